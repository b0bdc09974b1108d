"""`ddp-env`: the environment report, as the README shows the command, on this (GPU-less) machine."""

from __future__ import annotations

import shlex

import pytest

from launcher.machine.hardware import Gpu, Hardware
from launcher.machine.environment_report import report
from tests.conftest import ddp_launch
from tests.test_readme import readme_commands


@pytest.mark.parametrize("command", [c for c in readme_commands("ddp-env") if "--clear-cache" not in c])
def test_every_readme_ddp_env_command_prints_the_report(command, tmp_path):
    r = ddp_launch(shlex.split(command)[1:], cwd=tmp_path, tool="ddp-env", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    for section in ("versions:", "GPUs:", "GPU links:", "CPU and memory:", "SLURM:", "environment:"):
        assert f"\n{section}\n" in r.stdout, section
    assert "ultralytics     8.4.190" in r.stdout and "torch " in r.stdout and "CUDA build" in r.stdout
    assert "no GPU is visible" in r.stdout and "/dev/shm" in r.stdout


def test_the_report_names_each_gpu_and_says_why_links_are_missing(monkeypatch):
    monkeypatch.setattr("shutil.which", lambda tool: None)  # no nvidia-smi, no SLURM commands
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    gpus = tuple(Gpu(i, "NVIDIA H200", 139.8, f"GPU-{i}") for i in range(2))
    text = report(Hardware(gpus=gpus, cpu_count=32, driver="580.1"), with_torch=False)
    assert "cuda:0 NVIDIA H200, 140 GiB, GPU-0" in text and "cuda:1 NVIDIA H200" in text and "driver 580.1" in text
    assert "nvidia-smi is not on PATH" in text
    assert "none on PATH (launcher=slurm needs sbatch)" in text
    assert "NCCL_DEBUG=INFO" in text


@pytest.mark.parametrize("command", [c for c in readme_commands("ddp-env") if "--clear-cache" in c])
def test_the_readme_clear_cache_command_removes_unused_caches(command, tmp_path):
    """As the README shows it, for a paths.cache of its own: an unused cache file there is deleted, each folder
    reported (the /dev/shm folder's caches in use by running jobs are kept: they hold a lock)."""
    stale = tmp_path / "images" / "files-0123456789abcdef.bin"
    stale.parent.mkdir()
    stale.write_bytes(b"x" * 4096)
    r = ddp_launch(shlex.split(command)[1:], cwd=tmp_path, tool="ddp-env", timeout=120,
                   env={"DDP_LAUNCH_CACHE": str(tmp_path)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert not stale.exists() and f"{tmp_path / 'images'}: removed 1 cache file(s)" in r.stdout


@pytest.mark.parametrize("version_py,nccl", [
    ("cuda: Optional[str] = '13.0'\nhip: Optional[str] = None\n", True),
    ("cuda: Optional[str] = None\nhip: Optional[str] = '6.2.4'\n", True),  # ROCm: RCCL under the nccl backend
    ("cuda: Optional[str] = None\nhip: Optional[str] = None\n", False),  # a CPU build of torch
], ids=["cuda", "rocm", "cpu"])
def test_nccl_is_read_off_torchs_build_without_importing_torch(tmp_path, monkeypatch, version_py, nccl):
    """Planning on a GPU node must not import torch (seconds on the critical path before torchrun starts)."""
    import importlib.machinery
    import importlib.util
    import sys

    from launcher.machine import hardware

    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "version.py").write_text(version_py)
    spec = importlib.machinery.ModuleSpec("torch", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path / "torch")]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec if name == "torch" else None)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.delitem(sys.modules, "torch.distributed", raising=False)
    assert hardware._nccl_available() is nccl
    assert "torch.distributed" not in sys.modules

"""The environment report (`ddp-env`, and env.txt in every run folder): what a bug report about a distributed run
needs, in one place -- library versions, the GPUs and how they are linked, cores, memory, /dev/shm, SLURM.

Every probe fails soft: a report is most needed on a machine where something is missing, so a probe that cannot run
says why on its own line instead of ending the report.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

from launcher.inputs.ultralytics_files import window_status
from launcher.machine.hardware import Hardware, detect, torch_builds, usable_cpu_count

PACKAGES = ("ddp-launch", "torch", "torchvision", "triton", "ultralytics", "hydra-core", "omegaconf", "nvidia-ml-py", "numpy",
            "opencv-python", "opencv-python-headless", "pillow", "psutil")
ENV_PREFIXES = ("CUDA_", "NCCL_", "TORCH_", "SLURM_JOB", "SLURM_NNODES", "SLURM_NTASKS", "OMP_NUM_THREADS")


def report(hw: Hardware | None = None, *, with_torch: bool = True) -> str:
    """The report as text. `with_torch=False` leaves out what needs torch imported (CUDA, cuDNN, NCCL builds)."""
    hw = hw if hw is not None else detect()
    sections = [
        ("versions", _versions(with_torch)),
        ("GPUs", _gpus(hw)),
        ("GPU links", _links(hw)),
        ("CPU and memory", _cpu_memory()),
        ("SLURM", _slurm()),
        ("environment", _variables()),
    ]
    lines = ["ddp-env: the environment of this node"]
    for title, body in sections:
        lines += ["", f"{title}:", *(f"  {line}" for line in body)]
    return "\n".join(lines) + "\n"


def version_lines() -> list[str]:
    """`ddp-launch --version`: its own release, Ultralytics', torch's and the CUDA torch was built for, read from the
    packages' metadata and torch/version.py (importing torch would take seconds)."""
    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return [f"ddp-launch {version('ddp-launch')}", f"ultralytics {version('ultralytics')}",
            f"torch {version('torch')} (CUDA {torch_builds().get('cuda') or 'none: a CPU build'})",
            f"python {platform.python_version()}"]


def _versions(with_torch: bool) -> list[str]:
    out = [f"python          {platform.python_version()} ({sys.executable})", f"platform        {platform.platform()}"]
    for name in PACKAGES:
        try:
            found = importlib.metadata.version(name)
            out.append(f"{name:<15} {found}" + (f" ({window_status(found)})" if name == "ultralytics" else ""))
        except importlib.metadata.PackageNotFoundError:
            if not name.startswith("opencv"):  # one of the two OpenCV wheels is expected to be absent
                out.append(f"{name:<15} not installed")
    if with_torch:
        out += _torch_builds()
    return out


def _torch_builds() -> list[str]:
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - a broken torch is what the report is for
        return [f"torch builds    unavailable ({type(e).__name__}: {e})"]
    nccl = "none"
    if torch.cuda.is_available() and torch.distributed.is_available() and torch.distributed.is_nccl_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return [
        f"CUDA build      {torch.version.cuda or 'none (CPU build)'}",
        f"cuDNN           {cudnn or 'none'}",
        f"NCCL            {nccl}",
        f"gloo            {'yes' if torch.distributed.is_available() and torch.distributed.is_gloo_available() else 'no'}",
    ]


def _gpus(hw: Hardware) -> list[str]:
    if not hw.gpus:
        return [hw.describe_gpus()]
    return [f"driver {hw.driver or 'unknown'}"] + [
        f"cuda:{g.index} {g.name}, {g.memory_gib:.0f} GiB{', ' + g.uuid if g.uuid else ''}" for g in hw.gpus
    ]


def _links(hw: Hardware) -> list[str]:
    """nvidia-smi's topology matrix (NVLink, PCIe switches, NUMA affinity), where there are GPUs to link."""
    if len(hw.gpus) < 2:
        return ["one GPU or none: nothing to link"]
    if shutil.which("nvidia-smi") is None:
        return ["nvidia-smi is not on PATH: no topology matrix"]
    try:
        out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20, check=True)
    except (subprocess.SubprocessError, OSError) as e:
        return [f"nvidia-smi topo -m failed ({type(e).__name__})"]
    return out.stdout.rstrip().splitlines()


def _cpu_memory() -> list[str]:
    import psutil

    memory = psutil.virtual_memory()
    lines = [
        f"cores           {usable_cpu_count()} usable by this process (affinity), {os.cpu_count()} on the machine",
        f"memory          {memory.total / 2**30:.1f} GiB, {memory.available / 2**30:.1f} GiB available",
    ]
    shm = Path("/dev/shm")
    if shm.is_dir():
        usage = shutil.disk_usage(shm)
        lines.append(f"/dev/shm        {usage.total / 2**30:.1f} GiB, {usage.free / 2**30:.1f} GiB free "
                     "(DataLoader batches, NCCL and train.cache=shared use it)")
    else:
        lines.append("/dev/shm        absent (train.cache=shared falls back to disk)")
    return lines


def _slurm() -> list[str]:
    job = os.environ.get("SLURM_JOB_ID")
    tools = [t for t in ("sbatch", "srun", "sinfo") if shutil.which(t)]
    return [
        f"job             {job or 'none (not inside a SLURM job)'}",
        f"commands        {', '.join(tools) if tools else 'none on PATH (launcher=slurm needs sbatch)'}",
    ]


def _variables() -> list[str]:
    found = sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith(ENV_PREFIXES))
    return found or ["no CUDA_*, NCCL_*, TORCH_* or SLURM job variables set"]

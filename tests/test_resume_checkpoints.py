"""Bad checkpoints are found before any rank starts, and told by name: a last.pt that is truncated or another
model's falls back to an intact last.prev.pt with a line naming both; both bad is a refusal that points at an intact
best.pt; a truncated model.weights is refused naming the file."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from launcher.launch.resume_checkpoints import verdict
from launcher.rank.loop.checkpoint_io import RESUME_KEY, mismatch
from launcher.run_folder import RunFolder
from tests.conftest import TINY, ddp_launch

BASE = ["gpus=0", "nproc=1", "train.epochs=3", "loader.mosaic_buffer=false", *TINY]


def test_a_checkpoint_of_another_model_is_told_by_one_tensor():
    net = {"a.weight": torch.zeros(4, 3), "b.bias": torch.zeros(4)}
    assert mismatch(net, {k: v.clone() for k, v in net.items()}) is None
    assert "b.bias is [80] there, [4] in this run's network" in mismatch(net, {**net, "b.bias": torch.zeros(80)})
    assert "1 of the network's 2 tensors missing, 1 foreign" in mismatch(net, {"a.weight": net["a.weight"], "c": 1})


def test_the_verdict_falls_back_to_last_prev_or_refuses_naming_both_and_best(tmp_path):
    folder = RunFolder(tmp_path)
    w = folder.weights
    assert verdict(folder, {"last.pt": None, "last.prev.pt": "is unreadable (x)"}) == (None, [])
    assert verdict(folder, {}) == (None, [])  # nothing to resume from: the run starts at its first step
    line, problems = verdict(folder, {"last.pt": "is unreadable (EOF)", "last.prev.pt": None})
    assert not problems and line == (f"WARNING: {w / 'last.pt'} is unreadable (EOF); resuming from "
                                     f"{w / 'last.prev.pt'} instead (the checkpoint before it)")
    line, (problem,) = verdict(folder, {"last.pt": "is unreadable (EOF)", "last.prev.pt": "is another model's",
                                        "best.pt": None})
    assert line is None
    assert f"{w / 'last.pt'} is unreadable (EOF); {w / 'last.prev.pt'} is another model's" in problem.message
    assert f"{w / 'best.pt'} is intact: start a new run from it with model={w / 'best.pt'}" in problem.message
    _, (problem,) = verdict(folder, {"last.pt": "is unreadable", "best.pt": "is unreadable"})
    assert "there is no last.prev.pt" in problem.message and "best.pt is intact" not in problem.message


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, cache_dir) -> Path:
    """A run stopped in epoch 3 (SIGTERM: its checkpoint writes finish): last.pt, last.prev.pt and best.pt."""
    run = tmp_path_factory.mktemp("stopped") / "run"
    r = ddp_launch([*BASE, f"hydra.run.dir={run}"], cwd=run.parent, timeout=600,
                   env={"DDP_LAUNCH_FAULT": "rank=0,step=20,kind=sigterm"})  # stopped: its writes done
    assert r.returncode != 0 and (run / "weights" / "last.prev.pt").is_file(), r.stdout[-3000:] + r.stderr[-3000:]
    return run


def copy_of(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "run"))


@pytest.mark.slow
@pytest.mark.dist
def test_a_last_checkpoint_of_another_model_falls_back_to_the_previous_one_naming_both(stopped, tmp_path):
    run = copy_of(stopped, tmp_path)
    last, prev = run / "weights" / "last.pt", run / "weights" / "last.prev.pt"
    ckpt = torch.load(last, weights_only=False)
    state = ckpt[RESUME_KEY]["model"]
    key = next(k for k in state if k.endswith("cv3.0.2.weight"))  # the class head: what another dataset changes
    state[key] = torch.zeros(7, *state[key].shape[1:])
    torch.save(ckpt, last)
    r = ddp_launch([f"resume={run}"], cwd=tmp_path, timeout=600,
                   env={"DDP_LAUNCH_FAULT": "rank=0,step=10,kind=exit"})  # a step after resuming is enough to see
    assert f"WARNING: {last} is another model's: {key} is [7," in r.stdout
    assert f"resuming from {prev} instead" in r.stdout
    assert f"resuming from {prev} at epoch 3, step 1" in (run / "logs" / "rank0.log").read_text()


@pytest.mark.slow
@pytest.mark.dist
def test_both_last_checkpoints_corrupt_is_refused_in_the_plan_pointing_at_best(stopped, tmp_path):
    run = copy_of(stopped, tmp_path)
    for name in ("last.pt", "last.prev.pt"):
        f = run / "weights" / name
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
    logs_before = sorted(p.name for p in (run / "logs").iterdir())
    r = ddp_launch([f"resume={run}"], cwd=tmp_path, timeout=600)
    console = r.stdout + r.stderr
    assert r.returncode == 2 and "Traceback" not in console, console
    (line,) = [x for x in console.splitlines() if "no checkpoint to resume from" in x]
    assert str(run / "weights" / "last.pt") in line and str(run / "weights" / "last.prev.pt") in line
    assert f"model={run / 'weights' / 'best.pt'}" in line
    assert sorted(p.name for p in (run / "logs").iterdir()) == logs_before  # no rank started


@pytest.mark.slow
def test_a_truncated_model_weights_is_refused_naming_the_file(checkpoint, tmp_path, cache_dir):
    bad = tmp_path / "yolov8n.pt"
    bad.write_bytes(checkpoint.read_bytes()[:100_000])
    r = ddp_launch(["gpus=0", "nproc=1", f"model.weights={bad}", *TINY], cwd=tmp_path, timeout=600)
    console = r.stdout + r.stderr
    assert r.returncode == 2 and "Traceback" not in console, console
    assert f"model.weights={bad}: cannot be used to start from" in console
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("plan.json"))

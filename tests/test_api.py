"""The Python API (launcher/api.py): the README's snippet as written, and refusals as exceptions."""

from __future__ import annotations

import os
import re

import pytest

from launcher import api
from launcher.launch.startup import warm_torchrun
from launcher.problems import PlanError
from tests.conftest import REPO

SNIPPET = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)


@pytest.mark.slow
def test_the_readme_snippet_returns_the_plan_and_the_summary(tmp_path, cache_dir, monkeypatch, capsys):
    assert len(SNIPPET) == 1 and "from launcher import train" in SNIPPET[0]
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DDP_LAUNCH_WARM_START", raising=False)
    taken, real_take = [], warm_torchrun.WarmTorchrun.take

    def take(self, *args):
        taken.append(real_take(self, *args))
        return taken[-1]

    monkeypatch.setattr(warm_torchrun.WarmTorchrun, "take", take)
    scope: dict = {}
    exec(compile(SNIPPET[0], "README.md", "exec"), scope)  # noqa: S102 - the README's own code, as a user runs it
    assert len(taken) == 1 and taken[0] is not None  # the run's torchrun started before the config was composed
    plan, summary = scope["plan"], scope["summary"]
    assert plan["mode"] == "single" and plan["device"] == "cpu" and plan["global_batch"] == 16
    assert summary["status"] == "finished" and summary["epochs_completed"] == 1
    assert os.path.isfile(summary["weights"]) and str(tmp_path) in summary["weights"]
    assert "done: 1 epoch(s)" in capsys.readouterr().out  # the same output as the command's


def test_a_refused_plan_raises_with_the_commands_message(tmp_path, cache_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DDP_LAUNCH_WARM_START", raising=False)
    started, real_start = [], warm_torchrun.WarmTorchrun.start

    def start(self, *args):
        real_start(self, *args)
        started.append(self.proc)

    monkeypatch.setattr(warm_torchrun.WarmTorchrun, "start", start)
    with pytest.raises(PlanError, match="train.imgsz=65: must be a multiple of 32"):
        api.train(["train.imgsz=65"])
    assert not (tmp_path / "runs").exists()  # refused before anything was written
    assert len(started) == 1 and started[0].poll() is not None  # the torchrun started ahead is gone
    with pytest.raises(PlanError, match="not a ddp-launch run folder"):
        api.train(resume="/some/run")


def test_the_benchmark_plans_from_python(tmp_path, cache_dir, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert api.bench(["gpus=0", "bench.sizes=[1,2]", "bench.modes=[ddp]", "dry_run=true"]) is None
    out = capsys.readouterr().out
    assert "ddp-1" in out and "ddp-2" in out and "dry run: nothing started" in out

"""ddp-launch starts torchrun before it plans (launch/startup/warm_torchrun.py): the warm torchrun must run exactly the command
and environment a fresh one would have been given, and go away when no torchrun is needed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from launcher.launch.startup.warm_torchrun import WarmTorchrun, enabled, startup_environment, wanted
from tests.conftest import TINY


def test_the_warm_torchrun_runs_the_command_with_exactly_the_environment_given(tmp_path):
    out = tmp_path / "seen"
    warm = WarmTorchrun()
    warm.start()
    env = {k: v for k, v in os.environ.items() if k != "HOME"} | {"WARM_MARK": "planned", "PET_LOG_DIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "--no-python",
           "sh", "-c", f'echo "$WARM_MARK ${{HOME:-unset}} $LOCAL_RANK $WORLD_SIZE $(pwd)" > {out}']
    here = os.getcwd()
    os.chdir(tmp_path)  # the launcher moved (hydra.job.chdir=true) after the warm torchrun started
    try:
        proc = warm.take(cmd, env)
    finally:
        os.chdir(here)
    assert proc is not None and warm.take(cmd, env) is None  # taken once; a second launch starts its own
    assert proc.wait(timeout=120) == 0, proc.stderr.read().decode()[-3000:]
    # the plan's variables, none of the launcher's own; where the launcher is
    assert out.read_text().split() == ["planned", "unset", "0", "1", str(tmp_path)]


def test_a_command_that_is_not_this_pythons_torchrun_is_not_given_to_it():
    warm = WarmTorchrun()
    warm.start()
    proc = warm.proc
    assert warm.take(["/other/python", "-m", "torch.distributed.run", "--standalone"], dict(os.environ)) is None
    assert proc.poll() is not None  # stopped, not left idle


def test_an_unneeded_warm_torchrun_exits_and_info_commands_start_none(monkeypatch):
    warm = WarmTorchrun()
    warm.start()
    proc = warm.proc
    warm.discard()
    assert proc.poll() is not None and warm.proc is None
    assert wanted(["model=yolov8s", "gpus=2"]) and not wanted(["dry_run=true"]) and not wanted(["--cfg", "job"])
    assert not wanted(["launcher=slurm", "nnodes=2"])  # its torchrun runs in the job
    monkeypatch.delenv("DDP_LAUNCH_WARM_START", raising=False)
    assert enabled()  # the default
    monkeypatch.setenv("DDP_LAUNCH_WARM_START", "0")
    assert not enabled()


def test_a_warm_torchrun_started_with_other_python_variables_than_the_plans_is_not_used(tmp_path):
    """Python reads PYTHON* (the bytecode folder) as it starts: a warm torchrun started with other values than the
    plan's would run the ranks' torchrun differently (compiling torch again), so a fresh one is started instead."""
    warm = WarmTorchrun()
    warm.start({"PYTHONPYCACHEPREFIX": str(tmp_path / "guessed")})
    proc = warm.proc
    env = {**os.environ, "PYTHONPYCACHEPREFIX": str(tmp_path / "planned")}
    assert warm.take([sys.executable, "-m", "torch.distributed.run", "--standalone"], env) is None
    assert proc.poll() is not None


@pytest.mark.parametrize("overrides", [[], ["paths.cache=/data/cache"], ["paths.bytecode=/fast/pyc"],
                                       ["paths.bytecode=null"]], ids=["defaults", "cache", "folder", "off"])
def test_the_warm_torchruns_python_variables_are_the_plans_on_a_machine_whose_torch_keeps_no_bytecode(overrides):
    """The guess made before Hydra composes equals what the plan sets (the H200 machine's case: torch's install
    holds no bytecode, so the plan keeps it under the cache), so the warm torchrun is the one used; and so do the
    offline settings it starts with (tqdm, which it imports, reads TQDM_MININTERVAL as it loads)."""
    from dataclasses import replace
    from unittest import mock

    from launcher.plan.plan import make_plan
    from tests.conftest import compose_config
    from tests.test_plan import GPU_BOX

    plan, _ = make_plan(compose_config(["gpus=1", *overrides]), replace(GPU_BOX, bytecode_kept=False), None)
    with mock.patch("launcher.machine.hardware.bytecode_kept", return_value=False):
        guessed = startup_environment(["gpus=1", *overrides])
    planned = {k: v for k, v in plan.env.items() if k.startswith("PYTHON")}
    assert {k: v for k, v in guessed.items() if v and k.startswith("PYTHON")} == {k: v for k, v in planned.items() if v}
    assert {k: v for k, v in guessed.items() if not k.startswith("PYTHON")} == {  # the offline settings: rank_fork.py
        k: plan.env[k] for k in guessed if not k.startswith("PYTHON")}


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["dist.torch_debug=INFO"]], ids=["forked-ranks", "fresh-interpreters"])
def test_a_launch_runs_its_ranks_under_the_torchrun_it_started_before_planning(extra, tmp_path, cache_dir):
    """By default the torchrun that starts the ranks is the one ddp-launch started first thing (its imports overlapped
    the planning), and the run trains to its end through it, its ranks forked from it with torch imported
    (launch/startup/rank_fork.py); a toggle that torch reads as it loads (TORCH_DISTRIBUTED_DEBUG here) has it start fresh
    interpreters instead, and say why."""
    run = tmp_path / "run"
    exe = Path(sys.executable).parent / "ddp-launch"
    env = {k: v for k, v in os.environ.items() if k not in ("DDP_LAUNCH_WARM_START", "DDP_LAUNCH_FORK_RANKS")}
    proc = subprocess.Popen([str(exe) if exe.exists() else "ddp-launch", "gpus=0", "train.epochs=1", *TINY, *extra,
                             f"hydra.run.dir={run}"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    log, deadline = run / "logs" / "rank0.log", time.monotonic() + 300
    while not log.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    children = [" ".join(c.cmdline()) for c in psutil.Process(proc.pid).children()] if proc.poll() is None else []
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    assert any("-m launcher.launch.startup.warm_torchrun" in c for c in children), children
    header = log.read_text().splitlines()[0]
    if extra:
        assert "forked" not in header and "fresh interpreters: " in out and "TORCH_DISTRIBUTED_DEBUG" in out, out[-3000:]
    else:
        assert "forked from torchrun" in header and "fresh interpreters" not in out, (header, out[-3000:])

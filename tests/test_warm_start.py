"""ddp-launch starts torchrun before it plans (launch/warm_torchrun.py): the warm torchrun must run exactly the command
and environment a fresh one would have been given, and go away when no torchrun is needed."""

from __future__ import annotations

import os
import sys

from launcher.launch.warm_torchrun import WarmTorchrun, enabled, wanted


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
    monkeypatch.delenv("DDP_LAUNCH_WARM_START", raising=False)
    assert not enabled()  # opt-in (warm_torchrun.py says why)
    monkeypatch.setenv("DDP_LAUNCH_WARM_START", "1")
    assert enabled()

"""One trainer per run folder (launch/run_lock.py): a second launch or resume into a folder in use is refused with one
line naming the holder and leaves the folder as it was; a lock whose holder is gone is taken over with a line; a
requeued SLURM job takes over its own lock only; the lock goes on every exit, SIGTERM included."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.launch import run_lock, start
from launcher.launch.environments import local
from launcher.launch.run_lock import Holder, RunLock
from launcher.problems import PlanError
from tests.conftest import REPO, TINY, compose_config, ddp_launch
from tests.test_records import snapshot


@pytest.fixture()
def other_trainer():
    """A live process of this host, holding nothing but its pid: the trainer the test says holds a folder."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield proc
    proc.kill()
    proc.wait()


def held_by(folder: Path, pid: int, job: str | None = None, host: str | None = None) -> Holder:
    holder = Holder(host or socket.gethostname(), pid, run_lock.process_start(pid), time.time(), job)
    RunLock._write(folder / run_lock.LOCK_NAME, holder)
    return holder


@pytest.fixture()
def planned_run(tmp_path, cache_dir, monkeypatch) -> Path:
    """A run folder as a launch leaves it (its config, plan and data.yaml), started without ranks."""
    monkeypatch.setattr(local.LocalEnvironment, "start", lambda self, cfg, plan, folder: 0)
    assert start.start(compose_config(["gpus=0", *TINY]), tmp_path / "run", tmp_path) == 0
    assert not (tmp_path / "run" / run_lock.LOCK_NAME).exists()  # released when the launch ended
    return tmp_path / "run"


def test_a_resume_into_a_folder_in_use_is_refused_naming_the_holder_and_changes_nothing(
        planned_run, other_trainer, tmp_path):
    held_by(planned_run, other_trainer.pid)
    before = snapshot(planned_run)
    r = ddp_launch([f"resume={planned_run}", "nproc=1"], cwd=tmp_path, timeout=120)  # nproc=1 would write a new plan
    assert r.returncode == 2, r.stdout + r.stderr
    line = next(line for line in r.stderr.splitlines() if "is in use by another ddp-launch" in line)
    assert f"pid {other_trainer.pid} on {socket.gethostname()}, since " in line
    assert f"kill {other_trainer.pid}" in line and "Traceback" not in r.stderr
    assert snapshot(planned_run) == before


def test_a_second_new_launch_into_a_folder_being_started_writes_nothing_there(tmp_path, cache_dir, other_trainer,
                                                                              monkeypatch):
    monkeypatch.setattr(local.LocalEnvironment, "start", lambda *a: pytest.fail("the ranks were started"))
    (tmp_path / "run").mkdir()
    held_by(tmp_path / "run", other_trainer.pid)  # the first launch, between its lock and its plan.json
    before = snapshot(tmp_path / "run")
    with pytest.raises(PlanError, match="is in use by another ddp-launch"):
        start.start(compose_config(["gpus=0", *TINY]), tmp_path / "run", tmp_path)
    assert snapshot(tmp_path / "run") == before


def test_a_lock_whose_holder_is_gone_is_taken_over_with_a_line_and_released_at_the_end(planned_run, capsys,
                                                                                    monkeypatch):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    held_by(planned_run, gone.pid)  # a launcher killed outright (SIGKILL) leaves its lock
    resumed = []
    monkeypatch.setattr(local.LocalEnvironment, "resume",
                        lambda self, cfg, plan, folder: resumed.append(RunLock(folder.path).holder()) or 0)
    assert start.resume(planned_run, {}) == 0
    assert resumed[0].pid == os.getpid()  # held while the run runs
    assert f"taking over the lock of {planned_run} from the launch that held it (pid {gone.pid}" in capsys.readouterr().out
    assert not (planned_run / run_lock.LOCK_NAME).exists()


def test_a_reused_pid_is_not_taken_for_the_holder(tmp_path, other_trainer):
    holder = held_by(tmp_path, other_trainer.pid)
    assert not holder.gone()
    assert Holder(holder.host, holder.pid, "1", holder.since).gone()  # that pid now runs another process


def test_a_requeued_slurm_job_takes_over_its_own_lock_only(tmp_path, monkeypatch):
    held_by(tmp_path, 4242, job="77", host="node-a")  # the job's last run, on another node
    monkeypatch.setattr(run_lock, "slurm_job_ended", lambda job: False)  # SLURM lists job 77
    monkeypatch.setenv("SLURM_JOB_ID", "78")
    with pytest.raises(PlanError) as e:
        RunLock(tmp_path).acquire()
    assert "SLURM job 77" in str(e.value) and "scancel 77" in str(e.value)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    me = RunLock(tmp_path).acquire()
    assert RunLock(tmp_path).holder() == me and me.slurm_job_id == "77"
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.setattr(run_lock, "slurm_job_ended", lambda job: True)  # cancelled: a resume by hand may take it
    held_by(tmp_path, 4242, job="77", host="node-a")
    assert RunLock(tmp_path).acquire().pid == os.getpid()


HOLD = """
import sys, time
from pathlib import Path
from launcher.launch.run_lock import RunLock
with RunLock(Path(sys.argv[1])).held():
    print("held", flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_the_lock_goes_when_the_launcher_is_stopped(tmp_path, signum):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)},
                            preexec_fn=lambda: [signal.signal(s, signal.SIG_DFL) for s in (signal.SIGINT, signal.SIGTERM)])
    assert proc.stdout.readline().strip() == "held" and (tmp_path / run_lock.LOCK_NAME).exists()
    proc.send_signal(signum)
    proc.wait(timeout=30)
    assert not (tmp_path / run_lock.LOCK_NAME).exists()

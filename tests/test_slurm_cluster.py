"""launcher=slurm against a real SLURM cluster: sbatch reads the hostile directives exactly, a 2-rank gloo run trains
to the end, a finished run submitted again is done, and a signalled job checkpoints, requeues and resumes.

CI runs these on the single-node cluster of slurm/local-cluster.sh (.ci/run starts it and sets
DDP_LAUNCH_REQUIRE_SLURM=1, which turns a missing cluster into a failure). Elsewhere they skip without one.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from launcher.launch.environments import slurm
from launcher.plan.plan import make_plan
from tests.conftest import TINY, compose_config, ddp_launch
from tests.test_readme import readme_commands

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

LOCAL_CLUSTER_CONF = Path(os.environ.get("DDP_LAUNCH_SLURM_DIR", "/tmp/ddp-launch-slurm")) / "slurm.conf"
TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
HOSTILE = "it's \"x\"; $(touch PWNED) `id` #1 %j"


def _unavailable(reason: str):
    if os.environ.get("DDP_LAUNCH_REQUIRE_SLURM"):
        pytest.fail(f"{reason} (DDP_LAUNCH_REQUIRE_SLURM is set: .ci/run starts slurm/local-cluster.sh)")
    pytest.skip(f"{reason}; start one with `slurm/local-cluster.sh start` (root, Debian packages)")


SUBMITTED: list[str] = []  # every job these tests submit; cancelled at the end, so a failed test leaves none queued


@pytest.fixture(scope="module")
def cluster():
    """The environment that reaches the cluster: SLURM_CONF as given, else the local cluster's."""
    if shutil.which("sinfo") is None:
        _unavailable("no SLURM client here (sinfo is not on PATH)")
    env = {}
    if "SLURM_CONF" not in os.environ and LOCAL_CLUSTER_CONF.is_file():
        env["SLURM_CONF"] = str(LOCAL_CLUSTER_CONF)
    try:  # sinfo retries for a minute when it finds no config: a cluster that is up answers at once
        states = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, env={**os.environ, **env}, timeout=15)
    except subprocess.TimeoutExpired:
        _unavailable("no SLURM cluster answered sinfo within 15 s")
    if states.returncode != 0 or not any(s.startswith(("idle", "mixed", "alloc")) for s in states.stdout.split()):
        _unavailable(f"no SLURM cluster answers (sinfo: {states.stdout.strip() or states.stderr.strip()})")
    yield env
    if SUBMITTED:
        subprocess.run(["scancel", *SUBMITTED], capture_output=True, env={**os.environ, **env})


def sbatch(script: Path, cluster: dict) -> str:
    job_id = slurm_cmd(["sbatch", "--parsable", str(script)], cluster).stdout.strip().split(";")[0]
    SUBMITTED.append(job_id)
    return job_id


def slurm_cmd(args: list[str], cluster: dict, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, env={**os.environ, **cluster}, check=check)


def job_field(job_id: str, field: str, cluster: dict) -> str:
    """One field of `scontrol show job` (the rest of its line for JobName and StdOut, which may hold blanks)."""
    text = slurm_cmd(["scontrol", "show", "job", job_id], cluster).stdout
    rest_of_line = field in ("JobName", "StdOut", "Comment")
    m = re.search(rf"\b{field}=(.*)$" if rest_of_line else rf"\b{field}=(\S+)", text, re.M)
    assert m, f"no {field} in:\n{text}"
    return m.group(1)


def wait_for_job(job_id: str, cluster: dict, log: Path, timeout: float) -> str:
    """Wait until the job has ended for good (a requeued job passes through PENDING again). Returns its state."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        state = job_field(job_id, "JobState", cluster)
        if state in TERMINAL_STATES:
            return state
        time.sleep(2)
    slurm_cmd(["scancel", job_id], cluster, check=False)
    tail = log.read_text()[-4000:] if log.exists() else "(no job log)"
    pytest.fail(f"job {job_id} still {state} after {timeout:.0f} s; cancelled. Job log:\n{tail}")


# The README's local-cluster command, run as written apart from the epochs, TINY's sizes and the run folder.
README_JOB = next(c for c in readme_commands("ddp-launch") if c.startswith("ddp-launch launcher=slurm gpus=0"))


def submit(tmp_path: Path, cluster: dict, epochs: int, more: tuple[str, ...] = ()) -> tuple[str, Path]:
    run_dir = tmp_path / "run"
    args = [a for a in shlex.split(README_JOB)[1:] if not a.startswith("train.epochs=")]
    args += ["slurm.job_name=ddp-launch-test", f"train.epochs={epochs}", *TINY, *more, f"hydra.run.dir={run_dir}"]
    result = ddp_launch(args, tmp_path, timeout=300, env=cluster)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    m = re.search(r"^submitted SLURM job (\d+)", result.stdout, re.M)
    assert m, result.stdout
    SUBMITTED.append(m.group(1))
    assert f"job log     {run_dir / 'slurm.out'}" in result.stdout
    return m.group(1), run_dir


def completed_epochs(rank_log: str) -> list[int]:
    """Epochs whose last step rank 0 logged, in order (every epoch end is logged)."""
    return [int(e) for e, step, nb in re.findall(r"\[rank 0\] epoch (\d+)/\d+ step (\d+)/(\d+)", rank_log) if step == nb]


# --- sbatch reads what ddp-launch wrote ---------------------------------------------------------------------------
def test_hostile_values_reach_sbatch_srun_and_the_job_exactly(tmp_path, cluster):
    """A real job from a script with a hostile job name, comment and run folder; a stand-in Python records its argv."""
    cfg = compose_config(["launcher=slurm", "gpus=0", "slurm.cpus_per_task=1", "slurm.signal=null"])
    cfg["slurm"].update(job_name=HOSTILE, extra=["--comment=" + HOSTILE])
    cfg = slurm.planning_config(cfg)
    plan, _ = make_plan(cfg, slurm.allocation_hardware(cfg))
    run_dir = tmp_path / HOSTILE
    run_dir.mkdir()
    argv_file = tmp_path / "argv"
    stand_in = tmp_path / "python"
    stand_in.write_text(f'#!/bin/bash\nprintf "%s\\0" "$@" > {argv_file}\n')
    stand_in.chmod(0o755)
    script = tmp_path / "job.sbatch"
    script.write_text(slurm.sbatch_script(cfg["slurm"], plan, run_dir, {"YOLO_OFFLINE": "1"}, str(stand_in)))
    job_id = sbatch(script, cluster)
    assert wait_for_job(job_id, cluster, run_dir / "slurm.out", timeout=120) == "COMPLETED"
    assert job_field(job_id, "JobName", cluster) == HOSTILE
    assert job_field(job_id, "Comment", cluster).rstrip(" ") == HOSTILE  # scontrol pads this line with a blank
    assert (run_dir / "slurm.out").is_file()  # --output: the folder's % and #, quotes and blanks, read literally
    assert argv_file.read_text().split("\0")[:-1] == ["-m", "launcher.launch.environments.slurm_job", str(run_dir)]
    assert not list(tmp_path.rglob("PWNED"))


# --- a real submission ------------------------------------------------------------------------------------------------
EPOCHS = 2


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, cluster, cache_dir):
    tmp_path = tmp_path_factory.mktemp("slurm-run")
    start = time.time()
    # the ranks' bytecode in a folder of its own, as where torch's install holds none: the node compiles it ahead
    job_id, run_dir = submit(tmp_path, cluster, EPOCHS, (f"paths.bytecode={tmp_path / 'bytecode'}",))
    state = wait_for_job(job_id, cluster, run_dir / "slurm.out", timeout=600)
    print(f"slurm job {job_id}: {state} in {time.time() - start:.0f} s")
    return job_id, run_dir, state


def test_a_submitted_two_rank_run_trains_to_the_end(finished_run, cluster):
    job_id, run_dir, state = finished_run
    log = (run_dir / "slurm.out").read_text()
    assert state == "COMPLETED", log[-4000:]
    assert job_field(job_id, "ExitCode", cluster) == "0:0"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished"
    assert (summary["epochs_completed"], summary["world_size"], summary["backend"]) == (EPOCHS, 2, "gloo")
    assert "SLURM_RESTART_COUNT=0" in log and f"done: {EPOCHS} epoch(s) on 2 rank(s)" in log  # rank 0 and the result
    rank_log = (run_dir / "logs" / "rank0.log").read_text()
    assert completed_epochs(rank_log) == [1, 2]
    assert f"compiling the ranks' bytecode into {run_dir.parent / 'bytecode'} beside their start" in log
    # torchrun started first thing in the job, its ranks forked from it (launch/startup/rank_fork.py), as in a local launch
    assert "forked from torchrun" in rank_log.splitlines()[0] and "fresh interpreters" not in log, rank_log[:500]


def test_a_finished_run_submitted_again_is_done_not_an_error(finished_run, cluster):
    _, run_dir, _ = finished_run
    before = (run_dir / "summary.json").read_text()
    job_id = sbatch(run_dir / "job.sbatch", cluster)
    assert wait_for_job(job_id, cluster, run_dir / "slurm.out", timeout=300) == "COMPLETED"
    assert job_field(job_id, "ExitCode", cluster) == "0:0"
    assert "already holds a finished run" in (run_dir / "slurm.out").read_text()
    assert (run_dir / "summary.json").read_text() == before


# --- preemption: signal, checkpoint, requeue, resume --------------------------------------------------------------------
# 8 steps per epoch, signalled at step 2 of epoch 2: the stop lands mid-epoch, well before the epoch's last step.
REQUEUE_EPOCHS, REQUEUE_DATA = 3, ("data.synthetic.train_images=128",)


def test_a_signalled_job_checkpoints_requeues_and_resumes_to_the_configured_epochs(tmp_path, cluster, cache_dir):
    start = time.time()
    job_id, run_dir = submit(tmp_path, cluster, REQUEUE_EPOCHS, REQUEUE_DATA)
    rank_log, job_log = run_dir / "logs" / "rank0.log", run_dir / "slurm.out"
    deadline = time.time() + 300
    while not (rank_log.exists() and re.search(r"\[rank 0\] epoch 2/", rank_log.read_text())):
        assert time.time() < deadline, "training did not reach epoch 2 in 300 s:\n" + (job_log.read_text()[-3000:] if job_log.exists() else "")
        time.sleep(0.5)
    # What SLURM does ahead of the time limit (sbatch --signal=USR1@90): USR1 to every process of the job's steps.
    signalled = time.time()
    slurm_cmd(["scancel", "--signal=USR1", job_id], cluster)
    while f"requeueing job {job_id}" not in job_log.read_text():
        assert time.time() < signalled + 120, "no requeue 120 s after the signal:\n" + job_log.read_text()[-3000:]
        time.sleep(0.2)
    # torchrun has ended before node 0 requeues, and the job restarts ~20 s later: this checkpoint is the stop's own.
    assert (run_dir / "weights" / "last.pt").stat().st_mtime >= signalled, "no checkpoint written on the signal"

    state = wait_for_job(job_id, cluster, job_log, timeout=600)
    print(f"slurm job {job_id}: {state} in {time.time() - start:.0f} s, {time.time() - signalled:.0f} s after the signal")
    log = job_log.read_text()
    assert state == "COMPLETED", log[-4000:]
    assert job_field(job_id, "Restarts", cluster) == "1" and job_field(job_id, "ExitCode", cluster) == "0:0"
    assert "got SIGUSR1" in log
    assert "SLURM_RESTART_COUNT=1" in log and "resuming from weights/last.pt" in log

    attempts = re.split(r"^(?:\[detail\] )?==== rank 0/2 .*$", rank_log.read_text(), flags=re.M)[1:]
    assert len(attempts) == 2, "rank 0 should have started twice (before and after the requeue)"
    assert rank_log.read_text().count("forked from torchrun ====") == 2  # USR1 reached the forked ranks ignored
    first, second = completed_epochs(attempts[0]), completed_epochs(attempts[1])
    assert first and first[-1] < REQUEUE_EPOCHS  # stopped mid-training
    assert 1 not in second  # resumed from the checkpoint, not from epoch 1
    # Every epoch ended once (its log line, its row in results.csv), also the one the signal stopped in.
    assert first + second == list(range(1, REQUEUE_EPOCHS + 1)), f"epoch ends logged: {first} then {second}"
    with open(run_dir / "results.csv", newline="") as f:
        rows = [int(float(r["epoch"])) for r in csv.DictReader(f)]
    assert rows == list(range(1, REQUEUE_EPOCHS + 1))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished"
    assert summary["epochs_completed"] == summary["epochs"] == REQUEUE_EPOCHS

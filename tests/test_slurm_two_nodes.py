"""Two nodes of one SLURM job, played on this machine: two `python -m launcher.job RUN_DIR` processes with the SLURM
environment each node would get (SLURM_NODEID 0 and 1), meeting at node 0's c10d rendezvous on the job's port and
training one 2-rank gloo run; node 0 alone is refused in one line within dist.timeout_s. No cluster is needed; a
stand-in `scontrol` expands the node list."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from launcher.launch.environments import slurm_job as job
from launcher.machine.ports import port_is_free
from tests.conftest import TINY, ddp_launch

pytestmark = [pytest.mark.slow, pytest.mark.dist]


def planned_job(tmp_path, *more: str) -> tuple:
    """A two-node run planned for SLURM (not submitted), a job id whose port is free here, and the environment srun
    gives a node of it (less SLURM_NODEID)."""
    run_dir = tmp_path / "run"
    args = ["launcher=slurm", "slurm.nodes=2", "gpus=0", "nproc=1", "slurm.submit=false", "train.epochs=1", *TINY]
    result = ddp_launch([*args, *more, f"hydra.run.dir={run_dir}"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr

    job_id = next(i for i in range(424242, 434242) if port_is_free(job.rendezvous_port(i)))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\n[ \"$1 $2\" = 'show hostnames' ] && echo localhost\n")
    (bin_dir / "scontrol").chmod(0o755)
    return run_dir, job_id, {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": str(job_id),
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_RESTART_COUNT": "0",
        "OMP_NUM_THREADS": "1",
    }


def test_two_nodes_meet_at_node_0s_rendezvous_and_train_together(tmp_path, cache_dir):
    run_dir, job_id, env = planned_job(tmp_path)
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "launcher.launch.environments.slurm_job", str(run_dir)],
            env={**env, "SLURM_NODEID": str(n)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for n in (1, 0)  # node 1 first: it waits for node 0's store
    ]
    outputs = [p.communicate(timeout=600)[0] for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], "\n\n".join(o[-3000:] for o in outputs)
    node1, node0 = outputs
    assert f"--rdzv-endpoint localhost:{job.rendezvous_port(job_id)} --rdzv-conf is_host=1" in node0
    assert "is_host=0" in node1 and "done: 1 epoch(s) on 2 rank(s)" in node0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["world_size"], summary["epochs_completed"]) == ("finished", 2, 1)
    assert summary["ranks_params_identical"] is True


def test_node_0_of_a_job_whose_other_node_never_starts_is_refused_in_one_line_within_dist_timeout_s(
        tmp_path, cache_dir):
    run_dir, job_id, env = planned_job(tmp_path, "dist.timeout_s=3")
    started = time.monotonic()
    node0 = subprocess.run([sys.executable, "-m", job.JOB_MODULE, str(run_dir)], env={**env, "SLURM_NODEID": "0"},
                           capture_output=True, text=True, timeout=120)
    took, log = time.monotonic() - started, node0.stdout + node0.stderr  # the job's log holds both
    at = f"localhost:{job.rendezvous_port(job_id)}"
    assert node0.returncode == 2, log
    assert f"waiting for node 1 of 2 at {at} (at most dist.timeout_s=3 s)" in log
    refusals = [line for line in log.splitlines() if f"refused: node 1 of 2 did not join at {at}" in line]
    assert len(refusals) == 1 and "Traceback" not in log and "RendezvousTimeoutError" not in log, log
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "refused" and summary["detail"] in refusals[0]
    assert took < 60, took  # the job's start and 3 s, not c10d's own 600 s


def test_a_node_whose_node_0_never_starts_is_refused_in_one_line_within_dist_timeout_s(tmp_path, cache_dir):
    """Node 1 of a job whose node 0 never starts: it tries node 0's store for dist.timeout_s (not c10d's own 60 s),
    then says so in one line and exits 2, without torchrun's traceback."""
    run_dir, job_id, env = planned_job(tmp_path, "dist.timeout_s=3")
    started = time.monotonic()
    node1 = subprocess.run([sys.executable, "-m", job.JOB_MODULE, str(run_dir)], env={**env, "SLURM_NODEID": "1"},
                           capture_output=True, text=True, timeout=120)
    took, log = time.monotonic() - started, node1.stdout + node1.stderr
    at = f"localhost:{job.rendezvous_port(job_id)}"
    assert node1.returncode == 2, log
    assert f"node 1 of 2: waiting for node 0 at {at} (at most dist.timeout_s=3 s)" in log
    refusals = [line for line in log.splitlines() if f"refused: node 0 of 2 did not answer at {at}" in line]
    assert len(refusals) == 1 and "Traceback" not in log and "inner exception" not in log, log
    assert took < 45, took  # the job's start and 3 s, not c10d's own 60 s

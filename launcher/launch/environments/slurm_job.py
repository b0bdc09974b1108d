"""Inside a SLURM job, on every node: `python -m launcher.launch.environments.slurm_job RUN_DIR` (the one task
job.sbatch starts per node).

It derives this node's torchrun command from the SLURM environment (`node_torchrun_command`, pure), runs it, and
decides what the job does when torchrun ends (`decide`, pure):

* the run finished (RUN_DIR/summary.json says so): exit 0, also when a restarted job finds it already done;
* a signal arrived (the time-limit warning, preemption) and slurm.requeue is on: the ranks have checkpointed to
  RUN_DIR/weights/last.pt; node 0 runs `scontrol requeue`, every node exits 0; the restarted job runs this module
  again and the ranks resume from the checkpoint;
* otherwise torchrun's exit code.

Where the ranks keep their bytecode in the cache (paths.bytecode) and this node has not compiled it yet, its
compilation starts beside torchrun, as in a local launch (launch/startup/bytecode.py). torchrun itself starts first
thing, with the job's environment (job.sbatch exports the plan's), and its ranks are forked from it, as in a local
launch (launch/startup/warm_torchrun.py, rank_fork.py; DDP_LAUNCH_WARM_START=0 and DDP_LAUNCH_FORK_RANKS=0 turn
them off).

Signal path: SLURM delivers `--signal` (and `scancel --signal`) to every process of the job step, torchrun and the
ranks included, and torchrun dies of SIGUSR1 (it has no handler). So this launcher starts torchrun with SIGUSR1
ignored (from this module's start, so that the warm torchrun and the ranks forked from it have it too), a disposition
that survives exec and passes down to the ranks; the launcher alone acts on it and forwards
SIGTERM to torchrun (launch/torchrun.py, run_torchrun), which stops the ranks; they checkpoint and exit.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

from launcher.launch import torchrun
from launcher.launch.startup import bytecode, warm_torchrun
from launcher.launch.logs import say as _say
from launcher.launch.logs import QuietStop, verbose_console
from launcher.launch.outcome import report
from launcher.launch.startup.parent_death import parent_death_signal
from launcher.launch.run_lock import RunLock
from launcher.machine.hardware import usable_cpu_count
from launcher.plan.plan import LaunchPlan
from launcher.problems import PlanError
from launcher.run_folder import RunFolder

JOB_MODULE = "launcher.launch.environments.slurm_job"
LOCK_HANDOVER_S = 60  # how long node 0 waits for the run folder's lock: the submitter holds it until sbatch returns

# A multi-node rendezvous port derived from the job id: every node computes the same one without talking, it stays
# the same when the job is requeued, and two jobs whose first node is the same host collide only when their ids are
# equal modulo the span. The range lies below Linux's ephemeral ports (32768-60999), which the kernel hands out to
# outgoing connections, and above the well-known services.
RDZV_PORT_BASE = 20000
RDZV_PORT_SPAN = 10000


def rendezvous_port(job_id: int) -> int:
    return RDZV_PORT_BASE + job_id % RDZV_PORT_SPAN


def rendezvous_endpoint(first_host: str, job_id: str, port: int | None) -> str:
    """Where a multi-node job's rendezvous is: the allocation's first host, at `port` or the job's own."""
    return f"{first_host}:{port or rendezvous_port(int(job_id))}"


def job_rendezvous_wait(plan: LaunchPlan, node_id: int, endpoint: str, job_id: str) -> tuple[str, str] | None:
    """For a node of a multi-node job: the line that says what it waits for at the rendezvous, and the one-line
    refusal when the other nodes have not come within dist.timeout_s (the c10d join timeout). None for one node."""
    if plan.nnodes < 2:
        return None
    return torchrun.waiting_lines(node_id, plan.nnodes, endpoint, plan.timeout_s,
                                  join_advice=f"see `sacct -j {job_id}` for the node that did not start",
                                  answer_advice=f"node 0 serves it; see `sacct -j {job_id}`")


def node_torchrun_command(
    plan: LaunchPlan,
    run_dir: Path,
    slurm_env: dict[str, str],
    first_host: str,
    port: int | None = None,
    python: str | None = None,
) -> list[str]:
    """The torchrun command for one node of the job.

    One node: c10d on localhost:0 (the kernel picks the port; jobs sharing a node never clash). Several nodes: c10d
    on the allocation's first host, at `port` (dist.master_port when set) or the job's own port, joined within
    dist.timeout_s (c10d's `join_timeout`, 600 s otherwise; and its `read_timeout`, 60 s otherwise: how long a node
    tries to reach node 0's store before it gives up). Node 0
    (SLURM_NODEID, the first host of the node list) serves the rendezvous store and says so (`is_host`) rather than
    leaving torchrun to recognise its own host name, which fails where a node's name and its host name differ. The
    rendezvous, not the node id, then numbers the ranks.
    """
    nnodes = int(slurm_env["SLURM_NNODES"])
    if nnodes != plan.nnodes:
        raise ValueError(
            f"the job has {nnodes} node(s) but the run was planned for {plan.nnodes} (slurm.nodes); "
            "submit job.sbatch without changing --nodes"
        )
    job_id = slurm_env["SLURM_JOB_ID"]
    if nnodes == 1:
        endpoint = ["--rdzv-endpoint", "localhost:0"]
    else:
        is_host = int(slurm_env["SLURM_NODEID"]) == 0
        endpoint = [
            "--rdzv-endpoint", rendezvous_endpoint(first_host, job_id, port),
            "--rdzv-conf", f"is_host={int(is_host)},join_timeout={plan.timeout_s},read_timeout={plan.timeout_s}",
        ]  # fmt: skip
    rendezvous = ["--rdzv-backend", "c10d", *endpoint, "--rdzv-id", job_id]
    return torchrun.torchrun_command(plan, run_dir, rendezvous, nnodes=nnodes, python=python)


def decide(code: int, signum: int | None, finished: bool, node_id: int, requeue: bool) -> tuple[str, int]:
    """(what to do, exit code) once torchrun has ended: done | requeue | stopped | failed."""
    if finished:
        return "done", 0
    if signum is not None and requeue:
        return ("requeue", 0) if node_id == 0 else ("stopped", 0)
    if code == 0:
        return "done", 0  # a node other than node 0 whose ranks finished; rank 0 writes the summary
    return "failed", code


def first_host(nodelist: str) -> str:
    """The allocation's first host, as `scontrol show hostnames` expands SLURM_JOB_NODELIST."""
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    return out.stdout.split()[0]


def say(msg: str) -> None:
    _say(msg, prefix="ddp-launch job: ")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(f"usage: python -m {JOB_MODULE} RUN_DIR (started on every node by RUN_DIR/job.sbatch)", file=sys.stderr)
        return 2
    # Ignored here, so ignored in torchrun and the ranks (SIG_IGN survives exec and fork); run_torchrun then installs
    # the launcher's own handler. NOTE: a USR1 in the instant between the two is lost; SLURM's warning comes once.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    if warm_torchrun.enabled():
        warm_torchrun.warm.start({}, parent_death_signal())  # its imports overlap reading the plan
    try:
        return _run(argv[0])
    finally:
        warm_torchrun.warm.discard()  # when no torchrun was needed (a finished run, a bad plan); else a no-op


def _run(run_dir_arg: str) -> int:
    folder = RunFolder(Path(run_dir_arg).resolve())
    run_dir = folder.path
    env = dict(os.environ)
    job_id, node_id = env.get("SLURM_JOB_ID", "?"), int(env.get("SLURM_NODEID", "0"))
    restarts = env.get("SLURM_RESTART_COUNT", "0")
    nnodes, host_name = env.get("SLURM_NNODES", "?"), socket.gethostname()
    say(f"job {job_id} node {node_id} of {nnodes} on {host_name}, SLURM_RESTART_COUNT={restarts}")

    if folder.finished():
        say(f"{run_dir} already holds a finished run (summary.json); nothing to do")
        return 0
    if (folder.weights / "last.pt").is_file():
        say("resuming from weights/last.pt")
    try:
        cfg, plan = folder.load()
    except PlanError as e:
        say(str(e))
        return 2
    port = cfg["dist"]["master_port"] if isinstance(cfg["dist"].get("master_port"), int) else None
    host = first_host(env["SLURM_JOB_NODELIST"]) if plan.nnodes > 1 else "localhost"
    try:
        cmd = node_torchrun_command(plan, run_dir, env, host, port)
    except ValueError as e:
        say(str(e))
        return 2
    say("torchrun: " + " ".join(shlex.quote(c) for c in cmd))

    try:
        # node 0 holds the folder; the submitting ddp-launch hands its lock to the job as soon as sbatch answers
        with RunLock(run_dir).held(wait_s=LOCK_HANDOVER_S) if node_id == 0 else contextlib.nullcontext():
            wait = job_rendezvous_wait(plan, node_id, rendezvous_endpoint(host, job_id, port), job_id)
            code, signum, refused = _node_torchrun(folder, cmd, plan, cfg, node_id, wait)
    except PlanError as e:
        say(str(e))
        return 2
    if refused and signum is None:  # a node that never joined: the refusal is said; node 0 records it
        if node_id == 0:
            folder.write_outcome("refused", torchrun.EXIT_NOT_JOINED, wait[1])
        return torchrun.EXIT_NOT_JOINED

    action, exit_code = decide(code, signum, folder.finished(), node_id, bool(cfg["slurm"]["requeue"]))
    if action == "requeue":
        say(f"stopped by {signal.Signals(signum).name}; requeueing job {job_id}, which resumes from weights/last.pt")
        result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
        if result.returncode != 0:
            say(f"scontrol requeue failed: {result.stderr.strip()}")
            return 1
        return 0
    if action == "stopped":
        say(f"stopped by {signal.Signals(signum).name}; node 0 requeues the job")
        return exit_code
    if node_id != 0:
        if action == "failed":
            say(f"torchrun ended with exit code {code}")
        return exit_code
    # Node 0 ends as a local run does: the result, or what went wrong (which also goes into summary.json).
    reported = report(folder, code, signum, 0)
    return reported if action == "done" else exit_code


def _node_torchrun(folder: RunFolder, cmd: list[str], plan: LaunchPlan, cfg: dict, node_id: int,
                   wait: tuple[str, str] | None):
    """This node's torchrun, to its end: (exit code, the signal that stopped it or None, whether the rendezvous
    timed out: `wait` (job_rendezvous_wait) says what it waits for, and its refusal replaces torchrun's traceback)."""
    logs = [folder.rank_log(0)] if node_id == 0 else []  # the job log follows rank 0, wherever it runs
    compiling = bytecode.start_for(plan.env, usable_cpu_count(), parent_death_signal())
    if compiling is not None:
        say(compiling[1])
    if wait:
        say(wait[0])
    stderr = QuietStop(sys.stderr, rendezvous_refusal=wait[1] if wait else None)
    code, signum = torchrun.run_torchrun(cmd, {}, logs, prefix=False, verbose=verbose_console(cfg),
                                         stderr_filter=stderr)
    return code, signum, stderr.refused


if __name__ == "__main__":
    sys.exit(main())

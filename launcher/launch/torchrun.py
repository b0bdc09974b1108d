"""torchrun: the one command line for a node's ranks (pure), and running it with signals forwarded.

ddp-launch does not re-implement process management: torch.distributed.run (torchrun) starts the ranks, restarts
the group after a failure (`--max-restarts`), and stops them all when one dies. ddp-launch adds what torchrun lacks
for this job: the rendezvous chosen by the plan (or, under SLURM, by the job), the environment, the rank entry
point, signal forwarding (torchrun runs in its own session so a terminal's Ctrl-C reaches the launcher, which
forwards it once), a parent-death signal (a launcher killed outright, by SIGKILL or the OOM killer, still stops
torchrun, which stops the ranks as on Ctrl-C), and the rank logs streamed to the console.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from launcher.launch.logs import LogStreamer, QuietStop, say
from launcher.launch.startup.parent_death import parent_death_signal
from launcher.launch.startup.rank_fork import WORKER_MODULE
from launcher.launch.startup.warm_torchrun import warm
from launcher.plan.environment import TORCHRUN_STARTED
from launcher.plan.plan import LaunchPlan

# How long torchrun, told to stop, waits for the ranks before it SIGKILLs them (its default, 30 s, can end rank 0
# while it writes its checkpoint on a loaded machine). A rank with no progress ends itself sooner (rank/signals.py,
# StopSignal's grace), so this bounds a checkpoint write, and a frozen (SIGSTOPped) rank that cannot end itself.
SHUTDOWN_TIMEOUT, SHUTDOWN_TIMEOUT_S = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", 90

# HUP: the terminal closed or the ssh session dropped; USR1: SLURM's advance warning of the time limit
EXIT_NOT_JOINED = 2  # a node that never joined the rendezvous: as a refused plan, the run cannot start as asked

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)


def rendezvous_args(plan: LaunchPlan) -> list[str]:
    """torchrun's rendezvous options for a local launch: standalone c10d (the kernel picks the port, so jobs on one
    node never race), or the static master address and port every node was given, waited on for at most
    dist.timeout_s (torchrun's static rendezvous reads `timeout` from --rdzv-conf: the store's wait for the other
    nodes, 600 s otherwise)."""
    rdzv = plan.rendezvous
    if rdzv.kind == "standalone":
        return ["--standalone"]
    if rdzv.kind == "static":
        return ["--node-rank", str(plan.node_rank), "--master-addr", rdzv.addr, "--master-port", str(rdzv.port),
                "--rdzv-conf", f"timeout={plan.timeout_s}"]
    raise ValueError(f"a {rdzv.kind!r} rendezvous is decided in the job, on each node (slurm_job.py)")


def rendezvous_wait(plan: LaunchPlan) -> tuple[str, str] | None:
    """For a node of a multi-node launch by hand: the line that says what it waits for, and the one-line refusal
    when that does not come within dist.timeout_s (torchrun's rendezvous then times out). None for one node."""
    rdzv = plan.rendezvous
    if rdzv.kind != "static" or plan.nnodes < 2:
        return None
    return waiting_lines(plan.node_rank, plan.nnodes, f"{rdzv.addr}:{rdzv.port}", plan.timeout_s,
                         join_advice="start the same command with node_rank=N on each node",
                         answer_advice="start it with node_rank=0, and check dist.master_addr and dist.master_port")


def waiting_lines(node_rank: int, nnodes: int, at: str, timeout_s: int, *, join_advice: str,
                  answer_advice: str) -> tuple[str, str]:
    """(the line a node says while it waits at the rendezvous `at`, the one-line refusal when the others have not
    come within dist.timeout_s): node 0 names the nodes it waits for, any other node waits for node 0."""
    limit = f"dist.timeout_s={timeout_s}"
    if node_rank == 0:
        others = ", ".join(map(str, range(1, nnodes)))
        return (f"waiting for node {others} of {nnodes} at {at} (at most {limit} s)",
                f"ddp-launch: refused: node {others} of {nnodes} did not join at {at} within {limit} s; "
                f"{join_advice} (or raise dist.timeout_s)")
    return (f"node {node_rank} of {nnodes}: waiting for node 0 at {at} (at most {limit} s)",
            f"ddp-launch: refused: node 0 of {nnodes} did not answer at {at} within {limit} s; {answer_advice} "
            f"(or raise dist.timeout_s)")


def torchrun_command(plan: LaunchPlan, run_dir: Path, rendezvous: list[str], *, nnodes: int | None = None,
                     python: str | None = None) -> list[str]:
    """The exact command that starts this node's ranks (`python -m torch.distributed.run` is what the torchrun
    script runs); `rendezvous` comes from rendezvous_args, or from the SLURM job."""
    return [
        python or sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(nnodes or plan.nnodes),
        *rendezvous,
        "--nproc-per-node", str(plan.nproc_per_node),
        "--max-restarts", str(plan.max_restarts),
        "--monitor-interval", "1",
        "--module", WORKER_MODULE, str(run_dir),
    ]  # fmt: skip


def local_command(plan: LaunchPlan, run_dir: Path) -> list[str]:
    """The command that starts this node's ranks for a plan made for this machine."""
    return torchrun_command(plan, run_dir, rendezvous_args(plan))


def format_command(cmd: list[str], env: dict[str, str]) -> str:
    exports = " \\\n".join(f"  {k}={shlex.quote(v)}" for k, v in sorted(env.items()))
    return (f"env \\\n{exports} \\\n  " if env else "") + " ".join(shlex.quote(c) for c in cmd)


def run_torchrun(
    cmd: list[str], env: dict[str, str], log_files: list[Path], prefix: bool, keep=None, verbose: bool = False,
    stderr_filter: QuietStop | None = None,
) -> tuple[int, int | None]:
    """Run torchrun to completion. Returns (exit code, the signal that stopped the launcher or None).

    SIGINT, SIGTERM, SIGHUP and SIGUSR1 are forwarded to torchrun as SIGTERM, once; torchrun passes it to every rank,
    which checkpoints and exits, and kills what is left after its shutdown timeout. torchrun gets the same SIGTERM
    from the kernel if the launcher dies without a word (parent_death.PARENT_DEATH_SIGNAL). torchrun's stderr reaches the console
    without the traceback it prints when it is stopped (logs.QuietStop); torchrun is the warm one that `ddp-launch` started
    before planning, when there is one (warm_torchrun.py); its per-attempt folders (by default an empty
    /tmp/torchelastic_* left by every launch) go to a private temporary folder, removed when torchrun ends. The rank
    logs' diagnostics reach the console only with `verbose` (log.verbose). `stderr_filter`: the QuietStop that copies
    torchrun's stderr, where the caller wants to know what it saw (QuietStop.refused).
    """
    streamer = LogStreamer(log_files, prefix=prefix, keep=keep, verbose=verbose)
    scratch = None
    if "PET_LOG_DIR" not in os.environ and "PET_LOG_DIR" not in env:  # torchrun's --log-dir, from the environment
        scratch = tempfile.mkdtemp(prefix="ddp-launch-torchrun-")
        env = {**env, "PET_LOG_DIR": scratch}
    # torchrun first, then the threads and handlers: torchrun must inherit the dispositions the caller set (the SLURM
    # job ignores USR1, which SLURM sends to every process of the step; a handler installed before the fork would be
    # reset to the default, "terminate", in torchrun and the ranks), and the parent-death request runs in the child
    # between fork and exec, where no other thread of the launcher should exist.
    env = {**env, TORCHRUN_STARTED: repr(time.time())}  # rank 0's timeline (rank/metrics/timeline.py): handed over
    if SHUTDOWN_TIMEOUT not in os.environ:  # the user's own setting stands
        env = {**env, SHUTDOWN_TIMEOUT: str(SHUTDOWN_TIMEOUT_S)}
    proc = warm.take(cmd, {**os.environ, **env}) or subprocess.Popen(
        cmd, env={**os.environ, **env}, start_new_session=True, stderr=subprocess.PIPE,
        preexec_fn=parent_death_signal())
    stderr = threading.Thread(target=(stderr_filter or QuietStop(sys.stderr)).copy, args=(proc.stderr,), daemon=True)
    stderr.start()
    streamer.start()
    try:
        with signals_forwarded(proc, "ddp-launch: got {signal}, stopping the ranks (they save a checkpoint)") as received:
            code = proc.wait()
    finally:
        time.sleep(0.3)  # the last lines a rank wrote before exiting
        streamer.stop()
        stderr.join(timeout=5)  # a grandchild may still hold the pipe; it is a daemon thread
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    return code, (received[0] if received else None)


@contextmanager
def signals_forwarded(proc: subprocess.Popen, announce: str):
    """Inside: SIGINT, SIGTERM, SIGHUP and SIGUSR1 reach `proc` as SIGTERM, once, the first said on a line of its
    own (`announce`, its {signal} the signal's name). Yields the list the signal is put in (empty while none came)."""
    received: list[int] = []

    def forward(signum, _frame):
        if not received:
            received.append(signum)
            say("\n" + announce.format(signal=signal.Signals(signum).name))
            try:
                proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        yield received
    finally:
        for s, h in previous.items():
            signal.signal(s, h)

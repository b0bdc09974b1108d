"""torchrun: the one command line for a node's ranks (pure), and running it with signals forwarded.

ddp-launch does not re-implement process management: torch.distributed.run (torchrun) starts the ranks, restarts
the group after a failure (`--max-restarts`), and stops them all when one dies. ddp-launch adds what torchrun lacks
for this job: the rendezvous chosen by the plan (or, under SLURM, by the job), the environment, the rank entry
point, signal forwarding (torchrun runs in its own session so a terminal's Ctrl-C reaches the launcher, which
forwards it once), a parent-death signal (a launcher killed outright, by SIGKILL or the OOM killer, still stops
torchrun, which stops the ranks as on Ctrl-C), and the rank logs streamed to the console.
"""

from __future__ import annotations

import ctypes
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from launcher.launch.logs import LogStreamer, QuietStop, say
from launcher.launch.warm_torchrun import warm
from launcher.plan.environment import TORCHRUN_STARTED
from launcher.plan.plan import LaunchPlan

WORKER_MODULE = "launcher.rank.worker"
# HUP: the terminal closed or the ssh session dropped; USR1: SLURM's advance warning of the time limit
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def rendezvous_args(plan: LaunchPlan) -> list[str]:
    """torchrun's rendezvous options for a local launch: standalone c10d (the kernel picks the port, so jobs on one
    node never race), or the static master address and port every node was given."""
    rdzv = plan.rendezvous
    if rdzv.kind == "standalone":
        return ["--standalone"]
    if rdzv.kind == "static":
        return ["--node-rank", str(plan.node_rank), "--master-addr", rdzv.addr, "--master-port", str(rdzv.port)]
    raise ValueError(f"a {rdzv.kind!r} rendezvous is decided in the job, on each node (slurm_job.py)")


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


# What torchrun gets when the launcher dies without a word: the SIGTERM of a Ctrl-C, so that it stops the ranks as
# on one (and its rendezvous store lives until they have). The kernel sends it each time the child's parent *thread*
# dies, and a launcher killed outright loses its threads one by one (the child is re-parented to the next): torchrun
# gets it two or three times (seen with perf's signal tracepoints). The second restarts its shutdown once (its
# run()'s finally), which signals every rank again and waits for them; a third ends torchrun without waiting, and a
# rank left alone stops itself on seeing it gone (signals.stop_when_orphaned). Every rank stops at the same step.
PARENT_DEATH_SIGNAL = signal.SIGTERM


def parent_death_signal(signum: int = PARENT_DEATH_SIGNAL):
    """A preexec_fn that has the child sent `signum` when this process dies, however it dies (Linux prctl); None
    where there is no prctl. libc's prctl is looked up here, before the fork: the child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before the request took effect
            os.kill(os.getpid(), signum)

    return preexec


def run_torchrun(
    cmd: list[str], env: dict[str, str], log_files: list[Path], prefix: bool, keep=None
) -> tuple[int, int | None]:
    """Run torchrun to completion. Returns (exit code, the signal that stopped the launcher or None).

    SIGINT, SIGTERM, SIGHUP and SIGUSR1 are forwarded to torchrun as SIGTERM, once; torchrun passes it to every rank,
    which checkpoints and exits, and kills what is left after its shutdown timeout. torchrun gets the same SIGTERM
    from the kernel if the launcher dies without a word (PARENT_DEATH_SIGNAL). torchrun's stderr reaches the console
    without the traceback it prints when it is stopped (logs.QuietStop); torchrun is the warm one that `ddp-launch` started
    before planning, when there is one (warm_torchrun.py); its per-attempt folders (by default an empty
    /tmp/torchelastic_* left by every launch) go to a private temporary folder, removed when torchrun ends.
    """
    streamer = LogStreamer(log_files, prefix=prefix, keep=keep)
    scratch = None
    if "PET_LOG_DIR" not in os.environ and "PET_LOG_DIR" not in env:  # torchrun's --log-dir, from the environment
        scratch = tempfile.mkdtemp(prefix="ddp-launch-torchrun-")
        env = {**env, "PET_LOG_DIR": scratch}
    # torchrun first, then the threads and handlers: torchrun must inherit the dispositions the caller set (the SLURM
    # job ignores USR1, which SLURM sends to every process of the step; a handler installed before the fork would be
    # reset to the default, "terminate", in torchrun and the ranks), and the parent-death request runs in the child
    # between fork and exec, where no other thread of the launcher should exist.
    env = {**env, TORCHRUN_STARTED: repr(time.time())}  # rank 0's timeline (rank/metrics/timeline.py): handed over
    proc = warm.take(cmd, {**os.environ, **env}) or subprocess.Popen(
        cmd, env={**os.environ, **env}, start_new_session=True, stderr=subprocess.PIPE,
        preexec_fn=parent_death_signal())
    stderr = threading.Thread(target=QuietStop(sys.stderr).copy, args=(proc.stderr,), daemon=True)
    stderr.start()
    streamer.start()
    received: list[int] = []

    def forward(signum, _frame):
        if not received:
            received.append(signum)
            say(f"\nddp-launch: got {signal.Signals(signum).name}, stopping the ranks (they save a checkpoint)")
            try:
                proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        code = proc.wait()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        time.sleep(0.3)  # the last lines a rank wrote before exiting
        streamer.stop()
        stderr.join(timeout=5)  # a grandchild may still hold the pipe; it is a daemon thread
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    return code, (received[0] if received else None)

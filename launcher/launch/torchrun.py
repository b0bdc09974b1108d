"""torchrun: the one command line for a node's ranks (pure), and running it with signals forwarded.

ddp-launch does not re-implement process management: torch.distributed.run (torchrun) starts the ranks, restarts
the group after a failure (`--max-restarts`), and stops them all when one dies. ddp-launch adds what torchrun lacks
for this job: the rendezvous chosen by the plan (or, under SLURM, by the job), the environment, the rank entry
point, signal forwarding (torchrun runs in its own session so a terminal's Ctrl-C reaches the launcher, which
forwards it once), and the rank logs streamed to the console.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from launcher.launch.logs import LogStreamer, say
from launcher.plan.plan import LaunchPlan

WORKER_MODULE = "launcher.rank.worker"
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)  # USR1: SLURM's advance warning of the time limit


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


def run_torchrun(
    cmd: list[str], env: dict[str, str], log_files: list[Path], prefix: bool, keep=None
) -> tuple[int, int | None]:
    """Run torchrun to completion. Returns (exit code, the signal that stopped the launcher or None).

    SIGINT, SIGTERM and SIGUSR1 are forwarded to torchrun as SIGTERM, once; torchrun passes it to every rank, which
    checkpoints and exits, and kills what is left after its shutdown timeout.
    """
    streamer = LogStreamer(log_files, prefix=prefix, keep=keep)
    streamer.start()
    # torchrun first, then the handlers: torchrun must inherit the dispositions the caller set (the SLURM job ignores
    # USR1, which SLURM sends to every process of the step; a handler installed before the fork would be reset to
    # the default, "terminate", in torchrun and the ranks).
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, start_new_session=True)
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
    return code, (received[0] if received else None)

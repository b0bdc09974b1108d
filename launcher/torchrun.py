"""torchrun: the command line for a plan (pure), and running it with signals forwarded and rank 0 on the console.

ddp-launch does not re-implement process management: torch.distributed.run (torchrun) starts the ranks, restarts
the group after a failure (`--max-restarts`), and stops them all when one dies. ddp-launch adds what torchrun lacks
for this job: the rendezvous chosen by the plan, the environment, the worker entry point, signal forwarding
(torchrun runs in its own session so a terminal's Ctrl-C reaches the launcher, which forwards it once), and the
rank logs streamed to the console.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from launcher.plan import LaunchPlan

WORKER_MODULE = "launcher.worker"


def torchrun_command(plan: LaunchPlan, run_dir: Path, python: str | None = None) -> list[str]:
    """The exact command the launcher runs (`python -m torch.distributed.run` is what the torchrun script runs)."""
    cmd = [python or sys.executable, "-m", "torch.distributed.run"]
    rdzv = plan.rendezvous
    if rdzv.kind in ("standalone", "none"):
        # c10d rendezvous on localhost:0: the store binds a port the kernel picks, so jobs on one node never race
        cmd += ["--standalone", "--nnodes", "1"]
    else:
        cmd += [
            "--nnodes", str(plan.nnodes),
            "--node-rank", str(plan.node_rank),
            "--master-addr", rdzv.addr,
            "--master-port", str(rdzv.port),
        ]  # fmt: skip
    cmd += [
        "--nproc-per-node", str(plan.nproc_per_node),
        "--max-restarts", str(plan.max_restarts),
        "--monitor-interval", "1",
        "--module", WORKER_MODULE, str(run_dir),
    ]  # fmt: skip
    return cmd


def format_command(cmd: list[str], env: dict[str, str]) -> str:
    exports = " \\\n".join(f"  {k}={shlex.quote(v)}" for k, v in sorted(env.items()))
    return (f"env \\\n{exports} \\\n  " if env else "") + " ".join(shlex.quote(c) for c in cmd)


class LogStreamer(threading.Thread):
    """Copies what rank log files gain to the console while the job runs (rank 0 only, or every rank)."""

    def __init__(self, files: list[Path], prefix: bool, out=None, period: float = 0.2, keep=None):
        super().__init__(daemon=True)
        self.files, self.prefix, self.period = files, prefix, period
        self.keep = keep or (lambda line: True)  # which lines reach the console
        self.out = out or sys.stdout
        self.offsets = {f: (f.stat().st_size if f.exists() else 0) for f in files}
        self._done = threading.Event()
        self._partial: dict[Path, str] = {}

    def pump(self) -> None:
        for f in self.files:
            try:
                with open(f, "rb") as fh:
                    fh.seek(self.offsets[f])
                    chunk = fh.read()
            except FileNotFoundError:
                continue
            if not chunk:
                continue
            self.offsets[f] += len(chunk)
            text = self._partial.pop(f, "") + chunk.decode(errors="replace")
            lines = text.split("\n")
            if lines[-1]:
                self._partial[f] = lines[-1]
            for line in filter(self.keep, lines[:-1]):
                self.out.write(f"[{f.stem}] {line}\n" if self.prefix else f"{line}\n")
            self.out.flush()

    def run(self) -> None:
        while not self._done.is_set():
            self.pump()
            self._done.wait(self.period)
        self.pump()
        for f, rest in self._partial.items():
            self.out.write(f"[{f.stem}] {rest}\n" if self.prefix else f"{rest}\n")
        self.out.flush()

    def stop(self) -> None:
        self._done.set()
        self.join()


def run_torchrun(
    cmd: list[str], env: dict[str, str], log_files: list[Path], prefix: bool, keep=None
) -> tuple[int, int | None]:
    """Run torchrun to completion. Returns (exit code, the signal that stopped the launcher or None).

    SIGINT, SIGTERM and SIGUSR1 (SLURM's advance warning) are forwarded to torchrun as SIGTERM, once; torchrun
    passes it to every rank, which checkpoints and exits, and kills what is left after its shutdown timeout.
    """
    streamer = LogStreamer(log_files, prefix=prefix, keep=keep)
    streamer.start()
    # torchrun first, then the handlers: torchrun must inherit the dispositions the caller set (launcher.job ignores
    # SLURM's USR1, which SLURM sends to every process of the step; a handler installed before the fork would be
    # reset to the default, "terminate", in torchrun and the ranks).
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, start_new_session=True)
    received: list[int] = []

    def forward(signum, _frame):
        if not received:
            received.append(signum)
            print(f"\nddp-launch: got {signal.Signals(signum).name}, stopping the ranks (they save a checkpoint)", flush=True)
            try:
                proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    try:
        code = proc.wait()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        time.sleep(0.3)  # the last lines a rank wrote before exiting
        streamer.stop()
    return code, (received[0] if received else None)

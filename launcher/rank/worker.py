"""The per-rank entry point: `python -m launcher.rank.worker RUN_DIR`, started by torchrun once per rank; or `forked`,
the same run in a process forked from the warm torchrun, which has imported torch already (rank/startup/forked_start.py).

It does not run Hydra: it reads the config the launcher resolved (RUN_DIR/config.yaml) and the plan
(RUN_DIR/plan.json), sends its own stdout and stderr to RUN_DIR/logs/rank<R>.log, and trains. The rank, world size
and device come from torchrun's environment, which is set before Ultralytics is imported (it reads them at import).
"""

from __future__ import annotations

import io
import logging
import os
import sys
import time
import traceback
from pathlib import Path

STARTED = time.time()  # this process's start, for rank 0's timeline (rank/metrics/timeline.py)

from launcher.plan.settings import Settings
from launcher.problems import plain_text
from launcher.rank.group.signals import stop_when_orphaned
from launcher.run_folder import DETAIL, RunFolder


def redirect_output(log_file: Path) -> None:
    """Point fds 1 and 2 at the rank's log (append: a restarted rank continues the same file).

    At the file-descriptor level, so C++ and NCCL output land there too. The launcher streams rank 0's file to the
    console; a crash loses nothing because the kernel, not a pipe thread, writes the file.
    """
    log_file.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = PlainTextFile(open(1, "wb", closefd=False))  # line-buffered: the console follows in real time
    sys.stderr = PlainTextFile(open(2, "wb", closefd=False))


class PlainTextFile(io.TextIOWrapper):
    """A line-buffered text stream that leaves out terminal escape sequences: Ultralytics colours its messages
    (colorstr) whatever the stream, and a log file would keep the codes."""

    def __init__(self, raw):
        super().__init__(raw, encoding="utf-8", errors="replace", line_buffering=True)

    def write(self, s: str) -> int:
        super().write(plain_text(s))
        return len(s)


def main(argv: list[str] | None = None, started: float | None = None, how: str = "") -> int:
    """The rank's run; `started`: when its process started (this module's import, in a fresh interpreter)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m launcher.rank.worker RUN_DIR (started by ddp-launch through torchrun)", file=sys.stderr)
        return 2
    folder = RunFolder(Path(argv[0]).resolve())
    rank = int(os.environ.get("RANK", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    redirect_output(folder.rank_log(rank))
    stop_when_orphaned()  # torchrun killed outright: this rank stops too (signals.py)
    print(  # where each attempt starts in the log; a diagnostic on the console
        f"{DETAIL} ==== rank {rank}/{os.environ.get('WORLD_SIZE', '1')} local_rank {os.environ.get('LOCAL_RANK', '0')} "
        f"pid {os.getpid()} attempt {attempt} rendezvous {os.environ.get('MASTER_ADDR', '-')}:"
        f"{os.environ.get('MASTER_PORT', '-')} {time.strftime('%Y-%m-%d %H:%M:%S')}{how} ====",
        flush=True,
    )
    if folder.finished():
        print(f"this run already finished ({folder.summary_file}); nothing to do", flush=True)
        return 0  # a requeued or restarted job of a finished run is done, not failed
    cfg, plan = folder.load()

    from torch.distributed.elastic.multiprocessing.errors import record

    @record  # a failure's traceback reaches torchrun's error report, naming this rank
    def _run() -> None:
        from launcher.rank.data import torchvision_ops

        torchvision_ops.defer_package_import()  # Ultralytics' validator imports it; a rank on CUDA never uses it
        from launcher.rank.run import runs  # imports Ultralytics: only now, with the environment in place

        bench = Settings.of(cfg).bench
        if bench is not None and bench.cell:
            runs.bench_cell(cfg, plan, folder)
        else:
            runs.train(cfg, plan, folder, stamps={"rank_start": started or STARTED, "imports_done": time.time()})

    try:
        _run()
    except SystemExit:
        raise  # a signal-driven stop after its checkpoint: not a failure of this rank
    except BaseException as e:
        from launcher.rank.group.dist import DistributedInitError

        folder.record_exception(rank, e, phase="init" if isinstance(e, DistributedInitError) else "train")
        raise
    return 0


def run(argv: list[str] | None = None, started: float | None = None, how: str = "") -> int:
    """main's exit status, as a process would exit with it."""
    try:
        return main(argv, started, how)
    except SystemExit as stop:
        return exit_code(stop)
    except BaseException:
        traceback.print_exc()  # the failure is already in the run folder (main) and torchrun's error file (@record)
        return 1


def forked(run_dir: str, signals: dict) -> None:
    """The rank's entry as a function torchrun calls in a process forked from the warm torchrun: returning is
    success (torchrun collects the return value, then the process leaves as `leave` does, once multiprocessing's
    clean-up is done and before it would wait for threads); any other status ends the process at once."""
    started = time.time()
    from multiprocessing.util import Finalize

    from launcher.rank.startup.forked_start import become_rank

    become_rank(signals, run_dir, int(os.environ.get("RANK", "0")))
    status = run([run_dir], started, how=" forked from torchrun")
    if status:
        leave(status)
    Finalize(None, leave, args=(0,), exitpriority=-(2**30))  # the last of the exit's finalizers


def leave(code: int):
    """End this process with `code` once its output is flushed, without the interpreter's teardown.

    Gloo's worker threads release a finished collective's tensors lazily; one that does so while the interpreter
    finalizes needs the GIL, cannot have it, and aborts the process (SIGABRT: "terminate called without an active
    exception") after the rank's work is done and written, so torchrun reports a failed run. The rank's files are
    closed and its loader workers joined before this point (Rank.close), so nothing is lost by skipping the teardown.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def exit_code(stop: SystemExit) -> int:
    """The status a SystemExit asks for (sys.exit's rules: None is 0, a message is 1)."""
    return stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1


if __name__ == "__main__":
    leave(run())

"""A rank's own lines, in its log (rank/worker.py points stdout there): each tagged with the rank, diagnostics also
with run_folder.DETAIL, which the launcher leaves off the console unless log.verbose asks for them."""

from __future__ import annotations

from collections.abc import Callable

from launcher.run_folder import DETAIL


def rank_lines(rank: int) -> tuple[Callable[[str], None], Callable[[str], None]]:
    """(log, detail) for rank `rank`: `log(msg)` a line for the console (rank 0's) and the log; `detail(msg)` a
    diagnostic (timings, cores, CUDA graphs), on the console only with log.verbose."""

    def log(msg: str) -> None:
        print(f"[rank {rank}] {msg}", flush=True)

    def detail(msg: str) -> None:
        print(f"[rank {rank}] {DETAIL} {msg}", flush=True)

    return log, detail

"""CPU binding (`loader.bind_cores`): each rank's cores split between its training process and its loader workers.

A GPU rank's training process is latency-bound host work: it launches kernels, runs the loss's small eager ops and
waits on their syncs; every millisecond it spends preempted is a millisecond the GPU idles. Its DataLoader workers
are throughput-bound and, when the loader is tuned to keep up, keep every other core busy. Left to the scheduler,
busy workers on every core preempt the training thread all the time, and the GPU idles with the data ready
(docs/benchmarks/README.md, section 3). Bound, the training process owns its cores and the workers share the rest:
the same split the plan already makes in numbers (`threads_per_rank` = cores per rank - workers).

Ranks of a node get disjoint, contiguous blocks of the cores this process may use (SLURM's allocation, a container's
cpuset, or the whole machine), in local-rank order, so ranks on one GPU's NUMA node stay on nearby cores when the
node numbers its cores that way.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CoreSplit:
    main: tuple[int, ...]  # the training process: its main thread, the pin-memory thread, NCCL's threads
    workers: tuple[int, ...]  # every DataLoader worker of this rank (training and validation)


def split_cores(available: Sequence[int], local_rank: int, nproc: int, workers: int) -> CoreSplit | None:
    """This rank's block of `available`, its first cores for the training process and the rest for its workers.

    None when there is nothing to split: no workers, or fewer than 2 cores per rank (binding would only take cores
    away). The training process keeps at least one core; the workers get the remainder (they may be more processes
    than cores: they then share those cores, and never the training process's)."""
    cores = sorted(available)
    per_rank = len(cores) // max(1, nproc)
    if workers <= 0 or per_rank < 2 or not 0 <= local_rank < nproc:
        return None
    mine = cores[local_rank * per_rank : (local_rank + 1) * per_rank]
    n_main = max(1, per_rank - workers)
    return CoreSplit(main=tuple(mine[:n_main]), workers=tuple(mine[n_main:]))


def bind_process(cores: Sequence[int]) -> None:
    """Restrict every thread of this process, and the threads and processes it starts from now on, to `cores`.

    sched_setaffinity(0) moves only the calling thread: threads started earlier (NCCL's, the GPU monitor's) are
    moved one by one."""
    target = set(cores)
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]:
        try:
            os.sched_setaffinity(int(tid), target)
        except (ProcessLookupError, PermissionError):
            pass  # a thread that has just ended; a thread we may not move keeps its cores
    os.sched_setaffinity(0, target)


def core_list(cores) -> str:
    """(0, 1, 2, 5) -> '0-2,5' (the cpuset notation)."""
    runs, start = [], None
    for i, c in enumerate(cores):
        if start is None:
            start = c
        if i + 1 == len(cores) or cores[i + 1] != c + 1:
            runs.append(f"{start}-{c}" if c != start else str(c))
            start = None
    return ",".join(runs)


def available_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


class BindWorker:
    """A DataLoader worker_init_fn that first confines the worker to the workers' cores, then runs `inner`.

    A class, not a closure: workers started with spawn pickle it."""

    def __init__(self, cores: Sequence[int], inner=None):
        self.cores, self.inner = tuple(cores), inner

    def __call__(self, worker_id: int) -> None:
        bind_process(self.cores)
        if self.inner is not None:
            self.inner(worker_id)

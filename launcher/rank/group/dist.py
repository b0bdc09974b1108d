"""This rank's place in the job, and its process group.

`rank_info()` reads torchrun's environment and works before any process group exists (0, 0, 1 outside torchrun),
so single-process code runs unchanged. `Comm` is what the rest of the rank uses to talk to the others: with no
process group (a single process, DataParallel) every agreement is the local value, so callers never branch.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


class DistributedInitError(RuntimeError):
    """DDP could not start (rendezvous, NCCL): with mode=auto and dist.fallback=dp the launcher retries with DP."""


def rank_info() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun's environment."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def attempt_store(timeout: timedelta):
    """torchrun's store, under a prefix for this restart attempt.

    After a restart the agent's store still holds the previous attempt's keys (gloo's peer addresses, ...), and a
    fast rank can read a dead peer's address before the slow one rewrites it. A prefix per attempt keeps them apart.
    """
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    rank, _, world = rank_info()
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent serves the store
    base = dist.TCPStore(addr, port, world, is_master=not agent_hosts and rank == 0, timeout=timeout)
    return dist.PrefixStore(f"ddp_launch/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", base)


class Comm:
    """The ranks of this job, seen from one of them."""

    def __init__(self, rank: int = 0, world_size: int = 1, control_group=None, store=None):
        self.rank, self.world_size = rank, world_size
        self.control_group = control_group  # gloo: host-side agreements on CPU tensors, no GPU sync
        self.store = store

    @property
    def distributed(self) -> bool:
        return self.control_group is not None

    @classmethod
    def start(cls, backend: str, timeout_s: int, at_init=lambda: None) -> Comm:
        """The process group over torchrun's rendezvous, with the plan's backend and a bounded timeout; a gloo group
        beside an NCCL one for the host-side agreements. Raises DistributedInitError."""
        rank, _, world = rank_info()
        try:
            at_init()
            # The heartbeat names a hung rank after timeout_s; the collectives' own timeout comes later.
            timeout = timedelta(seconds=timeout_s + max(30, timeout_s // 2))
            dist.init_process_group(backend=backend, store=attempt_store(timeout), rank=rank, world_size=world,
                                    timeout=timeout)
            dist.barrier()  # the group really works (NCCL communicators are created lazily)
            control = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else dist.group.WORLD
        except Exception as e:
            raise DistributedInitError(f"rank {rank}: the {backend} process group did not start: {e}") from e
        return cls(rank, world, control, dist.distributed_c10d._get_default_store())

    def max(self, value: int) -> int:
        """The largest of every rank's `value` (a collective: every rank calls it at the same point)."""
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control_group)
        return int(t.item())

    def rank0_decides(self, flag: bool) -> bool:
        """Rank 0's decision, on every rank (early stop is decided where the metrics are)."""
        if not self.distributed:
            return flag
        box = [flag if self.rank == 0 else None]
        dist.broadcast_object_list(box, 0, group=self.control_group)
        return bool(box[0])

    def broadcast_from_rank0(self, tensors) -> None:
        """Rank 0's values of `tensors` (on this rank's device), in place, on every rank."""
        if self.distributed:
            for t in tensors:
                dist.broadcast(t, 0)

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.control_group)
        return out

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier(group=self.control_group)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

"""Each rank's training batches, epoch after epoch, from one persistent DataLoader iterator.

Why not Ultralytics' loader: its repeating sampler runs ahead of `set_epoch()`, so the first two epochs share one
order, and its augmentation randomness depends on which worker drew which image. Here the order of epoch e is a
pure function of (seed, e, rank, world size) -- a torch DistributedSampler set to epoch e -- and is computed when
the loader reaches epoch e, however far ahead the workers prefetch. Every index travels with its epoch, and
`EpochSeededDataset` seeds the augmentation of each sample from (seed, epoch, index): the same run gives the same
batches whatever the worker count, and a resumed run continues exactly where it stopped.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import random
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler, Sampler


def epoch_indices(n: int, epoch: int, *, num_replicas: int, rank: int, seed: int, shuffle: bool = True) -> list[int]:
    """The dataset indices rank `rank` trains on in `epoch` (torch's DistributedSampler, padded to equal shards)."""
    sampler = DistributedSampler(range(n), num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


class EpochBatchSampler(Sampler):
    """Yields batches of (epoch, index) pairs forever, starting at (start_epoch, start_batch).

    `fill_last`: an epoch's short last batch is completed with the first images of the same epoch's order (as
    DistributedSampler pads its shards to equal length), so that every batch has `batch_size` images. A CUDA-graphed
    step needs it: a batch of another size runs the network eagerly, and its activations are allocated outside the
    graph's memory pool, beside it (at a large batch, tens of GiB more than the step itself: h200-auto-batch)."""

    def __init__(self, n: int, batch_size: int, *, num_replicas: int = 1, rank: int = 0, seed: int = 0,
                 shuffle: bool = True, fill_last: bool = False):
        self.n, self.batch_size = n, batch_size
        self.num_replicas, self.rank, self.seed, self.shuffle = num_replicas, rank, seed, shuffle
        self.fill_last = fill_last
        self.start_epoch = 0
        self.start_batch = 0

    @property
    def batches_per_epoch(self) -> int:
        return math.ceil(self.shard / self.batch_size)

    @property
    def shard(self) -> int:
        """Images per rank per epoch (DistributedSampler's padded share)."""
        return math.ceil(self.n / self.num_replicas)

    @property
    def filled(self) -> int:
        """Images added to each epoch's last batch (0 without fill_last, or when the shard divides evenly)."""
        return -self.shard % self.batch_size if self.fill_last else 0

    def __len__(self) -> int:  # one epoch; iteration itself never ends
        return self.batches_per_epoch

    def start_at(self, epoch: int, batch: int = 0) -> None:
        """Where the next iterator (the next `iter(loader)`) begins."""
        self.start_epoch, self.start_batch = epoch, batch

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch, skip = self.start_epoch, self.start_batch
        while True:
            indices = epoch_indices(
                self.n, epoch, num_replicas=self.num_replicas, rank=self.rank, seed=self.seed, shuffle=self.shuffle
            )
            if self.filled:  # cycled: a shard smaller than one batch repeats as often as it takes
                indices = indices + list(itertools.islice(itertools.cycle(indices), self.filled))
            for b in range(skip, self.batches_per_epoch):
                yield [(epoch, i) for i in indices[b * self.batch_size : (b + 1) * self.batch_size]]
            epoch, skip = epoch + 1, 0


def mosaic_closes_at(epochs: int, close_mosaic: int) -> int | None:
    """The first epoch without mosaic (Ultralytics' close_mosaic: the last `close_mosaic` epochs), None if none. As in
    Ultralytics' trainer, a run of fewer epochs than close_mosaic never closes it."""
    at = epochs - close_mosaic
    return at if close_mosaic > 0 and at >= 0 else None


def sample_seed(seed: int, epoch: int, index: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{epoch}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class EpochSeededDataset(Dataset):
    """Seeds Python's, NumPy's and torch's generators per sample from (seed, epoch, index), then defers: to `closed`
    (the dataset with mosaic closed) from epoch `close_at` on, else to `dataset`. The workers hold both, so the
    batches they prefetch across that boundary are right and close_mosaic restarts nothing."""

    def __init__(self, dataset: Dataset, seed: int, *, closed: Dataset | None = None, close_at: int | None = None):
        if (closed is None) != (close_at is None):
            raise ValueError("closed and close_at go together")
        self.dataset, self.seed, self.closed, self.close_at = dataset, seed, closed, close_at

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name):  # labels, collate_fn, ...: what the trainer and Ultralytics read off a dataset
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __getitem__(self, key: tuple[int, int]):
        epoch, index = key
        s = sample_seed(self.seed, epoch, index)
        random.seed(s)
        np.random.seed(s % 2**32)
        torch.manual_seed(s)
        if self.close_at is not None and epoch >= self.close_at:
            return self.closed[index]
        return self.dataset[index]


def worker_init(_worker_id: int) -> None:
    """No thread oversubscription (a worker is one core's worth of decoding and augmentation); no dying on the
    rank's SIGTERM before the rank has saved its checkpoint (rank/group/signals.py)."""
    from launcher.rank.group.signals import ignore_termination_in_worker

    ignore_termination_in_worker()
    torch.set_num_threads(1)
    try:
        import cv2

        cv2.setNumThreads(1)
    except ImportError:
        pass

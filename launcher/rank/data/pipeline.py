"""The training batches of one rank, on its device, ready for the step.

One DataLoader iterator over the endless EpochBatchSampler (sampler.py) serves the whole run: its workers live from
the first batch to the last (`loader.persistent_workers=true`; the DataLoader's own flag of that name cannot be used,
since a restart must hand the workers a changed dataset after close_mosaic). The iterator is started again only
where it must be: at the run's first step, after close_mosaic (`restart()`), or at every epoch with
`loader.persistent_workers=false`.

With fetch-ahead (`loader.fetch_ahead`, on by default) the loop asks for the next batch while the GPU still runs
the step just launched (`prefetch`): on CUDA its host-to-device copy, and its augmentation with loader.gpu_augment,
run on a side stream, so the copy engine and the step overlap and the next step starts on data already on the
device. Only the loader's own delay counts as data wait then (`last_wait`).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable

import torch
from torch import nn

MAX_TARGETS = "max_targets"  # batch key: the largest number of targets in one image, known to the host


def max_targets_per_image(batch_idx: torch.Tensor, batch_size: int, *, read_device: bool = False) -> int | None:
    """The largest number of targets in one image of the batch. From labels on the CPU it costs nothing; from labels
    on a GPU only with `read_device` (one number read back: a sync on the current stream), else None."""
    if batch_idx.device.type != "cpu" and not read_device:
        return None
    if batch_idx.numel() == 0:
        return 0
    return int(torch.bincount(batch_idx.long(), minlength=batch_size).max())


def to_device(batch: dict, device: torch.device, *, imgsz: int, stride: int, multi_scale: float = 0.0) -> dict:
    """Ultralytics' DetectionTrainer.preprocess_batch: tensors to the device, images to [0, 1], and with
    multi_scale a random square size between (1 -+ multi_scale) x imgsz, a multiple of the stride."""
    if MAX_TARGETS not in batch:  # counted while the labels are on the CPU: the sync-free loss pads to it
        batch[MAX_TARGETS] = max_targets_per_image(batch["batch_idx"], len(batch["img"]))
    for k, v in batch.items():
        if isinstance(v, torch.Tensor):
            batch[k] = v.to(device, non_blocking=device.type != "cpu")
    batch["img"] = batch["img"].float() / 255
    if multi_scale > 0:
        imgs = batch["img"]
        low, high = max(stride, int(imgsz * (1 - multi_scale))), int(imgsz * (1 + multi_scale) + stride)
        scale = random.randrange(low, high) // stride * stride / max(imgs.shape[2:])
        if scale != 1:
            size = [math.ceil(x * scale / stride) * stride for x in imgs.shape[2:]]
            batch["img"] = nn.functional.interpolate(imgs, size=size, mode="bilinear", align_corners=False)
    return batch


class TrainInputs:
    """`next(ni)` and `prefetch(ni)` for the loop; `prepare(raw, ni)` makes a loader batch ready for the step (the
    GPU augmentation with loader.gpu_augment, then to_device), its randomness a function of the step `ni`."""

    def __init__(self, loader, sampler, device: torch.device, prepare: Callable[[object, int], dict], *,
                 fetch_ahead: bool = True, persistent: bool = True, clock=time.perf_counter):
        self.loader, self.sampler, self.device, self.prepare = loader, sampler, device, prepare
        self.fetch_ahead, self.persistent, self.clock = fetch_ahead, persistent, clock
        self.last_wait = 0.0
        self._iterator = None
        self._ahead: tuple[dict, torch.cuda.Event | None, float] | None = None  # batch, copy done, wait it cost
        self._copy_stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None

    def begin_epoch(self, epoch: int, first_step: int) -> None:
        if self._iterator is None or not self.persistent:
            self._start(epoch, first_step)

    def restart(self) -> None:
        """Start new workers at the next epoch (the dataset changed: close_mosaic). Batches already prefetched by
        the old workers are dropped with them."""
        self.close()

    def next(self, ni: int) -> dict:
        if self._ahead is not None:
            return self._take_ahead()
        start = self.clock()
        batch = self.prepare(next(self._iterator), ni)
        self.last_wait = self.clock() - start
        return batch

    def prefetch(self, ni: int) -> None:
        """Fetch batch `ni` now, while the GPU runs the step just launched."""
        if not self.fetch_ahead:
            return
        start = self.clock()
        raw = next(self._iterator)
        wait = self.clock() - start
        if self._copy_stream is None:  # the CPU: nothing to overlap, the same batch either way
            self._ahead = (self.prepare(raw, ni), None, wait)
            return
        with torch.cuda.stream(self._copy_stream):
            batch = self.prepare(raw, ni)
            ready = torch.cuda.Event()
            ready.record(self._copy_stream)
        self._ahead = (batch, ready, wait)

    def _take_ahead(self) -> dict:
        """The batch fetched ahead, for the compute stream: it waits for the copy on the device, not on the host, and
        the allocator keeps the batch's memory until the compute stream is done with it."""
        batch, ready, self.last_wait = self._ahead
        self._ahead = None
        if ready is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(ready)
            for v in batch.values():
                if isinstance(v, torch.Tensor) and v.is_cuda:
                    v.record_stream(compute)
        return batch

    def batches_on_device(self, n: int, first_ni: int) -> list[dict]:
        """`n` batches taken now and kept (the data-free ceiling of ddp-bench); then the workers stop, so that they
        do not compete with the step for the cores."""
        batches = [self.next(first_ni + j) for j in range(n)]
        self.close()
        return batches

    def _start(self, epoch: int, first_step: int) -> None:
        self.close()
        self.sampler.start_at(epoch, first_step)
        self._iterator = iter(self.loader)

    def close(self) -> None:
        self._ahead = None  # a batch fetched ahead belongs to the iterator that is going
        if self._iterator is not None and hasattr(self._iterator, "_shutdown_workers"):
            self._iterator._shutdown_workers()
        self._iterator = None

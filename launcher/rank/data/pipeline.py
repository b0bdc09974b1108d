"""The training batches of one rank, on its device, ready for the step.

One DataLoader iterator over the endless EpochBatchSampler (sampler.py) serves the whole run: its workers live from
the first batch to the last (`loader.persistent_workers=true`), and prefetch across epoch boundaries, close_mosaic's
included (the dataset closes mosaic by each batch's epoch: rank/components.py). The iterator is started only at the
run's first step, or at every epoch with `loader.persistent_workers=false`.

With fetch-ahead (`loader.fetch_ahead`, on by default) the loop asks for the next batch while the GPU still runs
the step just launched (`prefetch`): on CUDA its host-to-device copy runs on a side stream, so the copy engine and
the step overlap and the next step starts on data already on the device. Only the loader's own delay counts as data
wait then (`last_wait`).

With the input pipeline on the GPU (`background=True`) preparing a batch is host work too, so it runs in threads
of their own, on a high-priority stream of their own, `AHEAD` batches ahead of the loop and across epoch boundaries:
the training thread only launches steps, and waits (data wait) only when nothing is ready. Two threads, because
nvJPEG's batched decode (`decode`) waits for the device several times longer than it computes while the step runs,
and the rest (the augmentation's launches, the box count) should not wait behind it: one thread reads the loader and
decodes, the other augments what the first decoded. Neither keeps up unless the GPU takes kernels from more
hardware queues than CUDA's default 8 (`train.cuda_connections`, plan/environment.py): with 8, the decode's kernels
on torchvision's stream queue behind the step's.
"""

from __future__ import annotations

import math
import queue
import random
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass

import torch
from torch import nn

MAX_TARGETS = "max_targets"  # batch key: the largest number of targets in one image, known to the host
TARGETS_PER_IMAGE = "targets_per_image"  # batch key: each image's number of targets (a host list; accumulation)
AHEAD = 2  # batches the background thread prepares ahead of the step (each a batch of the network's input)


def targets_per_image(batch_idx: torch.Tensor, batch_size: int) -> list[int] | None:
    """Each image's number of targets, from labels on the CPU (it costs nothing there); None for labels on a GPU
    (reading it back would be a sync; the GPU pipeline reads it with its box count)."""
    if batch_idx.device.type != "cpu":
        return None
    return torch.bincount(batch_idx.long(), minlength=batch_size).tolist()


def max_targets_per_image(batch_idx: torch.Tensor, batch_size: int) -> int | None:
    """The largest number of targets in one image of the batch (targets_per_image's maximum), or None on a GPU."""
    counts = targets_per_image(batch_idx, batch_size)
    return None if counts is None else max(counts, default=0)


def to_device(batch: dict, device: torch.device, *, imgsz: int, stride: int, multi_scale: float = 0.0) -> dict:
    """Ultralytics' DetectionTrainer.preprocess_batch: tensors to the device, images to [0, 1], and with
    multi_scale a random square size between (1 -+ multi_scale) x imgsz, a multiple of the stride."""
    if TARGETS_PER_IMAGE not in batch:  # counted while the labels are on the CPU: where micro-batches split
        batch[TARGETS_PER_IMAGE] = (targets_per_image(batch["batch_idx"], len(batch["img"])) if "batch_idx" in batch
                                    else [1] * len(batch["img"]))  # a classifier's batch: one class per image
    if MAX_TARGETS not in batch:  # the sync-free loss pads every image's targets to it
        counts = batch[TARGETS_PER_IMAGE]
        batch[MAX_TARGETS] = None if counts is None else max(counts, default=0)
    for k, v in batch.items():
        if isinstance(v, torch.Tensor):
            batch[k] = v.to(device, non_blocking=device.type != "cpu")
    if not batch["img"].is_floating_point():  # the GPU pipeline writes the network's input, already scaled
        batch["img"] = batch["img"].float() / 255
    if multi_scale > 0:
        imgs = batch["img"]
        low, high = max(stride, int(imgsz * (1 - multi_scale))), int(imgsz * (1 + multi_scale) + stride)
        scale = random.randrange(low, high) // stride * stride / max(imgs.shape[2:])
        if scale != 1:
            size = [math.ceil(x * scale / stride) * stride for x in imgs.shape[2:]]
            batch["img"] = nn.functional.interpolate(imgs, size=size, mode="bilinear", align_corners=False)
    return batch


@dataclass
class ThreadTime:
    """Where one input thread's time went: waiting for its input (the loader's next batch, or the decoded one),
    working on batches, and blocked with a batch done because the queue after it was full (ahead of the step); and
    the batches it handed on. A thread that works about as long per batch as a step takes is the input's bound."""

    waiting: float = 0.0
    working: float = 0.0
    blocked: float = 0.0
    batches: int = 0

    def __add__(self, other: ThreadTime) -> ThreadTime:
        return ThreadTime(self.waiting + other.waiting, self.working + other.working, self.blocked + other.blocked,
                          self.batches + other.batches)

    def __sub__(self, other: ThreadTime) -> ThreadTime:
        return ThreadTime(self.waiting - other.waiting, self.working - other.working, self.blocked - other.blocked,
                          self.batches - other.batches)

    def per_batch_ms(self) -> dict | None:
        """Milliseconds per batch handed on, and the share of the thread's time spent working; None before any."""
        if self.batches <= 0:
            return None
        total = self.waiting + self.working + self.blocked
        return {"waiting_ms": 1000 * self.waiting / self.batches, "working_ms": 1000 * self.working / self.batches,
                "blocked_ms": 1000 * self.blocked / self.batches, "batches": self.batches,
                "busy": self.working / total if total > 0 else None}


def per_batch_ms(times: dict[str, ThreadTime]) -> dict[str, dict]:
    """ThreadTime.per_batch_ms of each thread that has handed on a batch."""
    figures = {name: t.per_batch_ms() for name, t in times.items()}
    return {name: f for name, f in figures.items() if f is not None}


class TrainInputs:
    """`next(ni)` and `prefetch(ni)` for the loop; `prepare(decode(raw), ni)` makes a loader batch ready for the
    step (the GPU input pipeline's decode, then its augmentation and to_device), its randomness a function of the
    step `ni`. `decode` (None: nothing) is the part that waits: with `background` it has a thread of its own."""

    def __init__(self, loader, sampler, device: torch.device, prepare: Callable[[object, int], dict], *,
                 decode: Callable[[object], object] | None = None, fetch_ahead: bool = True, persistent: bool = True,
                 background: bool = False, clock=time.perf_counter):
        self.loader, self.sampler, self.device = loader, sampler, device
        self.decode, self._prepare_decoded = decode, prepare
        self.fetch_ahead, self.persistent, self.clock = fetch_ahead, persistent, clock
        self.background = background
        self._worker: _Preparer | None = None
        self._closed_times: dict[str, ThreadTime] = {}  # what the threads of earlier iterators took
        self.last_wait = 0.0
        self._iterator = None
        self._ahead: tuple[dict, torch.cuda.Event | None, float] | None = None  # batch, copy done, wait it cost
        self._copy_stream = torch.cuda.Stream(device=device) if device.type == "cuda" and not background else None

    def prepare(self, raw, ni: int) -> dict:
        return self._prepare_decoded(raw if self.decode is None else self.decode(raw), ni)

    def begin_epoch(self, epoch: int, first_step: int, first_ni: int = 0) -> None:
        """`first_ni`: the run's step counter at this epoch's first step (the background thread counts from it)."""
        if self._iterator is None or not self.persistent:
            self._start(epoch, first_step, first_ni)

    def next(self, ni: int) -> dict:
        if self._worker is not None:
            start = self.clock()
            batch, done = self._worker.take(ni)
            self._ahead = (batch, done, self.clock() - start)
            return self._take_ahead()
        if self._ahead is not None:
            return self._take_ahead()
        start = self.clock()
        batch = self.prepare(next(self._iterator), ni)
        self.last_wait = self.clock() - start
        return batch

    def prefetch(self, ni: int) -> None:
        """Fetch batch `ni` now, while the GPU runs the step just launched."""
        if not self.fetch_ahead or self._worker is not None:  # the thread is ahead already
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
        if self._worker is not None:  # the thread prepares the run's next steps: these are they
            first_ni = self._worker.expected
        batches = [self.next(first_ni + j) for j in range(n)]
        self.close()
        return batches

    def _start(self, epoch: int, first_step: int, first_ni: int = 0) -> None:
        self.close()
        self.sampler.start_at(epoch, first_step)
        self._iterator = iter(self.loader)
        if self.background:
            self._worker = _Preparer(self._iterator, self._prepare_decoded, self.device, first_ni, self.decode)

    def thread_times(self) -> dict[str, ThreadTime]:
        """With `background`: each input thread's time so far ("decode": reads the loader and decodes; "prepare":
        augments, or also reads the loader without `decode`), over every iterator of the run; else empty."""
        times = dict(self._closed_times)
        if self._worker is not None:
            for name, t in self._worker.times.items():
                times[name] = times.get(name, ThreadTime()) + t
        return times

    def close(self) -> None:
        if self._worker is not None:
            self._worker.stop()  # before the workers go: the thread may be waiting for their next batch
            self._closed_times = self.thread_times()
            self._worker = None
        self._ahead = None  # a batch fetched ahead belongs to the iterator that is going
        if self._iterator is not None and hasattr(self._iterator, "_shutdown_workers"):
            self._iterator._shutdown_workers()
        self._iterator = None


class _Preparer:
    """Threads that prepare batches ni, ni + 1, ... from `iterator`, AHEAD at a time, on one CUDA stream of their own
    (high priority: its kernels are short, and the next step waits for them). With `decode`, one thread reads and
    decodes, the other prepares what it decoded; both issue work to the same stream, so the device runs it in order
    and the allocator's stream of every tensor is the stream that uses it."""

    def __init__(self, iterator, prepare, device: torch.device, first_ni: int, decode=None):
        self.iterator, self.prepare, self.device, self.decode = iterator, prepare, device, decode
        self.stream = torch.cuda.Stream(device=device, priority=-1) if device.type == "cuda" else None
        self.ready: queue.Queue = queue.Queue(maxsize=AHEAD)
        self.decoded: queue.Queue | None = queue.Queue(maxsize=AHEAD) if decode is not None else None
        self.expected = first_ni  # the step the next take() is for
        # each thread adds to its own (the training thread reads them: a copy, never reset)
        self.times = {"prepare": ThreadTime(), **({"decode": ThreadTime()} if decode is not None else {})}
        self.clock = time.perf_counter
        self._stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(first_ni,), name="input-prepare", daemon=True)]
        if decode is not None:
            self.threads.append(threading.Thread(target=self._decode, name="input-decode", daemon=True))
        for thread in self.threads:
            thread.start()

    def _on_stream(self) -> ExitStack:
        """The calling thread's current device and stream become the preparer's."""
        stack = ExitStack()
        if self.stream is not None:
            stack.enter_context(torch.cuda.device(self.device))
            stack.enter_context(torch.cuda.stream(self.stream))
        return stack

    def _decode(self) -> None:
        times, clock = self.times["decode"], self.clock
        try:
            with self._on_stream():
                while not self._stop.is_set():
                    start = clock()
                    raw = next(self.iterator)
                    read = clock()
                    decoded = self.decode(raw)
                    done = clock()
                    self._put(self.decoded, (True, decoded))
                    times.waiting += read - start
                    times.working += done - read
                    times.blocked += clock() - done
                    times.batches += 1
        except BaseException as e:  # noqa: BLE001 - handed on to the preparing thread, which hands it on
            self._put(self.decoded, (False, e))

    def _next_raw(self):
        """The next loader batch, decoded when there is a decode thread; None once stopped."""
        if self.decoded is None:
            return next(self.iterator)
        while not self._stop.is_set():
            try:
                ok, item = self.decoded.get(timeout=0.1)
            except queue.Empty:
                continue
            if not ok:
                raise item
            return item
        return None

    def _run(self, ni: int) -> None:
        times, clock = self.times["prepare"], self.clock
        try:
            with self._on_stream():
                while not self._stop.is_set():
                    start = clock()
                    raw = self._next_raw()
                    if raw is None:
                        return
                    got = clock()
                    batch = self.prepare(raw, ni)
                    done = None
                    if self.stream is not None:
                        done = torch.cuda.Event()
                        done.record(self.stream)
                    prepared = clock()
                    self._put(self.ready, (ni, batch, done))
                    times.waiting += got - start
                    times.working += prepared - got
                    times.blocked += clock() - prepared
                    times.batches += 1
                    ni += 1
        except BaseException as e:  # noqa: BLE001 - handed to the training thread, which raises it
            self._put(self.ready, (None, e, None))

    def _put(self, q: queue.Queue, item) -> None:
        while not self._stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def take(self, ni: int) -> tuple[dict, torch.cuda.Event]:
        tag, batch, done = self.ready.get()
        if tag is None:
            raise RuntimeError("preparing a training batch failed") from batch
        if tag != ni:
            raise RuntimeError(f"the input thread prepared batch {tag}, the loop asked for {ni}")
        self.expected = ni + 1
        return batch, done

    def stop(self) -> None:
        self._stop.set()
        while any(thread.is_alive() for thread in self.threads):
            for q in (self.ready, self.decoded):
                try:  # make room, so that a put in progress returns; a get in progress gets an item
                    if q is not None:
                        q.get_nowait()
                except queue.Empty:
                    pass
            for thread in self.threads:
                thread.join(timeout=0.05)


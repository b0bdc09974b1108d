"""The device half of the GPU input pipeline: file bytes in, the network's augmented input out.

Per batch, on the stream that prepares it (rank/data/pipeline.py's TrainInputs runs step 1 in a thread of its own,
the rest in another, on a side stream, while the steps before it run):
  1. decode: the JPEGs in one batched nvJPEG call (torchvision's operator: rank/data/torchvision_ops.py); images the
     workers decoded (non-JPEG files, rotated JPEGs: rank/data/encoded.py) are copied up; a batch nvJPEG refuses is
     retried image by image, and an image it still refuses is decoded on the CPU. A file nothing can decode is named in
     the rank's log once and trains as a grey image without labels: the run goes on, and says so.
  2. load: each image resized into a slot of the image buffer (warp.load_into_slots: Ultralytics' load_image), its
     labels stored beside it in the slot's pixels; what the host knows of the batch (slots, sizes, labels) goes up
     in one pinned copy (`upload`).
  3. mosaic partners: drawn uniformly from the buffer's filled slots, the images decoded most recently, as
     Ultralytics' Mosaic draws from its dataset's buffer of recently loaded images (min(n, 8 batches, 1000) of them).
     With mixup or cutmix on, each sample also gets a partner per mix (another image of the buffer, with 3 mosaic
     partners of its own), rendered as an extra row (rank/data/raw_batch.py's RawBatch.groups).
     With loader.mosaic_buffer=false all of them from the same batch, so that a batch depends on its keys and the
     seed alone (a resumed run repeats the uninterrupted one). From epoch `close_at` on (close_mosaic) there are
     none, and so no mosaic, mixup or cutmix: the batch says its epoch, so batches prepared ahead across that
     boundary need no restart.
  4. augment: gpu_augment.GpuAugment with the buffer as its images: the boxes (one host read: how many survive in
     each image), then one pass writes the network's input (and a second the mixed samples, when there are some).

The buffer costs capacity x imgsz^2 x 3 bytes of GPU memory (512 slots at 640 px: 0.6 GiB); a segmentation
dataset's polygons beside the labels capacity x width x M x 8 bytes (width: the most labels of an image, to the next
power of two; 512 slots of 64 labels of 100 points: 25 MiB), an obb dataset's corners the same with M = 4.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from launcher.rank.data.encoded import EncodedBatch, decode_on_cpu
from launcher.rank.data.raw_batch import RawBatch
from launcher.rank.data.torchvision_ops import decode_jpegs_cuda
from launcher.rank.gpu_data.gpu_augment import GpuAugment
from launcher.rank.gpu_data.warp import BORDER, load_into_slots, warm_up


def buffer_capacity(images: int, batch: int) -> int:
    """Ultralytics' BaseDataset.max_buffer_length for an augmenting dataset, never less than one batch."""
    return max(batch, min(images, batch * 8, 1000))


def resized_shape(h0: int, w0: int, imgsz: int) -> tuple[int, int]:
    """BaseDataset.load_image's size: the long side to imgsz, rounded up, at most imgsz."""
    r = imgsz / max(h0, w0)
    if r == 1:
        return h0, w0
    return min(math.ceil(h0 * r), imgsz), min(math.ceil(w0 * r), imgsz)


class Decoder:
    """EncodedBatch -> one (3, h, w) uint8 RGB image per sample on `device`, and which samples could not be decoded."""

    def __init__(self, device: torch.device, files: list[str], log=print):
        self.device, self.files, self.log = device, files, log
        self.reported: set[int] = set()  # images already named in the log

    def __call__(self, batch: EncodedBatch) -> tuple[list[torch.Tensor | None], list[bool]]:
        images: list[torch.Tensor | None] = [None] * len(batch.payloads)
        failed = [False] * len(images)
        encoded = [i for i, p in enumerate(batch.payloads) if p.dim() == 1]
        for i, payload in enumerate(batch.payloads):
            if payload.dim() == 3:
                if payload.numel() == 0:
                    failed[i] = True
                    self._report(batch.indices[i], batch.errors[i])
                else:
                    images[i] = payload.to(self.device, non_blocking=True)
        if encoded:
            for i, image in zip(encoded, self._decode_jpegs([batch.payloads[i] for i in encoded])):
                if image is None:
                    image, error = decode_on_cpu(batch.payloads[i].numpy())
                    if image.numel() == 0:
                        failed[i] = True
                        self._report(batch.indices[i], error)
                        continue
                    image = image.to(self.device)
                images[i] = image
        return images, failed

    def _decode_jpegs(self, data: list[torch.Tensor]) -> list[torch.Tensor | None]:
        if self.device.type != "cuda":  # a CPU rank's workers decode everything; this serves a stray JPEG
            return [None] * len(data)
        try:
            return list(decode_jpegs_cuda(data, self.device))
        except RuntimeError:  # one image nvJPEG refuses fails the whole batch: find it
            out = []
            for d in data:
                try:
                    out.append(decode_jpegs_cuda([d], self.device)[0])
                except RuntimeError:
                    out.append(None)  # the CPU tries next
            return out

    def _report(self, index: int, error: str) -> None:
        if index not in self.reported:
            self.reported.add(index)
            self.log(f"WARNING could not decode {self.files[index]} ({error}): it trains as a grey image without "
                     "labels; remove or replace the file")


def upload(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Host arrays to `device` in one copy: packed (each at an 8-byte boundary) into one pinned buffer on CUDA, so
    that the copy is queued on the current stream and the host goes on at once (a copy from pageable memory waits)."""
    ends = np.cumsum([(a.nbytes + 7) // 8 * 8 for a in arrays])
    cuda = device.type == "cuda"
    host = torch.empty(int(ends[-1]) if len(ends) else 0, dtype=torch.uint8, pin_memory=cuda)
    packed = host.numpy()
    for a, end in zip(arrays, ends):
        start = end - (a.nbytes + 7) // 8 * 8
        packed[start : start + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    moved = host.to(device, non_blocking=cuda)  # the host caching allocator keeps the pages until the copy is done
    out = []
    for a, end in zip(arrays, ends):
        start = int(end - (a.nbytes + 7) // 8 * 8)
        out.append(moved[start : start + a.nbytes].view(TORCH_DTYPES[a.dtype]).view(a.shape))
    return out


TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.float32): torch.float32}


class Decoded(NamedTuple):
    """Step 1's result: a batch's images on the device (None where none could be decoded), and which failed."""

    batch: EncodedBatch
    images: list[torch.Tensor | None]
    failed: list[bool]


class GpuInput:
    """`GpuInput(...)(encoded_batch, generator)` -> the training batch, images already the network's input.
    `decoded(encoded_batch)` is step 1 alone (rank/data/pipeline.py's TrainInputs runs it in a thread of its own: it
    waits for nvJPEG); then `GpuInput(...)(decoded, generator)` does the rest."""

    def __init__(self, augment: GpuAugment, decoder: Decoder, *, capacity: int, device: torch.device,
                 close_at: int | None = None, partners_from_batch: bool = False, timed: bool = True):
        s = augment.imgsz
        self.augment, self.decode, self.device, self.close_at = augment, decoder, device, close_at
        self.partners_from_batch = partners_from_batch  # loader.mosaic_buffer=false: a batch depends on its keys alone
        self.slots = torch.full((capacity, s, s, 3), int(BORDER), dtype=torch.uint8, device=device)
        self.sizes = torch.ones((capacity, 2), dtype=torch.int64, device=device)  # (h, w) of each slot's image
        self.labels = torch.zeros((capacity, 8, 5), dtype=torch.float32, device=device)  # class, x1, y1, x2, y2
        # a pose dataset's keypoints beside each label (x, y in pixels of the slot's image, visibility); None: boxes
        self.points = (torch.zeros((capacity, 8, augment.keypoints, 3), dtype=torch.float32, device=device)
                       if augment.keypoints else None)
        # a segmentation dataset's polygons beside each label (M points, x, y in pixels of the slot's image), or an
        # obb dataset's 4 corners
        self.segments = (torch.zeros((capacity, 8, augment.segments, 2), dtype=torch.float32, device=device)
                         if augment.segments else None)
        self.counts = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.head = self.filled = 0
        self.timer = InputTimer(device, timed)

    @property
    def capacity(self) -> int:
        return len(self.slots)

    def warm_up(self) -> None:
        """The Triton kernels of a batch's load and render compiled ahead, as they will be launched (warp.warm_up):
        on a thread of the set-up (rank/components.py), else the first batch compiles them."""
        augment = self.augment
        warm_up(self.device, self.slots.shape[1], augment.out_dtype or torch.uint8,
                channels_last=augment.out_dtype is not None, hsv=any(augment.hsv_gains), mixes=augment.mixes > 0)

    def mosaic(self, epoch: int) -> bool:
        """Whether a batch of `epoch` gets mosaic partners (none from epoch close_at on: Ultralytics' close_mosaic)."""
        return self.close_at is None or epoch < self.close_at

    def decoded(self, batch: EncodedBatch) -> Decoded:
        return Decoded(batch, *self.decode(batch))

    def __call__(self, batch: EncodedBatch | Decoded, generator: torch.Generator) -> dict:
        start = self.timer.start()
        batch, images, failed = batch if isinstance(batch, Decoded) else self.decoded(batch)
        b, s = len(batch.payloads), self.augment.imgsz
        if b > self.capacity:
            raise ValueError(f"a batch of {b} does not fit an image buffer of {self.capacity}")
        own = np.arange(self.head, self.head + b, dtype=np.int64) % self.capacity
        self.head = (self.head + b) % self.capacity
        self.filled = min(self.filled + b, self.capacity)

        shapes, meta, offset = [], [], 0
        for slot, image in zip(own.tolist(), images):
            h0, w0 = image.shape[1:] if image is not None else (s, s)
            h, w = resized_shape(h0, w0, s)
            shapes.append((h0, w0, h, w))
            if image is not None:
                meta.append((offset, h0, w0, slot, h, w))
                offset += image.numel()
        counts = batch.counts.numpy().copy()
        counts[np.asarray(failed, dtype=bool)] = 0
        self._fit_labels(int(counts.max()) if b else 0)
        hw = np.array([sh[2:] for sh in shapes], np.int64).reshape(b, 2)
        # Everything the host knows about the batch goes up in one pinned copy: the thread waits for no transfer
        rows, payloads = self._label_rows(batch, counts, shapes)
        slots, counts, hw, meta, rows, *payloads = upload(
            [own, counts, hw, np.array(meta, np.int64).reshape(-1, 6), rows, *payloads], self.device)
        present = [im.reshape(-1) for im in images if im is not None]
        if present:
            load_into_slots(torch.cat(present) if len(present) > 1 else present[0], meta, self.slots)
        for slot, bad in zip(own.tolist(), failed):
            if bad:
                self.slots[slot].fill_(int(BORDER))
        self.labels.index_copy_(0, slots, rows)
        for store, payload in zip(self._payloads(), payloads):
            store.index_copy_(0, slots, payload)
        self.counts.index_copy_(0, slots, counts)
        self.sizes.index_copy_(0, slots, hw)

        groups = slots[:, None]
        if self.mosaic(batch.epoch):
            groups = torch.cat((groups, self._partners(groups, b * 3, generator).view(b, 3)), 1)
            if self.augment.mixes:  # MixUp's and CutMix's partners: another image each, with 3 mosaic partners
                groups = torch.cat((groups, self._partners(groups, b * 4 * self.augment.mixes, generator).view(-1, 4)))
        out = self.augment(self._raw(batch, groups, shapes), generator)
        self.timer.stop(start, b)
        return out

    def _partners(self, groups: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
        """n slots drawn uniformly from the buffer's filled ones, or from the batch's own (`partners_from_batch`)."""
        if self.partners_from_batch:
            return groups[torch.randint(0, len(groups), (n,), generator=generator, device=self.device), 0]
        return torch.randint(0, self.filled, (n,), generator=generator, device=self.device)

    def _payloads(self) -> list[torch.Tensor]:
        """The stores beside the labels, in _label_rows' order: the keypoints, the polygons (those the data has)."""
        return [t for t in (self.points, self.segments) if t is not None]

    def _fit_labels(self, most: int) -> None:
        """Grow the label store (and the keypoints or polygons beside it) when an image has more boxes than a slot
        holds (to the next power of two)."""
        if most > self.labels.shape[1]:
            width = 2 ** math.ceil(math.log2(most))

            def grown(store: torch.Tensor) -> torch.Tensor:
                out = torch.zeros((self.capacity, width, *store.shape[2:]), device=self.device)
                out[:, : store.shape[1]] = store
                return out

            self.labels = grown(self.labels)
            self.points = None if self.points is None else grown(self.points)
            self.segments = None if self.segments is None else grown(self.segments)

    def _label_rows(self, batch: EncodedBatch, counts: np.ndarray, shapes) -> tuple[np.ndarray, list[np.ndarray]]:
        """The batch's labels as the label store holds them: (B, width, 5) rows of class, x1, y1, x2, y2 in pixels of
        their slot's image, and the payloads beside them (_payloads' order): keypoints (B, width, P, 3) x, y
        (pixels), visibility; polygons (B, width, M, 2) x, y (pixels). An image that could not be decoded has none."""
        rows = np.zeros((len(shapes), self.labels.shape[1], 5), np.float32)
        points = None if self.points is None else np.zeros((len(shapes), *self.points.shape[1:]), np.float32)
        outlines = None if self.segments is None else np.zeros((len(shapes), *self.segments.shape[1:]), np.float32)
        start = 0
        for k, n in enumerate(batch.counts.tolist()):
            if counts[k]:
                h, w = shapes[k][2:]
                xywh = batch.xywh[start : start + n].numpy() * np.array([w, h, w, h], np.float32)
                rows[k, :n, 0] = batch.cls[start : start + n].numpy()
                rows[k, :n, 1:3] = xywh[:, :2] - xywh[:, 2:] / 2
                rows[k, :n, 3:5] = xywh[:, :2] + xywh[:, 2:] / 2
                if points is not None:
                    points[k, :n] = batch.keypoints[start : start + n].numpy() * np.array([w, h, 1], np.float32)
                if outlines is not None:
                    outlines[k, :n] = batch.segments[start : start + n].numpy() * np.array([w, h], np.float32)
            start += n
        return rows, [a for a in (points, outlines) if a is not None]

    def _raw(self, batch: EncodedBatch, groups: torch.Tensor, shapes) -> RawBatch:
        """The augmentation's view of the buffer: every label row of every tile, padding rows marked invalid."""
        b, t = groups.shape  # b: the rows, the samples and then their mix partners
        width = self.labels.shape[1]
        labels = self.labels[groups]  # (rows, T, width, 5)
        valid = torch.arange(width, device=self.device) < self.counts[groups][..., None]
        sample = torch.arange(b, device=self.device).view(b, 1, 1).expand(b, t, width)
        tile = torch.arange(t, device=self.device).view(1, t, 1).expand(b, t, width)
        rows = torch.cat((sample[..., None].float(), tile[..., None].float(), labels), -1).view(-1, 7)
        files = self.decode.files
        points = None if self.points is None else self.points[groups].view(-1, *self.points.shape[2:])
        outlines = None if self.segments is None else self.segments[groups].view(-1, *self.segments.shape[2:])
        return RawBatch(
            images=self.slots, sizes=self.sizes, groups=groups, labels=rows, valid=valid.view(-1), rgb=True,
            keypoints=points, segments=outlines,
            im_file=tuple(files[i] for i in batch.indices),
            ori_shape=tuple(sh[:2] for sh in shapes),
            ratio_pad=tuple((sh[2] / sh[0], sh[3] / sh[1]) for sh in shapes),
        )

    def take_gpu_time(self) -> tuple[float, int]:
        """(GPU milliseconds, images) of the input work measured since the last call."""
        return self.timer.take()


class InputTimer:
    """The GPU time of an input's batches, decode to augmented batch, read without waiting: `start()` before a
    batch's work, `stop(start, images)` after it, `take()` what completed since the last take. No events (zero
    time) on the CPU or when not `timed`."""

    def __init__(self, device: torch.device, timed: bool = True):
        self.on = timed and device.type == "cuda"
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event, int]] = []
        self.ms, self.images = 0.0, 0  # of the batches whose events have completed

    def start(self) -> torch.cuda.Event | None:
        if not self.on:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, start: torch.cuda.Event | None, images: int) -> None:
        if start is not None:
            self._events.append((start, self.start(), images))
            self._collect()

    def _collect(self) -> None:
        """Add up the batches whose events have completed; never waits."""
        while self._events and self._events[0][1].query():
            start, end, images = self._events.pop(0)
            self.ms += start.elapsed_time(end)
            self.images += images

    def take(self) -> tuple[float, int]:
        self._collect()
        taken = (self.ms, self.images)
        self.ms, self.images = 0.0, 0
        return taken

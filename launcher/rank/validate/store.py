"""The validation split of this rank, loaded once per run and kept where the network reads it.

The rank's shard of Ultralytics' own validation loader is iterated once (its workers decode and letterbox every
image: rectangular batches with pad 0.5, Ultralytics' pixels exactly) and what it yields is kept: the letterboxed
images as uint8, grouped by shape, on the device when they fit (else in pinned host memory, copied per batch), and
each image's labels padded to the group's most. Every validation reads them from there.

Getting them there is `read` (host memory only: a thread may do it during training) then `Placement` (the copy to
the device, a slice between two training steps, or all of it at the first validation).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

DEVICE_SHARE = 0.5  # of the device's free memory the images may take; beyond it they stay in host memory
SLICE_BYTES = 32 << 20  # images copied to the device between two training steps: the host stages each slice itself


def device_free(device: torch.device) -> int:
    """Bytes this process may still take on the device: the driver's free memory, or less where the process is
    held to a share of it (train.batch_per_device=auto: rank/step/auto_batch.py) and has reserved most of that."""
    free, total = torch.cuda.mem_get_info(device)
    held = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.8
    if held is not None:
        free = min(free, max(0, int(held(device) * total) - torch.cuda.memory_reserved(device)))
    return free


@dataclass
class ValBatch:
    """`n` images of one shape (`img` may hold more rows: a fixed-size batch), their labels and their records."""

    img: torch.Tensor  # (n, 3, H, W) uint8, on the device
    cls: torch.Tensor  # (n, T) float32 class ids
    xywh: torch.Tensor  # (n, T, 4) float32 normalised to the letterboxed image, as Ultralytics' loader gives them
    count: torch.Tensor  # (n,) int64 labels per image
    files: list[str]
    ori_shape: list
    ratio_pad: list
    keypoints: torch.Tensor | None = None  # (n, T, K, 3) float32 normalised as xywh (a pose dataset's), else None
    masks: torch.Tensor | None = None  # (n, h, w) a segmentation dataset's: target i's pixels i + 1 (overlap_mask)

    @property
    def n(self) -> int:
        return len(self.files)

    def valid(self) -> torch.Tensor:
        return torch.arange(self.cls.shape[1], device=self.cls.device) < self.count[:, None]

    def ultralytics_targets(self) -> dict:
        """The labels in the loader's layout (batch_idx, cls (N, 1), bboxes (N, 4), a pose dataset's keypoints
        (N, K, 3), a segmentation dataset's masks (n, h, w)), which the loss reads."""
        valid = self.valid()
        idx = torch.arange(self.n, device=self.cls.device)[:, None].expand_as(valid)[valid]
        targets = {"batch_idx": idx.float(), "cls": self.cls[valid][:, None], "bboxes": self.xywh[valid]}
        if self.keypoints is not None:
            targets["keypoints"] = self.keypoints[valid]
        if self.masks is not None:
            targets["masks"] = self.masks
        return targets


class _Group:
    """The images of one letterboxed shape, in loader order."""

    def __init__(self):
        self.images: list[torch.Tensor] = []
        self.labels: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []  # cls, xywh, keypoints
        self.files, self.ori_shape, self.ratio_pad = [], [], []
        self.masks: list[torch.Tensor] | torch.Tensor | None = []  # an image's overlap mask each, then stacked
        self.keypoints: torch.Tensor | None = None

    def stack(self) -> None:
        """On the host: the images as one tensor, each image's labels padded to the group's most."""
        n = len(self.files)
        width = max([len(c) for c, _, _ in self.labels] + [1])
        cls, xywh, count = torch.zeros((n, width)), torch.zeros((n, width, 4)), torch.zeros(n, dtype=torch.int64)
        shape = next((k.shape[1:] for _, _, k in self.labels if k is not None), None)
        keypoints = torch.zeros((n, width, *shape)) if shape is not None else None
        for i, (c, b, k) in enumerate(self.labels):
            cls[i, : len(c)], xywh[i, : len(c)], count[i] = c, b, len(c)
            if keypoints is not None:
                keypoints[i, : len(c)] = k
        self.img, self.cls, self.xywh, self.count = torch.stack(self.images), cls, xywh, count
        self.keypoints = keypoints
        if self.masks:  # target indices: uint8, int32 where an image has over 255 targets (as Ultralytics' masks);
            # by value, as a batch holding an image without targets comes in float (Format gives it float zeros)
            dtype = torch.uint8 if max(int(m.max()) for m in self.masks) <= 255 else torch.int32
            self.masks = torch.stack([m.to(dtype) for m in self.masks])
        else:
            self.masks = None
        self.images = []

    def place_labels(self, device: torch.device) -> None:
        self.cls, self.xywh, self.count = self.cls.to(device), self.xywh.to(device), self.count.to(device)
        if self.keypoints is not None:
            self.keypoints = self.keypoints.to(device)
        if self.masks is not None:
            self.masks = self.masks.to(device)


class Placement:
    """`read`'s groups on their way to the device: `advance()` copies one slice of images (SLICE_BYTES), `finish()`
    copies what is left and gives the PreloadedSplit. A training run advances it between steps, on the training
    thread (never while that thread captures a graph), so that the first validation finds the images on the device.

    The copies run on a stream of their own, so the training stream never waits for them; from pageable memory the
    driver stages each copy before it returns, so the host's share is a slice's memcpy, not the whole split's. Where
    the images do not fit (DEVICE_SHARE of the free memory, asked now), nothing is copied ahead: `finish()` pins them
    in host memory, as PreloadedSplit.place does. Off CUDA there is nothing to copy, unless `ahead` asks (the tests:
    the slicing on the CPU)."""

    def __init__(self, groups: dict[tuple[int, int], _Group], device: torch.device, *, slice_bytes: int = SLICE_BYTES,
                 ahead: bool | None = None):
        self.groups, self.device, self.slice_bytes = groups, device, slice_bytes
        nbytes = sum(g.img.numel() for g in groups.values())
        self.on_device = device.type != "cuda" or nbytes <= DEVICE_SHARE * device_free(device)
        self.ahead = (device.type == "cuda" and self.on_device) if ahead is None else ahead
        self.stream = torch.cuda.Stream(device) if self.ahead and device.type == "cuda" else None
        self._left = [g for g in groups.values() if len(g.files)] if self.ahead else []
        self._targets: dict[int, torch.Tensor] = {}  # id(group) -> its images on the device, filled row by row
        self._row = 0  # the next row of self._left[0] to copy
        self.copied = 0  # bytes copied so far
        self.slices = 0  # advance() calls that copied something

    @property
    def done(self) -> bool:
        return not self._left

    def advance(self, budget: int | None = None) -> bool:
        """One slice (or `budget` bytes) more to the device, in whole images; True once nothing is left to copy."""
        budget = self.slice_bytes if budget is None else budget
        copied = 0
        while self._left and copied < budget:
            group = self._left[0]
            src, n = group.img, len(group.files)
            per_image = src[0].numel() * src.element_size()
            fits = (budget - copied) // per_image
            if not fits and copied:  # the slice is full; one image at least in each
                break
            end = min(n, self._row + max(1, fits))
            with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
                if id(group) not in self._targets:  # allocated on the copies' stream, which fills it
                    self._targets[id(group)] = torch.empty(src.shape, dtype=src.dtype, device=self.device)
                self._targets[id(group)][self._row:end].copy_(src[self._row:end], non_blocking=True)
            copied += (end - self._row) * per_image
            self._row = end
            if end == n:
                self._left.pop(0)
                self._row = 0
        self.copied += copied
        self.slices += copied > 0
        return self.done

    def finish(self) -> PreloadedSplit:
        """Every image where it is read from, the copies waited for by the current stream: the split."""
        self.advance(budget=1 << 62)  # all that is left, in one call
        if self.stream is not None:  # the images are read on the current stream from now on
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self.stream)
            for target in self._targets.values():
                target.record_stream(current)
        for group in self.groups.values():
            if id(group) in self._targets:
                group.img = self._targets[id(group)]
            elif self.on_device:
                group.img = group.img.to(self.device)
            elif self.device.type == "cuda":
                group.img = group.img.pin_memory()
            group.place_labels(self.device)
        self._targets.clear()
        return PreloadedSplit(self.groups, self.device, self.on_device)


class PreloadedSplit:
    """`PreloadedSplit.load(loader_batches, device)`, then `batches(size)` as often as wanted. `load` is `read` (on
    the host) then `place` (on the device), which a caller may run apart: `read` makes no CUDA call, so a thread may
    run it while the training thread captures CUDA graphs (another thread's allocation or copy would invalidate a
    capture in progress); `Placement` places a slice at a time."""

    def __init__(self, groups: dict[tuple[int, int], _Group], device: torch.device, on_device: bool):
        self.groups, self.device, self.on_device = groups, device, on_device

    @classmethod
    def load(cls, batches, device: torch.device, on_batch=lambda: None) -> PreloadedSplit:
        return cls.place(cls.read(batches, on_batch), device)

    @staticmethod
    def read(batches, on_batch=lambda: None) -> dict[tuple[int, int], _Group]:
        """Ultralytics' collated validation batches (img uint8 (b, 3, H, W), batch_idx, cls, bboxes, a pose
        dataset's keypoints, a segmentation dataset's masks (b, h, w) with overlap_mask, im_file, ori_shape,
        ratio_pad), grouped by image shape and stacked, in host memory."""
        groups: dict[tuple[int, int], _Group] = {}
        for batch in batches:
            img = batch["img"]
            group = groups.setdefault(tuple(img.shape[2:]), _Group())
            idx = batch["batch_idx"].long()
            for i in range(img.shape[0]):
                mine = idx == i
                group.images.append(img[i])
                keypoints = batch["keypoints"][mine].float() if "keypoints" in batch else None
                group.labels.append((batch["cls"][mine].view(-1).float(), batch["bboxes"][mine].float(), keypoints))
                group.files.append(batch["im_file"][i])
                group.ori_shape.append(batch["ori_shape"][i])
                group.ratio_pad.append(batch["ratio_pad"][i])
                if "masks" in batch:
                    group.masks.append(batch["masks"][i])
            on_batch()
        for group in groups.values():
            group.stack()
        return groups

    @classmethod
    def place(cls, groups: dict[tuple[int, int], _Group], device: torch.device) -> PreloadedSplit:
        """`read`'s groups on the device when they fit (DEVICE_SHARE of its free memory), else in pinned host memory."""
        return Placement(groups, device).finish()

    def __len__(self) -> int:
        return sum(len(g.files) for g in self.groups.values())

    @property
    def nbytes(self) -> int:
        return sum(g.img.numel() for g in self.groups.values())

    @property
    def shapes(self) -> dict[tuple[int, int], int]:
        """{(H, W): images of that shape}."""
        return {shape: len(g.files) for shape, g in self.groups.items()}

    def batches(self, size: int):
        """ValBatch after ValBatch of at most `size` images of one shape, every image once, in loader order per shape."""
        for group in self.groups.values():
            for start in range(0, len(group.files), size):
                end = min(start + size, len(group.files))
                img = group.img[start:end]
                yield ValBatch(img=img.to(self.device, non_blocking=True) if not self.on_device else img,
                               cls=group.cls[start:end], xywh=group.xywh[start:end], count=group.count[start:end],
                               files=group.files[start:end], ori_shape=group.ori_shape[start:end],
                               ratio_pad=group.ratio_pad[start:end],
                               keypoints=None if group.keypoints is None else group.keypoints[start:end],
                               masks=None if group.masks is None else group.masks[start:end])

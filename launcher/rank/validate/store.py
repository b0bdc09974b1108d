"""The validation split of this rank, loaded once per run and kept where the network reads it.

The first validation iterates the rank's shard of Ultralytics' own validation loader once (its workers decode and
letterbox every image: rectangular batches with pad 0.5, Ultralytics' pixels exactly) and keeps what it yields:
the letterboxed images as uint8, grouped by shape, on the device when they fit (else in pinned host memory, copied
per batch), and each image's labels padded to the group's most. Every later validation reads them from there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEVICE_SHARE = 0.5  # of the device's free memory the images may take; beyond it they stay in host memory


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

    @property
    def n(self) -> int:
        return len(self.files)

    def valid(self) -> torch.Tensor:
        return torch.arange(self.cls.shape[1], device=self.cls.device) < self.count[:, None]

    def ultralytics_targets(self) -> dict:
        """The labels in the loader's flat layout (batch_idx, cls (N, 1), bboxes (N, 4)), which the loss reads."""
        valid = self.valid()
        idx = torch.arange(self.n, device=self.cls.device)[:, None].expand_as(valid)[valid]
        return {"batch_idx": idx.float(), "cls": self.cls[valid][:, None], "bboxes": self.xywh[valid]}


class _Group:
    """The images of one letterboxed shape, in loader order."""

    def __init__(self):
        self.images: list[torch.Tensor] = []
        self.labels: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.files, self.ori_shape, self.ratio_pad = [], [], []

    def stack(self) -> None:
        """On the host: the images as one tensor, each image's labels padded to the group's most."""
        n = len(self.files)
        width = max([len(c) for c, _ in self.labels] + [1])
        cls, xywh, count = torch.zeros((n, width)), torch.zeros((n, width, 4)), torch.zeros(n, dtype=torch.int64)
        for i, (c, b) in enumerate(self.labels):
            cls[i, : len(c)], xywh[i, : len(c)], count[i] = c, b, len(c)
        self.img, self.cls, self.xywh, self.count = torch.stack(self.images), cls, xywh, count
        self.images = []

    def place(self, device: torch.device, on_device: bool) -> None:
        if on_device:
            self.img = self.img.to(device)
        elif device.type == "cuda":
            self.img = self.img.pin_memory()
        self.cls, self.xywh, self.count = self.cls.to(device), self.xywh.to(device), self.count.to(device)


class PreloadedSplit:
    """`PreloadedSplit.load(loader_batches, device)`, then `batches(size)` as often as wanted. `load` is `read` (on
    the host) then `place` (on the device), which a caller may run apart: `read` makes no CUDA call, so a thread may
    run it while the training thread captures CUDA graphs (another thread's allocation or copy would invalidate a
    capture in progress)."""

    def __init__(self, groups: dict[tuple[int, int], _Group], device: torch.device, on_device: bool):
        self.groups, self.device, self.on_device = groups, device, on_device

    @classmethod
    def load(cls, batches, device: torch.device, on_batch=lambda: None) -> PreloadedSplit:
        return cls.place(cls.read(batches, on_batch), device)

    @staticmethod
    def read(batches, on_batch=lambda: None) -> dict[tuple[int, int], _Group]:
        """Ultralytics' collated validation batches (img uint8 (b, 3, H, W), batch_idx, cls, bboxes, im_file,
        ori_shape, ratio_pad), grouped by image shape and stacked, in host memory."""
        groups: dict[tuple[int, int], _Group] = {}
        for batch in batches:
            img = batch["img"]
            group = groups.setdefault(tuple(img.shape[2:]), _Group())
            idx = batch["batch_idx"].long()
            for i in range(img.shape[0]):
                mine = idx == i
                group.images.append(img[i])
                group.labels.append((batch["cls"][mine].view(-1).float(), batch["bboxes"][mine].float()))
                group.files.append(batch["im_file"][i])
                group.ori_shape.append(batch["ori_shape"][i])
                group.ratio_pad.append(batch["ratio_pad"][i])
            on_batch()
        for group in groups.values():
            group.stack()
        return groups

    @classmethod
    def place(cls, groups: dict[tuple[int, int], _Group], device: torch.device) -> PreloadedSplit:
        """`read`'s groups on the device when they fit (DEVICE_SHARE of its free memory), else in pinned host memory."""
        nbytes = sum(g.img.numel() for g in groups.values())
        on_device = device.type != "cuda" or nbytes <= DEVICE_SHARE * device_free(device)
        for group in groups.values():
            group.place(device, on_device)
        return cls(groups, device, on_device)

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
                               ratio_pad=group.ratio_pad[start:end])

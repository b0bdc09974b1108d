"""The batch the loader's side hands the GPU augmentation (rank/gpu_data/gpu_augment.py): raw images, which of them
form each sample and each mix partner, and their labels as pixel boxes."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch


@dataclass
class RawBatch:
    """What the CPU hands over: raw images, which of them form each sample, their labels as pixel boxes.

    images     (N, S, S, 3) uint8, BGR: raw image i, resized like `load_image` (long side S, aspect kept), occupies
               images[i, :h_i, :w_i]; the rest is padding that is never read.
    sizes      (N, 2) int64: (h_i, w_i).
    groups     (R, T) int64: the raw images of each rendered sample; T = 4 (mosaic tiles: top left, top right, bottom
               left, bottom right, the sample's own image first) or T = 1 (no mosaic, and so no mix: close_mosaic).
               Rows 0..B-1 are the B output samples; with T = 4 and mixup or cutmix on, GpuAugment.mixes blocks of B
               rows follow, MixUp's partners first, then CutMix's: row j B + b is sample b's partner of block j.
    labels     (K, 7) float32: (sample, tile, class, x1, y1, x2, y2), the box in pixels of that tile's raw image,
               ordered by sample (the row of `groups`), then tile, then as in the label file.
    im_file, ori_shape, ratio_pad: per output sample, of its own image (what Ultralytics' batch carries).
    keypoints  (K, P, 3) float32 or None: a pose dataset's P keypoints per label row (x, y in pixels of that tile's
               raw image, visibility 0..1), in the order of `labels`; None for boxes alone.
    segments   (K, M, 2) float32 or None: a polygon per label row (polygon labels), M points (x, y in pixels of
               that tile's raw image) along its outline, or an obb dataset's 4 corners (M = 4), in the order of
               `labels`; None without polygons.
    """

    images: torch.Tensor
    sizes: torch.Tensor
    groups: torch.Tensor
    labels: torch.Tensor
    im_file: tuple[str, ...]
    ori_shape: tuple[tuple[int, int], ...]
    ratio_pad: tuple[tuple[float, float], ...]
    rgb: bool = False  # the images' channel order: BGR as Ultralytics loads them, RGB as the GPU decoder writes them
    valid: torch.Tensor | None = None  # (K,) bool: which label rows are labels (the image buffer pads them); None: all
    keypoints: torch.Tensor | None = None  # (K, P, 3) float32: see above
    segments: torch.Tensor | None = None  # (K, M, 2) float32: see above

    @property
    def samples(self) -> int:
        """B, the output samples (the rows of `groups` past them are mix partners)."""
        return len(self.im_file)

    def _map_tensors(self, fn) -> RawBatch:
        tensors = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(self, **{k: fn(v) for k, v in tensors.items() if isinstance(v, torch.Tensor)})

    def pin_memory(self) -> RawBatch:
        """Called by the DataLoader's pin-memory thread (pin_memory=True)."""
        return self._map_tensors(lambda t: t.pin_memory())

    def to(self, device, non_blocking: bool = False) -> RawBatch:
        return self._map_tensors(lambda t: t.to(device, non_blocking=non_blocking))

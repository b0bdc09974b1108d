"""A test helper: Ultralytics' own `load_image` as raw_batch.RawBatches (BGR pixels and pixel boxes), so that the
device augmentation can be compared draw for draw with Ultralytics' pipeline on the very images it loads. (The rank's
GPU input pipeline reads file bytes instead: rank/data/encoded.py and rank/gpu_data/gpu_input.py.)

Per sample the CPU does only what Ultralytics' `load_image` does -- read (or take from a cache) and resize the long
side to imgsz -- for the sample's own image and, while mosaic is on, its 3 mosaic partners; mosaic, warp, colour and
flips happen on the device (gpu_augment.py). The wrapped Ultralytics YOLODataset is used through `load_image(i)` and
`labels[i]` only, so Ultralytics' RAM and disk caches, and a subclass that overrides `load_image` (a node-shared
cache), work unchanged.

Keys are sampler.EpochBatchSampler's (epoch, index) pairs. Where the partners come from (`partners`):
  * "dataset" (default): 3 indices drawn uniformly over the dataset from (seed, epoch, index), what Ultralytics does
    with cache='ram'. Four `load_image` calls per sample: cheap from a RAM cache, 4 decodes without one.
  * "batch": 3 samples drawn, from (seed, epoch, index), among the same batch, whose images are loaded anyway. One
    `load_image` per sample and a quarter of the bytes to move; like Ultralytics' default (cache != 'ram'), which draws
    partners from a buffer of the images its worker loaded last, but from a smaller pool (the batch).
Either way a batch is a pure function of its keys: the same whatever the number of workers.

    dataset = RawTrainDataset(datasets.raw_train_dataset(hyp, data, batch), seed)  # rank/ultralytics/datasets.py
    loader = DataLoader(dataset, batch_sampler=EpochBatchSampler(...), collate_fn=dataset.collate_fn, pin_memory=True)
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset

from launcher.rank.data.encoded import outlined, resample_segments
from launcher.rank.data.raw_batch import RawBatch
from launcher.rank.data.sampler import sample_seed
from launcher.rank.gpu_data.warp import BORDER

PARTNERS = ("dataset", "batch")


class RawTile(NamedTuple):
    """One raw image as `load_image` returns it, with its labels in its own pixels."""

    index: int
    image: np.ndarray  # (h, w, 3) uint8 BGR, long side = imgsz
    labels: np.ndarray  # (n, 5) float32: class, x1, y1, x2, y2
    ori_shape: tuple[int, int]  # (h0, w0) before resizing
    im_file: str
    keypoints: np.ndarray | None = None  # (n, P, 3) float32 of a pose dataset: x, y in its own pixels, visibility
    segments: np.ndarray | None = None  # (n, M, 2) float32 of a segmentation dataset: its polygons, in its pixels


class RawSample(NamedTuple):
    """What a worker returns for one key: the tiles it loaded."""

    key: tuple[int, int]  # (epoch, index)
    tiles: list[RawTile]  # the sample's own image first, then its partners when the dataset draws them


class RawTrainDataset(Dataset):
    """(epoch, index) -> RawSample; `collate_fn` packs a list of them into one RawBatch."""

    def __init__(self, dataset, seed: int, *, mosaic: bool = True, partners: str = "dataset", segment_points: int = 0):
        if partners not in PARTNERS:
            raise ValueError(f"partners must be one of {PARTNERS}, not {partners!r}")
        if getattr(dataset, "rect", False):
            raise ValueError("a rect dataset has no square images to mosaic: build it with rect=False")
        self.dataset, self.seed, self.mosaic, self.partners = dataset, seed, mosaic, partners
        self.segment_points = segment_points if outlined(dataset) else 0  # M, or no outlines (encoded.outlined)
        self.imgsz = int(dataset.imgsz)

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def labels(self) -> list[dict]:
        """The wrapped dataset's labels: what Ultralytics' trainer reads off its training dataset (class weights)."""
        return self.dataset.labels

    def close_mosaic(self) -> None:
        """No partners from now on (Ultralytics' close_mosaic). Workers hold copies: restart them after this."""
        self.mosaic = False

    def __getitem__(self, key: tuple[int, int]) -> RawSample:
        epoch, index = key
        indices = [index]
        if self.mosaic and self.partners == "dataset":
            indices += self._rng(key).integers(0, len(self), 3).tolist()
        return RawSample((epoch, index), [self._tile(i) for i in indices])

    def _rng(self, key: tuple[int, int]) -> np.random.Generator:
        return np.random.default_rng(sample_seed(self.seed, *key))

    def _tile(self, i: int) -> RawTile:
        image, ori_shape, (h, w) = self.dataset.load_image(i)
        if image.ndim != 3 or image.shape[2] != 3:
            raise ValueError(f"loader.gpu_augment needs 3-channel images: {self.dataset.im_files[i]} is {image.shape}")
        label = self.dataset.labels[i]
        xywh = np.asarray(label["bboxes"], np.float32).reshape(-1, 4) * np.array([w, h, w, h], np.float32)
        xyxy = np.concatenate((xywh[:, :2] - xywh[:, 2:] / 2, xywh[:, :2] + xywh[:, 2:] / 2), 1)
        cls = np.asarray(label["cls"], np.float32).reshape(-1, 1)
        points = None
        if getattr(self.dataset, "use_keypoints", False):
            width = int(self.dataset.data["kpt_shape"][0])
            points = np.asarray(label["keypoints"], np.float32).reshape(-1, width, 3) * np.array([w, h, 1], np.float32)
        outlines = None
        if self.segment_points:  # as the rank's workers resample them (encoded.py)
            polygons = [np.asarray(p, np.float32).reshape(-1, 2) for p in label["segments"]]
            starts = np.concatenate(([0], np.cumsum([len(p) for p in polygons]))).astype(np.int64)
            flat = np.concatenate(polygons) if polygons else np.zeros((0, 2), np.float32)
            outlines = resample_segments(flat, starts, self.segment_points) * np.array([w, h], np.float32)
        return RawTile(i, image, np.concatenate((cls, xyxy), 1), tuple(ori_shape), label["im_file"], points, outlines)

    def _groups(self, samples: list[RawSample]) -> list[list[RawTile]]:
        """Each sample's tiles: its own image, then its mosaic partners (none after close_mosaic)."""
        if not (self.mosaic and self.partners == "batch"):
            return [sample.tiles for sample in samples]
        own = [sample.tiles[0] for sample in samples]
        groups = []
        for tile, sample in zip(own, samples):
            partners = self._rng(sample.key).integers(0, len(own), 3)
            groups.append([tile, *(own[j] for j in partners)])
        return groups

    def collate_fn(self, samples: list[RawSample]) -> RawBatch:
        """One RawBatch: every distinct raw image once, in one contiguous uint8 tensor (a single pinned copy)."""
        groups = self._groups(samples)
        slot: dict[int, int] = {}  # dataset index -> row in `images`; the samples' own images come first
        distinct: list[RawTile] = []
        for tile in [group[0] for group in groups] + [t for group in groups for t in group[1:]]:
            if tile.index not in slot:
                slot[tile.index] = len(distinct)
                distinct.append(tile)

        s = self.imgsz
        images = torch.empty((len(distinct), s, s, 3), dtype=torch.uint8)
        for row, tile in enumerate(distinct):
            h, w = tile.image.shape[:2]
            images[row, :h, :w] = torch.from_numpy(tile.image)
            images[row, h:], images[row, :h, w:] = BORDER, BORDER  # never read, but the same bytes every time
        rows = [
            np.concatenate((np.full((len(t.labels), 2), (b, q), np.float32), t.labels), 1)
            for b, group in enumerate(groups)
            for q, t in enumerate(group)
        ]
        own = [group[0] for group in groups]
        points = [t.keypoints for group in groups for t in group]  # a pose dataset's, in the labels' order
        outlines = [t.segments for group in groups for t in group]  # a segmentation dataset's
        return RawBatch(
            keypoints=torch.from_numpy(np.concatenate(points)) if own[0].keypoints is not None else None,
            segments=torch.from_numpy(np.concatenate(outlines)) if own[0].segments is not None else None,
            images=images,
            sizes=torch.tensor([t.image.shape[:2] for t in distinct], dtype=torch.int64).view(-1, 2),
            groups=torch.tensor([[slot[t.index] for t in group] for group in groups], dtype=torch.int64),
            labels=torch.from_numpy(np.concatenate(rows, 0)),
            im_file=tuple(t.im_file for t in own),
            ori_shape=tuple(t.ori_shape for t in own),
            ratio_pad=tuple((t.image.shape[0] / t.ori_shape[0], t.image.shape[1] / t.ori_shape[1]) for t in own),
        )

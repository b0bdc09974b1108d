"""The CPU half of the GPU input pipeline (`loader.augment_on=gpu`): a training sample is its file's bytes and its labels.

A loader worker reads the file (or takes its bytes from the node-shared cache, which then holds compressed files)
and does not decode it, except where the GPU decoder cannot: a file that is not a JPEG (PNG, BMP, WebP, ...), and a
JPEG whose EXIF orientation is not upright (nvJPEG ignores it; OpenCV, and so Ultralytics, applies it). Those are
decoded here, by torchvision's decoders on the CPU (torchvision_ops.py), into the planar RGB the GPU decoder would
give. On a CPU rank everything is decoded here (`decode_all`): there is no GPU to do it.

    dataset = EncodedTrainDataset(EncodedImages.of(ultralytics_dataset), decode_all=device.type == "cpu")
    # with train.cache=shared: cache=image_cache.ensure_file_cache(files, ...), the files' bytes mapped
    loader = DataLoader(dataset, batch_sampler=EpochBatchSampler(...), collate_fn=dataset.collate_fn)

Labels are read once, in the rank, from the dataset Ultralytics built (its label cache and image checks), and
travel to the workers as a few flat arrays.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset

from launcher.rank.data import torchvision_ops

JPEG_MAGIC = b"\xff\xd8\xff"
EXIF_ORIENTATION = 0x0112
LABEL_ARRAYS = ("cls", "xywh", "counts", "keypoints", "segments")  # an EncodedBatch's labels, pickled as arrays


class EncodedImages(NamedTuple):
    """A split's files and labels: labels of image i are rows starts[i]:starts[i+1] of `cls`, `xywh` and, for a
    pose dataset, `keypoints`; for a segmentation dataset label row r's polygon is vertices
    segment_starts[r]:segment_starts[r+1] of `segments`, handed over as `segment_points` points (resampled)."""

    files: list[str]
    cls: np.ndarray  # (K,) float32
    xywh: np.ndarray  # (K, 4) float32, normalised to the image
    starts: np.ndarray  # (n + 1,) int64
    keypoints: np.ndarray | None = None  # (K, P, 3) float32: x, y normalised to the image, visibility; None: boxes only
    segments: np.ndarray | None = None  # (V, 2) float32: every row's polygon vertices, normalised; None: no polygons
    segment_starts: np.ndarray | None = None  # (K + 1,) int64
    segment_points: int = 0  # M, the points a polygon travels as (resample_segments)

    @classmethod
    def of(cls, dataset, segment_points: int = 0) -> EncodedImages:
        """From an Ultralytics YOLODataset's `im_files` and `labels` (after its checks dropped unreadable files);
        with `segment_points` M the label rows' outlines too, for a dataset whose rows carry them (the caller asks
        `outlined`): polygons, or an obb dataset's corners."""
        labels = dataset.labels
        counts = [len(np.asarray(lb["cls"]).reshape(-1)) for lb in labels]
        starts = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        classes = [np.asarray(lb["cls"], np.float32).reshape(-1) for lb in labels]
        boxes = [np.asarray(lb["bboxes"], np.float32).reshape(-1, 4) for lb in labels]
        return cls(
            files=[lb["im_file"] for lb in labels],
            cls=np.concatenate(classes) if classes else np.zeros(0, np.float32),
            xywh=np.concatenate(boxes) if boxes else np.zeros((0, 4), np.float32),
            starts=starts,
            keypoints=_keypoints(labels, dataset) if getattr(dataset, "use_keypoints", False) else None,
            **(_segments(labels, counts, segment_points) if segment_points else {}),
        )

    def __len__(self) -> int:
        return len(self.files)

    def labels(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self.starts[i], self.starts[i + 1]
        return self.cls[lo:hi], self.xywh[lo:hi]

    def points(self, i: int) -> np.ndarray | None:
        """Image i's keypoints (n, P, 3), or None for a dataset of boxes alone."""
        return None if self.keypoints is None else self.keypoints[self.starts[i] : self.starts[i + 1]]

    def outlines(self, indices: list[int]) -> np.ndarray | None:
        """The polygons of images `indices`, their rows one after another, as (n, M, 2) points (normalised;
        resample_segments, in one call), or None without polygons."""
        if self.segments is None:
            return None
        parts = [self.segment_starts[self.starts[i] : self.starts[i + 1] + 1] for i in indices]
        vertices = [self.segments[b[0] : b[-1]] for b in parts]
        sizes = np.concatenate([np.diff(b) for b in parts]) if parts else np.zeros(0, np.int64)
        starts = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
        flat = np.concatenate(vertices) if vertices else np.zeros((0, 2), np.float32)
        return resample_segments(flat, starts, self.segment_points)


def outlined(dataset) -> bool:
    """Whether a dataset's label rows carry an outline: a segmentation dataset's polygons, an obb dataset's corners,
    or a detection dataset's polygons (label files of polygons, as Ultralytics' COCO labels are: Ultralytics makes
    their boxes from the warped polygons, and keeps a dataset's polygons only where every row has one)."""
    if getattr(dataset, "use_segments", False) or getattr(dataset, "use_obb", False):
        return True
    return any(len(lb.get("segments") if lb.get("segments") is not None else []) for lb in dataset.labels)


def _keypoints(labels: list[dict], dataset) -> np.ndarray:
    """A pose dataset's keypoints of every label row, (K, P, 3) float32, P from its kpt_shape (Ultralytics' label
    check adds the visibility to 2-d keypoints)."""
    width = int(dataset.data["kpt_shape"][0])
    points = [np.asarray(lb["keypoints"], np.float32).reshape(-1, width, 3) for lb in labels]
    return np.concatenate(points) if points else np.zeros((0, width, 3), np.float32)


def _segments(labels: list[dict], counts: list[int], m: int) -> dict:
    """A segmentation dataset's polygons as EncodedImages holds them: one polygon per label row (an image whose
    label file has none gives its rows no vertices: resample_segments makes them empty)."""
    polygons = []
    for lb, n in zip(labels, counts):
        segments = lb.get("segments")
        segments = [] if segments is None else segments
        polygons += [np.asarray(p, np.float32).reshape(-1, 2) for p in segments] if len(segments) == n else [
            np.zeros((0, 2), np.float32)] * n
    sizes = [len(p) for p in polygons]
    return dict(segments=np.concatenate(polygons) if polygons else np.zeros((0, 2), np.float32),
                segment_starts=np.concatenate(([0], np.cumsum(sizes))).astype(np.int64), segment_points=m)


def resample_segments(vertices: np.ndarray, starts: np.ndarray, m: int) -> np.ndarray:
    """Closed polygons (`vertices` (V, 2), polygon j's at starts[j]:starts[j+1]) as m points each along their
    perimeter, (K, m, 2) float32. A polygon of m vertices or fewer keeps every vertex, the other points spread
    evenly by length along its edges: the same shape (ultralytics.utils.ops.resample_segments, to 1000 points, also
    keeps every vertex and puts the rest on the edges, spread by vertex index); one of more vertices is sampled
    evenly by length. A polygon without vertices gives m points at (0, 0)."""
    k, n = len(starts) - 1, np.diff(starts)
    out = np.zeros((k, m, 2), np.float32)
    live = n > 0
    if not live.any() or m == 0:
        return out
    v = vertices.astype(np.float64)
    nxt = np.arange(len(v)) + 1
    nxt[starts[1:][live] - 1] = starts[:-1][live]  # each polygon closes on its first vertex
    edge = v[nxt] - v
    length = np.hypot(edge[:, 0], edge[:, 1])
    arc = np.cumsum(length) - length  # where each edge starts, along all the polygons one after another
    first = np.minimum(starts[:-1], len(v) - 1)
    perimeter = np.bincount(np.repeat(np.arange(k), n), weights=length, minlength=k)
    slot = np.arange(m)[None, :]
    keep = n[:, None] <= m
    extra = np.maximum(m - n, 1)[:, None]
    vertex = np.minimum(starts[:-1, None] + np.minimum(slot, n[:, None] - 1), len(v) - 1)
    spread = (slot - n[:, None] + 0.5) * perimeter[:, None] / extra  # the points between the kept vertices
    along = np.where(keep, np.where(slot < n[:, None], arc[vertex] - arc[first, None], spread),
                     slot * perimeter[:, None] / m)
    along = np.sort(along, axis=1) + arc[first, None]
    e = np.searchsorted(arc, along, side="right") - 1
    e = np.clip(e, starts[:-1, None], np.maximum(starts[1:, None] - 1, starts[:-1, None]))
    e = np.minimum(e, len(v) - 1)
    t = (along - arc[e]) / np.maximum(length[e], 1e-12)
    points = v[e] + np.clip(t, 0, 1)[..., None] * edge[e]
    out[live] = points[live]
    return out


class EncodedSample(NamedTuple):
    epoch: int
    index: int
    payload: torch.Tensor  # (n,) uint8 JPEG bytes, or a decoded (3, h, w) uint8 RGB image
    error: str  # why the CPU could not decode it ("" when it could, or did not try)


@dataclass
class EncodedBatch:
    """A batch as the workers hand it over. `payloads[i]` is 1-D (bytes for the GPU decoder) or 3-D (decoded).

    The payloads travel packed in one tensor (`data`, each at `layout[i]`'s offset, of its shape) and the labels as
    NumPy arrays: a worker hands a tensor to the training process as a shared-memory file, one file descriptor sent
    over a socket per tensor, which the training process's pin-memory thread receives and maps, holding the
    interpreter the input threads and the step's launches share. One tensor per batch instead of one per image.
    """

    epoch: int  # the epoch the sampler drew the batch for (a batch never spans two)
    indices: list[int]
    data: torch.Tensor  # (bytes,) uint8: every payload, back to back
    layout: list[tuple[int, tuple[int, ...]]]  # each payload's (offset in data, shape)
    errors: list[str]
    cls: torch.Tensor  # (K,) float32: the labels of every sample, in sample order
    xywh: torch.Tensor  # (K, 4) float32
    counts: torch.Tensor  # (B,) int64: labels per sample
    keypoints: torch.Tensor | None = None  # (K, P, 3) float32 of a pose dataset, as EncodedImages holds them
    segments: torch.Tensor | None = None  # (K, M, 2) float32 of a segmentation dataset: EncodedImages.outlines

    @classmethod
    def of(cls, samples: list[EncodedSample], images: EncodedImages) -> EncodedBatch:
        labels = [images.labels(s.index) for s in samples]
        layout, offset = [], 0
        for s in samples:
            layout.append((offset, tuple(s.payload.shape)))
            offset += s.payload.numel()
        data = torch.empty(offset, dtype=torch.uint8)
        for s, (start, _) in zip(samples, layout):
            data[start : start + s.payload.numel()] = s.payload.reshape(-1)
        return cls(
            epoch=samples[0].epoch,
            indices=[s.index for s in samples],
            data=data,
            layout=layout,
            errors=[s.error for s in samples],
            cls=torch.from_numpy(np.concatenate([c for c, _ in labels])),
            xywh=torch.from_numpy(np.concatenate([b for _, b in labels])).view(-1, 4),
            counts=torch.tensor([len(c) for c, _ in labels], dtype=torch.int64),
            keypoints=None if images.keypoints is None else torch.from_numpy(
                np.concatenate([images.points(s.index) for s in samples])),
            segments=None if images.segments is None else torch.from_numpy(images.outlines([s.index for s in samples])),
        )

    @property
    def payloads(self) -> list[torch.Tensor]:
        """Each sample's payload: a view of `data` (made once: the decoder reads them many times)."""
        if self.__dict__.get("_views") is None:
            self._views = [self.data[start : start + math.prod(shape)].view(shape) for start, shape in self.layout]
        return self._views

    def __getstate__(self) -> dict:
        """Pickled by a worker: the labels as arrays, which travel inside the pickle (no file descriptor each)."""
        state = {k: v for k, v in self.__dict__.items() if k != "_views"}
        for k in LABEL_ARRAYS:
            if state.get(k) is not None:
                state[k] = state[k].numpy()
        return state

    def __setstate__(self, state: dict) -> None:
        for k in LABEL_ARRAYS:
            if state.get(k) is not None:
                state[k] = torch.from_numpy(state[k])
        self.__dict__.update(state)

    def pin_memory(self) -> EncodedBatch:
        """Called by the DataLoader's pin-memory thread: the bytes and decoded images go to the GPU from pinned pages."""
        self.data, self._views = self.data.pin_memory(), None
        return self


class EncodedTrainDataset(Dataset):
    """(epoch, index) keys, as sampler.EpochBatchSampler gives them, to EncodedSamples; `collate_fn` makes a batch."""

    def __init__(self, images: EncodedImages, *, labels: list[dict] | None = None, decode_all: bool = False,
                 cache=None):
        self.images, self.decode_all = images, decode_all
        self.labels = labels  # Ultralytics' label dicts, what its trainer reads off a training set (class weights)
        self.cache = cache  # an image_cache.ImageCache of the files' bytes, or None
        self._rows = cache.rows(images.files) if cache is not None else None

    def __len__(self) -> int:
        return len(self.images)

    def read(self, i: int) -> bytes | np.ndarray:
        if self._rows is not None:
            return self.cache.image(int(self._rows[i]))[0].reshape(-1)  # a read-only view of the mapped file
        with open(self.images.files[i], "rb") as f:
            return f.read()

    def __getitem__(self, key: tuple[int, int]) -> EncodedSample:
        epoch, index = key
        data = self.read(index)
        if not self.decode_all and bytes(data[:3]) == JPEG_MAGIC and exif_orientation(data) == 1:
            return EncodedSample(epoch, index, torch.frombuffer(bytearray(data), dtype=torch.uint8), "")
        image, error = decode_on_cpu(data)
        return EncodedSample(epoch, index, image, error)

    def collate_fn(self, samples: list[EncodedSample]) -> EncodedBatch:
        return EncodedBatch.of(samples, self.images)


def decode_on_cpu(data) -> tuple[torch.Tensor, str]:
    """Any image file's bytes -> (3, h, w) uint8 RGB with its EXIF orientation applied, as OpenCV reads it; an
    empty (3, 0, 0) tensor and the reason when nothing can decode it."""
    buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    try:
        return torchvision_ops.decode_image(buffer, apply_exif_orientation=True), ""
    except (RuntimeError, ValueError) as e:  # torchvision's decoders raise RuntimeError on damaged data
        torchvision_error = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    try:  # Pillow reads formats torchvision does not (TIFF, MPO, ...), as Ultralytics' checks do
        from PIL import Image, ImageOps

        with Image.open(io.BytesIO(bytes(data))) as im:
            rgb = np.asarray(ImageOps.exif_transpose(im).convert("RGB"))
        return torch.from_numpy(rgb.copy()).permute(2, 0, 1).contiguous(), ""
    except Exception as e:  # noqa: BLE001 - any failure means the same: this file cannot be decoded
        return torch.zeros((3, 0, 0), dtype=torch.uint8), f"{torchvision_error}; Pillow: {type(e).__name__}: {e}"


def exif_orientation(data) -> int:
    """The EXIF orientation tag of JPEG bytes (1, upright, when there is none), read from the APP1 segment alone."""
    head = bytes(data[: 1 << 16])  # markers before the image data; EXIF sits in the first APP1 segment
    pos = 2
    while pos + 4 <= len(head) and head[pos] == 0xFF:
        marker, length = head[pos + 1], int.from_bytes(head[pos + 2 : pos + 4], "big")
        if marker == 0xE1 and head[pos + 4 : pos + 10] == b"Exif\x00\x00":
            return _tiff_orientation(head[pos + 10 : pos + 2 + length])
        if marker in (0xDA, 0xD9):  # start of scan, end of image: no EXIF before the pixels
            return 1
        pos += 2 + length
    return 1


def _tiff_orientation(tiff: bytes) -> int:
    if len(tiff) < 8 or tiff[:2] not in (b"II", b"MM"):
        return 1
    order = "little" if tiff[:2] == b"II" else "big"
    ifd = int.from_bytes(tiff[4:8], order)
    if ifd + 2 > len(tiff):
        return 1
    for k in range(int.from_bytes(tiff[ifd : ifd + 2], order)):
        entry = tiff[ifd + 2 + 12 * k : ifd + 14 + 12 * k]
        if len(entry) == 12 and int.from_bytes(entry[:2], order) == EXIF_ORIENTATION:
            value = int.from_bytes(entry[8:10], order)
            return value if 1 <= value <= 8 else 1
    return 1

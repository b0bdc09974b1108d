"""Ultralytics 8.4.190's detection training augmentation, on tensors, on the training device (loader.augment_on=gpu).

Why: with Ultralytics' loader the CPU decodes, builds the mosaic, warps it, shifts its colours and flips it, several
milliseconds of one core per 640-pixel image, while one GPU trains yolov8s at over a thousand images a second: a
dozen busy cores per GPU (docs/benchmarks/README.md). Here the workers only read file bytes (encoded.py), the GPU
decodes them into an image buffer (gpu_input.py) and this module does the rest:

    augment = GpuAugment(imgsz, hyp, out_dtype=torch.float16)  # None: uint8, Ultralytics' collated batch
    batch = augment(raw_batch, generator)  # generator: a torch.Generator on the batch's device

A `RawBatch` names the images (the buffer's slots), which of them form each sample, and their labels in pixels;
mosaic, RandomPerspective, RandomHSV, RandomFlip (up-down, left-right) and Format (RGB, boxes as normalised xywh) give
the batch `YOLODataset.collate_fn` gives, its images rendered in one pass (warp.render).

Semantics (ultralytics/data/augment.py, v8_transforms, read at 8.4.190), per output sample:
  * Mosaic (probability `mosaic`, 4 images): a 2S x 2S canvas of 114 (S = imgsz), centre xc, yc =
    int(uniform(S/2, 3S/2)) each; image 0 ends at the centre (top left), 1 top right, 2 bottom left, 3 bottom right;
    boxes shifted, clipped to the canvas, zero-area boxes dropped.
  * RandomPerspective to S x S: M = T @ Sh @ R @ P @ C, where C moves the centre of its input (the canvas, or without
    mosaic the image as load_image returned it) to the origin, P perspective, R = cv2.getRotationMatrix2D(angle
    uniform(+-degrees), scale uniform(1 +- scale)), Sh shear (tan of uniform(+-shear) degrees), T translation
    uniform(0.5 +- translate) x S. Warped bilinearly with border 114. Boxes: the 4 corners through M, min/max, clipped
    to S, kept by `box_candidates` (w, h > 2 px, area > 0.1 x the pre-warp area x scale^2, aspect ratio < 100).
    Without mosaic there is no LetterBox in 8.4.190's training path: C centres the image and T places it.
  * RandomHSV: gains r = uniform(-1, 1) x (hsv_h, hsv_s, hsv_v); OpenCV's uint8 HSV (hue 0..179); hue + 180 r_h
    modulo 180, saturation and value x (1 + r), each clipped and truncated to an integer like the uint8 LUTs.
  * RandomFlip up-down (flipud), then left-right (fliplr); Format: RGB unless uniform(0, 1) <= bgr; boxes as xywh / S.

Where the device version differs, and why
  * One sampling pass per output pixel: output pixel -> inverse affine -> canvas position -> the 4 canvas pixels its
    bilinear filter reads, each looked up in the source image that covers it (or 114). This equals building the
    canvas and warping it, without the 2S x 2S canvas; flips are folded into the same inverse map.
  * The bilinear filter runs in float32 at the exact sub-pixel position, as OpenCV 5.0's warpAffine (the version
    installed with Ultralytics here) does: outputs agree except for one grey level on ~0.02 % of values (rounding
    order). OpenCV 4.x warps in fixed point (1/32 pixel), a grey level or two apart on edges.
  * RandomHSV is computed in float, in the same pass (warp.hsv_shift): the same transform as OpenCV's uint8 HSV and
    Ultralytics' lookup tables, without their rounding (under one grey level on average, up to ~9 on saturated
    bright pixels, where OpenCV's hue moves in 2-degree steps).
  * Randomness comes from a torch.Generator on the device (same distributions, different numbers from Python's
    `random` and NumPy). Mosaic partners are chosen by gpu_input.py from its buffer of recently decoded images,
    as Ultralytics draws from its dataset's buffer of recently loaded ones.
  * Boxes are warped as boxes. When label files hold polygons, Ultralytics re-derives each box from the warped
    polygon (tighter under rotation, area threshold 0.01); here the box rule (0.10) applies to every dataset.
  * Not reproduced (refused when configured): mixup, cutmix, copy_paste, custom `augmentations`. Ultralytics also
    applies Albumentations blur/median blur/grey/CLAHE at p=0.01 each, but only when the albumentations package is
    installed, which it is not in this project's environments. Detection only, 3-channel images, 2x2 mosaic.

Syncs: none in the sampling; one device-to-host read per batch, of how many boxes survive in each image (their number
is data-dependent; the batch carries the counts, and their largest as MAX_TARGETS for the sync-free loss). Memory: the
output alone on CUDA (the Triton pass keeps nothing else); the PyTorch twin that CPU runs use works in passes of
bounded size (warp.PIXELS_PER_PASS).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

import torch

from launcher.plan.checks import GPU_INPUT_UNSUPPORTED
from launcher.rank.data.pipeline import MAX_TARGETS, TARGETS_PER_IMAGE
from launcher.rank.data.warp import render



@dataclass
class RawBatch:
    """What the CPU hands over: raw images, which of them form each sample, their labels as pixel boxes.

    images     (N, S, S, 3) uint8, BGR: raw image i, resized like `load_image` (long side S, aspect kept), occupies
               images[i, :h_i, :w_i]; the rest is padding that is never read.
    sizes      (N, 2) int64: (h_i, w_i).
    groups     (B, T) int64: the raw images of each output sample; T = 4 (mosaic tiles: top left, top right, bottom
               left, bottom right, the sample's own image first) or T = 1 (no mosaic).
    labels     (K, 7) float32: (sample, tile, class, x1, y1, x2, y2), the box in pixels of that tile's raw image,
               ordered by sample, then tile, then as in the label file.
    im_file, ori_shape, ratio_pad: per output sample, of its own image (what Ultralytics' batch carries).
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

    def _map_tensors(self, fn) -> RawBatch:
        tensors = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(self, **{k: fn(v) for k, v in tensors.items() if isinstance(v, torch.Tensor)})

    def pin_memory(self) -> RawBatch:
        """Called by the DataLoader's pin-memory thread (pin_memory=True)."""
        return self._map_tensors(lambda t: t.pin_memory())

    def to(self, device, non_blocking: bool = False) -> RawBatch:
        return self._map_tensors(lambda t: t.to(device, non_blocking=non_blocking))


@dataclass
class AugmentParams:
    """Every random choice for a batch, one row per output sample; `matrix` is the composed affine M (3 x 3)."""

    mosaic: torch.Tensor  # (B,) bool
    centre: torch.Tensor  # (B, 2) int64 mosaic centre (xc, yc) on the 2S canvas; 0 without mosaic
    perspective: torch.Tensor  # (B, 2)
    angle: torch.Tensor  # (B,) degrees
    scale: torch.Tensor  # (B,)
    shear: torch.Tensor  # (B, 2) degrees (x, y)
    translate: torch.Tensor  # (B, 2) fraction of S, in [0.5 - translate, 0.5 + translate]
    hsv: torch.Tensor  # (B, 3) gains r for hue, saturation, value
    flip_ud: torch.Tensor  # (B,) bool
    flip_lr: torch.Tensor  # (B,) bool
    rgb: torch.Tensor  # (B,) bool: False leaves the sample BGR (hyp bgr)
    matrix: torch.Tensor  # (B, 3, 3) float32: canvas (or image) pixels -> output pixels


@dataclass
class _Tiles:
    """Where each sample's 4 mosaic quadrants come from: per (sample, quadrant) tables, (B, 4) int32 each."""

    xc: torch.Tensor  # (B,) quadrant boundaries on the canvas
    yc: torch.Tensor
    pad_x: torch.Tensor  # canvas position of the tile image's (0, 0)
    pad_y: torch.Tensor
    x_lo: torch.Tensor  # canvas pixels the tile covers: [x_lo, x_hi) x [y_lo, y_hi)
    x_hi: torch.Tensor
    y_lo: torch.Tensor
    y_hi: torch.Tensor
    base: torch.Tensor  # flat pixel index in RawBatch.images of canvas pixel (0, 0) seen through this tile


def _hyp_dict(hyp) -> dict:
    return dict(hyp) if isinstance(hyp, Mapping) else dict(vars(hyp))


class GpuAugment:
    """`GpuAugment(imgsz, hyp)(raw_batch, generator)` -> a batch in YOLODataset.collate_fn's format.

    `hyp` is Ultralytics' training arguments (a dict or the trainer's `args` namespace); mosaic, degrees, translate,
    scale, shear, perspective, hsv_h/s/v, flipud, fliplr and bgr are read once, here. A RawBatch with one tile per
    sample (after close_mosaic) is never mosaicked; with four, each sample is, with probability `mosaic`.
    """

    def __init__(self, imgsz: int, hyp, out_dtype: torch.dtype | None = None):
        hyp = _hyp_dict(hyp)
        self.out_dtype = out_dtype  # None: uint8 images as Ultralytics collates them; else the network's input
        used = [k for k in GPU_INPUT_UNSUPPORTED if hyp.get(k)] + (["augmentations"] if hyp.get("augmentations") else [])
        if used:
            raise ValueError(f"the GPU input pipeline does not implement {', '.join(used)}: set them to 0 or use loader.augment_on=cpu")
        self.imgsz = int(imgsz)
        self.p_mosaic = float(hyp.get("mosaic", 1.0))
        self.degrees, self.translate = float(hyp.get("degrees", 0.0)), float(hyp.get("translate", 0.1))
        self.shear = float(hyp.get("shear", 0.0))
        scale = hyp.get("scale", 0.5)
        self.scale_range = tuple(map(float, scale)) if isinstance(scale, (tuple, list)) else (1 - scale, 1 + scale)
        self.perspective = float(hyp.get("perspective", 0.0))
        self.hsv_gains = tuple(float(hyp.get(k, d)) for k, d in (("hsv_h", 0.015), ("hsv_s", 0.7), ("hsv_v", 0.4)))
        self.p_flipud, self.p_fliplr = float(hyp.get("flipud", 0.0)), float(hyp.get("fliplr", 0.5))
        self.p_bgr = float(hyp.get("bgr", 0.0))

    def __call__(self, raw: RawBatch, generator: torch.Generator) -> dict:
        return self.apply(raw, self.draw(raw, generator))

    # --- the random choices ---------------------------------------------------------------------------------------
    def draw(self, raw: RawBatch, generator: torch.Generator) -> AugmentParams:
        """All of a batch's random choices in one draw from `generator` (which must live on the batch's device)."""
        b, t = raw.groups.shape
        s = self.imgsz
        u = torch.rand((b, 17), generator=generator, device=raw.images.device)

        def uniform(col, lo, hi):
            return lo + (hi - lo) * u[:, col]

        mosaic = (u[:, 0] <= self.p_mosaic) if t == 4 else torch.zeros(b, dtype=torch.bool, device=u.device)
        border = -s // 2  # Mosaic.border; the centre is int(uniform(-border, 2s + border)) = [s/2, 3s/2) for even s
        centre = uniform(slice(1, 3), -border, 2 * s + border).floor().long() * mosaic[:, None]
        params = dict(
            mosaic=mosaic,
            centre=centre,
            perspective=uniform(slice(3, 5), -self.perspective, self.perspective),
            angle=uniform(5, -self.degrees, self.degrees),
            scale=uniform(6, *self.scale_range),
            shear=uniform(slice(7, 9), -self.shear, self.shear),
            translate=uniform(slice(9, 11), 0.5 - self.translate, 0.5 + self.translate),
            hsv=torch.stack([uniform(11 + k, -gain, gain) for k, gain in enumerate(self.hsv_gains)], 1),
            flip_ud=u[:, 14] < self.p_flipud,
            flip_lr=u[:, 15] < self.p_fliplr,
            rgb=u[:, 16] > self.p_bgr,
        )
        return AugmentParams(**params, matrix=self._matrix(raw, params))

    def _matrix(self, raw: RawBatch, p: dict) -> torch.Tensor:
        """RandomPerspective._compute_affine_matrix, batched: M = T @ S @ R @ P @ C (applied right to left)."""
        s = self.imgsz
        b = p["angle"].shape[0]
        eye = torch.eye(3, device=p["angle"].device).expand(b, 3, 3)
        # C: the centre of the warp's input to the origin; the 2S canvas, or the sample's own image
        hw = raw.sizes[raw.groups[:, 0]].float()
        half = torch.where(p["mosaic"][:, None], float(s), hw.flip(1) / 2)  # (x, y)
        C = eye.clone()
        C[:, :2, 2] = -half
        P = eye.clone()
        P[:, 2, :2] = p["perspective"]
        a = torch.deg2rad(p["angle"])
        alpha, beta = p["scale"] * torch.cos(a), p["scale"] * torch.sin(a)  # cv2.getRotationMatrix2D, centre (0, 0)
        R = eye.clone()
        R[:, 0, 0], R[:, 0, 1], R[:, 1, 0], R[:, 1, 1] = alpha, beta, -beta, alpha
        S = eye.clone()
        S[:, 0, 1], S[:, 1, 0] = torch.tan(torch.deg2rad(p["shear"])).unbind(1)
        T = eye.clone()
        T[:, :2, 2] = p["translate"] * s
        return T @ S @ R @ P @ C

    # --- the transform --------------------------------------------------------------------------------------------
    def apply(self, raw: RawBatch, p: AugmentParams) -> dict:
        """The augmented batch, keys and dtypes as YOLODataset.collate_fn returns them for a detection dataset."""
        n, s = raw.images.shape[0], self.imgsz
        if raw.images.shape[1:] != (s, s, 3):
            raise ValueError(f"raw images of shape {tuple(raw.images.shape[1:])} for imgsz {s}: expected ({s}, {s}, 3)")
        if n * s * s >= 2**31:
            raise ValueError(f"{n} raw images of {s} pixels overflow the int32 pixel indices: use smaller batches")
        tiles = self._tiles(raw, p)
        # Boxes first: their host sync then waits for a few small kernels, and the image kernels queued after it
        # run while the host goes on to queue the training step.
        batch_idx, cls, bboxes, counts = self._boxes(raw, p, tiles)
        img = self._render(raw, p, tiles)
        return {
            MAX_TARGETS: max(counts),
            TARGETS_PER_IMAGE: counts,
            "batch_idx": batch_idx,
            "bboxes": bboxes,
            "cls": cls,
            "im_file": raw.im_file,
            "img": img,
            "ori_shape": raw.ori_shape,
            "ratio_pad": raw.ratio_pad,
            "resized_shape": ((s, s),) * len(raw.im_file),
        }

    def _tiles(self, raw: RawBatch, p: AugmentParams) -> _Tiles:
        """Mosaic.get_params' layout as tables. Without mosaic every quadrant is the sample's own image at (0, 0)."""
        s = self.imgsz
        m = p.mosaic[:, None]
        xc, yc = p.centre.unbind(1)
        img = torch.where(m, raw.groups.expand(-1, 4), raw.groups[:, :1])  # (B, 4) raw image per quadrant
        h, w = raw.sizes[img].unbind(2)
        quadrant = torch.arange(4, device=img.device)  # top left, top right, bottom left, bottom right
        right, bottom = quadrant % 2, quadrant // 2
        pad_x = torch.where(m, xc[:, None] - w * (1 - right), 0)  # left tiles end at xc, right ones start there
        pad_y = torch.where(m, yc[:, None] - h * (1 - bottom), 0)
        tables = dict(
            xc=xc,
            yc=yc,
            pad_x=pad_x,
            pad_y=pad_y,
            x_lo=pad_x.clamp(min=0),
            x_hi=(pad_x + w).clamp(max=2 * s),
            y_lo=pad_y.clamp(min=0),
            y_hi=(pad_y + h).clamp(max=2 * s),
            base=img * s * s - pad_y * s - pad_x,
        )
        return _Tiles(**{k: v.int() for k, v in tables.items()})  # int32: half the memory of per-pixel lookups

    def _render(self, raw: RawBatch, p: AugmentParams, tiles: _Tiles) -> torch.Tensor:
        """The images, in one pass (warp.render): (B, 3, S, S) uint8 RGB in Ultralytics' batch format, or with
        `out_dtype` the network's input itself (values / 255, channels_last)."""
        s = self.imgsz
        b = p.matrix.shape[0]
        dev = p.matrix.device
        # Output pixel (u, v) shows what the unflipped output shows at (S-1-u, v) when flipped left-right (np.fliplr)
        flip = torch.eye(3, device=dev).repeat(b, 1, 1)
        flip[:, 0, 0] = torch.where(p.flip_lr, -1.0, 1.0)
        flip[:, 0, 2] = torch.where(p.flip_lr, s - 1.0, 0.0)
        flip[:, 1, 1] = torch.where(p.flip_ud, -1.0, 1.0)
        flip[:, 1, 2] = torch.where(p.flip_ud, s - 1.0, 0.0)
        inverse = torch.linalg.inv_ex(p.matrix)[0] @ flip  # output pixel -> canvas; inv_ex: no check, no host sync
        table = torch.stack((tiles.x_lo, tiles.x_hi, tiles.y_lo, tiles.y_hi, tiles.base), 1)
        if self.out_dtype is None:
            img = torch.empty((b, 3, s, s), dtype=torch.uint8, device=dev)
        else:
            img = torch.empty((b, 3, s, s), dtype=self.out_dtype, device=dev).to(memory_format=torch.channels_last)
        gains = p.hsv if any(self.hsv_gains) else None  # RandomHSV is skipped when every gain is 0, as Ultralytics does
        render(raw.images, table, torch.stack((tiles.xc, tiles.yc), 1), inverse, gains, ~p.rgb, img,
               scale=1.0 if self.out_dtype is None else 1 / 255, bgr_slots=not raw.rgb)
        return img

    def _boxes(self, raw: RawBatch, p: AugmentParams, tiles: _Tiles):
        """Mosaic's shift and clip, RandomPerspective's warp and box_candidates, the flips, Format's xywh / S."""
        s = self.imgsz
        sample, tile = raw.labels[:, 0].long(), raw.labels[:, 1].long()
        mosaic = p.mosaic[sample]
        pad = torch.stack((tiles.pad_x[sample, tile], tiles.pad_y[sample, tile]), 1).float().repeat(1, 2)
        xyxy = raw.labels[:, 3:7] + pad
        clipped = xyxy.clamp(0, 2 * s)  # Mosaic._cat_labels: clip to the canvas, drop what has no area left
        alive = torch.where(mosaic, (clipped[:, 2] > clipped[:, 0]) & (clipped[:, 3] > clipped[:, 1]), tile == 0)
        if raw.valid is not None:
            alive &= raw.valid
        xyxy = torch.where(mosaic[:, None], clipped, xyxy)

        left, top, right, bottom = xyxy.unbind(1)
        corners = torch.stack((left, top, right, bottom, left, bottom, right, top), 1).view(-1, 4, 2)
        corners = torch.cat((corners, torch.ones_like(corners[..., :1])), 2) @ p.matrix[sample].transpose(1, 2)
        corners = corners[..., :2] / corners[..., 2:]
        warped = torch.cat((corners.amin(1), corners.amax(1)), 1).clamp(0, s)

        keep = alive & box_candidates((xyxy[:, 2:] - xyxy[:, :2]) * p.scale[sample, None], warped)

        x1 = torch.where(p.flip_lr[sample], s - warped[:, 2], warped[:, 0])
        x2 = torch.where(p.flip_lr[sample], s - warped[:, 0], warped[:, 2])
        y1 = torch.where(p.flip_ud[sample], s - warped[:, 3], warped[:, 1])
        y2 = torch.where(p.flip_ud[sample], s - warped[:, 1], warped[:, 3])
        xywh = torch.stack(((x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1), 1) / s

        per_sample = torch.zeros(len(p.scale), dtype=torch.int64, device=keep.device).index_add_(0, sample, keep.long())
        counts = per_sample.tolist()  # the one host sync
        kept = torch.sort(keep.to(torch.uint8), descending=True, stable=True).indices[:sum(counts)]  # in order
        return sample[kept].float(), raw.labels[kept, 2:3], xywh[kept], counts


def box_candidates(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """RandomPerspective.box_candidates: keep a warped box (xyxy, (K, 4)) when it is wider and taller than 2 pixels,
    keeps more than a tenth of its pre-warp area (`before`: (w, h) x scale, (K, 2)) and is not longer than 100:1."""
    w, h = after[:, 2] - after[:, 0], after[:, 3] - after[:, 1]
    aspect = torch.maximum(w / (h + 1e-16), h / (w + 1e-16))
    return (w > 2) & (h > 2) & (w * h / (before[:, 0] * before[:, 1] + 1e-16) > 0.1) & (aspect < 100)

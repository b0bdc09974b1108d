"""Ultralytics 8.4.190's detection training augmentation, on tensors, on the training device (loader.augment_on=gpu).

Why: with Ultralytics' loader the CPU decodes, builds the mosaic, warps it, shifts its colours and flips it, several
milliseconds of one core per 640-pixel image, while one GPU trains yolov8s at over a thousand images a second: a
dozen busy cores per GPU (docs/benchmarks/README.md). Here the workers only read file bytes (encoded.py), the GPU
decodes them into an image buffer (gpu_input.py) and this module does the rest:

    augment = GpuAugment(imgsz, hyp, out_dtype=torch.float16)  # None: uint8, Ultralytics' collated batch
    batch = augment(raw_batch, generator)  # generator: a torch.Generator on the batch's device

A `RawBatch` names the images (the buffer's slots), which of them form each sample (and each MixUp or CutMix
partner), and their labels in pixels; mosaic, RandomPerspective, MixUp, CutMix, RandomHSV, RandomFlip (up-down,
left-right) and Format (RGB, boxes as normalised xywh) give the batch `YOLODataset.collate_fn` gives, its images
rendered in one pass (warp.render), plus a second, smaller one for the samples that are mixed.

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
  * MixUp (probability `mixup`): a partner image run through the same Mosaic and RandomPerspective (its own tiles, its
    own draws); r ~ Beta(32, 32); img = (img r + partner (1 - r)) truncated to uint8; the partner's boxes appended.
  * CutMix (probability `cutmix`, after MixUp): another such partner; 3 candidate areas by _rand_bbox (lam ~ Beta(1, 1),
    side int(S sqrt(1 - lam)), centre randint(S) each way, x1 = clip(cx - side // 2), x2 = clip(cx + side // 2));
    the areas no box of the sample touches (bbox_ioa summed <= 0), one of them uniformly; the partner's boxes whose
    intersection with it is >= 0.1 of their own area, clipped to it; that area of the partner's image pasted. No free
    area, or no such box: nothing changes.
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
  * MixUp's and CutMix's partner is another image of the buffer (Ultralytics: of the whole dataset), with 3 mosaic
    partners and every draw of its own, rendered as an extra row of the batch.
  * RandomHSV comes after the mix and is not linear: a mixed sample's parts are rendered without it (uint8, as
    Ultralytics' images are), mixed, then HSV and the channel order in one elementwise pass (warp.shade). The flips
    are folded into both parts' warps and mirror CutMix's area: the mix is per pixel, so mixing the flipped parts is
    flipping the mix. Boxes are mixed by Ultralytics' rule before the flips, then flipped with the rest.
  * MixUp blends in float32 (NumPy: float64) before truncating: a grey level apart where the blend lies within
    rounding of an integer. r is the 32nd smallest of 63 uniforms, which is exactly Beta(32, 32).
  * CutMix keeps partner boxes from 0.1 of their area inside; Ultralytics from 0.01 when label files hold polygons.
  * Not reproduced (refused when configured): copy_paste (it needs polygons), custom `augmentations`. Ultralytics also
    applies Albumentations blur/median blur/grey/CLAHE at p=0.01 each, but only when the albumentations package is
    installed, which it is not in this project's environments. Detection only, 3-channel images, 2x2 mosaic.

Syncs: none in the sampling; one device-to-host read per batch, of how many boxes survive in each image (their number
is data-dependent; the batch carries the counts, and their largest as MAX_TARGETS for the sync-free loss) and, with
mixup or cutmix on, in the same read, how many samples are mixed and how many rows their mix reads. Memory: the
output alone on CUDA (the Triton pass keeps nothing else); the PyTorch twin that CPU runs use works in passes of
bounded size (warp.PIXELS_PER_PASS). A batch with mixed samples also renders those samples (again: the first pass's
image of theirs is overwritten) and the partners they use, without HSV, into uint8 (3 S^2 bytes each), and mixes them
in passes of that bounded size.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

import torch

from launcher.plan.checks import GPU_INPUT_UNSUPPORTED
from launcher.rank.data.pipeline import MAX_TARGETS, TARGETS_PER_IMAGE
from launcher.rank.data.warp import PIXELS_PER_PASS, render, shade


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


@dataclass
class AugmentParams:
    """Every random choice for a batch: one row per rendered sample (R: the output samples, then the mix partners,
    which take their sample's flips, HSV gains and channel order); `matrix` is the composed affine M (3 x 3). The mix
    fields, one row per output sample (B), are None when the batch has no mix partners."""

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
    mixup: torch.Tensor | None = None  # (B,) bool: MixUp applied
    mix_ratio: torch.Tensor | None = None  # (B,) MixUp's r, of the sample's own image
    cutmix: torch.Tensor | None = None  # (B,) bool: CutMix tried (it still skips without a free area or partner box)
    cut_areas: torch.Tensor | None = None  # (B, 3, 4) float32 candidate areas x1, y1, x2, y2 on the unflipped output
    cut_pick: torch.Tensor | None = None  # (B,) uniform in [0, 1): which of the free candidates


@dataclass
class _Mix:
    """What the boxes decided for the images: per output sample (B), and which rows (R) the mix reads."""

    mixup: torch.Tensor  # (B,) bool
    cutmix: torch.Tensor  # (B,) bool: CutMix applied (a free area with a partner box in it)
    area: torch.Tensor  # (B, 4) float32: CutMix's area, x1, y1, x2, y2 on the unflipped output
    need: torch.Tensor  # (R,) bool: the mixed samples and the partners their mix uses


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
    scale, shear, perspective, mixup, cutmix, hsv_h/s/v, flipud, fliplr and bgr are read once, here. A RawBatch with
    one tile per sample (after close_mosaic) is never mosaicked nor mixed, as Ultralytics' close_mosaic sets mosaic,
    mixup and cutmix to 0; with four, each sample is mosaicked with probability `mosaic`, and mixed with the
    partners the batch brings (`mixes` blocks of them) with probabilities `mixup` and `cutmix`.
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
        self.p_mixup, self.p_cutmix = float(hyp.get("mixup", 0.0)), float(hyp.get("cutmix", 0.0))
        self.hsv_gains = tuple(float(hyp.get(k, d)) for k, d in (("hsv_h", 0.015), ("hsv_s", 0.7), ("hsv_v", 0.4)))
        self.p_flipud, self.p_fliplr = float(hyp.get("flipud", 0.0)), float(hyp.get("fliplr", 0.5))
        self.p_bgr = float(hyp.get("bgr", 0.0))

    @property
    def mixes(self) -> int:
        """How many blocks of partners a mosaic batch brings: one for MixUp, one for CutMix, each when it is on."""
        return int(self.p_mixup > 0) + int(self.p_cutmix > 0)

    def __call__(self, raw: RawBatch, generator: torch.Generator) -> dict:
        return self.apply(raw, self.draw(raw, generator))

    def _partner_blocks(self, raw: RawBatch) -> int:
        """The blocks of mix partners `raw` carries: `mixes` with mosaic tiles, none after close_mosaic."""
        rows, t = raw.groups.shape
        blocks = self.mixes if t == 4 else 0
        if rows != raw.samples * (1 + blocks):
            raise ValueError(f"a RawBatch of {raw.samples} samples with {rows} rows of tiles: with {t} tile(s) and "
                             f"mixup={self.p_mixup}, cutmix={self.p_cutmix} it needs {raw.samples * (1 + blocks)} "
                             "(a block of partners per mix that is on: gpu_input.GpuInput draws them)")
        return blocks

    # --- the random choices ---------------------------------------------------------------------------------------
    def draw(self, raw: RawBatch, generator: torch.Generator) -> AugmentParams:
        """All of a batch's random choices in one draw from `generator` (which must live on the batch's device)."""
        rows, t = raw.groups.shape
        b, s = raw.samples, self.imgsz
        blocks = self._partner_blocks(raw)
        u = torch.rand((rows, 17), generator=generator, device=raw.images.device)

        def uniform(col, lo, hi):
            return lo + (hi - lo) * u[:, col]

        mosaic = (u[:, 0] <= self.p_mosaic) if t == 4 else torch.zeros(rows, dtype=torch.bool, device=u.device)
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
        matrix = self._matrix(raw, params)
        if blocks:  # HSV and the flips come after the mix: a partner takes its sample's
            host = torch.arange(rows, device=u.device) % b
            params.update({k: params[k][host] for k in ("hsv", "flip_ud", "flip_lr", "rgb")})
            params.update(self._draw_mix(b, generator, u.device))
        return AugmentParams(**params, matrix=matrix)

    def _draw_mix(self, b: int, generator: torch.Generator, device) -> dict:
        """MixUp's and CutMix's choices for b samples: whether each applies, r, CutMix's 3 candidate areas."""
        s = self.imgsz
        v = torch.rand((b, 12 + 63), generator=generator, device=device)
        off = torch.zeros(b, dtype=torch.bool, device=device)
        lam, cx, cy = v[:, 2:5], (v[:, 5:8] * s).floor().clamp(max=s - 1), (v[:, 8:11] * s).floor().clamp(max=s - 1)
        half = (s * torch.sqrt(1 - lam)).floor().div(2).floor()  # CutMix._rand_bbox: int(S * sqrt(1 - lam)) // 2
        return dict(
            mixup=v[:, 0] <= self.p_mixup if self.p_mixup > 0 else off,  # BaseMixTransform: uniform(0, 1) > p skips
            mix_ratio=v[:, 12:].kthvalue(32, 1).values,  # the 32nd smallest of 63 uniforms ~ Beta(32, 32)
            cutmix=v[:, 1] <= self.p_cutmix if self.p_cutmix > 0 else off,
            cut_areas=torch.stack(((cx - half).clamp(0, s), (cy - half).clamp(0, s),
                                   (cx + half).clamp(0, s), (cy + half).clamp(0, s)), 2),
            cut_pick=v[:, 11],
        )

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
        b = raw.samples
        tiles = self._tiles(raw, p)
        # Boxes first: their host sync then waits for a few small kernels, and the image kernels queued after it
        # run while the host goes on to queue the training step.
        row, xyxy, keep = self._warped_boxes(raw, p, tiles)
        host, block, mix = row, torch.zeros_like(row), None
        if self._partner_blocks(raw):
            host, block, xyxy, keep, mix = self._mix_boxes(p, b, row, xyxy, keep)
        batch_idx, cls, bboxes, counts, (mixed, needed) = self._format(raw, p, host, block, xyxy, keep, mix)
        geometry = self._geometry(p, tiles)
        img = self._render(raw, p, geometry)
        if mixed:
            self._mix_images(raw, p, geometry, mix, mixed, needed, img)
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
            "resized_shape": ((s, s),) * b,
        }

    def _tiles(self, raw: RawBatch, p: AugmentParams) -> _Tiles:
        """Mosaic.get_params' layout as tables. Without mosaic every quadrant is the sample's own image at (0, 0)."""
        s = self.imgsz
        m = p.mosaic[:, None]
        xc, yc = p.centre.unbind(1)
        img = torch.where(m, raw.groups.expand(-1, 4), raw.groups[:, :1])  # (R, 4) raw image per quadrant
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

    def _geometry(self, p: AugmentParams, tiles: _Tiles) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """warp.render's per-row tables: the tiles, the mosaic centre, output pixel -> canvas (flips folded in)."""
        s = self.imgsz
        rows = p.matrix.shape[0]
        # Output pixel (u, v) shows what the unflipped output shows at (S-1-u, v) when flipped left-right (np.fliplr)
        flip = torch.eye(3, device=p.matrix.device).repeat(rows, 1, 1)
        flip[:, 0, 0] = torch.where(p.flip_lr, -1.0, 1.0)
        flip[:, 0, 2] = torch.where(p.flip_lr, s - 1.0, 0.0)
        flip[:, 1, 1] = torch.where(p.flip_ud, -1.0, 1.0)
        flip[:, 1, 2] = torch.where(p.flip_ud, s - 1.0, 0.0)
        inverse = torch.linalg.inv_ex(p.matrix)[0] @ flip  # output pixel -> canvas; inv_ex: no check, no host sync
        table = torch.stack((tiles.x_lo, tiles.x_hi, tiles.y_lo, tiles.y_hi, tiles.base), 1)
        return table, torch.stack((tiles.xc, tiles.yc), 1), inverse

    @property
    def _scale(self) -> float:
        return 1.0 if self.out_dtype is None else 1 / 255

    def _render(self, raw: RawBatch, p: AugmentParams, geometry) -> torch.Tensor:
        """The output samples' images, in one pass (warp.render): (B, 3, S, S) uint8 RGB in Ultralytics' batch format,
        or with `out_dtype` the network's input itself (values / 255, channels_last)."""
        s, b = self.imgsz, raw.samples
        dev = p.matrix.device
        table, centre, inverse = (t[:b] for t in geometry)
        if self.out_dtype is None:
            img = torch.empty((b, 3, s, s), dtype=torch.uint8, device=dev)
        else:
            img = torch.empty((b, 3, s, s), dtype=self.out_dtype, device=dev).to(memory_format=torch.channels_last)
        gains = p.hsv[:b] if any(self.hsv_gains) else None  # RandomHSV is skipped when every gain is 0, as Ultralytics does
        render(raw.images, table, centre, inverse, gains, ~p.rgb[:b], img, scale=self._scale, bgr_slots=not raw.rgb)
        return img

    def _mix_images(self, raw: RawBatch, p: AugmentParams, geometry, mix: _Mix, mixed: int, needed: int,
                    img: torch.Tensor) -> None:
        """Overwrite the `mixed` mixed samples of `img`: their own image and their partners (`needed` rows) rendered
        without HSV into uint8, MixUp's blend, CutMix's paste, then HSV and the channel order (warp.shade)."""
        s, b = self.imgsz, raw.samples
        dev = img.device
        rows = _first_true(mix.need, needed)  # the rows needed, in order
        table, centre, inverse = (t[rows] for t in geometry)
        parts = torch.empty((needed, 3, s, s), dtype=torch.uint8, device=dev)
        render(raw.images, table, centre, inverse, None, torch.zeros(needed, dtype=torch.bool, device=dev), parts,
               scale=1.0, bgr_slots=not raw.rgb)
        at = mix.need.long().cumsum(0) - 1  # row -> its image in `parts`
        samples = _first_true(mix.mixup | mix.cutmix, mixed)
        x1, y1, x2, y2 = mix.area.unbind(1)  # CutMix's area on the output: mirrored with the sample's flips
        lr, ud = p.flip_lr[:b], p.flip_ud[:b]
        area = torch.stack((torch.where(lr, s - x2, x1), torch.where(ud, s - y2, y1),
                            torch.where(lr, s - x1, x2), torch.where(ud, s - y1, y2)), 1)
        axis = torch.arange(s, device=dev, dtype=torch.float32)
        gains = p.hsv if any(self.hsv_gains) else None
        step = max(1, PIXELS_PER_PASS // (s * s))
        for first in range(0, mixed, step):
            idx = samples[first : first + step]
            n = len(idx)
            image = parts[at[idx]].float()
            if self.p_mixup > 0:  # block 1
                r = p.mix_ratio[idx].view(n, 1, 1, 1)
                blend = torch.floor(image * r + parts[at[b + idx]].float() * (1 - r))  # .astype(np.uint8) truncates
                image = torch.where(mix.mixup[idx].view(n, 1, 1, 1), blend, image)
            if self.p_cutmix > 0:  # the last block
                lo, hi = area[idx, None, :2], area[idx, None, 2:]  # (n, 1, 2)
                columns = (axis[None, :] >= lo[..., 0]) & (axis[None, :] < hi[..., 0])  # (n, S)
                lines = (axis[None, :] >= lo[..., 1]) & (axis[None, :] < hi[..., 1])
                inside = lines[:, None, :, None] & columns[:, None, None, :] & mix.cutmix[idx].view(n, 1, 1, 1)
                image = torch.where(inside, parts[at[self.mixes * b + idx]].float(), image)
            planes = shade(*image.view(n, 3, s * s).unbind(1), None if gains is None else gains[idx], ~p.rgb[idx],
                           self._scale, img.dtype)
            img[idx] = torch.stack(planes, 1).view(n, 3, s, s)

    def _warped_boxes(self, raw: RawBatch, p: AugmentParams, tiles: _Tiles):
        """Mosaic's shift and clip, RandomPerspective's warp and box_candidates: per label row, its rendered sample
        (the row of `groups`), its box on the unflipped output (pixels, xyxy) and whether it survives."""
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
        return sample, warped, keep

    def _mix_boxes(self, p: AugmentParams, b: int, row: torch.Tensor, xyxy: torch.Tensor, keep: torch.Tensor):
        """MixUp.apply_instances and CutMix.get_params / apply_instances on every label row at once: the partners'
        rows join their sample (host), MixUp's when it applies, CutMix's inside its area, clipped to it."""
        host, block = row % b, row // b
        mixup = p.mixup
        if self.p_mixup > 0:
            keep = keep & ((block != 1) | mixup[host])
        cutmix, area = torch.zeros_like(mixup), torch.zeros((b, 4), device=xyxy.device)
        if self.p_cutmix > 0:
            cut = self.mixes  # CutMix's partners: the last block
            before = keep & (block != cut)  # the sample's boxes when CutMix runs, MixUp's partner's included
            ioa = torch.where(before[:, None], bbox_ioa(p.cut_areas[host], xyxy[:, None]), 0.0)  # (K, 3)
            free = torch.zeros((b, 3), device=xyxy.device).index_add_(0, host, ioa) <= 0
            n_free = free.sum(1)
            pick = (p.cut_pick * n_free).floor().long()  # np.random.choice among the free candidates
            chosen = ((free.long().cumsum(1) - 1 == pick[:, None]) & free).long().argmax(1)
            area = p.cut_areas[torch.arange(b, device=xyxy.device), chosen]
            mine = block == cut
            inside = keep & mine & (bbox_ioa(area[host], xyxy) >= 0.1)
            hits = torch.zeros(b, dtype=torch.int64, device=xyxy.device).index_add_(0, host, inside.long())
            cutmix = p.cutmix & (n_free > 0) & (hits > 0)
            clipped = torch.minimum(torch.maximum(xyxy, area[host, :2].repeat(1, 2)), area[host, 2:].repeat(1, 2))
            xyxy = torch.where(mine[:, None], clipped, xyxy)
            keep = torch.where(mine, inside & cutmix[host], keep)
        mixed = mixup | cutmix
        need = torch.cat([mixed] + [mixup] * (self.p_mixup > 0) + [cutmix] * (self.p_cutmix > 0))
        return host, block, xyxy, keep, _Mix(mixup=mixup, cutmix=cutmix, area=area, need=need)

    def _format(self, raw: RawBatch, p: AugmentParams, host, block, xyxy, keep, mix: _Mix | None):
        """The flips and Format's xywh / S; the boxes of each sample in Ultralytics' order (its own, MixUp's partner's,
        CutMix's partner's). Returns them with the per-sample counts and (mixed samples, rows their mix reads)."""
        s, b = self.imgsz, raw.samples
        x1 = torch.where(p.flip_lr[host], s - xyxy[:, 2], xyxy[:, 0])
        x2 = torch.where(p.flip_lr[host], s - xyxy[:, 0], xyxy[:, 2])
        y1 = torch.where(p.flip_ud[host], s - xyxy[:, 3], xyxy[:, 1])
        y2 = torch.where(p.flip_ud[host], s - xyxy[:, 1], xyxy[:, 3])
        xywh = torch.stack(((x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1), 1) / s

        per_sample = torch.zeros(b, dtype=torch.int64, device=keep.device).index_add_(0, host, keep.long())
        if mix is None:
            counts, mixing = per_sample.tolist(), (0, 0)  # the one host sync
        else:
            read = torch.cat((per_sample, torch.stack(((mix.mixup | mix.cutmix).sum(), mix.need.sum())))).tolist()
            counts, mixing = read[:b], tuple(read[b:])  # the one host sync, with the sizes of the mix pass
        blocks = 1 + self.mixes
        order = torch.where(keep, host * blocks + block, b * blocks)  # labels are ordered by row already
        kept = torch.sort(order, stable=True).indices[:sum(counts)]
        return host[kept].float(), raw.labels[kept, 2:3], xywh[kept], counts, mixing


def bbox_ioa(area: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
    """ultralytics.utils.metrics.bbox_ioa on matching rows (broadcast, xyxy in the last dimension): the intersection
    with `area` over each box's own area."""
    wh = (torch.minimum(area[..., 2:], boxes[..., 2:]) - torch.maximum(area[..., :2], boxes[..., :2])).clamp(min=0)
    return wh.prod(-1) / ((boxes[..., 2:] - boxes[..., :2]).prod(-1) + 1e-7)


def _first_true(mask: torch.Tensor, n: int) -> torch.Tensor:
    """The indices of `mask`'s first `n` True entries, in order (n counted on the host: no sync here)."""
    return torch.sort((~mask).to(torch.uint8), stable=True).indices[:n]


def box_candidates(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """RandomPerspective.box_candidates: keep a warped box (xyxy, (K, 4)) when it is wider and taller than 2 pixels,
    keeps more than a tenth of its pre-warp area (`before`: (w, h) x scale, (K, 2)) and is not longer than 100:1."""
    w, h = after[:, 2] - after[:, 0], after[:, 3] - after[:, 1]
    aspect = torch.maximum(w / (h + 1e-16), h / (w + 1e-16))
    return (w > 2) & (h > 2) & (w * h / (before[:, 0] * before[:, 1] + 1e-16) > 0.1) & (aspect < 100)

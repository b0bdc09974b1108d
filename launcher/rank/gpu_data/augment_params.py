"""A GPU-augmented batch's random choices (rank/gpu_data/gpu_augment.py), all drawn at once on the batch's device, and
the mosaic layout they make."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from launcher.rank.data.raw_batch import RawBatch
from launcher.rank.gpu_data.augment_settings import AugmentSettings


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
class Tiles:
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


def draw(aug: AugmentSettings, raw: RawBatch, generator: torch.Generator) -> AugmentParams:
    """All of a batch's random choices in one draw from `generator` (which must live on the batch's device)."""
    rows, t = raw.groups.shape
    b, s = raw.samples, aug.imgsz
    blocks = aug.partner_blocks(raw)
    u = torch.rand((rows, 17), generator=generator, device=raw.images.device)

    def uniform(col, lo, hi):
        return lo + (hi - lo) * u[:, col]

    mosaic = (u[:, 0] <= aug.p_mosaic) if t == 4 else torch.zeros(rows, dtype=torch.bool, device=u.device)
    border = -s // 2  # Mosaic.border; the centre is int(uniform(-border, 2s + border)) = [s/2, 3s/2) for even s
    centre = uniform(slice(1, 3), -border, 2 * s + border).floor().long() * mosaic[:, None]
    params = dict(
        mosaic=mosaic,
        centre=centre,
        perspective=uniform(slice(3, 5), -aug.perspective, aug.perspective),
        angle=uniform(5, -aug.degrees, aug.degrees),
        scale=uniform(6, *aug.scale_range),
        shear=uniform(slice(7, 9), -aug.shear, aug.shear),
        translate=uniform(slice(9, 11), 0.5 - aug.translate, 0.5 + aug.translate),
        hsv=torch.stack([uniform(11 + k, -gain, gain) for k, gain in enumerate(aug.hsv_gains)], 1),
        flip_ud=u[:, 14] < aug.p_flipud,
        flip_lr=u[:, 15] < aug.p_fliplr,
        rgb=u[:, 16] > aug.p_bgr,
    )
    matrix = affine_matrix(aug, raw, params)
    if blocks:  # HSV and the flips come after the mix: a partner takes its sample's
        host = torch.arange(rows, device=u.device) % b
        params.update({k: params[k][host] for k in ("hsv", "flip_ud", "flip_lr", "rgb")})
        params.update(draw_mix(aug, b, generator, u.device))
    return AugmentParams(**params, matrix=matrix)


def draw_mix(aug: AugmentSettings, b: int, generator: torch.Generator, device) -> dict:
    """MixUp's and CutMix's choices for b samples: whether each applies, r, CutMix's 3 candidate areas."""
    s = aug.imgsz
    v = torch.rand((b, 12 + 63), generator=generator, device=device)
    off = torch.zeros(b, dtype=torch.bool, device=device)
    lam, cx, cy = v[:, 2:5], (v[:, 5:8] * s).floor().clamp(max=s - 1), (v[:, 8:11] * s).floor().clamp(max=s - 1)
    half = (s * torch.sqrt(1 - lam)).floor().div(2).floor()  # CutMix._rand_bbox: int(S * sqrt(1 - lam)) // 2
    return dict(
        mixup=v[:, 0] <= aug.p_mixup if aug.p_mixup > 0 else off,  # BaseMixTransform: uniform(0, 1) > p skips
        mix_ratio=v[:, 12:].kthvalue(32, 1).values,  # the 32nd smallest of 63 uniforms ~ Beta(32, 32)
        cutmix=v[:, 1] <= aug.p_cutmix if aug.p_cutmix > 0 else off,
        cut_areas=torch.stack(((cx - half).clamp(0, s), (cy - half).clamp(0, s),
                               (cx + half).clamp(0, s), (cy + half).clamp(0, s)), 2),
        cut_pick=v[:, 11],
    )


def affine_matrix(aug: AugmentSettings, raw: RawBatch, p: dict) -> torch.Tensor:
    """RandomPerspective._compute_affine_matrix, batched: M = T @ S @ R @ P @ C (applied right to left)."""
    s = aug.imgsz
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


def mosaic_tiles(aug: AugmentSettings, raw: RawBatch, p: AugmentParams) -> Tiles:
    """Mosaic.get_params' layout as tables. Without mosaic every quadrant is the sample's own image at (0, 0)."""
    s = aug.imgsz
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
    return Tiles(**{k: v.int() for k, v in tables.items()})  # int32: half the memory of per-pixel lookups

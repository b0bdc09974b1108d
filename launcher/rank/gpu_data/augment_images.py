"""A GPU-augmented batch's images (rank/gpu_data/gpu_augment.py): the tables warp.render reads, the output samples in
one pass, and the mixed samples' second pass (their parts rendered without HSV, blended or pasted, then shaded)."""

from __future__ import annotations

import torch

from launcher.rank.data.raw_batch import RawBatch
from launcher.rank.gpu_data.augment_boxes import Mix
from launcher.rank.gpu_data.augment_params import AugmentParams, Tiles
from launcher.rank.gpu_data.augment_settings import AugmentSettings
from launcher.rank.gpu_data.warp import PIXELS_PER_PASS, render, shade


def warp_tables(aug: AugmentSettings, p: AugmentParams,
                tiles: Tiles) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """warp.render's per-row tables: the tiles, the mosaic centre, output pixel -> canvas (flips folded in)."""
    s = aug.imgsz
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


def render_samples(aug: AugmentSettings, raw: RawBatch, p: AugmentParams, geometry) -> torch.Tensor:
    """The output samples' images, in one pass (warp.render): (B, 3, S, S) uint8 RGB in Ultralytics' batch format,
    or with `out_dtype` the network's input itself (values / 255, channels_last)."""
    s, b = aug.imgsz, raw.samples
    dev = p.matrix.device
    table, centre, inverse = (t[:b] for t in geometry)
    if aug.out_dtype is None:
        img = torch.empty((b, 3, s, s), dtype=torch.uint8, device=dev)
    else:
        img = torch.empty((b, 3, s, s), dtype=aug.out_dtype, device=dev).to(memory_format=torch.channels_last)
    gains = p.hsv[:b] if any(aug.hsv_gains) else None  # RandomHSV is skipped when every gain is 0, as Ultralytics does
    render(raw.images, table, centre, inverse, gains, ~p.rgb[:b], img, scale=aug.out_scale, bgr_slots=not raw.rgb)
    return img


def mix_images(aug: AugmentSettings, raw: RawBatch, p: AugmentParams, geometry, mix: Mix, mixed: int, needed: int,
               img: torch.Tensor) -> None:
    """Overwrite the `mixed` mixed samples of `img`: their own image and their partners (`needed` rows) rendered
    without HSV into uint8, MixUp's blend, CutMix's paste, then HSV and the channel order (warp.shade)."""
    s, b = aug.imgsz, raw.samples
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
    gains = p.hsv if any(aug.hsv_gains) else None
    step = max(1, PIXELS_PER_PASS // (s * s))
    for first in range(0, mixed, step):
        idx = samples[first : first + step]
        n = len(idx)
        image = parts[at[idx]].float()
        if aug.p_mixup > 0:  # block 1
            r = p.mix_ratio[idx].view(n, 1, 1, 1)
            blend = torch.floor(image * r + parts[at[b + idx]].float() * (1 - r))  # .astype(np.uint8) truncates
            image = torch.where(mix.mixup[idx].view(n, 1, 1, 1), blend, image)
        if aug.p_cutmix > 0:  # the last block
            lo, hi = area[idx, None, :2], area[idx, None, 2:]  # (n, 1, 2)
            columns = (axis[None, :] >= lo[..., 0]) & (axis[None, :] < hi[..., 0])  # (n, S)
            lines = (axis[None, :] >= lo[..., 1]) & (axis[None, :] < hi[..., 1])
            inside = lines[:, None, :, None] & columns[:, None, None, :] & mix.cutmix[idx].view(n, 1, 1, 1)
            image = torch.where(inside, parts[at[aug.mixes * b + idx]].float(), image)
        planes = shade(*image.view(n, 3, s * s).unbind(1), None if gains is None else gains[idx], ~p.rgb[idx],
                       aug.out_scale, img.dtype)
        img[idx] = torch.stack(planes, 1).view(n, 3, s, s)


def _first_true(mask: torch.Tensor, n: int) -> torch.Tensor:
    """The indices of `mask`'s first `n` True entries, in order (n counted on the host: no sync here)."""
    return torch.sort((~mask).to(torch.uint8), stable=True).indices[:n]

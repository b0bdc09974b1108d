"""A GPU-augmented batch's boxes (rank/gpu_data/gpu_augment.py): Mosaic's shift and clip, RandomPerspective's warp and
box_candidates, MixUp's and CutMix's rules, the flips and Format, on every label row at once; one host read per batch,
of how many boxes each sample keeps."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from launcher.rank.data.raw_batch import RawBatch
from launcher.rank.gpu_data.augment_params import AugmentParams, Tiles
from launcher.rank.gpu_data.augment_settings import AugmentSettings


@dataclass
class Mix:
    """What the boxes decided for the images: per output sample (B), and which rows (R) the mix reads."""

    mixup: torch.Tensor  # (B,) bool
    cutmix: torch.Tensor  # (B,) bool: CutMix applied (a free area with a partner box in it)
    area: torch.Tensor  # (B, 4) float32: CutMix's area, x1, y1, x2, y2 on the unflipped output
    need: torch.Tensor  # (R,) bool: the mixed samples and the partners their mix uses


def warped_boxes(aug: AugmentSettings, raw: RawBatch, p: AugmentParams, tiles: Tiles,
                 from_segments: torch.Tensor | None = None):
    """Mosaic's shift and clip, RandomPerspective's warp and box_candidates: per label row, its rendered sample
    (the row of `groups`), its box on the unflipped output (pixels, xyxy) and whether it survives. `from_segments`
    (K, 4): the boxes the rows' warped polygons give (augment_segments.segment_boxes), taken instead of the warped
    corners' and judged by Ultralytics' area threshold for polygons (0.01)."""
    s = aug.imgsz
    sample, tile = raw.labels[:, 0].long(), raw.labels[:, 1].long()
    mosaic = p.mosaic[sample]
    pad = torch.stack((tiles.pad_x[sample, tile], tiles.pad_y[sample, tile]), 1).float().repeat(1, 2)
    xyxy = raw.labels[:, 3:7] + pad
    clipped = xyxy.clamp(0, 2 * s)  # Mosaic._cat_labels: clip to the canvas, drop what has no area left
    alive = torch.where(mosaic, (clipped[:, 2] > clipped[:, 0]) & (clipped[:, 3] > clipped[:, 1]), tile == 0)
    if raw.valid is not None:
        alive &= raw.valid
    xyxy = torch.where(mosaic[:, None], clipped, xyxy)

    if from_segments is None:
        left, top, right, bottom = xyxy.unbind(1)
        corners = torch.stack((left, top, right, bottom, left, bottom, right, top), 1).view(-1, 4, 2)
        corners = torch.cat((corners, torch.ones_like(corners[..., :1])), 2) @ p.matrix[sample].transpose(1, 2)
        corners = corners[..., :2] / corners[..., 2:]
        warped = torch.cat((corners.amin(1), corners.amax(1)), 1).clamp(0, s)
    else:
        warped = from_segments.clamp(0, s)

    before = (xyxy[:, 2:] - xyxy[:, :2]) * p.scale[sample, None]
    keep = alive & box_candidates(before, warped, 0.1 if from_segments is None else 0.01)
    return sample, warped, keep


def mix_boxes(aug: AugmentSettings, p: AugmentParams, b: int, row: torch.Tensor, xyxy: torch.Tensor,
              keep: torch.Tensor, polygons: bool = False):
    """MixUp.apply_instances and CutMix.get_params / apply_instances on every label row at once: the partners'
    rows join their sample (host), MixUp's when it applies, CutMix's inside its area, clipped to it: from 0.1 of
    their area inside, or with `polygons` (a segmentation dataset) 0.01 where the sample has an instance."""
    host, block = row % b, row // b
    mixup = p.mixup
    if aug.p_mixup > 0:
        keep = keep & ((block != 1) | mixup[host])
    cutmix, area = torch.zeros_like(mixup), torch.zeros((b, 4), device=xyxy.device)
    if aug.p_cutmix > 0:
        cut = aug.mixes  # CutMix's partners: the last block
        before = keep & (block != cut)  # the sample's boxes when CutMix runs, MixUp's partner's included
        ioa = torch.where(before[:, None], bbox_ioa(p.cut_areas[host], xyxy[:, None]), 0.0)  # (K, 3)
        free = torch.zeros((b, 3), device=xyxy.device).index_add_(0, host, ioa) <= 0
        n_free = free.sum(1)
        pick = (p.cut_pick * n_free).floor().long()  # np.random.choice among the free candidates
        chosen = ((free.long().cumsum(1) - 1 == pick[:, None]) & free).long().argmax(1)
        area = p.cut_areas[torch.arange(b, device=xyxy.device), chosen]
        mine = block == cut
        least = 0.1
        if polygons:  # Ultralytics asks len(segments): the sample's instances, none leaving the box rule's 0.1
            had = torch.zeros(b, dtype=torch.int64, device=xyxy.device).index_add_(0, host, before.long()) > 0
            least = torch.where(had[host], 0.01, 0.1)
        inside = keep & mine & (bbox_ioa(area[host], xyxy) >= least)
        hits = torch.zeros(b, dtype=torch.int64, device=xyxy.device).index_add_(0, host, inside.long())
        cutmix = p.cutmix & (n_free > 0) & (hits > 0)
        clipped = torch.minimum(torch.maximum(xyxy, area[host, :2].repeat(1, 2)), area[host, 2:].repeat(1, 2))
        xyxy = torch.where(mine[:, None], clipped, xyxy)
        keep = torch.where(mine, inside & cutmix[host], keep)
    mixed = mixup | cutmix
    need = torch.cat([mixed] + [mixup] * (aug.p_mixup > 0) + [cutmix] * (aug.p_cutmix > 0))
    return host, block, xyxy, keep, Mix(mixup=mixup, cutmix=cutmix, area=area, need=need)


def collated_boxes(aug: AugmentSettings, raw: RawBatch, p: AugmentParams, host, block, xyxy, keep,
                   mix: Mix | None):
    """The flips and Format's xywh / S; the boxes of each sample in Ultralytics' order (its own, MixUp's partner's,
    CutMix's partner's). Returns them with the per-sample counts, (mixed samples, rows their mix reads) and the
    kept label rows in that order (which the rows' keypoints follow: augment_keypoints.collated_keypoints)."""
    s, b = aug.imgsz, raw.samples
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
    blocks = 1 + aug.mixes
    order = torch.where(keep, host * blocks + block, b * blocks)  # labels are ordered by row already
    kept = torch.sort(order, stable=True).indices[:sum(counts)]
    return host[kept].float(), raw.labels[kept, 2:3], xywh[kept], counts, mixing, kept


def bbox_ioa(area: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
    """ultralytics.utils.metrics.bbox_ioa on matching rows (broadcast, xyxy in the last dimension): the intersection
    with `area` over each box's own area."""
    wh = (torch.minimum(area[..., 2:], boxes[..., 2:]) - torch.maximum(area[..., :2], boxes[..., :2])).clamp(min=0)
    return wh.prod(-1) / ((boxes[..., 2:] - boxes[..., :2]).prod(-1) + 1e-7)


def box_candidates(before: torch.Tensor, after: torch.Tensor, area_thr: float = 0.1) -> torch.Tensor:
    """RandomPerspective.box_candidates: keep a warped box (xyxy, (K, 4)) when it is wider and taller than 2 pixels,
    keeps more than `area_thr` of its pre-warp area (`before`: (w, h) x scale, (K, 2)) and is not longer than
    100:1."""
    w, h = after[:, 2] - after[:, 0], after[:, 3] - after[:, 1]
    aspect = torch.maximum(w / (h + 1e-16), h / (w + 1e-16))
    return (w > 2) & (h > 2) & (w * h / (before[:, 0] * before[:, 1] + 1e-16) > area_thr) & (aspect < 100)

"""A GPU-augmented batch's keypoints (rank/gpu_data/gpu_augment.py): a pose dataset's payload of each label row, moved
by the same maths as its box (augment_boxes.py), on every point of every row at once.

Ultralytics' rules (ultralytics/data/augment.py and utils/instance.py), per step:
  * Mosaic: shifted with their tile; Instances.clip to the 2S canvas: a point outside it gets visibility 0, and is
    clamped onto it.
  * RandomPerspective.apply_keypoints: through the sample's M, with the perspective divide; outside [0, S] visibility
    0; then Instances.clip clamps to [0, S].
  * CutMix: the partner's points clipped to the pasted area as its boxes are (visibility 0 outside, clamped).
  * box_candidates and every other drop: a row's points go with its box.
  * RandomFlip up-down then left-right: y -> S - y, x -> S - x, each flip reordering the points by flip_idx.
  * Format(normalize=True): x / S, y / S; the visibility as it is.
"""

from __future__ import annotations

import torch

from launcher.rank.data.raw_batch import RawBatch
from launcher.rank.gpu_data.augment_params import AugmentParams, Tiles
from launcher.rank.gpu_data.augment_segments import flipped_segments, on_canvas, warped_points
from launcher.rank.gpu_data.augment_settings import AugmentSettings


def clipped(points: torch.Tensor, lo: torch.Tensor | float, hi: torch.Tensor | float) -> torch.Tensor:
    """Instances.clip on keypoints (..., P, 3): visibility 0 where x or y lies outside [lo, hi] (bounds broadcast
    against the points' (..., P, 2) coordinates), then the coordinates clamped into it."""
    xy, visible = points[..., :2], points[..., 2]
    outside = ((xy < lo) | (xy > hi)).any(-1)
    xy = xy.clamp(lo, hi)  # Python numbers or tensors on the points' device: no copy from the host
    return torch.cat((xy, torch.where(outside, torch.zeros_like(visible), visible)[..., None]), -1)


def warped_keypoints(aug: AugmentSettings, raw: RawBatch, p: AugmentParams, tiles: Tiles) -> torch.Tensor:
    """Mosaic's shift and clip, then RandomPerspective's warp and clip: (K, P, 3) x, y in pixels of the unflipped
    output and visibility, per label row of `raw` (whether the row survives is its box's: warped_boxes)."""
    s = aug.imgsz
    sample = raw.labels[:, 0].long()
    points = torch.cat((on_canvas(raw, tiles, raw.keypoints[..., :2]), raw.keypoints[..., 2:]), -1)
    points = torch.where(p.mosaic[sample, None, None], clipped(points, 0.0, 2.0 * s), points)
    points = torch.cat((warped_points(points[..., :2], p.matrix[sample]), points[..., 2:]), -1)
    return clipped(points, 0.0, float(s))


def cutmix_keypoints(aug: AugmentSettings, points: torch.Tensor, host: torch.Tensor, block: torch.Tensor,
                     area: torch.Tensor) -> torch.Tensor:
    """CutMix.apply_instances on the points of CutMix's partner rows (the last block): clipped to their sample's
    area (`area` (B, 4) x1, y1, x2, y2 on the unflipped output); the other rows' points unchanged."""
    mine = block == aug.mixes
    inside = clipped(points, area[host, None, :2], area[host, None, 2:])
    return torch.where(mine[:, None, None], inside, points)


def collated_keypoints(aug: AugmentSettings, p: AugmentParams, host: torch.Tensor, points: torch.Tensor,
                       kept: torch.Tensor) -> torch.Tensor:
    """The kept rows' points (`kept`: collated_boxes' order) flipped with their sample and reordered by flip_idx
    for each flip, then normalised by S: (N, P, 3), Ultralytics' batch["keypoints"]."""
    s = aug.imgsz
    points, host = points[kept], host[kept]
    lr, ud = p.flip_lr[host][:, None], p.flip_ud[host][:, None]
    points = torch.cat((flipped_segments(aug, p, host, points[..., :2]) / s, points[..., 2:]), -1)
    if aug.flip_idx:
        flip = aug.flip_table(points.device)
        order = torch.arange(points.shape[1], device=points.device).expand(len(points), -1)
        order = torch.where(ud, flip[order], order)  # up-down first: point j takes point flip_idx[j]
        order = torch.where(lr, order[:, flip], order)  # then left-right reorders the result again
        points = points.gather(1, order[..., None].expand(-1, -1, 3))
    return points

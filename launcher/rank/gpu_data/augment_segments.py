"""A GPU-augmented batch's polygons (rank/gpu_data/gpu_augment.py): the payload of each label row of a dataset
labelled with polygons (a segmentation dataset's, or a detection dataset's), M points along its outline
(rank/data/encoded.py's resample_segments), moved by the same matrices as its box and turning into the box Ultralytics
derives from it; a segmentation batch's masks are made from them at the end (segment_masks.py).

Ultralytics' rules (ultralytics/data/augment.py, utils/instance.py, utils/ops.py), per step:
  * Mosaic: shifted with their tile; Instances.clip to the 2S canvas clamps every point onto it.
  * RandomPerspective.apply_segments: every point through M, with the perspective divide; the box is
    ops.segment2box's (the extent of the polygon's part inside the S x S output: its points inside, its edges'
    crossings of the borders, the corners it encloses; zeros when nothing is inside), not the warped box's corners;
    then the points are clamped into that box (and by Instances.clip into the image). box_candidates keeps a row by
    an area threshold of 0.01 (0.10 for boxes warped as boxes).
  * CutMix: a partner box joins when at least 0.01 of its area lies in the pasted area (0.1 when the sample had no
    instance left); its points are clamped into that area, as its box is.
  * RandomFlip up-down then left-right: y -> S - y, x -> S - x.
The shift (on_canvas), the warp (warped_points), the box rule and the flips serve any polygon payload (an obb
dataset's corners take Ultralytics' preserve_obb clip, augment_obb.py, where polygons are clamped here); the masks are
Format's (segment_masks.py).
"""

from __future__ import annotations

import torch

from launcher.rank.data.raw_batch import RawBatch
from launcher.rank.gpu_data.augment_params import AugmentParams, Tiles
from launcher.rank.gpu_data.augment_settings import AugmentSettings

SEGMENT_POINTS = 100  # M: each label's polygon travels as this many points along its outline (Ultralytics: 1000)
POINTS_PER_PASS = 2**19  # segment_boxes' polygon points per pass: bounds its temporaries (~200 bytes per point)


def warped_segments(aug: AugmentSettings, raw: RawBatch, p: AugmentParams, tiles: Tiles) -> torch.Tensor:
    """Mosaic's shift and clamp to the canvas, then RandomPerspective's warp: (K, M, 2) points in pixels of the
    unflipped output, per label row of `raw`, not yet clamped to the image (segment_boxes reads them as they are)."""
    sample = raw.labels[:, 0].long()
    points = on_canvas(raw, tiles)
    points = torch.where(p.mosaic[sample, None, None], points.clamp(0.0, 2.0 * aug.imgsz), points)
    return warped_points(points, p.matrix[sample])


def on_canvas(raw: RawBatch, tiles: Tiles, points: torch.Tensor | None = None) -> torch.Tensor:
    """Each label row's points (K, M, 2): its polygon (RawBatch.segments) unless given (a pose row's keypoints),
    shifted with its tile onto the mosaic canvas (without mosaic: its image as it is), in pixels; Mosaic's clip to
    the canvas is the caller's (a clamp for polygons)."""
    sample, tile = raw.labels[:, 0].long(), raw.labels[:, 1].long()
    pad = torch.stack((tiles.pad_x[sample, tile], tiles.pad_y[sample, tile]), 1).float()
    return (raw.segments if points is None else points) + pad[:, None]


def warped_points(points: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """Points (K, M, 2) through their row's matrix (K, 3, 3), with the perspective divide
    (RandomPerspective.apply_segments)."""
    xy1 = torch.cat((points, torch.ones_like(points[..., :1])), -1) @ matrix.transpose(1, 2)
    return xy1[..., :2] / xy1[..., 2:]


def segment_boxes(points: torch.Tensor, size: int) -> torch.Tensor:
    """ultralytics.utils.ops.segment2box on every polygon at once ((K, M, 2) -> (K, 4) xyxy): the bounds of its
    points inside [0, size]^2, of its edges' crossings of the image's borders and of the image's corners it encloses
    (even-odd); zeros where there are none. In passes of POINTS_PER_PASS points."""
    k, m = points.shape[:2]
    step = max(1, POINTS_PER_PASS // max(m, 1))
    return torch.cat([_segment_boxes(points[i : i + step], float(size)) for i in range(0, k, step)]) if k else (
        points.new_zeros((0, 4)))


def _segment_boxes(points: torch.Tensor, size: float) -> torch.Tensor:
    x, y = points[..., 0], points[..., 1]
    inside = (x >= 0) & (y >= 0) & (x <= size) & (y <= size)
    delta = points.roll(-1, 1) - points  # each point's edge to the next (the last closes the polygon)
    # crossings of x = 0, x = size, y = 0, y = size: (n, M, 4) positions along the edge, and the crossing point
    quarter = torch.arange(4, device=points.device)  # made on the device: no copy from the host per batch
    bound = (quarter % 2) * size  # x = 0, x = size, y = 0, y = size
    start = torch.stack((x, x, y, y), -1)
    step = torch.stack((delta[..., 0],) * 2 + (delta[..., 1],) * 2, -1)
    t = (bound - start) / step  # inf or nan where the edge runs along the border's axis: never in [0, 1]
    along = (t >= 0) & (t <= 1)
    vertical = quarter < 2  # the borders x = 0 and x = size
    cross_x = torch.where(vertical, bound, x[..., None] + t * delta[..., 0:1])
    cross_y = torch.where(vertical, y[..., None] + t * delta[..., 1:2], bound)
    other = torch.where(vertical, cross_y, cross_x)
    crossing = along & (other >= 0) & (other <= size)
    # the image's corners inside the polygon (cv2.pointPolygonTest >= 0; a corner on an edge is rare and moves the
    # box by nothing: the edge's crossings are that corner too)
    cx, cy = bound, (quarter // 2) * size  # (0, 0), (size, 0), (0, size), (size, size)
    y0, x0, dx, dy = y[:, None], x[:, None], delta[:, None, :, 0], delta[:, None, :, 1]  # (n, 1, M)
    spans = (y0 > cy[:, None]) != (y0 + dy > cy[:, None])  # (n, 4, M): the edge spans the corner's row
    at = x0 + (cy[:, None] - y0) * dx / torch.where(dy == 0, torch.ones_like(dy), dy)
    enclosed = ((spans & (cx[:, None] < at)).sum(-1) % 2) == 1  # (n, 4)

    n = len(points)  # the bounds of every candidate: the points inside, the crossings, the enclosed corners
    valid = torch.cat((inside, crossing.flatten(1), enclosed), 1)
    xs = torch.cat((x, cross_x.flatten(1), cx.expand(n, 4)), 1)
    ys = torch.cat((y, cross_y.flatten(1), cy.expand(n, 4)), 1)
    lo = torch.stack((xs, ys), -1).masked_fill(~valid[..., None], float("inf")).amin(1)
    hi = torch.stack((xs, ys), -1).masked_fill(~valid[..., None], float("-inf")).amax(1)
    return torch.where(valid.any(1, keepdim=True), torch.cat((lo, hi), 1), torch.zeros_like(lo).repeat(1, 2))


def clamped_into(points: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
    """Each polygon's points (K, M, 2) clamped into its box (K, 4) xyxy, coordinate by coordinate, as
    RandomPerspective.apply_segments and CutMix (to its area) clamp them."""
    return torch.minimum(torch.maximum(points, boxes[:, None, :2]), boxes[:, None, 2:])


def cutmix_segments(aug: AugmentSettings, points: torch.Tensor, host: torch.Tensor, block: torch.Tensor,
                    area: torch.Tensor) -> torch.Tensor:
    """CutMix.apply_instances on the polygons of CutMix's partner rows (the last block): clamped into their sample's
    area (`area` (B, 4) x1, y1, x2, y2 on the unflipped output); the other rows' unchanged."""
    mine = block == aug.mixes
    return torch.where(mine[:, None, None], clamped_into(points, area[host]), points)


def flipped_segments(aug: AugmentSettings, p: AugmentParams, host: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """The rows' polygons (N, M, 2) flipped with their sample (`host` (N,)), still in output pixels."""
    s = aug.imgsz
    x = torch.where(p.flip_lr[host][:, None], s - points[..., 0], points[..., 0])
    y = torch.where(p.flip_ud[host][:, None], s - points[..., 1], points[..., 1])
    return torch.stack((x, y), -1)

"""An oriented-box dataset's label rows through the GPU augmentation (rank/gpu_data/gpu_augment.py): clipped to the
canvas, the image and CutMix's area as Ultralytics clips them, and reduced to its targets, for every row at once,
with no per-row loop and no copy to the host.

An OBB row is carried by its 4 corners. Ultralytics carries it as the polygon ops.resample_segments makes of them
(data/dataset.py: 100 points, the corners among them), and every warp maps the quad's edges to straight edges, so
that polygon's convex hull, its bounds and its minimum-area rectangle are the corners' own.

Ultralytics' rule (utils/instance.py Instances.clip with preserve_obb=True, used by Mosaic at 2S, RandomPerspective
at S and CutMix in the pasted area's frame): a row whose points all lie on the canvas keeps its polygon and box; any
other row's polygon is replaced by the rectangle, along the unclipped polygon's minimum-area rectangle, that bounds
its visible part (its convex hull intersected with the canvas), and its box by the visible part's bounds; a row with
no visible area gets zeros (which remove_zero_area_boxes or box_candidates then drop).

The steps (ultralytics/data/augment.py with preserve_obb): Mosaic shifts the corners with their tile, clips at 2S
and drops rows of no area; RandomPerspective warps them (augment_segments.warped_points), clips at S (the box is
the visible part's bounds, segment2box's for a row inside) and keeps rows by box_candidates' polygon threshold
(0.01); CutMix clips its partner's rows in the pasted area's frame and drops those of no area; the flips mirror
the corners; Format's bboxes are their xywhr (obb_targets).
"""

from __future__ import annotations

import math

import torch

from launcher.rank.data.raw_batch import RawBatch
from launcher.rank.gpu_data.augment_boxes import box_candidates
from launcher.rank.gpu_data.augment_params import AugmentParams, Tiles
from launcher.rank.gpu_data.augment_rotated import min_area_rects
from launcher.rank.gpu_data.augment_segments import on_canvas, warped_points
from launcher.rank.gpu_data.augment_settings import AugmentSettings

OBB_CORNERS = 4  # M of an obb dataset's payload: each row's corners (Ultralytics resamples them to 100 points)
MAX_VERTICES = 8  # a convex quad clipped by 4 half-planes: at most one more vertex per half-plane


def clipped_obbs(corners: torch.Tensor, w: torch.Tensor | float, h: torch.Tensor | float,
                 x0: torch.Tensor | float = 0.0, y0: torch.Tensor | float = 0.0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Instances.clip(w, h, preserve_obb=True) on the polygons of `corners` (N, 4, 2), in the frame of the canvas
    [x0, x0 + w] x [y0, y0 + h] (each bound a Python number or an (N,) tensor on the corners' device): CutMix's
    add_padding(-x1, -y1), clip(x2 - x1, y2 - y1), add_padding(x1, y1) is x0, y0 = x1, y1 and w, h = x2 - x1, y2 - y1.

    Returns boxes (N, 4) xyxy, corners (N, 4, 2) and visible (N,) bool, in the corners' dtype and frame:
      * rows wholly on the canvas: their corners unchanged and their bounds, what RandomPerspective.apply_segments'
        segment2box gives them; visible True (a degenerate one too: dropping it is the box area's business);
      * rows crossing its edge: the corners of the rectangle bounding the visible part along the direction
        Ultralytics takes from cv2.minAreaRect of the unclipped polygon (its longer side, angle in [-pi/2, pi/2)),
        in Ultralytics' order (u2, v2), (u2, v1), (u1, v1), (u1, v2); the box is the visible part's bounds;
      * rows with no visible area (cv2.intersectConvexConvex's area 0): zeros, visible False.
    The corners' convex hull is clipped by Sutherland-Hodgman on padded (N, 8, 2) vertex tensors; the direction is
    min_area_rects' on the corners, so where the unclipped polygon's minimum-area rectangle is a tie (a triangle, a
    rhombus, some quads, to float32 rounding) it may be another minimal one than cv2's, and the rectangle with it.
    A row's corners and Ultralytics' 100 points have the same bounds only to rounding: a corner within about 1e-4 px
    of the canvas' edge may fall on the other side of the inside test than Ultralytics' warped points do."""
    x0, y0 = _column(x0, corners), _column(y0, corners)
    lo = torch.stack(torch.broadcast_tensors(x0, y0), -1)  # (N or 1, 1, 2)
    p = corners - lo  # Ultralytics' add_padding(-x1, -y1)
    size = torch.stack(torch.broadcast_tensors(_column(w, corners), _column(h, corners)), -1)
    inside = ((p.amin(1) >= 0) & (p.amax(1) <= size[:, 0])).all(1)

    poly, count = _clipped_hull(p, size[:, 0])
    visible = (count > 0) & (_area(poly) > 0)
    vis_lo, vis_hi = poly.amin(1), poly.amax(1)  # the padding slots repeat vertex 0

    angle = min_area_rects(p)[:, 4]
    angle = torch.where(angle >= math.pi / 2, angle - math.pi, angle)  # cv2's width angle, +90 when w < h
    cos, sin = torch.cos(angle)[:, None], torch.sin(angle)[:, None]
    u = poly[..., 0] * cos + poly[..., 1] * sin
    v = poly[..., 1] * cos - poly[..., 0] * sin
    u1, u2, v1, v2 = u.amin(1), u.amax(1), v.amin(1), v.amax(1)
    rect_u, rect_v = torch.stack((u2, u2, u1, u1), 1), torch.stack((v2, v1, v1, v2), 1)
    rect = torch.stack((rect_u * cos - rect_v * sin, rect_u * sin + rect_v * cos), -1)

    cross = ~inside[:, None]
    out_corners = torch.where(cross[..., None], rect + lo, corners)  # Ultralytics' add_padding(x1, y1) after
    boxes = torch.where(cross, torch.cat((vis_lo, vis_hi), 1) + lo[:, 0].repeat(1, 2),
                        torch.cat((corners.amin(1), corners.amax(1)), 1))
    visible = inside | visible
    zero = torch.zeros((), dtype=corners.dtype, device=corners.device)
    return (torch.where(visible[:, None], boxes, zero), torch.where(visible[:, None, None], out_corners, zero),
            visible)


def warped_obbs(aug: AugmentSettings, raw: RawBatch, p: AugmentParams, tiles: Tiles
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mosaic's shift, clip at 2S and zero-area drop, RandomPerspective's warp, clip at S and box_candidates (area
    threshold 0.01) on the corners (RawBatch.segments (K, 4, 2)) of every label row: per row its rendered sample
    (the row of `groups`), its box (xyxy) and corners (K, 4, 2) on the unflipped output, in pixels, and whether it
    survives (augment_boxes.warped_boxes' contract, with the corners)."""
    s = aug.imgsz
    sample, tile = raw.labels[:, 0].long(), raw.labels[:, 1].long()
    mosaic = p.mosaic[sample]
    corners = on_canvas(raw, tiles)
    canvas, clipped, _ = clipped_obbs(corners, 2.0 * s, 2.0 * s)  # Mosaic._cat_labels
    alive = torch.where(mosaic, _has_area(canvas), tile == 0)
    if raw.valid is not None:
        alive &= raw.valid
    before = torch.where(mosaic[:, None], canvas, torch.cat((corners.amin(1), corners.amax(1)), 1))
    corners = torch.where(mosaic[:, None, None], clipped, corners)
    boxes, corners, _ = clipped_obbs(warped_points(corners, p.matrix[sample]), float(s), float(s))
    keep = alive & box_candidates((before[:, 2:] - before[:, :2]) * p.scale[sample, None], boxes, 0.01)
    return sample, boxes, keep, corners


def cutmix_obbs(aug: AugmentSettings, corners: torch.Tensor, host: torch.Tensor, block: torch.Tensor,
                area: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CutMix.apply_instances with preserve_obb on CutMix's partner rows (the last block): their corners clipped in
    the frame of their sample's area (`area` (B, 4) x1, y1, x2, y2 on the unflipped output), those left with no
    area dropped from `keep` (remove_zero_area_boxes; the paste itself stands). The other rows unchanged."""
    mine = block == aug.mixes
    a = area[host]
    boxes, clipped, _ = clipped_obbs(corners, a[:, 2] - a[:, 0], a[:, 3] - a[:, 1], a[:, 0], a[:, 1])
    return torch.where(mine[:, None, None], clipped, corners), keep & (_has_area(boxes) | ~mine)


def _has_area(boxes: torch.Tensor) -> torch.Tensor:
    """Instances.remove_zero_area_boxes' test on xyxy boxes (N, 4): wider and taller than nothing."""
    return (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])


def obb_targets(corners: torch.Tensor, imgsz: int) -> torch.Tensor:
    """Format(return_obb=True, normalize=True)'s batch bboxes for rows of `corners` (N, 4, 2) in pixels of the
    imgsz x imgsz output: xyxyxyxy2xywhr of each row's polygon (min_area_rects: w the longer side, theta in
    [-pi/4, 3pi/4)), then cx, w divided by the width and cy, h by the height, theta as it is: (N, 5)."""
    rects = min_area_rects(corners)
    return torch.cat((rects[:, :4] / imgsz, rects[:, 4:]), 1)


def _column(x: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    """A bound as an (N or 1, 1) tensor in `like`'s dtype and device (a Python number goes with no host copy)."""
    if isinstance(x, torch.Tensor):
        return x.to(like.dtype).reshape(-1, 1)
    return torch.full((1, 1), float(x), dtype=like.dtype, device=like.device)


def _hull_order(p: torch.Tensor) -> torch.Tensor:
    """The convex hull of each row's 4 points as a closed (N, 4, 2) polygon, as cv2.convexHull gives Ultralytics'
    clip: the points in angular order about their mean (a simple polygon, even from corners listed in a crossing
    order), a reflex vertex (a point inside the others' triangle) replaced by its predecessor."""
    q = p - p.mean(1, keepdim=True)
    order = torch.atan2(q[..., 1], q[..., 0]).argsort(1)
    p = torch.gather(p, 1, order[..., None].expand(-1, -1, 2))
    prev, nxt = p.roll(1, 1), p.roll(-1, 1)
    a, b = p - prev, nxt - p
    turn = a[..., 0] * b[..., 1] - a[..., 1] * b[..., 0]  # positive at a convex vertex of the increasing-angle order
    return torch.where((turn < 0)[..., None], prev, p)


def _clipped_hull(p: torch.Tensor, size: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The corners' hull clipped to [0, size] (size (N or 1, 2)) by Sutherland-Hodgman: (N, MAX_VERTICES, 2) vertices,
    the first `count` (N,) of them the visible polygon in order, the rest copies of the first (or zeros if none)."""
    n = p.shape[0]
    poly = torch.cat((_hull_order(p), p[:, :1].expand(-1, MAX_VERTICES - 4, -1)), 1)
    count = torch.full((n,), 4, dtype=torch.long, device=p.device)
    slots = torch.arange(MAX_VERTICES, device=p.device)
    for axis, upper in ((0, False), (0, True), (1, False), (1, True)):
        bound = size[:, axis:axis + 1] if upper else torch.zeros_like(size[:, :1])
        poly, count = _clip_step(poly, count, slots, axis, bound, upper)
    return poly, count


def _clip_step(poly: torch.Tensor, count: torch.Tensor, slots: torch.Tensor, axis: int, bound: torch.Tensor,
               upper: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One Sutherland-Hodgman pass against the half-plane coordinate `axis` <= bound (upper) or >= bound: each vertex
    emits itself if inside and the edge's crossing point if the edge to its successor crosses the line."""
    valid = slots < count[:, None]
    nxt_index = torch.where(slots + 1 < count[:, None], slots + 1, 0)
    nxt = torch.gather(poly, 1, nxt_index[..., None].expand(-1, -1, 2))
    c, d = poly[..., axis], nxt[..., axis]
    keep = (c <= bound) if upper else (c >= bound)
    keep_next = (d <= bound) if upper else (d >= bound)
    crossing = valid & (keep != keep_next)
    t = (bound - c) / torch.where(crossing, d - c, torch.ones_like(c))
    point = poly + t[..., None] * (nxt - poly)
    point[..., axis] = torch.where(crossing, bound.expand_as(c), point[..., axis])  # exactly on the line
    emitted = torch.stack((poly, point), 2).flatten(1, 2)  # (N, 2 * MAX_VERTICES, 2): vertex, crossing, ...
    mask = torch.stack((valid & keep, crossing), 2).flatten(1)
    order = (~mask).to(torch.uint8).argsort(dim=1, stable=True)[:, :poly.shape[1]]  # emitted slots first, in order
    count = mask.sum(1).clamp_max(poly.shape[1])
    out = torch.gather(emitted, 1, order[..., None].expand(-1, -1, 2))
    first = torch.where((count > 0)[:, None], out[:, 0], torch.zeros_like(out[:, 0]))
    return torch.where((slots < count[:, None])[..., None], out, first[:, None]), count


def _area(poly: torch.Tensor) -> torch.Tensor:
    """Each clipped polygon's area by the shoelace formula (its padding slots repeat vertex 0: no area)."""
    nxt = poly.roll(-1, 1)
    return 0.5 * (poly[..., 0] * nxt[..., 1] - poly[..., 1] * nxt[..., 0]).sum(1).abs()

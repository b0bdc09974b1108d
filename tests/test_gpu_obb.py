"""Oriented boxes clipped and formatted on tensors (rank/gpu_data/augment_obb.py) against Ultralytics 8.4.190 itself:
Instances(...).clip(w, h, preserve_obb=True) on the 100-point polygons ops.resample_segments makes of the same
float32 corners (as an OBB dataset's labels are), and Format(return_obb=True)'s bboxes.

Rows: rotated rectangles and parallelograms (a shear in the warp), perspective-warped quads, inside the canvas,
across one edge, across a corner, wholly outside, tiny, corners listed in a crossing order; canvases S (the
RandomPerspective clip), 2S (Mosaic's) and per-row pasted areas (CutMix's frame).

Tolerances, on coordinates up to 1300 px: boxes and the rectangles' corners within 2e-3 px (both sides compute in
float32; cv2.intersectConvexConvex's crossing points and ours differ by rounding, about 2e-4 px seen); the
rectangles' corners compared in Ultralytics' own order, else up to their cyclic order where the orientation is a
near tie (a near-square's sides). Format's cx, cy, w, h within 2e-3 px before normalising, its rectangle's corners
likewise up to their cyclic order."""

from __future__ import annotations

import math

import cv2
import numpy as np
import pytest
import torch
from ultralytics.data.augment import Format
from ultralytics.utils import ops
from ultralytics.utils.instance import Instances

from launcher.rank.gpu_data.augment_obb import clipped_obbs, obb_targets
from launcher.rank.gpu_data.augment_rotated import min_area_rects

ATOL = 2e-3  # px
S = 640
POINTS = 100  # an OBB dataset's polygon length (data/dataset.py)
CORNER_SLOTS = np.searchsorted(np.linspace(0, 4, POINTS - 5), np.arange(4)) + np.arange(4)  # where resampling puts them


def polygons(corners: np.ndarray) -> np.ndarray:
    """The (N, 100, 2) float32 polygons an OBB dataset makes of (N, 4, 2) corners."""
    return np.stack(ops.resample_segments(list(corners), n=POINTS)) if len(corners) else np.zeros((0, POINTS, 2))


def reference(corners: np.ndarray, w: float, h: float, x0: float = 0, y0: float = 0) -> tuple[np.ndarray, ...]:
    """Ultralytics on one canvas: boxes (N, 4), the polygons' corners (N, 4, 2), the polygons (N, 100, 2) and whether
    each row kept an area, from Instances.clip(w, h, preserve_obb=True) in the canvas' frame (CutMix's add_padding
    either side), with the boxes RandomPerspective.apply_segments gives (segment2box) going in."""
    segments = polygons(corners)
    boxes = np.stack([ops.segment2box(s, 10**6, 10**6) for s in segments]).astype(np.float32)  # the bounds
    inside = (segments.min(1) >= (x0, y0)).all(1) & (segments.max(1) <= (x0 + w, y0 + h)).all(1)
    instances = Instances(boxes, segments.copy(), bbox_format="xyxy", normalized=False)
    instances.add_padding(-x0, -y0)
    instances.clip(w, h, preserve_obb=True)
    kept = inside | instances.bboxes.any(1)  # the rows the clip did not zero
    instances.add_padding(x0, y0)
    out_boxes, out_segments = instances.bboxes * kept[:, None], instances.segments * kept[:, None, None]
    return out_boxes, out_segments[:, CORNER_SLOTS], out_segments, kept


def corner_gap(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per row, the largest distance between two quads' corners under the best cyclic order."""
    return np.min([np.linalg.norm(a - np.roll(b, k, axis=1), axis=-1).max(1) for k in range(4)], 0)


def check(corners: np.ndarray, w=S, h=S, x0=0.0, y0=0.0, ties: float = 0.0) -> dict[str, int]:
    """clipped_obbs against Ultralytics on one canvas (or per-row canvases: bounds as (N,) arrays); returns how many
    rows were inside, crossing and zeroed, to show each family is exercised. Up to a fraction `ties` of the crossing
    rows may have a rectangle other than Ultralytics': only where the unclipped polygon's minimum-area rectangle is a
    tie (cv2's and min_area_rects' areas equal, their directions not), and then it must be the rectangle bounding the
    same visible part along min_area_rects' direction."""
    n, per_row = len(corners), any(np.ndim(b) for b in (w, h, x0, y0))
    w, h, x0, y0 = (np.broadcast_to(np.asarray(b, dtype=np.float32), (n,)) for b in (w, h, x0, y0))
    parts = [reference(corners[i:i + 1], w[i], h[i], x0[i], y0[i]) for i in range(n)]
    ref_boxes, ref_corners, ref_segments, ref_kept = (np.concatenate(p) for p in zip(*parts))
    bounds = [torch.from_numpy(b.copy()) for b in (w, h, x0, y0)] if per_row else [float(b[0]) for b in (w, h, x0, y0)]
    boxes, out, visible = clipped_obbs(torch.from_numpy(corners), *bounds)
    assert boxes.dtype == out.dtype == torch.float32 and visible.dtype == torch.bool
    boxes, out, visible = boxes.numpy(), out.numpy(), visible.numpy()
    np.testing.assert_array_equal(visible, ref_kept)
    np.testing.assert_allclose(boxes, ref_boxes, rtol=0, atol=ATOL)
    lo, hi = np.c_[x0, y0], np.c_[x0 + w, y0 + h]
    inside = (corners.min(1) >= lo).all(1) & (corners.max(1) <= hi).all(1)
    np.testing.assert_array_equal(out[inside], corners[inside])  # inside rows are left as they are
    same = corner_gap(out, ref_corners) <= ATOL  # the same rectangle; mostly in Ultralytics' own corner order
    assert (np.linalg.norm(out - ref_corners, axis=-1).max(1) <= ATOL).mean() >= 0.95 * same.mean()
    np.testing.assert_allclose(polygons(out[same]), ref_segments[same], rtol=0, atol=ATOL)  # the same 100 points
    tied = np.flatnonzero(~same)
    assert len(tied) <= ties * (~inside & ref_kept).sum(), len(tied)
    for i in tied:
        assert_tie(corners[i] - lo[i], out[i] - lo[i], hi[i] - lo[i])
    return {"inside": int(inside.sum()), "crossing": int((~inside & ref_kept).sum()), "zeroed": int((~ref_kept).sum())}


def assert_tie(corners: np.ndarray, rect: np.ndarray, size: np.ndarray) -> None:
    """`rect` bounds the visible part of `corners` (in the canvas' frame) along min_area_rects' direction for them,
    and that direction's rectangle ties with cv2.minAreaRect's on the unclipped polygon."""
    mine = min_area_rects(torch.from_numpy(corners[None]))[0].numpy().astype(np.float64)
    theirs = ops.xyxyxyxy2xywhr(polygons(corners[None]))[0]
    assert mine[2] * mine[3] == pytest.approx(theirs[2] * theirs[3], rel=1e-5)
    canvas = np.array(((0, 0), (size[0], 0), size, (0, size[1])), np.float32)
    _, part = cv2.intersectConvexConvex(cv2.convexHull(polygons(corners[None])[0]), canvas)
    basis = np.array(((math.cos(mine[4]), -math.sin(mine[4])), (math.sin(mine[4]), math.cos(mine[4]))))
    extents = [np.r_[p.min(0), p.max(0)] for p in (part.reshape(-1, 2) @ basis, rect @ basis)]
    np.testing.assert_allclose(extents[1], extents[0], rtol=0, atol=ATOL)


def quads(rng: np.random.Generator, n: int, lo: float, hi: float, size: tuple[float, float],
          shear: float = 0.0) -> np.ndarray:
    """n rotated rectangles with centres in [lo, hi]^2 and sides in `size`, sheared by up to `shear` degrees along
    x then y (parallelograms, as a warp with shear makes them): (n, 4, 2) float32 corners."""
    boxes = np.c_[rng.uniform(lo, hi, (n, 2)), rng.uniform(*size, (n, 2)), rng.uniform(-math.pi, math.pi, n)]
    corners = ops.xywhr2xyxyxyxy(boxes)
    sx, sy = (np.tan(np.radians(rng.uniform(-shear, shear, (n, 1)))) for _ in range(2))
    q = corners - corners.mean(1, keepdims=True)
    q = np.stack((q[..., 0] + sx * q[..., 1], q[..., 1]), -1)
    q = np.stack((q[..., 0], q[..., 1] + sy * q[..., 0]), -1)
    return (corners.mean(1, keepdims=True) + q).astype(np.float32)


@pytest.mark.parametrize("shear", [0.0, 30.0])
def test_rows_inside_across_an_edge_across_a_corner_outside_and_tiny(shear):
    rng = np.random.default_rng(int(shear))
    rows = np.concatenate([
        quads(rng, 200, 150, 490, (5, 250), shear),  # mostly inside
        quads(rng, 300, -60, 700, (20, 300), shear),  # across edges and corners, some outside
        quads(rng, 100, -40, 40, (20, 200), shear),  # about the top-left corner
        quads(rng, 100, -400, -200, (20, 200), shear),  # wholly outside
        quads(rng, 200, -2, 642, (0.5, 3), shear),  # tiny, many across an edge
    ])
    seen = check(rows)
    assert min(seen.values()) >= 100, seen


def test_mosaic_canvas_and_perspective_quads():
    """Mosaic's 2S clip, and quads through a random perspective matrix (convex, no two sides parallel)."""
    rng = np.random.default_rng(3)
    rows = quads(rng, 600, -100, 2 * S + 100, (20, 400))
    assert min(check(rows, 2 * S, 2 * S).values()) >= 20
    m = np.array([[1, 0.1, 0], [0.05, 1, 0], [4e-4, -3e-4, 1]])
    xy1 = np.concatenate((quads(rng, 600, -60, 700, (20, 300)), np.ones((600, 4, 1))), -1) @ m.T
    warped = (xy1[..., :2] / xy1[..., 2:]).astype(np.float32)
    assert min(check(warped, ties=0.05).values()) >= 20


def test_per_row_canvases_as_cutmix_clips():
    """Each row clipped in its own pasted area's frame: bounds as (N,) tensors, integer areas as CutMix casts them."""
    rng = np.random.default_rng(4)
    x1, y1 = rng.integers(0, 400, (2, 400))
    w, h = rng.integers(40, 240, (2, 400))
    rows = quads(rng, 400, -110, 110, (3, 100), 15) + np.c_[x1 + w / 2, y1 + h / 2][:, None].astype(np.float32)
    seen = check(rows, w, h, x1, y1)
    assert min(seen.values()) >= 30, seen


def test_corners_in_any_order_are_their_convex_hull():
    """Corners listed in a crossing order, or with one inside the others' triangle, clip as cv2.convexHull sees them
    (inside rows keep theirs as given). A triangle's edge-flush rectangles tie, so its direction may be another."""
    rng = np.random.default_rng(5)
    rows = quads(rng, 300, -60, 700, (20, 300))
    assert check(rows[:150][:, [0, 2, 1, 3]])["crossing"] >= 50
    triangles = rows[150:].copy()
    triangles[:, 3] = triangles[:, :3].mean(1)  # an inner point
    assert check(triangles, ties=1.0)["crossing"] >= 50


def test_orientation_and_visible_bounds():
    """A 45-degree bar across the right edge: its rectangle keeps the bar's direction (not the visible part's own
    minimum-area one, nor the axes) and reaches past the edge; its box is the visible part's bounds."""
    bar = ops.xywhr2xyxyxyxy(np.array([[S, 320, 200, 40, math.pi / 4]])).astype(np.float32)
    boxes, corners, visible = clipped_obbs(torch.from_numpy(bar), S, S)
    box, corners = boxes[0].numpy(), corners[0].numpy()
    sides = np.diff(np.r_[corners, corners[:1]], axis=0)
    np.testing.assert_allclose(np.abs(sides[:, 0]), np.abs(sides[:, 1]), atol=ATOL)  # at +-45 degrees
    assert visible.tolist() == [True] and box[2] == S and corners[:, 0].max() > S + 10
    visible_part = np.r_[bar[0][bar[0, :, 0] <= S], [[S, 320 - 20 * math.sqrt(2)], [S, 320 + 20 * math.sqrt(2)]]]
    np.testing.assert_allclose(box, np.r_[visible_part.min(0), visible_part.max(0)], atol=ATOL)


def test_obb_targets_equal_format():
    rng = np.random.default_rng(6)
    rows = quads(rng, 400, -60, 700, (2, 300), 20)
    boxes, corners, visible = clipped_obbs(torch.from_numpy(rows), S, S)
    corners = torch.cat((corners[visible], torch.from_numpy(quads(rng, 100, 150, 490, (64, 64)))))  # and squares
    segments = polygons(corners.numpy())
    instances = Instances(np.zeros((len(segments), 4), np.float32), segments, bbox_format="xyxy", normalized=False)
    labels = {"img": np.zeros((S, S, 3), np.uint8), "cls": np.zeros((len(segments), 1)), "instances": instances}
    ref = Format(bbox_format="xywh", normalize=True, return_obb=True)(labels)["bboxes"].numpy().astype(np.float64)
    got = obb_targets(corners, S)
    assert got.dtype == torch.float32 and got.shape == (len(segments), 5)
    got = got.numpy().astype(np.float64)
    pixels = np.c_[np.r_[got, ref][:, :4] * S, np.r_[got, ref][:, 4]]
    gap = corner_gap(ops.xywhr2xyxyxyxy(pixels[:len(got)]), ops.xywhr2xyxyxyxy(pixels[len(got):]))
    assert (gap <= ATOL).all()
    clear = (ref[:, 2] - ref[:, 3]) * S > ATOL  # w and h apart: the same parameters, not only the same rectangle
    np.testing.assert_allclose(got[clear, :4], ref[clear, :4], rtol=0, atol=ATOL / S)
    np.testing.assert_allclose(got[clear, 4], ref[clear, 4], rtol=0, atol=1e-5)


def test_no_rows():
    boxes, corners, visible = clipped_obbs(torch.zeros((0, 4, 2)), S, S)
    assert boxes.shape == (0, 4) and corners.shape == (0, 4, 2) and visible.shape == (0,)
    assert obb_targets(torch.zeros((0, 4, 2)), S).shape == (0, 5)

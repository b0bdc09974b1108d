"""An oriented box's rotated rectangle on tensors (rank/gpu_data/augment_rotated.py) against Ultralytics 8.4.190's
ops.xyxyxyxy2xywhr (cv2.minAreaRect per row) on the same float32 points: rotated rectangles resampled to 100 points
as an OBB dataset's labels are, warped by random affine matrices and clipped as RandomPerspective.apply_segments
clips segments, random convex and non-convex polygons, squares, rectangles at 0/45/90 degrees and degenerate rows.

Tolerances, on coordinates up to 640 px: the rectangles' corners (xywhr2xyxyxyxy, up to their cyclic order) within
2e-3 px; where w and h differ and theta is clear of the range's ends, cx, cy, w, h within 2e-3 px and theta within
1e-5 rad. A row where the corners differ must be a tie: its rectangle holds every point (to 2e-3 px) with an area
within 1e-5 of cv2's, a case clipped polygons meet (every edge-flush rectangle of a triangle with acute base angles
has the same area) and the other families must not."""

from __future__ import annotations

import math

import cv2
import numpy as np
import pytest
import torch
from ultralytics.utils import ops

from launcher.rank.gpu_data import augment_rotated
from launcher.rank.gpu_data.augment_rotated import min_area_rects

ATOL = 2e-3  # px
ANGLE_ATOL = 1e-5  # rad
AREA_RTOL = 1e-5
S = 640


def reference(points: np.ndarray, valid: np.ndarray | None = None) -> np.ndarray:
    """xyxyxyxy2xywhr on each row's valid points (all of a row at once when every point is valid)."""
    if valid is None:
        return ops.xyxyxyxy2xywhr(points).reshape(-1, 5)
    return np.stack([ops.xyxyxyxy2xywhr(p[None, v])[0] if v.any() else np.zeros(5) for p, v in zip(points, valid)])


def corner_gap(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per row, the largest distance between the rectangles' corners under the best cyclic order."""
    ca, cb = ops.xywhr2xyxyxyxy(a.astype(np.float64)), ops.xywhr2xyxyxyxy(b.astype(np.float64))
    gaps = [np.linalg.norm(ca - np.roll(cb, k, axis=1), axis=-1).max(1) for k in range(4)]
    return np.min(gaps, 0)


def holds(points: np.ndarray, r: np.ndarray) -> bool:
    """Whether rectangle `r` (cx, cy, w, h, theta) holds every point, to ATOL."""
    u = np.array([math.cos(r[4]), math.sin(r[4])])
    q = points.astype(np.float64) - r[:2]
    s, t = q @ u, q @ np.array([-u[1], u[0]])
    return bool(np.abs(s).max() <= r[2] / 2 + ATOL and np.abs(t).max() <= r[3] / 2 + ATOL)


def check(points: np.ndarray, valid: np.ndarray | None = None, ties_allowed: bool = False) -> int:
    """min_area_rects against xyxyxyxy2xywhr on `points` (N, M, 2) float32; returns the number of tied rows."""
    ref = reference(points, valid)
    got = min_area_rects(torch.from_numpy(points), None if valid is None else torch.from_numpy(valid))
    assert got.dtype == torch.float32 and got.shape == (len(points), 5)
    got = got.numpy().astype(np.float64)
    assert (got[:, 2] >= got[:, 3]).all() and (got[:, 3] >= 0).all()
    assert ((got[:, 4] >= -math.pi / 4 - 1e-6) & (got[:, 4] < 3 * math.pi / 4 + 1e-6)).all()  # float32's ends
    same = corner_gap(got, ref) <= ATOL
    clear = same & (ref[:, 2] - ref[:, 3] > ATOL) & (np.abs(np.abs(ref[:, 4] - math.pi / 4) - math.pi / 2) > 1e-4)
    np.testing.assert_allclose(got[clear, :4], ref[clear, :4], rtol=0, atol=ATOL)
    np.testing.assert_allclose(got[clear, 4], ref[clear, 4], rtol=0, atol=ANGLE_ATOL)
    for i in np.flatnonzero(~same):
        assert ties_allowed, (i, ref[i], got[i])
        pts = points[i] if valid is None else points[i][valid[i]]
        assert holds(pts, got[i]), (i, ref[i], got[i])
        assert got[i, 2] * got[i, 3] <= ref[i, 2] * ref[i, 3] * (1 + AREA_RTOL) + 1e-6, (i, ref[i], got[i])
    return int((~same).sum())


def rotated_rects(rng: np.random.Generator, n: int, square: bool = False) -> np.ndarray:
    """n random rotated rectangles (squares) as ops.resample_segments makes an OBB label's 4 corners: (n, 100, 2)."""
    w = rng.uniform(2, 300, n)
    h = w if square else rng.uniform(2, 300, n)
    boxes = np.stack((rng.uniform(100, 540, n), rng.uniform(100, 540, n), w, h, rng.uniform(-math.pi, math.pi, n)), 1)
    return np.stack(ops.resample_segments(list(ops.xywhr2xyxyxyxy(boxes).astype(np.float32)), n=100))


def warped_clipped(rng: np.random.Generator, segments: np.ndarray) -> np.ndarray:
    """Each segment through a random affine matrix (rotation, scale, shear, translation), then clipped to the S x S
    image as RandomPerspective.apply_segments clips segments (to segment2box's box, zeros when wholly outside)."""
    out = []
    for seg in segments:
        a, scale = math.radians(rng.uniform(-45, 45)), rng.uniform(0.5, 1.5)
        shear = np.tan(np.radians(rng.uniform(-10, 10, 2)))
        m = np.array([[1, shear[0], rng.uniform(-250, 250)], [shear[1], 1, rng.uniform(-250, 250)], [0, 0, 1]])
        m = m @ np.array([[math.cos(a) * scale, -math.sin(a) * scale, 0], [math.sin(a) * scale, math.cos(a) * scale, 0],
                          [0, 0, 1]])
        xy = (np.c_[seg, np.ones(len(seg))] @ m.T)[:, :2].astype(np.float32)
        box = ops.segment2box(xy, S, S)
        out.append(np.stack((xy[:, 0].clip(box[0], box[2]), xy[:, 1].clip(box[1], box[3])), 1))
    return np.stack(out).astype(np.float32)


def test_resampled_rotated_rectangles_and_squares():
    rng = np.random.default_rng(0)
    assert check(rotated_rects(rng, 300)) == 0
    assert check(rotated_rects(rng, 100, square=True)) == 0


def test_warped_and_clipped_rectangles():
    rng = np.random.default_rng(1)
    segments = warped_clipped(rng, rotated_rects(rng, 400))
    clipped = ((segments == 0) | (segments == S)).any((1, 2))
    assert clipped.sum() > 50  # the clipping is exercised
    ties = check(segments, ties_allowed=True)
    assert ties <= 0.1 * clipped.sum()  # exact ties, which cv2 breaks by its float32 rounding: about 6% here


def test_random_convex_and_non_convex_polygons():
    rng = np.random.default_rng(2)
    clouds = rng.uniform(0, S, (300, 30, 2)).astype(np.float32)  # any order: self-crossing polygons
    hulls = [cv2.convexHull(c[:rng.integers(3, 30)]).reshape(-1, 2) for c in clouds[:200]]
    angle = np.sort(rng.uniform(0, 2 * math.pi, (200, 12)), 1)[..., None]
    stars = rng.uniform(200, 440, (200, 1, 2)) + rng.uniform(20, 200, (200, 12, 1)) * np.concatenate(
        (np.cos(angle), np.sin(angle)), -1)  # random radii about the centre: non-convex
    polygons = np.stack(ops.resample_segments(hulls + list(stars.astype(np.float32)), n=100))
    assert check(clouds, ties_allowed=True) <= 0.03 * len(clouds)  # near ties to float32 rounding (areas 1e-7 apart)
    assert check(polygons, ties_allowed=True) <= 0.03 * len(polygons)


@pytest.mark.parametrize("degrees", [0, 45, 90, 135, -45])
def test_axis_and_diagonal_rectangles_and_squares(degrees):
    boxes = np.array([[320, 240, 200, 80, math.radians(degrees)], [100.5, 50.25, 64, 64, math.radians(degrees)],
                      [320, 240, 80, 200, math.radians(degrees)]])
    corners = ops.xywhr2xyxyxyxy(boxes).astype(np.float32)
    assert check(corners) == 0
    assert check(np.stack(ops.resample_segments(list(corners), n=100))) == 0


def test_axis_aligned_square_as_cv2_names_it():
    """An exact square: cv2's width is its side at [-pi/2, 0), so theta is pi/2 for an axis-aligned one."""
    square = torch.tensor([[[0.0, 0.0], [5.0, 0.0], [5.0, 5.0], [0.0, 5.0]]])
    assert min_area_rects(square).tolist() == [[2.5, 2.5, 5.0, 5.0, pytest.approx(math.pi / 2)]]


def test_degenerate_rows():
    rows = np.array([
        [[3, 4]] * 6,  # one point: w = h = 0, theta pi/2
        [[0, 0], [1, 1], [3, 3], [2, 2], [1, 1], [0, 0]],  # collinear, diagonal
        [[0, 0], [0, 3], [0, 1], [0, 2], [0, 3], [0, 0]],  # collinear, vertical
        [[5, 7], [9, 7], [5, 7], [9, 7], [6, 7], [5, 7]],  # collinear, horizontal, repeated
        [[0, 0], [1, -1], [3, -3], [2, -2], [3, -3], [0, 0]],  # collinear at -45 degrees: the range's end
        [[10, 10], [10, 10], [10, 10], [10, 10], [10, 10], [12, 11]],  # two distinct points
    ], dtype=np.float32)
    assert check(rows) == 0
    assert min_area_rects(torch.from_numpy(rows[:1])).tolist() == [[3.0, 4.0, 0.0, 0.0, pytest.approx(math.pi / 2)]]
    assert min_area_rects(torch.zeros((0, 100, 2))).shape == (0, 5)
    assert min_area_rects(torch.ones((3, 0, 2))).tolist() == [[0.0] * 5] * 3


def test_valid_points_only():
    rng = np.random.default_rng(3)
    points = np.concatenate((rotated_rects(rng, 60), rng.uniform(0, S, (60, 100, 2))), 0).astype(np.float32)
    valid = np.ones((120, 100), bool)
    valid[60:] = rng.random((60, 100)) < 0.2
    valid[60:, :3] = True
    points[60:][~valid[60:]] += 1e4  # invalid points far off: they would change any rectangle they entered
    assert check(points, valid, ties_allowed=True) <= 1
    none = min_area_rects(torch.tensor([[[3.0, 4.0], [5.0, 6.0]]]), torch.zeros((1, 2), dtype=torch.bool))
    assert none.tolist() == [[3.0, 4.0, 0.0, 0.0, pytest.approx(math.pi / 2)]]  # its first point's


def test_chunks_give_the_same_rectangles(monkeypatch):
    points = torch.from_numpy(rotated_rects(np.random.default_rng(4), 20))
    whole = min_area_rects(points)
    monkeypatch.setattr(augment_rotated, "CHUNK_ELEMENTS", 3 * 100 * 100)  # 7 chunks, the last one short
    torch.testing.assert_close(min_area_rects(points), whole, rtol=0, atol=1e-4)  # matmuls' batch sizes differ


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_without_host_sync():
    rng = np.random.default_rng(5)
    points = warped_clipped(rng, rotated_rects(rng, 200))
    cpu = min_area_rects(torch.from_numpy(points))
    cuda_points = torch.from_numpy(points).cuda()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rects = min_area_rects(cuda_points)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert rects.device == cuda_points.device
    assert (corner_gap(rects.cpu().numpy(), cpu.numpy()) <= ATOL).mean() >= 0.95

"""An oriented-box dataset's rotated boxes on the GPU (rank/gpu_data/gpu_augment.py): each label row's polygon reduced
to its minimum-area rectangle, as Format(return_obb=True) does with ultralytics.utils.ops.xyxyxyxy2xywhr
(cv2.minAreaRect per row), for every row at once and with no copy to the host.

The minimum-area rectangle of a point set has a side along an edge of its convex hull. Seen from a hull vertex, the
other points lie in a cone narrower than pi that holds the direction to the points' mean (inside the hull), and its
two hull neighbours bound that cone: so the point with the least signed angle from that direction is a hull
neighbour of each hull vertex, and these M directions per row hold every hull edge (a point inside the hull adds a
direction that cannot beat the minimum). Each direction's rectangle comes from the points' projections; the least
area wins. Memory is a few (rows, M, M) tensors, bounded by working through the rows in chunks.

An OBB dataset's polygons reach Format as Instances.clip(preserve_obb=True) leaves them: a polygon crossing the image's
edge replaced by the rectangle, along its unclipped minimum-area rectangle's direction, that bounds its visible part
(not clipped coordinate-wise as a segment dataset's are); that clipping is the caller's.
"""

from __future__ import annotations

import math

import torch

CHUNK_ELEMENTS = 1 << 22  # rows * M * M per chunk: about 11 such tensors live at once, ~180 MB in float32


def min_area_rects(points: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """ultralytics.utils.ops.xyxyxyxy2xywhr on tensors: (N, M, 2) points, `valid` (N, M) marking the points each row
    has (all when None), to (N, 5) cx, cy, w, h, theta in the points' dtype and device (zeros when M is 0).

    As xyxyxyxy2xywhr reports cv2.minAreaRect: w is the longer side, theta the angle in radians of the w side in
    [-pi/4, 3pi/4) (y down). On a tie of the sides, w is the side cv2 calls the width, the one whose direction lies in
    [-pi/2, 0) modulo pi, so a square's theta falls in [-pi/4, 0) or [pi/2, 3pi/4). Degenerate rows as cv2 gives them:
    collinear points have h = 0 (to rounding) and theta along the line; equal points give w = h = 0 and theta = pi/2;
    a row with no valid point gives its first point's.

    Both sides compute in float32, so a near tie may fall the other way than cv2's: a near-square's sides (theta
    pi/2 apart), a long side at the range's ends (theta -pi/4 against 3pi/4), where the rectangle is the same up to
    its corners' order; or two hull edges whose rectangles have equal areas (a rhombus; every edge-flush rectangle of
    a triangle with acute base angles, common in polygons clipped at an image corner), where both are minimal.
    Memory: about 11 * 4 * min(N, CHUNK_ELEMENTS / M^2) * M^2 bytes in float32 at once, whatever N."""
    n, m = points.shape[:2]
    if m == 0:
        return points.new_zeros((n, 5))
    if valid is None:
        valid = torch.ones((n, m), dtype=torch.bool, device=points.device)
    rows = max(1, CHUNK_ELEMENTS // (m * m))
    chunks = [_rects(points[i:i + rows], valid[i:i + rows]) for i in range(0, n, rows)]
    return torch.cat(chunks) if chunks else points.new_zeros((0, 5))


def _hull_directions(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unit candidate directions (R, M, 2), one per point of centred rows `q` (R, M, 2), and whether it has one:
    from each point to the other point with the least signed angle from its direction to the mean (the origin)."""
    v = q[:, None] - q[:, :, None]  # (R, i, j, 2): point i to point j
    cx, cy = -q[..., 0:1], -q[..., 1:2]  # point i to the mean
    rel = torch.atan2(cx * v[..., 1] - cy * v[..., 0], cx * v[..., 0] + cy * v[..., 1])
    usable = (v != 0).any(-1)  # a point equal to point i (an invalid one among them) gives no direction
    j = rel.masked_fill(~usable, math.inf).argmin(2)  # (R, i)
    edge = torch.gather(v, 2, j[..., None, None].expand(-1, -1, 1, 2)).squeeze(2)
    has = usable.any(2)
    fallback = torch.zeros_like(edge)
    fallback[..., 0] = 1.0  # built on the device: no copy from the host
    unit = edge / edge.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(q.dtype).tiny)
    return torch.where(has[..., None], unit, fallback), has


def _rects(points: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """min_area_rects on one chunk of rows."""
    first = torch.gather(points, 1, ok.int().argmax(1)[:, None, None].expand(-1, 1, 2))  # a row's first valid point
    points = torch.where(ok[..., None], points, first)  # a repeated point changes neither hull nor extents
    mean = points.mean(1, keepdim=True)
    q = points - mean  # centred for float32 precision
    u, has = _hull_directions(q)
    ux, uy = u[..., 0:1], u[..., 1:2]  # (R, candidate, 1)
    s = ux * q[:, None, :, 0] + uy * q[:, None, :, 1]  # (R, candidate, point): along the candidate direction
    t = ux * q[:, None, :, 1] - uy * q[:, None, :, 0]  # across it
    s_lo, s_hi, t_lo, t_hi = s.amin(2), s.amax(2), t.amin(2), t.amax(2)
    along, across = s_hi - s_lo, t_hi - t_lo
    # a row without a direction keeps its first candidate, (1, 0): its points all coincide
    area = (along * across).masked_fill(~has & has.any(1, keepdim=True), math.inf)
    best = area.argmin(1, keepdim=True)

    def pick(x: torch.Tensor) -> torch.Tensor:
        return torch.gather(x, 1, best).squeeze(1)

    ux, uy = pick(u[..., 0]), pick(u[..., 1])
    mid_s, mid_t = pick(s_hi + s_lo) / 2, pick(t_hi + t_lo) / 2
    cx = mean[:, 0, 0] + ux * mid_s - uy * mid_t
    cy = mean[:, 0, 1] + uy * mid_s + ux * mid_t
    return torch.stack((cx, cy, *_canonical(torch.atan2(uy, ux), pick(along), pick(across))), 1)


def _canonical(angle: torch.Tensor, along: torch.Tensor, across: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """w, h, theta as xyxyxyxy2xywhr makes them from a rectangle with sides `along` (at `angle`) and `across`:
    cv2's width is the side at [-pi/2, 0) modulo pi; w the longer side, the width on a tie; theta in [-pi/4, 3pi/4)."""
    d = torch.remainder(angle, math.pi)  # [0, pi)
    first = d >= math.pi / 2  # the `along` side is cv2's width
    width_dir = torch.where(first, d - math.pi, d - math.pi / 2)  # [-pi/2, 0)
    width, height = torch.where(first, along, across), torch.where(first, across, along)
    swap = width < height
    theta = torch.where(swap, width_dir + math.pi / 2, width_dir)
    theta = torch.where(theta < -math.pi / 4, theta + math.pi, theta)
    return torch.where(swap, height, width), torch.where(swap, width, height), theta

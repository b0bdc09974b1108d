"""Format's masks of a GPU-augmented segmentation batch (rank/gpu_data/gpu_augment.py), from the polygons that survived
(augment_segments.py), on the batch's device, every instance at once.

Ultralytics (data/augment.py Format._format_segments, data/utils.py polygon2mask, polygons2masks_overlap) fills each
polygon at full resolution (cv2.fillPoly on coordinates truncated to integers, boundary included), shrinks it by
mask_ratio r (cv2.resize, bilinear), and with overlap_mask one (S/r)^2 mask per image holds value i + 1 for the i-th
instance in order of mask area, largest first, smaller ones drawn over larger ones; the image's label rows take
that order. Here each mask pixel (u, v) is the even-odd test of its centre at full-resolution (r (u + 1/2),
r (v + 1/2)) against the polygon grown outward by GROW pixels: fillPoly's boundary and the bilinear shrink add about
a pixel of full resolution around each polygon (tests/test_gpu_segments.py measures the agreement).

The scanline test: per instance and mask row, the crossings of the polygon's edges with the row's centre line, each
mapped to the first mask column whose centre lies right of it, counted into a (rows, columns + 1) table by a
scatter_add; the running count's parity is the inside. In passes of ELEMENTS_PER_PASS table and crossing cells.
"""

from __future__ import annotations

import torch

GROW = 1.0  # full-resolution pixels the polygon grows by: fillPoly's boundary pixels and the shrink's blur
ELEMENTS_PER_PASS = 2**22  # crossing and table cells per pass: bounds the temporaries (~25 bytes each)


def grown(points: torch.Tensor, by: float) -> torch.Tensor:
    """Each polygon (N, M, 2) with its points moved `by` outward along the normal of their neighbours' chord (its
    orientation from its signed area): a polygon grown by about `by`; a polygon of no area unchanged."""
    chord = points.roll(-1, 1) - points.roll(1, 1)
    normal = torch.stack((chord[..., 1], -chord[..., 0]), -1)
    normal = normal / normal.norm(dim=-1, keepdim=True).clamp(min=1e-6)
    x, y = points[..., 0], points[..., 1]
    area = (x * y.roll(-1, 1) - x.roll(-1, 1) * y).sum(1)  # twice the signed area: > 0 counter-clockwise (y down)
    return points + by * torch.sign(area)[:, None, None] * normal


def rasterized(points: torch.Tensor, size: int, ratio: int, grow: float = GROW) -> torch.Tensor:
    """(N, size, size) bool: the polygons (N, M, 2) of output pixels filled at mask resolution (size = S / ratio)."""
    n, m = points.shape[:2]
    out = torch.zeros((n, size, size), dtype=torch.bool, device=points.device)
    if n == 0:
        return out
    points = grown(points, grow) if grow else points
    rows = (torch.arange(size, device=points.device, dtype=points.dtype) + 0.5) * ratio  # (size,) row centres
    step = max(1, ELEMENTS_PER_PASS // (size * (m + size + 1)))
    for lo in range(0, n, step):
        a = points[lo : lo + step, None]  # (n, 1, M, 2)
        b = a.roll(-1, 2)
        ay, by_ = a[..., 1], b[..., 1]
        y = rows[None, :, None]
        crosses = (ay > y) != (by_ > y)  # half-open: a vertex on the line counts once
        dy = torch.where(by_ == ay, torch.ones_like(ay), by_ - ay)
        x = a[..., 0] + (y - ay) * (b[..., 0] - a[..., 0]) / dy  # (n, size, M)
        column = torch.floor(x / ratio - 0.5).add(1).clamp(0, size)  # the first column whose centre is right of x
        column = column.nan_to_num(0.0).long()  # a point the perspective divide sent to nan indexes column 0
        table = torch.zeros((x.shape[0], size, size + 1), dtype=torch.int32, device=points.device)
        table.scatter_add_(2, column, crosses.int())
        out[lo : lo + step] = (table[..., :size].cumsum(2, dtype=torch.int32) & 1).bool()
    return out


def formatted_masks(inside: torch.Tensor, image: torch.Tensor, counts: list[int], cls: torch.Tensor, *,
                    overlap: bool) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Format's masks from the batch's instance masks (`inside` (N, h, w) bool, the rows in batch order: grouped by
    `image` (N,) int64, `counts` per image, `cls` (N, 1)).

    Returns (order, masks, sem_masks). With `overlap`: order (N,) the rows sorted within each image by mask area,
    those of no area first, then the largest first (ties keep their order), which the batch's label rows take;
    masks (B, h, w) uint8 (int32 past 255 instances in an image), 0 outside, i + 1 where the i-th of its image in
    that order is the last (smallest) covering it. Without: order None, masks (N, h, w) uint8 in batch order. sem_masks (B, h, w) float32: the class
    of the smallest instance covering each pixel; where none does, with overlap the class of the image's last row
    (Format indexes its classes by mask - 1), without it 0."""
    n, h, w = inside.shape
    b, device = len(counts), inside.device
    per_image = torch.zeros(b, dtype=torch.int64, device=device).index_add_(0, image, torch.ones_like(image))
    starts = per_image.cumsum(0) - per_image  # on the device: no copy from the host per batch
    area = inside.view(n, -1).sum(1)
    # by image, then by area descending; Ultralytics' areas are unsigned (np.uint8 masks' sums), so its argsort of
    # -area puts the instances of no area first
    key = image * (h * w + 1) + torch.where(area > 0, h * w + 1 - area, 0)
    order = torch.sort(key, stable=True).indices
    rank = torch.empty_like(order)
    rank[order] = torch.arange(n, device=device) - starts[image[order]]
    composed = torch.zeros((b, h * w), dtype=torch.float32, device=device)  # ranks + 1, exact in float32
    step = max(1, ELEMENTS_PER_PASS // max(h * w, 1))
    for lo in range(0, n, step):
        values = inside[lo : lo + step].view(-1, h * w) * (rank[lo : lo + step, None] + 1).float()
        composed.scatter_reduce_(0, image[lo : lo + step, None].expand_as(values), values, "amax")
    composed = composed.view(b, h, w).int()
    sorted_cls = cls.view(-1)[order] if n else cls.view(-1)
    last = per_image - 1
    index = torch.where(composed > 0, composed.long() - 1, last[:, None, None]) if overlap else composed.long() - 1
    covered = (index >= 0) & (per_image[:, None, None] > 0)
    flat = (starts[:, None, None] + index.clamp(min=0)).clamp(max=max(n - 1, 0))
    sem = torch.where(covered, sorted_cls[flat] if n else torch.zeros_like(flat, dtype=torch.float32), 0.0).float()
    if overlap:
        return order, composed.to(torch.uint8 if max(counts, default=0) <= 255 else torch.int32), sem
    return None, inside.to(torch.uint8), sem

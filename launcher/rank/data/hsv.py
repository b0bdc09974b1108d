"""Ultralytics' RandomHSV on tensors, operation for operation: the same uint8 results as OpenCV and its LUTs."""

from __future__ import annotations

import torch


def hsv_augment(bgr: torch.Tensor, gains: torch.Tensor) -> torch.Tensor:
    """RandomHSV, operation for operation: integer-valued float BGR (B, P, 3), gains r (B, 3) -> the same, augmented.

    1. cv2.COLOR_BGR2HSV on uint8: OpenCV's integer arithmetic with its division tables (hue 0..179).
    2. Ultralytics' three 256-entry LUTs per sample, in float64 as NumPy computes them, truncated like astype(uint8).
    3. cv2.COLOR_HSV2BGR on uint8: OpenCV's float32 arithmetic (its SIMD path), truncated.
    """
    dev = bgr.device
    px = bgr.to(torch.int32)
    b, g, r = px.unbind(-1)
    v = px.amax(-1)
    diff = v - px.amin(-1)
    i = torch.arange(256, device=dev, dtype=torch.float64)
    sdiv = torch.where(i > 0, (255 * 4096 / i).round(), 0).to(torch.int32)  # hsv_shift = 12
    hdiv = torch.where(i > 0, (180 * 4096 / (6 * i)).round(), 0).to(torch.int32)
    sat = (diff * sdiv[v] + 2048) >> 12
    hue = torch.where(v == r, g - b, torch.where(v == g, b - r + 2 * diff, r - g + 4 * diff))
    hue = (hue * hdiv[diff] + 2048) >> 12  # arithmetic shift: rounds negative hues the way OpenCV does
    hue = torch.where(hue < 0, hue + 180, hue)

    r64 = gains.double()
    luts = torch.stack(
        (
            torch.remainder(i + r64[:, 0:1] * 180, 180),
            (i * (r64[:, 1:2] + 1)).clamp(0, 255),
            (i * (r64[:, 2:3] + 1)).clamp(0, 255),
        ),
        1,
    ).to(torch.uint8)  # (B, 3, 256)
    hue, sat, v = (luts[:, c].gather(1, x.long()).float() for c, x in enumerate((hue, sat, v)))

    f32 = dict(device=dev, dtype=torch.float32)
    one, inv255 = torch.ones((), **f32), torch.ones((), **f32) / 255  # C++'s 1.0f / 255.0f
    h = hue * (torch.full((), 6.0, **f32) / 180)  # 6.0f / hrange
    sector = h.trunc()
    h = h - sector
    sector = sector - (sector * (one / 6)).trunc() * 6
    s, v = sat * inv255, v * inv255
    t0, t1, t2, t3 = v, v * (one - s), v * _one_minus(s, h), v * _one_minus(s, one - h)
    # which of them is blue, green and red in each sextant of the hue (OpenCV's sector table)
    blue = torch.where(sector < 2, t1, torch.where(sector == 2, t3, torch.where(sector < 5, t0, t2)))
    green = torch.where(sector < 1, t3, torch.where(sector < 3, t0, torch.where(sector == 3, t2, t1)))
    red = torch.where((sector < 1) | (sector > 4), t0, torch.where(sector == 1, t2, torch.where(sector < 4, t1, t3)))
    return (torch.stack((blue, green, red), -1) * 255).trunc().clamp(0, 255)


def _one_minus(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """float32 1 - a b rounded once, as OpenCV's compiled code computes it (a fused multiply-add); the product of two
    float32 numbers is exact in float64."""
    return (1 - a.double() * b.double()).float()

"""The colour operations of a classification batch on the device, as torchvision computes them on PIL images
(Ultralytics' classify pipeline): RandAugment's brightness, colour, contrast, sharpness, posterize, solarize,
autocontrast and equalize, and ColorJitter's brightness, contrast, saturation and hue. Each takes a batch x
(n, 3, h, w) of float values holding what PIL's uint8 image holds, and a per-image parameter ((n,) on x's device),
and rounds as PIL does: the enhancements blend with a degenerate image and truncate (Image.blend), the grey image
is PIL's "L" conversion (ITU-R 601-2 luma in 16-bit fixed point), the lookup tables are ImageOps'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SMOOTH = torch.tensor([[1.0, 1.0, 1.0], [1.0, 5.0, 1.0], [1.0, 1.0, 1.0]]) / 13  # ImageFilter.SMOOTH


def _col(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float32).view(-1, 1, 1, 1)


def blend(degenerate: torch.Tensor, x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """Image.blend(degenerate, x, factor), ImageEnhance's step: degenerate + factor x (x - degenerate), clipped to
    [0, 255] and truncated."""
    return torch.floor((degenerate + _col(factor) * (x - degenerate)).clamp(0, 255))


def grey(x: torch.Tensor) -> torch.Tensor:
    """PIL's convert("L"): (R 19595 + G 38470 + B 7471 + 2^15) >> 16, as (n, 1, h, w) (exact in float32)."""
    r, g, b = x[:, 0:1], x[:, 1:2], x[:, 2:3]
    return torch.floor((r * 19595 + g * 38470 + b * 7471 + 32768) / 65536)


def brightness(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """ImageEnhance.Brightness (F.adjust_brightness): a blend with black."""
    return blend(torch.zeros_like(x), x, factor)


def saturation(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """ImageEnhance.Color (F.adjust_saturation; RandAugment's Color): a blend with the grey image."""
    return blend(grey(x).expand_as(x), x, factor)


def contrast(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """ImageEnhance.Contrast (F.adjust_contrast): a blend with the grey image's mean, rounded to an integer."""
    mean = torch.floor(grey(x).double().mean((1, 2, 3)) + 0.5).float()
    return blend(_col(mean).expand_as(x), x, factor)


def sharpness(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """ImageEnhance.Sharpness (F.adjust_sharpness): a blend with ImageFilter.SMOOTH's image, whose border pixels
    are the image's own (PIL filters the inner pixels alone), rounded to the nearest."""
    n, c, h, w = x.shape
    kernel = SMOOTH.to(x.device).expand(c, 1, 3, 3)
    smooth = torch.floor(F.conv2d(x, kernel, groups=c) + 0.5).clamp(0, 255)
    degenerate = x.clone()
    degenerate[:, :, 1 : h - 1, 1 : w - 1] = smooth
    return blend(degenerate, x, factor)


def posterize(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """ImageOps.posterize (F.posterize): the `bits` high bits of each value kept."""
    step = torch.pow(2.0, 8 - _col(bits))
    return torch.floor(x / step) * step


def solarize(x: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """ImageOps.solarize (F.solarize): values at or above the threshold inverted."""
    return torch.where(x >= _col(threshold), 255 - x, x)


def apply_lut(x: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """Each channel's values through its own 256-entry table ((n, 3, 256))."""
    n, c, h, w = x.shape
    return lut.to(x.dtype).gather(2, x.long().view(n, c, h * w)).view(n, c, h, w)


def autocontrast(x: torch.Tensor) -> torch.Tensor:
    """ImageOps.autocontrast (F.autocontrast), per channel: its lowest value to 0 and its highest to 255, the table
    truncated (computed in double precision, as Python computes it); a flat channel left alone."""
    lo, hi = x.amin((2, 3)).double(), x.amax((2, 3)).double()
    scale = 255.0 / (hi - lo).clamp(min=1)
    offset = -lo * scale
    ix = torch.arange(256, device=x.device, dtype=torch.float64)
    lut = torch.trunc(ix * scale[..., None] + offset[..., None]).clamp(0, 255)
    lut = torch.where((hi > lo)[..., None], lut, ix)
    return apply_lut(x, lut)


def equalize(x: torch.Tensor) -> torch.Tensor:
    """ImageOps.equalize (F.equalize), per channel: step = (pixels - the count of its highest value) // 255, entry i
    = (step // 2 + the pixels below value i) // step (at most 255); a channel of one value, or a step of 0, left
    alone."""
    n, c, h, w = x.shape
    hist = torch.zeros((n, c, 256), dtype=torch.int64, device=x.device)
    hist.scatter_add_(2, x.long().view(n, c, -1), torch.ones((n, c, h * w), dtype=torch.int64, device=x.device))
    top = 255 - (hist.flip(2) > 0).long().argmax(2)  # the highest value present
    step = (h * w - hist.gather(2, top[..., None])[..., 0]) // 255
    below = hist.cumsum(2) - hist
    lut = torch.div(step[..., None] // 2 + below, step.clamp(min=1)[..., None], rounding_mode="floor").clamp(max=255)
    ix = torch.arange(256, device=x.device)
    return apply_lut(x, torch.where((step > 0)[..., None], lut, ix))


def hue(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """F.adjust_hue on a PIL image: to PIL's 8-bit HSV, the hue shifted by int(factor x 255) (wrapping), back to
    RGB."""
    h, s, v = _rgb_to_hsv(x)
    shift = torch.trunc(factor.to(x.device, torch.float32) * 255)
    h = torch.remainder(h + _col(shift)[:, 0], 256)
    return _hsv_to_rgb(h, s, v)


def _rgb_to_hsv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PIL's RGB to HSV conversion (each channel 0-255, the hue and saturation truncated)."""
    r, g, b = x[:, 0], x[:, 1], x[:, 2]
    maxc, minc = x.amax(1), x.amin(1)
    cr = maxc - minc
    flat = cr == 0
    crs = torch.where(flat, torch.ones_like(cr), cr)
    s = cr / torch.where(maxc == 0, torch.ones_like(maxc), maxc)
    rc, gc, bc = (maxc - r) / crs, (maxc - g) / crs, (maxc - b) / crs
    h = torch.where(r == maxc, bc - gc, torch.where(g == maxc, 2.0 + rc - bc, 4.0 + gc - rc))
    h = torch.remainder(h / 6.0 + 1.0, 1.0)
    h = torch.where(flat, 0.0, torch.trunc(h * 255.0).clamp(0, 255))
    s = torch.where(flat, 0.0, torch.trunc(s * 255.0).clamp(0, 255))
    return h, s, maxc


def _hsv_to_rgb(h: torch.Tensor, s: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """PIL's HSV to RGB conversion: six sectors of the hue, the intermediate values rounded."""
    hf = h * 6.0 / 255.0
    i = torch.floor(hf)
    f = hf - i
    fs = s / 255.0
    p = torch.round(v * (1.0 - fs)).clamp(0, 255)
    q = torch.round(v * (1.0 - fs * f)).clamp(0, 255)
    t = torch.round(v * (1.0 - fs * (1.0 - f))).clamp(0, 255)
    sector = torch.remainder(i, 6).long()
    table = torch.stack((torch.stack((v, t, p), 1), torch.stack((q, v, p), 1), torch.stack((p, v, t), 1),
                         torch.stack((p, q, v), 1), torch.stack((t, p, v), 1), torch.stack((v, p, q), 1)), 1)
    rgb = table.gather(1, sector[:, None, None].expand(-1, 1, 3, *sector.shape[1:]))[:, 0]
    return torch.where((s == 0)[:, None], v[:, None].expand_as(rgb), rgb)

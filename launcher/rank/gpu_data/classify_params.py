"""A classification batch's random draws, per image, on the host: what torchvision's transforms draw one image at a
time in Ultralytics' classify_augmentations (RandomResizedCrop's box, the flips, RandAugment's ops and signs,
ColorJitter's factors and order, RandomErasing's box), drawn for the whole batch at once from one seeded CPU
generator, so that a batch is a function of the seed and its step alone. The sizes they depend on are the host's
(the decoded images' shapes), so the device is never read back.

The rules are torchvision's (transforms.RandomResizedCrop.get_params, RandomErasing.get_params): up to 10 tries
each, the first that fits taken; the crop falls back to the central crop of the allowed aspect ratio, the erasing to
none. Rounding as Python's round (half to even: torch.round).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

TRIES = 10  # torchvision's tries for a crop (and an erased area) that fits
# RandAugment's operations, in torchvision's order (RandAugment._augmentation_space), and which take a random sign
RAND_OPS = ("Identity", "ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate", "Brightness", "Color", "Contrast",
            "Sharpness", "Posterize", "Solarize", "AutoContrast", "Equalize")
SIGNED = frozenset({"ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate", "Brightness", "Color", "Contrast",
                    "Sharpness"})
NUM_OPS, MAGNITUDE, BINS = 2, 9, 31  # torchvision's RandAugment defaults (Ultralytics passes only interpolation)
ERASE_SCALE, ERASE_RATIO = (0.02, 0.33), (0.3, 3.3)  # torchvision's RandomErasing defaults


@dataclass
class ClassifyDraws:
    """One batch's draws, CPU tensors of B rows."""

    crops: torch.Tensor  # (B, 4) int64: top, left, height, width of each image's crop
    hflip: torch.Tensor  # (B,) bool
    vflip: torch.Tensor  # (B,) bool
    ops: torch.Tensor | None  # (B, NUM_OPS) int64 indices into RAND_OPS (RandAugment), or None
    signs: torch.Tensor | None  # (B, NUM_OPS) float32: +1 or -1 (the sign of a signed op's magnitude)
    jitter: torch.Tensor | None  # (B, 4) float32: brightness, contrast, saturation, hue factors (ColorJitter), or None
    order: torch.Tensor | None  # (B, 4) int64: each image's order of ColorJitter's four adjustments (randperm)
    erase: torch.Tensor  # (B, 4) int64: top, left, height, width of the erased area (height 0: none)


def boxes(sizes: torch.Tensor, scale: tuple[float, float], ratio: tuple[float, float], g: torch.Generator, *,
          erasing: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(boxes (B, 4) int64 top, left, height, width; found (B,) bool) by torchvision's rule for images of `sizes`
    (B, 2) (height, width): an area fraction uniform in `scale`, a log-uniform aspect ratio (w/h) in `ratio`, the
    first of TRIES that fits, at a uniform position. `erasing`: RandomErasing's variant (h from area x ratio, and
    strictly inside); else RandomResizedCrop's (w from area x ratio, 0 < w <= width)."""
    b = len(sizes)
    h_img, w_img = sizes[:, 0:1].double(), sizes[:, 1:2].double()
    area = h_img * w_img * torch.empty((b, TRIES), dtype=torch.float64).uniform_(scale[0], scale[1], generator=g)
    log_ratio = torch.empty((b, TRIES), dtype=torch.float64).uniform_(math.log(ratio[0]), math.log(ratio[1]),
                                                                       generator=g)
    aspect = torch.exp(log_ratio)
    long_side, short_side = torch.round(torch.sqrt(area * aspect)), torch.round(torch.sqrt(area / aspect))
    if erasing:
        h, w = long_side, short_side
        fits = (h < h_img) & (w < w_img)
    else:
        w, h = long_side, short_side
        fits = (w > 0) & (w <= w_img) & (h > 0) & (h <= h_img)
    found = fits.any(1)
    first = torch.where(found, fits.double().argmax(1), torch.zeros(b, dtype=torch.int64))
    h, w = h.gather(1, first[:, None])[:, 0], w.gather(1, first[:, None])[:, 0]
    u = torch.rand((b, 2), dtype=torch.float64, generator=g)
    top = torch.floor(u[:, 0] * (h_img[:, 0] - h + 1).clamp(min=1))
    left = torch.floor(u[:, 1] * (w_img[:, 0] - w + 1).clamp(min=1))
    out = torch.stack((top, left, h, w), 1).long()
    if not erasing:  # the central crop of the aspect ratio nearest the image's
        out = torch.where(found[:, None], out, central_crops(sizes, ratio))
    return out, found


def central_crops(sizes: torch.Tensor, ratio: tuple[float, float]) -> torch.Tensor:
    """RandomResizedCrop's fallback: the whole image, cut to the nearest allowed aspect ratio, centred."""
    h_img, w_img = sizes[:, 0].double(), sizes[:, 1].double()
    in_ratio = w_img / h_img
    lo, hi = min(ratio), max(ratio)
    w = torch.where(in_ratio < lo, w_img, torch.where(in_ratio > hi, torch.round(h_img * hi), w_img))
    h = torch.where(in_ratio < lo, torch.round(w_img / lo), h_img)
    return torch.stack((torch.div(h_img - h, 2, rounding_mode="floor"), torch.div(w_img - w, 2, rounding_mode="floor"),
                        h, w), 1).long()


def draw(sizes: torch.Tensor, *, imgsz: int, scale: tuple[float, float], fliplr: float, flipud: float,
         rand_augment: bool, jitter: tuple[float, float, float, float] | None, erasing: float,
         g: torch.Generator) -> ClassifyDraws:
    """Every draw of a batch of images of `sizes` (B, 2): the crop (area fraction in `scale`, aspect 3/4 to 4/3),
    the flips, RandAugment's ops (`rand_augment`) or ColorJitter's factors (`jitter`: brightness, contrast,
    saturation, hue strengths; None: no ColorJitter), and RandomErasing (probability `erasing`) on the imgsz crop."""
    b = len(sizes)
    crops, _ = boxes(sizes, scale, (3 / 4, 4 / 3), g)
    flips = torch.rand((b, 2), generator=g)
    ops = signs = factors = order = None
    if rand_augment:
        ops = torch.randint(0, len(RAND_OPS), (b, NUM_OPS), generator=g)
        signs = torch.where(torch.rand((b, NUM_OPS), generator=g) < 0.5, -1.0, 1.0)
    if jitter is not None:
        factors, order = jitter_factors(b, jitter, g)
    erase_boxes, found = boxes(torch.tensor([[imgsz, imgsz]] * b, dtype=torch.int64).view(b, 2), ERASE_SCALE,
                               ERASE_RATIO, g, erasing=True)
    erased = (torch.rand(b, generator=g) < erasing) & found
    erase_boxes[~erased] = 0
    return ClassifyDraws(crops, flips[:, 0] < fliplr, flips[:, 1] < flipud, ops, signs, factors, order, erase_boxes)


def jitter_factors(b: int, strengths: tuple[float, float, float, float],
                   g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """ColorJitter.get_params per image: factors (B, 4) uniform in [max(0, 1 - s), 1 + s] (brightness, contrast,
    saturation) and [-s, s] (hue); a strength of 0 gives the neutral factor (1, or 0 for hue). And each image's
    order of the four (B, 4), a random permutation."""
    u = torch.rand((b, 4), generator=g)
    lo = torch.tensor([max(0.0, 1 - s) for s in strengths[:3]] + [-strengths[3]])
    hi = torch.tensor([1 + s for s in strengths[:3]] + [strengths[3]])
    neutral = torch.tensor([1.0, 1.0, 1.0, 0.0])
    on = torch.tensor([s > 0 for s in strengths])
    factors = torch.where(on, lo + u * (hi - lo), neutral)
    order = torch.argsort(torch.rand((b, 4), generator=g), 1)
    return factors, order


def magnitude(op: str, imgsz: int) -> float:
    """RandAugment's magnitude of `op` (unsigned) at torchvision's default magnitude bin of BINS, on imgsz images."""
    tops = {"ShearX": 0.3, "ShearY": 0.3, "TranslateX": 150.0 / 331.0 * imgsz, "TranslateY": 150.0 / 331.0 * imgsz,
            "Rotate": 30.0, "Brightness": 0.9, "Color": 0.9, "Contrast": 0.9, "Sharpness": 0.9}
    if op in tops:
        return float(torch.linspace(0.0, tops[op], BINS)[MAGNITUDE])
    if op == "Posterize":
        return float(8 - (torch.arange(BINS) / ((BINS - 1) / 4)).round().int()[MAGNITUDE])
    if op == "Solarize":
        return float(torch.linspace(255.0, 0.0, BINS)[MAGNITUDE])
    return 0.0

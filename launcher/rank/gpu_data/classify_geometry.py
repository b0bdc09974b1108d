"""The geometry of a classification batch on the device, as torchvision computes it on the PIL images Ultralytics'
ClassificationDataset hands it: RandomResizedCrop's crop and resize (PIL's bilinear resize, which widens its filter
by the reduction: antialiased), the flips, and RandAugment's shears, translations and rotations (PIL's affine
transform, bilinear, black outside the image).

Images are float tensors holding the uint8 values PIL would hold: each step rounds as PIL does (the resize to the
nearest, the affine transform down), so the next step sees what it sees in Ultralytics' pipeline.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

GREY = 114.0  # an image the device could not decode trains as grey (gpu_input.Decoder names it in the log)
EPS = 1e-3  # the affine transform's values are truncated as PIL does: float error must not take an integer below


def crop_resize(images: list[torch.Tensor | None], crops: list[list[int]], imgsz: int,
                out: torch.Tensor) -> torch.Tensor:
    """Each (3, h, w) uint8 image's crop (top, left, height, width) resized to imgsz square into out[k] (float,
    (B, 3, imgsz, imgsz)): PIL's bilinear resize (torch's antialiased bilinear interpolation is its port, in float
    where PIL's weights are 22-bit fixed point: a value may differ by one level), the rows then the columns, each
    rounded as PIL rounds them (Pillow resamples a crop much taller than wide columns first; RandomResizedCrop's
    aspect ratios, 3/4 to 4/3, are rows first). One call per image and pass: the filter's width follows each
    image's own reduction, and a padded batch would hold every image at the largest one's size."""
    for k, (image, (top, left, h, w)) in enumerate(zip(images, crops)):
        if image is None:
            out[k].fill_(GREY)
            continue
        crop = image[None, :, top : top + h, left : left + w].float()
        if w != imgsz:  # PIL resizes the rows first, into a uint8 image
            crop = F.interpolate(crop, size=(h, imgsz), mode="bilinear", align_corners=False, antialias=True)
            crop = crop.add_(0.5).floor_()  # halves up, as PIL rounds (a bilinear mean stays within 0 to 255)
        if h != imgsz:
            crop = F.interpolate(crop, size=(imgsz, imgsz), mode="bilinear", align_corners=False, antialias=True)
        out[k] = crop[0]
    return out.add_(0.5).floor_()


def flip(x: torch.Tensor, hflip: torch.Tensor, vflip: torch.Tensor) -> torch.Tensor:
    """RandomHorizontalFlip and RandomVerticalFlip with each image's own draw ((B,) bool on x's device)."""
    x = torch.where(hflip.view(-1, 1, 1, 1), x.flip(3), x)
    return torch.where(vflip.view(-1, 1, 1, 1), x.flip(2), x)


def inverse_affine(center: tuple[float, float], angle: float, translate: tuple[float, float],
                   shear: tuple[float, float]) -> list[float]:
    """torchvision's _get_inverse_affine_matrix at scale 1: the output-to-input map (a, b, c, d, e, f) that PIL's
    Image.transform(AFFINE) takes, for a rotation by `angle` degrees and a shear (degrees) about `center`, then a
    translation."""
    rot, sx, sy = math.radians(angle), math.radians(shear[0]), math.radians(shear[1])
    (cx, cy), (tx, ty) = center, translate
    a = math.cos(rot - sy) / math.cos(sy)
    b = -math.cos(rot - sy) * math.tan(sx) / math.cos(sy) - math.sin(rot)
    c = math.sin(rot - sy) / math.cos(sy)
    d = -math.sin(rot - sy) * math.tan(sx) / math.cos(sy) + math.cos(rot)
    m = [d, -b, 0.0, -c, a, 0.0]
    m[2] += m[0] * (-cx - tx) + m[1] * (-cy - ty)
    m[5] += m[3] * (-cx - tx) + m[4] * (-cy - ty)
    m[2] += cx
    m[5] += cy
    return m


def rand_affine(op: str, magnitude: float, size: int) -> list[float]:
    """RandAugment's geometric op `op` with its signed `magnitude` on a size-square image as torchvision applies it to
    a PIL image (_apply_op): shears about the corner (0, 0), translations by whole pixels, the rotation about the
    centre (PIL's Image.rotate, counter-clockwise for a positive angle)."""
    centre = (size * 0.5, size * 0.5)
    if op == "ShearX":
        return inverse_affine((0.0, 0.0), 0.0, (0.0, 0.0), (math.degrees(math.atan(magnitude)), 0.0))
    if op == "ShearY":
        return inverse_affine((0.0, 0.0), 0.0, (0.0, 0.0), (0.0, math.degrees(math.atan(magnitude))))
    if op == "TranslateX":
        return inverse_affine(centre, 0.0, (float(int(magnitude)), 0.0), (0.0, 0.0))
    if op == "TranslateY":
        return inverse_affine(centre, 0.0, (0.0, float(int(magnitude))), (0.0, 0.0))
    if op == "Rotate":
        return inverse_affine(centre, -magnitude, (0.0, 0.0), (0.0, 0.0))
    raise ValueError(f"{op} is not a geometric operation")


def affine(x: torch.Tensor, matrices: torch.Tensor) -> torch.Tensor:
    """PIL's Image.transform(AFFINE, BILINEAR) of each image of x (n, 3, h, w) by its (n, 6) output-to-input map (in
    pixel-edge coordinates: pixel i's centre at i + 0.5): a bilinear sample, the border pixels repeated for the
    samples within half a pixel of the edge, black (0) where the map leaves the image; truncated as PIL does."""
    n, _, h, w = x.shape
    m = matrices.to(x.device, torch.float32).view(n, 1, 1, 6)
    ys, xs = torch.meshgrid(torch.arange(h, device=x.device, dtype=torch.float32) + 0.5,
                            torch.arange(w, device=x.device, dtype=torch.float32) + 0.5, indexing="ij")
    u = m[..., 0] * xs + m[..., 1] * ys + m[..., 2]
    v = m[..., 3] * xs + m[..., 4] * ys + m[..., 5]
    inside = (u >= 0) & (u < w) & (v >= 0) & (v < h)
    grid = torch.stack((2 * u / w - 1, 2 * v / h - 1), -1)
    out = F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)
    return torch.floor(out + EPS).clamp_(0, 255) * inside[:, None]

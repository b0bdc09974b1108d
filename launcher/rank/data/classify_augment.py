"""Ultralytics' classification augmentation (data/augment.py classify_augmentations, as ClassificationDataset builds
it from the run's settings) on a whole batch on the device:

  RandomResizedCrop(imgsz, scale=(1 - scale, 1), ratio=(3/4, 4/3), bilinear), RandomHorizontalFlip(fliplr),
  RandomVerticalFlip(flipud), then RandAugment (auto_augment=randaugment: two ops per image, magnitude 9 of 31,
  bilinear, black fill) or ColorJitter(hsv_v, hsv_v, hsv_s, hsv_h) (auto_augment off), ToTensor, Normalize (mean 0,
  std 1: Ultralytics' defaults, the identity), RandomErasing(erasing, value 0).

Each image draws its own crop, flips, ops and factors (classify_params.py, on the host, from a generator seeded per
batch); the ops then run on the images that drew them, in the order each image drew them: the geometric ones
(classify_geometry.py) and the colour ones (classify_colour.py) as torchvision computes them on PIL images, rounding
as PIL does between ops. AugMix and AutoAugment are not built (the plan refuses them with the input on the GPU).
"""

from __future__ import annotations

import torch

from launcher.rank.data import classify_colour as colour
from launcher.rank.data import classify_geometry as geometry
from launcher.rank.data.classify_params import NUM_OPS, RAND_OPS, SIGNED, ClassifyDraws, draw, magnitude

GEOMETRIC = frozenset({"ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate"})
COLOUR = {"Brightness": lambda x, m: colour.brightness(x, 1.0 + m),  # RandAugment's ops, of the signed magnitude
          "Color": lambda x, m: colour.saturation(x, 1.0 + m),
          "Contrast": lambda x, m: colour.contrast(x, 1.0 + m),
          "Sharpness": lambda x, m: colour.sharpness(x, 1.0 + m),
          "Posterize": lambda x, m: colour.posterize(x, m),
          "Solarize": lambda x, m: colour.solarize(x, m),
          "AutoContrast": lambda x, m: colour.autocontrast(x),
          "Equalize": lambda x, m: colour.equalize(x)}
JITTER = (lambda x, f: colour.brightness(x, f), lambda x, f: colour.contrast(x, f),  # ColorJitter's fn_idx order
          lambda x, f: colour.saturation(x, f), lambda x, f: colour.hue(x, f))
AUTO_AUGMENT = ("randaugment",)  # the auto_augment policies built here (a false value: ColorJitter instead)


class ClassifyAugment:
    """`ClassifyAugment(imgsz, hyp)(images, draws)` -> the network's input (B, 3, imgsz, imgsz) in [0, 1], of
    `out_dtype` in channels_last (float32 NCHW where None); `draws(sizes, generator)` draws a batch's parameters.
    `hyp`: the run's Ultralytics settings (scale, fliplr, flipud, auto_augment, hsv_h, hsv_s, hsv_v, erasing)."""

    def __init__(self, imgsz: int, hyp, out_dtype: torch.dtype | None = None):
        policy = hyp.auto_augment or None
        if policy is not None and policy not in AUTO_AUGMENT:
            raise ValueError(f"auto_augment={policy} is not built on the GPU input (only {', '.join(AUTO_AUGMENT)})")
        self.imgsz, self.out_dtype = int(imgsz), out_dtype
        self.scale = (1.0 - float(hyp.scale), 1.0)  # ClassificationDataset's RandomResizedCrop area range
        self.fliplr, self.flipud, self.erasing = float(hyp.fliplr), float(hyp.flipud), float(hyp.erasing)
        self.rand_augment = policy is not None
        self.jitter = None if self.rand_augment else (float(hyp.hsv_v), float(hyp.hsv_v), float(hyp.hsv_s),
                                                      float(hyp.hsv_h))
        self.magnitudes = {op: magnitude(op, self.imgsz) for op in RAND_OPS}

    def draws(self, sizes: torch.Tensor, generator: torch.Generator) -> ClassifyDraws:
        """A batch's draws for images of `sizes` (B, 2) (height, width) from a CPU `generator`."""
        return draw(sizes, imgsz=self.imgsz, scale=self.scale, fliplr=self.fliplr, flipud=self.flipud,
                    rand_augment=self.rand_augment, jitter=self.jitter, erasing=self.erasing, g=generator)

    def __call__(self, images: list[torch.Tensor | None], d: ClassifyDraws, device: torch.device) -> torch.Tensor:
        """`images`: each (3, h, w) uint8 RGB on `device` (None: undecodable, trains grey), as `d` was drawn for."""
        b, s = len(images), self.imgsz
        x = torch.empty((b, 3, s, s), dtype=torch.float32, device=device)
        geometry.crop_resize(images, d.crops.tolist(), s, x)
        x = geometry.flip(x, d.hflip.to(device), d.vflip.to(device))
        if d.ops is not None:
            for slot in range(NUM_OPS):
                x = self._rand_op(x, d.ops[:, slot], d.signs[:, slot])
        if d.jitter is not None:
            for position in range(4):
                for fn, adjust in enumerate(JITTER):
                    x = _on(x, d.order[:, position] == fn, lambda sub, k, a=adjust, f=fn: a(
                        sub, d.jitter[k, f].to(device)))
        x = erase(x, d.erase) / 255  # ToTensor; Normalize's default mean 0 and std 1 leave it
        if self.out_dtype is not None:
            return x.to(self.out_dtype).contiguous(memory_format=torch.channels_last)
        return x

    def _rand_op(self, x: torch.Tensor, ops: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
        """One of RandAugment's ops per image (`ops` (B,) indices into RAND_OPS, `signs` of the signed ones): each op
        on the images that drew it."""
        for index, op in enumerate(RAND_OPS):
            chosen = ops == index
            if op == "Identity" or not bool(chosen.any()):
                continue
            base = self.magnitudes[op]
            signs = signs if op in SIGNED else torch.ones_like(signs)
            if op in GEOMETRIC:
                x = _on(x, chosen, lambda sub, k, o=op, m=base: geometry.affine(sub, torch.tensor(
                    [geometry.rand_affine(o, m * float(sign), self.imgsz) for sign in signs[k].tolist()])))
            else:
                x = _on(x, chosen, lambda sub, k, o=op, m=base: COLOUR[o](sub, (m * signs[k]).to(sub.device)))
        return x


def _on(x: torch.Tensor, chosen: torch.Tensor, fn) -> torch.Tensor:
    """fn(x's images where `chosen` ((B,) bool on the host), their indices) written back in place of them."""
    k = chosen.nonzero()[:, 0]
    if len(k) == 0:
        return x
    index = k.to(x.device)
    return x.index_copy(0, index, fn(x.index_select(0, index), k))


def erase(x: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
    """RandomErasing with value 0: each image's box (top, left, height, width; height 0: none) set to 0."""
    b, _, h, w = x.shape
    top, left, bh, bw = (v.to(x.device).view(b, 1, 1, 1) for v in boxes.unbind(1))
    rows = torch.arange(h, device=x.device).view(1, 1, h, 1)
    cols = torch.arange(w, device=x.device).view(1, 1, 1, w)
    inside = (rows >= top) & (rows < top + bh) & (cols >= left) & (cols < left + bw)
    return x.masked_fill(inside, 0.0)

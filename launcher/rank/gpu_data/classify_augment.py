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

import numpy as np
import torch

from launcher.rank.gpu_data import classify_colour as colour
from launcher.rank.gpu_data import classify_geometry as geometry
from launcher.rank.gpu_data.classify_params import NUM_OPS, RAND_OPS, SIGNED, ClassifyDraws, draw, magnitude
from launcher.rank.gpu_data.gpu_input import upload

GEOMETRIC = frozenset({"ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate"})
COLOUR = {"Brightness": lambda x, m: colour.brightness(x, 1.0 + m),  # RandAugment's ops, of the signed magnitude
          "Color": lambda x, m: colour.saturation(x, 1.0 + m),
          "Contrast": lambda x, m: colour.contrast(x, 1.0 + m),
          "Sharpness": lambda x, m: colour.sharpness(x, 1.0 + m),
          "Posterize": lambda x, m: colour.posterize(x, m),
          "Solarize": lambda x, m: colour.solarize(x, m),
          "AutoContrast": lambda x, m: colour.autocontrast(x),
          "Equalize": lambda x, m: colour.equalize(x)}
JITTER = (colour.brightness, colour.contrast, colour.saturation, colour.hue)  # ColorJitter's fn_idx order
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
        """`images`: each (3, h, w) uint8 RGB on `device` (None: undecodable, trains grey), as `d` was drawn for.
        What the device needs of the draws goes up in one copy (gpu_input.upload): the host never waits for it."""
        b, s = len(images), self.imgsz
        groups, values, matrices = self._groups(d)
        flips, values, matrices, erase_boxes, *indices = upload(
            [torch.stack((d.hflip, d.vflip), 1).long().numpy(), values, matrices, d.erase.numpy(),
             *(k for _, _, k in groups)], device)
        x = torch.empty((b, 3, s, s), dtype=torch.float32, device=device)
        geometry.crop_resize(images, d.crops.tolist(), s, x)
        x = geometry.flip(x, flips[:, 0].bool(), flips[:, 1].bool())
        for (column, op, _), index in zip(groups, indices):  # each op on the images that drew it, in their order
            sub = x.index_select(0, index)
            if op in GEOMETRIC:
                sub = geometry.affine(sub, matrices.index_select(0, index)[:, column])
            else:
                sub = (COLOUR[op] if d.ops is not None else JITTER[op])(sub, values.index_select(0, index)[:, column])
            x = x.index_copy(0, index, sub)
        x = erase(x, erase_boxes) / 255  # ToTensor; Normalize's default mean 0 and std 1 leave it
        if self.out_dtype is not None:
            return x.to(self.out_dtype).contiguous(memory_format=torch.channels_last)
        return x

    def _groups(self, d: ClassifyDraws) -> tuple[list[tuple[int, str | int, np.ndarray]], np.ndarray, np.ndarray]:
        """(groups, values, matrices): the ops to run in order, each as (its column of the parameters, the op, the
        images that drew it as host indices); (B, columns) float32 values (RandAugment's signed magnitudes, or
        ColorJitter's factors) and (B, columns, 6) float32 affine maps (RandAugment's geometric ops)."""
        b = len(d.crops)
        groups = []
        if d.ops is not None:
            ops, signs = d.ops.numpy(), d.signs.numpy()
            values = np.zeros((b, NUM_OPS), np.float32)
            matrices = np.tile(np.array([1, 0, 0, 0, 1, 0], np.float32), (b, NUM_OPS, 1))
            for slot in range(NUM_OPS):
                for index, op in enumerate(RAND_OPS):
                    k = np.flatnonzero(ops[:, slot] == index)
                    if op == "Identity" or not len(k):
                        continue
                    m = self.magnitudes[op] * (signs[k, slot] if op in SIGNED else np.ones(len(k), np.float32))
                    values[k, slot] = m
                    if op in GEOMETRIC:
                        matrices[k, slot] = [geometry.rand_affine(op, float(v), self.imgsz) for v in m]
                    groups.append((slot, op, k.astype(np.int64)))
            return groups, values, matrices
        values = np.ones((b, 4), np.float32) if d.jitter is None else d.jitter.numpy().astype(np.float32)
        if d.jitter is not None:
            order = d.order.numpy()
            for position in range(4):
                for fn in range(4):
                    k = np.flatnonzero(order[:, position] == fn)
                    if len(k) and self.jitter[fn] > 0:  # a strength of 0: torchvision skips the adjustment
                        groups.append((fn, fn, k.astype(np.int64)))
        return groups, values, np.zeros((b, 4, 6), np.float32)


def erase(x: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
    """RandomErasing with value 0: each image's box (top, left, height, width; height 0: none) set to 0."""
    b, _, h, w = x.shape
    top, left, bh, bw = (v.view(b, 1, 1, 1) for v in boxes.to(x.device).unbind(1))
    rows = torch.arange(h, device=x.device).view(1, 1, h, 1)
    cols = torch.arange(w, device=x.device).view(1, 1, 1, w)
    inside = (rows >= top) & (rows < top + bh) & (cols >= left) & (cols < left + bw)
    return x.masked_fill(inside, 0.0)

"""The GPU augmentation's settings (rank/gpu_data/gpu_augment.py), read once from Ultralytics' training arguments."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from launcher.plan.checks import GPU_INPUT_UNSUPPORTED
from launcher.rank.data.raw_batch import RawBatch


def _hyp_dict(hyp) -> dict:
    return dict(hyp) if isinstance(hyp, Mapping) else dict(vars(hyp))


class AugmentSettings:
    """`AugmentSettings(imgsz, hyp, out_dtype, keypoints=P, flip_idx=...)`: the probabilities and strengths
    GpuAugment draws with, and the keypoints its labels carry.

    `hyp` is Ultralytics' training arguments (a dict or the trainer's `args` namespace); mosaic, degrees, translate,
    scale, shear, perspective, mixup, cutmix, hsv_h/s/v, flipud, fliplr and bgr are read here, with Ultralytics'
    defaults for those missing. Raises ValueError, naming them, for settings the GPU pipeline does not implement.
    `keypoints`: P, the keypoints per label of a pose dataset (its kpt_shape[0]; 0: boxes alone); `flip_idx`: its
    data YAML's flip_idx, which both flips apply to the keypoints' order. As v8_transforms does, a pose dataset
    without flip_idx is not flipped, and a flip_idx whose length is not P is refused (ValueError). `segments`: M,
    the points each label's polygon travels as (its boxes come from the warped polygons; 0: none). `masks`: Format
    makes the polygons' masks, by hyp's overlap_mask and mask_ratio (default: with polygons, a segmentation dataset;
    False for a detection dataset whose label files hold polygons, whose boxes alone come from them). `obb`: an obb
    dataset, whose payload (`segments` = 4) is each row's corners, clipped as rotated boxes and formatted as xywhr
    (augment_obb.py).
    """

    def __init__(self, imgsz: int, hyp, out_dtype: torch.dtype | None = None, *, keypoints: int = 0,
                 flip_idx=(), segments: int = 0, masks: bool | None = None, obb: bool = False):
        hyp = _hyp_dict(hyp)
        self.out_dtype = out_dtype  # None: uint8 images as Ultralytics collates them; else the network's input
        used = [k for k in GPU_INPUT_UNSUPPORTED if hyp.get(k)] + (["augmentations"] if hyp.get("augmentations") else [])
        if used:
            raise ValueError(f"the GPU input pipeline does not implement {', '.join(used)}: set them to 0 or use loader.augment_on=cpu")
        self.imgsz = int(imgsz)
        self.p_mosaic = float(hyp.get("mosaic", 1.0))
        self.degrees, self.translate = float(hyp.get("degrees", 0.0)), float(hyp.get("translate", 0.1))
        self.shear = float(hyp.get("shear", 0.0))
        scale = hyp.get("scale", 0.5)
        self.scale_range = tuple(map(float, scale)) if isinstance(scale, (tuple, list)) else (1 - scale, 1 + scale)
        self.perspective = float(hyp.get("perspective", 0.0))
        self.p_mixup, self.p_cutmix = float(hyp.get("mixup", 0.0)), float(hyp.get("cutmix", 0.0))
        self.hsv_gains = tuple(float(hyp.get(k, d)) for k, d in (("hsv_h", 0.015), ("hsv_s", 0.7), ("hsv_v", 0.4)))
        self.p_flipud, self.p_fliplr = float(hyp.get("flipud", 0.0)), float(hyp.get("fliplr", 0.5))
        self.p_bgr = float(hyp.get("bgr", 0.0))
        self.keypoints, self.flip_idx = int(keypoints), tuple(int(i) for i in flip_idx or ())
        self._flip_tables: dict[torch.device, torch.Tensor] = {}
        self.segments, self.obb = int(segments), bool(obb)
        self.masks = bool(self.segments and not self.obb) if masks is None else bool(masks)
        if self.masks and (self.obb or not self.segments):
            raise ValueError("masks are drawn from a segmentation dataset's polygons: segments=M, and not obb")
        if self.obb and self.segments != 4:
            raise ValueError(f"an obb dataset's rows travel as their 4 corners, not segments={self.segments}")
        self.overlap_mask, self.mask_ratio = bool(hyp.get("overlap_mask", True)), int(hyp.get("mask_ratio", 4))
        if self.masks and not 1 <= self.mask_ratio <= self.imgsz:
            raise ValueError(f"mask_ratio={self.mask_ratio} downsamples imgsz={self.imgsz} masks to zero size; use "
                             f"mask_ratio <= {self.imgsz}")
        if self.keypoints and not self.flip_idx:
            self.p_flipud = self.p_fliplr = 0.0  # both flips need flip_idx to keep left and right keypoints apart
        elif self.keypoints and len(self.flip_idx) != self.keypoints:
            raise ValueError(f"data.yaml flip_idx={list(self.flip_idx)} length must be equal to kpt_shape[0]="
                             f"{self.keypoints}")

    def flip_table(self, device: torch.device) -> torch.Tensor:
        """flip_idx as an int64 tensor on `device`, made once: a copy from the host would wait for the device."""
        if device not in self._flip_tables:
            self._flip_tables[device] = torch.tensor(self.flip_idx, dtype=torch.int64, device=device)
        return self._flip_tables[device]

    @property
    def mixes(self) -> int:
        """How many blocks of partners a mosaic batch brings: one for MixUp, one for CutMix, each when it is on."""
        return int(self.p_mixup > 0) + int(self.p_cutmix > 0)

    def partner_blocks(self, raw: RawBatch) -> int:
        """The blocks of mix partners `raw` carries: `mixes` with mosaic tiles, none after close_mosaic."""
        rows, t = raw.groups.shape
        blocks = self.mixes if t == 4 else 0
        if rows != raw.samples * (1 + blocks):
            raise ValueError(f"a RawBatch of {raw.samples} samples with {rows} rows of tiles: with {t} tile(s) and "
                             f"mixup={self.p_mixup}, cutmix={self.p_cutmix} it needs {raw.samples * (1 + blocks)} "
                             "(a block of partners per mix that is on: gpu_input.GpuInput draws them)")
        return blocks

    @property
    def out_scale(self) -> float:
        """What an output grey level is multiplied by: 1 for uint8 images, 1/255 for the network's input."""
        return 1.0 if self.out_dtype is None else 1 / 255

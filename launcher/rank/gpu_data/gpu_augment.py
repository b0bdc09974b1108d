"""Ultralytics 8.4.190's detection, pose, segmentation and obb training augmentation, on tensors, on the training device
(loader.augment_on=gpu).

Why: with Ultralytics' loader the CPU decodes, builds the mosaic, warps it, shifts its colours and flips it, several
milliseconds of one core per 640-pixel image, while one GPU trains yolov8s at over a thousand images a second: a
dozen busy cores per GPU (docs/benchmarks/README.md). Here the workers only read file bytes (rank/data/encoded.py),
the GPU decodes them into an image buffer (gpu_input.py) and this module does the rest:

    augment = GpuAugment(imgsz, hyp, out_dtype=torch.float16)  # None: uint8, Ultralytics' collated batch
    batch = augment(raw_batch, generator)  # generator: a torch.Generator on the batch's device

A `RawBatch` names the images (the buffer's slots), which of them form each sample (and each MixUp or CutMix
partner), and their labels in pixels; mosaic, RandomPerspective, MixUp, CutMix, RandomHSV, RandomFlip (up-down,
left-right) and Format (RGB, boxes as normalised xywh) give the batch `YOLODataset.collate_fn` gives, its images
rendered in one pass (warp.render), plus a second, smaller one for the samples that are mixed.

Semantics (ultralytics/data/augment.py, v8_transforms, read at 8.4.190), per output sample:
  * Mosaic (probability `mosaic`, 4 images): a 2S x 2S canvas of 114 (S = imgsz), centre xc, yc =
    int(uniform(S/2, 3S/2)) each; image 0 ends at the centre (top left), 1 top right, 2 bottom left, 3 bottom right;
    boxes shifted, clipped to the canvas, zero-area boxes dropped.
  * RandomPerspective to S x S: M = T @ Sh @ R @ P @ C, where C moves the centre of its input (the canvas, or without
    mosaic the image as load_image returned it) to the origin, P perspective, R = cv2.getRotationMatrix2D(angle
    uniform(+-degrees), scale uniform(1 +- scale)), Sh shear (tan of uniform(+-shear) degrees), T translation
    uniform(0.5 +- translate) x S. Warped bilinearly with border 114. Boxes: the 4 corners through M, min/max, clipped
    to S, kept by `box_candidates` (w, h > 2 px, area > 0.1 x the pre-warp area x scale^2, aspect ratio < 100).
    Without mosaic there is no LetterBox in 8.4.190's training path: C centres the image and T places it.
  * MixUp (probability `mixup`): a partner image run through the same Mosaic and RandomPerspective (its own tiles, its
    own draws); r ~ Beta(32, 32); img = (img r + partner (1 - r)) truncated to uint8; the partner's boxes appended.
  * CutMix (probability `cutmix`, after MixUp): another such partner; 3 candidate areas by _rand_bbox (lam ~ Beta(1, 1),
    side int(S sqrt(1 - lam)), centre randint(S) each way, x1 = clip(cx - side // 2), x2 = clip(cx + side // 2));
    the areas no box of the sample touches (bbox_ioa summed <= 0), one of them uniformly; the partner's boxes whose
    intersection with it is >= 0.1 of their own area, clipped to it; that area of the partner's image pasted. No free
    area, or no such box: nothing changes.
  * RandomHSV: gains r = uniform(-1, 1) x (hsv_h, hsv_s, hsv_v); OpenCV's uint8 HSV (hue 0..179); hue + 180 r_h
    modulo 180, saturation and value x (1 + r), each clipped and truncated to an integer like the uint8 LUTs.
  * RandomFlip up-down (flipud), then left-right (fliplr); Format: RGB unless uniform(0, 1) <= bgr; boxes as xywh / S.

Where the device version differs, and why
  * One sampling pass per output pixel: output pixel -> inverse affine -> canvas position -> the 4 canvas pixels its
    bilinear filter reads, each looked up in the source image that covers it (or 114). This equals building the
    canvas and warping it, without the 2S x 2S canvas; flips are folded into the same inverse map.
  * The bilinear filter runs in float32 at the exact sub-pixel position, as OpenCV 5.0's warpAffine (the version
    installed with Ultralytics here) does: outputs agree except for one grey level on ~0.02 % of values (rounding
    order). OpenCV 4.x warps in fixed point (1/32 pixel), a grey level or two apart on edges.
  * RandomHSV is computed in float, in the same pass (warp.hsv_shift): the same transform as OpenCV's uint8 HSV and
    Ultralytics' lookup tables, without their rounding (under one grey level on average, up to ~9 on saturated
    bright pixels, where OpenCV's hue moves in 2-degree steps).
  * Randomness comes from a torch.Generator on the device (same distributions, different numbers from Python's
    `random` and NumPy). Mosaic partners are chosen by gpu_input.py from its buffer of recently decoded images,
    as Ultralytics draws from its dataset's buffer of recently loaded ones.
  * Boxes are warped as boxes, except where the label files hold polygons (a segmentation dataset, or a detection
    dataset labelled with polygons, as Ultralytics' COCO labels are): those boxes come from the warped polygons as
    Ultralytics makes them (area threshold 0.01; augment_segments.py), and only a segmentation model's batch gets
    their masks. Ultralytics resamples a detection dataset's polygons to 1000 points, ours travel as 100
    (encoded.resample_segments: every vertex of a polygon of 100 or fewer). An obb dataset's
    rows travel as their 4 corners (Ultralytics: 100 points along them, with the same hull) and take its preserve_obb
    clip at the canvas, the image and CutMix's area (augment_obb.py).
  * MixUp's and CutMix's partner is another image of the buffer (Ultralytics: of the whole dataset), with 3 mosaic
    partners and every draw of its own, rendered as an extra row of the batch.
  * RandomHSV comes after the mix and is not linear: a mixed sample's parts are rendered without it (uint8, as
    Ultralytics' images are), mixed, then HSV and the channel order in one elementwise pass (warp.shade). The flips
    are folded into both parts' warps and mirror CutMix's area: the mix is per pixel, so mixing the flipped parts is
    flipping the mix. Boxes are mixed by Ultralytics' rule before the flips, then flipped with the rest.
  * MixUp blends in float32 (NumPy: float64) before truncating: a grey level apart where the blend lies within
    rounding of an integer. r is the 32nd smallest of 63 uniforms, which is exactly Beta(32, 32).
  * CutMix keeps partner boxes from 0.1 of their area inside (a segmentation or obb dataset's from 0.01, as
    Ultralytics); Ultralytics from 0.01 whenever label files hold polygons.
  * Not reproduced (refused when configured): copy_paste (it needs polygons), custom `augmentations`. Ultralytics also
    applies Albumentations blur/median blur/grey/CLAHE at p=0.01 each, but only when the albumentations package is
    installed, which it is not in this project's environments. Boxes, a pose dataset's keypoints with them
    (augment_keypoints.py), a segmentation dataset's polygons and Format's masks from them (augment_segments.py,
    segment_masks.py: drawn by a scanline test, not by cv2.fillPoly, a pixel apart on instances' edges), an obb
    dataset's rotated boxes (augment_obb.py). 3-channel images, 2x2 mosaic.

Syncs: none in the sampling; one device-to-host read per batch, of how many boxes survive in each image (their number
is data-dependent; the batch carries the counts, and their largest as MAX_TARGETS for the sync-free loss) and, with
mixup or cutmix on, in the same read, how many samples are mixed and how many rows their mix reads. Memory: the
output alone on CUDA (the Triton pass keeps nothing else); the PyTorch twin that CPU runs use works in passes of
bounded size (warp.PIXELS_PER_PASS). A batch with mixed samples also renders those samples (again: the first pass's
image of theirs is overwritten) and the partners they use, without HSV, into uint8 (3 S^2 bytes each), and mixes them
in passes of that bounded size. A segmentation batch's polygons are read by segment2box's rule and drawn into masks
in passes of bounded size too (augment_segments.POINTS_PER_PASS, segment_masks.ELEMENTS_PER_PASS), keeping each
instance's mask at mask resolution ((S / mask_ratio)^2 bytes) until the batch's masks are composed.
"""

from __future__ import annotations

import torch

from launcher.rank.data.pipeline import MAX_TARGETS, TARGETS_PER_IMAGE
from launcher.rank.data.raw_batch import RawBatch
from launcher.rank.gpu_data.augment_boxes import collated_boxes, mix_boxes, warped_boxes
from launcher.rank.gpu_data.augment_images import mix_images, render_samples, warp_tables
from launcher.rank.gpu_data.augment_keypoints import collated_keypoints, cutmix_keypoints, warped_keypoints
from launcher.rank.gpu_data.augment_obb import cutmix_obbs, obb_targets, warped_obbs
from launcher.rank.gpu_data.augment_params import AugmentParams, draw, mosaic_tiles
from launcher.rank.gpu_data.augment_segments import (clamped_into, cutmix_segments, flipped_segments, segment_boxes,
                                                     warped_segments)
from launcher.rank.gpu_data.augment_settings import AugmentSettings
from launcher.rank.gpu_data.segment_masks import formatted_masks, rasterized


class GpuAugment(AugmentSettings):
    """`GpuAugment(imgsz, hyp, out_dtype)(raw_batch, generator)` -> a batch in YOLODataset.collate_fn's format.

    The settings are read once from `hyp` (AugmentSettings). A RawBatch with
    one tile per sample (after close_mosaic) is never mosaicked nor mixed, as Ultralytics' close_mosaic sets mosaic,
    mixup and cutmix to 0; with four, each sample is mosaicked with probability `mosaic`, and mixed with the
    partners the batch brings (`mixes` blocks of them) with probabilities `mixup` and `cutmix`.
    """

    def __call__(self, raw: RawBatch, generator: torch.Generator) -> dict:
        return self.apply(raw, self.draw(raw, generator))

    def draw(self, raw: RawBatch, generator: torch.Generator) -> AugmentParams:
        """All of a batch's random choices in one draw from `generator` (which must live on the batch's device)."""
        return draw(self, raw, generator)

    def apply(self, raw: RawBatch, p: AugmentParams) -> dict:
        """The augmented batch, keys and dtypes as YOLODataset.collate_fn returns them for a detection dataset, and
        for a pose dataset (RawBatch.keypoints) its `keypoints` (N, P, 3), normalised as Format(normalize=True), for
        a segmentation dataset (RawBatch.segments and `masks`) Format's `masks` and `sem_masks`
        (segment_masks.formatted_masks), the label rows sorted as their overlap masks number them, and for an obb
        dataset (`obb`) `bboxes` (N, 5) as Format(return_obb=True) makes them (normalised xywhr)."""
        n, s = raw.images.shape[0], self.imgsz
        if raw.images.shape[1:] != (s, s, 3):
            raise ValueError(f"raw images of shape {tuple(raw.images.shape[1:])} for imgsz {s}: expected ({s}, {s}, 3)")
        if n * s * s >= 2**31:
            raise ValueError(f"{n} raw images of {s} pixels overflow the int32 pixel indices: use smaller batches")
        b = raw.samples
        tiles = mosaic_tiles(self, raw, p)
        # Boxes first: their host sync then waits for a few small kernels, and the image kernels queued after it
        # run while the host goes on to queue the training step.
        outlines = boxes = corners = None
        if self.obb:  # an obb dataset's rows are their corners, clipped as rotated boxes
            row, xyxy, keep, corners = warped_obbs(self, raw, p, tiles)
        else:
            if raw.segments is not None:  # a dataset with polygons: its boxes are its warped polygons'
                outlines = warped_segments(self, raw, p, tiles)
                boxes = segment_boxes(outlines, s)
                outlines = clamped_into(outlines, boxes)
            row, xyxy, keep = warped_boxes(self, raw, p, tiles, boxes)
        points = None if raw.keypoints is None else warped_keypoints(self, raw, p, tiles)  # a pose dataset's
        host, block, mix = row, torch.zeros_like(row), None
        if self.partner_blocks(raw):
            host, block, xyxy, keep, mix = mix_boxes(self, p, b, row, xyxy, keep,
                                                     polygons=outlines is not None or corners is not None)
            if points is not None and self.p_cutmix > 0:
                points = cutmix_keypoints(self, points, host, block, mix.area)
            if outlines is not None and self.masks and self.p_cutmix > 0:
                outlines = cutmix_segments(self, outlines, host, block, mix.area)
            if corners is not None and self.p_cutmix > 0:
                corners, keep = cutmix_obbs(self, corners, host, block, mix.area, keep)
        batch_idx, cls, bboxes, counts, (mixed, needed), kept = collated_boxes(self, raw, p, host, block, xyxy, keep,
                                                                               mix)
        out = {} if points is None else {"keypoints": collated_keypoints(self, p, host, points, kept)}
        if corners is not None:  # Format(return_obb=True): xywhr of the flipped corners
            bboxes = obb_targets(flipped_segments(self, p, host[kept], corners[kept]), s)
        if outlines is not None and self.masks:  # Format's masks; with overlap_mask the rows sorted by mask area
            inside = rasterized(flipped_segments(self, p, host[kept], outlines[kept]), s // self.mask_ratio,
                                self.mask_ratio)
            order, out["masks"], out["sem_masks"] = formatted_masks(inside, batch_idx.long(), counts, cls,
                                                                    overlap=self.overlap_mask)
            if order is not None:
                cls, bboxes = cls[order], bboxes[order]
        geometry = warp_tables(self, p, tiles)
        img = render_samples(self, raw, p, geometry)
        if mixed:
            mix_images(self, raw, p, geometry, mix, mixed, needed, img)
        return {
            **out,
            MAX_TARGETS: max(counts),
            TARGETS_PER_IMAGE: counts,
            "batch_idx": batch_idx,
            "bboxes": bboxes,
            "cls": cls,
            "im_file": raw.im_file,
            "img": img,
            "ori_shape": raw.ori_shape,
            "ratio_pad": raw.ratio_pad,
            "resized_shape": ((s, s),) * b,
        }

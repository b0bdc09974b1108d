"""SegmentationValidator's masks and their matching (its tp_m), for a whole batch at once.

Per image Ultralytics makes each detection's mask from the head's prototypes (ops.process_mask: the mask
coefficients times the prototypes, > 0, cropped to the box scaled to the prototypes' resolution), each target's
from the loader's (with overlap_mask, one image of target indices: value i + 1 on target i's pixels; resized to a
quarter of the input where the loader's mask_ratio is not 4), their IoU (metrics.mask_iou: a matrix product of the
flattened 0/1 masks) and match_predictions on it. Here the same operations on a few images at once (their masks are
the temporaries), then one matching for the batch (matching.matched).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from launcher.rank.validate.matching import IOU_THRESHOLDS, matched, no_matches

MASK_ELEMENTS = 2**26  # mask pixels (detections' and targets') held at once as float32: 256 MiB


def predicted_masks(proto: torch.Tensor, coefficients: torch.Tensor, boxes: torch.Tensor, shape) -> torch.Tensor:
    """(B, D, h, w) uint8: ops.process_mask (upsample=False) for each image's detections, from its prototypes
    `proto` (B, nm, h, w), the detections' mask coefficients (B, D, nm) and boxes (B, D, 4) xyxy in pixels of the
    input `shape` (H, W)."""
    b, c, mh, mw = proto.shape
    masks = torch.bmm(coefficients.float(), proto.float().view(b, c, -1)).view(b, -1, mh, mw)
    ratios = torch.tensor([[mw / shape[1], mh / shape[0], mw / shape[1], mh / shape[0]]], device=boxes.device)
    return crop_mask(masks.gt_(0.0).byte(), boxes * ratios)


def crop_mask(masks: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
    """ops.crop_mask over images: (B, D, h, w) masks zeroed outside their boxes (B, D, 4), in place."""
    h, w = masks.shape[-2:]
    x1, y1, x2, y2 = boxes[..., None, None].unbind(-3)  # each (B, D, 1, 1)
    r = torch.arange(w, device=masks.device, dtype=x1.dtype)  # columns
    c = torch.arange(h, device=masks.device, dtype=x1.dtype)[:, None]  # rows
    masks *= (r >= x1) * (r < x2)
    masks *= (c >= y1) * (c < y2)
    return masks


def target_masks(overlap: torch.Tensor, targets: int, size) -> torch.Tensor:
    """(B, M, h, w) float 0/1: each image's first `targets` targets' masks from its overlap image (B, h0, w0) of
    target indices, at `size` (h, w) as SegmentationValidator._prepare_batch resizes them (bilinear, > 0.5)."""
    index = torch.arange(1, targets + 1, device=overlap.device).view(1, targets, 1, 1)
    masks = (overlap[:, None] == index).float()
    if tuple(masks.shape[2:]) != tuple(size) and targets:
        masks = F.interpolate(masks, size, mode="bilinear", align_corners=False).gt_(0.5)
    return masks


def mask_iou(truth: torch.Tensor, pred: torch.Tensor, eps: float = 1e-7) -> torch.Tensor:
    """(B, M, D) IoU of each image's target masks `truth` (B, M, N) with its detections' `pred` (B, D, N), both
    flattened 0/1 floats: metrics.mask_iou's operations."""
    intersection = torch.bmm(truth, pred.transpose(1, 2)).clamp_(0)
    union = (truth.sum(2)[:, :, None] + pred.sum(2)[:, None]) - intersection
    return intersection / (union + eps)


def mask_true_positives(proto: torch.Tensor, coefficients: torch.Tensor, pred_boxes: torch.Tensor,
                        pred_cls: torch.Tensor, pred_valid: torch.Tensor, overlap: torch.Tensor,
                        true_cls: torch.Tensor, true_valid: torch.Tensor, shape,
                        thresholds: torch.Tensor = IOU_THRESHOLDS, claim=None) -> torch.Tensor:
    """(B, D, T) bool as matching.true_positives, detections matched to targets by their masks' IoU
    (SegmentationValidator's tp_m): the detections' from `proto` and their `coefficients` (predicted_masks), the
    targets' from the loader's `overlap` images (target_masks, at the input `shape` (H, W) over 4)."""
    if not (pred_cls.shape[1] and true_cls.shape[1]):
        return no_matches(pred_cls, thresholds)
    b, m, d = *true_cls.shape, pred_cls.shape[1]
    size = (shape[0] // 4, shape[1] // 4)  # SegmentationValidator's mask size for process_mask
    pixels = proto.shape[2] * proto.shape[3]
    rows = max(1, MASK_ELEMENTS // ((m + d) * pixels))  # images at once: their masks as floats are the temporaries
    iou = []
    for i in range(0, b, rows):
        pred = predicted_masks(proto[i : i + rows], coefficients[i : i + rows], pred_boxes[i : i + rows], shape)
        truth = target_masks(overlap[i : i + rows], m, size)
        iou.append(mask_iou(truth.flatten(2), pred.flatten(2).float()))
    return matched(torch.cat(iou), pred_cls, pred_valid, true_cls, true_valid, thresholds, claim)

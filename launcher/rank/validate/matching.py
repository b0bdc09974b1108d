"""Ultralytics' DetectionValidator._process_batch and BaseValidator.match_predictions, for a whole batch at once.

Per image Ultralytics computes the IoU of every target with every detection (metrics.box_iou), zeroes the pairs of
different classes, and then, visiting the detections that reach the lowest threshold in descending confidence
order, lets each claim the unclaimed target it overlaps most at each of the 10 thresholds (0.5:0.95): a detection is
a true positive at a threshold when that IoU reaches it. The visit is sequential, so here it runs over the k-th such
detection of every image at once: as many rounds as the busiest image has candidate detections, each a few
operations on (images, targets, thresholds); on CUDA the visit is one Triton program per image instead (scans.py),
with no launch per round. Same IoUs in the same float operations, the same first-index argmax: the same true
positives.
"""

from __future__ import annotations

import torch

from launcher.rank.kernels import scans

IOU_THRESHOLDS = torch.linspace(0.5, 0.95, 10)  # DetectionValidator.iouv


def box_iou(a: torch.Tensor, b: torch.Tensor, eps: float = 1e-7) -> torch.Tensor:
    """(B, M, N) IoU of each image's boxes `a` (B, M, 4) with its boxes `b` (B, N, 4): metrics.box_iou's operations."""
    (a1, a2), (b1, b2) = a.float().unsqueeze(2).chunk(2, 3), b.float().unsqueeze(1).chunk(2, 3)
    wh, wh1, wh2 = (torch.min(a2, b2) - torch.max(a1, b1)).clamp_(0), a2 - a1, b2 - b1
    inter = wh[..., 0] * wh[..., 1]
    return inter / (wh1[..., 0] * wh1[..., 1] + wh2[..., 0] * wh2[..., 1] - inter + eps)


def true_positives(pred_boxes: torch.Tensor, pred_cls: torch.Tensor, pred_valid: torch.Tensor,
                   true_boxes: torch.Tensor, true_cls: torch.Tensor, true_valid: torch.Tensor,
                   thresholds: torch.Tensor = IOU_THRESHOLDS) -> torch.Tensor:
    """(B, D, T) bool: detection d of image b is a true positive at threshold t. Detections in descending
    confidence order per image; padding rows (not `*_valid`) never match."""
    b, d = pred_cls.shape
    device = pred_cls.device
    if not (d and true_cls.shape[1]):
        return torch.zeros((b, d, thresholds.numel()), dtype=torch.bool, device=device)
    thresholds = thresholds.to(device)
    iou = box_iou(true_boxes, pred_boxes)  # (B, M, D): targets as rows, as Ultralytics
    same = (true_cls[:, :, None] == pred_cls[:, None, :]) & true_valid[:, :, None] & pred_valid[:, None, :]
    iou = iou * same
    return scans.claims(iou, thresholds) if scans.usable(iou) else _claims(iou, thresholds)


def _claims(iou: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """scans.claims in PyTorch: the k-th candidate detection of every image at once, round after round."""
    b, _, d = iou.shape
    t = thresholds.numel()
    device = iou.device
    correct = torch.zeros((b, d + 1, t), dtype=torch.bool, device=device)  # a spare row for padding
    candidate = (iou >= thresholds.min()).any(1)  # (B, D)
    rounds = int(candidate.sum(1).max())  # the host read: the busiest image's candidates
    if not rounds:
        return correct[:, :d]
    positions = torch.where(candidate, torch.arange(d, device=device), d).sort(1).values[:, :rounds]  # (B, R)
    matched = torch.zeros((b, iou.shape[1], t), dtype=torch.bool, device=device)
    zero = iou.new_zeros(())
    for r in range(rounds):
        j = positions[:, r]  # (B,): this round's detection in each image, d where it has no more
        column = iou.gather(2, j.clamp(max=d - 1).view(b, 1, 1).expand(b, iou.shape[1], 1))  # (B, M, 1)
        available = torch.where(matched, zero, column)  # (B, M, T)
        k = available.argmax(1, keepdim=True)  # (B, 1, T): the best unclaimed target, first on ties
        hit = (available.gather(1, k) >= thresholds) & (j < d).view(b, 1, 1)  # (B, 1, T)
        correct.scatter_(1, j.view(b, 1, 1).expand(b, 1, t), hit)
        matched.scatter_(1, k, matched.gather(1, k) | hit)
    return correct[:, :d]

"""Ultralytics' DetectionValidator._process_batch and BaseValidator.match_predictions, for a whole batch at once.

Per image Ultralytics computes the IoU of every target with every detection (metrics.box_iou), zeroes the pairs of
different classes, and then, visiting the detections that reach the lowest threshold in descending confidence
order, lets each claim the unclaimed target it overlaps most at each of the 10 thresholds (0.5:0.95): a detection is
a true positive at a threshold when that IoU reaches it. The visit is sequential, so here it runs over the k-th such
detection of every image at once: as many rounds as the busiest image has candidate detections, each a few
operations on (images, targets, thresholds); on CUDA the visit is one Triton program per image instead (scans.py),
with no launch per round. Same IoUs in the same float operations, the same first-index argmax: the same true
positives. PoseValidator._process_batch matches by keypoint similarity (metrics.kpt_iou, OKS) instead of IoU, the
same way: pose_true_positives; SegmentationValidator's by the masks' IoU: masks.py.
"""

from __future__ import annotations

import torch

from launcher.rank.kernels import scans

IOU_THRESHOLDS = torch.linspace(0.5, 0.95, 10)  # DetectionValidator.iouv
OKS_ELEMENTS = 2**24  # keypoint distances computed at once (a few temporaries of 64 MiB)


def box_iou(a: torch.Tensor, b: torch.Tensor, eps: float = 1e-7) -> torch.Tensor:
    """(B, M, N) IoU of each image's boxes `a` (B, M, 4) with its boxes `b` (B, N, 4): metrics.box_iou's operations."""
    (a1, a2), (b1, b2) = a.float().unsqueeze(2).chunk(2, 3), b.float().unsqueeze(1).chunk(2, 3)
    wh, wh1, wh2 = (torch.min(a2, b2) - torch.max(a1, b1)).clamp_(0), a2 - a1, b2 - b1
    inter = wh[..., 0] * wh[..., 1]
    return inter / (wh1[..., 0] * wh1[..., 1] + wh2[..., 0] * wh2[..., 1] - inter + eps)


def true_positives(pred_boxes: torch.Tensor, pred_cls: torch.Tensor, pred_valid: torch.Tensor,
                   true_boxes: torch.Tensor, true_cls: torch.Tensor, true_valid: torch.Tensor,
                   thresholds: torch.Tensor = IOU_THRESHOLDS, claim=None) -> torch.Tensor:
    """(B, D, T) bool: detection d of image b is a true positive at threshold t. Detections in descending
    confidence order per image; padding rows (not `*_valid`) never match. `claim(iou, thresholds)`: another rule
    for who claims what, given the (B, M, D) IoUs with other classes and padding zeroed (None: the greedy claims)."""
    if not (pred_cls.shape[1] and true_cls.shape[1]):
        return no_matches(pred_cls, thresholds)
    iou = box_iou(true_boxes, pred_boxes)  # (B, M, D): targets as rows, as Ultralytics
    return matched(iou, pred_cls, pred_valid, true_cls, true_valid, thresholds, claim)


def pose_true_positives(pred_kpts: torch.Tensor, pred_cls: torch.Tensor, pred_valid: torch.Tensor,
                        true_kpts: torch.Tensor, true_boxes: torch.Tensor, true_cls: torch.Tensor,
                        true_valid: torch.Tensor, sigma: torch.Tensor,
                        thresholds: torch.Tensor = IOU_THRESHOLDS, claim=None) -> torch.Tensor:
    """(B, D, T) bool as true_positives, the detections' keypoints `pred_kpts` (B, D, K, >= 2) matched to the
    targets' `true_kpts` (B, M, K, 3), in input pixels, by OKS with the keypoints' `sigma` (K,) (PoseValidator's
    tp_p); `true_boxes` (B, M, 4) xyxy give each target's area."""
    if not (pred_cls.shape[1] and true_cls.shape[1]):
        return no_matches(pred_cls, thresholds)
    wh = true_boxes[..., 2:] - true_boxes[..., :2]  # ops.xyxy2xywh's width and height
    area = wh.prod(-1) * 0.53  # PoseValidator's (from xtcocotools' cocoeval)
    b, m, d, k = *true_cls.shape, pred_cls.shape[1], true_kpts.shape[2]
    rows = max(1, OKS_ELEMENTS // (m * d * k))  # images at once: their (M, D, K) distances are the temporaries
    oks = torch.cat([kpt_iou(true_kpts[i : i + rows], pred_kpts[i : i + rows], area[i : i + rows], sigma)
                     for i in range(0, b, rows)])
    return matched(oks, pred_cls, pred_valid, true_cls, true_valid, thresholds, claim)


def kpt_iou(kpt1: torch.Tensor, kpt2: torch.Tensor, area: torch.Tensor, sigma: torch.Tensor,
            eps: float = 1e-7) -> torch.Tensor:
    """(B, M, D) OKS of each image's targets' keypoints `kpt1` (B, M, K, 3) with its detections' `kpt2` (B, D, K,
    >= 2): metrics.kpt_iou's operations, image by image at once."""
    t, p = kpt1[:, :, None], kpt2[:, None]  # (B, M, 1, K, 3), (B, 1, D, K, >= 2)
    d = (t[..., 0] - p[..., 0]).pow(2) + (t[..., 1] - p[..., 1]).pow(2)  # (B, M, D, K)
    sigma = sigma.to(device=kpt1.device, dtype=kpt1.dtype)
    kpt_mask = kpt1[..., 2] != 0  # (B, M, K)
    e = d / ((2 * sigma).pow(2) * (area[:, :, None, None] + eps) * 2)
    return ((-e).exp() * kpt_mask[:, :, None]).sum(-1) / (kpt_mask.sum(-1)[:, :, None] + eps)


def no_matches(pred_cls: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    b, d = pred_cls.shape
    return torch.zeros((b, d, thresholds.numel()), dtype=torch.bool, device=pred_cls.device)


def matched(iou: torch.Tensor, pred_cls: torch.Tensor, pred_valid: torch.Tensor, true_cls: torch.Tensor,
            true_valid: torch.Tensor, thresholds: torch.Tensor, claim=None) -> torch.Tensor:
    """BaseValidator.match_predictions on (B, M, D) similarities (IoU, OKS, mask IoU): other classes and padding
    zeroed, then claimed."""
    thresholds = thresholds.to(iou.device)
    same = (true_cls[:, :, None] == pred_cls[:, None, :]) & true_valid[:, :, None] & pred_valid[:, None, :]
    iou = iou * same
    if claim is not None:
        return claim(iou, thresholds)
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
    taken = torch.zeros((b, iou.shape[1], t), dtype=torch.bool, device=device)
    zero = iou.new_zeros(())
    for r in range(rounds):
        j = positions[:, r]  # (B,): this round's detection in each image, d where it has no more
        column = iou.gather(2, j.clamp(max=d - 1).view(b, 1, 1).expand(b, iou.shape[1], 1))  # (B, M, 1)
        available = torch.where(taken, zero, column)  # (B, M, T)
        k = available.argmax(1, keepdim=True)  # (B, 1, T): the best unclaimed target, first on ties
        hit = (available.gather(1, k) >= thresholds) & (j < d).view(b, 1, 1)  # (B, 1, T)
        correct.scatter_(1, j.view(b, 1, 1).expand(b, 1, t), hit)
        taken.scatter_(1, k, taken.gather(1, k) | hit)
    return correct[:, :d]

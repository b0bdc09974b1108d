"""Ultralytics' ConfusionMatrix.process_batch (task detect), for a whole batch at once.

Per image Ultralytics keeps the detections whose confidence exceeds `conf`, computes the IoU of every target with
every kept detection (metrics.box_iou), and, visiting the detections that overlap some target by more than
`iou_thres` in descending confidence order (ties in detection order), lets each claim the target it overlaps most,
first on ties, if that IoU exceeds `iou_thres`; a claimed target's row is zeroed, so it is claimed once. Then a
claimed target counts [detection's class, target's class], an unclaimed one [background, target's class], and a kept
detection that claimed nothing [detection's class, background]. Its special cases (no targets: every kept detection
is background; no detections: every target is missed) are what the general rule gives, so one rule serves here.

Image by image that is a Python loop with host reads per image, on the critical path of the final validation. Here the visit runs over the k-th candidate of every image at once, as in
matching.py: as many rounds as the busiest image has candidates, the one host read per batch; the counts stay on the
device, summed by one scatter.
"""

from __future__ import annotations

import torch

from launcher.rank.validate.matching import box_iou
from launcher.rank.validate.nms import Detections


def confusion_counts(det: Detections, valid_det: torch.Tensor, target_boxes: torch.Tensor, target_cls: torch.Tensor,
                     valid_t: torch.Tensor, nc: int, conf: float, iou_thres: float = 0.45) -> torch.Tensor:
    """(nc + 1, nc + 1) int64 counts, on the device, that ConfusionMatrix(nc classes).process_batch(..., conf,
    iou_thres) adds to its matrix (rows: predicted class, columns: true class, index nc: background) called image by
    image on this batch. `det`: (B, K) detections, `valid_det` (B, K) the real ones; `target_boxes` (B, T, 4) xyxy,
    `target_cls` (B, T) class ids (float), `valid_t` (B, T) the real targets. `iou_thres` must be >= 0 (a zeroed or
    padded IoU then never claims)."""
    b, k = det.conf.shape
    t = target_cls.shape[1]
    device = det.conf.device
    kept = valid_det & (det.conf > conf)  # strictly greater, as Ultralytics' filter
    iou = box_iou(target_boxes, det.boxes)  # (B, T, K): targets as rows, in Ultralytics' float32 operations
    iou = torch.where(valid_t[:, :, None] & kept[:, None, :], iou, iou.new_zeros(()))  # padding never claims
    candidate = (iou > iou_thres).any(1)  # (B, K), from the IoUs before any row is zeroed, as Ultralytics
    rounds = int(candidate.sum(1).max()) if candidate.numel() else 0  # the host read: the busiest image's candidates
    # Each image's candidates in descending confidence, ties in detection order (np.argsort(-conf, kind="stable"));
    # the others after them, as the sentinel k.
    order = torch.where(candidate, -det.conf.float(), torch.inf).sort(dim=1, stable=True).indices[:, :rounds]
    positions = torch.where(candidate.gather(1, order), order, k)  # (B, R)
    # gt_match: the detection that claimed each target, -1 for none. A claimed target's row is zeroed, so it can
    # never be claimed again (0 never exceeds iou_thres): nothing is overwritten.
    claimed_by = torch.full((b, t), -1, dtype=torch.long, device=device)
    zero = iou.new_zeros(())
    for r in range(rounds):
        j = positions[:, r]  # (B,): this round's detection in each image, k where it has no more
        column = iou.gather(2, j.clamp(max=k - 1).view(b, 1, 1).expand(b, t, 1)).squeeze(2)  # (B, T)
        column = torch.where(claimed_by >= 0, zero, column)  # the zeroed rows
        gt = column.argmax(1, keepdim=True)  # (B, 1): first maximum, as numpy's argmax
        hit = (column.gather(1, gt) > iou_thres) & (j < k).view(b, 1)
        claimed_by.scatter_(1, gt, torch.where(hit, j.view(b, 1), claimed_by.gather(1, gt)))

    det_cls, gt_cls = det.cls.int().long(), target_cls.int().long()  # .int() truncates, as Ultralytics' .int()
    claimer = torch.where(claimed_by >= 0, claimed_by, k)  # (B, T): each target's detection, k (spare) for none
    with_background = torch.cat([det_cls, det_cls.new_full((b, 1), nc)], 1)  # column k: an unclaimed target's row
    pred_of_gt = with_background.gather(1, claimer)  # (B, T): each target's row
    claimed = torch.zeros((b, k + 1), dtype=torch.bool, device=device)  # a spare column for the sentinel
    claimed.scatter_(1, claimer, True)
    unclaimed = kept & ~claimed[:, :k]  # (B, K): false positives against the background
    # Every target and every detection adds its cell, weighted 0 where it does not count: a boolean selection
    # instead would make the host wait for its size.
    cells = torch.cat([pred_of_gt * (nc + 1) + gt_cls, det_cls * (nc + 1) + nc], 1)  # (B, T + K) flat cell indices
    counted = torch.cat([valid_t, unclaimed], 1)
    counts = torch.zeros((nc + 1) ** 2, dtype=torch.long, device=device)
    counts.scatter_add_(0, torch.where(counted, cells, 0).flatten(), counted.long().flatten())
    return counts.view(nc + 1, nc + 1)

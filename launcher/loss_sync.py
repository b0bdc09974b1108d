"""Normalise the YOLO loss by the whole global batch's target weight, not each rank's own.

Ultralytics' detection loss divides its box, class and DFL terms by `target_scores_sum`, the total weight of the
targets assigned *in the batch at hand*. Under DDP each rank divides by its own shard's total, so the averaged
gradient is not the gradient of the same loss on the whole global batch: multi-GPU training quietly optimises a
different objective than one GPU with the same global batch. Here every rank divides by the mean of the ranks'
totals (one scalar all-reduce per step, no host sync), which makes a DDP step at world size W x batch b equal to a
single-process step at batch W x b (tests/test_ddp_equivalence.py).

Ultralytics computes the normaliser inline, so it is replaced where it is used: the class term through the
criterion's element-wise BCE (rescaled by local/global, so its sum over local/global equals sum/global), and the
box and DFL terms through the `target_scores_sum` argument of its BboxLoss. Each v8DetectionLoss inside the
criterion (two in YOLO26's end-to-end loss) gets its own pair.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class _Normaliser:
    """The global normaliser of the current loss call, shared by the two wrappers of one v8DetectionLoss."""

    value: torch.Tensor | None = None


def _global_normaliser(raw_local: torch.Tensor) -> torch.Tensor:
    """What each rank divides by: the clamped total over all ranks, shared out equally.

    Summing the raw shares before Ultralytics' clamp(min=1) matters early in training, when the assigned target
    weight is below 1: clamping each rank's share would inflate the normaliser by up to the world size.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return raw_local.clamp(min=1)
    total = raw_local.detach().clone()
    dist.all_reduce(total)
    return total.clamp(min=1) / dist.get_world_size()


class GlobalBCE(nn.Module):
    def __init__(self, inner: nn.Module, shared: _Normaliser):
        super().__init__()
        self.inner, self.shared = inner, shared

    def forward(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raw = target.sum()
        local = raw.clamp(min=1)  # Ultralytics' own target_scores_sum, which the class term is divided by
        self.shared.value = _global_normaliser(raw)
        return self.inner(pred, target) * (local / self.shared.value).to(pred.dtype)


class GlobalBboxLoss(nn.Module):
    TARGET_SCORES_SUM = 5  # position of target_scores_sum in BboxLoss.forward (ultralytics 8.4.190)

    def __init__(self, inner: nn.Module, shared: _Normaliser):
        super().__init__()
        self.inner, self.shared = inner, shared

    def forward(self, *args):
        args = list(args)
        if self.shared.value is not None:
            args[self.TARGET_SCORES_SUM] = self.shared.value
        return self.inner(*args)


def _detection_losses(criterion) -> list:
    from ultralytics.utils.loss import v8DetectionLoss

    found = [criterion] if isinstance(criterion, v8DetectionLoss) else []
    for name in ("one2many", "one2one"):
        sub = getattr(criterion, name, None)
        if isinstance(sub, v8DetectionLoss):
            found.append(sub)
    return found


def use_global_normaliser(criterion) -> int:
    """Patch every detection loss in `criterion`; returns how many were patched (0: an unknown loss, left alone)."""
    losses = _detection_losses(criterion)
    for loss in losses:
        if isinstance(loss.bce, GlobalBCE):
            continue
        shared = _Normaliser()
        loss.bce = GlobalBCE(loss.bce, shared)
        loss.bbox_loss = GlobalBboxLoss(loss.bbox_loss, shared)
    return len(losses)

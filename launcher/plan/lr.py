"""Learning-rate scaling and warmup: what lr0 means, and how it follows the global batch. Pure functions.

The contract (README, "Batch size and learning rate"):

* The trainer back-propagates ``base_batch x (mean per-image loss over the global batch)``. At a global batch of
  ``base_batch`` (64 by default) that is exactly the gradient Ultralytics steps with (its loss is summed over the
  batch and accumulated up to nbs=64 images), so Ultralytics' lr0=0.01 keeps its meaning. A classifier's loss is a
  mean in Ultralytics (v8ClassificationLoss): its step back-propagates the mean over the global batch itself
  (task_rules.TaskRules.loss_base), Ultralytics' classification step at a batch of nbs.
* Ultralytics' own implicit scaling (gradient accumulation up to nbs, weight decay multiplied by batch/nbs) is
  switched off: accumulation is 1 and weight decay is used as given.
* The only batch-size rule is then ``lr0 = base_lr x f(global_batch / base_batch)``, with f linear, sqrt or none,
  applied once, and capped at ``optim.lr0_cap`` when one is set. For SGD, linear scaling reproduces what
  Ultralytics does above nbs (step, weight decay and all).
* Warmup is a length of data (epochs or images), converted to optimizer steps for the actual world size, so adding
  ranks does not shorten it in images.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

LR_RULES = ("linear", "sqrt", "none")


def scaled_lr(base_lr: float, base_batch: int, global_batch: int, rule: str) -> float:
    """lr0 for `global_batch`, given that `base_lr` was tuned at `base_batch`."""
    if rule not in LR_RULES:
        raise ValueError(f"optim.lr_scaling={rule!r}: expected one of {', '.join(LR_RULES)}")
    ratio = global_batch / base_batch
    return base_lr * {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[rule]


def capped(lr0: float, cap: float | None) -> float:
    """lr0 no higher than optim.lr0_cap (None: no cap)."""
    return lr0 if cap is None else min(lr0, float(cap))


def loss_scale(base_batch: int, local_batch: int) -> float:
    """Factor on a rank's summed loss so that DDP's gradient average is base_batch x the global mean gradient.

    The criterion returns (per-image loss summed over the rank's `local_batch` images). DDP averages gradients over
    ranks, so multiplying each rank's sum by base_batch / local_batch yields base_batch x mean over the global batch
    (ranks hold equal batches). A single process (or DataParallel) is the world-size-1 case of the same formula.
    """
    return base_batch / local_batch


@dataclass(frozen=True)
class Warmup:
    iterations: int  # optimizer steps of warmup
    images: int  # images seen during warmup (global)
    epochs: float  # the same length in epochs


def warmup_length(
    *,
    warmup_epochs: float,
    warmup_images: int | None,
    epochs: int,
    batches_per_epoch: int,
    global_batch: int,
) -> Warmup:
    """Warmup in optimizer steps for this world size.

    `batches_per_epoch` is per rank (every rank takes the same number of steps). As in Ultralytics, warmup never
    takes the final epoch: at least one epoch trains at the scheduled lr.
    """
    images_per_epoch = batches_per_epoch * global_batch
    if warmup_images is not None:
        length_epochs = warmup_images / images_per_epoch
    else:
        length_epochs = warmup_epochs
    length_epochs = max(0.0, min(length_epochs, max(epochs - 1, 0)))
    iterations = round(length_epochs * batches_per_epoch)
    return Warmup(iterations=iterations, images=iterations * global_batch, epochs=length_epochs)


def lr_lambda(epochs: int, lrf: float, cos_lr: bool):
    """Per-epoch multiplier on lr0: Ultralytics' linear (to lrf) or one-cycle cosine schedule."""
    if cos_lr:
        return lambda e: ((1 - math.cos(e * math.pi / epochs)) / 2) * (lrf - 1) + 1
    return lambda e: max(1 - e / epochs, 0) * (1.0 - lrf) + lrf

"""One optimizer step on a batch already on the device: forward, loss, backward (per micro-batch when accumulating),
unscale, clip, step, EMA."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from launcher.rank.data.pipeline import MAX_TARGETS, TARGETS_PER_IMAGE
from launcher.rank.step.wrap import unwrap

PER_TARGET = ("batch_idx", "cls", "bboxes", "keypoints")  # per-target tensors, grouped by image in image order


def train_step(model, batch: dict, *, loss_scale: float, optimizer, scaler, grad_clip: float, amp_dtype=None,
               accumulate: int = 1):
    """Returns (loss, loss items), both still on the device (reading them would make the host wait).

    `loss_scale` turns the rank's summed loss into base_batch x its mean (plan/lr.py, loss_scale), so DDP's gradient
    average is the same update a single process would take on the whole global batch. With `accumulate` N the batch
    (N micro-batches' worth of images) goes forward and backward in N parts; DDP all-reduces on the last one only, and
    the detection loss is normalised over the whole batch (rank/ultralytics/loss.py, deferred): the step is the one
    a single pass over the whole batch would take.
    """
    device_type = next(model.parameters()).device.type
    criterion = getattr(unwrap(model), "criterion", None)
    defer = accumulate > 1 and hasattr(criterion, "defer_normaliser")
    if defer:
        criterion.defer_normaliser()
    parts = micro_batches(batch, accumulate) if accumulate > 1 else [batch]
    if accumulate > 1:  # every part adds into allocated gradients (see zero_grad below)
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None and p.requires_grad:
                    p.grad = torch.zeros_like(p)
    total = items = None
    for k, part in enumerate(parts):
        last = k == len(parts) - 1
        with nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync():
            # cache_enabled=False: CUDA graphs replay casts they captured; a cache would hold tensors across steps
            with torch.autocast(device_type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None,
                                cache_enabled=False):
                # Forward on the images only, loss on the unwrapped model: DataParallel may scatter the images but
                # not the batch's per-object tensors (batch_idx, cls, bboxes), and DDP hooks the gradients either way.
                preds = model(part["img"])
                loss, part_items = unwrap(model).loss(part, preds)
                loss = loss.sum() * loss_scale
            scaler.scale(loss).backward()
        total = loss.detach() if total is None else total + loss.detach()
        items = dict(part_items) if items is None else {k: items[k] + v for k, v in part_items.items()}
    scaler.unscale_(optimizer)
    if defer:
        # Each part was divided by 1 and scaled for its b images where the whole batch is N b: the gradients want
        # the whole batch's normaliser over N (plan/lr.py's loss_scale and Ultralytics' loss x batch size).
        normaliser = criterion.deferred_normaliser()
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        torch._foreach_div_(grads, normaliser / len(parts))
        total, items = total / (normaliser / len(parts)), {k: v / normaliser for k, v in items.items()}
    elif accumulate > 1:  # each part normalised on its own (a loss that cannot defer): their mean
        items = {k: v / len(parts) for k, v in items.items()}
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=grad_clip)
    scaler.step(optimizer)
    scaler.update()
    # Accumulating, the gradients stay allocated (zeroed) so that every part adds into them: a CUDA graph's static
    # gradient output must never become a parameter's .grad, or the next part's replay would overwrite it.
    optimizer.zero_grad(set_to_none=accumulate == 1)
    return total, items


def micro_batches(batch: dict, n: int) -> list[dict]:
    """A batch of n x b images as n batches of b, in order: images, their per-image entries and their targets
    (split where the host-side per-image target counts say, TARGETS_PER_IMAGE; no host sync)."""
    images = len(batch["img"])
    if images % n:
        raise ValueError(f"a batch of {images} images does not split into {n} micro-batches")
    b, counts = images // n, batch[TARGETS_PER_IMAGE]
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    parts = []
    for k in range(n):
        first, end = k * b, (k + 1) * b
        lo, hi = starts[first], starts[end]
        part = {}
        for key, value in batch.items():
            if key in PER_TARGET:
                part[key] = value[lo:hi] - first if key == "batch_idx" else value[lo:hi]
            elif isinstance(value, (torch.Tensor, list, tuple)) and len(value) == images:
                part[key] = value[first:end]
            else:
                part[key] = value
        part[MAX_TARGETS] = max(counts[first:end], default=0)
        parts.append(part)
    return parts


class TrainStep:
    """The loop's step: `train_step` on what the step calls (`model`: graphed, compiled, inside DDP or DataParallel),
    then the EMA of the bare network `net`. `loss` and `loss_items` hold the last step's, on the device."""

    def __init__(self, model, net, *, optimizer, scaler, ema, loss_scale: float, grad_clip: float, amp_dtype=None,
                 accumulate: int = 1):
        self.model, self.net, self.optimizer, self.scaler, self.ema = model, net, optimizer, scaler, ema
        self.loss_scale, self.grad_clip, self.amp_dtype, self.accumulate = loss_scale, grad_clip, amp_dtype, accumulate
        self.loss = self.loss_items = None

    def __call__(self, batch: dict) -> None:
        self.loss, self.loss_items = train_step(
            self.model, batch, loss_scale=self.loss_scale, optimizer=self.optimizer, scaler=self.scaler,
            grad_clip=self.grad_clip, amp_dtype=self.amp_dtype, accumulate=self.accumulate,
        )
        self.ema.update(self.net)

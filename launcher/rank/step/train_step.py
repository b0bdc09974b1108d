"""One optimizer step on a batch already on the device: forward, loss, backward, unscale, clip, step, EMA."""

from __future__ import annotations

import torch

from launcher.rank.step.wrap import unwrap


def train_step(model, batch: dict, *, loss_scale: float, optimizer, scaler, grad_clip: float, amp_dtype=None):
    """Returns (loss, loss items), both still on the device (reading them would make the host wait).

    `loss_scale` turns the rank's summed loss into base_batch x its mean (plan/lr.py, loss_scale), so DDP's gradient
    average is the same update a single process would take on the whole global batch.
    """
    device_type = next(model.parameters()).device.type
    # cache_enabled=False: CUDA graphs replay casts they captured; a cache would hold tensors across steps
    with torch.autocast(device_type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None, cache_enabled=False):
        # Forward on the images only, loss on the unwrapped model: DataParallel may scatter the images but not
        # the batch's per-object tensors (batch_idx, cls, bboxes), and DDP hooks the gradients either way.
        preds = model(batch["img"])
        loss, items = unwrap(model).loss(batch, preds)
        loss = loss.sum() * loss_scale
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    return loss.detach(), items


class TrainStep:
    """The loop's step: `train_step` on what the step calls (`model`: graphed, compiled, inside DDP or DataParallel),
    then the EMA of the bare network `net`. `loss` and `loss_items` hold the last step's, on the device."""

    def __init__(self, model, net, *, optimizer, scaler, ema, loss_scale: float, grad_clip: float, amp_dtype=None):
        self.model, self.net, self.optimizer, self.scaler, self.ema = model, net, optimizer, scaler, ema
        self.loss_scale, self.grad_clip, self.amp_dtype = loss_scale, grad_clip, amp_dtype
        self.loss = self.loss_items = None

    def __call__(self, batch: dict) -> None:
        self.loss, self.loss_items = train_step(
            self.model, batch, loss_scale=self.loss_scale, optimizer=self.optimizer, scaler=self.scaler,
            grad_clip=self.grad_clip, amp_dtype=self.amp_dtype,
        )
        self.ema.update(self.net)

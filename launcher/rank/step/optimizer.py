"""The optimizer as the step uses it: the fused kernel (`optim.fused`), and the learning-rate schedule with warmup.

**Fused optimizer.** With fp16 AMP, `GradScaler.step` asks the host whether the gradients overflowed (`.item()`) before
a foreach optimizer may step: the host waits for the whole backward pass on every step, and the GPU then idles while
the host launches the optimizer, the EMA and the next batch. A fused optimizer takes the overflow flag as a device
tensor and skips the update on the GPU, so the host never waits there.

torch's fused SGD has a trap: its first step creates the momentum buffers with `torch.empty_like` and lets the kernel
fill them. When that first step overflows (common with fp16 AMP, whose scale starts at 65536 and is lowered after
each overflow) the kernel skips the step and leaves the buffers holding uninitialised memory, and every later step
reads it: NaN from the second step on. So the buffers are created here, as zeros, before the first step. With zero
buffers the first update is `buf = momentum * 0 + grad = grad`, exactly torch's first-step rule (dampening is 0),
and a skipped step leaves them zero.

**Schedule.** Ultralytics' recipe: per epoch, lr0 times a linear (to lrf) or cosine factor (plan/lr.py, lr_lambda);
during the first `warmup` steps the bias lr falls from warmup_bias_lr, the others rise from 0, and momentum rises
from warmup_momentum.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from launcher.plan import lr as lrmod


def fused_optimizer(optimizer: torch.optim.Optimizer, setting, device: torch.device) -> torch.optim.Optimizer:
    """The same optimizer (class, parameter groups, hyperparameters) with the fused kernel, its state initialised.

    `setting`: optim.fused -- auto (fused on CUDA), true, false. Called before any step, so there is no state to carry.
    """
    use = device.type == "cuda" if setting == "auto" else bool(setting)
    if not use:
        return optimizer
    if optimizer.state:
        raise RuntimeError("fused_optimizer must be applied before the first step")
    defaults = {k: v for k, v in optimizer.defaults.items() if k not in ("fused", "foreach")}
    # A group's own 'fused'/'foreach' entries (None, from the first construction) would override the defaults.
    groups = [{k: v for k, v in g.items() if k not in ("fused", "foreach")} for g in optimizer.param_groups]
    fused = type(optimizer)(groups, **defaults, fused=True)
    zero_momentum_buffers(fused)
    return fused


def zero_momentum_buffers(optimizer: torch.optim.Optimizer) -> None:
    """SGD with momentum: create every momentum buffer as zeros now, not as empty memory at the first step."""
    if not isinstance(optimizer, torch.optim.SGD):
        return  # Adam's moments are zero-initialised by torch itself
    for group in optimizer.param_groups:
        if group["momentum"] == 0:
            continue
        for p in group["params"]:
            state = optimizer.state[p]
            if state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)


class Schedule:
    """lr and momentum of every parameter group, for epoch `epoch` and step `ni` of the run."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, epochs: int, lrf: float, cos_lr: bool, warmup_steps: int,
                 warmup_bias_lr: float, warmup_momentum: float, momentum: float):
        self.optimizer, self.warmup_steps = optimizer, warmup_steps
        self.warmup_bias_lr, self.warmup_momentum, self.momentum = warmup_bias_lr, warmup_momentum, momentum
        self.factor = lrmod.lr_lambda(epochs, lrf, cos_lr)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=self.factor)

    def start_at(self, epoch: int) -> None:
        """Before the first epoch (also of a resumed run): the next `begin_epoch` sets `epoch`'s lr. A restored
        optimizer brings the lr0 of the run that saved it; the scheduler's (this plan's lr0) wins."""
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs):
            group["initial_lr"] = base
        self.scheduler.last_epoch = epoch - 1

    def begin_epoch(self) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()"
            self.scheduler.step()

    def warm_up(self, ni: int, epoch: int) -> None:
        """Ultralytics' warmup at step `ni` (<= warmup_steps): bias lr falls from warmup_bias_lr, the others rise
        from 0 to the epoch's scheduled lr; momentum rises from warmup_momentum."""
        xi = [0, self.warmup_steps]
        for g in self.optimizer.param_groups:
            start = self.warmup_bias_lr if g.get("param_group") == "bias" else 0.0
            g["lr"] = float(np.interp(ni, xi, [start, g["initial_lr"] * self.factor(epoch)]))
            if "momentum" in g:
                g["momentum"] = float(np.interp(ni, xi, [self.warmup_momentum, self.momentum]))

    def lrs(self) -> dict[str, float]:
        """results.csv's lr/pg<N> columns."""
        return {f"lr/pg{i}": g["lr"] for i, g in enumerate(self.optimizer.param_groups)}

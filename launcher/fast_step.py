"""The training step's speed settings: a fused optimizer (`optim.fused`) and torch.compile (`train.compile`).

Both change how the step runs, never what it computes (up to floating-point rounding).

**Fused optimizer.** With fp16 AMP, `GradScaler.step` asks the host whether the gradients overflowed (`.item()`) before
a foreach optimizer may step: the host waits for the whole backward pass on every step, and the GPU then idles while
the host launches the optimizer, the EMA and the next batch. A fused optimizer takes the overflow flag as a device
tensor and skips the update on the GPU, so the host never waits there.

torch's fused SGD has a trap, found on the H200 (docs/benchmarks/README.md): its first step creates the momentum
buffers with `torch.empty_like` and lets the kernel fill them. When that first step overflows -- common with fp16
AMP, whose scale starts at 65536 and is lowered after each overflow -- the kernel skips the step and leaves the
buffers holding uninitialised memory, and every later step reads it: NaN from the second step on. So the buffers are
created here, as zeros, before the first step. With zero buffers the first update is `buf = momentum * 0 + grad =
grad`, exactly torch's first-step rule (dampening is 0), and a skipped step leaves them zero. Measured on the H200:
+2.9 % and +4.4 % images/s end to end.

**torch.compile.** The eager step launches about 1,200 kernels per yolov8s step, each taking more host time than
GPU time. Inductor fuses the elementwise work (BatchNorm, SiLU, concatenations, copies) around cuDNN's convolutions,
and `reduce-overhead` also replays forward and backward as CUDA graphs. Only the network is compiled: the loss has
data-dependent shapes (target assignment) and stays eager, like validation, which runs on the EMA copy. Shapes are
static (`dynamic=False`): a short last batch compiles once more, and every full batch keeps the specialised kernels.
Measured on the H200 (yolov8s, batch 64): `default` -4 %, `reduce-overhead` +6 %, 2.5 min of compilation per run,
and the GPU time per step unchanged (Inductor's SPPF max-pool and upsample-backward kernels are slower than ATen's);
so it stays off by default.
"""

from __future__ import annotations

import torch
from torch import nn


def compile_mode(value) -> str | None:
    """train.compile as a torch.compile mode (None: off); the plan has checked the value."""
    if value is False or value is None:
        return None
    return "default" if value is True else str(value)


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


def compiled(model: nn.Module, value) -> nn.Module:
    """`model` compiled as train.compile asks (the module itself when it is off). Compilation is lazy: the first
    steps are slow, which ddp-bench's warm-up steps absorb."""
    mode = compile_mode(value)
    if mode is None:
        return model
    return torch.compile(model, mode=mode, dynamic=False)

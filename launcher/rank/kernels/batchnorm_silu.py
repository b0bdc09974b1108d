"""Training BatchNorm and SiLU as one differentiable function (`bn_silu`): Ultralytics' Conv blocks' act(bn(x)) on
the convolution's output, with Triton kernels on channels_last tensors and a PyTorch twin elsewhere.

PyTorch runs a Conv block's training BatchNorm as cuDNN's forward (two reads of the convolution's output, one write)
and backward (two reads of the input and of the gradient, one write), and SiLU as two more passes each way, keeping
both the normalised tensor and the activation's input for the backward. Here:

- forward: one read for the per-channel mean and biased variance, one read and one write for
  y = silu((x - mean) * rstd * weight + bias), rounded once to x's type; running_mean and running_var updated in place
  as torch.nn.BatchNorm2d updates them (momentum, the unbiased variance); x, mean and rstd kept for the backward;
- backward: one read of x and dy for the per-channel sum(dz) and sum(dz * xhat), dz = dy * silu'(z) with z recomputed
  from x, then one read of both and one write of dx = weight * rstd * (dz - mean(dz) - xhat * mean(dz * xhat));
  dweight = sum(dz * xhat), dbias = sum(dz).

The statistics: each program reduces blocks of rows of the [N*H*W, C] view into a (count, mean, M2) per channel,
each block's mean and squared deviations taken in registers and merged into the program's by Chan's pairwise
update; a small finish kernel merges the programs' partials the same way. Sums of x and x^2 in fp32 would lose the
variance to cancellation where a channel's mean is large against its spread over millions of rows; the pairwise
merge does not. Every sum runs in a fixed order (no atomics): a replay repeats its values bit for bit.

Eval mode (running statistics) is PyTorch's batch_norm and SiLU. The PyTorch twin computes the same in fp32 with
torch ops: on the CPU, for other layouts and types. The kernels are in batchnorm_silu_kernels.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from launcher.rank.kernels import batchnorm_silu_kernels as k
from launcher.rank.kernels.triton_use import runs_on

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_ELEMENTS = 2**31 - 2**16  # the kernels index rows in int32 (with a block to spare)
# Tiles of 32 channels: a pixel's 32 channels are 64 contiguous bytes in fp16 (every Ultralytics width is a multiple of
# 16, most of 32). First choices, to be tuned on the GPU (docs/benchmarks/h200-step/README.md, how to measure).
STAT_ROWS, STAT_CHANNELS = 128, 32  # rows x channels of a reduction's block
ROWS, CHANNELS = 128, 32  # rows x channels per program of the elementwise passes (as kernels.py's row copies)
# A finish kernel's programs each take few channels and many partials: it then runs on several multiprocessors (one
# per 8 channels) in a step or two, not on one in many.
PARTS, FINISH_CHANNELS = 512, 8  # partials x channels merged per step of a finish kernel
PROGRAMS = 1024  # about how many reduction programs one call launches (rows blocks x channel blocks)


def _on_triton(x: torch.Tensor) -> bool:
    return (k.triton is not None and runs_on(x.device) and x.dtype in TRITON_DTYPES and x.dim() == 4
            and x.is_contiguous(memory_format=torch.channels_last) and 0 < x.numel() <= MAX_ELEMENTS)


def _rows_channels(x: torch.Tensor) -> tuple[int, int]:
    n, c, h, w = x.shape
    return n * h * w, c


def _split(rows: int, channels: int) -> tuple[int, int]:
    """(row blocks per reduction program, reduction programs along the rows) for a [rows, channels] view."""
    blocks = -(-rows // STAT_ROWS)
    along = max(1, min(blocks, PROGRAMS // -(-channels // STAT_CHANNELS)))
    per = -(-blocks // along)
    return per, -(-blocks // per)


def _stats_triton(x, weight, bias, running_mean, running_var, momentum: float, eps: float):
    """(mean, rstd, scale = weight * rstd), fp32 (C,), of x; the running statistics updated when given."""
    rows, c = _rows_channels(x)
    per, along = _split(rows, c)
    f32 = dict(dtype=torch.float32, device=x.device)
    part_mean, part_m2 = torch.empty((along, c), **f32), torch.empty((along, c), **f32)
    k.stats_partial[(along, -(-c // STAT_CHANNELS))](x, part_mean, part_m2, rows, c, per, ROWS=STAT_ROWS,
                                                     CHANNELS=STAT_CHANNELS)
    mean, rstd, scale = (torch.empty(c, **f32) for _ in range(3))
    update = running_mean is not None
    k.stats_finish[(-(-c // FINISH_CHANNELS),)](
        part_mean, part_m2, mean, rstd, scale, weight, running_mean if update else mean,
        running_var if update else rstd, rows, c, along, per * STAT_ROWS, float(momentum), float(eps),
        UPDATE=update, PARTS=PARTS, CHANNELS=FINISH_CHANNELS)
    return mean, rstd, scale


def _forward_triton(x, weight, bias, running_mean, running_var, momentum, eps, act: bool):
    mean, rstd, scale = _stats_triton(x, weight, bias, running_mean, running_var, momentum, eps)
    rows, c = _rows_channels(x)
    y = torch.empty_like(x, memory_format=torch.channels_last)
    k.act_forward[(-(-rows // ROWS), -(-c // CHANNELS))](x, y, mean, scale, bias, rows, c, ACT=act, ROWS=ROWS,
                                                         CHANNELS=CHANNELS)
    return y, mean, rstd


def _backward_triton(dy, x, weight, bias, mean, rstd, act: bool):
    rows, c = _rows_channels(x)
    per, along = _split(rows, c)
    f32 = dict(dtype=torch.float32, device=x.device)
    part_dz, part_dzx = torch.empty((along, c), **f32), torch.empty((along, c), **f32)
    k.grad_partial[(along, -(-c // STAT_CHANNELS))](x, dy, mean, rstd, weight, bias, part_dz, part_dzx, rows, c, per,
                                                    ACT=act, ROWS=STAT_ROWS, CHANNELS=STAT_CHANNELS)
    dweight, dbias = torch.empty(c, **f32), torch.empty(c, **f32)
    k.grad_finish[(-(-c // FINISH_CHANNELS),)](part_dz, part_dzx, dweight, dbias, c, along, PARTS=PARTS,
                                               CHANNELS=FINISH_CHANNELS)
    dx = torch.empty_like(x, memory_format=torch.channels_last)
    k.act_backward[(-(-rows // ROWS), -(-c // CHANNELS))](x, dy, dx, mean, rstd, weight, bias, dweight, dbias, rows,
                                                          c, ACT=act, ROWS=ROWS, CHANNELS=CHANNELS)
    return dx, dweight, dbias


# --- the PyTorch twin: the same maths in fp32 with torch ops -------------------------------------------------------
def _per_channel(v: torch.Tensor) -> torch.Tensor:
    return v.view(1, -1, 1, 1)


def _fp32(t: torch.Tensor) -> torch.Tensor:
    """t in fp32, or in its own type where that is wider (float64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _forward_torch(x, weight, bias, running_mean, running_var, momentum, eps, act: bool):
    xf = _fp32(x)
    rows = xf.numel() // xf.shape[1]
    var, mean = torch.var_mean(xf, dim=(0, 2, 3), correction=0)
    rstd = torch.rsqrt(var + eps)
    if running_mean is not None:
        running_mean.copy_(momentum * mean + (1 - momentum) * running_mean)
        running_var.copy_(momentum * var * (rows / (rows - 1)) + (1 - momentum) * running_var)
    z = (xf - _per_channel(mean)) * _per_channel(_fp32(weight) * rstd) + _per_channel(_fp32(bias))
    y = z * torch.sigmoid(z) if act else z
    return y.to(x.dtype), mean, rstd


def _dz_torch(dy, x, weight, bias, mean, rstd, act: bool):
    """(dz, xhat) in fp32: dy through SiLU at z = xhat * weight + bias."""
    xhat = (_fp32(x) - _per_channel(mean)) * _per_channel(rstd)
    dz = _fp32(dy)
    if act:
        z = xhat * _per_channel(_fp32(weight)) + _per_channel(_fp32(bias))
        s = torch.sigmoid(z)
        dz = dz * s * (1 + z * (1 - s))
    return dz, xhat


def _backward_torch(dy, x, weight, bias, mean, rstd, act: bool):
    dz, xhat = _dz_torch(dy, x, weight, bias, mean, rstd, act)
    rows = dz.numel() // dz.shape[1]
    dbias, dweight = dz.sum((0, 2, 3)), (dz * xhat).sum((0, 2, 3))
    dx = _per_channel(_fp32(weight) * rstd) * (dz - _per_channel(dbias / rows) - xhat * _per_channel(dweight / rows))
    return dx.to(x.dtype), dweight, dbias


class _BnSilu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum: float, eps: float, act: bool):
        rows, _ = _rows_channels(x)
        if rows < 2:  # as torch.nn.BatchNorm2d refuses it
            raise ValueError(f"Expected more than 1 value per channel when training, got input size {tuple(x.shape)}")
        triton = _on_triton(x)
        forward = _forward_triton if triton else _forward_torch
        y, mean, rstd = forward(x, weight, bias, running_mean, running_var, momentum, eps, act)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.act, ctx.triton = act, triton
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        if ctx.triton:
            dy = dy.contiguous(memory_format=torch.channels_last)  # what the graph's backward hands over already
        backward = _backward_triton if ctx.triton and _on_triton(dy) else _backward_torch
        dx, dweight, dbias = backward(dy, x, weight, bias, mean, rstd, ctx.act)
        need = ctx.needs_input_grad
        return (dx if need[0] else None, dweight.to(weight.dtype) if need[1] else None,
                dbias.to(bias.dtype) if need[2] else None, None, None, None, None, None)


def bn_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, running_mean: torch.Tensor | None,
            running_var: torch.Tensor | None, momentum: float, eps: float, training: bool, act: bool) -> torch.Tensor:
    """silu(batch_norm(x)) (or batch_norm(x) without `act`) for x (N, C, H, W), differentiable in x, weight and bias.
    Training: the batch's statistics, with running_mean and running_var (when given) updated in place as
    torch.nn.BatchNorm2d updates them (the caller counts num_batches_tracked); else the running statistics."""
    if not training:
        y = F.batch_norm(x, running_mean, running_var, weight, bias, False, 0.0, eps)
        return F.silu(y) if act else y
    return _BnSilu.apply(x, weight, bias, running_mean, running_var, float(momentum), float(eps), bool(act))


def warm_up(device: torch.device, dtype: torch.dtype) -> None:
    """The kernels compiled (or loaded from Triton's cache) for `dtype` channels_last tensors whose channel counts
    are multiples of 16 (every Ultralytics width but a few heads'), without launching."""
    if k.triton is None or device.type != "cuda" or dtype not in TRITON_DTYPES:
        return
    torch.cuda.set_device(device)  # Triton compiles for the thread's current device
    f32 = torch.float32
    k.stats_partial.warmup(dtype, f32, f32, 1, 16, 1, ROWS=STAT_ROWS, CHANNELS=STAT_CHANNELS, grid=(1,))
    for update in (True, False):
        k.stats_finish.warmup(f32, f32, f32, f32, f32, f32, f32, f32, 1, 16, 1, 1, 0.1, 0.1, UPDATE=update,
                              PARTS=PARTS, CHANNELS=FINISH_CHANNELS, grid=(1,))
    k.grad_finish.warmup(f32, f32, f32, f32, 16, 1, PARTS=PARTS, CHANNELS=FINISH_CHANNELS, grid=(1,))
    for act in (True, False):
        k.act_forward.warmup(dtype, dtype, f32, f32, f32, 1, 16, ACT=act, ROWS=ROWS, CHANNELS=CHANNELS, grid=(1,))
        k.grad_partial.warmup(dtype, dtype, f32, f32, f32, f32, f32, f32, 1, 16, 1, ACT=act, ROWS=STAT_ROWS,
                              CHANNELS=STAT_CHANNELS, grid=(1,))
        k.act_backward.warmup(dtype, dtype, dtype, f32, f32, f32, f32, f32, f32, 1, 16, ACT=act, ROWS=ROWS,
                              CHANNELS=CHANNELS, grid=(1,))

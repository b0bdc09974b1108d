"""Triton kernels with PyTorch twins: Triton on CUDA, PyTorch elsewhere (and for what Triton does not take).

- `bias_act_(y, bias, silu)`: a convolution's per-channel bias, then SiLU or nothing, in place, in one pass: the
  validation's folded forward (rank/ultralytics/folded.py). Once BatchNorm is folded into a convolution, its bias is
  what is left of it; PyTorch adds a per-channel bias to a channels_last tensor with its generic broadcast kernel,
  which cost as much as the BatchNorm it replaced, and SiLU then takes a second pass
  (docs/benchmarks/h200-validation/README.md, the seventh session's profile).
- `upsample_nearest2x(x)` and `upsample_nearest2x_backward(grad)`: nearest upsampling by 2 of a channels_last tensor
  (Ultralytics' nn.Upsample in the neck), a copy of each input pixel's channel row into four output rows, and its
  gradient, the sum of those four rows; `nearest2x` is the pair as one differentiable function, which the training
  step's CUDA graphs run (rank/step/upsampling.py). PyTorch's channels_last kernels are several times slower: its
  forward, and its backward after a copy of the whole gradient to NCHW (docs/benchmarks/h200-step/README.md).

Each computes what the PyTorch form computes: bias and SiLU in fp32 on the stored values, rounded once to the
tensor's type; the upsampling copies values; its backward sums the four rows in fp32 in PyTorch's order (row by
row, left to right), rounded once.

A process's first Triton kernel pays for Triton's own start (its driver, the hash of its sources behind every cache
key) and, on a machine that never ran it, the compilation; `warm_up` does all that without a launch, on a thread
(`WarmUp`): during the set-up for the training step's kernels (rank/components.py), during the first epoch for the
folded validation's (FastValidator.read_ahead).
"""

from __future__ import annotations

import threading
import time

import torch
import torch.nn.functional as F

try:  # compiled at the first launch; without Triton only the PyTorch forms run
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - every torch build this project supports ships Triton on Linux
    triton = None

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_ELEMENTS = 2**31 - 2**16  # the kernels index in int32 where they can (with a block to spare)
BLOCK = 2048  # elements per program of bias_act_
ROWS, CHANNELS = 64, 64  # pixels x channels per program of the upsampling's kernels (output / input pixels)
VALIDATION = ("bias_act", "upsample")  # the kernels of the folded validation forward (warm_up's `names`)
TRAINING = ("upsample", "upsample_backward")  # the training step's
SCANS = ("scans",)  # the validation's NMS and matching (rank/validate/scans.py)


def _on_triton(t: torch.Tensor) -> bool:
    return triton is not None and t.is_cuda and t.dtype in TRITON_DTYPES and t.numel() <= MAX_ELEMENTS


def bias_act_(y: torch.Tensor, bias: torch.Tensor, silu: bool) -> torch.Tensor:
    """y (N, C, H, W) += bias (C,), then SiLU when `silu`; in place, returned."""
    channels_last = y.is_contiguous(memory_format=torch.channels_last)
    if _on_triton(y) and (channels_last or y.is_contiguous()) and bias.is_contiguous() and y.numel():
        n, c, h, w = y.shape
        _bias_act[(triton.cdiv(y.numel(), BLOCK),)](y, bias, y.numel(), c, h * w, SILU=silu,
                                                    CHANNELS_LAST=channels_last, BLOCK=BLOCK)
        return y
    y.add_(bias.view(1, -1, 1, 1).to(y.dtype))
    return F.silu(y, inplace=True) if silu else y


def upsample_nearest2x(x: torch.Tensor) -> torch.Tensor:
    """F.interpolate(x, scale_factor=2, mode="nearest") for x (N, C, H, W); channels_last in, channels_last out."""
    if _on_triton(x) and x.is_contiguous(memory_format=torch.channels_last) and x.numel() * 4 <= MAX_ELEMENTS:
        n, c, h, w = x.shape
        y = torch.empty((n, c, 2 * h, 2 * w), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
        if y.numel():
            rows = n * 4 * h * w
            _upsample2x[(triton.cdiv(rows, ROWS),)](x, y, rows, h, w, c, ROWS=ROWS, CHANNELS=CHANNELS)
        return y
    return F.interpolate(x, scale_factor=2, mode="nearest")


def upsample_nearest2x_backward(grad: torch.Tensor) -> torch.Tensor:
    """The gradient of upsample_nearest2x's input, from `grad` of its output (N, C, 2H, 2W); channels_last on Triton."""
    n, c, h2, w2 = grad.shape
    if _on_triton(grad) and h2 % 2 == 0 and w2 % 2 == 0:
        grad = grad.contiguous(memory_format=torch.channels_last)  # what the graph's backward hands over already
        out = torch.empty((n, c, h2 // 2, w2 // 2), dtype=grad.dtype, device=grad.device,
                          memory_format=torch.channels_last)
        if out.numel():
            rows = n * (h2 // 2) * (w2 // 2)
            _upsample2x_backward[(triton.cdiv(rows, ROWS),)](grad, out, rows, h2 // 2, w2 // 2, c, ROWS=ROWS,
                                                               CHANNELS=CHANNELS)
        return out
    return torch.ops.aten.upsample_nearest2d_backward(grad, [h2, w2], [n, c, h2 // 2, w2 // 2], 2.0, 2.0)


def is_nearest2x(module: torch.nn.Module) -> bool:
    """An nn.Upsample doubling height and width by nearest neighbour (Ultralytics' neck): what nearest2x computes."""
    if type(module) is not torch.nn.Upsample or module.mode != "nearest" or module.size is not None:
        return False
    scale = module.scale_factor
    scales = scale if isinstance(scale, (tuple, list)) else (scale,)
    return all(s is not None and float(s) == 2.0 for s in scales) and not module.recompute_scale_factor


class _Nearest2x(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return upsample_nearest2x(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return upsample_nearest2x_backward(grad)


def nearest2x(x: torch.Tensor) -> torch.Tensor:
    """F.interpolate(x, scale_factor=2, mode="nearest"), differentiable, on the kernels above."""
    return _Nearest2x.apply(x)


def warm_up(device: torch.device, dtype: torch.dtype, names: tuple[str, ...] = VALIDATION) -> None:
    """The kernels `names` (VALIDATION, TRAINING, SCANS) compiled (or loaded from Triton's cache) for `dtype` on
    channels_last tensors, as they are launched, without launching: no CUDA work, so it may run beside a graph capture
    on another thread."""
    if triton is None or device.type != "cuda" or dtype not in TRITON_DTYPES:
        return
    torch.cuda.set_device(device)  # Triton compiles for the thread's current device
    if "bias_act" in names:
        for silu in (True, False):
            _bias_act.warmup(dtype, dtype, 1, 1, 1, SILU=silu, CHANNELS_LAST=True, BLOCK=BLOCK, grid=(1,))
    if "upsample" in names:
        _upsample2x.warmup(dtype, dtype, 1, 1, 1, 1, ROWS=ROWS, CHANNELS=CHANNELS, grid=(1,))
    if "upsample_backward" in names:
        _upsample2x_backward.warmup(dtype, dtype, 1, 1, 1, 1, ROWS=ROWS, CHANNELS=CHANNELS, grid=(1,))
    if "scans" in names:
        from launcher.rank.validate import scans  # the validation's own module; its kernels are fp32 whatever `dtype`

        scans.warm_up(device)


class WarmUp:
    """`warm_up` on a thread of its own, started now; `join()` waits for it and returns how long it took, or the
    error it met (then the first launch compiles instead: nothing is lost but time)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, names: tuple[str, ...] = VALIDATION):
        self.seconds: float | None = None
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, args=(device, dtype, names), name="triton-warm-up",
                                       daemon=True)
        self.thread.start()

    def _run(self, device, dtype, names) -> None:
        started = time.perf_counter()
        try:
            warm_up(device, dtype, names)
        except Exception as e:  # noqa: BLE001 - reported by join()
            self.error = f"{type(e).__name__}: {e}"
        self.seconds = time.perf_counter() - started

    def join(self) -> WarmUp:
        self.thread.join()
        return self


if triton is not None:
    @triton.jit(do_not_specialize=["n", "C", "HW"])
    def _bias_act(y, bias, n, C, HW, SILU: tl.constexpr, CHANNELS_LAST: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        valid = offs < n
        if CHANNELS_LAST:
            c = offs % C
        else:
            c = (offs // HW) % C
        x = tl.load(y + offs, mask=valid).to(tl.float32) + tl.load(bias + c, mask=valid).to(tl.float32)
        if SILU:
            x = x * tl.sigmoid(x)
        tl.store(y + offs, x.to(y.dtype.element_ty), mask=valid)

    @triton.jit(do_not_specialize=["rows", "H", "W", "C"])
    def _upsample2x(x, y, rows, H, W, C, ROWS: tl.constexpr, CHANNELS: tl.constexpr):
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # output pixels, (n, oh, ow) flattened
        ow = r % (2 * W)
        t = r // (2 * W)
        oh = t % (2 * H)
        src = ((t // (2 * H)) * H + oh // 2) * W + ow // 2
        for c0 in range(0, C, CHANNELS):
            c = c0 + tl.arange(0, CHANNELS)
            valid = (r[:, None] < rows) & (c[None, :] < C)
            v = tl.load(x + src[:, None].to(tl.int64) * C + c[None, :], mask=valid)
            tl.store(y + r[:, None].to(tl.int64) * C + c[None, :], v, mask=valid)

    @triton.jit(do_not_specialize=["rows", "H", "W", "C"])
    def _upsample2x_backward(g, out, rows, H, W, C, ROWS: tl.constexpr, CHANNELS: tl.constexpr):
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # input pixels, (n, h, w) flattened
        w = r % W
        t = r // W  # n * H + h
        top = (2 * t * (2 * W) + 2 * w).to(tl.int64)  # the output pixel (n, 2h, 2w): row 2h of image n is 2t
        for c0 in range(0, C, CHANNELS):
            c = c0 + tl.arange(0, CHANNELS)
            valid = (r[:, None] < rows) & (c[None, :] < C)
            at = g + top[:, None] * C + c[None, :]
            acc = tl.load(at, mask=valid).to(tl.float32)  # PyTorch's order: (2h, 2w), (2h, 2w+1), (2h+1, 2w), ...
            acc += tl.load(at + C, mask=valid).to(tl.float32)
            acc += tl.load(at + 2 * W * C, mask=valid).to(tl.float32)
            acc += tl.load(at + 2 * W * C + C, mask=valid).to(tl.float32)
            tl.store(out + r[:, None].to(tl.int64) * C + c[None, :], acc.to(out.dtype.element_ty), mask=valid)

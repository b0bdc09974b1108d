"""Two kernels of the validation's folded forward (rank/ultralytics/folded.py): Triton on CUDA, PyTorch elsewhere.

- `bias_act_(y, bias, silu)`: a convolution's per-channel bias, then SiLU or nothing, in place, in one pass. Once
  BatchNorm is folded into a convolution, its bias is what is left of it; PyTorch adds a per-channel bias to a
  channels_last tensor with its generic broadcast kernel, which cost as much as the BatchNorm it replaced, and SiLU
  then takes a second pass (docs/benchmarks/h200-validation/README.md, the seventh session's profile).
- `upsample_nearest2x(x)`: nearest upsampling by 2 of a channels_last tensor (Ultralytics' nn.Upsample in the
  neck), a copy of each input pixel's channel row into four output rows; PyTorch's channels_last kernel is several
  times slower than such a copy (the same README).

Both compute what the PyTorch forms compute: bias and SiLU in fp32 on the stored values, rounded once to the tensor's
type; the upsampling copies values.

A process's first Triton kernel pays for Triton's own start (its driver, the hash of its sources behind every cache
key) and, on a machine that never ran it, the compilation; `warm_up` does all that without a launch, on a thread
during the first epoch (FastValidator.read_ahead, with the folded copy on), so that the first validation does not.
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
ROWS, CHANNELS = 64, 64  # output pixels x channels per program of upsample_nearest2x


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


def warm_up(device: torch.device, dtype: torch.dtype) -> None:
    """Both kernels compiled (or loaded from Triton's cache) for `dtype` on channels_last tensors, as the folded
    forward launches them, without launching: no CUDA work, so it may run beside a graph capture on another thread."""
    if triton is None or device.type != "cuda" or dtype not in TRITON_DTYPES:
        return
    torch.cuda.set_device(device)  # Triton compiles for the thread's current device
    for silu in (True, False):
        _bias_act.warmup(dtype, dtype, 1, 1, 1, SILU=silu, CHANNELS_LAST=True, BLOCK=BLOCK, grid=(1,))
    _upsample2x.warmup(dtype, dtype, 1, 1, 1, 1, ROWS=ROWS, CHANNELS=CHANNELS, grid=(1,))


class WarmUp:
    """`warm_up` on a thread of its own, started now; `join()` waits for it and returns how long it took, or the
    error it met (then the first launch compiles instead: nothing is lost but time)."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.seconds: float | None = None
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, args=(device, dtype), name="val-kernels-warm-up", daemon=True)
        self.thread.start()

    def _run(self, device, dtype) -> None:
        started = time.perf_counter()
        try:
            warm_up(device, dtype)
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

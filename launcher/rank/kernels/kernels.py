"""Triton kernels with PyTorch twins: Triton on CUDA, PyTorch elsewhere (and for what Triton does not take).

- `bias_act_(y, bias, silu)`: a convolution's per-channel bias, then SiLU or nothing, in place, in one pass: the
  validation's folded forward (rank/ultralytics/folded.py). Once BatchNorm is folded into a convolution, its bias is
  what is left of it; PyTorch adds a per-channel bias to a channels_last tensor with its generic broadcast kernel,
  which costs as much as the BatchNorm it replaced, and SiLU then takes a second pass
  (docs/benchmarks/h200-validation/README.md).
- `upsample_nearest2x(x)` and `upsample_nearest2x_backward(grad)`: nearest upsampling by 2 of a channels_last tensor
  (Ultralytics' nn.Upsample in the neck), a copy of each input pixel's channel row into four output rows, and its
  gradient, the sum of those four rows; `nearest2x` is the pair as one differentiable function, which the training
  step's CUDA graphs run (rank/step/triton_modules.py). PyTorch's channels_last kernels are several times slower: its
  forward, and its backward after a copy of the whole gradient to NCHW (docs/benchmarks/h200-step/README.md).
- `channel_cat(xs)` and `channel_split(x, c)`: torch.cat(xs, 1) and x.split((c, rest), 1) of tensors stored pixel by
  pixel (channels_last, or a channel slice of one), differentiable, each input's rows copied by one Triton program
  grid: Ultralytics' C2f, SPPF and Concat blocks in the training graphs (rank/ultralytics/blocks.py). PyTorch
  copies such a concatenation element by element with strided index arithmetic, and its backward hands out strided
  slices of the gradient that every consumer then copies or reads slowly (docs/benchmarks/h200-step/README.md); here
  the backward hands out packed channels_last gradients, and the split packs the half that a convolution reads.

Each computes what the PyTorch form computes: bias and SiLU in fp32 on the stored values, rounded once to the
tensor's type; the upsampling and the channel concatenation copy values; the upsampling's backward sums the four
rows in fp32 in PyTorch's order (row by row, left to right), rounded once.

A process's first Triton kernel pays for Triton's own start (its driver, the hash of its sources behind every cache
key) and, on a machine that never ran it, the compilation; `warm_up` does all that without a launch, on a thread
(`WarmUp`): during the set-up for the training step's kernels (rank/components.py), during the first epoch for the
folded validation's (FastValidator.read_ahead).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import torch
import torch.nn.functional as F

from launcher.rank.kernels.triton_use import runs_on

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
COPY_ROWS, COPY_CHANNELS = 128, 32  # pixels x channels per program of the channel concatenation's copy
TRAINING = ("upsample", "upsample_backward", "copy_rows")  # the training step's
SCANS = ("scans",)  # the validation's NMS and matching (rank/kernels/scans.py)


def _on_triton(t: torch.Tensor) -> bool:
    return triton is not None and runs_on(t.device) and t.dtype in TRITON_DTYPES and t.numel() <= MAX_ELEMENTS


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


def pixel_rows(x: torch.Tensor) -> int | None:
    """The row stride S when x (N, C, H, W) stores each pixel's C channels side by side and pixel p (n, h, w in that
    order) at p * S: a channels_last tensor (S = C), or a channel slice of one (S its whole width). Else None."""
    if x.dim() != 4:
        return None
    n, c, h, w = x.shape
    sn, sc, sh, sw = x.stride()
    row = sw if w > 1 else sh if h > 1 else sn if n > 1 else c
    fits = ((c == 1 or sc == 1) and (w == 1 or sw == row) and (h == 1 or sh == w * row)
            and (n == 1 or sn == h * w * row) and row >= c)
    return row if fits else None


def _rows_on_triton(x: torch.Tensor) -> bool:
    """What _copy_rows takes, in the one specialisation warm_up compiles: channels, row stride and address all
    multiples of 16 (every Ultralytics width is)."""
    row = pixel_rows(x)
    return (row is not None and _on_triton(x) and row % 16 == 0 and x.shape[1] % 16 == 0
            and x.data_ptr() % 16 == 0)


def _copy_rows(src: torch.Tensor, dst: torch.Tensor) -> None:
    """dst[...] = src for two (N, C, H, W) tensors that both pass _rows_on_triton."""
    n, c, h, w = src.shape
    rows = n * h * w
    if rows and c:
        grid = (triton.cdiv(rows, COPY_ROWS), triton.cdiv(c, COPY_CHANNELS))
        _copy_rows_kernel[grid](src, dst, rows, c, pixel_rows(src), pixel_rows(dst), ROWS=COPY_ROWS,
                                CHANNELS=COPY_CHANNELS)


def _channels_last_like(x: torch.Tensor, channels: int) -> torch.Tensor:
    n, _, h, w = x.shape
    return torch.empty((n, channels, h, w), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)


def cat_channels(xs: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """torch.cat(xs, 1); on Triton, channels_last out, when every input is stored pixel by pixel (pixel_rows)."""
    first = xs[0]
    same = all(x.dtype == first.dtype and x.device == first.device and x.dim() == 4
               and x.shape[0] == first.shape[0] and x.shape[2:] == first.shape[2:] for x in xs)
    if not (same and all(_rows_on_triton(x) for x in xs)):
        return torch.cat(xs, 1)
    out = _channels_last_like(first, sum(x.shape[1] for x in xs))
    at = 0
    for x in xs:
        _copy_rows(x, out[:, at:at + x.shape[1]])  # a channel slice of `out`: its address moves by `at` elements
        at += x.shape[1]
    return out


def split_channels(x: torch.Tensor, sizes: list[int], packed: list[bool]) -> tuple[torch.Tensor, ...]:
    """x.split(sizes, 1); a part with `packed` set is a channels_last copy where x is on Triton, else the view."""
    parts, at = [], 0
    for c, pack in zip(sizes, packed):
        part = x[:, at:at + c]
        if pack and _rows_on_triton(part):
            copy = _channels_last_like(x, c)
            _copy_rows(part, copy)
            part = copy
        parts.append(part)
        at += c
    return tuple(parts)


class _ChannelCat(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *xs: torch.Tensor) -> torch.Tensor:
        ctx.sizes = [x.shape[1] for x in xs]
        return cat_channels(xs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # packed parts: the convolutions' backward, SiLU's and the gradients' sums then read them at full speed (a part
        # no input needs stays an uncopied view, dropped below)
        parts = split_channels(grad, ctx.sizes, list(ctx.needs_input_grad))
        return tuple(p if need else None for p, need in zip(parts, ctx.needs_input_grad))


class _ChannelSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.shape, ctx.c = x.shape, c
        # the first part stays a view (only a concatenation reads it), the second is packed (a convolution reads it)
        return split_channels(x, [c, x.shape[1] - c], [False, True])

    @staticmethod
    def backward(ctx, head: torch.Tensor | None, tail: torch.Tensor | None) -> tuple[torch.Tensor | None, None]:
        n, channels, h, w = ctx.shape
        like = head if head is not None else tail
        zeros = lambda c: torch.zeros((n, c, h, w), dtype=like.dtype, device=like.device,  # noqa: E731
                                      memory_format=torch.channels_last)
        head = zeros(ctx.c) if head is None else head
        tail = zeros(channels - ctx.c) if tail is None else tail
        return cat_channels([head, tail]), None


def channel_cat(xs: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """torch.cat(xs, 1), differentiable; on Triton for tensors stored pixel by pixel (cat_channels)."""
    return _ChannelCat.apply(*xs)


def channel_split(x: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x.split((c, C - c), 1) for x (N, C, H, W), differentiable; the second part packed channels_last on Triton."""
    return _ChannelSplit.apply(x, c)


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
    """The kernels `names` (VALIDATION, TRAINING, "bn_act", SCANS) compiled (or loaded from Triton's cache) for `dtype` on
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
    if "copy_rows" in names:  # channels, row strides and addresses multiples of 16, as _rows_on_triton admits
        _copy_rows_kernel.warmup(dtype, dtype, 1, 16, 16, 16, ROWS=COPY_ROWS, CHANNELS=COPY_CHANNELS, grid=(1,))
    if "bn_act" in names:  # the training graphs' fused BatchNorm and SiLU (rank/kernels/batchnorm_silu.py)
        from launcher.rank.kernels import batchnorm_silu

        batchnorm_silu.warm_up(device, dtype)
    if "scans" in names:
        from launcher.rank.kernels import scans  # the validation's own module; its kernels are fp32 whatever `dtype`

        scans.warm_up(device)


class WarmUp:
    """`warm_up` (or `work`) on a thread of its own, started now; `join()` waits for it and returns how long it
    took, or the error it met (then the first launch compiles instead: nothing is lost but time)."""

    def __init__(self, device: torch.device | None = None, dtype: torch.dtype | None = None,
                 names: tuple[str, ...] = VALIDATION, *, work: Callable[[], None] | None = None):
        self.seconds: float | None = None
        self.error: str | None = None
        work = work or (lambda: warm_up(device, dtype, names))
        self.thread = threading.Thread(target=self._run, args=(work,), name="triton-warm-up", daemon=True)
        self.thread.start()

    def _run(self, work) -> None:
        started = time.perf_counter()
        try:
            work()
        except Exception as e:  # noqa: BLE001 - reported by join()
            self.error = f"{type(e).__name__}: {e}"
        self.seconds = time.perf_counter() - started

    def join(self) -> WarmUp:
        self.thread.join()
        return self

    def then(self, work: Callable[[], None]) -> WarmUp:
        """`work` on a thread once this warm-up has ended, whatever its outcome: one compilation at a time."""
        return WarmUp(work=lambda: (self.join(), work()))


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

    @triton.jit(do_not_specialize=["rows"])
    def _copy_rows_kernel(src, dst, rows, C, src_row, dst_row, ROWS: tl.constexpr, CHANNELS: tl.constexpr):
        # one block of pixels x channels per program, no loop: the compiler sees each row's channels start at a
        # multiple of 16 elements (the specialisation) and moves them in 16-byte vectors
        r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)  # pixels, (n, h, w) flattened
        c = tl.program_id(1) * CHANNELS + tl.arange(0, CHANNELS)
        valid = (r[:, None] < rows) & (c[None, :] < C)
        v = tl.load(src + r[:, None] * src_row + c[None, :], mask=valid)
        tl.store(dst + r[:, None] * dst_row + c[None, :], v, mask=valid)

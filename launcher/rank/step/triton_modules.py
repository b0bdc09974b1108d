"""The training graphs' Triton kernels: the modules that PyTorch runs slowly on channels_last tensors, swapped for
rank/kernels/kernels.py's forms while a graph is warmed up and captured.

- The neck's nearest 2x upsampling (`nearest2x`): PyTorch upsamples a channels_last tensor several times slower than
  the copy it is, and its backward first copies the whole gradient to NCHW.
- The channel concatenations of Ultralytics' C2f, SPPF and Concat blocks, and C2f's split
  (rank/ultralytics/blocks.py): PyTorch copies them element by element, and its backward hands strided slices of the
  gradient to the convolutions, which copy them again.
Both compute PyTorch's values, and the gradients bit for bit (docs/benchmarks/h200-step/README.md has what each
took off the step).
- Ultralytics' Conv blocks' training BatchNorm and SiLU (`bn_act`, rank/kernels/batchnorm_silu.py): one reduction
  and one elementwise pass each way, where cuDNN's BatchNorm and PyTorch's SiLU take five passes forward and eight
  backward. Its values are PyTorch's to float rounding (another order of summation), not bit for bit; it is on
  where the plan says (train.fused_bn_act).

A replay calls no Python, so every replay runs the Triton kernels, while the modules themselves stay PyTorch's and
Ultralytics' for everything else (an eager step, the EMA, the checkpoints, validation). The graph code captures on
the training thread; nothing else runs the training network meanwhile.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

from torch import nn

from launcher.rank.kernels.kernels import is_nearest2x, nearest2x
from launcher.rank.ultralytics.blocks import concatenating_forwards, conv_forwards

COPIES = ("upsample", "concat")  # the parts that give PyTorch's values bit for bit
PARTS = (*COPIES, "bn_act")


@contextmanager
def triton_modules(net: nn.Module, enabled: bool = True, parts: tuple[str, ...] = PARTS) -> Iterator[int]:
    """Within it, `net`'s nearest 2x upsampling modules run `nearest2x` ("upsample"), its channel-concatenating
    blocks the Triton copies ("concat") and its Conv blocks the fused BatchNorm and SiLU ("bn_act"); yields how many
    modules were swapped."""
    swaps = []
    if enabled and "upsample" in parts:
        swaps += [(m, nearest2x) for m in net.modules() if is_nearest2x(m)]
    if enabled and "concat" in parts:
        swaps += [(m, partial(forward, m)) for m, forward in concatenating_forwards(net)]
    if enabled and "bn_act" in parts:
        swaps += [(m, partial(forward, m)) for m, forward in conv_forwards(net)]
    for m, forward in swaps:
        m.forward = forward  # an instance attribute, over the class's forward
    try:
        yield len(swaps)
    finally:
        for m, _ in swaps:
            del m.forward

"""The neck's nearest 2x upsampling on Triton kernels inside the training step's CUDA graphs.

PyTorch upsamples a channels_last tensor several times slower than the copy it is, and its backward first copies the
whole gradient to NCHW: on the H200 the Triton kernels took 2.4 ms off a 46 ms yolov8s step
(docs/benchmarks/h200-step/README.md). rank/kernels.py's `nearest2x` computes the same values with a copy forward and
a four-row sum backward.

The modules' forward is swapped only while a graph is warmed up and captured (`triton_upsampling`): a replay calls no
Python, so every replay runs the Triton kernels, while the modules themselves stay PyTorch's for everything else (an
eager step, the EMA, the checkpoints, validation). The graph code captures on the training thread; nothing else runs
the training network meanwhile.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from launcher.rank.kernels import is_nearest2x, nearest2x


@contextmanager
def triton_upsampling(net: nn.Module, enabled: bool = True) -> Iterator[int]:
    """Within it, `net`'s nearest 2x upsampling modules run `nearest2x`; yields how many were swapped."""
    swapped = [m for m in net.modules() if is_nearest2x(m)] if enabled else []
    for m in swapped:
        m.forward = nearest2x  # an instance attribute, over the class's forward
    try:
        yield len(swapped)
    finally:
        for m in swapped:
            del m.forward

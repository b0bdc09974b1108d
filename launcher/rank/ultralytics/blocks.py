"""Ultralytics' channel-concatenating blocks (C2f and the blocks that keep its forward, SPPF, Concat) re-stated on
rank/kernels/kernels.py's `channel_cat` and `channel_split`: the same operations in the same order, each concatenation
and C2f's split done by Triton copies that leave packed channels_last tensors behind (docs/benchmarks/h200-step/).
Its Conv block (and the blocks that keep its forward) re-stated with training BatchNorm and SiLU as one function,
rank/kernels/batchnorm_silu.py's `bn_silu`.

The training graphs run them (rank/step/triton_modules.py swaps the forwards in while a graph is captured), so the
modules themselves, the EMA and the checkpoints stay Ultralytics'. A subclass that overrides one of these forwards is
left alone: only a forward known to be the one re-stated here is swapped.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from ultralytics.nn.modules.block import C2f, SPPF
from ultralytics.nn.modules.conv import Concat, Conv

from launcher.rank.kernels.batchnorm_silu import bn_silu
from launcher.rank.kernels.kernels import channel_cat, channel_split


def c2f(m: C2f, x: torch.Tensor) -> torch.Tensor:
    """C2f.forward: cv1's output split in two halves, each bottleneck on the last part, all parts concatenated."""
    y = list(channel_split(m.cv1(x), m.c))
    y.extend(block(y[-1]) for block in m.m)
    return m.cv2(channel_cat(y))


def sppf(m: SPPF, x: torch.Tensor) -> torch.Tensor:
    """SPPF.forward: cv1, then the max pool three times (or `n`), the four concatenated into cv2."""
    y = [m.cv1(x)]
    y.extend(m.m(y[-1]) for _ in range(getattr(m, "n", 3)))
    y = m.cv2(channel_cat(y))
    return y + x if getattr(m, "add", False) else y


def concat(m: Concat, x: list[torch.Tensor]) -> torch.Tensor:
    """Concat.forward along the channels."""
    return channel_cat(x)


def concatenating_forwards(net: nn.Module) -> list[tuple[nn.Module, Callable]]:
    """(module, its forward on the Triton copies) for each block of `net` whose forward is re-stated above."""
    found = []
    for m in net.modules():
        forward = type(m).forward
        if forward is C2f.forward:
            found.append((m, c2f))
        elif forward is SPPF.forward:
            found.append((m, sppf))
        elif forward is Concat.forward and m.d == 1:
            found.append((m, concat))
    return found


def conv_bn_act(m: Conv, x: torch.Tensor) -> torch.Tensor:
    """Conv.forward, act(bn(conv(x))), BatchNorm and the activation as one function in training (the BatchNorm
    counting its batch as torch.nn.BatchNorm2d does); in eval mode Ultralytics' own."""
    bn = m.bn
    if not bn.training:
        return m.act(bn(m.conv(x)))
    bn.num_batches_tracked.add_(1)
    return bn_silu(m.conv(x), bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.momentum, bn.eps, True,
                   type(m.act) is nn.SiLU)


def fusable_conv(m: nn.Module) -> bool:
    """A block whose forward is Conv's, with a plain BatchNorm2d (not SyncBatchNorm: its statistics are the ranks')
    that is affine, tracks running statistics with a momentum, and SiLU or no activation after it."""
    if type(m).forward is not Conv.forward or "forward" in m.__dict__:
        return False
    bn, act = getattr(m, "bn", None), getattr(m, "act", None)
    return (type(bn) is nn.BatchNorm2d and bn.affine and bn.track_running_stats and bn.momentum is not None
            and type(act) in (nn.SiLU, nn.Identity))


def conv_forwards(net: nn.Module) -> list[tuple[nn.Module, Callable]]:
    """(module, conv_bn_act) for each block of `net` that `fusable_conv` admits."""
    return [(m, conv_bn_act) for m in net.modules() if fusable_conv(m)]

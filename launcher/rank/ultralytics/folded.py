"""The fast validator's inference copy of the detector, BatchNorm folded into the convolutions, in the validation's
dtype: `val.fold_batchnorm=true` (`FastValidator(folded=True)`). Off by default: its forward is faster, but when
last measured the validation pass was not (it was bound by the post-processing, since moved to Triton, and the first
validation pays for the copy: docs/benchmarks/h200-validation/README.md).

Ultralytics' standalone validator folds each Conv's BatchNorm into its convolution (BaseModel.fuse); its validation
during training runs the EMA as it is. Folding removes a pass over every activation, but only pays with the
convolution's bias and SiLU applied in one pass after it, and with the neck's upsampling as a plain copy
(rank/kernels/kernels.py says why). So the copy's
  - Conv and DWConv modules compute `bias_act_(conv(x) without its bias, folded bias, SiLU or nothing)` (any other
    activation: Ultralytics' forward_fuse, the bias in the convolution);
  - other convolutions with a bias (the Detect head's last layers) add it the same way;
  - nn.Upsample modules of nearest mode and scale 2 run `upsample_nearest2x`;
and everything else is the EMA's, copied. `refresh()` recomputes it all from the EMA in place before each
validation (the EMA moves at every step; best.pt's weights are loaded into it), so a captured CUDA graph of the
copy's forward stays valid. The copy's forwards are bound to its instances: it is never saved (the checkpoints hold
the EMA).

Reaches into Ultralytics: Conv / DWConv's `conv`, `bn` and `act`, as BaseModel.fuse folds them (Conv2, RepConv and
the other fusable modules are left as they are: correct, not faster).
"""

from __future__ import annotations

import types
from copy import deepcopy

import torch
from torch import nn
from ultralytics.nn.modules import Conv, DWConv

from launcher.rank.kernels.kernels import bias_act_, is_nearest2x, upsample_nearest2x

FOLDED = (Conv, DWConv)  # modules whose forward is act(bn(conv(x))); exact types (subclasses may differ)
ACTIVATIONS = {nn.SiLU: True, nn.Identity: False}  # what bias_act_ applies: SiLU, or nothing


def folded_weights(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight and bias of one convolution computing bn(conv(x)) in eval mode, in fp32."""
    scale = bn.weight.float() * torch.rsqrt(bn.running_var.float() + bn.eps)
    weight = conv.weight.float() * scale.view(-1, *([1] * (conv.weight.dim() - 1)))
    shift = bn.bias.float() - bn.running_mean.float() * scale
    if conv.bias is not None:
        shift = shift + conv.bias.float() * scale
    return weight, shift


def _folded_forward(self, x):
    return bias_act_(self.conv._conv_forward(x, self.conv.weight, None), self.conv.bias, self.silu)


def _biased_conv_forward(self, x):
    return bias_act_(self._conv_forward(x, self.weight, None), self.bias, False)


class FoldedCopy:
    """`FoldedCopy(ema_model, dtype)`: `.model` the copy in `dtype` (eval mode), `.refresh()` from the EMA in place.
    `folded`: how many BatchNorms were folded."""

    def __init__(self, source: nn.Module, dtype: torch.dtype):
        self.source, self.dtype = source, dtype
        copy = deepcopy(source).eval()
        self._folds: list[tuple[nn.Conv2d, nn.BatchNorm2d, nn.Conv2d]] = []  # the EMA's conv, bn -> the copy's conv
        folded_names = set()
        sources = dict(source.named_modules())
        for name, m in list(copy.named_modules()):  # the modules as built: the replaced ones are not visited
            if (type(m) in FOLDED and type(getattr(m, "bn", None)) is nn.BatchNorm2d and type(m.conv) is nn.Conv2d
                    and m.conv.padding_mode == "zeros"):
                conv = nn.Conv2d(m.conv.in_channels, m.conv.out_channels, m.conv.kernel_size, m.conv.stride,
                                 m.conv.padding, m.conv.dilation, m.conv.groups, bias=True,
                                 device=m.conv.weight.device).requires_grad_(False)
                src = sources[name]
                self._folds.append((src.conv, src.bn, conv))
                m.conv = conv
                del m.bn
                folded_names.add(name)
                silu = ACTIVATIONS.get(type(m.act))
                if silu is None:
                    m.forward = m.forward_fuse
                else:
                    m.silu = silu
                    m.forward = types.MethodType(_folded_forward, m)
            elif type(m) is nn.Conv2d and m.bias is not None and m.padding_mode == "zeros":
                m.forward = types.MethodType(_biased_conv_forward, m)
            elif is_nearest2x(m):
                m.forward = upsample_nearest2x  # a function of x alone: nothing to bind
        self.model = copy.to(dtype).requires_grad_(False)
        folded_keys = {f"{n}.{k}" for n in folded_names for k in ("conv.weight", "conv.bias")}
        mine, theirs = self.model.state_dict(keep_vars=True), source.state_dict(keep_vars=True)
        self._copied = [(mine[k], theirs[k]) for k in mine if k not in folded_keys]
        self.refresh()

    @property
    def folded(self) -> int:
        return len(self._folds)

    @torch.no_grad()
    def refresh(self) -> None:
        """The copy's weights from the EMA's, in place; also its `end2end` switch (set per validation)."""
        for conv, bn, target in self._folds:
            weight, bias = folded_weights(conv, bn)
            target.weight.copy_(weight)
            target.bias.copy_(bias)
        for mine, theirs in self._copied:
            mine.copy_(theirs)
        if hasattr(self.source, "end2end"):
            self.model.end2end = self.source.end2end

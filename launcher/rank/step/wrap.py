"""What the step calls: the bare network, CUDA-graphed or compiled, inside DDP or DataParallel.

**CUDA graphs** (`train.cuda_graphs`, graphed.py) are captured before DDP wraps the network, as torch requires.
**torch.compile** (`train.compile`) wraps DDP, as torch recommends: Dynamo splits the graph at DDP's buckets, so each
bucket's all-reduce still overlaps the rest of the backward pass. Only the network is compiled: the loss has
data-dependent shapes (target assignment) and stays eager, like validation, which runs on the EMA copy. Shapes are
static (`dynamic=False`): a short last batch compiles once more, every full batch keeps the specialised kernels.
**DDP** runs without find_unused_parameters, with gradients in the all-reduce buckets, and BatchNorm buffers kept per
rank unless dist.broadcast_buffers. The measured effect of each is in docs/benchmarks/README.md, section 3.
"""

from __future__ import annotations

import torch
from torch import nn

# torch 2.13 renamed DDP's broadcast_buffers to forward_sync_buffers (the old name warns there; older torch knows only it)
_TORCH_2_13 = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)
BUFFER_SYNC_KWARG = "forward_sync_buffers" if _TORCH_2_13 else "broadcast_buffers"


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside compile (`_orig_mod`), DDP and DataParallel (`module`) wrappers."""
    while True:
        if isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        elif isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        else:
            return model


def compile_mode(value) -> str | None:
    """train.compile as a torch.compile mode (None: off); the plan has checked the value."""
    if value is False or value is None:
        return None
    return "default" if value is True else str(value)


def compiled(model: nn.Module, value) -> nn.Module:
    """`model` compiled as train.compile asks (the module itself when it is off). Compilation is lazy: the first
    steps are slow, which ddp-bench's warm-up steps absorb."""
    mode = compile_mode(value)
    if mode is None:
        return model
    import torch._inductor.config as inductor_config  # what use_deterministic_algorithms tells it (build.seed)

    inductor_config.deterministic = torch.are_deterministic_algorithms_enabled()
    return torch.compile(model, mode=mode, dynamic=False)


def wrap(net: nn.Module, *, mode: str, device: torch.device, devices_per_rank: int, dist, compile_setting,
         graphed: nn.Module | None = None) -> nn.Module:
    """The module the step calls. `dist`: the DistSettings (DDP's switches); `graphed` is `net` with its step captured
    as CUDA graphs, when the plan asks."""
    model = graphed if graphed is not None else net
    if mode == "ddp":
        model = nn.parallel.DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            find_unused_parameters=bool(dist.find_unused_parameters),
            gradient_as_bucket_view=True,  # gradients live in the all-reduce buckets: no copy in, no copy out
            **{BUFFER_SYNC_KWARG: bool(dist.broadcast_buffers)},
        )
        return compiled(model, compile_setting)
    if mode == "dp":
        # One process drives every GPU of the node: images are scattered, predictions gathered on cuda:0.
        devices = list(range(devices_per_rank)) if device.type == "cuda" else None
        return nn.DataParallel(model, device_ids=devices)
    return compiled(model, compile_setting)

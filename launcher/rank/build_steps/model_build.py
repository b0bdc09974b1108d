"""The network and what trains it, built by the same functions for the run (components.Rank's steps 3 and 5) and for
train.batch_per_device=auto's probe (batch_probe.py), so that the batch measured is the batch the run can take.

- `network`: the network from model.cfg and/or model.weights, `before_device` applied to the bare one (the run loads
  its resume state there), then on the device;
- `optimizer`: optim.name over the network's parameter groups, fused where optim.fused allows it;
- `resumable_network`: the run's network, with the resume state of the run folder's last.pt;
- `scaler`: the fp16 gradient scaler (off in bf16 and fp32);
- `ema_and_loss`: the EMA copy (it carries the class weights set before it), then the training loss (the EMA keeps
  Ultralytics' own, which validation uses, collective-free).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from launcher.rank.loop import checkpoint_io
from launcher.rank.loop.state import upgrade
from launcher.rank.step.optimizer import fused_optimizer
from launcher.rank.ultralytics import build
from launcher.rank.ultralytics.task_loss import training_criterion


def network(hyp, data: dict, weights: str | None, device: torch.device,
            before_device: Callable[[nn.Module], None] | None = None) -> tuple[nn.Module, object]:
    """(network on `device`, its frozen layers): channels_last unless the hyperparameters turn it off."""
    net, frozen = build.network(hyp, data, weights)
    if before_device is not None:
        before_device(net)
    return on_device(net, device, hyp), frozen


def on_device(net: nn.Module, device: torch.device, hyp) -> nn.Module:
    """`net` on `device`, channels_last unless the hyperparameters turn it off: Ultralytics' CUDA default (fast
    convolutions), and on the CPU oneDNN's faster one too (docs/benchmarks section 21)."""
    net = net.to(device)
    if hyp.channels_last is not False:
        net = net.to(memory_format=torch.channels_last)
    return net


def optimizer(net: nn.Module, optim, lr: float, fused, device: torch.device) -> torch.optim.Optimizer:
    """optim.name over `net`'s parameter groups at `lr` (`optim`: the optim settings), fused as the plan decided."""
    return fused_optimizer(build.optimizer(net, str(optim.name), lr, optim.momentum, optim.weight_decay), fused, device)


def scaler(amp_dtype: torch.dtype | None) -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cuda", enabled=amp_dtype == torch.float16)


def ema_and_loss(net: nn.Module, sync_free: bool, log=None):
    """The EMA copy first, then net.criterion set to the training loss (sync-free as train.sync_free_loss says);
    said through `log` when that loss is Ultralytics' own, normalised per rank (task_loss.training_criterion)."""
    ema = build.ema(net)
    net.criterion, over_ranks = training_criterion(net, sync_free=sync_free)
    if not over_ranks and log is not None:
        log(f"WARNING: {type(net.criterion).__name__}: Ultralytics' own loss, normalised per rank and not sync-free "
            "(over the ranks: the YOLOv8/YOLO11 detection, segmentation, pose and obb losses, YOLO26's detection "
            "loss, and the classification loss)")
    return ema


def resumable_network(hyp, data: dict, weights: str | None, folder, device: torch.device, *, sync_bn: bool,
                      log) -> tuple[nn.Module, object, dict | None, str | None]:
    """(network, frozen layers, resume checkpoint or None, where it came from): the run's network with the resume
    state of the run folder's last.pt loaded into the bare network in fp32 (training continues exactly), before
    anything copies it; then on the device, with SyncBatchNorm when `sync_bn` (dist.sync_bn under DDP)."""
    checkpoint_io.remove_stale_temporaries(folder.weights)  # left by a writer that was SIGKILLed
    found = {}

    def load_resume(net: nn.Module) -> None:
        expected = net.state_dict()
        found["ckpt"], found["source"] = checkpoint_io.load_resumable(
            folder.weights / "last.pt", log=log,
            fits=lambda ckpt: checkpoint_io.mismatch(expected, resume_part(ckpt, "model")))
        if found["ckpt"] is not None:
            net.load_state_dict(resume_part(found["ckpt"], "model"))

    net, frozen = network(hyp, data, weights, device, before_device=load_resume)
    if sync_bn:
        net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    return net, frozen, found["ckpt"], found["source"]


def resume_part(ckpt: dict, name: str):
    """A component's saved state in a checkpoint of any layout this project wrote (None when absent)."""
    return upgrade(ckpt).get(name)

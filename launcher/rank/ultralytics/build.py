"""Ultralytics' pieces a rank trains with: hyperparameters, the dataset description, the network, its EMA and the
optimizer's parameter groups, built through Ultralytics' own classes and rules."""

from __future__ import annotations

import os
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn
from ultralytics.cfg import get_cfg
from ultralytics.data.utils import check_det_dataset
from ultralytics.models.yolo.detect import DetectionTrainer, DetectionValidator
from ultralytics.nn.tasks import DetectionModel, load_checkpoint
from ultralytics.utils import YAML
from ultralytics.utils.checks import check_imgsz
from ultralytics.utils.torch_utils import ModelEMA

from launcher.plan.plan import LaunchPlan
from launcher.plan.settings import Settings
from launcher.plan.task_rules import rules
from launcher.rank.ultralytics.tasks import task_of

OPTIMIZERS = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}
ALWAYS_FROZEN = (".dfl",)  # Ultralytics always freezes the DFL projection


def hyperparameters(settings: Settings, plan: LaunchPlan, run_dir: Path, local_rank: int):
    """Ultralytics' training arguments for this run (what `yolo train` would be given), validated by get_cfg."""
    train, optim, model = settings.train, settings.optim, settings.model
    args = {
        "model": model.cfg or model.weights,
        "task": plan.task,  # the dataset's polygons or keypoints, the validator's, the checkpoint's (tasks.py)
        "pretrained": model.weights or False,
        "data": str(settings.data.path),
        "epochs": train.epochs,
        "imgsz": train.imgsz,
        **({} if plan.batch_pending else batch_args(plan)),  # auto: Ultralytics' defaults until set_batch
        "device": "cpu" if plan.device == "cpu" else str(local_rank),
        "workers": plan.workers_per_rank,
        "optimizer": {"sgd": "SGD", "adamw": "AdamW"}[str(optim.name).lower()],
        "lrf": optim.lrf,
        "momentum": optim.momentum,
        "weight_decay": optim.weight_decay,
        "warmup_momentum": optim.warmup_momentum,
        "warmup_bias_lr": optim.warmup_bias_lr,
        "cos_lr": optim.cos_lr,
        "amp": plan.amp,
        "cache": False if train.cache == "shared" else train.cache,  # shared: ddp-launch's node cache
        "close_mosaic": train.close_mosaic,
        "patience": train.patience,
        "save_period": train.save_period,
        "seed": settings.seed,
        "save_dir": str(run_dir),
        "exist_ok": True,
        "val": True,
        "plots": False,
        "verbose": True,
        **(train.extra or {}),
    }
    return get_cfg(overrides=args)


def batch_args(plan: LaunchPlan) -> dict:
    """The training arguments that follow the batch."""
    return {
        "batch": plan.global_batch,
        "nbs": plan.global_batch,  # Ultralytics' accumulation and weight-decay rescaling off: plan/lr.py
        "lr0": plan.lr0,
        "warmup_epochs": plan.warmup_epochs or 0.0,
    }


def set_batch(hyp, plan: LaunchPlan) -> None:
    """The batch train.batch_per_device=auto chose, in the arguments the network and its loss already hold."""
    for key, value in batch_args(plan).items():
        setattr(hyp, key, value)


def seed(hyp, rank: int, world_size: int) -> None:
    """Ultralytics' seeds and deterministic switches, as its trainer sets them (init_seeds(seed + 1 + RANK), RANK -1
    in a single process), re-stated: init_seeds switches through torch.use_deterministic_algorithms, which imports
    torch._inductor's config to pass the switch on to torch.compile, 1-2 s of the rank's start-up for a module only
    train.compile uses (step/wrap.py passes it on there)."""
    value = hyp.seed + 1 + (rank if world_size > 1 else -1)
    random.seed(value)
    np.random.seed(value)
    torch.manual_seed(value)  # every device's generator too
    on = bool(hyp.deterministic)
    torch._C._set_deterministic_algorithms(on, warn_only=on)  # use_deterministic_algorithms(on, warn_only=on)
    torch.backends.cudnn.deterministic = on
    torch.utils.deterministic.fill_uninitialized_memory = not on  # Ultralytics skips the fill of every new tensor
    for key, setting in (("CUBLAS_WORKSPACE_CONFIG", ":4096:8"), ("PYTHONHASHSEED", str(value))):
        if on:
            os.environ[key] = setting
        else:
            os.environ.pop(key, None)


def save_args(hyp, run_dir: Path) -> None:
    """args.yaml in the run folder, as Ultralytics' trainer writes it."""
    YAML.save(Path(run_dir) / "args.yaml", vars(hyp))


def dataset_info(hyp) -> dict:
    """The data YAML as Ultralytics reads it (names, nc, channels, split paths). The launcher wrote it with absolute
    paths and no download script, so nothing is fetched. A classification run's names its class folders
    (inputs/class_folders.py): its classes are the ones the launcher read, check_cls_dataset's."""
    if not rules(hyp.task).folders:
        return check_det_dataset(hyp.data)
    data = YAML.load(hyp.data)
    names = {int(k): str(v) for k, v in data["names"].items()}
    return {**data, "names": names, "nc": len(names), "channels": int(data.get("channels", 3))}


def network(hyp, data: dict, weights: str | None) -> tuple[DetectionModel, list[str]]:
    """The network of hyp.task to train (a DetectionModel or its segmentation, pose or obb subclass: tasks.py), from
    model.cfg (random init) and/or model.weights, with Ultralytics' model attributes, the imgsz checked against its
    stride, and its frozen layers. Returns (model, frozen name parts)."""
    start = load_checkpoint(weights)[0] if weights else None
    arch = hyp.model if str(hyp.model).endswith((".yaml", ".yml")) else start.yaml
    model = task_of(hyp.task).network(arch, data, dropout=hyp.dropout)
    if hyp.cls_remap and data.get("names"):
        model.names = data["names"]  # a pretrained class head is remapped by class name (set_model_names_for_load)
    if start is not None:
        model.load(start)  # logs "Transferred N/M items from pretrained weights" on rank 0
    model.nc, model.names, model.args = data["nc"], data["names"], hyp
    stride = max(int(model.stride.max()), 32)
    hyp.imgsz = check_imgsz(hyp.imgsz, stride=stride, floor=stride, max_dim=1)
    freeze = hyp.freeze if isinstance(hyp.freeze, list) else range(hyp.freeze) if isinstance(hyp.freeze, int) else []
    frozen = [f"model.{x}." for x in freeze] + list(ALWAYS_FROZEN)
    for name, p in model.named_parameters():
        p.requires_grad = not any(part in name for part in frozen) and p.dtype.is_floating_point
    return model, frozen


def train_mode(net: nn.Module, frozen: list[str]) -> None:
    """Training mode, with the BatchNorm statistics of frozen layers kept as they are (Ultralytics' _model_train)."""
    net.train()
    for name, m in net.named_modules():
        if any(part in name for part in frozen) and isinstance(m, nn.BatchNorm2d):
            m.eval()


def ema(net: nn.Module) -> ModelEMA:
    return ModelEMA(net)


def class_weights(net: nn.Module, hyp, labels: list[dict] | None, nc: int) -> None:
    """Ultralytics' inverse-frequency class weights (cls_pw > 0), set on the network before its loss is built; none
    without box labels (`labels` None: a classifier's cross-entropy takes none, as Ultralytics')."""
    if not 0 <= hyp.cls_pw <= 1:
        raise ValueError(f"train.extra.cls_pw={hyp.cls_pw}: must be in [0, 1]")
    if hyp.cls_pw == 0 or labels is None:
        return
    classes = np.concatenate([lb["cls"].flatten() for lb in labels], 0).astype(int)
    counts = np.bincount(classes, minlength=nc).astype(np.float32)
    if not counts.any():
        return
    # Ultralytics' own rule, on a stand-in trainer: it moves between releases (classes without labels get the mean
    # weight from 8.4.175, weight 1 before)
    weights = DetectionTrainer.compute_class_weights(SimpleNamespace(args=hyp), counts)
    net.class_weights = torch.from_numpy(weights / weights.mean()).to(next(net.parameters()).device)


def align_max_det(net: nn.Module, hyp, train_dataset, val_dataset) -> None:
    """Ultralytics raises the default max_det to the most objects an image of the data holds, so validation does
    not cap recall (DetectionValidator._check_max_det; DetectionTrainer does the same). A classifier has none."""
    if rules(hyp.task).folders:
        return
    DetectionValidator._check_max_det(hyp, {"train": train_dataset, "val": val_dataset})
    net.set_head_attr(max_det=hyp.max_det)


def optimizer(net: nn.Module, name: str, lr: float, momentum: float, weight_decay: float) -> torch.optim.Optimizer:
    """Ultralytics' three parameter groups (BaseTrainer.build_optimizer): weights with decay, normalisation weights
    and biases without; SGD with Nesterov momentum, or AdamW with betas (momentum, 0.999)."""
    norms = tuple(v for k, v in nn.__dict__.items() if "Norm" in k)
    weights, norm_weights, biases = [], [], []
    for module_name, module in net.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            if "bias" in full:
                biases.append(param)
            elif isinstance(module, norms) or "logit_scale" in full:
                norm_weights.append(param)
            else:
                weights.append(param)
    kind = OPTIMIZERS[name.lower()]
    common = {"lr": lr, "betas": (momentum, 0.999)} if kind is torch.optim.AdamW else {"lr": lr, "momentum": momentum, "nesterov": True}
    groups = [
        {"params": weights, **common, "weight_decay": weight_decay, "param_group": "weight"},
        {"params": norm_weights, **common, "weight_decay": 0.0, "param_group": "bn"},
        {"params": biases, **common, "weight_decay": 0.0, "param_group": "bias"},
    ]
    return kind(groups, **common)

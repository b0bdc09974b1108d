"""Ultralytics' checkpoint layout, so that `YOLO("best.pt")` and `yolo val model=last.pt` load what ddp-launch writes.

BaseTrainer.save_model's keys: the EMA in fp16 (NaN and inf zeroed, contiguous), the optimizer in fp16, the training
arguments, the last metrics and results.csv as columns. ddp-launch adds its exact resume state beside them
(rank/state.py); strip() removes it, and the optimizer, once the run has finished, as Ultralytics' final_eval does.
"""

from __future__ import annotations

from copy import deepcopy
from datetime import datetime
from pathlib import Path

import torch
from ultralytics import __version__ as ULTRALYTICS_VERSION
from ultralytics.utils.torch_utils import convert_optimizer_state_dict_to_fp16, strip_optimizer

from launcher.rank.checkpoint_io import RESUME_KEY


def layout(*, ema, optimizer, scaler, hyp, epoch: int, best_fitness, fitness, early_stop: dict, metrics: dict,
           results: dict) -> dict:
    """Ultralytics' keys of a checkpoint taken after `epoch` (0-based, Ultralytics' convention)."""
    snapshot = deepcopy(ema.ema).half().to(memory_format=torch.contiguous_format)  # NCHW, as Ultralytics saves
    if hasattr(snapshot, "criterion"):
        snapshot.criterion = None
    for v in snapshot.state_dict().values():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            torch.nan_to_num_(v)
    return {
        "epoch": epoch,
        "best_fitness": best_fitness,
        "stopper": early_stop,
        "model": None,
        "ema": snapshot,
        "updates": ema.updates,
        "optimizer": convert_optimizer_state_dict_to_fp16(deepcopy(optimizer.state_dict())),
        "scaler": scaler.state_dict(),
        "train_args": vars(hyp),
        "train_metrics": {**metrics, "fitness": fitness},
        "train_results": results,
        "date": datetime.now().astimezone().isoformat(),
        "version": ULTRALYTICS_VERSION,
        "license": "AGPL-3.0 (https://ultralytics.com/license)",
    }


def strip(path: Path) -> None:
    """The final weights: EMA as the model, no optimizer, no resume state."""
    strip_optimizer(path, updates={RESUME_KEY: None})


def ema_weights(ckpt: dict) -> dict:
    """The full-precision state dict of a checkpoint's EMA (to validate best.pt at the end of a run)."""
    return ckpt["ema"].float().state_dict()

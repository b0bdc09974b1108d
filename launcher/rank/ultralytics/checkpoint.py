"""Ultralytics' checkpoint layout, so that `YOLO("best.pt")` and `yolo val model=last.pt` load what ddp-launch writes.

BaseTrainer.save_model's keys: the EMA in fp16 (NaN and inf zeroed, contiguous), the optimizer in fp16, the training
arguments, the last metrics and results.csv as columns. ddp-launch adds its exact resume state beside them
(rank/loop/state.py); strip() removes it, and the optimizer, once the run has finished, as Ultralytics' final_eval does.
stripped() makes the same final weights from a checkpoint still in memory (the last epoch's), so that the end of a
run writes them once instead of writing the whole checkpoint, reading it back and writing it again.
"""

from __future__ import annotations

from copy import deepcopy
from datetime import datetime
from pathlib import Path

import torch
from ultralytics import __version__ as ULTRALYTICS_VERSION
from ultralytics.utils import DEFAULT_CFG_DICT, DEFAULT_CFG_KEYS
from ultralytics.utils.torch_utils import convert_optimizer_state_dict_to_fp16, strip_optimizer

from launcher.rank.loop.checkpoint_io import RESUME_KEY
from launcher.rank.ultralytics import releases


class Layout:
    """Ultralytics' keys of a checkpoint, in two halves so that the training thread pays only for the small ones.

    `keys(...)` at the save: the epoch, fitness, metrics, results, scaler and arguments. `complete(checkpoint)` in
    the checkpointer's writer thread: the fp16 EMA model and the fp16 optimizer, made from the resume state's host
    copies (its "ema" and "optimizer" parts) instead of from the live ones: Ultralytics' deepcopy of the EMA module
    at every save took a quarter of a second of the epoch boundary. The EMA module is copied once, at the first
    save, with its weights left out (they are filled from the copies each time), and kept on the host.
    """

    def __init__(self, ema, hyp):
        self.ema, self.hyp = ema, hyp
        self._model: torch.nn.Module | None = None  # the EMA's host copy; one write at a time refills it

    def keys(self, *, scaler, epoch: int, best_fitness, fitness, early_stop: dict, metrics: dict,
             results: dict) -> dict:
        """The checkpoint's keys taken after `epoch` (0-based, Ultralytics' convention), but the model's."""
        if self._model is None:
            self._model = _host_model(self.ema.ema)
        return {
            "epoch": epoch,
            "best_fitness": best_fitness,
            "stopper": early_stop,
            "model": None,
            "ema": None,  # complete()
            "updates": self.ema.updates,
            "optimizer": None,  # complete()
            "scaler": scaler.state_dict(),
            "train_args": vars(self.hyp),
            "train_metrics": {**metrics, "fitness": fitness},
            "train_results": results,
            "date": datetime.now().astimezone().isoformat(),
            "version": ULTRALYTICS_VERSION,
            "license": "AGPL-3.0 (https://ultralytics.com/license)",
        }

    def complete(self, checkpoint: dict) -> dict:
        """`checkpoint` (host copies) with Ultralytics' EMA model (fp16, NaN and inf zeroed) and fp16 optimizer."""
        resume = checkpoint[RESUME_KEY]
        model = self._model
        with torch.no_grad():
            for name, v in model.state_dict().items():
                v.copy_(resume["ema"]["weights"][name])
                if v.is_floating_point():
                    torch.nan_to_num_(v)
        optimizer = resume["optimizer"]  # its tensors are shared with the resume state: converted copies, not in place
        optimizer = {**optimizer, "state": {k: dict(v) for k, v in optimizer["state"].items()},
                     "param_groups": deepcopy(optimizer["param_groups"])}
        return {**checkpoint, "ema": model, "optimizer": convert_optimizer_state_dict_to_fp16(optimizer)}


def _host_model(module: torch.nn.Module) -> torch.nn.Module:
    """`module` copied to the host as Ultralytics saves it (fp16, contiguous, no criterion), its state left unset:
    the copy's parameters and buffers are made empty (not copied from the device), other tensors are copied."""
    memo = {id(module.criterion): None} if getattr(module, "criterion", None) is not None else {}  # not saved
    for t in module.state_dict(keep_vars=True).values():
        host = torch.empty(t.shape, dtype=torch.half if t.is_floating_point() else t.dtype)
        memo[id(t)] = torch.nn.Parameter(host, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) \
            else host
    copy = deepcopy(module, memo).to("cpu")  # (the state is on the host already: the rest, non-persistent buffers)
    for m in copy.modules():  # the tensors outside the state (Detect's anchors and strides): on the host too
        for k, v in vars(m).items():
            if isinstance(v, torch.Tensor) and v.device.type != "cpu":
                setattr(m, k, v.to("cpu"))
    return copy


def strip(path: Path) -> None:
    """The final weights: EMA as the model, no optimizer, no resume state."""
    strip_optimizer(path, updates={RESUME_KEY: None})


# strip_optimizer's metadata; the checkpoint's own date, version and licence come after it and win, as there
STRIP_METADATA = {"license": "AGPL-3.0 License (https://ultralytics.com/license)",
                  "docs": "https://docs.ultralytics.com"}
# set to None by strip_optimizer (releases.py: "stopper" from 8.4.172)
STRIPPED_KEYS = ("optimizer", "best_fitness", *(["stopper"] if releases.STRIP_CLEARS_STOPPER else []), "ema",
                 "updates", "scaler")


def stripped(ckpt: dict) -> dict:
    """What strip() writes for `ckpt` (a whole checkpoint, e.g. the last epoch's, still in memory), without its
    file: strip_optimizer's steps re-stated, in its order. Like strip_optimizer with the copy it loads, it changes the
    EMA model object in place (fp16, frozen, its args a dict): give it a checkpoint that nothing saves again, the
    run's last."""
    x = dict(ckpt)
    metadata = {"date": datetime.now().astimezone().isoformat(), "version": ULTRALYTICS_VERSION, **STRIP_METADATA}
    if x.get("ema"):
        x["model"] = x["ema"]
    model = x["model"]
    if hasattr(model, "args"):
        model.args = dict(model.args)
    if hasattr(model, "criterion"):
        model.criterion = None
    model.half()
    for p in model.parameters():
        p.requires_grad = False
    args = {**DEFAULT_CFG_DICT, **x.get("train_args", {})}
    x.update(dict.fromkeys(STRIPPED_KEYS), epoch=-1,
             train_args={k: v for k, v in args.items() if k in DEFAULT_CFG_KEYS})
    return {**metadata, **x, RESUME_KEY: None}


def ema_weights(ckpt: dict) -> dict:
    """The full-precision state dict of a checkpoint's EMA (to validate best.pt at the end of a run)."""
    return ckpt["ema"].float().state_dict()

"""Validation during training with Ultralytics' validator of the task (DetectionValidator, or its segmentation,
pose or obb subclass: tasks.py), sharded over the ranks and gathered to rank 0.

The validator is given a trainer to read; ddp-launch has none, so `_TrainerView` offers exactly the attributes
DetectionValidator 8.4.190 reads off one in training mode (BaseValidator.__call__): the device, the dataset, AMP, the
EMA, the loss items, the early stopper's possible_stop, epoch/epochs, world size and label_loss_items.
"""

from __future__ import annotations

from contextlib import nullcontext
from copy import copy
from functools import cache
from types import SimpleNamespace

import torch
from ultralytics.utils import callbacks

from launcher.rank.group.dist import Comm
from launcher.rank.ultralytics.deferred_plots import DeferredPlots
from launcher.rank.ultralytics.plots import PLOT_LOCK
from launcher.rank.ultralytics.results_table import no_progress_bar, print_table, table_validator
from launcher.rank.ultralytics.tasks import task_of


def label_loss_items(loss_items: dict | None, prefix: str = "train") -> dict:
    """{'train/box_loss': 1.23, ...}: Ultralytics' column names and rounding for results.csv."""
    return {f"{prefix}/{k}": round(float(v), 5) for k, v in (loss_items or {}).items()}


class _TrainerView:
    def __init__(self, *, device, data, amp, ema, loss_items, epoch, epochs, world_size, plots=False):
        self.device, self.data, self.amp, self.ema = device, data, amp, ema
        self.loss_items, self.epoch, self.epochs, self.world_size = loss_items, epoch, epochs, world_size
        # the validator plots in training only at the last epoch or a possible early stop: `plots` decides here
        self.stopper = SimpleNamespace(possible_stop=plots)

    @staticmethod
    def label_loss_items(loss_items=None, prefix="train"):
        return label_loss_items(loss_items, prefix)


class Validator:
    """`validate(...)` -> (metrics, fitness) on rank 0, (None, None) elsewhere; every rank must call it."""

    def __init__(self, loader, hyp, run_dir, *, on_batch=None):
        hooks = callbacks.get_default_callbacks()
        if on_batch is not None:
            hooks["on_val_batch_end"].append(lambda _validator: on_batch())
        self.validator = _validator_class(task_of(hyp.task).validator)(loader, save_dir=run_dir, args=copy(hyp),
                                                                       _callbacks=hooks)

    @property
    def metric_keys(self) -> list[str]:
        return list(self.validator.metrics.keys)

    def validate(self, ema, comm: Comm, *, device, data, amp: bool, loss_items: dict, epoch: int, epochs: int,
                 plots: bool = False, draw=None, per_class: bool = False):
        """`plots`: Ultralytics' validation plots (curves, confusion matrices, batches), drawn by rank 0, this time;
        every rank must pass the same value; given `draw` (rank 0's Plotter.later), they are handed to it to be drawn
        after the weights are written (deferred_plots.py). Rank 0 writes the table (results_table.py): with
        `per_class`, a row per class too."""
        if comm.distributed:  # BaseTrainer.validate: rank 0's EMA buffers (BatchNorm statistics) on every rank
            comm.broadcast_from_rank0(list(ema.ema.buffers()))
        view = _TrainerView(device=device, data=data, amp=amp, ema=ema, loss_items=loss_items, epoch=epoch,
                            epochs=epochs, world_size=comm.world_size, plots=plots)
        # the same on every rank: with plots the validator also sums the confusion matrix over the ranks (a collective);
        # only rank 0 draws (Ultralytics checks RANK), so only rank 0 keeps the other plots waiting
        self.validator.args.plots, self.validator.per_class = plots, per_class
        self.validator.defer = draw if plots else None
        drawn_now = plots and comm.rank == 0 and draw is None
        try:
            with PLOT_LOCK if drawn_now else nullcontext(), no_progress_bar():
                metrics = self.validator(trainer=view)
        finally:
            self.validator.args.plots, self.validator.per_class, self.validator.defer = False, False, None
        if metrics is None:
            return None, None
        return metrics, metrics.pop("fitness", None)

    def print_table(self) -> None:
        """Rank 0: the last validation's table again, with a row per class."""
        print_table(self.validator, per_class=True)

    def validate_weights(self, weights: dict[str, torch.Tensor], ema, comm: Comm, **kwargs):
        """Validate other weights (best.pt's EMA at the end of a run) in the EMA's place: rank 0's `weights` (None on
        the other ranks) are loaded on every rank, since the ranks may not share the run folder."""
        if comm.rank == 0:
            ema.ema.load_state_dict(weights)
        comm.broadcast_from_rank0(list(ema.ema.state_dict().values()))
        return self.validate(ema, comm, **kwargs)


@cache
def _validator_class(validator: type) -> type:
    """Ultralytics' `validator` writing print_table's table, its plots deferred where asked."""
    table = table_validator(validator)
    return type(f"Deferred{table.__name__}", (DeferredPlots, table), {})

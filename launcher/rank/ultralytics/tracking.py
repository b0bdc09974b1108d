"""Experiment tracking through Ultralytics' own integrations (`log.integrations=[tensorboard]`; also wandb, mlflow,
clearml, comet, dvc where their package is installed), on rank 0 only.

ddp-launch writes Ultralytics' settings with every integration off (launch/ultralytics_home.py), so that nothing
reaches the network unless the user names an integration. A named one is switched on for this process alone (the
shared settings file is left as it is), its callbacks module is imported from Ultralytics, and this hook calls its
callbacks at the trainer events they expect, with a view of the run in the trainer's place: save_dir (the run
folder, where TensorBoard writes its event file), args, data, model, epoch/epochs, tloss, lr, metrics, best/last.
Each epoch's metrics carry ddp-launch's own figures beside Ultralytics' (metrics/epoch_figures.py: images/s, data
wait, GPU utilisation, peak GPU memory, under "ddp_launch/"), so that every integration records them as it records
the mAP.
TensorBoard's callbacks are tested (tests/test_tracking.py); the others receive the same view, and a callback that
reads something the view lacks is reported as a warning, never ending the run.

Ultralytics' integrations switch themselves off inside a test runner or a GitHub Actions job (TESTS_RUNNING): the
rank then says so.
"""

from __future__ import annotations

from collections import defaultdict
from importlib import import_module
from pathlib import Path
from types import SimpleNamespace

from launcher.rank.loop.loop import Hook, TrainLoop
from launcher.rank.ultralytics.validation import label_loss_items

MODULES = {"tensorboard": "tensorboard", "wandb": "wb", "mlflow": "mlflow", "clearml": "clearml", "comet": "comet",
           "dvc": "dvc"}  # Ultralytics' settings key -> its module in ultralytics/utils/callbacks


class Tracking(Hook):
    """Rank 0: Ultralytics' integration callbacks, at the start, after each epoch (after validation and results.csv;
    `figures()` adds ddp-launch's to the epoch's metrics) and at the end, once `plots_drawn()` has returned (the
    final validation's plots, drawn in a thread, are among the files an integration uploads at the end)."""

    def __init__(self, names: list[str], *, run_dir: Path, hyp, data: dict, net, lrs, log, plots_drawn=None,
                 figures=None):
        from ultralytics.utils import SETTINGS

        self.log, self.lrs, self.plots_drawn = log, lrs, plots_drawn
        self.figures = figures or dict  # the epoch's own figures, {name: value}
        self.callbacks: dict[str, list] = defaultdict(list)
        for name in names:
            dict.__setitem__(SETTINGS, name, True)  # this process only: JSONDict's own __setitem__ writes the file
            module = import_module(f"ultralytics.utils.callbacks.{MODULES[name]}")
            if not module.callbacks:
                log(f"WARNING log.integrations: Ultralytics' {name} callbacks are off in this process (it found its "
                    "package missing, or a test runner or GitHub Actions job, where its integrations stay off)")
            for event, fn in module.callbacks.items():
                self.callbacks[event].append(fn)
        weights = Path(run_dir) / "weights"
        self.view = SimpleNamespace(save_dir=Path(run_dir), args=hyp, data=data, model=net, epoch=0, epochs=0,
                                    tloss=None, lr={}, metrics={}, best=weights / "best.pt", last=weights / "last.pt",
                                    wdir=weights, plots={}, label_loss_items=label_loss_items)

    def _fire(self, event: str) -> None:
        for fn in self.callbacks[event]:
            try:
                fn(self.view)
            except Exception as e:  # noqa: BLE001 - tracking never ends a training run
                self.log(f"WARNING log.integrations: {fn.__module__}.{event} failed ({type(e).__name__}: {e})")

    def before_train(self, loop: TrainLoop) -> None:
        self.view.epochs = loop.epochs
        self._fire("on_pretrain_routine_start")
        self._fire("on_train_start")

    def after_epoch(self, loop: TrainLoop) -> None:
        state = loop.state
        self.view.epoch, self.view.tloss = state.epoch, dict(state.tloss or {})
        self.view.lr = self.lrs()
        self.view.metrics = {**(dict(state.metrics or {}) if state.validated else {}), **self.figures()}
        self._fire("on_train_epoch_end")
        self._fire("on_fit_epoch_end")

    def after_train(self, loop: TrainLoop) -> None:
        if self.plots_drawn is not None:
            self.plots_drawn()
        self._fire("on_train_end")
        self._fire("teardown")

"""Ultralytics' training plots, written by rank 0 into the run folder (`train.plots`, on by default).

* labels.jpg: the training labels' classes, positions and sizes (`plot_labels`), at the start;
* train_batch<N>.jpg: the run's first training batches (and the first ones after mosaic closes) with their boxes, as
  Ultralytics' trainer plots them (plot_training_samples' plot_images), from host copies (`train_batch`, fed by
  rank/run/train_batches.py);
* results.png: the losses, metrics and learning rates of results.csv by epoch (`plot_results`), once, after the
  run's last epoch (as Ultralytics draws it), held with the final validation's plots (`later`);
* the final validation's curves (PR, F1, P, R) and confusion matrices, and its first batches with labels and
  predictions: Ultralytics' validator writes them when its `plots` argument is on (runs.py turns it on for the
  final validation); the fast validator hands them to `later`, which draws them once the weights are written.

All of them run in a thread of their own, off the training's path. matplotlib's pyplot is not thread-safe, so
every plot holds PLOT_LOCK. Ultralytics reads results.csv and the labels with polars for these two; where polars is
missing (the GPU machines' image), they are skipped with one warning and the validator's plots are still written.
"""

from __future__ import annotations

import importlib.util
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

PLOT_LOCK = threading.Lock()


class Plotter:
    """`labels(...)` queues a plot, `results(csv)` and `later(...)` hold one; `drain()` and `close()` draw what is
    held and wait for everything. Failures are warnings."""

    def __init__(self, run_dir: Path, log):
        self.run_dir, self.log = Path(run_dir), log
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plots")
        self.pending: list[Future] = []
        self.held: list[tuple] = []  # later()'s, until drain()
        self.usable = importlib.util.find_spec("polars") is not None
        if not self.usable:
            log("WARNING plots: labels.jpg and results.png need polars (pip install polars); the final "
                "validation's curves and confusion matrix are still written")

    def labels(self, labels: list[dict], names: dict) -> None:
        if self.usable:
            self.now("labels.jpg", _plot_labels, labels, names, self.run_dir)

    def results(self, csv: Path) -> None:
        if self.usable:
            self.later("results.png", _plot_results, csv, self.run_dir)

    def train_batch(self, batch: dict, ni: int, copied=None) -> None:
        """train_batch<ni>.jpg of `batch` (host tensors: img, cls, bboxes, batch_idx; im_file), drawn once `copied`
        (an event behind their copy from the device, or None) has completed."""
        self.now(f"train_batch{ni}.jpg", _plot_train_batch, batch, self.run_dir / f"train_batch{ni}.jpg", copied)

    def now(self, what: str, fn, *args) -> None:
        """`fn(*args)` in the plotter's thread under PLOT_LOCK, after what is queued; a failure is a warning."""
        self.pending = [f for f in self.pending if not f.done()]
        self.pending.append(self.pool.submit(self._run, what, fn, *args))

    def later(self, what: str, fn, *args) -> None:
        """`fn(*args)` held until drain() or close(): the final validation's plots, drawn once the weights are
        written (in the thread beside the stripping, matplotlib's Python work would slow it down)."""
        self.held.append((what, fn, args))

    def drain(self) -> None:
        """Everything queued and held drawn, and waited for; the plotter stays open."""
        held, self.held = self.held, []
        for what, fn, args in held:
            self.now(what, fn, *args)
        for f in list(self.pending):
            f.result()

    def _run(self, what: str, fn, *args) -> None:
        try:
            with PLOT_LOCK:
                fn(*args)
        except Exception as e:  # noqa: BLE001 - a plot never ends a training run
            self.log(f"WARNING plots: {what} failed ({type(e).__name__}: {e})")

    def close(self) -> None:
        self.drain()
        self.pool.shutdown(wait=True)


def _plot_labels(labels: list[dict], names: dict, run_dir: Path) -> None:
    from ultralytics.utils.plotting import plot_labels

    boxes = np.concatenate([np.asarray(lb["bboxes"]).reshape(-1, 4) for lb in labels], 0)
    cls = np.concatenate([np.asarray(lb["cls"]).reshape(-1) for lb in labels], 0)
    plot_labels(boxes, cls, names=names, save_dir=run_dir)


def _plot_results(csv: Path, run_dir: Path) -> None:
    from ultralytics.utils.plotting import plot_results

    plot_results(file=csv, dir=run_dir)


def _plot_train_batch(batch: dict, file: Path, copied) -> None:
    import torch
    from ultralytics.utils.plotting import plot_images

    if copied is not None:
        copied.synchronize()
    labels = {k: v for k, v in batch.items() if k not in ("img", "im_file")}  # boxes, and keypoints or masks
    if "batch_idx" not in labels:  # a classifier's batch: each image's class (ClassificationTrainer's plot)
        labels["batch_idx"] = torch.arange(len(batch["cls"]))
    labels["img"] = batch["img"].float()  # the network's input: [0, 1], perhaps half precision
    plot_images(labels=labels, paths=batch["im_file"], fname=file, threaded=False)

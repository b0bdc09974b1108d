"""The final validation's plots of Ultralytics' own validators (segmentation, pose, obb, classification, and
detection with `val.engine=ultralytics`) drawn after the final weights are written, not before.

A validation with plots draws, besides computing its metrics: the first batches' labels and predictions
(plot_val_samples, plot_predictions, up to plot_images' 16 images each), the precision/recall curves (its metrics'
process(plot=True): four per kind of mAP) and the confusion matrix, twice (finalize_metrics). In the rank these take
seconds of matplotlib work, and the weights would wait for them. While `defer` holds a callable (rank 0's
Plotter.later), each is handed to it instead, as a closure over copies of what it reads: the batch's first images and
its labels on the host, the statistics before they are cleared, the confusion matrix as it was counted. The
validation's metrics are computed exactly as with plots drawn at once; the files written are the same.
"""

from __future__ import annotations

from contextlib import contextmanager
from copy import deepcopy

import torch
from torch.utils import _pytree as pytree

PLOTTED_IMAGES = 16  # plot_images' max_subplots: the images of a batch that its plot shows


def _on_host(tree, per_image: tuple[str, ...] = ()):
    """A copy of `tree`'s tensors on the host (its other leaves as they are); the tensors under the keys `per_image`
    (a row per image) cut to the PLOTTED_IMAGES that plot_images draws."""
    if isinstance(tree, dict):
        tree = {k: v[:PLOTTED_IMAGES] if k in per_image else v for k, v in tree.items()}
    return pytree.tree_map(lambda t: t.detach().to("cpu", copy=True) if isinstance(t, torch.Tensor) else t, tree)


def draw_curves(metrics_type, names: dict, stats: dict, save_dir, on_plot) -> None:
    """The curves of these statistics (the PR, F1, P and R curves of each kind of mAP), drawn by a fresh metrics
    object of the validation's own type."""
    curves = metrics_type(names=names)
    curves.stats = stats
    curves.process(save_dir=save_dir, plot=True, on_plot=on_plot)


def draw_confusion(matrix, save_dir, on_plot) -> None:
    for normalize in True, False:  # DetectionValidator.finalize_metrics's two
        matrix.plot(save_dir=save_dir, normalize=normalize, on_plot=on_plot)


class DeferredPlots:
    """Before an Ultralytics validator in the bases (validation.py composes them): with `defer` set to
    `later(what, fn, *args)`, the plots of a validation with `args.plots` are handed to it, not drawn."""

    defer = None

    def _plotted_batch(self, batch: dict) -> dict:
        """The batch's first images on the host, with their labels: a classifier's labels are a row per image, the
        others' a row per object (batch_idx names its image)."""
        return _on_host(batch, ("img", "cls") if self.args.task == "classify" else ("img",))

    @contextmanager
    def _not_drawing(self):
        """Ultralytics' own step without its drawing (args.plots off inside)."""
        self.args.plots = False
        try:
            yield
        finally:
            self.args.plots = True

    def plot_val_samples(self, batch, ni):
        if self.defer is None:
            return super().plot_val_samples(batch, ni)
        self.defer(f"val_batch{ni}_labels.jpg", super().plot_val_samples, self._plotted_batch(batch), ni)

    def plot_predictions(self, batch, preds, ni):
        if self.defer is None:
            return super().plot_predictions(batch, preds, ni)
        kept = _on_host(preds[:PLOTTED_IMAGES])  # a dict per image, or a classifier's row per image
        self.defer(f"val_batch{ni}_pred.jpg", super().plot_predictions, self._plotted_batch(batch), kept, ni)

    def get_stats(self):
        """The metrics without the curves, which are deferred with a copy of the statistics they are drawn from
        (ClassificationValidator's have none: it draws no curves)."""
        stats = getattr(self.metrics, "stats", None)
        if self.defer is None or not self.args.plots or not isinstance(stats, dict):
            return super().get_stats()
        kept = {k: list(v) for k, v in stats.items()}
        with self._not_drawing():
            results = super().get_stats()
        self.defer("the validation's curves", draw_curves, type(self.metrics), self.names, kept, self.save_dir,
                   self.on_plot)
        return results

    def finalize_metrics(self):
        if self.defer is None or not self.args.plots:
            return super().finalize_metrics()
        with self._not_drawing():
            super().finalize_metrics()  # ClassificationValidator counts its matrix here
        self.defer("the confusion matrix", draw_confusion, deepcopy(self.confusion_matrix), self.save_dir, self.on_plot)

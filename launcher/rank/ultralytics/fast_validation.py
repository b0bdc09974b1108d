"""Validation at inference speed (`val.engine=fast`, what `auto` picks), with Ultralytics' metrics.

The split is read once per run through Ultralytics' own validation loader (rect batches, pad 0.5: its pixels) and kept
on the device (rank/validate/store.py; during the first epoch a thread reads it into host memory, `read_ahead` and
SplitReader, and the training thread copies it to the device a slice between two steps, `place_ahead`); each
validation then runs the EMA in fp16 over large batches, replayed as CUDA graphs (rank/validate/forward.py;
`folded`: a copy with its BatchNorms folded, folded.py), with NMS and the matching of detections to targets
batched over the whole batch on the device (rank/validate/nms.py, matching.py), on a second CUDA stream while the
next batch's forward runs (rank/validate/engine.py). What reaches the metrics is what DetectionValidator's
update_metrics collects, in the same layout; Ultralytics' own DetMetrics (its ap_per_class, grouped by class once:
class_metrics.py, the same results), ConfusionMatrix and plotting compute and draw the rest, through a
DetectionValidator that never runs a batch itself:
  - the PR/F1/P/R curves from DetMetrics.process(plot=True), as Ultralytics draws them;
  - the confusion matrix of ConfusionMatrix.process_batch on the same detections (only when plots are drawn: the
    final validation), counted a batch at a time on the device (rank/validate/confusion.py; image by image through
    process_batch itself where Ultralytics' `visualize` wants its matches), summed over the ranks;
  - val_batch{0,1,2}_labels.jpg and _pred.jpg from rank 0's first three batches (up to 16 images each, as Ultralytics);
  in a training run all three are drawn in the plotter's thread, after the final weights are written (`draw`).
The validation loss is the EMA's own Ultralytics loss on the same outputs, summed per batch and divided by the batch
count, averaged over the ranks (Ultralytics' rule; larger batches move it a little). DetMetrics' per-image
precision/recall dict (image_metrics) is not kept: nothing of a training run reads it.

A pose model's validation is PoseValidator's the same way: its detections carry their keypoints through the NMS,
are matched to the targets' by OKS as well as by IoU (matching.pose_true_positives: its tp_p), and PoseMetrics scores
both; its first batches are drawn with their keypoints. A segmentation model's is SegmentationValidator's: its
detections carry their mask coefficients through the NMS, their masks are made from the head's prototypes and
matched to the targets' (the loader's overlapping masks, kept with the split) by mask IoU (rank/validate/masks.py:
its tp_m), and SegmentMetrics scores both.

Per-rank statistics go to rank 0 through the rank's own process group (Comm.gather), in rank order.
"""

from __future__ import annotations

import time
from copy import copy, deepcopy

import numpy as np
import torch
from ultralytics.models.yolo.detect import DetectionValidator

from launcher.rank.kernels import kernels
from launcher.rank.group.dist import Comm
from launcher.rank.ultralytics import class_metrics, datasets, releases
from launcher.rank.ultralytics.deferred_plots import PLOTTED_IMAGES, draw_confusion, draw_curves
from launcher.rank.ultralytics.folded import FoldedCopy
from launcher.rank.ultralytics.plots import PLOT_LOCK
from launcher.rank.ultralytics.results_table import print_table
from launcher.rank.ultralytics.tasks import task_of
from launcher.rank.ultralytics.validation import label_loss_items
from launcher.rank.validate.confusion import confusion_counts
from launcher.rank.validate.engine import NmsSettings, detections_of, run_pass
from launcher.rank.validate.forward import InferenceForward, autocast_to
from launcher.rank.validate.split_reader import SplitReader
from launcher.rank.validate.store import Placement, PreloadedSplit

PLOTTED_BATCHES = 3  # BaseValidator plots its first three batches


VAL_CONF = 0.001  # BaseValidator's conf where the arguments leave it None (task detect), as training's do


def nms_settings(args, end2end: bool, conf: float | None = None) -> NmsSettings:
    """DetectionValidator.postprocess's arguments (task detect: multi_label, agnostic with single_cls); `conf` where
    args.conf is None (the training arguments, before a validator fills it in)."""
    return NmsSettings(conf=float(args.conf if args.conf is not None else conf), iou=float(args.iou),
                       max_det=int(args.max_det),
                       agnostic=bool(args.single_cls or args.agnostic_nms), end2end=end2end, multi_label=True)


def gathered_stats(per_rank: list[dict]) -> dict[str, list]:
    """DetMetrics.stats from every rank's concatenated arrays, rank after rank (DetectionValidator.gather_stats)."""
    return {k: [r[k] for r in per_rank] for k in per_rank[0]}


class FastValidator:
    """The interface of validation.Validator: `validate(...)` -> (metrics, fitness) on rank 0, (None, None)
    elsewhere; every rank calls it. `batch`: images per forward; `cuda_graphs`: replay the forward per shape;
    `pipelined`: on CUDA, each batch's post-processing on a second stream while the next batch's forward runs;
    `folded` (val.fold_batchnorm, off by default): the forward on a copy of the EMA with BatchNorm folded (folded.py),
    in the AMP dtype on CUDA, instead of the EMA under autocast: a faster forward, which the pass was not bound by
    when last measured, and the first validation pays for the copy (docs/benchmarks/h200-validation/README.md).
    `device`: the rank's, where read_ahead warms the folded forward's kernels up. `log` warns; `detail` (default `log`)
    takes the diagnostics (where the split is, each pass's time)."""

    def __init__(self, loader, hyp, run_dir, *, batch: int, amp_dtype: torch.dtype | None, cuda_graphs: bool = True,
                 pipelined: bool = True, folded: bool = False, device: torch.device | None = None, on_batch=None,
                 log=print, detail=None):
        self.loader, self.batch, self.amp_dtype, self.cuda_graphs = loader, batch, amp_dtype, cuda_graphs
        self.pipelined, self.fold, self.device = pipelined, folded, device
        self.folded: FoldedCopy | None = None
        self.warming: kernels.WarmUp | None = None  # the validation's Triton kernels, compiled during training
        self._amp_dtype: torch.dtype | None = None  # this validation's autocast type (None on CPU or without AMP)
        self.on_batch, self.log, self.detail = on_batch or (lambda: None), log, detail or log
        task = task_of(getattr(hyp, "task", None))  # detect, pose or segment; without one, detection's
        if task.name == "segment" and not getattr(hyp, "overlap_mask", True):
            raise ValueError("the fast validator reads a segmentation split's masks as overlapping (overlap_mask=True, "
                             "Ultralytics' default); use val.engine=ultralytics with overlap_mask=False")
        self.validator = task.validator(loader, save_dir=run_dir, args=copy(hyp))
        self.split: PreloadedSplit | None = None
        self.reading: SplitReader | None = None  # the split being read during training (read_ahead)
        self.placing: Placement | None = None  # the split read, being copied to the device (place_ahead)
        self.forward: InferenceForward | None = None
        self.stream: torch.cuda.Stream | None = None  # the post-processing's, one batch behind the forward (CUDA)
        self.timing: dict[str, float] = {}  # preload_s (once), last pass_s and images/s

    @property
    def metric_keys(self) -> list[str]:
        return list(self.validator.metrics.keys)

    def read_ahead(self) -> None:
        """The loader's workers start reading this rank's shard now, while training goes on, and a thread takes their
        batches as they come into host memory (PreloadedSplit.read); place_ahead then copies it to the device between
        steps. Nothing to do with no workers (the thread would decode in this process), or once the
        split is read or being read. On CUDA, a second thread compiles the validation's Triton kernels (WarmUp): the
        NMS and matching scans, and the folded forward's."""
        if self.split is None and self.reading is None and datasets.start_workers(self.loader):
            self.reading = SplitReader(self.loader)
        if self.warming is None and self.device is not None and self.device.type == "cuda":
            names = (*kernels.VALIDATION, *kernels.SCANS) if self.fold else kernels.SCANS
            self.warming = kernels.WarmUp(self.device, self.amp_dtype or torch.float32, names)

    def place_ahead(self) -> None:
        """After a training step: once read_ahead's thread has read the split, one slice of it copied to the device
        (Placement.advance, on the training thread, between two steps), so that the first validation finds it there.
        Nothing while it is being read (or failed to be: the validation says why), nor once it is placed."""
        if self.split is not None or self.device is None:
            return
        if self.placing is None:
            if self.reading is None or not self.reading.succeeded:
                return
            self.placing = Placement(self.reading.result()[0], self.device)
        self.placing.advance()  # nothing once all is copied

    def preload(self, device: torch.device) -> None:
        """This rank's shard, once: its loader's batches kept (the loader's workers are not needed after)."""
        started = time.perf_counter()
        read_s = None
        if self.reading is not None:  # read during training: what is left of it, then what is left of the copy
            groups, read_s = self.reading.result()
            self.placing = self.placing or Placement(groups, device)
            ahead = self.placing.copied if self.placing.ahead else None  # None: nothing to copy ahead
            self.split = self.placing.finish()
        else:
            self.split = PreloadedSplit.load(iter(self.loader), device, on_batch=self.on_batch)
        self.placing = None
        self.timing["preload_s"] = time.perf_counter() - started
        self.loader.close()  # its workers are done (SplitReader has closed it): the split is read from memory now
        where = "on the device" if self.split.on_device else "in pinned host memory"
        shapes = ", ".join(f"{n} at {h}x{w}" for (h, w), n in self.split.shapes.items())
        mib = self.split.nbytes / 2**20
        took = f"preloaded in {self.timing['preload_s']:.2f} s"
        if read_s is not None:
            copied = "" if ahead is None else f", {ahead / 2**20:.0f} MiB of it copied to the device between steps"
            took = (f"read during training in {read_s:.2f} s{copied}, then waited for and placed in "
                    f"{self.timing['preload_s']:.2f} s")
        self.detail(f"validation: {len(self.split)} images ({shapes}) {where}, {took} ({mib:.0f} MiB)")

    def validate(self, ema, comm: Comm, *, device, data, amp: bool, loss_items: dict, epoch: int, epochs: int,
                 plots: bool = False, draw=None, per_class: bool = False):
        """`plots` (the same on every rank): Ultralytics' plots of this validation, drawn by rank 0: now, or, given
        `draw` (rank 0's Plotter.later), in the plotter's thread from a copy of what they need, so that the weights
        need not wait for them. Rank 0 writes Ultralytics' table (results_table.py): with `per_class`, a row per
        class too."""
        if comm.distributed:  # BaseTrainer.validate: rank 0's EMA buffers (BatchNorm statistics) on every rank
            comm.broadcast_from_rank0(list(ema.ema.buffers()))
        if self.split is None:
            self.preload(device)
        model = ema.ema
        self._ready_validator(model, device, data, plots)
        self._ready_forward(model, device, amp)
        first = "pass_s" not in self.timing  # the run's first pass: it pays for what the later ones reuse
        result, plotted, elapsed = self._pass(model, comm, device, plots, first)
        everyone = self._gather(comm, result, plots)
        if everyone is None:
            return None, None
        drawing = _Drawing(self.validator, plotted) if plots else None  # before the statistics are cleared
        stats = self._metrics(first, elapsed, result.images, per_class)
        if drawing is not None:
            _draw(drawing, draw)
        loss = mean_loss([r["loss"] for r in everyone])
        metrics = {k: round(float(x), 5) for k, x in {**stats, **label_loss_items(loss, "val")}.items()}
        return metrics, metrics.pop("fitness", None)

    # --- the Ultralytics adapter: a DetectionValidator set up as BaseValidator.__call__ sets it in training ---------
    def _ready_validator(self, model, device, data, plots: bool) -> None:
        """The validator's state for a pass over `model` (the EMA): training mode, device, data and plots set,
        `model` in float32 eval mode, metrics and confusion matrix cleared (init_metrics)."""
        v = self.validator
        v.training, v.device, v.data = True, device, data
        v.args.plots = plots
        if hasattr(model, "end2end"):  # BaseValidator.__call__ in training
            model.end2end = v.args.nms is False
        model.float().eval()
        v.init_metrics(model)  # names, nc, the head's max_det, the confusion matrix, cleared statistics

    # --- the graphed forward -------------------------------------------------------------------------------------
    def _ready_forward(self, model, device, amp: bool) -> None:
        """`self.forward` over this validation's network: the EMA under autocast, or its folded copy (made once,
        refreshed with the EMA's weights after); CUDA-graphed per shape where cuda_graphs. Joins the validation's
        kernels compiled during training, and makes the post-processing's stream, once."""
        if self.stream is None and device.type == "cuda" and self.pipelined:
            self.stream = torch.cuda.Stream(device)
        self._amp_dtype = self.amp_dtype if amp and device.type == "cuda" else None
        if self.warming is not None:  # once: its kernels are compiled before the first launch
            warming, self.warming = self.warming.join(), None
            if warming.error:
                self.log(f"WARNING: compiling the validation's kernels during training failed ({warming.error})")
            else:
                self.detail(f"validation: its kernels compiled during training in {warming.seconds:.2f} s")
        if self.fold and (self.folded is None or self.folded.source is not model):
            folding = time.perf_counter()
            self.folded = FoldedCopy(model, self._amp_dtype or torch.float32)
            self.detail(f"validation: the EMA copied with {self.folded.folded} BatchNorms folded, in "
                        f"{str(self.folded.dtype).removeprefix('torch.')}, in {time.perf_counter() - folding:.2f} s")
        elif self.folded is not None:
            self.folded.refresh()  # the EMA's weights now
        network = self.folded.model if self.fold else model
        if self.forward is None or self.forward.model is not network:
            self.forward = InferenceForward(network, device, batch=self.batch, graphs=self.cuda_graphs,
                                            amp_dtype=None if self.fold else self._amp_dtype, log=self.log,
                                            detail=self.detail)

    # --- the statistics ------------------------------------------------------------------------------------------
    def _pass(self, model, comm: Comm, device, plots: bool, first: bool):
        """One pass over this rank's shard: (run_pass's result, rank 0's first batches to plot with their
        detections, the pass's seconds). With `plots`, the confusion matrix counted too (_confusion_counter)."""
        v = self.validator
        plotted: list = []
        confusion: list[torch.Tensor] = []  # each batch's confusion counts, on the device until the pass ends
        each_batch = self._confusion_counter(comm.rank, confusion, plotted) if plots else None
        ends: list[float] = []  # each batch's end on the host (its post-processing reads the host once)

        def on_batch() -> None:
            self.on_batch()
            ends.append(time.perf_counter())

        started = time.perf_counter()
        with torch.inference_mode(), torch.autocast(device.type, enabled=False):
            result = run_pass(self.split, self.forward, batch=self.batch, nc=v.nc, nms=nms_settings(v.args, v.end2end),
                              single_cls=bool(v.args.single_cls), kpt_sigma=_kpt_sigma(v),
                              masks=v.args.task == "segment", claim=claims_rule(v),
                              on_batch=on_batch, each_batch=each_batch,
                              loss_fn=lambda targets, preds: self._loss(model, targets, preds), stream=self.stream)
        if confusion:  # one copy to the host
            v.confusion_matrix.matrix += torch.stack(confusion).sum(0).cpu().numpy()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        finished = time.perf_counter()
        elapsed = finished - started
        self.timing.update(pass_s=elapsed, images_per_s=result.images / elapsed if elapsed else 0.0)
        self.detail(f"validation: {result.images} images in {elapsed:.2f} s "
                    f"({self.timing['images_per_s']:.0f} images/s)")
        if first and ends:  # where a slow first pass went: its first batch (the graph's capture), or every batch
            steps = [b - a for a, b in zip([started, *ends], [*ends, finished])]
            self.detail(f"validation: the first pass batch by batch: {', '.join(f'{x:.3f}' for x in steps[:-1])} s, "
                        f"then {steps[-1]:.3f} s to its end")
        return result, plotted, elapsed

    def _confusion_counter(self, rank: int, confusion: list, plotted: list):
        """run_pass's `each_batch` when plots are drawn: each batch's confusion counts appended to `confusion` (on
        the device), or, where Ultralytics' `visualize` wants its matches, counted by process_batch image by image;
        on rank 0 the first PLOTTED_BATCHES batches kept in `plotted`."""
        v = self.validator

        def each_batch(vb, det, boxes, proto):
            cm = v.confusion_matrix
            if cm.matches is None and releases.GREEDY_CONFUSION:  # the counts alone: the whole batch at once
                confusion.append(confusion_counts(det, det.valid(), boxes, vb.cls, vb.valid(), cm.nc,
                                                  float(v.args.conf)))
            else:  # `visualize` (Ultralytics' matches bookkeeping is per image) or an older rule (releases.py)
                for i in range(vb.n):
                    n = int(vb.count[i])
                    truth = {"cls": vb.cls[i, :n], "bboxes": boxes[i, :n]}
                    cm.process_batch(detections_of(det, i, _kpt_shape(v)), truth, conf=v.args.conf)
            if rank == 0 and len(plotted) < PLOTTED_BATCHES:  # a copy of the prototypes: a replay overwrites them
                plotted.append((vb, det, None if proto is None else proto[:PLOTTED_IMAGES].clone()))

        return each_batch

    # --- the gather ----------------------------------------------------------------------------------------------
    def _gather(self, comm: Comm, result, plots: bool) -> list[dict] | None:
        """Every rank's statistics, loss, image count and (with `plots`) confusion matrix on rank 0, in rank order,
        and folded into the validator there (DetectionValidator.gather_stats); None on the other ranks, whose
        statistics are cleared."""
        v = self.validator
        loss = {k: (v_.cpu() / max(result.batches, 1)).float() for k, v_ in result.loss.items()}
        mine = {"stats": result.stats, "loss": loss, "images": result.images,
                "matrix": v.confusion_matrix.matrix if plots else None}
        everyone = comm.gather(mine)
        if comm.rank != 0:
            v.metrics.clear_stats()
            return None
        v.metrics.stats = gathered_stats([r["stats"] for r in everyone])
        v.seen = sum(r["images"] for r in everyone)
        if plots and comm.world_size > 1:
            v.confusion_matrix.matrix = np.sum([r["matrix"] for r in everyone], axis=0)
        return everyone

    def _metrics(self, first: bool, elapsed: float, images: int, per_class: bool) -> dict:
        """Rank 0: Ultralytics' metrics of the gathered statistics (DetMetrics.process, each class's detections
        grouped once; no plots: those are _Drawing's), its table printed; the statistics cleared after."""
        v = self.validator
        v.args.plots = False  # the metrics without the plots: those are drawing's
        detections = sum(len(c) for c in v.metrics.stats["conf"])
        metrics_started = time.perf_counter()
        class_metrics.process(v.metrics)  # get_stats' metrics.process, each class's detections grouped once
        stats = v.metrics.results_dict
        v.metrics.clear_stats()
        if first:  # on the host, and as long as the detections are many: an untrained model's, at conf 0.001
            self.detail(f"validation: the metrics over {detections} detections in "
                        f"{time.perf_counter() - metrics_started:.2f} s")
        v.speed = {"preprocess": 0.0, "inference": 1e3 * elapsed / max(images, 1), "loss": 0.0,
                   "postprocess": 0.0}
        v.finalize_metrics()
        print_table(v, per_class=per_class)
        return stats

    def _loss(self, model, targets: dict, preds) -> dict:
        """The EMA's own loss items under autocast to the AMP dtype, whichever forward made `preds` (its BCE in fp32)."""
        with autocast_to(self.forward.device, self._amp_dtype):
            return model.loss(targets, preds)[1]

    def print_table(self) -> None:
        """Rank 0: the last validation's table again, with a row per class."""
        print_table(self.validator, per_class=True)

    def validate_weights(self, weights: dict[str, torch.Tensor], ema, comm: Comm, **kwargs):
        """best.pt's EMA in the EMA's place, loaded in place (the captured graphs read the same tensors)."""
        if comm.rank == 0:
            ema.ema.load_state_dict(weights)
        comm.broadcast_from_rank0(list(ema.ema.state_dict().values()))
        return self.validate(ema, comm, **kwargs)


class _Drawing:
    """The plots of one validation, drawn when called (in the plotter's thread, or at once), from copies of what
    the validator held: its statistics, its confusion matrix and the first batches with their detections. Of the
    validator itself only what a run never changes is read (the run folder, names, max_det)."""

    def __init__(self, v: DetectionValidator, plotted: list):  # or its PoseValidator, SegmentationValidator
        self.v, self.plotted = v, list(plotted)
        self.stats = {k: list(x) for k, x in v.metrics.stats.items()}
        self.matrix = deepcopy(v.confusion_matrix)

    def __call__(self) -> None:
        """Under PLOT_LOCK (the caller's)."""
        v = self.v
        for ni, (vb, det, proto) in enumerate(self.plotted):
            batch = {"img": vb.img[: vb.n], **vb.ultralytics_targets(), "im_file": vb.files}
            v.plot_val_samples(batch, ni)
            shape = tuple(vb.img.shape[2:])  # the images plot_images draws
            v.plot_predictions(batch, [detections_of(det, i, _kpt_shape(v), proto, shape)
                                       for i in range(min(vb.n, PLOTTED_IMAGES))], ni)
        draw_curves(type(v.metrics), v.names, self.stats, v.save_dir, v.on_plot)  # DetMetrics' or the task's own
        draw_confusion(self.matrix, v.save_dir, v.on_plot)


def _draw(drawing: _Drawing, draw) -> None:
    """The plots drawn now (under PLOT_LOCK: matplotlib's pyplot is not thread-safe, plots.py), or handed to `draw`
    (rank 0's Plotter.later) to be drawn in the plotter's thread."""
    if draw is None:
        with PLOT_LOCK:
            drawing()
    else:
        draw("the final validation's plots", drawing)


def _kpt_shape(v: DetectionValidator) -> list | None:
    """A PoseValidator's keypoint shape (set by init_metrics), None for detection's."""
    return getattr(v, "kpt_shape", None)


def _kpt_sigma(v: DetectionValidator) -> torch.Tensor | None:
    """A PoseValidator's OKS sigmas (set by init_metrics), None for detection's."""
    sigma = getattr(v, "sigma", None)
    return None if sigma is None else torch.as_tensor(sigma)


def claims_rule(v: DetectionValidator):
    """run_pass's `claim`: None (the greedy claims, batched) where the installed release claims greedily
    (releases.GREEDY_MATCHING), else the validator's own match_predictions, image by image."""
    if releases.GREEDY_MATCHING:
        return None

    def claim(iou: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
        b, m, d = iou.shape
        same = torch.zeros(max(m, d), device=iou.device)  # other classes are zeroed in `iou` already
        return torch.stack([v.match_predictions(same[:d], same[:m], iou[i]) for i in range(b)]).to(iou.device)

    return claim


def mean_loss(losses: list[dict]) -> dict:
    """The validation loss items over the ranks that validated something: a rank whose shard is empty (fewer
    batches than ranks: Ultralytics' sampler hands out whole batches) has none."""
    ran = [loss for loss in losses if loss]
    return {k: torch.stack([loss[k] for loss in ran]).mean() for k in (ran[0] if ran else {})}

"""One validation pass over a preloaded split: forward, batched NMS, batched matching, and what the metrics need.

Everything stays on the device until the pass ends; then one copy brings the statistics to the host in the layout of
Ultralytics' DetMetrics.stats (per detection: the 10 true-positive flags, confidence, class; per target: its class;
per image: its classes, once each), in image order; a pose model's PoseMetrics and a segmentation model's
SegmentMetrics add their own true-positive flags (tp_p by keypoints, tp_m by masks).

Given a second CUDA stream, the pass is a two-stage pipeline: batch i+1's forward is queued on the current stream
before batch i's post-processing (NMS, matching, the loss) runs on the second one, so that the host reads inside
the post-processing wait for batch i's work alone while the next forward keeps the GPU busy. A replayed graph
writes its outputs in place, so each batch's outputs are copied before the next replay.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils import _pytree as pytree

from launcher.rank.validate.masks import mask_true_positives, predicted_masks
from launcher.rank.validate.matching import pose_true_positives, true_positives
from launcher.rank.validate.nms import Detections, batched_nms, xywh2xyxy
from launcher.rank.validate.store import PreloadedSplit, ValBatch


@dataclass
class NmsSettings:
    """What DetectionValidator.postprocess passes to non_max_suppression in training."""

    conf: float = 0.001
    iou: float = 0.7
    max_det: int = 300
    agnostic: bool = False
    end2end: bool = False
    multi_label: bool = True


@dataclass
class PassResult:
    stats: dict[str, np.ndarray]  # tp, conf, pred_cls, target_cls, target_img (DetMetrics.stats, concatenated)
    images: int
    batches: int
    loss: dict[str, torch.Tensor] = field(default_factory=dict)  # summed over the batches


def target_boxes(batch: ValBatch, shape) -> torch.Tensor:
    """The targets in pixels of the letterboxed image, as DetectionValidator._prepare_batch computes them."""
    h, w = shape
    return xywh2xyxy(batch.xywh) * torch.tensor([w, h, w, h], device=batch.xywh.device)


def target_keypoints(batch: ValBatch, shape) -> torch.Tensor:
    """A pose dataset's target keypoints in pixels of the letterboxed image, as PoseValidator._prepare_batch scales
    them."""
    h, w = shape
    kpts = batch.keypoints.clone()
    kpts[..., 0] *= w
    kpts[..., 1] *= h
    return kpts


def head_outputs(preds) -> tuple[torch.Tensor, torch.Tensor | None]:
    """From a model's eval output: the head's inference rows (B, 4 + nc + extra, anchors), and a segmentation
    head's prototypes (B, nm, h, w) (its first output is the pair) or None."""
    y = preds[0] if isinstance(preds, (list, tuple)) else preds
    return (y[0], y[1]) if isinstance(y, (list, tuple)) else (y, None)


def batch_stats(vb: ValBatch, det: Detections, boxes: torch.Tensor, nc: int,
                kpt_sigma: torch.Tensor | None = None, proto: torch.Tensor | None = None,
                claim=None) -> dict[str, torch.Tensor]:
    """What DetectionValidator.update_metrics adds to DetMetrics.stats for these images, concatenated image after
    image (still on the device); given the keypoints' `kpt_sigma`, PoseValidator's tp_p too (the detections'
    keypoints in det.extra); given a segmentation head's prototypes `proto`, SegmentationValidator's tp_m (the
    detections' mask coefficients in det.extra, the targets' masks in vb.masks). `claim`: matching.true_positives'."""
    valid_t, valid_p = vb.valid(), det.valid()
    tp = true_positives(det.boxes, det.cls, valid_p, boxes, vb.cls, valid_t, claim=claim)
    present = torch.zeros((vb.n, max(nc, 1)), dtype=torch.bool, device=vb.cls.device)
    rows = torch.arange(vb.n, device=vb.cls.device)[:, None].expand_as(valid_t)
    present[rows[valid_t], vb.cls[valid_t].long()] = True
    stats = {"tp": tp[valid_p], "conf": det.conf[valid_p], "pred_cls": det.cls[valid_p],
             "target_cls": vb.cls[valid_t],
             "target_img": present.nonzero()[:, 1].float()}  # np.unique(cls) of each image, image after image
    if kpt_sigma is not None:
        kpts = target_keypoints(vb, vb.img.shape[2:])
        b, d, channels = det.extra.shape
        pred = det.extra.view(b, d, kpts.shape[2], channels // kpts.shape[2])  # PoseValidator.postprocess's view
        stats["tp_p"] = pose_true_positives(pred, det.cls, valid_p, kpts, boxes, vb.cls, valid_t, kpt_sigma,
                                            claim=claim)[valid_p]
    if proto is not None:
        stats["tp_m"] = mask_true_positives(proto, det.extra, det.boxes, det.cls, valid_p, vb.masks, vb.cls, valid_t,
                                            vb.img.shape[2:], claim=claim)[valid_p]
    return stats


def run_pass(split: PreloadedSplit, forward, *, batch: int, nc: int, nms: NmsSettings, single_cls: bool = False,
             kpt_sigma: torch.Tensor | None = None, masks: bool = False, claim=None, loss_fn=None,
             on_batch=lambda: None, each_batch=None, stream: torch.cuda.Stream | None = None) -> PassResult:
    """`forward(img)` -> the model's eval output; `loss_fn(targets, preds)` -> a dict of loss items (the val loss);
    `each_batch(batch, detections, target_boxes, proto)` sees every batch (the plots' confusion matrix, the first
    batches; `proto`: a segmentation head's prototypes, else None);
    `stream`: where the post-processing runs, one batch behind the forward (None: after it, on the same stream).
    `kpt_sigma`: a pose model's keypoint sigmas (PoseValidator.sigma), its detections then matched by OKS too (the
    stats' tp_p); `masks`: a segmentation model's, its detections then matched by their masks' IoU too (tp_m);
    `claim`: matching.true_positives' (None: the greedy claims, batched)."""
    keys = ("tp", "conf", "pred_cls", "target_cls", "target_img") + (("tp_p",) if kpt_sigma is not None else ())
    keys += ("tp_m",) if masks else ()
    out = {k: [] for k in keys}
    loss: dict[str, torch.Tensor] = {}
    batches = images = 0

    def post(vb: ValBatch, preds, ready) -> None:
        nonlocal batches, images
        n, shape = vb.n, tuple(vb.img.shape[2:])
        if ready is not None:
            torch.cuda.current_stream().wait_event(ready)
        y, proto = head_outputs(preds)
        proto = proto[:n] if masks and proto is not None else None  # `masks` alone decides the stats' keys
        det = batched_nms(y[:n], nms.conf, nms.iou, max_det=nms.max_det, multi_label=nms.multi_label,
                          agnostic=nms.agnostic, nc=nc, end2end=nms.end2end)
        if single_cls:
            det = det._replace(cls=det.cls * 0)
        boxes = target_boxes(vb, shape)
        for k, v in batch_stats(vb, det, boxes, nc, kpt_sigma, proto, claim).items():
            out[k].append(v)
        if loss_fn is not None:
            sliced = pytree.tree_map(lambda t: t[:n] if isinstance(t, torch.Tensor) else t, preds)
            for k, v in loss_fn(vb.ultralytics_targets(), sliced).items():
                loss[k] = loss[k] + v.detach() if k in loss else v.detach().clone()
        if each_batch is not None:
            each_batch(vb, det, boxes, proto)
        batches += 1
        images += n
        on_batch()

    pending = None
    for vb in split.batches(batch):
        preds = forward(vb.img)
        if stream is None:  # now, before the next replay of a graph overwrites its outputs
            post(vb, preds, None)
            continue
        # kept from the next replay, and from the allocator until the second stream is done with them
        preds = pytree.tree_map(lambda t: _kept_for(t[: vb.n].clone(), stream) if isinstance(t, torch.Tensor) else t,
                                preds)
        ready = torch.cuda.Event()
        ready.record()
        if pending is not None:
            with torch.cuda.stream(stream):
                post(*pending)
        pending = (vb, preds, ready)
    if pending is not None:
        with torch.cuda.stream(stream):
            post(*pending)
        torch.cuda.current_stream().wait_stream(stream)  # what it computed is read on this stream from here on
    stats = {k: (torch.cat(v).cpu().numpy() if v else np.zeros((0, 10) if k.startswith("tp") else 0))
             for k, v in out.items()}
    return PassResult(stats=stats, images=images, batches=batches, loss=loss)


def _kept_for(t: torch.Tensor, stream: torch.cuda.Stream) -> torch.Tensor:
    t.record_stream(stream)
    return t


def detections_of(det: Detections, i: int, kpt_shape=None, proto: torch.Tensor | None = None,
                  shape=None) -> dict[str, torch.Tensor]:
    """Image i's detections as DetectionValidator.postprocess returns them (PoseValidator's, given `kpt_shape`;
    SegmentationValidator's, given the batch's prototypes `proto` and input `shape` (H, W): their masks)."""
    n = int(det.count[i])
    out = {"bboxes": det.boxes[i, :n], "conf": det.conf[i, :n], "cls": det.cls[i, :n]}
    if kpt_shape is not None:
        out["keypoints"] = det.extra[i, :n].view(-1, *kpt_shape)
    if proto is not None:
        out["masks"] = predicted_masks(proto[i : i + 1], det.extra[i : i + 1, :n], det.boxes[i : i + 1, :n], shape)[0]
    return out

"""The YOLO detection loss as ddp-launch trains with it: normalised over the global batch, and without host syncs.

**The global normaliser.** Ultralytics' detection loss divides its box, class and DFL terms by `target_scores_sum`,
the total weight of the targets assigned *in the batch at hand*. Under DDP each rank would divide by its own shard's
total, so the averaged gradient would not be the gradient of the same loss on the whole global batch. Here every
rank divides by the mean of the ranks' totals (one scalar all-reduce per step, no host sync): a DDP step at world
size W x batch b equals a single-process step at batch W x b (tests/test_ddp_equivalence.py). The other tasks'
losses, built on this one, and the criterion a rank's step takes are task_loss.py's.

**Accumulated micro-batches** (train.accumulate) are normalised the same way, over the whole step: after
`defer_normaliser()` the loss divides by 1 and keeps each micro-batch's raw target weight; the step then divides the
summed gradients by `deferred_normaliser()`, the global normaliser of their total, once the last micro-batch is
back-propagated (every term of the loss is divided by the same normaliser, so the division can wait). YOLO26's
end-to-end loss has two branches, each with its own normaliser, and cannot defer: its micro-batches are normalised
each on its own.

**Sync-free** (`train.sync_free_loss`, on by default). Ultralytics 8.4.190's loss makes the host wait for the GPU
several times per step: it pads the targets to `counts.max()` (a device value the host reads), builds small tensors on
the CPU and copies them over, and gathers the assigner's candidates and the foreground anchors through `nonzero()`.
Each wait drains the GPU's queue. Without them the host queues the forward pass, the loss and the backward pass back
to back. The values are Ultralytics'; only how they are computed changes:

* targets are padded to the batch's largest per-image count, read by the host off the batch before it moved to the
  GPU (rank/data/pipeline.py, MAX_TARGETS); without it Ultralytics' own padding runs, with its sync;
* the anchor grid and the image-size vector are made once per feature-map shape;
* TaskAlignedAssigner scores every (image, target, anchor) triple densely instead of gathering candidates (above
  DENSE_LIMIT triples it uses Ultralytics' sparse path);
* BboxLoss computes CIoU and DFL for every anchor and zeroes them outside the foreground (torch.where, so the
  gradient outside is exactly zero) instead of indexing the foreground anchors;
* DFL weighs each bin's log-probability with a dense mask instead of gathering the two bins around the target
  (`dfl_loss`): a gather's backward is a scatter, which Ultralytics' default `deterministic=True` runs as a sort and an
  index_put, a measurable part of a yolov8s step (docs/benchmarks/h200-step/README.md). The same values, bit for
  bit.

Sums run over more (zero) terms in another order: the loss matches Ultralytics' to float rounding
(tests/test_loss.py compares values and gradients).

Reaches into Ultralytics: DetectionLoss re-implements v8DetectionLoss.get_assigned_targets_and_loss of 8.4.190 (the
normaliser is computed inline there) and overrides its preprocess; the dense assigner and box loss override
TaskAlignedAssigner.get_box_metrics/select_candidates_in_gts and BboxLoss.forward; `dfl_loss` re-states
DFLoss.__call__. E2ELoss (YOLO26) takes the loss class as an argument, so its two branches get these too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ultralytics.utils.loss import BboxLoss, v8DetectionLoss
from ultralytics.utils.metrics import bbox_iou
from ultralytics.utils.ops import xywh2xyxy, xyxy2xywh
from ultralytics.utils.tal import TaskAlignedAssigner, bbox2dist, make_anchors

from launcher.rank.data.pipeline import MAX_TARGETS

DENSE_LIMIT = 2**26  # (image, target, anchor) triples scored densely: 64 images x 120 targets x 8,400 anchors
PADDED_TARGETS = "padded_targets"  # batch key: the targets already padded (DetectionLoss.padded_targets)


def global_normaliser(raw_local: torch.Tensor) -> torch.Tensor:
    """What each rank divides by: the clamped total over all ranks, shared out equally.

    Summing the raw shares before Ultralytics' clamp(min=1) matters early in training, when the assigned target
    weight is below 1: clamping each rank's share would inflate the normaliser by up to the world size.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return raw_local.clamp(min=1)
    total = raw_local.detach().clone()
    dist.all_reduce(total)
    return total.clamp(min=1) / dist.get_world_size()


class DetectionLoss(v8DetectionLoss):
    def __init__(self, model, tal_topk: int = 10, tal_topk2: int | None = None, *, sync_free: bool = True):
        super().__init__(model, tal_topk, tal_topk2)
        self.sync_free = sync_free
        self._max_targets: int | None = None
        self._grids: dict = {}
        self._scales: dict = {}
        self._deferred: list[torch.Tensor] | None = None  # accumulating: each micro-batch's raw target weight
        if sync_free:
            a = self.assigner
            self.assigner = DenseTaskAlignedAssigner(topk=a.topk, num_classes=a.num_classes, alpha=a.alpha, beta=a.beta,
                                                     stride=a.stride, topk2=a.topk2)
            self.bbox_loss = DenseBboxLoss(self.reg_max).to(self.device)

    def defer_normaliser(self) -> None:
        """From now on divide by 1 and keep each batch's raw target weight (the micro-batches of one step)."""
        self._deferred = []

    def deferred_normaliser(self) -> torch.Tensor:
        """The global normaliser of the batches since defer_normaliser(); each batch is normalised again after."""
        total, self._deferred = torch.stack(self._deferred).sum(), None
        return global_normaliser(total)

    def preprocess(self, targets: torch.Tensor, batch_size: int, scale_tensor: torch.Tensor) -> torch.Tensor:
        n = self._max_targets if self.sync_free else None
        if n is None:
            return super().preprocess(targets, batch_size, scale_tensor)
        nl, ne = targets.shape
        out = torch.zeros(batch_size, n, ne - 1, device=self.device)
        if nl:  # Ultralytics' scatter, with the row count known (targets are grouped by image, in image order)
            batch_idx = targets[:, 0].long()
            offsets = torch.zeros(batch_size + 1, dtype=torch.long, device=self.device)
            offsets.scatter_add_(0, batch_idx + 1, torch.ones_like(batch_idx))
            offsets = offsets.cumsum(0)
            within_idx = torch.arange(nl, device=self.device) - offsets[batch_idx]
            out[batch_idx, within_idx] = targets[:, 1:]
            out[..., 1:5] = xywh2xyxy(out[..., 1:5].mul_(scale_tensor))
        return out

    def padded_targets(self, batch: dict, n: int | None) -> torch.Tensor:
        """The batch's targets as the loss reads them, padded to `n` per image (at least the batch's largest count;
        None: Ultralytics' own count, a sync): (images, n, 5) rows of class and xyxy box in pixels, zero rows after
        each image's own. Zero rows are masked out of the assignment, so any `n` gives the same loss; a fixed `n`
        gives the step fixed shapes (its CUDA graph, rank/step/captured_step.py). In the batch under PADDED_TARGETS
        the loss takes them as they are."""
        img = batch["img"]
        key = (tuple(img.shape[2:]), img.device)
        if key not in self._scales:  # (w, h, w, h), made once per image size: no copy to the device per step
            h, w = img.shape[2:]
            self._scales[key] = torch.tensor([w, h, w, h], dtype=torch.float32, device=self.device)
        targets = torch.cat((batch["batch_idx"].view(-1, 1), batch["cls"].view(-1, 1), batch["bboxes"]), 1)
        held, self._max_targets = self._max_targets, n
        try:
            return self.preprocess(targets.to(self.device), len(img), scale_tensor=self._scales[key])
        finally:
            self._max_targets = held

    def _grid(self, feats: list[torch.Tensor], dtype: torch.dtype):
        """(anchor points, stride per anchor, image size (h, w)); sync-free: once per feature-map shape (Ultralytics
        rebuilds them every step from CPU ranges and strides read back by the host). Nothing writes into them."""
        key = (tuple(tuple(f.shape[2:]) for f in feats), feats[0].dtype, dtype, feats[0].device)
        if key not in self._grids or not self.sync_free:
            anchor_points, stride_tensor = make_anchors(feats, self.stride, 0.5)
            imgsz = torch.tensor(feats[0].shape[2:], device=self.device, dtype=dtype) * self.stride[0]
            self._grids[key] = anchor_points, stride_tensor, imgsz
        return self._grids[key]

    def get_assigned_targets_and_loss(self, preds: dict, batch: dict, **assign_kwargs) -> tuple:
        """Ultralytics 8.4.190's method with the global normaliser, the host's target count and the cached grid."""
        loss = torch.zeros(3, device=self.device)  # box, cls, dfl
        pred_distri, pred_scores = (
            preds["boxes"].permute(0, 2, 1).contiguous(),
            preds["scores"].permute(0, 2, 1).contiguous(),
        )
        dtype = pred_scores.dtype
        anchor_points, stride_tensor, imgsz = self._grid(preds["feats"], dtype)

        targets = batch[PADDED_TARGETS] if PADDED_TARGETS in batch else self.padded_targets(batch, batch.get(MAX_TARGETS))
        gt_labels, gt_bboxes = targets.split((1, 4), 2)  # cls, xyxy
        mask_gt = gt_bboxes.sum(2, keepdim=True).gt_(0.0)

        pred_bboxes = self.bbox_decode(anchor_points, pred_distri)  # xyxy, (b, h*w, 4)
        _, target_bboxes, target_scores, fg_mask, target_gt_idx = self.assigner(
            pred_scores.detach().sigmoid(),
            (pred_bboxes.detach() * stride_tensor).type(gt_bboxes.dtype),
            anchor_points * stride_tensor,
            gt_labels,
            gt_bboxes,
            mask_gt,
            **assign_kwargs,
        )
        if self._deferred is None:
            target_scores_sum = global_normaliser(target_scores.sum())
        else:  # the step divides by the normaliser of the whole accumulated batch (module docstring)
            self._deferred.append(target_scores.sum().detach())
            target_scores_sum = torch.ones((), device=self.device)

        bce_loss = self.bce(pred_scores, target_scores.to(dtype))  # (bs, num_anchors, nc)
        if self.class_weights is not None:
            bce_loss *= self.class_weights
        loss[1] = bce_loss.sum() / target_scores_sum

        loss[0], loss[2] = self.bbox_loss(
            pred_distri,
            pred_bboxes,
            anchor_points,
            target_bboxes / stride_tensor,
            target_scores,
            target_scores_sum,
            fg_mask,
            imgsz,
            stride_tensor,
        )
        loss[0] *= self.hyp.box
        loss[1] *= self.hyp.cls
        loss[2] *= self.hyp.dfl
        return (
            (fg_mask, target_gt_idx, target_bboxes, anchor_points, stride_tensor),
            loss,
            dict(zip(self.loss_names, loss.detach())),
        )


class DenseTaskAlignedAssigner(TaskAlignedAssigner):
    """TaskAlignedAssigner scoring every (image, target, anchor) triple instead of gathering candidates."""

    def get_box_metrics(self, pd_scores, pd_bboxes, gt_labels, gt_bboxes, mask_gt, **extra):
        na = pd_bboxes.shape[-2]
        if extra or self.bs * self.n_max_boxes * na > DENSE_LIMIT:
            return super().get_box_metrics(pd_scores, pd_bboxes, gt_labels, gt_bboxes, mask_gt, **extra)
        mask = mask_gt.bool()  # (b, max_num_obj, h*w)
        labels = gt_labels.long().squeeze(-1)  # (b, max_num_obj)
        # the predicted score of each target's class at each anchor: (b, h*w, nc) -> (b, max_num_obj, h*w)
        scores = pd_scores.gather(2, labels.unsqueeze(1).expand(-1, na, -1)).transpose(1, 2)
        overlaps = self.iou_calculation(gt_bboxes.unsqueeze(2), pd_bboxes.unsqueeze(1))  # (b, max_num_obj, h*w)
        align_metric = torch.where(mask, scores.pow(self.alpha) * overlaps.pow(self.beta), 0)
        return align_metric, torch.where(mask, overlaps, 0).to(pd_bboxes.dtype)

    def select_candidates_in_gts(self, xy_centers, gt_bboxes, mask_gt, eps=1e-9):
        gt_bboxes_xywh = xyxy2xywh(gt_bboxes)
        wh_mask = gt_bboxes_xywh[..., 2:] < self.stride_val  # floor tiny sides so the pool grows monotonically
        gt_bboxes_xywh[..., 2:] = torch.where((wh_mask * mask_gt).bool(), float(self.stride_val), gt_bboxes_xywh[..., 2:])
        gt_bboxes = xywh2xyxy(gt_bboxes_xywh)

        lt, rb = gt_bboxes.unsqueeze(2).chunk(2, 3)  # (b, n_boxes, 1, 2) left-top, right-bottom
        mask = xy_centers[:, 0] - lt[..., 0] > eps
        mask &= xy_centers[:, 1] - lt[..., 1] > eps
        mask &= rb[..., 0] - xy_centers[:, 0] > eps
        mask &= rb[..., 1] - xy_centers[:, 1] > eps
        return mask


class DenseBboxLoss(BboxLoss):
    """BboxLoss over every anchor, zero outside the foreground, instead of indexing the foreground."""

    def forward(self, pred_dist, pred_bboxes, anchor_points, target_bboxes, target_scores, target_scores_sum, fg_mask,
                imgsz, stride):
        if self.dfl_loss is None:  # the L1 variant (reg_max 1) keeps Ultralytics' code
            return super().forward(pred_dist, pred_bboxes, anchor_points, target_bboxes, target_scores,
                                   target_scores_sum, fg_mask, imgsz, stride)
        fg = fg_mask.unsqueeze(-1)  # (b, h*w, 1)
        weight = torch.where(fg, target_scores.sum(-1, keepdim=True), 0)
        iou = bbox_iou(pred_bboxes, target_bboxes, xywh=False, CIoU=True)  # (b, h*w, 1)
        loss_iou = (torch.where(fg, 1.0 - iou, 0) * weight).sum() / target_scores_sum

        reg_max = self.dfl_loss.reg_max
        target_ltrb = bbox2dist(anchor_points, target_bboxes, reg_max - 1)  # (b, h*w, 4)
        dfl = dfl_loss(pred_dist.reshape(-1, reg_max), target_ltrb.reshape(-1, 4), reg_max).view(fg.shape)
        loss_dfl = (torch.where(fg, dfl, 0) * weight).sum() / target_scores_sum
        return loss_iou, loss_dfl



def dfl_loss(pred_dist: torch.Tensor, target: torch.Tensor, reg_max: int) -> torch.Tensor:
    """DFLoss.__call__ of 8.4.190 (the distribution focal loss of each box side, averaged over the four), with each
    bin's weight a dense mask: wl at the bin left of the target, wr at the bin right of it, zero elsewhere. Adding the
    zero terms changes no bit of the sum, and the backward is a product instead of a scatter (module docstring)."""
    target = target.clamp(0, reg_max - 1 - 0.01)
    left = target.long()  # the bin left of the target
    wl = (left + 1) - target  # weight left
    wr = 1 - wl  # weight right
    bins = torch.arange(reg_max, device=pred_dist.device)
    left, wl, wr = left.view(-1, 1), wl.view(-1, 1), wr.view(-1, 1)
    weight = torch.where(bins == left, wl, torch.where(bins == left + 1, wr, 0))
    return -(F.log_softmax(pred_dist, dim=1) * weight).sum(1).view(target.shape).mean(-1, keepdim=True)

"""The YOLO detection loss without host synchronisations (`train.sync_free_loss`, on by default).

Ultralytics 8.4.190's detection loss makes the host wait for the GPU several times per step: it pads the targets to
`counts.max()` (a device value read by the host), builds small tensors on the CPU and copies them over (a blocking
copy synchronises the stream), and gathers the assigner's candidates and the loss's foreground anchors through
`nonzero()` (whose output size the host must read). Each wait drains the GPU's queue: the forward pass has to finish
before the host launches the loss, and the GPU then idles while the host launches the loss's ~700 small kernels one
by one. On the H200 the profile showed 16 stream synchronisations per step and the GPU 19 % idle in the data-free
step (docs/benchmarks/README.md). Without them the host can queue the forward pass, the loss and the backward pass
back to back. Measured: 16 syncs per step before, 2 after (two scalar fills, cached since; not yet re-measured).

The values are Ultralytics'; only how they are computed changes:

* Targets are padded to the batch's largest per-image count, which the host reads off the batch before it moves
  to the GPU (`max_targets_per_image`, stored as `batch["max_targets"]`). Labels made on the GPU
  (`loader.gpu_augment`) are counted where they are made, on the stream that augments (the side stream when the
  batch is fetched ahead). Without the count Ultralytics' own padding runs, with its sync.
* The anchor grid and the image-size vector are made once per feature-map shape (Ultralytics rebuilds them every
  step from CPU ranges and lists, and device strides read back by the host); the assigner's stride floor is a
  Python number, not a tensor copied from the CPU.
* TaskAlignedAssigner scores every (image, target, anchor) triple densely instead of gathering the candidates
  through `nonzero()`; the candidates' values are the same numbers, the others are masked to zero as before.
  Dense costs memory (a few temporaries of images x targets x anchors): above DENSE_LIMIT triples the assigner uses
  Ultralytics' sparse path.
* BboxLoss computes CIoU and DFL for every anchor and zeroes them outside the foreground (torch.where, so the
  gradient outside is exactly zero) instead of indexing the foreground anchors.

Sums run over more (zero) terms in another order: the loss matches Ultralytics' to float rounding
(tests/test_fast_loss.py compares values and gradients). The classes are swapped on the criterion's own objects
(`make_sync_free`), only where they are exactly Ultralytics' detection classes; anything else is left alone.
"""

from __future__ import annotations

import torch
from ultralytics.utils.loss import BboxLoss, v8DetectionLoss
from ultralytics.utils.metrics import bbox_iou
from ultralytics.utils.ops import xywh2xyxy, xyxy2xywh
from ultralytics.utils.tal import TaskAlignedAssigner, bbox2dist, make_anchors

DENSE_LIMIT = 2**26  # (image, target, anchor) triples scored densely: 64 images x 120 targets x 8,400 anchors
MAX_TARGETS = "max_targets"  # the batch key: the largest number of targets in one image, known to the host


def max_targets_per_image(batch_idx: torch.Tensor, batch_size: int, *, read_device: bool = False) -> int | None:
    """The largest number of targets in one image of the batch. From labels on the CPU it costs nothing; from labels
    on a GPU only with `read_device` (one number read back: a sync on the current stream), else None."""
    if batch_idx.device.type != "cpu" and not read_device:
        return None
    if batch_idx.numel() == 0:
        return 0
    return int(torch.bincount(batch_idx.long(), minlength=batch_size).max())


class SyncFreeDetectionLoss(v8DetectionLoss):
    """v8DetectionLoss whose padding size comes from the host and whose anchor grid and image size are cached."""

    _max_targets: int | None = None

    def preprocess(self, targets: torch.Tensor, batch_size: int, scale_tensor: torch.Tensor) -> torch.Tensor:
        n = self._max_targets
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

    def _grid(self, feats: list[torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(anchor points, stride per anchor, image size (h, w)), once per feature-map shape. Ultralytics rebuilds
        them every step: make_anchors from CPU ranges and device strides read back by the host (9 syncs for 3
        levels), the image size copied from a CPU list (1 sync). Nothing writes into the cached tensors."""
        key = (tuple(tuple(f.shape[2:]) for f in feats), feats[0].dtype, dtype, feats[0].device)
        cache = self.__dict__.setdefault("_grid_cache", {})
        if key not in cache:
            anchor_points, stride_tensor = make_anchors(feats, self.stride, 0.5)
            imgsz = torch.tensor(feats[0].shape[2:], device=self.device, dtype=dtype) * self.stride[0]
            cache[key] = anchor_points, stride_tensor, imgsz
        return cache[key]

    def get_assigned_targets_and_loss(self, preds: dict, batch: dict, **assign_kwargs) -> tuple:
        """Ultralytics 8.4.190's method, with the anchor grid and the image size cached per feature-map shape."""
        self._max_targets = batch.get(MAX_TARGETS)
        loss = torch.zeros(3, device=self.device)  # box, cls, dfl
        pred_distri, pred_scores = (
            preds["boxes"].permute(0, 2, 1).contiguous(),
            preds["scores"].permute(0, 2, 1).contiguous(),
        )
        dtype = pred_scores.dtype
        batch_size = pred_scores.shape[0]
        anchor_points, stride_tensor, imgsz = self._grid(preds["feats"], dtype)

        targets = torch.cat((batch["batch_idx"].view(-1, 1), batch["cls"].view(-1, 1), batch["bboxes"]), 1)
        scale = imgsz.flip(0).repeat(2)  # (w, h, w, h): imgsz[[1, 0, 1, 0]] without copying an index to the GPU
        targets = self.preprocess(targets.to(self.device), batch_size, scale_tensor=scale)
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
        target_scores_sum = target_scores.sum().clamp_(min=1)

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
        dfl = self.dfl_loss(pred_dist.reshape(-1, reg_max), target_ltrb.reshape(-1, 4)).view(fg.shape)
        loss_dfl = (torch.where(fg, dfl, 0) * weight).sum() / target_scores_sum
        return loss_iou, loss_dfl


def make_sync_free(criterion) -> int:
    """Swap the classes of `criterion`'s detection losses (and their assigner and box loss) for the sync-free ones.

    Only objects of exactly Ultralytics' classes are touched: a subclass (segmentation, pose, OBB) may rely on what
    is replaced. Returns how many detection losses were made sync-free."""
    found = [criterion] + [getattr(criterion, name, None) for name in ("one2many", "one2one")]
    done = 0
    for loss in found:
        if type(loss) is not v8DetectionLoss:
            continue
        if type(loss.assigner) is not TaskAlignedAssigner or type(loss.bbox_loss) is not BboxLoss:
            continue
        loss.__class__ = SyncFreeDetectionLoss
        loss.assigner.__class__ = DenseTaskAlignedAssigner
        loss.bbox_loss.__class__ = DenseBboxLoss
        done += 1
    return done

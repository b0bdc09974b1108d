"""The loss of each task as ddp-launch trains with it, and the criterion a rank's step takes (training_criterion).

Detection's loss is loss.py's DetectionLoss: normalised over the global batch and sync-free. Segmentation and pose take
their box, class and DFL terms from it (TaskLoss) and normalise their own terms over the ranks' foreground; the mask
term is computed over the whole batch's foreground at once (mask_loss) where Ultralytics loops over the images with
two host syncs each. The rotated-box loss is Ultralytics' own with its normaliser made global (OBBLoss), the
classification loss a sum over the images (ClassificationLoss). Each equals Ultralytics' on one process to float
rounding (tests/test_tasks.py, tests/test_task_loss.py).

Reaches into Ultralytics: v8SegmentationLoss.calculate_segmentation_loss re-stated over the batch (mask_loss: its
single_mask_loss per foreground anchor), its and v8PoseLoss.calculate_keypoints_loss rescaled, their
get_assigned_targets_and_loss handed to DetectionLoss; v8OBBLoss's assigner wrapped and its .loss rescaled;
v8ClassificationLoss.__call__ multiplied by the batch's images.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from ultralytics.utils.loss import (E2ELoss, v8ClassificationLoss, v8DetectionLoss, v8OBBLoss, v8PoseLoss,
                                   v8SegmentationLoss)
from ultralytics.utils.ops import crop_mask, xyxy2xywh

from launcher.rank.ultralytics.loss import DetectionLoss, global_normaliser


def training_criterion(model, sync_free: bool = True):
    """(the criterion the training step uses, whether it is normalised over the ranks), for the loss Ultralytics
    would build for `model` (init_criterion): a v8DetectionLoss, or YOLO26's E2ELoss of two, becomes DetectionLoss;
    v8SegmentationLoss and v8PoseLoss take their box, class and DFL terms from one (TaskLoss), v8OBBLoss its
    normaliser (OBBLoss); v8ClassificationLoss, a mean, is summed over the images (ClassificationLoss). Any other loss
    (YOLO26's segmentation, pose and obb) is Ultralytics' own, normalised per rank."""
    default = model.init_criterion()
    if type(default) is v8ClassificationLoss:
        return ClassificationLoss(), True
    loss = partial(DetectionLoss, sync_free=sync_free)
    if type(default) is v8DetectionLoss:
        return loss(model, tal_topk=default.assigner.topk, tal_topk2=default.assigner.topk2), True
    if type(default) is E2ELoss and type(default.one2many) is v8DetectionLoss:
        return E2ELoss(model, loss), True
    if type(default) in TASK_LOSSES:
        return TASK_LOSSES[type(default)](model, tal_topk=default.assigner.topk, tal_topk2=default.assigner.topk2,
                                          sync_free=sync_free), True
    return default, False


class ClassificationLoss(v8ClassificationLoss):
    """Ultralytics' cross-entropy (a mean over the batch) as the step takes every loss: summed over the rank's images
    (the mean times their number); the step's loss scale divides it by the rank's batch (plan/task_rules.py
    TaskRules.loss_base), and DDP's gradient average over equal batches is then the mean over the global batch, the
    gradient one process takes on the whole of it. Nothing is shared between the ranks. Its item stays Ultralytics'
    mean."""

    def __call__(self, preds, batch: dict) -> tuple:
        loss, items = super().__call__(preds, batch)
        return loss * len(batch["cls"]), items


class TaskLoss:
    """Ultralytics' segmentation or pose loss (the class after this one in the bases), normalised over the ranks.

    Its box, class and DFL terms come from a DetectionLoss (get_assigned_targets_and_loss, which both call first):
    normalised over the ranks and sync-free as for detection, and the assignment they return is the one the mask and
    keypoint terms use. Those terms are divided by the rank's foreground anchors (the mask term) or averaged over
    them (the keypoint terms): here by the mean over the ranks of the foreground anchors instead (one more scalar
    all-reduce per step), so that a DDP step at world size W x batch b equals a single-process step at W x b
    (tests/test_tasks.py). Nothing is deferred over accumulated micro-batches (no defer_normaliser): each is
    normalised on its own, as YOLO26's end-to-end loss is."""

    def __init__(self, model, tal_topk: int = 10, tal_topk2: int | None = None, *, sync_free: bool = True):
        super().__init__(model, tal_topk, tal_topk2)
        self.sync_free = sync_free
        self.boxes = DetectionLoss(model, tal_topk, tal_topk2, sync_free=sync_free)
        self.foreground: torch.Tensor | None = None  # this step's foreground anchors, the ranks' mean

    def get_assigned_targets_and_loss(self, preds: dict, batch: dict, **assign_kwargs) -> tuple:
        assigned = self.boxes.get_assigned_targets_and_loss(preds, batch, **assign_kwargs)
        fg_mask = assigned[0][0]
        self.foreground = global_normaliser(fg_mask.sum().float())  # on every rank, every step: a collective
        return assigned

    def share(self, fg_mask: torch.Tensor) -> torch.Tensor:
        """What turns a term normalised by this rank's foreground anchors into one normalised by the ranks' mean."""
        return fg_mask.sum() / self.foreground


class SegmentationLoss(TaskLoss, v8SegmentationLoss):
    """Sync-free, the mask term over the batch at once (mask_loss); else Ultralytics' loop over the images."""

    def calculate_segmentation_loss(self, fg_mask, *args):
        term = (mask_loss(fg_mask, *args, overlap=self.overlap) if self.sync_free
                else super().calculate_segmentation_loss(fg_mask, *args))
        return term * self.share(fg_mask)


class PoseLoss(TaskLoss, v8PoseLoss):
    def calculate_keypoints_loss(self, masks, *args):
        location, visibility = super().calculate_keypoints_loss(masks, *args)
        share = self.share(masks)
        return location * share, visibility * share


class OBBLoss(v8OBBLoss):
    """Ultralytics' rotated-box loss, normalised over the ranks: each of its terms (box, class, DFL, angle) is
    divided by the rank's clamped target weight (target_scores_sum); rescaled here to the global normaliser's
    division. Its own code runs (eager, with its host syncs); the assigner is wrapped to read the raw weight."""

    def __init__(self, model, tal_topk: int = 10, tal_topk2: int | None = None, *, sync_free: bool = True):
        super().__init__(model, tal_topk, tal_topk2)
        self._assign, self.assigner = self.assigner, self._assigned
        self._weight: torch.Tensor | None = None  # this batch's raw target weight, read off the assignment

    def _assigned(self, *args, **kwargs):
        out = self._assign(*args, **kwargs)
        self._weight = out[2].sum().detach()  # target_scores, as Ultralytics sums it
        return out

    def loss(self, preds: dict, batch: dict) -> tuple:
        loss, items = super().loss(preds, batch)
        share = self._weight.clamp(min=1) / global_normaliser(self._weight)  # on every rank, every step
        return loss * share, {k: v * share for k, v in items.items()}


TASK_LOSSES = {v8SegmentationLoss: SegmentationLoss, v8PoseLoss: PoseLoss, v8OBBLoss: OBBLoss}  # Ultralytics' -> ours


def mask_loss(fg_mask, masks, target_gt_idx, target_bboxes, batch_idx, proto, pred_masks, imgsz, *,
              overlap: bool) -> torch.Tensor:
    """v8SegmentationLoss.calculate_segmentation_loss of 8.4.190 (its arguments, its value) over the batch's
    foreground anchors at once: each anchor's binary cross-entropy between its predicted mask and its target's, kept
    inside the target's box, averaged over the mask and divided by the box's area (single_mask_loss), summed, then
    divided by the foreground anchors. Ultralytics loops over the images and makes the host wait for the GPU twice in
    each (`fg_mask_i.any()`, then the boolean index); here the host waits once, for the foreground's positions. The
    products with the prototypes stay per image (a few small matrix products; gathering each anchor's prototypes
    would take 32 times the masks' memory). The targets are grouped by image in image order, as collated."""
    _, _, mask_h, mask_w = proto.shape
    image, anchor = fg_mask.nonzero(as_tuple=True)  # the one wait: image-major, each image's anchors in order
    sizes = fg_mask.sum(1).tolist()  # read once the queue has drained there
    gt_idx = target_gt_idx[image, anchor]
    box = target_bboxes[image, anchor] / imgsz[[1, 0, 1, 0]]  # xyxy, 0-1
    area = xyxy2xywh(box)[:, 2:].prod(1)
    box = box * torch.tensor([mask_w, mask_h, mask_w, mask_h], device=proto.device)  # at the prototypes' size
    if overlap:  # one mask per image, object k drawn as k + 1
        gt = (masks[image] == (gt_idx + 1).view(-1, 1, 1)).float()
    else:  # a mask per object, the images' objects one after the other
        per_image = torch.zeros(len(fg_mask), dtype=torch.long, device=masks.device)
        per_image.index_add_(0, batch_idx.view(-1).long(), torch.ones_like(batch_idx.view(-1), dtype=torch.long))
        gt = masks[(per_image.cumsum(0) - per_image)[image] + gt_idx]
    coefficients = pred_masks[image, anchor].split(sizes)
    pred = torch.cat([torch.einsum("in,nhw->ihw", c, p) for c, p, n in zip(coefficients, proto, sizes) if n])
    loss = F.binary_cross_entropy_with_logits(pred, gt, reduction="none")
    return (crop_mask(loss, box).mean(dim=(1, 2)) / area).sum() / fg_mask.sum()

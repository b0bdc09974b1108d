"""Ultralytics' non_max_suppression for validation, over the whole batch at once.

Ultralytics 8.4.190 (utils/nms.py) loops over the images of a batch, and per image calls torchvision's NMS, which
makes the host wait for the GPU: hundreds of small launches and a sync per image. Here every image's candidates are
ranked by one topk, the pairwise suppression of each image's candidates is one batched IoU, and greedy NMS is solved
for every image at once by fixed-point iteration: `keep[j] = not any(keep[i] and iou[i, j] > thr for i before j)`.
Iterating that map from "every candidate kept", the first t candidates are right after t rounds, and a round that
changes nothing has reached the one fixed point, which is greedy NMS's answer; clusters of boxes chain only a few
deep, so a few rounds suffice.

Semantics are Ultralytics' for the validator's call (multi_label=True, conf 0.001, iou 0.7, max_det): candidates
are (anchor, class) pairs scoring above `conf` (the best class only without multi_label, or with one class), at most
`max_nms` of the highest, boxes offset by class x `max_wh` unless agnostic, suppression where IoU > `iou`, the first
`max_det` survivors in descending score order, equal scores in anchor-then-class order (torchvision sorts stably;
fp16 scores tie often, and the order decides which of two tied boxes survives). End-to-end heads (YOLO26 with nms=False) only filter by `conf` and
keep the first `max_det`. Not reproduced: Ultralytics' time limit (2 s + 0.05 s per image), after which it drops the
remaining images of the batch; and, above `max_nms` candidates in an image, which of those tied at the cut are kept
(Ultralytics' argsort there is unstable).
Images with more than LARGE candidates go through torchvision's NMS one by one, as in Ultralytics (a matrix of
LARGE^2 per image is the most this holds in memory).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

LARGE = 2048  # candidates per image above which the image takes torchvision's NMS on its own
MATRIX_ELEMENTS = 2**25  # pairwise IoUs computed at once (a few temporaries of 128 MiB each)


class Detections(NamedTuple):
    """Per image, its first `count[b]` rows: boxes (B, K, 4) xyxy in input pixels, conf (B, K), cls (B, K) (float32)."""

    boxes: torch.Tensor
    conf: torch.Tensor
    cls: torch.Tensor
    count: torch.Tensor

    def valid(self) -> torch.Tensor:
        """(B, K) True on each image's detections."""
        return torch.arange(self.conf.shape[1], device=self.conf.device) < self.count[:, None]


def xywh2xyxy(x: torch.Tensor) -> torch.Tensor:
    """Ultralytics' ops.xywh2xyxy, in the same operations (so in the same rounding)."""
    y = torch.empty_like(x)
    xy, wh = x[..., :2], x[..., 2:] / 2
    y[..., :2] = xy - wh
    y[..., 2:] = xy + wh
    return y


def batched_nms(prediction, conf: float, iou: float, *, max_det: int, multi_label: bool = True,
                agnostic: bool = False, nc: int = 0, max_nms: int = 30000, max_wh: int = 7680,
                end2end: bool = False) -> Detections:
    """`prediction`: the head's inference output (B, 4 + nc [+ extra], anchors) of xywh boxes and class scores, or
    an end-to-end head's (B, N, 6) rows of x1, y1, x2, y2, score, class (or the tuple the model returns in eval)."""
    if isinstance(prediction, (list, tuple)):
        prediction = prediction[0]
    if prediction.shape[-1] == 6 or end2end:
        return _end2end(prediction, conf, max_det)
    b, channels, anchors = prediction.shape
    nc = nc or channels - 4
    device = prediction.device
    x = prediction.transpose(-1, -2)  # (B, anchors, C), in the prediction's dtype as Ultralytics computes
    scores = x[..., 4 : 4 + nc]
    if multi_label and nc > 1:  # every (anchor, class) pair above conf; flattened anchor-major, as torch.where orders
        above = scores > conf
        flat = scores.reshape(b, -1)
        cls_of = torch.arange(nc, device=device).repeat(anchors)
        anchor_of = torch.arange(anchors, device=device).repeat_interleave(nc)
    else:  # the best class only
        best, j = scores.max(-1)
        above = best > conf
        flat, cls_of, anchor_of = best, None, torch.arange(anchors, device=device)
    counts = above.reshape(b, -1).sum(1)
    top = int(counts.max()) if b else 0  # the one host read: how many candidates the busiest image has
    out_k = min(max_det, top)
    boxes_out = torch.zeros((b, out_k, 4), device=device)
    conf_out = torch.zeros((b, out_k), device=device)
    cls_out = torch.zeros((b, out_k), device=device)
    count_out = torch.zeros(b, dtype=torch.int64, device=device)
    if top == 0:
        return Detections(boxes_out, conf_out, cls_out, count_out)
    k = min(top, max_nms)
    masked = torch.where(above.reshape(b, -1), flat, torch.full_like(flat, -1))
    # descending score, equal scores in candidate order: torchvision's NMS sorts stably over Ultralytics' candidates
    cand_score, cand = (t[:, :k] for t in masked.sort(dim=1, descending=True, stable=True))
    cand_valid = torch.arange(k, device=device) < counts.clamp(max=max_nms)[:, None]
    anchor = anchor_of[cand]
    cand_cls = (cls_of[cand] if cls_of is not None else j.gather(1, anchor)).float()
    box = xywh2xyxy(x[..., :4]).gather(1, anchor[..., None].expand(b, k, 4)).float()
    cand_score = cand_score.float()
    offset = box + cand_cls[..., None] * (0 if agnostic else max_wh)

    keep = torch.zeros((b, k), dtype=torch.bool, device=device)
    large = (counts > LARGE).tolist()
    small = [i for i in range(b) if not large[i]]
    if small:
        width = min(k, LARGE)
        rows = max(1, MATRIX_ELEMENTS // (width * width))
        for start in range(0, len(small), rows):
            idx = torch.tensor(small[start : start + rows], device=device)
            keep[idx, :width] = _greedy(offset[idx, :width], cand_valid[idx, :width], iou)
    if any(large):
        import torchvision  # Ultralytics' path, image by image

        for i in (i for i in range(b) if large[i]):
            n = int(cand_valid[i].sum())
            kept = torchvision.ops.nms(offset[i, :n], cand_score[i, :n], iou)
            keep[i, kept] = True
    rank = keep.cumsum(1)
    keep &= rank <= max_det
    count_out = keep.sum(1)
    slot = torch.where(keep, rank - 1, out_k)  # each survivor's row in the output; the rest to a spare row
    for dst, src in ((boxes_out, box), (conf_out, cand_score), (cls_out, cand_cls)):
        spare = torch.zeros((b, out_k + 1, *dst.shape[2:]), dtype=dst.dtype, device=device)
        spare.scatter_(1, slot.view(b, k, *([1] * (dst.dim() - 2))).expand_as(src), src)
        dst.copy_(spare[:, :out_k])
    return Detections(boxes_out, conf_out, cls_out, count_out)


def pairwise_iou(boxes: torch.Tensor) -> torch.Tensor:
    """(B, K, K) IoU of each image's boxes with each other, as torchvision's NMS computes it."""
    x1, y1, x2, y2 = boxes.unbind(-1)
    area = (x2 - x1) * (y2 - y1)
    w = (torch.minimum(x2[:, :, None], x2[:, None, :]) - torch.maximum(x1[:, :, None], x1[:, None, :])).clamp(min=0)
    h = (torch.minimum(y2[:, :, None], y2[:, None, :]) - torch.maximum(y1[:, :, None], y1[:, None, :])).clamp(min=0)
    inter = w * h
    return inter / (area[:, :, None] + area[:, None, :] - inter)


def _greedy(boxes: torch.Tensor, valid: torch.Tensor, iou: float) -> torch.Tensor:
    """Greedy NMS of each image's candidates (sorted by descending score) at once: which are kept."""
    k = boxes.shape[1]
    later = torch.ones((k, k), dtype=torch.bool, device=boxes.device).triu(1)
    suppresses = (pairwise_iou(boxes) > iou) & later & valid[:, :, None]  # [b, i, j]: i, if kept, removes j
    s = suppresses.to(torch.float16 if boxes.is_cuda else torch.float32)
    keep = valid.clone()
    while True:
        hit = torch.bmm(keep.to(s.dtype)[:, None, :], s)[:, 0] > 0
        new = valid & ~hit
        if torch.equal(new, keep):
            return keep
        keep = new


def _end2end(prediction: torch.Tensor, conf: float, max_det: int) -> Detections:
    """An end-to-end head's rows above `conf`, the first `max_det` of each image."""
    b, n = prediction.shape[:2]
    above = prediction[..., 4] > conf
    rank = above.cumsum(1)
    keep = above & (rank <= max_det)
    out_k = min(max_det, n)
    slot = torch.where(keep, rank - 1, out_k)
    rows = torch.zeros((b, out_k + 1, 6), device=prediction.device)
    rows.scatter_(1, slot[..., None].expand(b, n, 6), prediction[..., :6].float())
    rows = rows[:, :out_k]
    return Detections(rows[..., :4], rows[..., 4], rows[..., 5], keep.sum(1))

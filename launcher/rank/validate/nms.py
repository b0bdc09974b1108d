"""Ultralytics' non_max_suppression for validation, over the whole batch at once.

Ultralytics 8.4.190 (utils/nms.py) loops over the images of a batch, and per image calls torchvision's NMS, which
makes the host wait for the GPU: hundreds of small launches and a sync per image. Here every image's candidates are
ranked by one sort, and greedy NMS runs for every image at once: on CUDA one Triton program per image scans its
sorted candidates, keeping each that no kept one before it suppresses (scans.py); elsewhere, where a call costs no
sync, torchvision's NMS runs image by image, as in Ultralytics.

Semantics are Ultralytics' for the validator's call (multi_label=True, conf 0.001, iou 0.7, max_det): candidates
are (anchor, class) pairs scoring above `conf` (the best class only without multi_label, or with one class), at most
`max_nms` of the highest, boxes offset by class x `max_wh` unless agnostic, suppression where IoU > `iou`, the first
`max_det` survivors in descending score order, equal scores in anchor-then-class order (torchvision sorts stably;
fp16 scores tie often, and the order decides which of two tied boxes survives). End-to-end heads (YOLO26 with nms=False) only filter by `conf` and
keep the first `max_det`. Not reproduced: Ultralytics' time limit (2 s + 0.05 s per image), after which it drops the
remaining images of the batch; and, above `max_nms` candidates in an image, which of those tied at the cut are kept
(Ultralytics' argsort there is unstable).
A weak model (the first epochs) gives every anchor a candidate, tens of thousands per image, most of them suppressed.
An image's scan stops once it has max_det survivors, since no later candidate can change its first max_det. On CUDA
the Triton program goes through an image's candidates a tile at a time, each tile losing first to the survivors of
the tiles before it (scans.py); elsewhere the host does the same CHUNK candidates at a time, torchvision's NMS
within a chunk.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from launcher.rank.kernels import scans

CHUNK = 2048  # candidates per image suppressed at once on the host (no Triton)
MATRIX_ELEMENTS = 2**26  # IoUs of earlier survivors with a chunk's candidates computed at once (temporaries of 256 MiB)


class Detections(NamedTuple):
    """Per image, its first `count[b]` rows: boxes (B, K, 4) xyxy in input pixels, conf (B, K), cls (B, K) (float32);
    `extra` (B, K, E): the head's channels after the class scores (a pose head's keypoints), or None without them."""

    boxes: torch.Tensor
    conf: torch.Tensor
    cls: torch.Tensor
    count: torch.Tensor
    extra: torch.Tensor | None = None

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
    an end-to-end head's (B, N, 6 [+ extra]) rows of x1, y1, x2, y2, score, class (or the tuple the model returns in
    eval). With `nc` given, the channels after the scores come with each detection (Detections.extra, float32), as
    Ultralytics' non_max_suppression keeps them for a pose head's keypoints."""
    if isinstance(prediction, (list, tuple)):
        prediction = prediction[0]
    if prediction.shape[-1] == 6 or end2end:
        return _end2end(prediction, conf, max_det)
    b, channels, anchors = prediction.shape
    nc = nc or channels - 4
    extra = channels - 4 - nc
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
    if top == 0:
        return Detections(torch.zeros((b, 0, 4), device=device), torch.zeros((b, 0), device=device),
                          torch.zeros((b, 0), device=device), torch.zeros(b, dtype=torch.int64, device=device),
                          torch.zeros((b, 0, extra), device=device) if extra else None)
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

    if scans.usable(offset):  # one program per image over all its candidates, stopped at max_det survivors
        keep = scans.greedy_nms(offset, cand_valid, iou, limit=max_det)
    else:
        keep = _greedy_in_chunks(offset, cand_valid, iou, max_det)
    keep &= keep.cumsum(1) <= max_det
    kept = (_first_kept(t, keep, out_k) for t in (box, cand_score, cand_cls))
    channels = None
    if extra:  # the survivors' own channels only (a weak model's candidates are tens of thousands per image)
        kept_anchor = _first_kept(anchor, keep, out_k)  # a padding row reads anchor 0, never counted
        channels = x[..., 4 + nc :].gather(1, kept_anchor[..., None].expand(b, out_k, extra)).float()
    return Detections(*kept, keep.sum(1), channels)


def box_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(B, M, N) IoU of each image's boxes `a` (B, M, 4) with its boxes `b` (B, N, 4), as torchvision's NMS
    computes it."""
    ax1, ay1, ax2, ay2 = (t[:, :, None] for t in a.unbind(-1))
    bx1, by1, bx2, by2 = (t[:, None, :] for t in b.unbind(-1))
    w = (torch.minimum(ax2, bx2) - torch.maximum(ax1, bx1)).clamp(min=0)
    h = (torch.minimum(ay2, by2) - torch.maximum(ay1, by1)).clamp(min=0)
    inter = w * h
    return inter / ((ax2 - ax1) * (ay2 - ay1) + (bx2 - bx1) * (by2 - by1) - inter)


def _greedy_in_chunks(boxes: torch.Tensor, valid: torch.Tensor, iou: float, max_det: int) -> torch.Tensor:
    """Greedy NMS of every image's candidates (sorted by descending score; `valid` a prefix of each row), CHUNK
    candidates at a time, until an image has max_det survivors or no candidates left: which are kept."""
    b, k = valid.shape
    keep = torch.zeros_like(valid)
    todo = torch.arange(b, device=valid.device)  # the images whose survivors are not all known yet
    for start in range(0, k, CHUNK):
        end = min(start + CHUNK, k)
        if start:
            todo = todo[(keep[todo].sum(1) < max_det) & valid[todo, start]]  # a host read per chunk after the first
            if len(todo) == 0:
                break
        width = end - start
        rows = max(1, MATRIX_ELEMENTS // (max_det * width))
        for first in range(0, len(todo), rows):
            idx = todo[first : first + rows]
            chunk, alive = boxes[idx, start:end], valid[idx, start:end]
            if start:  # fewer than max_det survivors so far: compact them, then their IoU with the chunk's candidates
                kept = _first_kept(boxes[idx, :start], keep[idx, :start], max_det)
                count = keep[idx, :start].sum(1)
                alive = alive & ~((box_iou(kept, chunk) > iou) & (torch.arange(max_det, device=idx.device)
                                                                  < count[:, None])[:, :, None]).any(1)
            keep[idx, start:end] = _torchvision_nms(chunk, alive, iou)
    return keep


def _first_kept(rows: torch.Tensor, keep: torch.Tensor, n: int) -> torch.Tensor:
    """Each image's first `n` rows where `keep` (B, K) is True, in order: (B, n, ...) from `rows` (B, K, ...), zeros
    after them (a row past the n-th goes to a spare slot, dropped)."""
    b, k = keep.shape
    slot = torch.where(keep, keep.cumsum(1) - 1, n).clamp(max=n)
    out = torch.zeros((b, n + 1, *rows.shape[2:]), dtype=rows.dtype, device=rows.device)
    out.scatter_(1, slot.view(b, k, *([1] * (rows.dim() - 2))).expand_as(rows), rows)
    return out[:, :n]


def _torchvision_nms(boxes: torch.Tensor, valid: torch.Tensor, iou: float) -> torch.Tensor:
    """torchvision.ops.nms of each image's valid candidates, ranked by a score that keeps their order (they are
    sorted already, equal scores included)."""
    import torchvision  # imported by Ultralytics already

    b, k = valid.shape
    keep = torch.zeros_like(valid)
    rank = torch.arange(k, 0, -1, dtype=torch.float32, device=boxes.device)
    for i in range(b):
        idx = valid[i].nonzero()[:, 0]
        keep[i, idx[torchvision.ops.nms(boxes[i, idx].float(), rank[idx], iou)]] = True
    return keep


def _end2end(prediction: torch.Tensor, conf: float, max_det: int) -> Detections:
    """An end-to-end head's rows above `conf`, the first `max_det` of each image (the columns after the sixth as
    `extra`)."""
    b, n, columns = prediction.shape
    above = prediction[..., 4] > conf
    rank = above.cumsum(1)
    keep = above & (rank <= max_det)
    out_k = min(max_det, n)
    slot = torch.where(keep, rank - 1, out_k)
    rows = torch.zeros((b, out_k + 1, columns), device=prediction.device)
    rows.scatter_(1, slot[..., None].expand(b, n, columns), prediction.float())
    rows = rows[:, :out_k]
    return Detections(rows[..., :4], rows[..., 4], rows[..., 5], keep.sum(1), rows[..., 6:] if columns > 6 else None)

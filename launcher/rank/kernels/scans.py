"""The validation's two sequential scans as one Triton program per image: greedy NMS over an image's sorted
candidates (nms.py) and the matching's claims of targets by detections (matching.py).

Both are sequential by nature: a candidate survives NMS only if no kept one before it suppresses it, and a detection
claims the best target the detections before it left unclaimed. In PyTorch each step of such a scan is a handful of
launches over the whole batch, and a weak model (the first epochs) gives hundreds of detections per image and
thousands of candidates: tens of thousands of launches and a host read every few rounds, most of the first
validation's time. Here each image's scan is a loop inside one program, its state in registers: one launch, none
per step. NMS takes an image's candidates a tile at a time (CANDIDATES of them in registers): a tile's candidates
first lose to the survivors of the tiles before it (their boxes kept in a small scratch buffer), then the loop visits
the tile's survivors in turn, each found by a reduction over the candidates still alive, so that it turns once per
survivor, not once per candidate; the program stops at max_det survivors. A weak model gives every anchor a
candidate, most of them suppressed: tens of tiles an image, which a host loop would go through chunk by chunk.

Each computes what the PyTorch form computes, bit for bit: the same IoU in the same float operations (no fused
multiply-add, an IEEE division), the same first-index argmax, the same comparisons. Triton on CUDA (and in Triton's
interpreter, where the tests check them on the CPU); elsewhere the callers keep their PyTorch forms.
"""

from __future__ import annotations

import torch

from launcher.rank.kernels.triton_use import runs_on

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - every torch build this project supports ships Triton on Linux
    triton = None

CANDIDATES = 2048  # candidates per tile of an NMS program (in its registers)
THRESHOLDS = 16  # the matching's IoU thresholds, padded (10 in DetectionValidator)
NO_FUSION = {"enable_fp_fusion": False}  # a*b + c rounded twice, as PyTorch's separate kernels round it


def usable(t: torch.Tensor) -> bool:
    """Whether the scans run as Triton programs on tensors like `t` (triton_use.py)."""
    return triton is not None and runs_on(t.device)


def greedy_nms(boxes: torch.Tensor, alive: torch.Tensor, iou: float, limit: int | None = None) -> torch.Tensor:
    """(B, K) bool: greedy NMS of each image's candidates `boxes` (B, K, 4) xyxy, sorted by descending score, of
    which `alive` (B, K) may be kept: each alive candidate, at its turn, is kept and removes the later ones whose IoU
    with it exceeds `iou`. With `limit`, an image's scan stops at that many survivors: its first `limit` are kept,
    the later ones not."""
    b, k = alive.shape
    limit = k if limit is None else min(int(limit), k)
    keep = torch.zeros((b, k), dtype=torch.uint8, device=alive.device)
    if b and k and limit:
        survivors = torch.empty((b, limit, 4), dtype=torch.float32, device=alive.device)  # the scan's scratch
        _greedy_nms[(b,)](boxes.float().contiguous(), alive.contiguous().view(torch.uint8), keep, survivors, k,
                          float(iou), limit, BLOCK=CANDIDATES, num_warps=8, **NO_FUSION)
    return keep.view(torch.bool)


def claims(iou: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor:
    """(B, D, T) bool: whether detection d of image b is a true positive at threshold t, given `iou` (B, M, D), each
    target's IoU with each detection (zero where they cannot match), the detections in descending confidence order:
    each, in turn, claims per threshold the unclaimed target it overlaps most (the first on ties) and is a true
    positive where that IoU reaches the threshold."""
    b, m, d = iou.shape
    t = thresholds.numel()
    correct = torch.empty((b, d, t), dtype=torch.uint8, device=iou.device)
    if b and d:
        block_m = max(16, triton.next_power_of_2(m))
        _claims[(b,)](iou.float().contiguous(), thresholds.float().contiguous(), correct, m, d, T=t,
                      BLOCK_M=block_m, BLOCK_T=THRESHOLDS, num_warps=4, **NO_FUSION)
    return correct.view(torch.bool)


def warm_up(device: torch.device) -> None:
    """Both programs compiled (or loaded from Triton's cache) without a launch, for the current thread's `device`:
    rank/kernels/kernels.py's WarmUp runs it on a thread during the first epoch."""
    torch.cuda.set_device(device)
    _greedy_nms.warmup(torch.float32, torch.uint8, torch.uint8, torch.float32, 20000, 0.7, 300, BLOCK=CANDIDATES,
                       num_warps=8, grid=(1,), **NO_FUSION)
    for block_m in (16, 32):  # up to 32 targets an image, most datasets
        _claims.warmup(torch.float32, torch.float32, torch.uint8, 17, 300, T=10, BLOCK_M=block_m, BLOCK_T=THRESHOLDS,
                       num_warps=4, grid=(1,), **NO_FUSION)


if triton is not None:

    @triton.jit(do_not_specialize=["k", "limit"])
    def _greedy_nms(boxes, alive, keep, survivors, k, threshold, limit, BLOCK: tl.constexpr):
        img = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, BLOCK)
        row = boxes + img * k * 4
        kept_boxes = survivors + img * limit * 4
        count = tl.program_id(0) * 0  # survivors so far
        start = count
        while (start < k) & (count < limit):  # a tile of candidates
            inside = start + j < k
            x1 = tl.load(row + (start + j) * 4, mask=inside, other=0.0)
            y1 = tl.load(row + (start + j) * 4 + 1, mask=inside, other=0.0)
            x2 = tl.load(row + (start + j) * 4 + 2, mask=inside, other=0.0)
            y2 = tl.load(row + (start + j) * 4 + 3, mask=inside, other=0.0)
            area = (x2 - x1) * (y2 - y1)
            live = (tl.load(alive + img * k + start + j, mask=inside, other=0) != 0) & inside
            for s in range(0, count):  # the earlier tiles' survivors, each scoring above this whole tile
                sx1 = tl.load(kept_boxes + s * 4)
                sy1 = tl.load(kept_boxes + s * 4 + 1)
                sx2 = tl.load(kept_boxes + s * 4 + 2)
                sy2 = tl.load(kept_boxes + s * 4 + 3)
                w = tl.maximum(tl.minimum(sx2, x2) - tl.maximum(sx1, x1), 0.0)
                h = tl.maximum(tl.minimum(sy2, y2) - tl.maximum(sy1, y1), 0.0)
                inter = w * h
                live = live & ~(tl.math.div_rn(inter, (sx2 - sx1) * (sy2 - sy1) + area - inter) > threshold)
            kept = j < 0
            i = tl.min(tl.where(live, j, BLOCK))  # the first candidate alive: BLOCK where there is none
            while (i < BLOCK) & (count < limit):  # candidate i is alive at its turn: kept
                xi1 = tl.load(row + (start + i) * 4)
                yi1 = tl.load(row + (start + i) * 4 + 1)
                xi2 = tl.load(row + (start + i) * 4 + 2)
                yi2 = tl.load(row + (start + i) * 4 + 3)
                w = tl.maximum(tl.minimum(xi2, x2) - tl.maximum(xi1, x1), 0.0)
                h = tl.maximum(tl.minimum(yi2, y2) - tl.maximum(yi1, y1), 0.0)
                inter = w * h
                overlap = tl.math.div_rn(inter, (xi2 - xi1) * (yi2 - yi1) + area - inter)  # nms.box_iou's order
                live = live & ~((overlap > threshold) & (j > i))
                kept = kept | (j == i)
                tl.store(kept_boxes + count * 4, xi1)
                tl.store(kept_boxes + count * 4 + 1, yi1)
                tl.store(kept_boxes + count * 4 + 2, xi2)
                tl.store(kept_boxes + count * 4 + 3, yi2)
                count += 1
                i = tl.min(tl.where(live & (j > i), j, BLOCK))
            tl.store(keep + img * k + start + j, kept.to(tl.uint8), mask=inside)
            tl.debug_barrier()  # the survivors' boxes stored by this tile are read by every thread of the next
            start += BLOCK

    @triton.jit(do_not_specialize=["m", "d"])
    def _claims(iou, thresholds, correct, m, d, T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr):
        img = tl.program_id(0).to(tl.int64)
        rows = tl.arange(0, BLOCK_M)
        ts = tl.arange(0, BLOCK_T)
        threshold = tl.load(thresholds + ts, mask=ts < T, other=float("inf"))
        matched = tl.zeros((BLOCK_M, BLOCK_T), dtype=tl.int1)
        base = iou + img * m * d
        for j in range(0, d):
            column = tl.load(base + rows * d + j, mask=rows < m, other=-1.0)  # below any IoU: never the best
            available = tl.where(matched, 0.0, column[:, None])
            best = tl.max(available, axis=0)
            first = tl.min(tl.where(available == best[None, :], rows[:, None], BLOCK_M), axis=0)
            hit = best >= threshold
            tl.store(correct + (img * d + j) * T + ts, hit.to(tl.uint8), mask=ts < T)
            matched = matched | ((rows[:, None] == first[None, :]) & hit[None, :])

"""The step's forward, loss and backward captured as one CUDA graph (`train.graph_scope=auto`, on one GPU).

With only the network graphed (graphed.py) the step stays host-bound: the host spends most of a yolov8s step
launching the eager loss, its backward and an AccumulateGrad per parameter, and the GPU idles between those launches
(docs/benchmarks/README.md, section 6). Here the network's forward, the sync-free loss and the backward pass replay
as one graph. Its shapes must not change, so the targets are padded to a bucket: the next power of two at or above
the batch's largest per-image count (at least MIN_BUCKET). Zero rows change no value of the loss
(DetectionLoss.padded_targets). One graph per bucket the data can need (`buckets`: up to its most crowded image
times what mosaic, mixup and cutmix combine), all captured at set-up, largest first, each after two eager warm-up
passes on a side stream, into one memory pool: a smaller graph reuses the blocks the larger one freed, so the pool
holds about the largest graph's memory, and nothing is captured mid-run (a capture's warm-ups would grow what the
run holds past what train.batch_per_device=auto measured). The probe captures the same buckets (auto_batch.py).

The graph writes the gradients into tensors of its own, which are the parameters' `.grad` for the whole run: the
optimizer, the gradient clip and the GradScaler read them there, and no step zeroes them (each replay overwrites
them). Unscaling, clipping, the fused optimizer, the scaler's update and the EMA stay eager: a few multi-tensor
launches, and the learning rate and momentum they read change every step of the warmup.

With `triton_parts` (set where its kernels compiled: rank/components.py) the graphs run the neck's upsampling, the
blocks' channel concatenations and (train.fused_bn_act) the Conv blocks' BatchNorm and SiLU on Triton kernels
(triton_modules.py).

A batch of another shape (multi-scale, a short batch), whose bucket would leave the dense assigner (DENSE_LIMIT) or
was not captured (more targets than the data was planned to give) runs the same code eagerly, the last with a line
in the log. On the CPU everything runs eagerly: the same step, testable in CI.

Where it applies (`uses_captured_step`): one process on one GPU (with DDP the loss's global normaliser and the
gradients' all-reduce would be collectives inside the graph), train.accumulate=1, and the sync-free YOLO detection
loss (YOLO26's end-to-end loss reweights its two branches every epoch with host numbers a graph would freeze).
Elsewhere the network alone is graphed (graphed.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from launcher.rank.data.pipeline import MAX_TARGETS
from launcher.rank.step.triton_modules import triton_modules
from launcher.rank.ultralytics.loss import DENSE_LIMIT, PADDED_TARGETS, DetectionLoss

MIN_BUCKET = 8  # the fewest target rows per image a graph is captured for
WARMUP_PASSES = 2  # eager passes on a side stream before a capture (cuDNN and cuBLAS choose their kernels there)
# A bucket is captured mid-epoch while the input's threads run: the DataLoader's pin-memory thread may allocate pinned
# memory, which CUDA forbids every thread during a "global" capture (the allocation fails, the capture is void, and
# the run stops). "thread_local" forbids it to the capturing thread alone; no other thread uses its stream.
CAPTURE_MODE = "thread_local"


def bucket(max_targets: int) -> int:
    """The padded per-image target count for a batch whose fullest image has `max_targets`."""
    return max(MIN_BUCKET, 1 << max(int(max_targets) - 1, 0).bit_length())


def most_targets(most_boxes: int | None, hyp) -> int | None:
    """The most targets one training image can carry: the data's most crowded image (inputs/labels.py) times the
    images mosaic (4), mixup (2) and cutmix (2) combine where they are on; None where the data's count is unknown."""
    if most_boxes is None:
        return None
    def on(key: str) -> bool:
        return float(getattr(hyp, key, 0) or 0) > 0

    return int(most_boxes) * (4 if on("mosaic") else 1) * (2 if on("mixup") else 1) * (2 if on("cutmix") else 1)


def buckets(targets: int | None, largest: int) -> list[int]:
    """The buckets a run whose images carry at most `targets` needs captured, largest first: MIN_BUCKET up to
    bucket(targets), at most `largest` (beyond it the step runs eagerly); every bucket up to `largest` where
    `targets` is unknown."""
    top = min(bucket(targets), largest) if targets is not None else largest
    return [b for b in (MIN_BUCKET << i for i in range(32)) if b <= top][::-1]


def uses_captured_step(net: nn.Module, *, device: torch.device, world_size: int, accumulate: int) -> str | None:
    """None where the whole step can be captured, else why not (the network alone is graphed then)."""
    if device.type != "cuda":
        return "not on a GPU"
    if world_size > 1:
        return "DDP across processes"
    if accumulate != 1:
        return "train.accumulate > 1"
    criterion = getattr(net, "criterion", None)
    if type(criterion) is not DetectionLoss or not criterion.sync_free:
        return f"the loss {type(criterion).__name__} (only the sync-free YOLO detection loss is captured)"
    return None


class CapturedStep:
    """The loop's step (rank/step/train_step.py's TrainStep does the same eagerly): forward, loss and backward,
    replayed as a CUDA graph per target bucket for full batches of `batch` square `imgsz` images; then unscale,
    clip, the optimizer, the scaler's update and the EMA. `loss` and `loss_items` hold the last step's, on the
    device, as TrainStep's do."""

    def __init__(self, net: nn.Module, *, optimizer, scaler, ema, loss_scale: float, grad_clip: float, amp_dtype,
                 batch: int, imgsz: int, triton_parts: tuple[str, ...] = (), log: Callable[[str], None] = print):
        self.triton_parts = triton_parts
        self.net, self.optimizer, self.scaler, self.ema = net, optimizer, scaler, ema
        self.loss_scale, self.grad_clip, self.amp_dtype, self.log = loss_scale, grad_clip, amp_dtype, log
        self.model = net  # what a caller reads as the step's module (the probe of train.batch_per_device=auto)
        self.device = next(net.parameters()).device
        self.shape = (batch, 3, imgsz, imgsz)
        anchors = sum((imgsz // int(s)) ** 2 for s in net.stride)
        self.largest_bucket = DENSE_LIMIT // (batch * anchors)  # beyond it the assigner gathers (host syncs)
        self.params = [p for p in net.parameters() if p.requires_grad]
        self.grads = [torch.zeros_like(p) for p in self.params]
        for p, g in zip(self.params, self.grads):
            p.grad = g
        self.graphs: dict[int, _Graph | None] = {}  # bucket -> its graph; None: its capture failed, eager
        self.told: set[int] = set()  # buckets whose eager steps the log has named
        self.pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None
        self.keys: list[str] | None = None  # the loss items' names
        self.loss = self.loss_items = None

    def __call__(self, batch: dict) -> None:
        n = bucket(_max_targets(batch))
        img, targets = batch["img"], self.net.criterion.padded_targets(batch, n)
        graph = self._graph(n) if self._capturable(img, n) else None
        out = graph.replay(img, targets) if graph is not None else self._body(img, targets, n)
        self.loss, self.loss_items = out[0], dict(zip(self.keys, out[1:]))
        self.scaler.unscale_(self.optimizer)
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, max_norm=self.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.ema.update(self.net)

    def capture(self, batch: dict) -> None:
        """Capture `batch`'s bucket now (before the first step: a capture that fails is then known at set-up)."""
        n = bucket(_max_targets(batch))
        img, targets = batch["img"], self.net.criterion.padded_targets(batch, n)
        if not self._capturable(img, n):
            raise ValueError(f"a batch of shape {tuple(img.shape)} with {n} target rows is not captured")
        self.graphs[n] = _Graph(self, img, targets, n)

    def capture_all(self, targets: int | None, make_batch: Callable[[int], dict]) -> list[int]:
        """Capture every bucket that images of at most `targets` targets need (`buckets`), largest first, each on
        `make_batch(bucket)` (a batch whose fullest image has that many); the buckets captured. The warm-ups' blocks
        stay cached until the caller empties the cache."""
        wanted = buckets(targets, self.largest_bucket)
        for n in wanted:
            self.capture(make_batch(n))
        return wanted

    def _capturable(self, img: torch.Tensor, n: int) -> bool:
        return self.pool is not None and tuple(img.shape) == self.shape and n <= self.largest_bucket

    def _graph(self, n: int):
        """The bucket's graph; None (the step eager) for a bucket not captured at set-up, named once in the log."""
        if n not in self.graphs and n not in self.told:
            self.told.add(n)
            self.log(f"a batch with more than {max(self.graphs, default=0)} targets in one image: batches padded to "
                     f"{n} target rows train without a CUDA graph (slower)")
        return self.graphs.get(n)

    def _body(self, img: torch.Tensor, targets: torch.Tensor, n: int) -> torch.Tensor:
        """Forward, loss and backward into self.grads; (loss, *loss items) as one tensor. What the graph holds."""
        with torch.autocast(self.device.type, dtype=self.amp_dtype or torch.float32, enabled=self.amp_dtype is not None,
                            cache_enabled=False):  # a cast cache would hold tensors across replays
            preds = self.net(img)
            loss, items = self.net.loss({"img": img, PADDED_TARGETS: targets, MAX_TARGETS: n}, preds)
            loss = loss.sum() * self.loss_scale
        grads = torch.autograd.grad(self.scaler.scale(loss), self.params, allow_unused=True, materialize_grads=True)
        torch._foreach_copy_(self.grads, grads)
        self.keys = list(items)
        return torch.stack([loss.detach(), *items.values()])


def _max_targets(batch: dict) -> int:
    """The batch's largest per-image target count, as the host read it off the batch (pipeline.py); counted on
    the device (one sync) for a batch that came without it."""
    if batch.get(MAX_TARGETS) is not None:
        return batch[MAX_TARGETS]
    return int(torch.bincount(batch["batch_idx"].long(), minlength=1).max()) if len(batch["batch_idx"]) else 0


class _Graph:
    """One bucket's captured body: its input tensors (each step's batch is copied in) and its output."""

    def __init__(self, step: CapturedStep, img: torch.Tensor, targets: torch.Tensor, n: int):
        self.img, self.targets = img.clone(), targets.clone()
        saved = {k: v.detach().clone() for k, v in step.net.named_buffers()}  # warm-up passes move BN statistics
        try:
            with triton_modules(step.net, parts=step.triton_parts):  # what the replays run (triton_modules.py)
                side = torch.cuda.Stream(step.device)
                side.wait_stream(torch.cuda.current_stream(step.device))
                with torch.cuda.stream(side):
                    for _ in range(WARMUP_PASSES):
                        step._body(self.img, self.targets, n)
                torch.cuda.current_stream(step.device).wait_stream(side)
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph, pool=step.pool, capture_error_mode=CAPTURE_MODE):
                    self.out = step._body(self.img, self.targets, n)
        finally:  # also after a failed capture: the step then runs eagerly, on the statistics it had
            with torch.no_grad():
                for k, v in step.net.named_buffers():
                    v.copy_(saved[k])

    def replay(self, img: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.img.copy_(img)
        self.targets.copy_(targets)
        self.graph.replay()
        return self.out.clone()  # the next replay overwrites out; the loop keeps this step's loss

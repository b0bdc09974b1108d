"""The network's training forward and backward captured as CUDA graphs (`train.cuda_graphs`, `auto` by default).

The eager step is host-bound: it launches about 1,200 kernels per yolov8s step, each costing more CPU time than its
GPU time, so the GPU idles between launches. A CUDA graph replays the whole forward (and, through autograd, the
whole backward) of the network with one launch each. The loss stays eager: its target assignment has
data-dependent shapes. The measured gain is in docs/benchmarks/README.md, section 3.

A capture that fails (a network whose forward synchronises with the host or changes shape with the data) leaves the
network as it was: with `auto` the trainer then trains eagerly with a warning, with `true` it stops with the cause.

Full-size batches replay the graph; any other shape (the short last batch of an epoch, multi-scale) runs the same
network eagerly, with the same parameters. DDP wraps the graphed module: gradients still land in `.grad` through
autograd, so DDP's all-reduce hooks fire as usual. BatchNorm statistics update inside the graph, in the module's
own buffers. With `triton_parts` the graphs run the upsampling, the concatenations and (train.fused_bn_act) the Conv
blocks' BatchNorm and SiLU on Triton kernels (triton_modules.py).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils import _pytree as pytree

from launcher.rank.step.triton_modules import triton_modules


class GraphedDetector(nn.Module):
    """A DetectionModel whose train-mode forward on `(batch, 3, imgsz, imgsz)` images replays a CUDA graph."""

    def __init__(self, net: nn.Module, batch: int, imgsz: int, amp_dtype: torch.dtype | None, *,
                 input_dtype: torch.dtype = torch.float32, channels_last: bool = False,
                 triton_parts: tuple[str, ...] = ()):
        super().__init__()
        self.net = net
        self.triton_parts = triton_parts
        self.shape = (batch, 3, imgsz, imgsz)
        self.amp_dtype = amp_dtype
        # the graph's input buffer as the pipeline writes batches: each replay then copies without converting
        self.input_dtype, self.input_format = input_dtype, torch.channels_last if channels_last else torch.contiguous_format
        self._spec = None  # the structure of the network's output (dicts and lists of tensors), seen at capture
        self._graphed = self._capture()

    def _flat(self, img: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # v8/11 heads return {boxes, scores, feats}, end-to-end heads (yolo26) {one2many: {...}, one2one: {...}}
        leaves, self._spec = pytree.tree_flatten(self.net(img))
        return tuple(leaves)

    def _capture(self):
        device = next(self.net.parameters()).device
        sample = torch.rand(self.shape, device=device).to(self.input_dtype, memory_format=self.input_format)
        saved = {k: v.detach().clone() for k, v in self.net.named_buffers()}  # warm-up runs move BN statistics
        flat = _FlatForward(self)
        try:
            with triton_modules(self.net, parts=self.triton_parts), torch.autocast(
                    "cuda", dtype=self.amp_dtype or torch.float32, enabled=self.amp_dtype is not None,
                    cache_enabled=False):
                return torch.cuda.make_graphed_callables(flat, (sample,), num_warmup_iters=3)
        finally:  # also after a failed capture: the network then trains eagerly, as if never captured
            with torch.no_grad():
                for k, v in self.net.named_buffers():
                    v.copy_(saved[k])
            for p in self.net.parameters():
                p.grad = None  # the warm-up backward passes accumulated gradients

    def forward(self, img: torch.Tensor) -> dict:
        if tuple(img.shape) != self.shape or not self.training:
            return self.net(img)
        return pytree.tree_unflatten(list(self._graphed(img)), self._spec)

    def loss(self, batch: dict, preds: dict):
        return self.net.loss(batch, preds)


class _FlatForward(nn.Module):
    """make_graphed_callables wants a flat tuple of tensors out, not Ultralytics' nested dicts and lists."""

    def __init__(self, owner: GraphedDetector):
        super().__init__()
        self.net = owner.net
        self._owner = [owner]  # a list: not registered as a submodule (no cycle in the module tree)

    def forward(self, img: torch.Tensor):
        return self._owner[0]._flat(img)

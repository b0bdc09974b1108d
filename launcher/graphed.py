"""The network's training forward and backward captured as CUDA graphs (`train.cuda_graphs=true`).

Profiling Ultralytics' step on an H200 (docs/benchmarks/) shows a host-bound step: about 1,400 kernel launches
per step for yolov8s, each costing more CPU time than its GPU time, so the GPU idles between launches. A CUDA graph
replays the whole forward (and, through autograd, the whole backward) of the network with one launch each. The
loss stays eager: its target assignment has data-dependent shapes.

Full-size batches replay the graph; any other shape (the short last batch of an epoch, multi-scale) runs the same
network eagerly, with the same parameters. DDP wraps the graphed module: gradients still land in `.grad` through
autograd, so DDP's all-reduce hooks fire as usual. BatchNorm statistics update inside the graph, in the module's
own buffers.
"""

from __future__ import annotations

import torch
from torch import nn


class GraphedDetector(nn.Module):
    """A DetectionModel whose train-mode forward on `(batch, 3, imgsz, imgsz)` images replays a CUDA graph."""

    def __init__(self, net: nn.Module, batch: int, imgsz: int, amp_dtype: torch.dtype | None):
        super().__init__()
        self.net = net
        self.shape = (batch, 3, imgsz, imgsz)
        self.amp_dtype = amp_dtype
        self._n_feats = 0
        self._graphed = self._capture()

    def _flat(self, img: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.net(img)
        self._n_feats = len(out["feats"])
        return (out["boxes"], out["scores"], *out["feats"])

    def _capture(self):
        device = next(self.net.parameters()).device
        sample = torch.rand(self.shape, device=device)
        saved = {k: v.detach().clone() for k, v in self.net.named_buffers()}  # warm-up runs move BN statistics
        flat = _FlatForward(self)
        with torch.autocast("cuda", dtype=self.amp_dtype or torch.float32, enabled=self.amp_dtype is not None, cache_enabled=False):
            graphed = torch.cuda.make_graphed_callables(flat, (sample,), num_warmup_iters=3)
        with torch.no_grad():
            for k, v in self.net.named_buffers():
                v.copy_(saved[k])
        for p in self.net.parameters():
            p.grad = None  # the warm-up backward passes accumulated gradients
        return graphed

    def forward(self, img: torch.Tensor) -> dict:
        if tuple(img.shape) != self.shape or not self.training:
            return self.net(img)
        out = self._graphed(img)
        return {"boxes": out[0], "scores": out[1], "feats": list(out[2 : 2 + self._n_feats])}

    def loss(self, batch: dict, preds: dict):
        return self.net.loss(batch, preds)


class _FlatForward(nn.Module):
    """make_graphed_callables wants tensors out, not Ultralytics' dict of boxes, scores and a list of feature maps."""

    def __init__(self, owner: GraphedDetector):
        super().__init__()
        self.net = owner.net
        self._owner = [owner]  # a list: not registered as a submodule (no cycle in the module tree)

    def forward(self, img: torch.Tensor):
        return self._owner[0]._flat(img)

"""The network's inference forward for validation: fixed-size batches in fp16 autocast, channels_last, replayed as a
CUDA graph per image shape on CUDA (`val.cuda_graphs`).

The eager forward of a detector launches hundreds of small kernels per batch, and the host's launch time bounds it
at large batches as in training (rank/step/graphed.py). Each graph is captured at the first batch of its shape,
over a static input of `batch` rows: a shorter batch fills the first rows and reads only their outputs (in eval mode
each image's output depends on that image alone). The graphs read the network's parameters and buffers where they
are, so the EMA's updates between validations and best.pt's weights loaded in place are what they compute with.
The Detect head caches its anchors per input shape: the tensors a graph was captured with are kept alive here.
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

MAX_GRAPHS = 4  # shapes captured; images of further shapes run eagerly (rectangular batches of mixed aspect ratios)


class InferenceForward:
    """`forward(img_uint8)` -> the model's eval output for those n images (tensors may hold more rows: slice [:n])."""

    def __init__(self, model: torch.nn.Module, device: torch.device, *, batch: int,
                 amp_dtype: torch.dtype | None, graphs: bool, log=print):
        self.model, self.device, self.batch, self.amp_dtype, self.log = model, device, batch, amp_dtype, log
        self.graphs = graphs and device.type == "cuda"
        self.channels_last = device.type == "cuda"
        self._captured: dict[tuple[int, int], tuple] = {}  # shape -> (graph, input, outputs, spec, kept tensors)
        self._pool = None
        self.failed = False

    def _input(self, img: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 -> the network's input: img.half() / 255 under fp16 AMP, as Ultralytics' validator, else float."""
        x = (img.half() if self.amp_dtype == torch.float16 else img.float()) / 255
        if out is None:
            return x.contiguous(memory_format=torch.channels_last) if self.channels_last else x
        out[: len(img)].copy_(x)
        return out

    def autocast(self):
        return torch.autocast(self.device.type, dtype=self.amp_dtype or torch.float32,
                              enabled=self.amp_dtype is not None and self.device.type == "cuda", cache_enabled=False)

    @torch.no_grad()
    def __call__(self, img: torch.Tensor):
        shape = tuple(img.shape[2:])
        if self.graphs and not self.failed and (shape in self._captured or len(self._captured) < MAX_GRAPHS):
            if shape not in self._captured:
                self._capture(shape)
            if shape in self._captured:
                graph, static, outputs, spec, _ = self._captured[shape]
                self._input(img, static)
                graph.replay()
                return pytree.tree_unflatten(list(outputs), spec)
        with self.autocast():
            return self.model(self._input(img))

    def _capture(self, shape: tuple[int, int]) -> None:
        dtype = torch.float16 if self.amp_dtype == torch.float16 else torch.float32
        static = torch.zeros((self.batch, 3, *shape), dtype=dtype, device=self.device)
        static = static.contiguous(memory_format=torch.channels_last)
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side), self.autocast():
                for _ in range(2):  # cuDNN picks its algorithms, the head makes its anchors for this shape
                    self.model(static)
            torch.cuda.current_stream(self.device).wait_stream(side)
            self._pool = self._pool or torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool), self.autocast():
                leaves, spec = pytree.tree_flatten(self.model(static))
        except Exception as e:  # a network whose eval forward syncs with the host: run it eagerly
            self.failed = True
            self.log(f"WARNING: CUDA graph capture of the validation forward failed ({type(e).__name__}: {e}); "
                     "validating eagerly")
            return
        head = self.model.model[-1] if hasattr(self.model, "model") else None
        kept = tuple(getattr(head, name) for name in ("anchors", "strides") if isinstance(getattr(head, name, None),
                                                                                          torch.Tensor))
        self._captured[shape] = (graph, static, tuple(leaves), spec, kept)
        self.log(f"validation forward captured as a CUDA graph for batches of {self.batch} x {shape[0]}x{shape[1]}")

"""The network's inference forward for validation: fixed-size batches, channels_last, replayed as a CUDA graph per
image shape on CUDA (`val.cuda_graphs`). The network computes under autocast to `amp_dtype` (the EMA, as the fast
validator runs it by default; the auto-batch probe's training network), or in its own dtype (the folded fp16 copy:
rank/ultralytics/folded.py).

The eager forward of a detector launches hundreds of small kernels per batch, and the host's launch time bounds it
at large batches as in training (rank/step/graphed.py). Each graph is captured at the first batch of its shape and
size, over a static input of `batch` rows, or for a shorter batch (a shape's last) of its size rounded up to a
quarter of `batch`: a replay computes every row, so the split's last batch does not pay for a whole one. The first
time a short batch comes after its shape's whole graph, it replays that one instead, so that the run's first
validation (which outlasts the later ones) captures one graph per shape. A batch fills the first rows and reads only
their outputs (in eval mode each image's output depends on that image alone). The graphs read the network's
parameters and buffers where they are, so the EMA's updates between validations and best.pt's weights loaded in
place are what they compute with.
The Detect head caches its anchors per input shape: the tensors a graph was captured with are kept alive here.
"""

from __future__ import annotations

import time

import torch
from torch.utils import _pytree as pytree

MAX_GRAPHS = 6  # (shape, rows) captured; further batches run eagerly (rectangular batches of mixed aspect ratios)
CAPTURE_MODE = "thread_local"  # the input's threads run beside a validation (rank/step/captured_step.py says why)


def autocast_to(device: torch.device, dtype: torch.dtype | None):
    """Autocast to `dtype` on CUDA; off for None and on other devices."""
    return torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None and device.type == "cuda",
                          cache_enabled=False)


class InferenceForward:
    """`forward(img_uint8)` -> the model's eval output for those n images (tensors may hold more rows: slice [:n]).
    `amp_dtype`: autocast's type, None for none; `input_dtype`: the images' type, by default fp16 under fp16 autocast
    (as Ultralytics' validator feeds them), else the model's own. `log` warns; `detail` (default `log`) takes the
    diagnostics (each capture's time)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, *, batch: int,
                 amp_dtype: torch.dtype | None, graphs: bool, input_dtype: torch.dtype | None = None, log=print,
                 detail=None):
        self.model, self.device, self.batch, self.amp_dtype, self.log = model, device, batch, amp_dtype, log
        self.detail = detail or log
        if input_dtype is None:
            first = next(model.parameters(), None)
            own = first.dtype if first is not None and first.is_floating_point() else torch.float32
            input_dtype = torch.float16 if amp_dtype == torch.float16 else (torch.float32 if amp_dtype else own)
        self.input_dtype = input_dtype
        self.graphs = graphs and device.type == "cuda"
        self.channels_last = device.type == "cuda"
        self._captured: dict[tuple[int, int, int], tuple] = {}  # (rows, H, W) -> (graph, input, outputs, spec, kept)
        self._deferred: set[tuple[int, int, int]] = set()  # short batches' keys replayed once on the whole graph
        self._pool = None
        self.failed = False

    def _input(self, img: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 -> the network's input: img / 255 in input_dtype."""
        x = img.to(self.input_dtype) / 255
        if out is None:
            return x.contiguous(memory_format=torch.channels_last) if self.channels_last else x
        out[: len(img)].copy_(x)
        return out

    def autocast(self):
        return autocast_to(self.device, self.amp_dtype)

    @torch.no_grad()
    def __call__(self, img: torch.Tensor):
        key = (self.rows_for(len(img)), *img.shape[2:])
        whole = (self.batch, *img.shape[2:])
        if key not in self._captured and whole in self._captured and key not in self._deferred:
            self._deferred.add(key)  # this once, the shape's whole graph: the first validation captures one per shape
            key = whole
        if self.graphs and not self.failed and (key in self._captured or len(self._captured) < MAX_GRAPHS):
            if key not in self._captured:
                self._capture(key)
            if key in self._captured:
                graph, static, outputs, spec, _ = self._captured[key]
                self._input(img, static)
                graph.replay()
                return pytree.tree_unflatten(list(outputs), spec)
        with self.autocast():
            return self.model(self._input(img))

    def rows_for(self, n: int) -> int:
        """The rows of the graph that computes a batch of n images: `batch`, or n rounded up to a quarter of it."""
        quarter = max(1, self.batch // 4)
        return min(self.batch, -(-n // quarter) * quarter)

    def _capture(self, key: tuple[int, int, int]) -> None:
        started = time.perf_counter()
        rows, *shape = key
        static = torch.zeros((rows, 3, *shape), dtype=self.input_dtype, device=self.device)
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
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode=CAPTURE_MODE), self.autocast():
                leaves, spec = pytree.tree_flatten(self.model(static))
        except Exception as e:  # a network whose eval forward syncs with the host: run it eagerly
            self.failed = True
            self.log(f"WARNING: CUDA graph capture of the validation forward failed ({type(e).__name__}: {e}); "
                     "validating eagerly")
            return
        head = self.model.model[-1] if hasattr(self.model, "model") else None
        kept = tuple(getattr(head, name) for name in ("anchors", "strides") if isinstance(getattr(head, name, None),
                                                                                          torch.Tensor))
        self._captured[key] = (graph, static, tuple(leaves), spec, kept)
        self.detail(f"validation forward captured as a CUDA graph for batches of {rows} x {shape[0]}x{shape[1]} in "
                    f"{time.perf_counter() - started:.2f} s")

"""nvJPEG's start on a thread beside the set-up, so the first training batch does not pay it.

A process's first batched nvJPEG decode initialises the library, many times the cost of the next decode, and the
first training batch paid it (docs/benchmarks/h200-time-to-model/README.md, first_decode.py). `Prewarm` decodes one
batch on a thread as soon as the CUDA context exists; the decode runs in torchvision's C++ operator, mostly outside
the GIL, so the set-up's Python work goes on beside it. The set-up `join()`s it before capturing CUDA graphs: a capture
must see no other thread's CUDA calls (an allocation or a stream made while it records invalidates it). No process
forks while it runs (the loaders' workers start after the join).

The decode is torchvision's operator, loaded without importing torchvision (data/torchvision_ops.py): the import
(it imports Dynamo) was Python work on the set-up's critical path, on the thread as much as beside it (it took the
GIL from the set-up: docs/benchmarks/h200-time-to-model/results-defaults-prewarm/startup-ab.md).
A warm-up that fails costs nothing but its time: the first batch initialises nvJPEG instead, and the error is logged.
"""

from __future__ import annotations

import threading
import time

import torch

from launcher.rank.data import torchvision_ops

WARM_UP_SHAPE = (3, 480, 640)  # a 640x480 photo's JPEG, 4:2:0: the decoder path the training images take


def nvjpeg_warm_up(device: torch.device, batch: int) -> None:
    """One batched decode of `batch` images on `device`, the size of the training input's batches."""
    torch.cuda.set_device(device)  # the current device is per thread
    data = torchvision_ops.encode_jpeg(torch.full(WARM_UP_SHAPE, 114, dtype=torch.uint8))
    torchvision_ops.decode_jpegs_cuda([data] * batch, device)
    torch.cuda.synchronize(device)


class Prewarm:
    """`Prewarm(device, decode_batch=64).start()`, then `join()` before anything captures a graph (decode_batch: the
    training input's batch; 0, or a device other than CUDA: nothing to warm). `seconds`: how long the thread took;
    `error`: why the warm-up failed, or None."""

    def __init__(self, device: torch.device, *, decode_batch: int, log=print):
        self.device, self.decode_batch, self.log = device, decode_batch, log
        self.seconds: float | None = None
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, name="ddp-launch-prewarm", daemon=True)

    def start(self) -> Prewarm:
        if self.decode_batch and self.device.type == "cuda":
            self._thread.start()
        return self

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def join(self) -> None:
        if not self.started:
            return
        self._thread.join()
        if self.error is not None:
            self.log(f"WARNING: nvJPEG's warm-up failed ({self.error}); the first batch initialises it instead")
            self.error = None  # said once

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            nvjpeg_warm_up(self.device, self.decode_batch)
        except Exception as e:  # noqa: BLE001 - the first batch does the same work again and reports its own error
            self.error = f"{type(e).__name__}: {e}"
        self.seconds = time.perf_counter() - started

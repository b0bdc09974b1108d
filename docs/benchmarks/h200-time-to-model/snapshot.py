"""The epoch boundary's checkpoint, on the training thread: Ultralytics' way against ddp-launch's (issue 14).

yolov8s on the GPU (channels_last, as ddp-launch trains it), its EMA and SGD's momentum after one step. Each round
times, with the GPU idle (as after a validation), what the training thread spends in a save:
- "deepcopy": what ddp-launch did until 2026-12-03 and Ultralytics' save_model does: deepcopy the EMA module, to
  fp16, NaN zeroed, deepcopy the optimizer's state to fp16, then every tensor (the resume state's too) copied to
  the host one by one;
- "queued": Checkpointer._take() as shipped: the state's tensors copied into pinned host buffers, queued on the
  stream, the EMA model and fp16 optimizer made later in the writer thread (timed apart: "writer").
Rounds interleaved in one process; medians in milliseconds. Usage: python snapshot.py [ROUNDS] [DEVICE]
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from copy import deepcopy
from types import SimpleNamespace

import torch
from ultralytics.nn.tasks import DetectionModel
from ultralytics.utils.torch_utils import ModelEMA, convert_optimizer_state_dict_to_fp16

from launcher.rank.loop.checkpoint_io import RESUME_KEY
from launcher.rank.components import EmaState
from launcher.rank.loop.state import Checkpointer
from launcher.rank.ultralytics.checkpoint import Layout


def on_host(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, torch.nn.Module):
        return obj.to("cpu")
    if isinstance(obj, dict):
        return {k: on_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(on_host(v) for v in obj)
    return obj


def deepcopy_save(ema, optimizer, components) -> dict:
    model = deepcopy(ema.ema).half().to(memory_format=torch.contiguous_format)
    for v in model.state_dict().values():
        if v.is_floating_point():
            torch.nan_to_num_(v)
    keys = {"ema": model, "optimizer": convert_optimizer_state_dict_to_fp16(deepcopy(optimizer.state_dict()))}
    return on_host({**keys, RESUME_KEY: {name: c.state_dict() for name, c in components.items()}})


def main(rounds: int, device: str) -> None:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    net = DetectionModel("yolov8s.yaml", nc=80, verbose=False).to(device).to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.937, nesterov=True)
    for p in net.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()  # the momentum buffers exist
    ema = ModelEMA(net)
    components = {"model": net, "ema": EmaState(ema), "optimizer": optimizer}
    layout = Layout(ema, SimpleNamespace())
    keys = lambda: layout.keys(scaler=torch.amp.GradScaler("cuda"), epoch=0, best_fitness=None, fitness=None,  # noqa: E731
                               early_stop={}, metrics={}, results={})
    ckpt = Checkpointer(tempfile.mkdtemp(), components, keys, complete=layout.complete)
    times: dict[str, list[float]] = {"deepcopy": [], "queued": [], "writer": [], "first queued": []}
    for i in range(rounds + 1):
        sync()
        start = time.perf_counter()
        deepcopy_save(ema, optimizer, components)
        old = time.perf_counter() - start
        sync()
        start = time.perf_counter()
        taken = ckpt._take()
        queued = time.perf_counter() - start
        start = time.perf_counter()
        ckpt._host.ready()
        ckpt.complete(taken)
        writer = time.perf_counter() - start
        if i == 0:  # the first save also copies the EMA module's structure
            times["first queued"].append(queued)
            continue
        times["deepcopy"].append(old)
        times["queued"].append(queued)
        times["writer"].append(writer)
    tensors = sum(1 for _ in _leaves({name: c.state_dict() for name, c in components.items()}))
    result = {k: round(statistics.median(v) * 1e3, 1) for k, v in times.items()}
    result.update(rounds=rounds, resume_tensors=tensors, device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                  torch=torch.__version__)
    print(json.dumps(result))


def _leaves(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _leaves(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _leaves(v)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 7, sys.argv[2] if len(sys.argv) > 2 else "cuda")

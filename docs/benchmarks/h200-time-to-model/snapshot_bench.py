"""The checkpoint's snapshot at an epoch boundary, side by side in one process: every device tensor copied to the
host on its own (the build before 2026-12-03) against one copy per dtype (launcher/rank/state.host_copies).

yolov8s on the GPU with its EMA and an SGD optimizer after a step, the snapshot that rank/runs.py's checkpointer takes
(Ultralytics' layout with its fp16 EMA, plus the resume state); 7 rounds, the two interleaved, the median of each.
Usage: python3 docs/benchmarks/h200-time-to-model/snapshot_bench.py
"""

from __future__ import annotations

import statistics
import time

import torch
from ultralytics.nn.tasks import DetectionModel
from ultralytics.utils.torch_utils import ModelEMA

from launcher.rank import state


def per_tensor(obj):  # the build before: one synchronous copy per tensor
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, torch.nn.Module):
        return obj.to("cpu")
    if isinstance(obj, dict):
        return {k: per_tensor(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(per_tensor(v) for v in obj)
    return obj


def total(out) -> torch.Tensor:  # a scalar of every output, for a backward pass
    if isinstance(out, torch.Tensor):
        return out.float().sum()
    return sum(total(v) for v in (out.values() if isinstance(out, dict) else out))


def main() -> None:
    from copy import deepcopy

    net = DetectionModel("yolov8s.yaml", nc=80, verbose=False).cuda()
    ema = ModelEMA(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.937, nesterov=True)
    total(net(torch.randn(2, 3, 640, 640, device="cuda"))).backward()
    optimizer.step()
    ema.update(net)

    def take() -> dict:
        layout = {"ema": deepcopy(ema.ema).half(), "optimizer": deepcopy(optimizer.state_dict())}
        return {**layout, "resume": {"model": net.state_dict(), "ema": ema.ema.state_dict(),
                                     "optimizer": optimizer.state_dict()}}

    count = len(state._device_tensors(take(), []))
    times = {"per tensor": [], "per dtype": []}
    for _ in range(7):
        for name, move in (("per tensor", per_tensor), ("per dtype", state._on_host)):
            torch.cuda.synchronize()
            start = time.perf_counter()
            move(take())
            times[name].append(time.perf_counter() - start)
    print(f"snapshot of {count} device tensors (yolov8s, EMA, SGD state), median of 7:")
    for name, ts in times.items():
        print(f"  {name:10s} {1000 * statistics.median(ts):7.1f} ms  (all: {', '.join(f'{1000 * t:.0f}' for t in ts)})")


if __name__ == "__main__":
    main()

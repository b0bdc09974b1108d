"""Issue 13: is the GPU decode's time under a training load paid per call or per image?

On a lease the GPU input's decoding thread worked about one step per batch of 64 (README, section 6), and 48 or 32
JPEGs per call took no less. If a call under load costs about a step whatever its size, decoding two loader batches in
one call halves the thread's cost per batch; if it grows with the images, it does not. This times
`decode_jpegs_cuda` (the rank's decode: torchvision's operator, rank/data/torchvision_ops.py) for 16, 32, 64 and 128
JPEGs of the benchmark data, on an idle GPU and beside a load that keeps the GPU's queue full all the time the decodes
run: a convolutional network's forward and backward in fp16, channels_last, batch 64 at 640 px, replayed as a CUDA
graph on the default stream with two replays in flight (the training step's shape of work). Every call's wall time
is recorded, and how many replays the load finished during the decodes (so a load that left the queue shows).

Usage (a GPU machine): python3 docs/benchmarks/h200-gpu-input/decode_per_call.py OUT_DIR [REPEATS]
Prints a table and writes OUT_DIR/decode_per_call.json.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from launcher.inputs import shapes
from launcher.rank.data.torchvision_ops import decode_jpegs_cuda

SIZES = (16, 32, 64, 128)


class Load:
    """A CUDA graph of a conv net's training step, replayed on the default stream until stopped, at most two ahead."""

    def __init__(self, device: torch.device, batch: int = 64, imgsz: int = 640):
        layers, c = [], 3
        for width, stride in ((32, 2), (64, 2), (64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2)):
            layers += [torch.nn.Conv2d(c, width, 3, stride, 1, bias=False), torch.nn.BatchNorm2d(width),
                       torch.nn.SiLU()]
            c = width
        self.net = torch.nn.Sequential(*layers).to(device).half().to(memory_format=torch.channels_last)
        self.x = torch.randn(batch, 3, imgsz, imgsz, device=device, dtype=torch.half).contiguous(
            memory_format=torch.channels_last)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(3):
                self.net(self.x).float().square().mean().backward()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.net(self.x).float().square().mean().backward()
        self.device, self.replays, self._stop = device, 0, threading.Event()
        self._thread: threading.Thread | None = None

    def step_ms(self, n: int = 20) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            self.graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / n

    def _run(self) -> None:
        with torch.cuda.device(self.device):
            done: list[torch.cuda.Event] = []
            while not self._stop.is_set():
                self.graph.replay()
                event = torch.cuda.Event()
                event.record()
                done.append(event)
                if len(done) > 2:  # two replays in flight, as a training loop keeps its steps queued
                    done.pop(0).synchronize()
                    self.replays += 1

    def __enter__(self) -> Load:
        self._stop.clear()
        self.replays = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        time.sleep(0.5)  # the queue full before the first decode
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        torch.cuda.synchronize(self.device)


def time_calls(data: list[torch.Tensor], device: torch.device, n: int, repeats: int) -> list[float]:
    """Wall milliseconds of `repeats` calls decoding n JPEGs (different files each call)."""
    out = []
    for r in range(repeats):
        chunk = [data[(r * n + k) % len(data)] for k in range(n)]
        start = time.perf_counter()
        images = decode_jpegs_cuda(chunk, device)
        out.append(1e3 * (time.perf_counter() - start))
        del images
    return out


def main(out: Path, repeats: int = 12) -> None:
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda", 0)
    spec = shapes.ShapesSpec(train_images=4096, val_images=256, width=640, height=480, min_objects=1, max_objects=7,
                             texture=True)  # conf/data/shapes_bench.yaml
    root = Path(os.environ.get("DDP_LAUNCH_CACHE", "/tmp/ddp-launch-cache")) / "datasets"
    files = sorted((shapes.ensure_dataset(root, spec).parent / "images" / "train").glob("*.jpg"))[:1024]
    data = [torch.frombuffer(bytearray(f.read_bytes()), dtype=torch.uint8) for f in files]
    load = Load(device)
    result = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "repeats": repeats,
              "load_step_ms": load.step_ms(), "idle": {}, "loaded": {}}
    time_calls(data, device, 64, 3)  # nvJPEG's first calls allocate its buffers
    for n in SIZES:
        result["idle"][n] = time_calls(data, device, n, repeats)
    for n in SIZES:
        with load:
            started = time.perf_counter()
            calls = time_calls(data, device, n, repeats)
            seconds = time.perf_counter() - started
            replays = load.replays
        result["loaded"][n] = {"ms": calls, "load_replays": replays, "seconds": seconds}
    (out / "decode_per_call.json").write_text(json.dumps(result, indent=1))
    print(f"{result['device']}; the load's step {result['load_step_ms']:.1f} ms (alone)")
    print("JPEGs per call | idle: median ms | under load: median ms (min-max) | per image | load steps meanwhile")
    for n in SIZES:
        idle, loaded = result["idle"][n], result["loaded"][n]
        med = statistics.median(loaded["ms"])
        print(f"{n:>14} | {statistics.median(idle):>17.1f} | {med:>7.1f} ({min(loaded['ms']):.1f}-"
              f"{max(loaded['ms']):.1f}) | {med / n:.2f} | {loaded['load_replays']} in {loaded['seconds']:.2f} s")


if __name__ == "__main__":
    main(Path(sys.argv[1]), *(int(a) for a in sys.argv[2:]))

"""nvJPEG's batched decode beside a busy GPU: torchvision.io.decode_jpeg against ddp-launch's binding
(launcher/rank/data/nvjpeg.py) on a high-priority and a normal-priority stream (issue 13: the decoding thread's pace).

The load stands in for a training step: a CUDA graph of 3x3 convolutions, SiLU and a BatchNorm-like scale in fp16
channels_last (many kernels of tens to hundreds of microseconds, as in yolov8s's step), replayed on a stream of its
own or on the legacy default stream (where a training step runs unless told otherwise). Each round queues about
0.8 s of it, then times decodes of a batch of 64 photo-like 640x480 JPEGs
(the benchmark data's generator, launcher/inputs/shapes.py) while it runs, each from its call until its images are
ready on the device: torchvision's call (it waits for its own stream inside), the binding's call plus a wait for an
event recorded after it. The same on an idle GPU. Also checks that the binding's pixels equal torchvision's.

Usage: python3 decode_under_load.py OUT_DIR [--rounds 5] [--per-round 3]; prints a table, writes decode.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def jpegs(n: int) -> list:
    import cv2
    import torch

    from launcher.inputs.shapes import ShapesSpec, _draw_image

    spec = ShapesSpec(train_images=n, width=640, height=480, texture=True, max_objects=7)
    out = []
    for i in range(n):
        img, _ = _draw_image(spec, "train", i)
        ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, spec.quality])
        assert ok
        out.append(torch.frombuffer(bytearray(buf.tobytes()), dtype=torch.uint8))
    return out


def load_graph(ms: float, stream):
    """A CUDA graph of conv + SiLU + scale layers, about `ms` of GPU time per replay, replayed on `stream`."""
    import torch

    x = torch.randn(64, 64, 80, 80, device="cuda", dtype=torch.float16).to(memory_format=torch.channels_last)
    conv = torch.nn.Conv2d(64, 64, 3, padding=1, bias=False).cuda().half().to(memory_format=torch.channels_last)
    scale = torch.rand(1, 64, 1, 1, device="cuda", dtype=torch.float16)

    def layers(n):
        y = x
        for _ in range(n):
            y = torch.nn.functional.silu(conv(y) * scale)
        return y

    side = torch.cuda.Stream()
    with torch.no_grad(), torch.cuda.stream(side):
        layers(2)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            layers(10)
    torch.cuda.synchronize()

    def replay_ms() -> float:
        with torch.cuda.stream(stream):
            graph.replay()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(10):
                graph.replay()
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / 10 * 1e3

    per = replay_ms()
    return graph, max(1, round(ms / per)), per


def main() -> None:
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    from launcher.rank.data.nvjpeg import NvJpeg

    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--per-round", type=int, default=3)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = jpegs(args.batch)
    device = torch.device("cuda", 0)
    binding = NvJpeg(device)
    high, normal = torch.cuda.Stream(priority=-1), torch.cuda.Stream()

    def with_torchvision():
        decode_jpeg(data, mode=ImageReadMode.RGB, device=device)

    def with_binding(stream):
        def run():
            binding.stream = stream
            binding.decode(data)[1].synchronize()
        return run

    ways = {"torchvision": with_torchvision, "binding, high priority": with_binding(high),
            "binding, normal priority": with_binding(normal)}
    for fn in ways.values():  # each decoder's start
        fn()
        fn()
    expected = decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
    binding.stream = high
    got, ready = binding.decode(data)
    ready.synchronize()
    same = sum(int(g is not None and torch.equal(g, e)) for g, e in zip(got, expected))
    declined = sum(g is None for g in got)

    # the load on a stream of its own (non-blocking, as PyTorch makes them), or on the legacy default stream, where
    # a training step runs unless told otherwise
    loads = {"side stream": torch.cuda.Stream(), "default stream": torch.cuda.default_stream()}
    result = {"batch": args.batch, "mean_file_kb": sum(d.numel() for d in data) / len(data) / 1e3,
              "hardware_decoder": binding.hardware, "equal_to_torchvision": same, "declined": declined, "cells": []}
    for load_name, load_stream in loads.items():
        graph, replays, replay_ms = load_graph(800.0, load_stream)
        for name, fn in ways.items():
            idle, busy, left = [], [], []
            for _ in range(args.rounds):
                torch.cuda.synchronize()
                for _ in range(args.per_round):
                    start = time.perf_counter()
                    fn()
                    idle.append((time.perf_counter() - start) * 1e3)
                with torch.cuda.stream(load_stream):
                    for _ in range(replays):  # about 0.8 s of load queued, then the decodes beside it
                        graph.replay()
                queued = time.perf_counter()
                for _ in range(args.per_round):
                    start = time.perf_counter()
                    fn()
                    busy.append((time.perf_counter() - start) * 1e3)
                before = time.perf_counter()
                torch.cuda.synchronize()
                left.append((time.perf_counter() - before) * 1e3)  # the load still queued when the decodes ended
            cell = {"load": load_name, "decoder": name, "load_ms": replays * replay_ms,
                    "idle_ms": statistics.median(idle), "busy_ms": statistics.median(busy), "busy_max_ms": max(busy),
                    "load_left_ms": statistics.median(left)}
            result["cells"].append(cell)
            print(json.dumps(cell), flush=True)
    (out / "decode.json").write_text(json.dumps(result, indent=1))
    print(f"batch {args.batch}, {result['mean_file_kb']:.0f} kB per file, hardware decoder {binding.hardware}; "
          f"binding equal to torchvision on {same}/{len(data)} images ({declined} declined)")
    print("| load on | decoder | idle GPU, ms per batch | busy GPU, median (max) | load left after the decodes, ms |")
    print("| --- | --- | ---: | ---: | ---: |")
    for c in result["cells"]:
        print(f"| {c['load']} | {c['decoder']} | {c['idle_ms']:.1f} | {c['busy_ms']:.1f} ({c['busy_max_ms']:.1f}) | "
              f"{c['load_left_ms']:.0f} of {c['load_ms']:.0f} |")


if __name__ == "__main__":
    main()

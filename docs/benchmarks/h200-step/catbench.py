"""The channel concatenations' Triton copies alone (rank/kernels/kernels.py's cat_channels) against torch.cat, on the
training step's largest shapes (yolov8s, batch 64, 640 px), eager, one launch per part, for several block shapes
(pixels x channels per program). Prints microseconds per concatenation and the bytes moved per second.

Usage (the H200 machine, ddp-launch installed): python3 catbench.py
"""
import torch

from launcher.rank.kernels import kernels

CASES = {  # name: (batch, height, width, the parts' channels); "p*" cases: C2f's, the first two parts halves of one
    "p2 3x32 @160": (64, 160, 160, [32, 32, 32]),
    "p3 4x64 @80": (64, 80, 80, [64, 64, 64, 64]),
    "p4 4x128 @40": (64, 40, 40, [128] * 4),
    "concat 512+256 @40": (64, 40, 40, [512, 256]),
}
BLOCKS = [(128, 32), (64, 64), (256, 32), (128, 64), (64, 32), (256, 16)]


def ms_per_call(fn, calls: int = 50) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def channels_last(*shape: int) -> torch.Tensor:
    return torch.randn(shape, device="cuda", dtype=torch.half).contiguous(memory_format=torch.channels_last)


for rows, channels in BLOCKS:
    kernels.COPY_ROWS, kernels.COPY_CHANNELS = rows, channels
    line = []
    for name, (n, h, w, widths) in CASES.items():
        if name.startswith("p"):
            whole = channels_last(n, 2 * widths[0], h, w)
            parts = [whole[:, :widths[0]], whole[:, widths[0]:], *(channels_last(n, c, h, w) for c in widths[2:])]
        else:
            parts = [channels_last(n, c, h, w) for c in widths]
        ours = ms_per_call(lambda: kernels.cat_channels(parts))
        theirs = ms_per_call(lambda: torch.cat(parts, 1))
        gigabytes = 2 * sum(p.numel() for p in parts) * 2 / 1e9  # read and written once, fp16
        line.append(f"{name}: {ours * 1e3:.0f} us ({gigabytes / ours * 1e3:.0f} GB/s) torch {theirs * 1e3:.0f} us")
    print(rows, channels, " | ".join(line), flush=True)

"""Issue 13: what the GPU input pipeline costs, measured apart from training, on the benchmark dataset.

1. The workers' half alone: batches of file bytes per second from N workers (no decode), pinned, as the rank gets them.
2. The device's half alone: GpuInput on batches already read, synchronised per batch: images/s, and decode vs the
   rest (load, mosaic, warp, HSV, boxes).
3. torch.profiler over the device's half: kernel time on the GPU's SMs per image, by kernel (nvJPEG's hardware
   engine does not show there), and the same for the CPU path's host-to-device copy for comparison.

Usage (the H200 machine): python3 docs/benchmarks/h200-gpu-input/profile_input.py OUT_DIR [IMGSZ] [BATCH]
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from launcher.inputs import shapes
from launcher.rank.data.encoded import EncodedImages, EncodedTrainDataset
from launcher.rank.gpu_data.gpu_augment import GpuAugment
from launcher.rank.gpu_data.gpu_input import Decoder, GpuInput, buffer_capacity
from launcher.rank.data.sampler import EpochBatchSampler


def device_time_us(event) -> float:
    return float(getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0))


def main(out: Path, imgsz: int = 640, batch: int = 64) -> None:
    from ultralytics.cfg import get_cfg

    from launcher.rank.ultralytics.datasets import raw_train_dataset

    out.mkdir(parents=True, exist_ok=True)
    spec = shapes.ShapesSpec(train_images=4096, val_images=256, width=640, height=480, min_objects=1, max_objects=7,
                             texture=True)  # conf/data/shapes_bench.yaml
    root = Path(os.environ.get("DDP_LAUNCH_CACHE", "/tmp/ddp-launch-cache")) / "datasets"
    t0 = time.time()
    yaml_path = shapes.ensure_dataset(root, spec)
    print(f"dataset ready in {time.time() - t0:.0f} s", flush=True)
    train = yaml_path.parent / "images" / "train"
    hyp = get_cfg(overrides={"imgsz": imgsz})
    data = {"train": str(train), "names": dict(enumerate(shapes.CLASSES)), "nc": len(shapes.CLASSES), "channels": 3}
    inner = raw_train_dataset(hyp, data, batch)
    images = EncodedImages.of(inner)
    sizes = [Path(f).stat().st_size for f in images.files]
    result = {"images": len(images), "mean_file_kb": sum(sizes) / len(sizes) / 1024, "imgsz": imgsz, "batch": batch,
              "boxes_per_image": float(len(images.cls) / len(images))}
    ds = EncodedTrainDataset(images)

    # 1. the workers' half
    for workers in (2, 4):
        sampler = EpochBatchSampler(len(ds), batch, seed=0)
        loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler, num_workers=workers, collate_fn=ds.collate_fn,
                                             pin_memory=True, prefetch_factor=4, persistent_workers=False)
        it = iter(loader)
        for _ in range(5):
            next(it)
        start, n = time.perf_counter(), 40
        for _ in range(n):
            next(it)
        result[f"workers_{workers}_images_per_s"] = n * batch / (time.perf_counter() - start)
        del it, loader

    # 2. the device's half alone
    dev = torch.device("cuda")
    sampler = EpochBatchSampler(len(ds), batch, seed=0)
    keys = list(itertools.islice(iter(sampler), 40))  # the sampler never ends
    batches = [ds.collate_fn([ds[k] for k in ks]).pin_memory() for ks in keys]
    gi = GpuInput(GpuAugment(imgsz, hyp, out_dtype=torch.float16), Decoder(dev, images.files, print),
                  capacity=buffer_capacity(len(images), batch), device=dev, timed=False)
    g = torch.Generator(device=dev)
    for b in batches[:8]:  # compile the kernels, fill the buffer
        gi(b, g.manual_seed(0))
    torch.cuda.synchronize()
    start = time.perf_counter()
    for b in batches[8:]:
        gi(b, g.manual_seed(1))
    torch.cuda.synchronize()
    result["device_half_images_per_s"] = (len(batches) - 8) * batch / (time.perf_counter() - start)
    decode_s = 0.0
    for b in batches[8:]:
        torch.cuda.synchronize()
        t = time.perf_counter()
        gi.decode(b)
        torch.cuda.synchronize()
        decode_s += time.perf_counter() - t
    result["decode_alone_images_per_s"] = (len(batches) - 8) * batch / decode_s

    # 3. kernel time on the SMs
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for b in batches[8:24]:
            gi(b, g.manual_seed(2))
        torch.cuda.synchronize()
    profiled = 16 * batch
    kernels = sorted(((device_time_us(e), e.key) for e in prof.key_averages() if device_time_us(e) > 0), reverse=True)
    on_sms = [(t, k) for t, k in kernels if _is_kernel(k)]
    result["sm_kernel_ms_per_image"] = sum(t for t, _ in on_sms) / 1000 / profiled
    result["copies_ms_per_image"] = sum(t for t, k in kernels if k.startswith(("Memcpy", "Memset"))) / 1000 / profiled
    result["top_kernels_us_per_image"] = [(k[:90], round(t / profiled, 3)) for t, k in kernels[:15]]
    (out / "profile.txt").write_text(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40))
    (out / "profile_input.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


def _is_kernel(key: str) -> bool:
    """A kernel on the SMs: not an operator (aten:: rows repeat their kernels' time), not a runtime call, not a copy
    (copy engines)."""
    return not key.startswith(("aten::", "cuda", "Memcpy", "Memset", "ProfilerStep", "torchvision::", "image::"))


if __name__ == "__main__":
    main(Path(sys.argv[1]), *(int(a) for a in sys.argv[2:4]))

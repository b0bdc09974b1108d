"""Issues 13 and 14: does cuDNN's own timing of its convolution algorithms (`torch.backends.cudnn.benchmark`,
`train.cudnn_benchmark`) make yolov8s's validation forward faster than its heuristics (what the ranks use unless
asked)? forward_probe.py and h200-step/step_probe.py timed their forms with it on; the ranks never set it.

The shipped validation forward (rank/validate/forward.py's InferenceForward, a CUDA graph per batch shape) over
yolov8s at batch 128 x 512x672 (a 640x480 split's rectangular batch): the model under fp16 autocast (the fast
validator's default) and its folded fp16 copy (rank/ultralytics/folded.py, val.fold_batchnorm), each captured with
the flag off and on, cuDNN's deterministic switch on as the ranks set it by default (Ultralytics' deterministic=True).
A graph keeps the algorithms it was captured with, so the four are replayed interleaved: 5 rounds of 20 replays,
medians. The capture's time is printed too (with the flag on it includes cuDNN's timing runs).

Usage (a GPU machine, ddp-launch and Ultralytics installed): python3 docs/benchmarks/h200-validation/cudnn_probe.py OUT
Prints a table and writes OUT/cudnn_probe.json.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("YOLO_OFFLINE", "1")
os.environ.setdefault("YOLO_CONFIG_DIR", "/tmp/yolo")

import torch  # noqa: E402

from launcher.rank.ultralytics.folded import FoldedCopy  # noqa: E402
from launcher.rank.validate.forward import InferenceForward  # noqa: E402

BATCH, H, W = 128, 512, 672


def replay_ms(forward: InferenceForward, img: torch.Tensor, n: int = 20) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        forward(img)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def main(out: Path) -> None:
    from ultralytics.nn.tasks import DetectionModel

    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda", 0)
    torch.backends.cudnn.deterministic = True
    torch.manual_seed(0)
    model = DetectionModel("yolov8s.yaml", nc=2, verbose=False).to(dev)
    model.train()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        for _ in range(3):  # BatchNorm statistics that are not the identity
            model(torch.rand(8, 3, 640, 640, device=dev))
    model.eval()
    folded = FoldedCopy(model, torch.float16)
    img = torch.randint(0, 255, (BATCH, 3, H, W), device=dev, dtype=torch.uint8)
    forwards, result = {}, {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                            "cudnn": torch.backends.cudnn.version(), "batch": [BATCH, H, W], "rows": {}}
    for benchmark in (False, True):
        torch.backends.cudnn.benchmark = benchmark
        for name, net, amp in (("autocast", model, torch.float16), ("folded", folded.model, None)):
            key = f"{name}, benchmark {'on' if benchmark else 'off'}"
            started = time.perf_counter()
            forward = InferenceForward(net, dev, batch=BATCH, amp_dtype=amp, graphs=True, log=lambda *a: None)
            forward(img)
            torch.cuda.synchronize(dev)
            forwards[key] = forward
            result["rows"][key] = {"capture_s": time.perf_counter() - started, "ms": []}
    torch.backends.cudnn.benchmark = False
    for _ in range(5):
        for key, forward in forwards.items():
            result["rows"][key]["ms"].append(replay_ms(forward, img))
    (out / "cudnn_probe.json").write_text(json.dumps(result, indent=1))
    print(f"{result['device']}, torch {result['torch']}, cuDNN {result['cudnn']}; batch {BATCH} x {H}x{W}")
    print("forward | capture s | ms per batch (median of 5, min-max) | images/s")
    for key, row in result["rows"].items():
        med = statistics.median(row["ms"])
        print(f"{key} | {row['capture_s']:.2f} | {med:.2f} ({min(row['ms']):.2f}-{max(row['ms']):.2f}) | "
              f"{BATCH / med * 1e3:,.0f}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))

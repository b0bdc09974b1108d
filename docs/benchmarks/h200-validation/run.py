"""Issue 14: validation at inference speed. The fast validator (val.engine=fast) against Ultralytics'
DetectionValidator (val.engine=ultralytics) on the same weights and the same validation split, one GPU.

1. Weights: --weights PATH (a best.pt), or a short ddp-launch training run of the model on the same data (default
   3 epochs) whose best.pt is used (its log also shows the fast validator at work in a real run).
2. Ultralytics' engine as ddp-launch ran it before: its validation loader (rect batches of 2 x the training batch,
   pad 0.5), the EMA in fp16 autocast, its NMS and metrics, the validation loss: --passes timed passes after one
   unmeasured (its workers start).
3. The fast engine on the same loader's images: the one-off preload (reported apart), the first pass (CUDA graph
   capture), then --passes timed passes, for each --batch (and at the first batch, as --rows picks: without CUDA
   graphs, with each batch's post-processing after its forward on one stream instead of pipelined on a second,
   on a copy of the EMA with BatchNorm folded in fp16 instead of the EMA under autocast (`folded`), and with
   --no-scans the post-processing without its Triton scans (rank/kernels/scans.py): torchvision's NMS image by
   image and the matching's rounds in PyTorch. The fixed-point NMS of the sessions before the twelfth, which the
   ninth session's --old-nms-rounds varied, is gone.
Every pass is a whole validation as a training run calls it: forward, NMS, matching, the validation loss, rank 0's
ap_per_class; images/s = images / wall time of the pass. Both mAPs are printed; they differ only by fp16 rounding
(the pixels, letterbox, NMS and matching are Ultralytics').

Usage (the H200 machine, from the repository root, ddp-launch installed):
  python3 docs/benchmarks/h200-validation/run.py OUT_DIR [--val-images 800] [--imgsz 640] [--model yolov8s] [--profile]
Results: OUT_DIR/results.json and OUT_DIR/results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import torch


def dataset(val_images: int, out: Path, train_images: int | None = None) -> Path:
    """conf/data/shapes_bench.yaml's split (4,096 train / 256 val textured 640x480 JPEGs), or with --val-images N
    the same generator with N validation images and a token training split."""
    from launcher.inputs import shapes

    bench = val_images == 256
    spec = shapes.ShapesSpec(train_images=train_images or (4096 if bench else 64), val_images=val_images, width=640, height=480,
                             min_objects=1, max_objects=7, texture=True)
    root = Path(os.environ.get("DDP_LAUNCH_CACHE", Path.home() / ".cache" / "ddp-launch")) / "datasets"
    t0 = time.time()
    path = shapes.ensure_dataset(root, spec)
    print(f"dataset {path.parent} ready in {time.time() - t0:.0f} s", flush=True)
    return path


def trained_weights(args, data_yaml: Path, out: Path) -> str:
    if args.weights:
        return args.weights
    from launcher import train

    overrides = [f"model={args.model}", "data=custom", f"data.path={data_yaml}", f"train.imgsz={args.imgsz}",
                 f"train.batch_per_device={args.train_batch}", f"train.epochs={args.epochs}", "train.close_mosaic=1",
                 "train.plots=false"]
    print("training:", " ".join(overrides), flush=True)
    summary = train(overrides, run_dir=out / "train")
    print(f"trained: mAP50-95 {summary['map50_95']}, weights {summary['weights']}", flush=True)
    return summary["weights"]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(validate, passes: int) -> tuple[list[float], dict]:
    times, metrics = [], None
    for _ in range(passes):
        sync()
        t0 = time.perf_counter()
        metrics, _ = validate()
        sync()
        times.append(time.perf_counter() - t0)
    return times, metrics


def profile(validate, out: Path) -> None:
    """Where one pass's time goes: on the host (cProfile) and on the GPU (torch.profiler's kernel totals)."""
    import cProfile
    import io
    import pstats

    host = cProfile.Profile()
    sync()
    host.enable()
    validate()
    sync()
    host.disable()
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("cumulative").print_stats(45)
    (out / "profile-host.txt").write_text(text.getvalue())
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        validate()
        sync()
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    (out / "profile-gpu.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=40))
    print(f"profiled: {out / 'profile-host.txt'}, {out / 'profile-gpu.txt'}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--val-images", type=int, default=256)
    p.add_argument("--imgsz", type=int, default=640)
    p.add_argument("--model", default="yolov8s")
    p.add_argument("--weights", default=None)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--train-images", type=int, default=None,
                   help="the training split's size for the weights' run (default: 4,096 with 256 val images, else 64)")
    p.add_argument("--train-batch", type=int, default=64, help="sets Ultralytics' val batch: 2 x this")
    p.add_argument("--batch", type=int, nargs="+", default=[128, 256], help="the fast engine's val.batch values")
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--workers", type=int, default=16, help="the validation loader's workers (a run: 2 x its own)")
    p.add_argument("--rows", default="graphs-off,serial,folded",
                   help="the rows at the first batch besides the shipped engine: graphs-off, serial, folded")
    p.add_argument("--fold", action="store_true", help="the --batch rows on the folded copy (FastValidator(folded))")
    p.add_argument("--no-graphs", action="store_true", help="the --batch rows without CUDA graphs")
    p.add_argument("--skip-ultralytics", action="store_true",
                   help="no Ultralytics row (a fresh process per engine: its first validation alone)")
    p.add_argument("--no-scans", action="store_true",
                   help="one more row: the first batch without the Triton scans (torchvision's NMS image by image, "
                        "the matching's rounds in PyTorch)")
    p.add_argument("--profile", action="store_true",
                   help="one more pass of the fast engine at the first batch, profiled: OUT_DIR/profile-host.txt "
                        "(cProfile, by cumulative time) and profile-gpu.txt (torch.profiler, by GPU time)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data_yaml = dataset(args.val_images, args.out, args.train_images)
    weights = trained_weights(args, data_yaml, args.out)

    from ultralytics.cfg import get_cfg

    from launcher.inputs import shapes
    from launcher.rank.group.dist import Comm
    from launcher.rank.ultralytics import datasets
    from launcher.rank.ultralytics.fast_validation import FastValidator
    from launcher.rank.ultralytics.validation import Validator

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")  # the CPU: a smoke test
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ckpt = torch.load(weights, map_location="cpu", weights_only=False)
    model = (ckpt.get("ema") or ckpt["model"]).float().to(device).eval()
    hyp = get_cfg(overrides={"imgsz": args.imgsz, "plots": False})
    model.args = hyp  # the loss gains, as a rank sets them (a checkpoint holds a dict)
    ema = SimpleNamespace(ema=model)
    data = {"val": str(data_yaml.parent / "images" / "val"), "names": dict(enumerate(shapes.CLASSES)),
            "nc": len(shapes.CLASSES), "channels": 3}
    val_batch = 2 * args.train_batch
    kwargs = dict(device=device, data=data, amp=device.type == "cuda", epoch=0, epochs=1,
                  loss_items={k: torch.zeros((), device=device) for k in ("box_loss", "cls_loss", "dfl_loss")})

    def loader():
        return datasets.val_loader(hyp, data, val_batch, 32, args.workers, device)

    result = {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__, "model": args.model,
              "weights": weights, "imgsz": args.imgsz, "val_images": args.val_images, "workers": args.workers,
              "ultralytics_val_batch": val_batch, "passes": args.passes, "rows": []}

    base = float("nan")
    if not args.skip_ultralytics:
        ul = Validator(loader(), hyp, args.out / "ultralytics")
        validate = lambda: ul.validate(ema, Comm(), **kwargs)  # noqa: E731
        validate()  # its workers start
        times, metrics = timed(validate, args.passes)
        base = args.val_images / (sum(times) / len(times))
        result["rows"].append({"engine": "ultralytics", "batch": val_batch, "graphs": False, "images_per_s": base,
                               "pass_s": times, "map50": metrics["metrics/mAP50(B)"],
                               "map50_95": metrics["metrics/mAP50-95(B)"], "metrics": metrics})
        print(f"ultralytics: {base:.0f} images/s, mAP50-95 {metrics['metrics/mAP50-95(B)']:.4f}", flush=True)

    from launcher.rank.kernels import scans

    rows = set(filter(None, args.rows.split(",")))
    unknown = rows - {"graphs-off", "serial", "folded"}
    if unknown:
        p.error(f"--rows: unknown {sorted(unknown)}")
    first = args.batch[0]
    configs = [(b, not args.no_graphs, True, "", args.fold) for b in args.batch]
    configs += [(first, False, True, "", False)] * ("graphs-off" in rows) + [(first, True, False, "", False)] * (
        "serial" in rows) + [(first, True, True, "", True)] * ("folded" in rows)
    if args.no_scans:
        configs.append((first, True, True, "no-scans", False))
    shipped = scans.usable
    for batch, graphs, pipelined, nms_rounds, folded in configs:
        scans.usable = (lambda t: False) if nms_rounds == "no-scans" else shipped
        fast = FastValidator(loader(), hyp, args.out / f"fast{batch}", batch=batch,
                             amp_dtype=torch.float16 if device.type == "cuda" else None,
                             cuda_graphs=graphs, pipelined=pipelined, folded=folded, log=print)
        validate = lambda: fast.validate(ema, Comm(), **kwargs)  # noqa: E731
        t0 = time.perf_counter()
        validate()  # the preload (timed inside) and the graphs' capture
        first = time.perf_counter() - t0
        times, metrics = timed(validate, args.passes)
        ips = args.val_images / (sum(times) / len(times))
        result["rows"].append({"engine": "fast", "batch": batch, "graphs": graphs, "pipelined": pipelined,
                               "nms": nms_rounds or "shipped", "folded": folded,
                               "images_per_s": ips,
                               "pass_s": times, "preload_s": fast.timing["preload_s"], "first_pass_s": first,
                               "pass_only_images_per_s": fast.timing["images_per_s"],
                               "map50": metrics["metrics/mAP50(B)"], "map50_95": metrics["metrics/mAP50-95(B)"],
                               "metrics": metrics})
        print(f"fast batch {batch} graphs {graphs} pipelined {pipelined} nms {nms_rounds or 'shipped'} folded {folded}: "
              f"{ips:.0f} images/s ({ips / base:.1f}x), preload "
              f"{fast.timing['preload_s']:.2f} s, mAP50-95 {metrics['metrics/mAP50-95(B)']:.4f}", flush=True)
        if args.profile and (batch, graphs, pipelined, nms_rounds, folded) == configs[0]:
            profile(validate, args.out)
        del fast
        if device.type == "cuda":
            torch.cuda.empty_cache()

    (args.out / "results.json").write_text(json.dumps(result, indent=2))
    lines = [f"# Validation engines, {result['gpu']}, {args.model} at {args.imgsz} px, {args.val_images} images",
             "", f"weights `{weights}`; Ultralytics' loader: {args.workers} workers, batch {val_batch}; "
             f"mean of {args.passes} passes", "",
             "| engine | batch | CUDA graphs | pipelined | folded | NMS | images/s | x Ultralytics | first validation s | "
             "preload s | mAP50 | mAP50-95 |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        lines.append(f"| {r['engine']} | {r['batch']} | {r['graphs']} | {r.get('pipelined', '-')} | "
                     f"{r.get('folded', '-')} | "
                     f"{r.get('nms', '-')} | {r['images_per_s']:.0f} | {r['images_per_s'] / base:.1f} | "
                     f"{r.get('first_pass_s', float('nan')):.2f} | {r.get('preload_s', float('nan')):.2f} | "
                     f"{r['map50']:.4f} | "
                     f"{r['map50_95']:.4f} |")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

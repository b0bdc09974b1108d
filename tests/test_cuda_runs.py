"""Whole runs on one GPU: every lever on, the other model families captured, a compiled network, the auto batch,
the fast validator against Ultralytics' mAP, the pipelined validation pass, the step profile, a fork after the
warm torchrun's imports. Skipped without CUDA (CI); run on the GPU machine (`pytest -m gpu`)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.conftest import TINY, ddp_launch, run_dir_of

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("augment_on", ["gpu", "cpu"])
def test_one_gpu_trains_with_every_lever_on(tmp_path, cache_dir, augment_on):
    levers = ["train.cuda_graphs=true", f"loader.augment_on={augment_on}", "train.cache=shared", "mode=ddp", "gpus=1"]
    r = ddp_launch([*TINY, "train.epochs=3", *levers], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((run_dir_of(r) / "summary.json").read_text())
    assert summary["backend"] == "nccl" and summary["epochs_completed"] == 3
    assert summary["ranks"][0]["gpus"], "NVML figures missing"
    # one GPU: the whole step is captured (rank/step/captured_step.py)
    assert "CUDA graphs: the whole step's forward, loss and backward captured" in (run_dir_of(r) / "logs" / "rank0.log").read_text()
    gpu_ms = summary["ranks"][0]["input_gpu_ms_per_image"]
    assert (gpu_ms is not None and gpu_ms > 0) == (augment_on == "gpu"), gpu_ms
    threads = summary["ranks"][0]["input_threads"]  # the GPU input's threads: decode, augment
    assert (set(threads) if threads else set()) == ({"decode", "prepare"} if augment_on == "gpu" else set()), threads


@pytest.mark.parametrize("model", ["yolo11n", "yolo26n"])
def test_cuda_graphs_capture_the_other_shipped_model_families(tmp_path, cache_dir, model):
    """train.cuda_graphs=auto is the default on GPUs: the other families are captured too, not left to the eager
    fallback: yolo11's whole step, yolo26's network (its end-to-end head returns nested dicts; its loss reweights
    its branches every epoch, which a captured loss would freeze)."""
    r = ddp_launch([*TINY, f"model={model}", "train.epochs=1", "gpus=1"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    log = (run_dir_of(r) / "logs" / "rank0.log").read_text()
    expected = "the whole step's forward, loss and backward captured" if model == "yolo11n" else (
        "CUDA graphs: forward and backward captured")
    assert expected in log, log[-3000:]


def test_one_gpu_trains_with_a_compiled_network(tmp_path, cache_dir):
    r = ddp_launch([*TINY, "train.epochs=2", "train.compile=reduce-overhead", "mode=ddp", "gpus=1"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((run_dir_of(r) / "summary.json").read_text())
    assert summary["epochs_completed"] == 2
    assert all(v == v and abs(v) < 1e4 for v in summary["ranks"][0]["loss"].values()), summary["ranks"][0]["loss"]


def test_auto_batch_measure_survives_a_real_out_of_memory_and_frees_what_it_allocated():
    from launcher.rank.step import auto_batch

    memory, gib = auto_batch.CudaMemory(torch.device("cuda")), 2**30
    memory.release()
    before = torch.cuda.memory_reserved()
    assert auto_batch.measure(lambda b: torch.empty(2 * memory.total(), dtype=torch.uint8, device="cuda"), 8, memory) is None
    held = []
    peak = auto_batch.measure(lambda b: held.append(torch.empty(b * gib, dtype=torch.uint8, device="cuda")), 2, memory)
    held.clear()
    memory.release()
    assert 2 * gib <= peak - before < 2 * gib + 2**26
    assert torch.cuda.memory_reserved() == before


def test_auto_batch_fits_and_an_epoch_at_it_uses_50_to_70_percent_of_the_gpu(tmp_path, cache_dir):
    """yolov8s at 640 px with train.batch_per_device=auto (the default fraction, 0.6) on real CUDA graphs, AMP and
    the sync-free loss: the chosen batch is a multiple of 8, its verified step within the limit, and a training
    epoch at it (validation of the untrained model's thousands of candidates included) runs to its end within the
    70 % its allocator is held to, peaking above 50 % of the GPU's memory. Measured as the caching allocator's peak
    reserved bytes: what the probe limits and what an out-of-memory error sees (allocated is lower by the
    allocator's cache; NVML adds the CUDA context). Unheld, the same epoch reserved 93-99 %
    (docs/benchmarks/h200-auto-batch/README.md)."""
    data = ["data.synthetic.train_images=2048", "data.synthetic.val_images=32", "data.synthetic.width=320",
            "data.synthetic.height=256"]
    r = ddp_launch([*data, "gpus=1", "model=yolov8s", "train.imgsz=640", "train.batch_per_device=auto",
                    "train.epochs=1", "train.plots=false", "optim.lr_scaling=linear"], cwd=tmp_path, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "batch           auto per device x 1 device(s): the largest multiple of 8" in r.stdout
    summary = json.loads((run_dir_of(r) / "summary.json").read_text())
    auto, batch = summary["auto_batch"], summary["batch_per_device"]
    print(f"batch {batch}; {auto}; peak reserved {summary['memory_peak_reserved_gib']:.1f} GiB, allocated "
          f"{summary['memory_peak_allocated_gib']:.1f} GiB, NVML {summary['memory_peak_gib']} GiB of "
          f"{summary['memory_total_gib']:.1f} GiB; allocator retries {summary['memory_alloc_retries']}")
    assert batch % 8 == 0 and batch == auto["batch_per_device"] and auto["limited_by"] == "memory"
    assert auto["peak_gib"] <= auto["limit_gib"] == pytest.approx(0.6 * auto["total_gib"], rel=1e-3)
    settled = auto["with_validation"][-1]  # the steps with a validation batch beside them, within the held 70 %
    assert settled["batch"] == batch and settled["fits"] and settled["peak_gib"] <= auto["held_gib"]
    assert summary["global_batch"] == batch and summary["lr0"] == pytest.approx(0.01 * batch / 64)
    assert 0.5 <= summary["memory_peak_reserved_gib"] / summary["memory_total_gib"] <= 0.7
    log = (run_dir_of(r) / "logs" / "rank0.log").read_text()
    assert f"auto batch: {batch} per device" in log and f"lr0             {summary['lr0']:.6g}" in log
    assert "the run's allocator held to 70 %" in log and auto["held_fraction"] == pytest.approx(0.7)
    assert f"CUDA graphs: the whole step's forward, loss and backward captured for batches of {batch}" in log
    assert json.loads((run_dir_of(r) / "plan.json").read_text())["batch_per_device"] == batch  # for a restart


def test_the_fast_validator_on_cuda_gives_ultralytics_map(tmp_path, cache_dir):
    """val.engine=fast (fp16, CUDA graphs, batched NMS and matching; the EMA, then its folded copy) against
    Ultralytics' DetectionValidator on the same weights (a head that finds some of the shapes untrained:
    test_validation_split's) and split: the same mAP up to fp16 rounding; each engine's images/s printed."""
    import time
    from types import SimpleNamespace

    from ultralytics.cfg import get_cfg

    from launcher.inputs.shapes import CLASSES, ShapesSpec, ensure_dataset
    from launcher.rank.group.dist import Comm
    from launcher.rank.ultralytics import datasets
    from launcher.rank.ultralytics.fast_validation import FastValidator
    from launcher.rank.ultralytics.validation import Validator
    from tests.test_validation_split import a_model_that_finds_objects

    spec = ShapesSpec(train_images=2, val_images=64, width=97, height=71, seed=3)
    root = ensure_dataset(tmp_path / "data", spec, workers=1, log=lambda *_: None).parent
    device = torch.device("cuda", 0)
    model = a_model_that_finds_objects().to(device)
    hyp = get_cfg(overrides={"imgsz": 64, "plots": False})
    model.args = hyp
    data = {"val": str(root / "images" / "val"), "names": dict(enumerate(CLASSES)), "nc": len(CLASSES), "channels": 3}
    kwargs = dict(device=device, data=data, amp=True, epoch=0, epochs=1,
                  loss_items={k: torch.zeros((), device=device) for k in ("box_loss", "cls_loss", "dfl_loss")})
    ema = SimpleNamespace(ema=model)
    results = {}
    for name in ("ultralytics", "fast", "folded"):
        loader = datasets.val_loader(hyp, data, 16, 32, 2, device)
        validator = (Validator(loader, hyp, tmp_path / name) if name == "ultralytics" else
                     FastValidator(loader, hyp, tmp_path / name, batch=32, amp_dtype=torch.float16,
                                   folded=name == "folded", log=print))
        validator.validate(ema, Comm(), **kwargs)  # workers start / the preload and the graphs' capture
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        metrics, _ = validator.validate(ema, Comm(), **kwargs)
        torch.cuda.synchronize()
        results[name] = (metrics, 64 / (time.perf_counter() - t0))
        print(f"{name}: {results[name][1]:.0f} images/s, mAP50 {metrics['metrics/mAP50(B)']:.4f} "
              f"mAP50-95 {metrics['metrics/mAP50-95(B)']:.4f}")
    want = results["ultralytics"][0]
    assert want["metrics/recall(B)"] > 0  # something was found: the comparison is not of zeros
    for got in (results["fast"][0], results["folded"][0]):
        assert list(got) == list(want)
        for key in ("metrics/mAP50(B)", "metrics/mAP50-95(B)", "metrics/precision(B)", "metrics/recall(B)"):
            assert abs(got[key] - want[key]) <= 0.05 * want[key] + 1e-4, (key, got[key], want[key])  # both in fp16


class ImageDependentHead(torch.nn.Module):
    """A detector-like eval output (B, 4 + nc, anchors) that depends on each image (a random network's barely does:
    its outputs for two batches agree to 1e-5): boxes and class scores from the image's pooled pixels."""

    def __init__(self, nc: int, anchors: int = 600):
        super().__init__()
        torch.manual_seed(0)
        self.nc, self.anchors = nc, anchors
        self.proj = torch.nn.Linear(3 * 8 * 8, (4 + nc) * anchors)
        torch.nn.init.normal_(self.proj.weight, 0, 0.1)

    def forward(self, x):
        h, w = x.shape[2:]
        z = self.proj(torch.nn.functional.adaptive_avg_pool2d(x, 8).flatten(1)).view(len(x), 4 + self.nc, -1).float()
        xy = torch.sigmoid(z[:, :2])
        wh, scores = 8 + 40 * torch.sigmoid(z[:, 2:4]), torch.sigmoid(z[:, 4:]) ** 3
        return torch.cat([xy[:, :1] * w, xy[:, 1:] * h, wh, scores], 1)


def test_the_pipelined_validation_pass_computes_what_the_serial_pass_computes(tmp_path):
    """run_pass with a second stream (the next batch's graph replayed before this batch's NMS, matching and loss):
    exactly the statistics and loss of the same pass with everything on one stream (each batch post-processed
    before the next replay), over several batches whose outputs differ."""
    from ultralytics.cfg import get_cfg

    from launcher.inputs.shapes import CLASSES, ShapesSpec, ensure_dataset
    from launcher.rank.ultralytics import datasets
    from launcher.rank.validate.engine import NmsSettings, run_pass
    from launcher.rank.validate.forward import InferenceForward
    from launcher.rank.validate.store import PreloadedSplit

    spec = ShapesSpec(train_images=2, val_images=72, width=97, height=71, seed=5)
    root = ensure_dataset(tmp_path / "data", spec, workers=1, log=lambda *_: None).parent
    device = torch.device("cuda", 0)
    model = ImageDependentHead(len(CLASSES)).to(device).eval()
    hyp = get_cfg(overrides={"imgsz": 64, "plots": False})
    data = {"val": str(root / "images" / "val"), "names": dict(enumerate(CLASSES)), "nc": len(CLASSES), "channels": 3}
    split = PreloadedSplit.load(iter(datasets.val_loader(hyp, data, 16, 32, 0, device)), device)
    forward = InferenceForward(model, device, batch=16, amp_dtype=torch.float16, graphs=True, log=print)
    first, second = list(split.batches(16))[:2]
    with torch.inference_mode():  # the premise: batches' outputs differ, so an output overwritten too soon shows
        out = forward(first.img).clone()
        assert not torch.equal(forward(second.img)[:16], out)
        last = list(split.batches(16))[-1]  # 8 images: the whole graph's 16 rows once, then a graph of 8 rows
        forward(last.img)
        assert sorted(rows for rows, *_ in forward._captured) == [16]
        forward(last.img)
        assert sorted(rows for rows, *_ in forward._captured) == [8, 16]
    loss_fn = lambda targets, preds: {"preds": preds.sum(), "targets": targets["bboxes"].sum()}  # noqa: E731
    passes = []
    for stream in (None, torch.cuda.Stream(device), None):
        with torch.inference_mode():
            passes.append(run_pass(split, forward, batch=16, nc=len(CLASSES), nms=NmsSettings(), loss_fn=loss_fn,
                                   stream=stream))
    serial, pipelined, again = passes
    assert pipelined.batches == serial.batches == 5  # batches of 16, 16, 16, 16, 8: the last replays a graph of 8 rows
    # The short graph computes what the network computes for those rows, to fp16's rounding: the captured graph may
    # run another GEMM kernel than eager, and an ulp of the head's fp16 logits moves a box coordinate by up to
    # imgsz / 4 ulps (the 1e-3 tolerance this had failed on an H100). Another image's rows, or stale ones, are
    # pixels off.
    with torch.inference_mode(), forward.autocast():
        eager = model(last.img.half() / 255).float()
        graphed = forward(last.img)[: last.n].float()
        worst = (graphed - eager).abs().flatten().argmax()
        assert torch.allclose(graphed, eager, rtol=1e-2, atol=0.1), (
            f"worst at {np.unravel_index(int(worst), eager.shape)}: graph {graphed.flatten()[worst]:.6g}, eager "
            f"{eager.flatten()[worst]:.6g}")
    assert len(serial.stats["conf"]) > 500 and serial.stats["tp"].any()  # detections, some of them true
    for r in (pipelined, again):
        assert all(np.array_equal(r.stats[k], serial.stats[k]) for k in serial.stats)
        assert all(torch.equal(r.loss[k], serial.loss[k]) for k in serial.loss)


def test_the_step_profile_reads_the_loops_steps_on_the_gpus_timeline(tmp_path):
    """bench.profile on CUDA: the profiled steps' timeline, one stream busy, the trace itself not kept."""
    from tests.test_step_profile import profile_a_loop

    x = torch.randn(2048, 2048, device="cuda")
    profile_a_loop(tmp_path, torch.device("cuda"), lambda: x.copy_(x @ x / 2048))
    summary = json.loads((tmp_path / "profile-steps.json").read_text())
    assert summary["steps"] == 3 and summary["window_ms"] > 0
    assert summary["step_stream_busy_ms"] > 0.9 * (summary["window_ms"] - summary["idle_ms"])  # one stream only
    assert summary["host_threads_top"][0]  # the training thread's operators
    assert "no stream busy" in (tmp_path / "profile-steps.txt").read_text()
    assert not list(tmp_path.glob("*.trace.json"))


FORK_AFTER_THE_WARM_TORCHRUNS_IMPORTS = r"""
import json, os
import torch.distributed.run
from launcher.launch.startup import rank_fork
from launcher.machine.libraries import cuda_driver_started, mapped
rank_fork.preload()
with rank_fork.cuda_asked_by_nvml():  # as the warm torchrun builds torchrun's config, which asks for CUDA
    torch.distributed.launcher.api.LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1)
before = cuda_driver_started(mapped())
pid = os.fork()
if pid == 0:
    import torch
    os._exit(0 if torch.ones(4, device="cuda").sum().item() == 4 else 1)
_, status = os.waitpid(pid, 0)
import torch
torch.ones(1, device="cuda")
print(json.dumps({"started_before": before, "child": status, "started_after": cuda_driver_started(mapped())}))
"""


def test_the_warm_torchruns_imports_leave_the_cuda_driver_unstarted_and_a_fork_of_it_uses_the_gpu():
    """torch's import maps libcuda.so (cuBLASLt loads it) without starting it, and torchrun's config asks for CUDA
    through NVML: the ranks forked from the warm torchrun (launch/startup/rank_fork.py) train on the GPU, and the probe tells
    a started driver from a mapped one."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", FORK_AFTER_THE_WARM_TORCHRUNS_IMPORTS], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1]) == {"started_before": False, "child": 0, "started_after": True}

"""GPU paths: skipped without CUDA (CI); run on the GPU machine, results in docs/benchmarks/ and the issue notes."""

from __future__ import annotations

import json
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from tests.conftest import TINY, ddp_launch, run_dir_of
from tests.test_ddp_equivalence import make_model_and_batch, with_training_loss

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _on_cuda(batch: dict) -> dict:
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def test_dataparallel_loss_on_gathered_predictions_equals_the_single_gpu_loss():
    model, batch = make_model_and_batch()
    model, batch = model.cuda(), _on_cuda(batch)
    with_training_loss(model).train()
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.eval()  # per-replica BatchNorm statistics would differ from the whole batch's
    single, _ = model.loss(batch, model(batch["img"]))
    dp = torch.nn.DataParallel(model)  # every visible GPU: the images are scattered, the predictions gathered
    dp_loss, _ = model.loss(batch, dp(batch["img"]))
    torch.testing.assert_close(dp_loss, single, rtol=1e-4, atol=1e-4)


def test_a_cuda_graph_step_takes_the_same_step_as_the_eager_one():
    from launcher.plan import lr
    from launcher.rank.step.graphed import GraphedDetector
    from launcher.rank.step.train_step import train_step

    updates = []
    for graphed in (False, False, True):  # two eager runs: how far cuDNN's own choices move the weights
        model, batch = make_model_and_batch()
        model, batch = model.cuda(), _on_cuda(batch)
        with_training_loss(model).train()
        before = _flat(model)
        net = GraphedDetector(model, batch["img"].shape[0], batch["img"].shape[-1], None) if graphed else model
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)
        scaler = torch.amp.GradScaler("cuda", enabled=False)
        for _ in range(3):
            train_step(net, batch, loss_scale=lr.loss_scale(64, 4), optimizer=opt, scaler=scaler, grad_clip=10.0)
        updates.append(_flat(model) - before)
    _assert_graph_update_is_eager(updates)


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in model.parameters()])


def _assert_graph_update_is_eager(updates: list[torch.Tensor]) -> None:
    """updates: eager, eager, graphed (every parameter's change over the steps, flattened). The graphed update is
    as far from the eager one as cuDNN's own choices move two eager runs apart, and within 1 % of it."""
    eager_spread = ((updates[1] - updates[0]).norm() / updates[0].norm()).item()
    graph_gap = ((updates[2] - updates[0]).norm() / updates[0].norm()).item()
    print(f"relative update gap: eager vs eager {eager_spread:.2e}, graph vs eager {graph_gap:.2e}")
    assert updates[0].norm() > 0 and graph_gap <= max(10 * eager_spread, 1e-2)


class _TinyNet(torch.nn.Module):
    """A network whose loss is linear in its output: its gradients are exact sums, whatever the split."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 4, 3)

    def forward(self, img):
        return {"out": self.conv(img).mean((2, 3))}

    def loss(self, batch, preds):
        value = (preds["out"] * batch["weight"][:, None]).sum()
        return value[None], {"value": value.detach()}


def test_accumulated_cuda_graph_steps_take_the_eager_accumulated_steps(monkeypatch):
    """train.accumulate=2 with a graphed network: each micro-batch's replay adds into the gradients (a graph's
    static gradient output never becomes a parameter's .grad, which the next replay would overwrite), and the step
    is the whole batch's."""
    from launcher.rank.data.pipeline import TARGETS_PER_IMAGE
    from launcher.rank.step.graphed import GraphedDetector
    from launcher.rank.step.train_step import train_step

    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    g = torch.Generator().manual_seed(0)
    batch = {"img": torch.rand(4, 3, 16, 16, generator=g).cuda(), "weight": torch.tensor([1.0, -2.0, 3.0, 0.5]).cuda(),
             TARGETS_PER_IMAGE: [0, 0, 0, 0]}
    updates = []
    for graphed, accumulate in ((False, 1), (False, 2), (True, 2)):
        net = _TinyNet().cuda().train()
        before = _flat(net)
        model = GraphedDetector(net, 2, 16, None) if graphed else net
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        scaler = torch.amp.GradScaler("cuda", enabled=False)
        for _ in range(2):
            train_step(model, batch, loss_scale=1.0, optimizer=opt, scaler=scaler, grad_clip=0.0, accumulate=accumulate)
        updates.append(_flat(net) - before)
    assert updates[0].norm() > 0
    for update in updates[1:]:
        torch.testing.assert_close(update, updates[0], rtol=1e-5, atol=1e-7)


def test_a_compiled_network_takes_the_same_step_as_the_eager_one():
    """train.compile (Inductor): the same loss and the same update as eager, up to the rounding of its fused
    kernels: the update (all parameters' change in one step) within a few percent of eager's."""
    from launcher.plan import lr
    from launcher.rank.step.train_step import train_step
    from launcher.rank.step.wrap import compiled

    results = []
    for mode in (False, False, True):  # two eager runs: how far cuDNN's own choices move the weights
        torch._dynamo.reset()
        model, batch = make_model_and_batch()
        model, batch = model.cuda(), _on_cuda(batch)
        with_training_loss(model).train()
        before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
        net = compiled(model, mode)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)
        scaler = torch.amp.GradScaler("cuda", enabled=False)
        loss, _ = train_step(net, batch, loss_scale=lr.loss_scale(64, 4), optimizer=opt, scaler=scaler, grad_clip=10.0)
        update = torch.cat([p.detach().flatten() for p in model.parameters()]) - before
        bn = next(m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d))
        results.append((float(loss), update, bn.running_mean.clone()))

    (eager_loss, eager, eager_bn), (_, again, _), (comp_loss, comp, comp_bn) = results
    spread, gap = ((again - eager).norm() / eager.norm()).item(), ((comp - eager).norm() / eager.norm()).item()
    cosine = torch.nn.functional.cosine_similarity(comp, eager, dim=0).item()
    print(f"loss {eager_loss:.6g} vs {comp_loss:.6g}; update: eager vs eager {spread:.2e}, compiled {gap:.2e} "
          f"(cosine {cosine:.6f})")
    assert comp_loss == pytest.approx(eager_loss, rel=1e-3)
    assert gap <= max(10 * spread, 5e-2) and cosine > 0.999
    torch.testing.assert_close(comp_bn, eager_bn, rtol=1e-2, atol=1e-3)  # BatchNorm statistics move inside the graph


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


def test_the_input_kernels_on_cuda_compute_what_their_torch_twins_compute():
    """warp.py's Triton kernels against the PyTorch twins that CPU runs use, on the same CUDA tensors."""
    from tests.test_gpu_input import load_case, render_case

    from launcher.rank.data import warp

    for kw in render_case(torch.device("cuda")):
        ours, twin = kw["out"], kw["out"].clone()
        warp.render(**kw)
        warp._render_torch(**{**kw, "out": twin})
        diff = (ours.float() - twin.float()).abs()
        assert (diff > 1e-3).float().mean() < 1e-4 and diff.max() <= 1.0 + 1e-3, float(diff.max())
    flat, meta, slots = load_case(torch.device("cuda"))
    twin = slots.clone()
    warp.load_into_slots(flat, meta, slots)
    saved, warp.triton_usable = warp.triton_usable, lambda device: False
    try:
        warp.load_into_slots(flat, meta, twin)
    finally:
        warp.triton_usable = saved
    assert (slots.int() - twin.int()).abs().max() <= 1


def test_nvjpeg_decodes_what_the_cpu_decodes_and_names_what_it_cannot(tmp_path):
    """Batched nvJPEG against torchvision's CPU decoder on the same JPEGs; a damaged file in the batch is retried
    alone, reported by name, and trains as a grey image."""
    from tests.test_gpu_input import encoded_batch_of, write_images

    from launcher.rank.data.encoded import decode_on_cpu
    from launcher.rank.data.gpu_input import Decoder

    files = write_images(tmp_path, ["jpg", "jpg", "png", "corrupt", "jpg"])
    batch = encoded_batch_of(files, decode_all=False)
    logged = []
    images, failed = Decoder(torch.device("cuda"), files, logged.append)(batch)
    assert failed == [False, False, False, True, False]
    assert len(logged) == 1 and files[3] in logged[0]
    for i in (0, 1, 4):
        cpu, _ = decode_on_cpu(open(files[i], "rb").read())
        assert images[i].is_cuda and images[i].shape == cpu.shape
        assert (images[i].cpu().float() - cpu.float()).abs().mean() < 2.0


def test_the_decode_without_torchvisions_import_is_torchvisions_decode(tmp_path):
    """rank/data/torchvision_ops.py calls the operator torchvision.io.decode_jpeg calls for a batch on CUDA: the same
    images, bit for bit, and the warm-up's JPEG is torchvision's encode_jpeg."""
    from torchvision.io import ImageReadMode, decode_jpeg, encode_jpeg

    from launcher.rank.data import torchvision_ops
    from tests.test_gpu_input import write_images

    files = write_images(tmp_path, ["jpg", "grey", "jpg"])
    data = [torch.frombuffer(bytearray(open(f, "rb").read()), dtype=torch.uint8) for f in files]
    ours = torchvision_ops.decode_jpegs_cuda(data, torch.device("cuda", 0))
    theirs = decode_jpeg(data, mode=ImageReadMode.RGB, device="cuda")
    assert all(a.is_cuda and torch.equal(a, b) for a, b in zip(ours, theirs))
    grey = torch.full((3, 48, 64), 114, dtype=torch.uint8)
    assert torch.equal(torchvision_ops.encode_jpeg(grey), encode_jpeg(grey))


def test_nvjpeg_warmed_on_a_thread_beside_the_set_up_leaves_the_graph_capture_after_it_valid():
    """rank/startup/prewarm.py: the warm-up's decode on its own thread ends without error, and a CUDA graph captured after
    the join replays what the eager computation gives."""
    from launcher.rank.startup.prewarm import Prewarm

    logged = []
    prewarm = Prewarm(torch.device("cuda", 0), decode_batch=8, log=logged.append).start()
    x = torch.randn(64, 64, device="cuda")  # the set-up's own CUDA work, beside it
    prewarm.join()
    assert prewarm.error is None and not logged and prewarm.seconds > 0
    graph, static = torch.cuda.CUDAGraph(), torch.zeros_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        (static @ static).relu()  # warm-up before capture, as torch.cuda.graph's users do
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out = (static @ static).relu()
    static.copy_(x)
    graph.replay()
    torch.testing.assert_close(out, (x @ x).relu())


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


def test_fp16_amp_with_the_fused_optimizer_survives_an_overflowing_first_step():
    """GradScaler's first scale (65536) overflows fp16 on the first step; the fused kernel skips that step on the
    device. The momentum buffers it would have initialised are zeros (rank/step/optimizer.py), so training stays finite."""
    from launcher.plan import lr
    from launcher.rank.step.optimizer import fused_optimizer
    from launcher.rank.step.train_step import train_step

    model, batch = make_model_and_batch()
    model, batch = model.cuda(), _on_cuda(batch)
    with_training_loss(model)
    model.train()
    plain = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.937, nesterov=True)
    opt = fused_optimizer(plain, "auto", torch.device("cuda"))
    assert opt is not plain and opt.defaults["fused"]
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**24)  # certain to overflow at first
    losses = []
    for _ in range(6):
        loss, _ = train_step(model, batch, loss_scale=lr.loss_scale(64, 4), optimizer=opt, scaler=scaler,
                             grad_clip=10.0, amp_dtype=torch.float16)
        losses.append(loss.item())
    assert scaler.get_scale() < 2.0**24, "no step overflowed: the test did not test the skipped step"
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(torch.isfinite(torch.tensor(losses))), losses


def test_one_gpu_trains_with_a_compiled_network(tmp_path, cache_dir):
    r = ddp_launch([*TINY, "train.epochs=2", "train.compile=reduce-overhead", "mode=ddp", "gpus=1"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((run_dir_of(r) / "summary.json").read_text())
    assert summary["epochs_completed"] == 2
    assert all(v == v and abs(v) < 1e4 for v in summary["ranks"][0]["loss"].values()), summary["ranks"][0]["loss"]


def test_the_training_step_never_makes_the_host_wait_for_the_gpu():
    """Forward, the sync-free loss, backward, unscale, clip, the fused step and the EMA: with the batch's target count
    known to the host, CUDA's sync debug mode finds no synchronisation (rank/ultralytics/loss.py, rank/step/optimizer.py)."""
    from ultralytics.utils.torch_utils import ModelEMA

    from launcher.plan import lr
    from launcher.rank.data.pipeline import MAX_TARGETS, max_targets_per_image
    from launcher.rank.step.optimizer import fused_optimizer
    from launcher.rank.step.train_step import train_step

    model, batch = make_model_and_batch()
    max_targets = max_targets_per_image(batch["batch_idx"], len(batch["img"]))
    model, batch = model.cuda(), {**_on_cuda(batch), MAX_TARGETS: max_targets}
    with_training_loss(model)
    model.train()
    opt = fused_optimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True), "auto", batch["img"].device)
    scaler, ema = torch.amp.GradScaler("cuda"), ModelEMA(model)

    def step():
        train_step(model, batch, loss_scale=lr.loss_scale(64, 4), optimizer=opt, scaler=scaler, grad_clip=10.0,
                   amp_dtype=torch.float16)
        ema.update(model)

    step()  # first-use work (cuDNN plans, the anchor cache, lazy state) may sync once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_a_step_in_flight_keeps_the_gpu_busy_across_step_boundaries_and_is_timed_by_the_gpu():
    """A step that keeps the GPU busy 20 ms after 5 ms of host work: synchronising at every step's end adds the
    host's 5 ms to each step (the GPU idles meanwhile); with one step in flight the host's work hides behind the
    GPU's, and the events time the GPU's 20 ms, not the host's queueing."""
    import time

    from launcher.rank.metrics.meter import StepMeter

    def sleep_ms(cycles: int) -> float:  # GPU time of one spinning kernel
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    for _ in range(5):
        sleep_ms(10_000_000)  # clocks up from idle: the kernel spins a number of cycles, not of milliseconds
    cycles = int(1_000_000 * 20.0 / sleep_ms(1_000_000))
    gpu_ms = sleep_ms(cycles)  # about 20 ms

    def step_ms(in_flight: int) -> float:
        meter = StepMeter(torch.device("cuda", torch.cuda.current_device()), skip_steps=3, in_flight=in_flight)
        for _ in range(23):
            meter.begin_step()
            time.sleep(0.005)  # the host's own share of a step: loading, launching
            torch.cuda._sleep(cycles)
            meter.end_step(64, 0.0)
        return meter.summary().step_ms

    synced, in_flight = step_ms(0), step_ms(1)
    assert in_flight == pytest.approx(gpu_ms, rel=0.1)
    assert synced - in_flight == pytest.approx(5.0, abs=2.0)


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
    data = ["data.synthetic.train_images=1024", "data.synthetic.val_images=32", "data.synthetic.width=320",
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
    test_fast_validation's) and split: the same mAP up to fp16 rounding; each engine's images/s printed."""
    import time
    from types import SimpleNamespace

    from ultralytics.cfg import get_cfg

    from launcher.inputs.shapes import CLASSES, ShapesSpec, ensure_dataset
    from launcher.rank.group.dist import Comm
    from launcher.rank.ultralytics import datasets
    from launcher.rank.ultralytics.fast_validation import FastValidator
    from launcher.rank.ultralytics.validation import Validator
    from tests.test_fast_validation import a_model_that_finds_objects

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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_triton_kernels_on_cuda_compute_what_their_pytorch_forms_compute(dtype):
    """rank/kernels/kernels.py's Triton forms against PyTorch: the bias and SiLU in fp32, rounded once (channels_last
    and contiguous tensors, channel counts that fill no block); the upsampling and its backward bit for bit, the
    backward from gradients in either layout, through autograd as the training graphs run it."""
    import torch.nn.functional as F

    from launcher.rank.kernels import kernels

    for shape in [(2, 3, 5, 7), (4, 80, 13, 17), (2, 144, 9, 11), (1, 512, 20, 20)]:
        for layout in (torch.channels_last, torch.contiguous_format):
            y = torch.randn(shape, device="cuda").to(dtype).contiguous(memory_format=layout)
            bias = torch.randn(shape[1], device="cuda").to(dtype)
            for silu in (True, False):
                want = y.float() + bias.float().view(1, -1, 1, 1)
                want = (want * torch.sigmoid(want) if silu else want).to(dtype)
                got = kernels.bias_act_(y.clone(), bias, silu)
                torch.testing.assert_close(got, want)
                assert got.is_contiguous(memory_format=layout)
        x = torch.randn(shape, device="cuda").to(dtype).contiguous(memory_format=torch.channels_last)
        up = kernels.upsample_nearest2x(x)
        assert up.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(up, F.interpolate(x, scale_factor=2, mode="nearest"))
        n, c, h, w = shape
        for layout in (torch.channels_last, torch.contiguous_format):
            grad = torch.randn((n, c, 2 * h, 2 * w), device="cuda").to(dtype).contiguous(memory_format=layout)
            want = torch.ops.aten.upsample_nearest2d_backward(grad, [2 * h, 2 * w], list(shape), 2.0, 2.0)
            assert torch.equal(kernels.upsample_nearest2x_backward(grad), want)
            leaf = x.detach().requires_grad_()
            kernels.nearest2x(leaf).backward(grad)
            assert torch.equal(leaf.grad, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_channel_concatenation_on_triton_is_torch_cat_and_its_backward_hands_out_packed_slices(dtype):
    """kernels.channel_cat / channel_split (the training graphs' C2f, SPPF and Concat): torch.cat's values bit for
    bit, from packed channels_last tensors and from channel slices of one (C2f's halves), in the Triton copies
    (profiled); the gradients PyTorch's slices, packed channels_last; widths that are no multiple of 16 and NCHW
    tensors go to torch.cat, with the same values."""
    from torch.profiler import ProfilerActivity, profile

    from launcher.rank.kernels import kernels

    def cl(*shape):
        return torch.randn(shape, device="cuda").to(dtype).contiguous(memory_format=torch.channels_last)

    for n, h, w, widths in [(2, 40, 40, [32, 32, 32]), (3, 7, 5, [64, 16]), (1, 1, 1, [256, 128, 16]),
                            (2, 9, 11, [24, 40]), (64, 20, 20, [256, 256, 256, 256])]:
        whole = cl(n, 2 * widths[0], h, w)
        head, tail = kernels.channel_split(whole, widths[0])  # C2f's halves: a view, and a packed copy
        assert torch.equal(head, whole[:, :widths[0]]) and torch.equal(tail, whole[:, widths[0]:])
        parts = [head, tail, *(cl(n, c, h, w) for c in widths[1:])]
        leaves = [p.detach().requires_grad_() for p in parts]
        handed = [None] * len(leaves)  # the gradients as the backward hands them out (before any accumulation)
        for i, leaf in enumerate(leaves):
            leaf.register_hook(lambda g, i=i: handed.__setitem__(i, g))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            out = kernels.channel_cat(leaves)
            torch.cuda.synchronize()
        assert torch.equal(out, torch.cat(parts, 1)) and out.is_contiguous(memory_format=torch.channels_last)
        fits = all(c % 16 == 0 for c in widths)
        assert fits == ("_copy_rows_kernel" in {e.key for e in prof.key_averages()}), (widths, fits)
        grad = cl(*out.shape)
        out.backward(grad)
        at = 0
        for leaf, given in zip(leaves, handed):
            c = leaf.shape[1]
            assert torch.equal(leaf.grad, grad[:, at:at + c]) and torch.equal(given, leaf.grad)
            assert given.is_contiguous(memory_format=torch.channels_last) or not fits
            at += c
        source = whole.detach().requires_grad_()
        a, b = kernels.channel_split(source, widths[0])
        (a.float().sum() * 2 + (b.float() * 3).sum()).backward()
        want = torch.cat([torch.full_like(a, 2), torch.full_like(b, 3)], 1)
        assert torch.equal(source.grad, want)
    nchw = [torch.randn(2, 32, 8, 8, device="cuda", dtype=dtype) for _ in range(2)]
    assert torch.equal(kernels.cat_channels(nchw), torch.cat(nchw, 1))


WARMED_UP_LAUNCHES = """
import pathlib, sys
import torch
from launcher.rank.kernels import kernels
cache, warm = pathlib.Path(sys.argv[1]), sys.argv[2] == "warm"
names = {"validation": kernels.VALIDATION, "training": kernels.TRAINING, "scans": kernels.SCANS,
         "bn_act": ("bn_act",)}[sys.argv[3]]
if warm:
    kernels.warm_up(torch.device("cuda", 0), torch.float16, names)
before = len(list(cache.rglob("*.cubin")))
y = torch.randn(4, 80, 13, 17, device="cuda", dtype=torch.half).contiguous(memory_format=torch.channels_last)
if names == kernels.SCANS:
    from launcher.rank.kernels import scans
    from launcher.rank.validate import matching, nms
    boxes = torch.rand(3, 500, 4, device="cuda").cumsum(-1)
    scans.greedy_nms(boxes, torch.ones(3, 500, dtype=torch.bool, device="cuda"), 0.7)
    for targets in (5, 17):  # up to 16 and up to 32 targets an image
        scans.claims(torch.rand(3, targets, 300, device="cuda"), matching.IOU_THRESHOLDS.cuda())
    # and as a validation calls them: NMS of a head's fp16 output, then the matching of its detections to targets
    pred = torch.rand(2, 7, 4000, device="cuda")
    pred[:, :4] = pred[:, :4] * torch.tensor([600.0, 440.0, 80.0, 60.0], device="cuda")[:, None] + 20
    det = nms.batched_nms(pred.half(), 0.001, 0.7, max_det=300, nc=3)
    truth = torch.tensor([[[100.0, 100, 200, 180], [300, 50, 420, 200]]], device="cuda").repeat(2, 1, 1)
    matching.true_positives(det.boxes, det.cls, det.valid(), truth, torch.zeros(2, 2, device="cuda"),
                            torch.ones(2, 2, dtype=torch.bool, device="cuda"))
elif names == ("bn_act",):
    from launcher.rank.kernels.batchnorm_silu import bn_silu
    w, b = torch.ones(80, device="cuda", requires_grad=True), torch.zeros(80, device="cuda", requires_grad=True)
    for act, stats in ((True, True), (False, False)):  # with running statistics to update and without
        running = (torch.zeros(80, device="cuda"), torch.ones(80, device="cuda")) if stats else (None, None)
        bn_silu(y.detach().requires_grad_(), w, b, *running, 0.03, 1e-3, True, act).float().sum().backward()
elif names == kernels.VALIDATION:
    for silu in (True, False):
        kernels.bias_act_(y, torch.randn(80, device="cuda", dtype=torch.half), silu)
    kernels.upsample_nearest2x(y)
else:
    leaf = y.detach().requires_grad_()
    kernels.nearest2x(leaf).sum().backward()
    wide = torch.randn(4, 64, 13, 17, device="cuda", dtype=torch.half).contiguous(memory_format=torch.channels_last)
    kernels.channel_cat(kernels.channel_split(wide.requires_grad_(), 32)).sum().backward()
torch.cuda.synchronize()
print(before, len(list(cache.rglob("*.cubin"))))
"""


@pytest.mark.parametrize("names,kernel_count", [("validation", 3), ("training", 3), ("scans", 3), ("bn_act", 10)])
def test_the_kernels_warmed_up_on_a_thread_are_the_ones_launched_after(tmp_path, names, kernel_count):
    """kernels.warm_up compiles, without a launch, exactly the specialisations that are then launched (fp16,
    channels_last): the folded validation forward's, the training graphs' upsampling forward and backward and the
    concatenations' copy, the fused BatchNorm and SiLU's, and the validation's NMS and matching scans (called
    directly, and by batched_nms and true_positives as a validation calls them). In a process with an empty Triton cache, the launches after it
    compile nothing more; without it they compile all."""
    import os
    import subprocess
    import sys

    counts = {}
    for mode in ("warm", "cold"):
        cache = tmp_path / mode
        done = subprocess.run([sys.executable, "-c", WARMED_UP_LAUNCHES, str(cache), mode, names], capture_output=True,
                              text=True, env={**os.environ, "TRITON_CACHE_DIR": str(cache)}, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        counts[mode] = tuple(int(n) for n in done.stdout.split()[-2:])
    assert counts == {"warm": (kernel_count, kernel_count), "cold": (0, kernel_count)}, counts


INPUT_LAUNCHES = """
import pathlib, sys
import torch
from launcher.rank.data.encoded import EncodedTrainDataset
from launcher.rank.data.gpu_augment import GpuAugment
from launcher.rank.data.gpu_input import Decoder, GpuInput
from tests.test_gpu_input import images_of, write_images
cache, warm, form = pathlib.Path(sys.argv[1]), sys.argv[2] == "warm", sys.argv[3]
files = write_images(cache.parent, ["jpg"] * 8, size=(96, 72))
ds = EncodedTrainDataset(images_of(files), decode_all=False)
hyp = {"mixup": 0.5} if form == "mixed" else {}
dtype = torch.float16 if form == "fp16" else None  # the AMP step's channels_last input, or Ultralytics' uint8 batch
cuda = torch.device("cuda", 0)  # as the rank's device: an index (torch's stream calls refuse "cuda" alone)
gi = GpuInput(GpuAugment(64, hyp, out_dtype=dtype), Decoder(cuda, files), capacity=16, device=cuda)
if warm:
    gi.warm_up()
before = len(list(cache.rglob("*.cubin")))
for k in range(3):
    gi(ds.collate_fn([ds[(0, i)] for i in range(8)]), torch.Generator(device="cuda").manual_seed(k))
torch.cuda.synchronize()
print(sorted(p.parent.name[:8] + "/" + p.stem for p in cache.rglob("*.cubin")), file=sys.stderr)  # which compiled
print(before, len(list(cache.rglob("*.cubin"))))
"""


@pytest.mark.parametrize("form,kernel_count", [("fp16", 2), ("uint8", 2), ("mixed", 3)])
def test_the_gpu_inputs_kernels_warmed_up_are_the_ones_its_batches_launch(tmp_path, form, kernel_count):
    """GpuInput.warm_up compiles, without a launch, the load and render kernels that its batches then launch: into
    the AMP step's fp16 channels_last input, into Ultralytics' uint8 batch, and with MixUp's second render. In a
    process with an empty Triton cache, the batches after it compile nothing more; without it they compile all."""
    import os
    import subprocess
    import sys

    counts, compiled = {}, {}
    for mode in ("warm", "cold"):
        cache = tmp_path / mode / "triton"
        cache.parent.mkdir()
        done = subprocess.run([sys.executable, "-c", INPUT_LAUNCHES, str(cache), mode, form], capture_output=True,
                              text=True, env={**os.environ, "TRITON_CACHE_DIR": str(cache)}, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        counts[mode] = tuple(int(n) for n in done.stdout.split()[-2:])
        compiled[mode] = done.stderr.strip().splitlines()[-1:]
    assert counts == {"warm": (kernel_count, kernel_count), "cold": (0, kernel_count)}, (counts, compiled)


def test_the_scans_on_cuda_keep_and_match_what_the_cpu_forms_do():
    """Greedy NMS and the matching as Triton programs on CUDA (rank/kernels/scans.py), at a weak model's scale
    (5,000 candidates an image, three tiles of the NMS program, crowded, identical boxes among them; 300 detections
    against 40 targets), against torchvision's NMS and the PyTorch matching on the CPU: the same answers, bit for
    bit."""
    from launcher.rank.kernels import scans
    from launcher.rank.validate import matching, nms

    g = torch.Generator().manual_seed(0)
    xy = torch.rand(6, 5000, 2, generator=g) * 400  # three tiles an image
    boxes = torch.cat([xy, xy + 1 + torch.rand(6, 5000, 2, generator=g) * 80], -1)
    boxes[:, 1::9] = boxes[:, ::9][:, : boxes[:, 1::9].shape[1]]
    alive = torch.rand(6, 5000, generator=g) > 0.05
    kept = scans.greedy_nms(boxes.cuda(), alive.cuda(), 0.7).cpu()
    full = nms._torchvision_nms(boxes, alive, 0.7)
    assert torch.equal(kept, full) and 100 < kept.sum(1).min() and full[:, 2048:].any(1).all()
    first = scans.greedy_nms(boxes.cuda(), alive.cuda(), 0.7, limit=100).cpu()  # the scan stopped at 100 survivors
    assert torch.equal(first, full & (full.cumsum(1) <= 100))
    boxes = boxes[:, :2048]
    truth = boxes[:, :40] + torch.rand(6, 40, 4, generator=g) * 10
    iou = matching.box_iou(truth, boxes[:, :300]) * (torch.rand(6, 40, 300, generator=g) > 0.3)
    claimed = scans.claims(iou.cuda(), matching.IOU_THRESHOLDS.cuda()).cpu()
    assert torch.equal(claimed, matching._claims(iou, matching.IOU_THRESHOLDS)) and claimed.sum() > 100


def test_the_folded_fp16_copy_on_cuda_is_as_close_to_fp32_as_autocast_and_its_graph_follows_a_refresh():
    """The fast validator's forward (rank/ultralytics/folded.py: BatchNorm folded, fp16, the Triton bias/SiLU and
    upsampling) against the EMA's fp32 output: no further from it than the EMA under fp16 autocast (the forward
    before the fold); replayed as a CUDA graph, a refresh after the EMA moved reaches the replay."""
    from launcher.rank.ultralytics.folded import FoldedCopy
    from launcher.rank.validate.forward import InferenceForward
    from tests.test_folded_copy import a_trained_looking_model

    ema = a_trained_looking_model().cuda()
    img = torch.randint(0, 256, (8, 3, 96, 128), dtype=torch.uint8, device="cuda")
    folded = FoldedCopy(ema, torch.float16)
    forward = InferenceForward(folded.model, torch.device("cuda"), batch=8, amp_dtype=None, graphs=True)
    amp = InferenceForward(ema, torch.device("cuda"), batch=8, amp_dtype=torch.float16, graphs=False)

    def outputs():
        with torch.inference_mode():
            want = ema(img.float().contiguous(memory_format=torch.channels_last) / 255)[0]
            return want, forward(img)[0].float(), amp(img)[0].float()

    for moved in (False, True):
        if moved:
            with torch.no_grad():  # up to 2 % on every weight and statistic (more overflows fp16 in 60 layers)
                for t in ema.state_dict().values():
                    if t.is_floating_point():
                        t.mul_(1 + 0.02 * torch.rand_like(t))
            folded.refresh()
        want, got, autocast = outputs()
        assert forward._captured  # replayed
        for part in (slice(0, 4), slice(4, None)):  # boxes (pixels), then class scores
            err, amp_err = (got[:, part] - want[:, part]).abs().max(), (autocast[:, part] - want[:, part]).abs().max()
            assert err <= 2 * amp_err + 1e-3, (moved, part, err, amp_err)
            assert want[:, part].abs().max() > 10 * amp_err  # the premise: outputs well above the rounding


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


def test_a_split_placed_between_steps_copies_on_its_own_stream_and_arrives_whole():
    """Placement on CUDA: the slices are copied on a stream of their own while the current stream is busy (a
    training step's work), each advance returns without waiting for that work, and the split that finish() gives
    is read on the current stream with every image equal to the host's."""
    from tests.test_fast_validation import _loader_batches

    from launcher.rank.validate.store import Placement, PreloadedSplit

    device = torch.device("cuda", 0)
    batches = _loader_batches(40, 8, shape=(256, 320), seed=3)
    want = PreloadedSplit.load(batches, torch.device("cpu"))
    placing = Placement(PreloadedSplit.read(batches), device, slice_bytes=4 * 3 * 256 * 320)
    assert placing.ahead and placing.stream is not None and placing.stream != torch.cuda.current_stream(device)
    busy = torch.randn(4096, 4096, device=device)
    for _ in range(6):
        done = torch.cuda.Event()
        for _ in range(20):  # the "step": tens of milliseconds of work on the current stream
            busy = torch.tanh(busy @ busy / 64)
        done.record()
        placing.advance()
        assert not done.query()  # the copy did not wait for the step
    torch.cuda.synchronize(device)
    assert placing.copied == 6 * 4 * 3 * 256 * 320 and not placing.done
    got = placing.finish()
    assert got.on_device and all(g.img.device == device for g in got.groups.values())
    for x, y in zip(got.batches(16), want.batches(16)):
        assert x.files == y.files and torch.equal(x.img.cpu(), y.img) and torch.equal(x.cls.cpu(), y.cls)


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


def test_the_captured_whole_step_takes_the_eager_steps_and_never_waits_for_the_gpu():
    """train.graph_scope=auto on one GPU (rank/step/captured_step.py): forward, loss and backward replay as a CUDA
    graph per target bucket (16 and 8, captured at set-up; 32 not: eager, named once) and the weights move as the eager
    step moves them, as far as cuDNN's own choices move two eager runs apart; the replayed steps never make the host
    wait (CUDA's sync debug mode)."""
    from ultralytics.utils.torch_utils import ModelEMA

    from launcher.plan import lr
    from launcher.rank.data.pipeline import MAX_TARGETS
    from launcher.rank.step.captured_step import CapturedStep
    from launcher.rank.step.optimizer import fused_optimizer
    from launcher.rank.step.train_step import TrainStep

    updates = []
    for captured in (False, False, True):
        model, batch = make_model_and_batch()
        model, batch = model.cuda(), _on_cuda(batch)
        with_training_loss(model).train()
        before = _flat(model)
        opt = fused_optimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True), "auto",
                              batch["img"].device)
        common = dict(optimizer=opt, scaler=torch.amp.GradScaler("cuda"), ema=ModelEMA(model),
                      loss_scale=lr.loss_scale(64, 4), grad_clip=10.0, amp_dtype=torch.float16)
        step = (CapturedStep(model, **common, batch=len(batch["img"]), imgsz=batch["img"].shape[-1]) if captured
                else TrainStep(model, model, **common))
        batches = [{**batch, MAX_TARGETS: 3}, {**batch, MAX_TARGETS: 3}, {**batch, MAX_TARGETS: 11}]
        if captured:
            lines = []
            step.log = lines.append
            assert step.capture_all(11, lambda n: {**batch, MAX_TARGETS: n}) == [16, 8]
        for b in batches:
            step(b)
        if captured:
            assert sorted(step.graphs) == [8, 16] and all(step.graphs.values()) and not lines
            step({**batch, MAX_TARGETS: 20})
            step({**batch, MAX_TARGETS: 30})
            assert sorted(step.graphs) == [8, 16] and len(lines) == 1 and "32 target rows" in lines[0], lines
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                step(batches[0])
                step(batches[2])
            finally:
                torch.cuda.set_sync_debug_mode(0)
            assert torch.isfinite(step.loss) and all(torch.isfinite(v) for v in step.loss_items.values())
        else:
            step(batches[0])
            step(batches[2])
        updates.append(_flat(model) - before)
    _assert_graph_update_is_eager(updates)


def _channels_last_model_and_batch():
    """The equivalence tests' yolov8n with the run's loss, channels_last, in training mode, and its batch, on CUDA."""
    model, batch = make_model_and_batch()
    return with_training_loss(model.cuda().to(memory_format=torch.channels_last)).train(), _on_cuda(batch)


def _graphs_grads_and_kernels(parts: tuple[str, ...], whole: bool):
    """The gradients of a yolov8n's fp16 graph (the whole step's, or the network's) replayed with `parts` of
    rank/step/triton_modules.py, flat, and the names of the kernels its replay launched."""
    from torch.profiler import ProfilerActivity, profile

    from launcher.rank.data.pipeline import MAX_TARGETS
    from launcher.rank.step.captured_step import CapturedStep, bucket
    from launcher.rank.step.graphed import GraphedDetector

    model, batch = _channels_last_model_and_batch()
    batch["img"] = batch["img"].half().contiguous(memory_format=torch.channels_last)
    if whole:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        step = CapturedStep(model, optimizer=opt, scaler=torch.amp.GradScaler("cuda", enabled=False), ema=None,
                            loss_scale=1.0, grad_clip=0.0, amp_dtype=torch.float16, batch=len(batch["img"]),
                            imgsz=batch["img"].shape[-1], triton_parts=parts)
        step.capture({**batch, MAX_TARGETS: 3})
        graph = step.graphs[bucket(3)]
        replay = lambda: graph.replay(graph.img, graph.targets)  # noqa: E731
        grads = step.grads
    else:
        net = GraphedDetector(model, len(batch["img"]), batch["img"].shape[-1], torch.float16,
                              input_dtype=torch.float16, channels_last=True, triton_parts=parts)
        params = list(model.parameters())

        def replay():
            for p in params:
                p.grad = None
            with torch.autocast("cuda", dtype=torch.float16):
                loss, _ = model.loss(batch, net(batch["img"]))
            loss.sum().backward()
        grads = None
    replay()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages()}
    taken = grads if whole else [p.grad for p in model.parameters() if p.requires_grad]
    assert not any("forward" in m.__dict__ for m in model.modules())  # PyTorch's again
    return torch.cat([g.detach().float().flatten() for g in taken]), names


@contextmanager
def _cudnn_deterministic():
    deterministic, benchmark = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = deterministic, benchmark


def test_the_training_graphs_run_the_triton_modules_and_take_pytorchs_gradients():
    """triton_parts=COPIES (rank/step/triton_modules.py): the whole step's graph and the network's graph replay the
    Triton upsampling (forward and backward) and the concatenations' copies, as the profiler sees the replay, and
    give the gradients of the graphs without them, bit for bit (cuDNN deterministic); the modules run PyTorch's
    and Ultralytics' forward again after the capture."""
    from launcher.rank.step.triton_modules import COPIES

    with _cudnn_deterministic():
        for whole in (True, False):
            want, pytorch_kernels = _graphs_grads_and_kernels((), whole)
            got, triton_kernels = _graphs_grads_and_kernels(COPIES, whole)
            assert torch.isfinite(want).all() and torch.equal(got, want), whole
            assert any("upsample_nearest2d" in k for k in pytorch_kernels), pytorch_kernels
            assert not any("upsample_nearest2d" in k for k in triton_kernels), triton_kernels
            assert {"_upsample2x", "_upsample2x_backward", "_copy_rows_kernel"} <= triton_kernels, triton_kernels


def _exact_grads(fused: bool = False) -> torch.Tensor:
    """The gradient the fp16 graphs approximate: the same yolov8n and batch in fp32, eager, TF32 off, flat (with
    `fused`, its Conv blocks on the fused kernels in fp32)."""
    from launcher.rank.step.triton_modules import triton_modules

    model, batch = _channels_last_model_and_batch()
    img = batch["img"].half().float().contiguous(memory_format=torch.channels_last)  # the graphs' input, exactly
    conv, matmul = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with triton_modules(model, parts=("bn_act",) if fused else ()):
            loss, _ = model.loss(batch, model(img))
            loss.sum().backward()
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = conv, matmul
    return torch.cat([p.grad.detach().float().flatten() for p in model.parameters() if p.requires_grad])


def _distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_the_fused_bn_act_in_fp32_gives_a_networks_exact_gradients():
    """Every Conv block of a yolov8n on the fused kernels in fp32 (eager): the whole network's gradient within 1e-3
    of PyTorch's fp32 one, where a wrong term of the backward in any block moves it by far more."""
    with _cudnn_deterministic():
        exact, fused = _exact_grads(), _exact_grads(fused=True)
    assert _distance(fused, exact) < 1e-3, _distance(fused, exact)


def test_the_training_graphs_with_the_fused_bn_act_are_as_close_to_the_exact_gradients_as_pytorchs():
    """triton_parts=PARTS (train.fused_bn_act): both graphs replay the fused BatchNorm and SiLU kernels, no cuDNN
    BatchNorm and no SiLU kernel of PyTorch's, and a second capture repeats them bit for bit. Their fp16 gradient is
    as close to the fp32 one as the fp16 graphs' without the fusion (within 1.25x). The two fp16 gradients are not
    compared with each other: a freshly initialised network's fp16 gradients scatter by a tenth of their norm from
    the fp32 one however BatchNorm and SiLU round (docs/benchmarks/README.md section 14)."""
    from launcher.rank.step.triton_modules import COPIES, PARTS

    fused = {"stats_partial", "stats_finish", "act_forward", "grad_partial", "grad_finish", "act_backward"}
    with _cudnn_deterministic():
        exact = _exact_grads()
        for whole in (True, False):
            want, _ = _graphs_grads_and_kernels(COPIES, whole)
            got, names = _graphs_grads_and_kernels(PARTS, whole)
            again, _ = _graphs_grads_and_kernels(PARTS, whole)
            assert torch.isfinite(got).all() and torch.equal(got, again), whole
            print(f"whole={whole}: fp16 to fp32 gradient, fused {_distance(got, exact):.4f}, "
                  f"PyTorch's {_distance(want, exact):.4f}, fused to PyTorch's {_distance(got, want):.4f}")
            assert _distance(got, exact) <= 1.25 * _distance(want, exact) + 1e-3, whole
            assert fused <= names, names
            left = [k for k in names if any(w in k.lower() for w in ("silu", "batch_norm", "bn_fw", "bn_bw"))]
            assert not left, left


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_fused_bn_act_kernels_on_cuda_give_batchnorm_and_silus_values(dtype):
    """rank/kernels/batchnorm_silu.py on CUDA against torch.nn.BatchNorm2d and SiLU in fp32 on the same stored input
    (channel counts that fill no block, a yolov8s P2 layer's shape): output, input and parameter gradients, running
    statistics; a second call repeats the first bit for bit (no atomics)."""
    from launcher.rank.kernels.batchnorm_silu import bn_silu

    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for shape in [(2, 5, 3, 4), (4, 80, 13, 17), (2, 144, 9, 11), (64, 32, 160, 160)]:
        for act in (True, False):
            x = (torch.randn(shape, device="cuda") * 2 + 1).to(dtype).contiguous(memory_format=torch.channels_last)
            grad = torch.randn(shape, device="cuda").to(dtype).contiguous(memory_format=torch.channels_last)
            bn = torch.nn.BatchNorm2d(shape[1], momentum=0.03, eps=1e-3).cuda().train()
            runs = []
            for _ in range(2):
                w, b = bn.weight.detach().clone().requires_grad_(), bn.bias.detach().clone().requires_grad_()
                rm, rv = bn.running_mean.clone(), bn.running_var.clone()
                leaf = x.detach().requires_grad_()
                y = bn_silu(leaf, w, b, rm, rv, bn.momentum, bn.eps, True, act)
                y.backward(grad)
                runs.append([y, leaf.grad, w.grad, b.grad, rm, rv])
            leaf = x.detach().float().requires_grad_()
            ref = bn(leaf)
            ref = torch.nn.functional.silu(ref) if act else ref
            ref.backward(grad.float())
            want = [ref.to(dtype), leaf.grad.to(dtype), bn.weight.grad, bn.bias.grad, bn.running_mean, bn.running_var]
            assert runs[0][0].is_contiguous(memory_format=torch.channels_last)
            for got, again, expected in zip(runs[0], runs[1], want):
                assert torch.equal(got, again)
                scale = max(1.0, float(expected.float().abs().max()))
                torch.testing.assert_close(got.float(), expected.float(), rtol=tol["rtol"], atol=tol["atol"] * scale)


def test_a_bucket_captured_mid_epoch_survives_another_thread_pinning_memory():
    """A new target bucket is captured while the input's threads run (the DataLoader's pin-memory thread allocates
    pinned memory, which a "global" capture forbids every thread): each capture succeeds and the pinning thread
    meets no error."""
    import threading

    from launcher.rank.data.pipeline import MAX_TARGETS
    from launcher.rank.step.captured_step import CapturedStep

    model, batch = make_model_and_batch()
    model, batch = with_training_loss(model.cuda()).train(), _on_cuda(batch)
    step = CapturedStep(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
                        scaler=torch.amp.GradScaler("cuda", enabled=False), ema=None, loss_scale=1.0, grad_clip=0.0,
                        amp_dtype=torch.float16, batch=len(batch["img"]), imgsz=batch["img"].shape[-1])
    stop, errors, allocations = threading.Event(), [], [0]

    def pin():  # new pinned allocations all the time: blocks held, then given back to the driver, 256 at a time
        held = []
        while not stop.is_set():
            try:
                held.append(torch.empty(1 << 16, dtype=torch.uint8, pin_memory=True))
                allocations[0] += 1
                if len(held) == 256:
                    held.clear()
                    torch._C._host_emptyCache()
            except Exception as e:  # noqa: BLE001 - what the pin-memory thread would raise
                errors.append(e)
                return

    thread = threading.Thread(target=pin, daemon=True)
    thread.start()
    try:
        for n in (3, 11, 20, 40):  # buckets 8, 16, 32, 64
            step.capture({**batch, MAX_TARGETS: n})
    finally:
        stop.set()
        thread.join()
    assert not errors, errors
    assert sorted(step.graphs) == [8, 16, 32, 64] and allocations[0] > 256


def test_a_checkpoint_of_device_state_reaches_the_host_equal(tmp_path):
    """Checkpointer.snapshot copies the model's, the optimizer's and the EMA's tensors to the host without waiting
    for the GPU at the save (the copies queued on the stream, read in the writer thread): every value equal to its
    tensor's at the save, every tensor on the host; Ultralytics' EMA model in half precision, contiguous."""
    from types import SimpleNamespace

    from ultralytics.utils.torch_utils import ModelEMA

    from launcher.rank.loop.checkpoint_io import RESUME_KEY
    from launcher.rank.components import EmaState
    from launcher.rank.loop.state import Checkpointer
    from launcher.rank.ultralytics.checkpoint import Layout

    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8)).cuda()
    net = net.to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.randn(2, 3, 8, 8, device="cuda")).sum().backward()
    optimizer.step()
    ema = ModelEMA(net)
    layout = Layout(ema, SimpleNamespace())
    keys = lambda: layout.keys(scaler=torch.amp.GradScaler("cuda"), epoch=0, best_fitness=None, fitness=None,  # noqa: E731
                               early_stop={}, metrics={}, results={})
    ckpt = Checkpointer(tmp_path, {"model": net, "ema": EmaState(ema), "optimizer": optimizer}, keys,
                        complete=layout.complete)
    expected = {k: v.clone() for k, v in net.state_dict().items()}
    taken = ckpt._take()
    torch.cuda._sleep(50_000_000)  # the GPU busy for a while after the save (the next steps' kernels)
    with torch.no_grad():
        for v in net.state_dict().values():
            v.add_(1)  # queued after the copies: none of them sees it
    ckpt._host.ready()
    snapshot = layout.complete(taken)
    resume = snapshot[RESUME_KEY]
    for name, value in expected.items():
        assert resume["model"][name].device.type == "cpu" and torch.equal(resume["model"][name], value.cpu())
    for i, state in optimizer.state_dict()["state"].items():
        assert torch.equal(resume["optimizer"]["state"][i]["momentum_buffer"], state["momentum_buffer"].cpu())
    for name, v in snapshot["ema"].state_dict().items():
        assert v.device.type == "cpu" and v.is_contiguous()
        assert torch.equal(v, ema.ema.state_dict()[name].to("cpu", v.dtype)) and (v.dtype == torch.half) == v.is_floating_point()
    assert snapshot["scaler"]["scale"] == 65536.0


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

"""The training step on CUDA: CUDA graphs (accumulated, whole step, a bucket captured mid-epoch), torch.compile,
fp16 AMP, DataParallel's loss, a step that never makes the host wait, and checkpoints of device state. Skipped
without CUDA (CI); run on the GPU machine (`pytest -m gpu`), results in docs/benchmarks/."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import on_cuda
from tests.test_ddp_equivalence import make_model_and_batch, with_training_loss

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_dataparallel_loss_on_gathered_predictions_equals_the_single_gpu_loss():
    model, batch = make_model_and_batch()
    model, batch = model.cuda(), on_cuda(batch)
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
        model, batch = model.cuda(), on_cuda(batch)
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
        model, batch = model.cuda(), on_cuda(batch)
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


def test_fp16_amp_with_the_fused_optimizer_survives_an_overflowing_first_step():
    """GradScaler's first scale (65536) overflows fp16 on the first step; the fused kernel skips that step on the
    device. The momentum buffers it would have initialised are zeros (rank/step/optimizer.py), so training stays finite."""
    from launcher.plan import lr
    from launcher.rank.step.optimizer import fused_optimizer
    from launcher.rank.step.train_step import train_step

    model, batch = make_model_and_batch()
    model, batch = model.cuda(), on_cuda(batch)
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
    model, batch = model.cuda(), {**on_cuda(batch), MAX_TARGETS: max_targets}
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
        model, batch = model.cuda(), on_cuda(batch)
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
        step({**batch, MAX_TARGETS: 30})  # past the captured buckets: eager on both sides
        if captured:
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


def test_a_bucket_captured_mid_epoch_survives_another_thread_pinning_memory():
    """A new target bucket is captured while the input's threads run (the DataLoader's pin-memory thread allocates
    pinned memory, which a "global" capture forbids every thread): each capture succeeds and the pinning thread
    meets no error."""
    import threading

    from launcher.rank.data.pipeline import MAX_TARGETS
    from launcher.rank.step.captured_step import CapturedStep

    model, batch = make_model_and_batch()
    model, batch = with_training_loss(model.cuda()).train(), on_cuda(batch)
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

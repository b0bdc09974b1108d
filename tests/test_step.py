"""The step's optimizer: the fused kernel changes how it runs, never what it computes; the parameter groups and the
schedule are Ultralytics'; a checkpoint's state is read back by component. (torch.compile: tests/test_cuda_step.py.)"""

from __future__ import annotations

import pytest
import torch

from launcher.rank.step.optimizer import fused_optimizer
from tests.test_ddp_equivalence import make_model_and_batch


def _ultralytics_sgd(model: torch.nn.Module) -> torch.optim.SGD:
    """Ultralytics' three parameter groups: BN weights (no decay), other weights (decay), biases (no decay)."""
    bn, weights, biases = [], [], []
    for name, p in model.named_parameters():
        (biases if name.endswith("bias") else bn if p.ndim == 1 else weights).append(p)
    opt = torch.optim.SGD(bn, lr=0.01, momentum=0.937, nesterov=True)
    opt.add_param_group({"params": weights, "weight_decay": 5e-4})
    opt.add_param_group({"params": biases, "weight_decay": 0.0})
    return opt


def _steps(opt, model, losses) -> dict:
    """One GradScaler step per loss factor; inf makes that step overflow (GradScaler skips it)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    x = torch.linspace(-1, 1, 32).view(4, 8)
    for factor in losses:
        loss = (model(x) ** 2).mean() * factor
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.SiLU(), torch.nn.Linear(16, 2))


def test_the_fused_optimizer_keeps_groups_and_hyperparameters():
    model = _mlp()
    plain = _ultralytics_sgd(model)
    fused = fused_optimizer(plain, True, torch.device("cpu"))
    assert type(fused) is torch.optim.SGD and fused.defaults["fused"] is True
    assert len(fused.param_groups) == len(plain.param_groups) == 3
    for a, b in zip(fused.param_groups, plain.param_groups):
        assert a["params"] == b["params"]
        assert {k: a[k] for k in ("lr", "momentum", "nesterov", "weight_decay")} == {
            k: b[k] for k in ("lr", "momentum", "nesterov", "weight_decay")
        }
        assert a["fused"] is True and not a["foreach"]
    assert fused_optimizer(plain, "auto", torch.device("cpu")) is plain, "auto is fused on CUDA only"
    assert fused_optimizer(plain, False, torch.device("cuda")) is plain


@pytest.mark.parametrize("first_step_overflows", [True, False])
def test_fused_sgd_takes_the_same_steps_as_foreach_sgd_also_after_a_skipped_first_step(first_step_overflows):
    """The H200 bug: fp16 AMP's first step overflows; fused SGD skipped it with uninitialised momentum buffers."""
    factors = [float("inf") if first_step_overflows else 1.0, 1.0, 0.5, 2.0, 1.0]
    model = _mlp()
    reference = _steps(_ultralytics_sgd(model), model, factors)
    model = _mlp()
    fused = fused_optimizer(_ultralytics_sgd(model), True, torch.device("cpu"))
    result = _steps(fused, model, factors)
    for k, v in reference.items():
        assert torch.isfinite(result[k]).all(), k
        torch.testing.assert_close(result[k], v, rtol=1e-5, atol=1e-6, msg=k)
    assert any(not torch.equal(v, _mlp().state_dict()[k]) for k, v in result.items()), "nothing was trained"


def test_fused_sgd_state_round_trips_through_a_checkpoint():
    model = _mlp()
    opt = fused_optimizer(_ultralytics_sgd(model), True, torch.device("cpu"))
    _steps(opt, model, [1.0, 1.0])
    again = fused_optimizer(_ultralytics_sgd(model), True, torch.device("cpu"))
    again.load_state_dict(opt.state_dict())  # a resumed run continues with the saved momentum
    for p in model.parameters():
        torch.testing.assert_close(again.state[p]["momentum_buffer"], opt.state[p]["momentum_buffer"])


# --- the schedule (rank/step/optimizer.py) ----------------------------------------------------------------------
@pytest.mark.parametrize("cos_lr", [False, True], ids=["linear", "cosine"])
def test_the_schedule_is_ultralytics_per_epoch_rule_with_its_warmup(cos_lr):
    import math

    from launcher.rank.step.optimizer import Schedule

    model = _mlp()
    opt = _ultralytics_sgd(model)
    for g, kind in zip(opt.param_groups, ("bn", "weight", "bias")):
        g["param_group"] = kind
    epochs, lrf = 4, 0.01
    schedule = Schedule(opt, epochs=epochs, lrf=lrf, cos_lr=cos_lr, warmup_steps=10, warmup_bias_lr=0.1,
                        warmup_momentum=0.8, momentum=0.937)
    schedule.start_at(0)
    seen = []
    for epoch in range(epochs):
        schedule.begin_epoch()
        seen.append(opt.param_groups[0]["lr"])
    expected = [((1 - math.cos(e * math.pi / epochs)) / 2) * (lrf - 1) + 1 if cos_lr else (1 - e / epochs) * (1 - lrf) + lrf
                for e in range(epochs)]
    assert seen == pytest.approx([0.01 * f for f in expected])
    schedule.start_at(0)
    schedule.begin_epoch()
    schedule.warm_up(0, 0)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.0, 0.0, 0.1])  # bias lr falls from 0.1
    assert opt.param_groups[0]["momentum"] == pytest.approx(0.8)
    schedule.warm_up(10, 0)  # the last warmup step lands on the schedule
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.01] * 3)
    assert opt.param_groups[0]["momentum"] == pytest.approx(0.937)


def test_a_restored_optimizer_follows_the_new_plans_lr0():
    """A resume at another world size has another lr0: the saved optimizer state must not bring the old one back."""
    from launcher.rank.step.optimizer import Schedule

    model = _mlp()
    saved = _ultralytics_sgd(model)
    Schedule(saved, epochs=4, lrf=0.01, cos_lr=False, warmup_steps=0, warmup_bias_lr=0.1, warmup_momentum=0.8,
             momentum=0.937)
    _steps(saved, model, [1.0])
    state = saved.state_dict()
    moved = _ultralytics_sgd(model)
    for g in moved.param_groups:
        g["lr"] = 0.02  # this plan's lr0 (twice the world size)
    schedule = Schedule(moved, epochs=4, lrf=0.01, cos_lr=False, warmup_steps=0, warmup_bias_lr=0.1,
                        warmup_momentum=0.8, momentum=0.937)
    moved.load_state_dict(state)  # brings initial_lr 0.01 back
    schedule.start_at(2)
    schedule.begin_epoch()
    assert moved.param_groups[0]["lr"] == pytest.approx(0.02 * ((1 - 2 / 4) * 0.99 + 0.01))


def test_a_checkpoint_of_the_earlier_layout_is_read_by_component():
    """Checkpoints written before the components had their own parts hold one flat resume dict."""
    from launcher.rank.loop.state import TrainState, upgrade

    flat = {"position": (2, 5), "model": {"w": 1}, "ema": {"w": 2}, "ema_updates": 7, "optimizer": {}, "scaler": {},
            "fitness": 0.4, "fitness_epoch": 2, "validated_epochs": [1, 2], "metrics": {"m": 1.0},
            "tloss": {"box_loss": 1.5}, "tloss_steps": 5, "world_size": 2, "global_batch": 16}
    state = upgrade({"ddp_launch_state": flat, "best_fitness": 0.45, "stopper": {"best_fitness": 0.45, "best_epoch": 2}})
    assert state["ema"] == {"weights": {"w": 2}, "updates": 7}
    assert state["early_stop"] == {"best_fitness": 0.45, "best_epoch": 2}
    train = TrainState()
    train.load_state_dict(state["train"])
    assert (train.epoch, train.step, train.best_fitness, train.tloss_steps) == (2, 5, 0.45, 5)
    again = TrainState()
    again.load_state_dict(train.state_dict())
    assert again.state_dict() == train.state_dict()


def test_a_batch_splits_into_micro_batches_by_its_per_image_target_counts():
    from launcher.rank.data.pipeline import MAX_TARGETS, TARGETS_PER_IMAGE
    from launcher.rank.step.train_step import micro_batches

    counts = [3, 0, 2, 1]
    batch_idx = torch.tensor([i for i, n in enumerate(counts) for _ in range(n)], dtype=torch.float32)
    batch = {"img": torch.arange(4.0).view(4, 1, 1, 1), "batch_idx": batch_idx, "cls": batch_idx[:, None] * 10,
             "bboxes": torch.rand(6, 4), "im_file": ("a", "b", "c", "d"), "ori_shape": ((1, 1),) * 4,
             "resized_shape": ((8, 8),) * 4, MAX_TARGETS: 3, TARGETS_PER_IMAGE: counts}
    first, second = micro_batches(batch, 2)
    assert first["img"].flatten().tolist() == [0, 1] and second["img"].flatten().tolist() == [2, 3]
    assert first["batch_idx"].tolist() == [0, 0, 0] and second["batch_idx"].tolist() == [0, 0, 1]  # renumbered
    assert second["cls"][:, 0].tolist() == [20, 20, 30] and torch.equal(second["bboxes"], batch["bboxes"][3:])
    assert first["im_file"] == ("a", "b") and second["im_file"] == ("c", "d")
    assert (first[MAX_TARGETS], second[MAX_TARGETS]) == (3, 2)  # the sync-free loss pads each to its own
    with pytest.raises(ValueError, match="does not split into 3"):
        micro_batches(batch, 3)


def _captured_or_plain_steps(captured: bool, batches: list[dict], amp_scaler: bool = False) -> tuple[dict, list]:
    """Ultralytics' SGD, GradScaler, clip and EMA over `batches` with the step the run takes: CapturedStep (eager on
    the CPU: the body its CUDA graph replays) or TrainStep."""
    from ultralytics.utils.torch_utils import ModelEMA

    from launcher.rank.step.captured_step import CapturedStep
    from launcher.rank.step.train_step import TrainStep
    from tests.test_ddp_equivalence import with_training_loss

    model, _ = make_model_and_batch()
    with_training_loss(model).train()
    opt = _ultralytics_sgd(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, enabled=amp_scaler)
    ema = ModelEMA(model)
    common = dict(optimizer=opt, scaler=scaler, ema=ema, loss_scale=16.0, grad_clip=10.0, amp_dtype=None)
    step = (CapturedStep(model, **common, batch=len(batches[0]["img"]), imgsz=batches[0]["img"].shape[-1]) if captured
            else TrainStep(model, model, **common))
    losses = []
    for b in batches:
        step(b)
        losses.append((step.loss.clone(), {k: v.clone() for k, v in step.loss_items.items()}))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state.update({f"ema.{k}": v.detach().clone() for k, v in ema.ema.state_dict().items()})
    return state, losses


@pytest.mark.parametrize("amp_scaler", [False, True], ids=["fp32", "grad-scaler"])
def test_the_captured_steps_body_takes_the_steps_the_eager_step_takes(amp_scaler):
    """CapturedStep pads the targets to a bucket and writes the gradients into tensors of its own, which no step
    zeroes: three steps (the buckets 8 and 16 among them) end on the weights, BatchNorm statistics, EMA and losses
    of TrainStep's. (Its CUDA graphs replay this body: tests/test_cuda_step.py.)"""
    from launcher.rank.data.pipeline import MAX_TARGETS
    from launcher.rank.step.captured_step import bucket

    _, base = make_model_and_batch()
    crowded = {**base, MAX_TARGETS: 11}  # the same boxes, read as if one image held 11: bucket 16
    batches = [{**base, MAX_TARGETS: 3}, crowded, {**base, MAX_TARGETS: 3}]
    assert [bucket(b[MAX_TARGETS]) for b in batches] == [8, 16, 8]
    plain, plain_losses = _captured_or_plain_steps(False, batches, amp_scaler)
    captured, captured_losses = _captured_or_plain_steps(True, batches, amp_scaler)
    start, _ = make_model_and_batch()
    assert any(not torch.equal(plain[k], v) for k, v in start.state_dict().items()), "nothing was trained"
    for k, v in plain.items():
        torch.testing.assert_close(captured[k], v, rtol=1e-4, atol=1e-6, msg=k)
    for (a, items_a), (b, items_b) in zip(captured_losses, plain_losses):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert items_a.keys() == items_b.keys()
        for k in items_b:
            torch.testing.assert_close(items_a[k], items_b[k], rtol=1e-5, atol=1e-6, msg=k)


def test_the_buckets_captured_cover_the_most_crowded_image_mosaic_can_make():
    """The captured step's buckets come from the data's most crowded image times the images mosaic (4), mixup (2)
    and cutmix (2) put into one: a set of at most 120 boxes per image, mosaic on, needs 8 ... 512, largest first,
    no more than the dense assigner takes; an unknown count takes every bucket up to that bound."""
    from types import SimpleNamespace

    from launcher.rank.step.captured_step import buckets, most_targets

    hyp = SimpleNamespace(mosaic=1.0, mixup=0.0, cutmix=0.0)
    assert most_targets(120, hyp) == 480 and most_targets(None, hyp) is None
    assert most_targets(120, SimpleNamespace(mosaic=1.0, mixup=0.1, cutmix=0.5)) == 1920
    assert most_targets(5, SimpleNamespace(mosaic=0.0, mixup=0.0, cutmix=0.0)) == 5
    assert buckets(480, largest=10_000) == [512, 256, 128, 64, 32, 16, 8]
    assert buckets(480, largest=100) == [64, 32, 16, 8]
    assert buckets(3, largest=100) == [8] and buckets(None, largest=40) == [32, 16, 8]


def test_bucket_is_the_next_power_of_two_from_eight():
    from launcher.rank.step.captured_step import bucket

    assert [bucket(n) for n in (0, 1, 8, 9, 16, 17, 100)] == [8, 8, 8, 16, 16, 32, 128]


def test_a_batch_without_the_hosts_target_count_is_counted():
    from launcher.rank.data.pipeline import MAX_TARGETS
    from launcher.rank.step.captured_step import _max_targets

    _, batch = make_model_and_batch()  # 3, 1, 2 and 1 boxes
    assert _max_targets({**batch, MAX_TARGETS: None}) == 3 == _max_targets({**batch, MAX_TARGETS: 3})
    assert _max_targets({"batch_idx": torch.zeros(0)}) == 0


def swapped_modules_against_pytorch(interpreted: bool = False) -> None:
    """rank/step/triton_modules.py: inside triton_modules a yolov8n's nearest 2x upsampling modules run
    kernels.nearest2x and its C2f, SPPF and Concat blocks rank/ultralytics/blocks.py's forwards (and no other module
    is swapped), with Ultralytics' outputs and gradients bit for bit, for the network and for its channels_last
    input; after it the modules are as they were, and the network pickles without ddp-launch. `interpreted` (a
    process under TRITON_INTERPRET=1): the concatenations and the split run as the Triton copies (counted), the
    outputs bit for bit, the gradients to float rounding: the backward hands out packed gradients, on which the
    CPU's SiLU backward takes its vectorised path, which rounds differently (CUDA's does not: tests/test_cuda_kernels.py
    compares the graphs' gradients bit for bit)."""
    import pickle

    from launcher.rank.kernels import kernels
    from launcher.rank.step.triton_modules import COPIES, triton_modules

    model, batch = make_model_and_batch()
    model = model.train().to(memory_format=torch.channels_last)
    bilinear = model.bilinear = torch.nn.Upsample(scale_factor=2, mode="bilinear")  # a module, not nearest: left alone
    blocks = {name: [m for m in model.modules() if type(m).__name__ == name] for name in ("C2f", "SPPF", "Concat")}
    assert [len(b) for b in blocks.values()] == [8, 1, 4]  # yolov8's
    # the Triton copies a step makes: C2f's split (one part forward, two backward) and its 2 + n parts, SPPF's 4 and
    # Concat's 2, forward and backward
    expected = (sum(1 + 2 * (2 + len(m.m)) + 2 for m in blocks["C2f"]) + 2 * 4 * len(blocks["SPPF"])
                + 2 * 2 * len(blocks["Concat"]))
    copies = []
    copy_rows = kernels._copy_rows

    def counted(src, dst):
        copies.append(src.shape)
        copy_rows(src, dst)

    def outputs_and_grads():
        model.zero_grad()
        x = batch["img"][:2].contiguous(memory_format=torch.channels_last).requires_grad_()
        out = model(x)  # the training forward
        leaves = [o for o in (out if isinstance(out, (list, tuple)) else out.values()) if torch.is_tensor(o)]
        sum(o.square().sum() for o in leaves).backward()
        return leaves, [p.grad for p in model.parameters() if p.requires_grad], x.grad

    want, want_grads, want_input = outputs_and_grads()
    kernels._copy_rows = counted
    try:
        with triton_modules(model, parts=COPIES) as swapped:
            assert swapped == 2 + 8 + 1 + 4
            assert "forward" not in bilinear.__dict__
            assert {type(m).__name__ for m in model.modules() if "forward" in m.__dict__} == {
                "Upsample", "C2f", "SPPF", "Concat"}
            got, got_grads, got_input = outputs_and_grads()
    finally:
        kernels._copy_rows = copy_rows
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    if interpreted:  # the CPU's SiLU backward rounds differently on packed gradients (vectorised) than on strided
        for a, b in zip([*got_grads, got_input], [*want_grads, want_input]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))
    else:
        assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads)) and torch.equal(got_input, want_input)
    assert len(copies) == (expected if interpreted else 0), (len(copies), expected)  # the CPU: torch.cat and views
    with triton_modules(model, enabled=False) as swapped:
        assert swapped == 0
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert b"launcher" not in pickle.dumps(model)


def test_the_modules_swapped_in_for_a_capture_compute_pytorchs_values_and_are_undone():
    swapped_modules_against_pytorch()


def test_the_swapped_modules_triton_copies_through_the_interpreter_give_pytorchs_values():
    """The same, with the Triton kernels run by Triton's interpreter on the CPU (what CUDA runs inside the graphs)."""
    import os
    import subprocess
    import sys

    code = "from tests.test_step import swapped_modules_against_pytorch; swapped_modules_against_pytorch(True)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]


def test_only_tensors_stored_pixel_by_pixel_are_copied_as_rows():
    """kernels.pixel_rows: the row stride the concatenations' copy walks; a layout it does not describe goes to
    torch.cat (a wrong stride here would copy the wrong pixels)."""
    from launcher.rank.kernels.kernels import pixel_rows

    cl = torch.zeros(2, 48, 5, 7).contiguous(memory_format=torch.channels_last)
    assert pixel_rows(cl) == 48
    assert pixel_rows(cl[:, 16:32]) == 48  # a channel slice: its pixels are the parent's rows
    assert pixel_rows(cl[1:]) == 48  # whole images
    assert pixel_rows(cl[:, :, 1:]) is None and pixel_rows(cl[:, :, :, 1:]) is None  # cropped: pixels skipped
    assert pixel_rows(torch.cat([cl, cl])[::2]) is None  # every other of four images
    assert pixel_rows(torch.zeros(2, 48, 5, 7)) is None  # NCHW
    assert pixel_rows(torch.zeros(2, 48, 1, 1)) == 48  # NCHW and channels_last are one layout at 1x1
    assert pixel_rows(cl[0:1, 16:32, 2:3, 3:4]) == 16 and pixel_rows(torch.zeros(2, 3, 4)) is None


@pytest.mark.parametrize("asked", [None, True, False])
def test_the_network_is_channels_last_on_the_cpu_too_unless_channels_last_false(asked):
    """Ultralytics' channels_last key: unset or true, the network's 4-d weights are channels_last on the CPU as on
    CUDA (oneDNN's faster layout: docs/benchmarks section 21); channels_last=False keeps them NCHW."""
    from types import SimpleNamespace

    from launcher.rank.build_steps.model_build import on_device

    model, _ = make_model_and_batch()
    net = on_device(model, torch.device("cpu"), SimpleNamespace(channels_last=asked))
    weights = [p for p in net.parameters() if p.ndim == 4 and p.shape[1] > 1 and p.shape[2] > 1]
    layout = torch.contiguous_format if asked is False else torch.channels_last
    assert weights and all(w.is_contiguous(memory_format=layout) for w in weights)

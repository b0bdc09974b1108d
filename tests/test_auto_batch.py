"""train.batch_per_device=auto on the rank side (launcher/rank/step/auto_batch.py): the search over a fake memory
model (a fake step that runs out of memory above a size), the job's agreement, the synthetic batch the real loss
takes, and the training arguments set once the batch is known. The GPU's own run: tests/test_cuda_runs.py (-k auto)."""

from __future__ import annotations

import pytest
import torch

from launcher.rank.step import auto_batch
from launcher.rank.step.auto_batch import GiB, MiB

TOTAL = 100 * GiB
RULE = {"fraction": 0.6, "multiple": 8, "divides": None, "most": None}


class FakeGpu:
    """A step whose peak is fixed + per_image x batch (+ curve x batch^2: the fit underestimates), out of memory
    above `capacity` bytes; the memory interface `measure` reads."""

    def __init__(self, fixed=4 * GiB, per_image=300 * MiB, curve=0.0, capacity=TOTAL, validation=0):
        self.fixed, self.per_image, self.curve, self.capacity = fixed, per_image, curve, capacity
        self.validation = validation  # bytes a validation batch adds beside the step
        self.steps, self.released, self._peak = [], 0, 0

    def need(self, batch: int, validate: bool = False) -> int:
        return int(self.fixed + self.per_image * batch + self.curve * batch**2 + self.validation * validate)

    def run_at(self, batch: int, validate: bool = False) -> None:
        self.steps.append(batch)
        if self.need(batch, validate) > self.capacity:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory at {batch}")
        self._peak = self.need(batch, validate)

    def release(self) -> None:
        self.released += 1
        self._peak = 0

    def peak(self) -> int:
        return self._peak

    def choose(self, rule=RULE, **kw):
        return auto_batch.choose(lambda b: auto_batch.measure(self.run_at, b, self), total=TOTAL, rule=rule, **kw)

    def settle(self, rule=RULE):
        """choose, then settle with a validation batch beside the steps, as the rank does."""
        whole = lambda b: auto_batch.measure(lambda x: self.run_at(x, validate=True), b, self)  # noqa: E731
        return auto_batch.settle(self.choose(rule), whole, rule=rule)


def largest_within(gpu: FakeGpu, limit: float, ok=lambda b: True) -> int:
    return max(b for b in range(8, 4096, 8) if gpu.need(b) <= limit and ok(b))


def test_a_linear_step_gets_the_largest_multiple_of_8_within_the_fraction_and_the_fit_says_why():
    gpu = FakeGpu()
    choice = gpu.choose()
    assert choice.batch == largest_within(gpu, 0.6 * TOTAL) == 184  # (60 - 4) GiB / 300 MiB = 191.1
    assert gpu.steps == [8, 16, 32, 64, 184]  # profiled, then the fit's answer verified; nothing more
    assert choice.fixed == pytest.approx(4 * GiB) and choice.per_image == pytest.approx(300 * MiB)
    record = choice.record(0.6, "cuda:0 H200")
    assert record["memory_per_image_mib"] == pytest.approx(300) and record["fixed_mib"] == pytest.approx(4096)
    assert record["limit_gib"] == pytest.approx(60) and record["total_gib"] == pytest.approx(100)
    assert [c["batch"] for c in record["candidates"]] == [8, 16, 32, 64, 184] and all(c["fits"] for c in record["candidates"])
    assert gpu.released == 2 * len(gpu.steps)  # everything the probe allocated freed before and after each size
    # the run is then held to the fraction plus the headroom for what the probe's step leaves out, at most the GPU
    assert record["held_fraction"] == pytest.approx(0.7) and record["held_gib"] == pytest.approx(70)
    assert FakeGpu().choose(rule={**RULE, "fraction": 0.95}).record(0.95, "cuda:0")["held_fraction"] == 1.0


def test_a_step_that_runs_out_of_memory_above_the_fit_backs_off_by_8():
    gpu = FakeGpu(capacity=int(4 * GiB + 300 * MiB * 170))  # out of memory above 170, below the fit's 184
    choice = gpu.choose()
    assert choice.batch == 168 and gpu.steps == [8, 16, 32, 64, 184, 176, 168]
    assert [c["peak_gib"] for c in choice.record(0.6, "cuda:0")["candidates"]][-3:-1] == [None, None]  # the OOMs


def test_a_step_whose_memory_grows_faster_than_the_fit_stays_within_the_limit():
    gpu = FakeGpu(curve=2 * MiB)
    choice = gpu.choose()
    assert choice.batch == largest_within(gpu, 0.6 * TOTAL)
    assert gpu.need(choice.batch) <= 0.6 * TOTAL < gpu.need(choice.batch + 8)


def test_the_rule_bounds_the_batch_global_batch_divisors_and_the_datas_share():
    gpu = FakeGpu()
    divides = gpu.choose({**RULE, "divides": 160, "most": 160})  # train.global_batch=320 on 2 GPUs
    assert divides.batch == 160 and divides.limited_by == "train.global_batch" and 160 % divides.batch == 0
    assert max(gpu.steps) <= 160 and all(160 % b == 0 for b in gpu.steps)
    small = FakeGpu(per_image=900 * MiB).choose({**RULE, "divides": 96, "most": 96})
    assert small.batch == 48  # 56, 64 fit memory but do not divide 96; 96 does not fit
    odd_gpu = FakeGpu()
    odd = odd_gpu.choose({**RULE, "divides": 120, "most": 120})  # global_batch=120 on 1 GPU: 8, 24, 40, 120
    assert odd.batch == 120 and all(120 % b == 0 for b in odd_gpu.steps)  # measured at its own sizes, not 8 alone
    data = FakeGpu().choose({**RULE, "most": 40})
    assert data.batch == 40 and data.limited_by == "the training set"


def test_when_only_the_smallest_size_fits_it_is_taken_and_when_none_fits_the_error_says_what_to_do():
    one = FakeGpu(fixed=50 * GiB, per_image=1 * GiB)  # 8: 58 GiB fits, 16: 66 does not
    assert one.choose().batch == 8 and one.steps == [8, 16]
    with pytest.raises(auto_batch.NoBatchFits, match=r"a batch of 8 takes more than the GPU has.*set train.batch_per_device"):
        FakeGpu(capacity=10 * GiB, per_image=2 * GiB).choose()
    with pytest.raises(auto_batch.NoBatchFits, match=r"a batch of 8 takes 70.0 GiB, over the limit of 60.0 GiB"):
        FakeGpu(fixed=62 * GiB, per_image=1 * GiB).choose()


def test_the_batch_is_settled_with_a_validation_batch_beside_the_steps_within_what_the_run_is_held_to():
    """The run is held to 70 % (60 % + the headroom): a validation that fits beside the chosen step keeps the batch
    (one more measurement); one that does not backs off by what its excess over the memory per image says, to the
    largest size whose whole loop fits."""
    light = FakeGpu(validation=5 * GiB)
    settled = light.settle()
    assert settled.batch == 184 and list(settled.whole) == [184] and settled.held == int(0.7 * TOTAL)
    heavy = FakeGpu(validation=20 * GiB)
    settled = heavy.settle()
    assert settled.batch == largest_within(heavy, 0.7 * TOTAL - 20 * GiB) == 152  # 184: 77.9 GiB; 152: 68.5 GiB
    assert list(settled.whole) == [184, 152] and settled.limited_by == "memory"
    record = settled.record(0.6, "cuda:0")
    assert [(c["batch"], c["fits"]) for c in record["with_validation"]] == [(184, False), (152, True)]
    assert auto_batch.explain(record).endswith("(with a validation batch beside the steps 184: 77.9 GiB, 152: 68.5 GiB)")
    # out of memory with the validation: the excess is at least what lies above the held bytes; then read again
    gpu = FakeGpu(validation=50 * GiB)
    oom = gpu.settle()
    assert list(oom.whole) == [184, 80, 48] and oom.whole[184] is None
    assert oom.batch == largest_within(gpu, 0.7 * TOTAL - 50 * GiB) == 48


def test_a_validation_that_fits_beside_no_batch_is_refused_with_what_to_do():
    with pytest.raises(auto_batch.NoBatchFits, match=r"with a validation batch beside its steps no batch from 184 down "
                                                     r"fits the 70.0 GiB .* a smaller val.batch"):
        FakeGpu(validation=69 * GiB).settle()


def test_every_rank_takes_the_smallest_batch_of_the_job_with_its_why():
    records = [FakeGpu().choose().record(0.6, "cuda:0"), FakeGpu(fixed=20 * GiB).choose().record(0.6, "cuda:1")]
    job = auto_batch.agree(records)
    assert job["batch_per_device"] == records[1]["batch_per_device"] < records[0]["batch_per_device"]
    assert job["rank"] == 1 and job["ranks"] == [records[0]["batch_per_device"], records[1]["batch_per_device"]]
    line = auto_batch.explain(job)
    assert line.startswith(f"auto batch: {job['batch_per_device']} per device, the largest whose step fits 60 % of "
                           "100.0 GiB = 60.0 GiB on cuda:1 (300 MiB per image + 20.0 GiB fixed")
    assert line.endswith("; the smallest over ranks [184, 136]; the run's allocator held to 70 % = 70.0 GiB")
    assert auto_batch.agree(records[:1])["ranks"] is None


def test_the_synthetic_batch_is_one_the_training_loss_takes():
    from launcher.rank.ultralytics.task_loss import training_criterion
    from tests.test_ddp_equivalence import make_model_and_batch

    model, _ = make_model_and_batch()
    model.criterion, _ = training_criterion(model.train())
    batch = auto_batch.synthetic_batch(2, 64, torch.device("cpu"), dtype=torch.float32, channels_last=True, nc=3)
    assert batch["img"].shape == (2, 3, 64, 64) and batch["img"].is_contiguous(memory_format=torch.channels_last)
    assert len(batch["batch_idx"]) == 2 * auto_batch.PROBE_TARGETS == len(batch["bboxes"])
    assert 0 < batch["bboxes"].min() and batch["bboxes"].max() < 1 and batch["cls"].max() == 2
    loss, _ = model.loss(batch, model(batch["img"]))
    assert torch.isfinite(loss).all() and loss.sum() > 0


def test_the_training_arguments_follow_the_measured_batch(tmp_path):
    """Before the batch is measured the ranks' Ultralytics arguments hold its defaults; set_batch gives them the
    measured plan's batch, lr0 and warmup, on the object the network and its loss already hold."""
    from launcher.machine.hardware import Gpu, Hardware
    from launcher.plan.plan import make_plan
    from launcher.plan.plan import with_batch
    from launcher.plan.settings import Settings
    from launcher.rank.ultralytics import build
    from tests.conftest import compose_config
    from tests.test_plan import shapes

    cfg = compose_config(["gpus=1", "train.batch_per_device=auto", "data.path=/x/data.yaml", "optim.lr_scaling=linear"])
    hw = Hardware(gpus=(Gpu(0, "NVIDIA H200", 141.0),), cpu_count=16, nccl_available=True)
    pending, _ = make_plan(cfg, hw, shapes(4096))
    hyp = build.hyperparameters(Settings.of(cfg), pending, tmp_path, 0)
    plan = with_batch(pending, cfg, 128, {})
    build.set_batch(hyp, plan)
    assert (hyp.batch, hyp.nbs, hyp.lr0, hyp.warmup_epochs) == (128, 128, plan.lr0, plan.warmup_epochs)
    assert plan.lr0 == pytest.approx(0.02)


def test_the_probes_validation_batch_runs_the_real_network_and_its_nms_and_leaves_it_training():
    """batch_probe.probe_validation (on CUDA beside the probe's graphs) with a real yolov8n on the CPU: the
    training arguments leave conf None (BaseValidator fills it in later), so the probe's NMS must not read it."""
    from types import SimpleNamespace

    from ultralytics.cfg import get_cfg

    from launcher.machine.hardware import Hardware
    from launcher.plan.plan import make_plan
    from launcher.rank.build_steps.batch_probe import probe_validation
    from launcher.rank.ultralytics import build
    from tests.conftest import compose_config

    hyp = get_cfg(overrides={"imgsz": 64, "plots": False, "model": "yolov8n.yaml"})
    assert hyp.conf is None
    data = {"nc": 3, "names": {0: "a", 1: "b", 2: "c"}, "channels": 3}
    net, frozen = build.network(hyp, data, None)
    plan, _ = make_plan(compose_config(["gpus=0", "val.engine=fast"]), Hardware(cpu_count=2))
    rank = SimpleNamespace(plan=plan, hyp=hyp, device=torch.device("cpu"), amp_dtype=None, data=data)
    probe_validation(rank, net, frozen, 8)
    assert net.training

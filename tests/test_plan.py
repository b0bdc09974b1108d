"""The plan is a pure function: topology, batch, learning rate, warmup, loader, rendezvous, gradient accumulation and
train.batch_per_device=auto. Its refusals of bad values and machines: tests/test_plan_problems.py; what it decides for
the ranks (the step's speed settings, validation, bytecode, CUDA's environment): tests/test_plan_rank_decisions.py.
This module holds the plan helpers other tests import."""

from __future__ import annotations

import pytest

from launcher.plan import lr
from launcher.inputs.data import DatasetInfo
from launcher.machine.hardware import Gpu, Hardware
from launcher.plan.describe import describe
from launcher.plan.plan import make_plan
from tests.conftest import compose_config

CPU_BOX = Hardware(gpus=(), cpu_count=2)
GPU_BOX = Hardware(gpus=tuple(Gpu(i, "NVIDIA H200", 141.0) for i in range(8)), cpu_count=128, nccl_available=True)


def shapes(n_train: int) -> DatasetInfo:
    return DatasetInfo("shapes", "test", {"path": "/x", "train": "/x/t", "val": "/x/v", "names": {0: "a"}}, n_train, 10)


def plan_for(overrides=(), hw=GPU_BOX, data=None, port_is_free=None):
    return make_plan(compose_config(list(overrides)), hw, data, port_is_free=port_is_free)


def messages(problems) -> str:
    return "\n".join(p.message for p in problems)


# --- topology ------------------------------------------------------------------------------------------------
def test_auto_uses_every_gpu_and_one_rank_each():
    plan, problems = plan_for(["gpus=auto"])
    assert not problems
    assert (plan.mode, plan.backend, plan.device) == ("ddp", "nccl", "cuda")
    assert plan.nproc_per_node == 8 and plan.world_size == 8


def test_auto_on_a_cpu_machine_is_one_process_without_a_process_group():
    plan, problems = plan_for(["gpus=auto"], hw=CPU_BOX)
    assert not problems
    assert (plan.mode, plan.backend, plan.device, plan.world_size) == ("single", None, "cpu", 1)
    assert plan.rendezvous.kind == "standalone"  # torchrun still supervises the one process (logs, signals, restarts)
    assert "one process under torchrun, no process group" in describe(plan, None, None)


def test_two_cpu_ranks_use_gloo():
    plan, problems = plan_for(["gpus=0", "nproc=2"], hw=CPU_BOX)
    assert not problems
    assert (plan.mode, plan.backend, plan.world_size) == ("ddp", "gloo", 2)


def test_multi_node_world_size_counts_every_node():
    plan, problems = plan_for(["gpus=4", "nnodes=2", "node_rank=1", "dist.master_addr=10.0.0.1", "dist.master_port=29400"])
    assert not problems
    assert plan.world_size == 8 and plan.node_rank == 1
    assert (plan.rendezvous.kind, plan.rendezvous.addr, plan.rendezvous.port) == ("static", "10.0.0.1", 29400)


# --- batch and learning rate ---------------------------------------------------------------------------------
@pytest.mark.parametrize("gpus,expected_batch", [(1, 32), (2, 64), (4, 128), (8, 256)])
def test_global_batch_is_per_device_times_world(gpus, expected_batch):
    plan, _ = plan_for([f"gpus={gpus}", "train.batch_per_device=32"])
    assert plan.global_batch == expected_batch


@pytest.mark.parametrize(
    "rule,gpus,expected",
    [("linear", 1, 0.005), ("linear", 8, 0.04), ("sqrt", 8, 0.02), ("sqrt", 2, 0.01), ("none", 8, 0.01)],
)
def test_lr0_follows_the_scaling_rule_once(rule, gpus, expected):
    plan, _ = plan_for([f"gpus={gpus}", "train.batch_per_device=32", f"optim.lr_scaling={rule}"])
    assert plan.lr0 == pytest.approx(expected)


def test_at_the_base_batch_lr0_is_base_lr():
    plan, _ = plan_for(["gpus=2", "train.batch_per_device=32", "optim.base_batch=64", "optim.base_lr=0.02"])
    assert plan.lr0 == pytest.approx(0.02)


def test_loss_scale_makes_the_ddp_gradient_base_batch_times_the_global_mean():
    # A rank's summed loss x scale, averaged over ranks by DDP, is base_batch x mean over the global batch.
    per_image = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    for world in (1, 2, 4):
        local = len(per_image) // world
        shards = [per_image[r * local : (r + 1) * local] for r in range(world)]
        ddp_value = sum(sum(s) * lr.loss_scale(64, local) for s in shards) / world
        assert ddp_value == pytest.approx(64 * sum(per_image) / len(per_image))


# --- warmup ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_warmup_is_the_same_number_of_images_at_every_world_size(gpus):
    plan, _ = plan_for([f"gpus={gpus}", "train.batch_per_device=16", "optim.warmup_epochs=2"], data=shapes(4096))
    assert plan.warmup_epochs == 2
    assert plan.warmup_images == 2 * 4096
    assert plan.warmup_iterations == 2 * 4096 // (16 * gpus)


def test_warmup_in_images_overrides_epochs():
    plan, _ = plan_for(["gpus=4", "train.batch_per_device=16", "optim.warmup_images=1280"], data=shapes(4096))
    assert plan.warmup_iterations == 1280 // 64 and plan.warmup_images == 1280


def test_warmup_leaves_the_last_epoch_alone():
    plan, _ = plan_for(["gpus=1", "train.epochs=2", "optim.warmup_epochs=3"], data=shapes(320))
    assert plan.warmup_epochs == 1


# --- loader ------------------------------------------------------------------------------------------------------
def test_auto_workers_leave_a_gpu_rank_a_quarter_of_its_cores_and_are_capped_at_16():
    cpu_input = "loader.augment_on=cpu"  # Ultralytics' transforms in the workers: they need every core they can get
    plan, _ = plan_for(["gpus=8", cpu_input], hw=GPU_BOX)
    assert plan.workers_per_rank == 12  # 128 cores / 8 ranks - 4 (the training process's threads, measured)
    assert plan.threads_per_rank == 4
    plan, _ = plan_for(["gpus=4", cpu_input], hw=Hardware(gpus=GPU_BOX.gpus[:4], cpu_count=24, nccl_available=True))
    assert plan.workers_per_rank == 4  # 6 cores per rank: at least 2 stay with the training process
    plan, _ = plan_for(["gpus=1", cpu_input], hw=GPU_BOX)
    assert plan.workers_per_rank == 16
    plan, _ = plan_for(["gpus=8"], hw=Hardware(gpus=GPU_BOX.gpus, cpu_count=64, nccl_available=True))
    assert plan.augment_on == "gpu" and plan.workers_per_rank == 4  # 8 cores per rank: the input on the GPU
    plan, _ = plan_for(["gpus=0", "nproc=2"], hw=CPU_BOX)
    assert plan.workers_per_rank == 0


# --- rendezvous ----------------------------------------------------------------------------------------------
def test_single_node_auto_port_is_torchruns_standalone_rendezvous():
    plan, _ = plan_for(["gpus=2"])
    assert (plan.rendezvous.kind, plan.rendezvous.port) == ("standalone", 0)


def test_explicit_free_port_is_used():
    plan, problems = plan_for(["gpus=2", "dist.master_port=29611"], port_is_free=lambda p: True)
    assert not problems
    assert (plan.rendezvous.kind, plan.rendezvous.addr, plan.rendezvous.port) == ("static", "127.0.0.1", 29611)


def test_busy_explicit_port_is_an_error_naming_the_port():
    _, problems = plan_for(["gpus=2", "dist.master_port=29612"], port_is_free=lambda p: p != 29612)
    assert "dist.master_port=29612 is already in use" in messages(problems)


# --- gradient accumulation -------------------------------------------------------------------------------------
def test_accumulation_multiplies_the_global_batch_and_lr_and_warmup_follow_it():
    cpu = ["gpus=0", "nproc=2", "train.batch_per_device=8", "optim.lr_scaling=linear"]
    plain, _ = plan_for(cpu, data=shapes(1024))
    acc, problems = plan_for([*cpu, "train.accumulate=4"], data=shapes(1024))
    assert not problems and (acc.accumulate, acc.micro_batch, acc.batch_per_rank, acc.global_batch) == (4, 8, 32, 64)
    assert acc.lr0 == pytest.approx(4 * plain.lr0)  # linear scaling on the effective global batch
    assert (plain.batches_per_epoch, acc.batches_per_epoch) == (64, 16)  # optimizer steps of 64 images
    assert acc.warmup_images == plain.warmup_images and acc.warmup_iterations == plain.warmup_iterations // 4
    named, problems = plan_for([*cpu, "train.global_batch=64"])
    assert not problems and named.accumulate == 4 and named.global_batch == 64
    assert "x 4 accumulated micro-batches = global batch 64" in describe(named, None, None)


@pytest.mark.parametrize(("overrides", "message"), [
    (["train.global_batch=60"], "use 48 or 64"),
    (["train.global_batch=64", "train.accumulate=2"], "set one"),
    (["train.accumulate=0"], "train.accumulate"),
])
def test_an_accumulation_that_cannot_be_is_refused_with_what_can(overrides, message):
    _, problems = plan_for(["gpus=0", "nproc=2", "train.batch_per_device=8", *overrides])
    assert any(message in p.message for p in problems), [p.message for p in problems]


# --- train.batch_per_device=auto -------------------------------------------------------------------------------
def test_auto_batch_is_left_to_the_gpus_and_the_plan_says_by_which_rule():
    plan, problems = plan_for(["gpus=1", "train.batch_per_device=auto", "optim.lr_scaling=linear"], data=shapes(4096))
    assert not problems and plan.batch_pending
    assert (plan.batch_per_device, plan.global_batch, plan.lr0, plan.warmup_iterations) == (None, None, None, None)
    assert plan.auto_batch == {"fraction": 0.6, "multiple": 8, "divides": None, "most": 512, "eager": False}
    text = describe(plan, None, None)
    assert ("batch           auto per device x 1 device(s): the largest multiple of 8 whose measured step fits 60 % "
            "of the smallest GPU's memory") in text
    assert "chosen on the GPUs before the first step" in text and "lr0             base_lr 0.01 x linear(" in text
    small, _ = plan_for(["gpus=1", "train.batch_per_device=auto"], data=shapes(256))  # the built-in shapes
    assert small.auto_batch["most"] == 32  # a large GPU's batch of 208 of them took 2 steps an epoch, and learnt nothing
    assert "at most 32 (every epoch at least 8 steps of a rank's share of the training set)" in describe(small, None, None)
    fraction, _ = plan_for(["gpus=1", "train.batch_per_device=auto", "train.memory_fraction=0.75"])
    assert "fits 75 % of the smallest GPU's memory" in describe(fraction, None, None)


def test_the_measured_batch_is_planned_by_the_same_rules_as_a_given_one():
    """with_batch on the ranks gives the plan make_plan gives for that number: accumulate, lr0, warmup, steps."""
    from launcher.plan.plan import with_batch

    for extra, measured in (([], 96), (["train.global_batch=512"], 64), (["optim.lr_scaling=sqrt"], 40)):
        args = ["gpus=2", *extra]
        auto, problems = plan_for([*args, "train.batch_per_device=auto"], data=shapes(4096))
        assert not problems
        chosen = with_batch(auto, compose_config([*args, "train.batch_per_device=auto"]), measured, {"peak_gib": 80.0})
        given, _ = plan_for([*args, f"train.batch_per_device={measured}"], data=shapes(4096))
        for key in ("batch_per_device", "batch_per_rank", "global_batch", "accumulate", "lr0", "warmup_iterations",
                    "warmup_images", "batches_per_epoch"):
            assert getattr(chosen, key) == getattr(given, key), key
        assert chosen.auto_batch["batch_per_device"] == measured and chosen.auto_batch["peak_gib"] == 80.0
        assert describe(chosen, None, None).split("loader")[0] == describe(given, None, None).split("loader")[0]
    assert chosen.lr0 == pytest.approx(0.01 * (80 / 64) ** 0.5)
    named, _ = plan_for(["gpus=2", "train.batch_per_device=auto", "train.global_batch=512"], data=shapes(4096))
    assert named.auto_batch["divides"] == named.auto_batch["most"] == 256 and named.accumulate is None


def test_auto_batch_on_the_cpu_is_the_default_with_a_note():
    plan, problems = plan_for(["gpus=0", "train.batch_per_device=auto"], hw=CPU_BOX)
    assert not problems and plan.batch_per_device == 16 and not plan.auto_batch
    assert any("train.batch_per_device=auto measures GPU memory; on the CPU it is 16" in n for n in plan.notes)
    from launcher.plan.batch import AUTO_BATCH_ON_CPU, DEFAULT_MEMORY_FRACTION

    shipped = compose_config()["train"]
    assert (AUTO_BATCH_ON_CPU, DEFAULT_MEMORY_FRACTION) == (shipped["batch_per_device"], shipped["memory_fraction"])


@pytest.mark.parametrize(("overrides", "message"), [
    (["train.memory_fraction=0"], "train.memory_fraction=0: expected a number in (0, 1]"),
    (["train.memory_fraction=1.5"], "train.memory_fraction=1.5: expected a number in (0, 1]"),
    (["train.memory_fraction=most"], "train.memory_fraction='most'"),
    (["mode=dp"], "train.batch_per_device=auto is not supported with mode=dp"),
    (["train.global_batch=100"], "the global batch must be a multiple of 16; use 96 or 112"),
    (["train.global_batch=64", "train.accumulate=2"], "set one"),
    (["+train.extra.multi_scale=0.5"], "multi-scale batches reach 1.5 x that"),
])
def test_an_auto_batch_that_cannot_be_measured_is_refused_with_what_can(overrides, message):
    _, problems = plan_for(["gpus=2", "train.batch_per_device=auto", *overrides])
    assert any(message in p.message for p in problems), [p.message for p in problems]

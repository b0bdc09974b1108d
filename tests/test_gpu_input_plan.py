"""The plan's choice of input pipeline (loader.augment_on): auto takes the GPU input where cores are few or images
large, the CPU pipeline for what only it does, and says so; what the GPU input cannot do is refused with the setting
that can; the dry run names the pipeline. The pipeline itself: tests/test_gpu_input.py (decoding) and
tests/test_gpu_input_batches.py (the device's half)."""

from __future__ import annotations

import pytest
import torch


def _plan(overrides: list[str], gpus: int = 1, cpus: int = 16):
    from launcher.machine.hardware import Gpu, Hardware
    from launcher.plan.plan import make_plan
    from tests.conftest import compose_config

    hw = Hardware(gpus=tuple(Gpu(i, "NVIDIA H200", 141.0) for i in range(gpus)), cpu_count=cpus, nccl_available=True)
    return make_plan(compose_config(overrides), hw, None, port_is_free=lambda port: True)


def test_auto_takes_the_gpu_input_where_cores_are_few_or_images_large_and_it_needs_four_workers():
    few, problems = _plan([], cpus=8)
    assert not problems and few.augment_on == "gpu" and few.workers_per_rank == 4
    assert [n for n in few.notes if "loader.augment_on=auto: the input on the GPU (8 core(s) per rank" in n]
    many, problems = _plan([])  # 16 cores at 160 px: Ultralytics' pipeline keeps up
    assert not problems and many.augment_on == "cpu" and many.workers_per_rank == 12 and not many.notes
    large, problems = _plan(["train.imgsz=640"])  # 16 cores at 640 px: the GPU decodes and augments faster
    assert not problems and large.augment_on == "gpu" and [n for n in large.notes if "(640 px: at 512 px" in n]
    assert _plan([], gpus=8, cpus=64)[0].augment_on == "gpu"  # 8 cores per rank
    gpu_input, problems = _plan(["loader.augment_on=gpu"])
    assert not problems and gpu_input.augment_on == "gpu" and gpu_input.workers_per_rank == 4
    assert _plan([], gpus=0, cpus=2)[0].augment_on == "cpu"  # no GPU: Ultralytics' pipeline in the workers
    on_cpu, problems = _plan(["loader.augment_on=gpu"], gpus=0, cpus=2)  # the tensor maths on the CPU (CI)
    assert on_cpu.augment_on == "gpu" and not problems


@pytest.mark.parametrize("override", ["+train.extra.copy_paste=0.2", "train.cache=ram"])
def test_auto_takes_the_cpu_pipeline_for_what_only_it_does_and_says_so(override):
    plan, problems = _plan([override], cpus=8)
    assert not problems and plan.augment_on == "cpu"
    assert [n for n in plan.notes if "loader.augment_on=auto" in n and override.lstrip("+").split("=")[0] in n]


@pytest.mark.parametrize(("override", "advice"), [
    ("+train.extra.copy_paste=0.1", "loader.augment_on=cpu"),
    ("train.cache=ram", "train.cache=shared"),
    ("loader.augment_on=gpus", "auto, cpu or gpu"),
])
def test_what_the_gpu_input_cannot_do_is_refused_with_the_setting_that_can(override, advice):
    _, problems = _plan(["loader.augment_on=gpu", override])
    assert any(advice in p.message for p in problems), [p.message for p in problems]


def test_mixup_and_cutmix_are_the_gpu_inputs_too():
    mix = ["+train.extra.mixup=0.1", "+train.extra.cutmix=0.2"]
    plan, problems = _plan(["loader.augment_on=gpu", *mix])
    assert not problems and plan.augment_on == "gpu"
    plan, problems = _plan(mix, cpus=8)  # auto: nothing in them needs the CPU pipeline
    assert not problems and plan.augment_on == "gpu"


def test_the_dry_run_names_the_input_pipeline(tmp_path, cache_dir):
    from tests.conftest import ddp_launch

    r = ddp_launch(["dry_run=true", "loader.augment_on=gpu"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    expected = ("GPU: the workers read the files, nvJPEG decodes, one pass augments" if torch.cuda.is_available()
                else "the GPU pipeline's tensor maths, run on the CPU")
    assert f"input           {expected}" in r.stdout

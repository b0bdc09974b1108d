"""The plan's problems: bad config values named with the setting, machine problems (GPUs not there, no CUDA) that a
dry run turns into warnings. The plan's numbers: tests/test_plan.py; what it decides for the ranks:
tests/test_plan_rank_decisions.py."""

from __future__ import annotations

import pytest

from launcher.machine.hardware import Gpu, Hardware
from launcher.plan.checks import check_plan
from tests.test_plan import CPU_BOX, messages, plan_for


def test_more_gpus_than_visible_lists_what_is_visible():
    hw = Hardware(gpus=(Gpu(0, "NVIDIA H200", 141.0),), cpu_count=16, nccl_available=True)
    _, problems = plan_for(["gpus=4"], hw=hw)
    text = messages(problems)
    assert "gpus=4 but this node has 1 visible GPU(s): cuda:0 NVIDIA H200" in text
    assert all(p.environment for p in problems)


def test_gpus_without_cuda_suggests_the_cpu():
    _, problems = plan_for(["gpus=2"], hw=CPU_BOX)
    assert "train on the CPU with gpus=0" in messages(problems)


def test_dry_run_turns_machine_problems_into_warnings_but_not_config_errors():
    _, problems = plan_for(["gpus=2", "train.batch_per_device=0"], hw=CPU_BOX)
    errors, warnings = check_plan(problems, dry_run=True)
    assert "train.batch_per_device=0: must be >= 1" in messages(errors)
    assert "gpus=2" in messages(warnings)
    errors, warnings = check_plan(problems, dry_run=False)
    assert not warnings and len(errors) == len(problems)


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["train.batch_per_device=0"], "train.batch_per_device=0: must be >= 1"),
        (["gpus=0", "dist.backend=nccl", "mode=ddp", "nproc=2"], "dist.backend=nccl needs GPUs"),
        (["gpus=4", "nproc=2"], "ddp-launch runs one rank per GPU"),
        (["mode=single", "gpus=2"], "mode=single runs one process"),
        (["nnodes=2", "gpus=1"], "needs dist.master_addr set to node 0's address"),
        (["optim.name=auto"], "Ultralytics' `auto` picks its own optimizer"),
        (["optim.lr_scaling=cubic"], "optim.lr_scaling='cubic'"),
        (["train.amp=fp8"], "train.amp='fp8'"),
        (["train.imgsz=100"], "multiple of 32"),
        (["+train.extra.epochs=3"], "train.extra.epochs: ddp-launch sets this itself; use train.epochs"),
        (["+train.extra.not_an_arg=3"], "train.extra.not_an_arg: not an Ultralytics train argument"),
        (["dist.nccl.debug=LOUD"], "dist.nccl.debug='LOUD'"),
        (["train.compile=fastest"], "train.compile='fastest': expected false, true or one of default, reduce-overhead"),
        (["train.compile=true", "train.cuda_graphs=true"], "choose one (train.compile=reduce-overhead"),
        (["train.compile=true", "mode=dp"], "train.compile is not supported with mode=dp"),
        (["train.cuda_graphs=true", "mode=dp"], "train.cuda_graphs=true is not supported with mode=dp"),
        (["optim.fused=maybe"], "optim.fused='maybe': expected auto, true or false"),
        (["train.cuda_graphs=always"], "train.cuda_graphs='always': expected auto, true or false"),
        (["train.graph_scope=step"], "train.graph_scope='step': expected auto or network"),
        (["train.steps_in_flight=-1"], "train.steps_in_flight=-1: expected a whole number >= 0"),
        (["train.steps_in_flight=two"], "train.steps_in_flight='two': expected a whole number >= 0"),
        (["train.cudnn_benchmark=fast"], "train.cudnn_benchmark='fast': expected true or false"),
        (["train.cuda_connections=0"], "train.cuda_connections=0: expected a whole number from 1 to 32"),
        (["train.cuda_connections=64"], "train.cuda_connections=64: expected a whole number from 1 to 32"),
        (["train.cuda_connections=many"], "train.cuda_connections='many': expected a whole number from 1 to 32"),
        (["val.engine=turbo"], "val.engine='turbo': expected auto, fast or ultralytics"),
        (["val.batch=0"], "val.batch=0: must be >= 1"),
        (["val.cuda_graphs=maybe"], "val.cuda_graphs='maybe': expected auto, true or false"),
        (["val.fold_batchnorm=1"], "val.fold_batchnorm=1: expected true or false"),
        (["val.fold_batchnorm=yes"], "val.fold_batchnorm='yes': expected true or false"),
        (["val.engine=fast", "+train.extra.save_json=true"], "the fast validation engine does not write it"),
    ],
)
def test_bad_config_values_are_named(overrides, expected):
    _, problems = plan_for(overrides)
    assert expected in messages(problems)

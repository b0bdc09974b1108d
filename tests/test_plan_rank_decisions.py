"""What the plan decides for the ranks, once: the step's speed settings (compile, CUDA graphs), the validation engine,
where the ranks' bytecode is kept, CUDA's hardware queues, precision, and a plan.json without these decisions read
from its config. The plan's numbers: tests/test_plan.py; its refusals: tests/test_plan_problems.py."""

from __future__ import annotations

import importlib.util
import py_compile
import sys

import pytest

from launcher.machine.hardware import Hardware
from launcher.plan.describe import describe
from launcher.plan.plan import make_plan
from tests.conftest import compose_config
from tests.test_plan import CPU_BOX, GPU_BOX, messages, plan_for


# --- the validation engine ---------------------------------------------------------------------------------------
def test_the_validation_engine_is_the_fast_one_unless_ultralytics_must_write_files_only_it_writes():
    from launcher.plan.checks import val_engine
    from launcher.plan.decisions import val_batch_at

    assert val_engine({"engine": "auto"}, {"extra": {}}) == "fast"
    assert val_engine({"engine": "auto"}, {"extra": {"save_txt": True}}) == "ultralytics"
    assert val_engine({"engine": "ultralytics"}, {"extra": {}}) == "ultralytics"
    assert (val_batch_at(None, 64), val_batch_at(96, 64), val_batch_at(None, 100)) == (128, 96, 128)
    _, problems = plan_for(["+train.extra.save_json=true"])  # auto gives way: nothing refused
    assert "validation engine" not in messages(problems)


# --- the step's speed settings ----------------------------------------------------------------------------------
def test_compile_with_cuda_graphs_on_the_cpu_is_refused_with_the_mode_that_works():
    _, problems = plan_for(["gpus=0", "train.compile=reduce-overhead"], hw=CPU_BOX)
    assert "on the CPU use train.compile=default" in messages(problems)
    _, problems = plan_for(["gpus=0", "train.compile=default"], hw=CPU_BOX)
    assert not problems


def test_compile_on_gpus_without_triton_is_a_machine_problem():
    _, problems = plan_for(["gpus=1", "train.compile=true"], hw=GPU_BOX)
    (problem,) = [p for p in problems if "Triton" in p.message]
    assert problem.environment and "train.compile=false" in problem.message
    with_triton = Hardware(gpus=GPU_BOX.gpus, cpu_count=128, nccl_available=True, triton_available=True)
    _, problems = plan_for(["gpus=1", "train.compile=reduce-overhead"], hw=with_triton)
    assert not problems


def test_cuda_graphs_are_on_by_default_wherever_they_can_be_and_off_where_they_cannot():
    assert plan_for(["gpus=1"])[0].cuda_graphs
    assert plan_for(["gpus=2", "mode=ddp"])[0].cuda_graphs
    assert not plan_for(["gpus=2", "mode=dp"])[0].cuda_graphs  # DataParallel replicates the network every step
    assert not plan_for(["gpus=0"], hw=CPU_BOX)[0].cuda_graphs
    with_triton = Hardware(gpus=GPU_BOX.gpus, cpu_count=128, nccl_available=True, triton_available=True)
    plan, problems = plan_for(["gpus=1", "train.compile=reduce-overhead"], hw=with_triton)
    assert not plan.cuda_graphs and not problems  # torch.compile brings its own graphs
    plan, _ = plan_for(["gpus=1", "train.cuda_graphs=false"])
    assert not plan.cuda_graphs
    assert "step            CUDA graphs on" in describe(plan_for(["gpus=1"])[0], None, None)


# --- the ranks' interpreters -----------------------------------------------------------------------------------
def test_where_torchs_install_keeps_no_bytecode_the_ranks_keep_theirs_in_the_cache():
    from dataclasses import replace

    bare = replace(GPU_BOX, bytecode_kept=False)
    plan, problems = plan_for(["gpus=1", "paths.cache=/data/cache"], hw=bare)
    assert not problems
    assert plan.env["PYTHONPYCACHEPREFIX"] == "/data/cache/bytecode"
    assert plan.env["PYTHONDONTWRITEBYTECODE"] == ""  # unset, to Python: the folder is written, not the install
    assert any("/data/cache/bytecode" in n and "paths.bytecode=null" in n for n in plan.notes)
    kept, _ = plan_for(["gpus=1", "paths.cache=/data/cache"])
    assert "PYTHONPYCACHEPREFIX" not in kept.env and not any("bytecode" in n for n in kept.notes)
    off, _ = plan_for(["gpus=1", "paths.bytecode=null"], hw=bare)
    assert "PYTHONPYCACHEPREFIX" not in off.env
    chosen, _ = plan_for(["gpus=1", "paths.bytecode=/fast/pyc"])
    assert chosen.env["PYTHONPYCACHEPREFIX"] == "/fast/pyc"
    _, problems = plan_for(["gpus=1", "paths.bytecode=pyc"])
    assert "paths.bytecode='pyc': give auto, null or an absolute folder" in messages(problems)


def test_an_install_without_bytecode_is_found_by_its_files_alone(tmp_path, monkeypatch):
    from launcher.machine.hardware import bytecode_kept

    package = tmp_path / "somepkg"
    package.mkdir()
    (package / "__init__.py").write_text("raise RuntimeError('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    monkeypatch.setattr("sys.pycache_prefix", None)
    real = sys.flags

    class Flags:  # as without -B (or PYTHONDONTWRITEBYTECODE, which sets it) in this interpreter
        dont_write_bytecode = False

        def __getattr__(self, name):
            return getattr(real, name)

    monkeypatch.setattr("sys.flags", Flags())
    read_only = lambda path, mode: False  # noqa: E731 (the install's folders, as in a read-only image)
    assert bytecode_kept("somepkg", writable=read_only) is False
    assert bytecode_kept("somepkg") is True  # writable: the first import writes it
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    assert bytecode_kept("somepkg") is False  # writable, but nothing will write it
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", str(tmp_path / "elsewhere"))
    assert bytecode_kept("somepkg") is True  # the user keeps it elsewhere
    monkeypatch.delenv("PYTHONPYCACHEPREFIX")
    source = str(package / "__init__.py")
    py_compile.compile(source, cfile=importlib.util.cache_from_source(source))
    assert bytecode_kept("somepkg", writable=read_only) is True  # compiled in the image
    assert bytecode_kept("not_installed_anywhere") is True


# --- the ranks' CUDA environment -----------------------------------------------------------------------------
def test_gpu_ranks_get_more_hardware_queues_than_cudas_default():
    # With CUDA's 8 queues the input's decode kernels waited behind the step's (docs/benchmarks/README.md, section 6)
    plan, problems = plan_for(["gpus=2"])
    assert not problems and plan.env["CUDA_DEVICE_MAX_CONNECTIONS"] == "32"
    plan, _ = plan_for(["gpus=2", "train.cuda_connections=8"])
    assert plan.env["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"


@pytest.mark.parametrize("overrides,hw", [(["gpus=2", "train.cuda_connections=null"], GPU_BOX), (["gpus=0"], CPU_BOX)])
def test_cuda_connections_left_to_the_environment(overrides, hw):
    plan, problems = plan_for(overrides, hw=hw)
    assert not problems and "CUDA_DEVICE_MAX_CONNECTIONS" not in plan.env


# --- all of them at once, and a plan.json without them -----------------------------------------------------------
def test_the_plan_decides_the_ranks_precision_graphs_and_validation_once():
    plan, _ = plan_for(["train.amp=bf16", "val.batch=24", "train.graph_scope=network", "train.cuda_graphs=true"])
    assert (plan.amp, plan.cuda_graphs, plan.cuda_graphs_required, plan.graph_scope) == ("bf16", True, True, "network")
    assert (plan.val_engine, plan.val_batch, plan.val_cuda_graphs, plan.fused_optimizer) == ("fast", 24, True, True)
    plan, _ = plan_for(["gpus=0", "+train.extra.save_json=true"])
    assert not plan.fused_optimizer
    assert (plan.amp, plan.cuda_graphs, plan.graph_scope, plan.val_engine, plan.val_cuda_graphs) == (
        False, False, "network", "ultralytics", False)
    assert plan.val_batch == min(2 * plan.micro_batch, 128)
    plan, _ = plan_for(["train.batch_per_device=auto"])
    assert plan.val_batch is None and plan.val_batch_at(48) == 96 and plan.graph_scope == "step"


def test_an_older_plan_json_without_the_ranks_decisions_takes_them_from_its_config():
    from launcher.plan.plan import LaunchPlan

    cfg = compose_config(["train.amp=bf16", "+train.extra.save_txt=true", "val.cuda_graphs=false"])
    plan, _ = make_plan(cfg, GPU_BOX)
    older = {k: v for k, v in plan.to_dict().items()
             if k not in ("amp", "fused_optimizer", "cudnn_benchmark", "cuda_graphs_required", "graph_scope", "val_engine",
                          "val_batch_fixed", "val_cuda_graphs")}
    assert LaunchPlan.from_dict(older, cfg) == plan
    assert LaunchPlan.from_dict(plan.to_dict(), cfg) == plan

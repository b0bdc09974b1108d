"""ddp-bench: which cells run and what the verdicts say (the README's CPU benchmark runs in tests/test_readme.py)."""

from __future__ import annotations

import pytest

from launcher.bench import report
from launcher.bench.cells import plan_cells
from tests.conftest import TINY, ddp_launch


def test_cells_skip_what_the_machine_lacks_and_say_why():
    cells, problems = plan_cells([1, 2, 4, 8], ["single", "dp", "ddp"], "ultralytics", gpu_count=2, cpu_count=32, on_gpu=True)
    assert not problems
    by_name = {c.name: c for c in cells}
    assert cells[0].name == "ultralytics-1"
    assert "single-2" not in by_name  # a single process is size 1
    assert not by_name["ddp-2"].skip and not by_name["dp-2"].skip
    assert by_name["ddp-8"].skip == "needs 8 GPU(s); this machine has 2"


def test_dataparallel_over_several_devices_needs_gpus():
    cells, _ = plan_cells([1, 2], ["dp"], None, gpu_count=0, cpu_count=2, on_gpu=False)
    assert [c.skip for c in cells] == ["", "DataParallel over several devices needs GPUs (on the CPU it is one device)"]


def test_bad_bench_requests_are_named():
    _, problems = plan_cells([0], ["fsdp"], "yolov5", gpu_count=0, cpu_count=2, on_gpu=False)
    assert len(problems) == 3 and "unknown mode 'fsdp'" in problems[0]


def test_variants_run_beside_the_defaults_cell_unless_one_of_them_is_the_defaults():
    """bench.variants measures levers against the defaults: each (mode, size) cell runs with the defaults first, then
    once per variant; a variant with no overrides is the defaults already, and no unnamed cell is added."""
    levers = {"cache": ["train.cache=shared"], "gpu": ["loader.augment_on=gpu"]}
    cells, _ = plan_cells([1, 2], ["ddp"], None, gpu_count=2, cpu_count=16, on_gpu=True, variants=levers)
    assert [(c.size, c.variant, c.overrides_) for c in cells] == [
        (1, "", ()), (1, "cache", ("train.cache=shared",)), (1, "gpu", ("loader.augment_on=gpu",)),
        (2, "", ()), (2, "cache", ("train.cache=shared",)), (2, "gpu", ("loader.augment_on=gpu",))]
    cells, _ = plan_cells([1], ["ddp"], None, gpu_count=1, cpu_count=16, on_gpu=True, variants={"base": [], **levers})
    assert [c.variant for c in cells] == ["base", "cache", "gpu"]


@pytest.mark.parametrize("kind", [["bench.kind=time_to_model"], ["bench.kind=throughput", "bench.sizes=[1]",
                                                                  "bench.modes=[single]"]])
def test_a_variants_bad_value_or_unknown_key_is_refused_before_any_side_runs(tmp_path, kind):
    """Either kind of benchmark: every variant is checked before the first side (or cell) runs, with ddp-launch's
    own wording (the throughput cells once stopped at the first bad variant's cell, with OmegaConf's message)."""
    out = tmp_path / "b"
    args = [*kind, "gpus=0", "data=shapes", *TINY, f"hydra.run.dir={out}",
            'bench.variants={bad:["val.fold_batchnorm=1"],typo:["val.fold_batchnrm=true"],fine:["train.val_interval=2"]}']
    result = ddp_launch(args, cwd=tmp_path, timeout=300, tool="ddp-bench")
    assert result.returncode != 0
    said = result.stdout + result.stderr
    assert "bench.variants.bad: val.fold_batchnorm=1: expected true or false" in said, said[-3000:]
    assert "bench.variants.typo: val.fold_batchnrm: not a ddp-launch key; did you mean val.fold_batchnorm?" in said
    assert "bench.variants.fine" not in said and not list(out.glob("*-seed*")) and not (out / "cells").exists()


def cell(**kw):
    base = {"mode": "ddp", "size": 1, "images_per_s": 500.0, "data_wait": 0.02, "gpu_util": 95.0, "pipeline_efficiency": 0.97, "efficiency": 1.0}
    return {**base, **kw}


@pytest.mark.parametrize(
    "figures,expected",
    [
        ({"data_wait": 0.55, "gpu_util": 43.0}, "input-bound: GPU 43 % busy, 55 % of step time waiting for data; raise loader.workers or set train.cache=ram"),
        # the GPU input: train.cache=ram would put an auto run back on the CPU pipeline
        ({"data_wait": 0.3, "gpu_util": 70.0, "input_gpu_ms_per_image": 0.4}, "input-bound: GPU 70 % busy, 30 % of step time waiting for data; set train.cache=shared"),
        # with the GPU input's threads measured: the one that bounds it, or the workers when the decoding thread
        # waits for them longer than it works
        ({"data_wait": 0.3, "gpu_util": 70.0, "input_gpu_ms_per_image": 0.4, "step_ms": 48.0,
          "input_threads": {"decode": {"waiting_ms": 0.5, "working_ms": 47.0, "blocked_ms": 0.5, "busy": 0.98},
                            "prepare": {"waiting_ms": 30.0, "working_ms": 17.0, "blocked_ms": 1.0, "busy": 0.35}}},
         "input-bound: GPU 70 % busy, 30 % of step time waiting for data; the input's decode thread (reads the "
         "loader's batches, decodes) bounds it: 47 ms of work a batch against a 48 ms step, busy 98 % of its time"),
        ({"data_wait": 0.3, "gpu_util": 70.0, "input_gpu_ms_per_image": 0.4,
          "input_threads": {"decode": {"waiting_ms": 40.0, "working_ms": 7.0, "blocked_ms": 0.0, "busy": 0.15},
                            "prepare": {"waiting_ms": 40.0, "working_ms": 7.0, "blocked_ms": 1.0, "busy": 0.15}}},
         "input-bound: GPU 70 % busy, 30 % of step time waiting for data; set train.cache=shared"),
        ({"pipeline_efficiency": 0.74}, "host-bound: 74 % of the data-free ceiling"),
        # below the ceiling with little data wait: an input thread that works (nearly) a whole step per batch paces
        # the loop (as the decoding thread did on a lease: docs/benchmarks/README.md, section 6); one with time to
        # spare does not
        ({"pipeline_efficiency": 0.89, "step_ms": 55.1,
          "input_threads": {"decode": {"waiting_ms": 0.3, "working_ms": 52.5, "blocked_ms": 3.3, "busy": 0.94},
                            "prepare": {"waiting_ms": 28.3, "working_ms": 27.6, "blocked_ms": 0.0, "busy": 0.49}}},
         "input-paced: 89 % of the data-free ceiling with 2 % data wait; the input's decode thread (reads the "
         "loader's batches, decodes) bounds it: 52 ms of work a batch against a 55 ms step"),
        ({"pipeline_efficiency": 0.89, "step_ms": 55.1,
          "input_threads": {"decode": {"waiting_ms": 0.3, "working_ms": 30.0, "blocked_ms": 25.0, "busy": 0.54}}},
         "host-bound: 89 % of the data-free ceiling"),
        ({"gpu_util": 46.0}, "step-bound: GPU 46 % busy"),
        ({"size": 4, "efficiency": 0.8}, "scaling-bound: 80 % efficiency at 4 devices"),
        ({}, "fed: GPU 95 % busy, 2 % data wait"),
    ],
)
def test_verdicts_name_the_bottleneck_and_the_knob(figures, expected):
    assert report.verdict(cell(**figures)).startswith(expected)


@pytest.mark.parametrize("profile", [False, True])
def test_the_reports_footnote_says_which_steps_the_window_left_out(profile):
    env = {"gpus": [], "torch": "2", "cpu_count": 2, "python": "3.11"}
    md = report.markdown({"command": "ddp-bench", "cells": [], "environment": env,
                          "settings": {"warmup_steps": 15, "steps": 60, "steps_in_flight": 1, "profile": profile}})
    left_out = " (on GPUs also the profiled steps after them: bench.profile)" if profile else ""
    assert f"15 warm-up steps dropped{left_out}, 60 steps measured" in md


def test_the_report_lists_the_gpu_inputs_threads_per_cell_and_their_mean_over_ranks():
    ranks = [{"images_per_s": 500.0, "data_wait": 0.02, "step_ms": 50.0, "steps_measured": 60, "host_cpu": 0.1,
              "input_threads": {"decode": {"waiting_ms": w, "working_ms": 30.0, "blocked_ms": 10.0, "busy": 0.7}}}
             for w in (1.0, 3.0)]
    c = report.aggregate("ddp", 2, ranks)
    assert c["input_threads"] == {"decode": {"waiting_ms": 2.0, "working_ms": 30.0, "blocked_ms": 10.0, "busy": 0.7}}
    assert report.aggregate("ddp", 1, [{**ranks[0], "input_threads": None}])["input_threads"] is None
    report.add_speedups([c])
    c["verdict"] = report.verdict(c)
    env = {"gpus": [], "torch": "2", "cpu_count": 2, "python": "3.11"}
    md = report.markdown({"command": "ddp-bench", "cells": [c], "environment": env,
                          "settings": {"warmup_steps": 15, "steps": 60, "steps_in_flight": 1}})
    assert "- ddp x2 (step 50.0): decode thread (reads the loader's batches, decodes) 2.0 / 30.0 / 10.0" in md

"""ddp-bench: which cells run and what the verdicts say (the README's CPU benchmark runs in tests/test_readme.py)."""

from __future__ import annotations

import pytest

from launcher.bench import report
from launcher.bench.cells import plan_cells


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


def cell(**kw):
    base = {"mode": "ddp", "size": 1, "images_per_s": 500.0, "data_wait": 0.02, "gpu_util": 95.0, "pipeline_efficiency": 0.97, "efficiency": 1.0}
    return {**base, **kw}


@pytest.mark.parametrize(
    "figures,expected",
    [
        ({"data_wait": 0.55, "gpu_util": 43.0}, "input-bound: GPU 43 % busy, 55 % of step time waiting for data; raise loader.workers or set train.cache=ram"),
        # the GPU input: train.cache=ram would put an auto run back on the CPU pipeline
        ({"data_wait": 0.3, "gpu_util": 70.0, "input_gpu_ms_per_image": 0.4}, "input-bound: GPU 70 % busy, 30 % of step time waiting for data; set train.cache=shared"),
        ({"pipeline_efficiency": 0.74}, "host-bound: 74 % of the data-free ceiling"),
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

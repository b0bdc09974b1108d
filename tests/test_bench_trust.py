"""ddp-bench says when its figures are not to be trusted (bench/trust.py): repeats and their spread, the host's load,
figures outside physics flagged; and no verdict rests on a GPU utilisation that NVML did not report."""

from __future__ import annotations

from launcher.bench import report, trust

QUIET = trust.host_load((0.1, 0.1, 0.1), (1.9, 1.0, 0.5), 2)
BUSY = trust.host_load((3.5, 3.0, 2.0), (4.0, 3.0, 2.0), 2)


def run(size: int, ips: float, ceiling: float | None = None, wait: float = 0.02) -> dict:
    return {"mode": "ddp", "size": size, "images_per_s": ips, "data_wait": wait, "gpu_util": None,
            "ceiling_images_per_s": ceiling, "pipeline_efficiency": ips / ceiling if ceiling else None}


def measured(runs_per_cell: list[list[dict]], host: dict) -> list[dict]:
    cells = [{**trust.combine(runs), "variant": ""} for runs in runs_per_cell]
    report.add_speedups(cells)
    trust.flags(cells, host)
    return cells


def test_two_noisy_runs_of_one_benchmark_are_flagged_not_reported_as_a_speedup():
    """Two identical CPU benchmarks on a busy host read 27x and then 2.85x from 2 processes: measured as repeats of
    one invocation, the cells say their runs differ and the host was busy."""
    one, two = measured([[run(1, 10.0), run(1, 100.0)], [run(2, 270.0), run(2, 285.0)]], BUSY)
    assert one["images_per_s"] == 100.0 and one["repeats"] == [10.0, 100.0] and abs(one["spread"] - 0.9) < 1e-9
    assert abs(two["speedup"] - 2.85) < 1e-9  # the fastest runs against each other: noise only slows a run
    assert "its repeats differ by 90 % (10.0, 100.0 images/s)" in one["flags"][0]
    assert "the host was busy before the bench: load 3.5 on 2 cores" in one["flags"][-1]
    assert two["flags"] == []  # 5 % apart: within what a quiet host gives
    (line,) = trust.warnings([one, two])
    assert line.startswith("ddp x1: not to be trusted as it stands: its repeats differ by 90 %")


def test_an_efficiency_above_100_percent_beyond_the_spread_and_a_starved_single_cell_are_flagged():
    one, two = measured([[run(1, 20.0, ceiling=400.0), run(1, 21.0, ceiling=400.0)],
                         [run(2, 375.0, ceiling=800.0), run(2, 370.0, ceiling=800.0)]], QUIET)
    assert two["efficiency"] > 8  # 938 %: two processes cannot do nine times the work of one
    assert any("efficiency 893 % is above 100 % beyond the repeats' spread" in f for f in two["flags"])
    assert any("a size-1 cell at 5 % of its own data-free ceiling with its data ready" in f for f in one["flags"])
    fine = measured([[run(1, 100.0, ceiling=110.0), run(1, 98.0, ceiling=110.0)],
                     [run(2, 203.0, ceiling=220.0), run(2, 199.0, ceiling=220.0)]], QUIET)
    assert [c["flags"] for c in fine] == [[], []]  # 101.5 % efficiency: inside the spread
    (outran,) = measured([[run(1, 9.7, ceiling=6.3), run(1, 9.5, ceiling=6.3)]], QUIET)
    assert "the loop ran at 154 % of its own data-free ceiling, which it cannot outrun" in outran["flags"][0]


def test_a_failed_repeat_fails_the_cell():
    assert trust.combine([run(1, 10.0), {"mode": "ddp", "size": 1, "error": "exit code 1"}])["error"] == "exit code 1"


def test_a_utilisation_nvml_did_not_report_carries_no_verdict():
    """An H200 whose NVML read 0 % at 94 % of the data-free ceiling: not 'step-bound'."""
    c = {"mode": "ddp", "size": 1, "images_per_s": 940.0, "data_wait": 0.005, "gpu_util": 0.0,
         "pipeline_efficiency": 0.94, "efficiency": 1.0}
    v = report.verdict(c)
    assert not v.startswith("step-bound") and "GPU 0 % busy" not in v
    assert v == ("fed: 0 % data wait, 94 % of the data-free ceiling; GPU utilisation unavailable (NVML read 0 % at "
                 "94 % of the data-free ceiling), so no verdict rests on it")
    assert report.verdict({**c, "gpu_util": 46.0}).startswith("step-bound: GPU 46 % busy")  # a reading there is


def test_a_low_utilisation_beside_a_whole_step_graph_at_its_ceiling_carries_no_verdict():
    """An H200 whose NVML read 33 % on a step replayed as one CUDA graph at 94 % of its data-free ceiling: that step
    has no per-step host work or launches to be bound by, so 'step-bound' would be false; below the ceiling, or on a
    step launched kernel by kernel, the reading still counts."""
    c = {"mode": "ddp", "size": 1, "images_per_s": 940.0, "data_wait": 0.004, "gpu_util": 33.0,
         "pipeline_efficiency": 0.94, "efficiency": 1.0, "whole_step_graph": True}
    assert report.verdict(c) == (
        "fed: 0 % data wait, 94 % of the data-free ceiling; NVML's 33 % GPU utilisation is not trusted: the step "
        "replays as one CUDA graph at 94 % of the data-free ceiling, with no per-step host work or launches to be "
        "bound by, so no verdict rests on it")
    assert report.verdict({**c, "whole_step_graph": False}).startswith("step-bound: GPU 33 % busy")
    assert report.verdict({**c, "pipeline_efficiency": 0.80}).startswith("host-bound: 80 %")
    ranks = [{"images_per_s": 470.0, "data_wait": 0.0, "step_ms": 10.0, "steps_measured": 5, "whole_step_graph": True},
             {"images_per_s": 470.0, "data_wait": 0.0, "step_ms": 10.0, "steps_measured": 5}]
    assert report.aggregate("ddp", 2, ranks)["whole_step_graph"] is False  # every rank's step must be one graph


def test_the_report_gives_the_spread_the_host_load_and_what_not_to_trust():
    cells = measured([[run(1, 10.0), run(1, 100.0)], [run(2, 270.0), run(2, 285.0)]], BUSY)
    for c in cells:
        c.update(gpu_util=None, gpu_util_per_gpu=[], memory_peak_gib=None, host_cpu=0.5, step_ms=10.0,
                 verdict=report.verdict(c))
    env = {"gpus": [], "torch": "2", "cpu_count": 2, "python": "3.11"}
    md = report.markdown({"command": "ddp-bench", "cells": cells, "environment": env, "host": BUSY,
                          "settings": {"warmup_steps": 3, "steps": 10, "steps_in_flight": 1, "repeats": 2}})
    assert "| 90 % of 2 |" in md and "| 5 % of 2 |" in md
    assert "Host load (1-minute average): 3.5 before the first cell, 4 after the last, on 2 cores" in md
    assert "Not to be trusted as they stand:\n- ddp x1: not to be trusted as it stands: its repeats differ" in md

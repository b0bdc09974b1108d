"""ddp-bench: which cells run, what the verdicts say, and a real 2-rank CPU benchmark with consistent reports."""

from __future__ import annotations

import json
import re

import pytest

from launcher.bench import report
from launcher.bench.cells import plan_cells
from tests.conftest import ddp_launch


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
        ({"data_wait": 0.55, "gpu_util": 43.0}, "input-bound: GPU 43 % busy, 55 % of step time waiting for data; raise loader.workers"),
        ({"pipeline_efficiency": 0.74}, "host-bound: 74 % of the data-free ceiling"),
        ({"gpu_util": 46.0}, "step-bound: GPU 46 % busy"),
        ({"size": 4, "efficiency": 0.8}, "scaling-bound: 80 % efficiency at 4 devices"),
        ({}, "fed: GPU 95 % busy, 2 % data wait"),
    ],
)
def test_verdicts_name_the_bottleneck_and_the_knob(figures, expected):
    assert report.verdict(cell(**figures)).startswith(expected)


@pytest.mark.slow
@pytest.mark.dist
def test_a_two_rank_cpu_benchmark_writes_consistent_reports(tmp_path, cache_dir):
    args = ["gpus=0", "bench.sizes=[1,2]", "bench.modes=[ddp]", "data=shapes", "data.synthetic.train_images=64",
            "train.imgsz=64", "train.batch_per_device=8", "bench.warmup_steps=3", "bench.steps=8", f"hydra.run.dir={tmp_path}/b"]
    r = ddp_launch(args, cwd=tmp_path, timeout=900, tool="ddp-bench")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = tmp_path / "b"
    data = json.loads((out / "bench.json").read_text())
    md = (out / "bench.md").read_text()
    assert (out / "bench.png").stat().st_size > 0
    cells = {c["size"]: c for c in data["cells"]}
    assert set(cells) == {1, 2}
    for size, c in cells.items():
        assert c["efficiency"] == pytest.approx(c["speedup"] / size)
        assert c["steps_measured"] == 8  # the 3 warm-up steps are not in the window
        row = next(line for line in md.splitlines() if line.startswith(f"| ddp x{size} |"))
        assert f"| {c['images_per_s']:.1f} |" in row and f"| {c['speedup']:.2f}x |" in row
        assert re.search(rf"\| {100 * c['efficiency']:.0f} % \|", row)
        assert c["verdict"] in row
    assert cells[1]["speedup"] == pytest.approx(1.0)
    assert data["environment"]["cpu_count"] >= 1 and "torch" in data["environment"]

"""Each task's record (plan/task_rules.py TaskRules) is what the plan, the ranks and the final lines ask: a run's
summary.json names its headline metric, and the final lines of a finished run, or of its resume, print it. Fakes
only: a summary written from a stand-in plan and state."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from types import SimpleNamespace

import pytest

from launcher.launch.outcome import report, say_finished
from launcher.plan.task_rules import TASKS, TOP1, TOP5, rules
from launcher.rank.metrics.run_summary import summary
from launcher.run_folder import RunFolder


def test_every_task_the_ranks_build_has_a_record_by_the_same_name():
    from launcher.inputs.model_task import TRAINED
    from launcher.rank.ultralytics.tasks import TASKS as SEAM

    assert set(TASKS) == set(SEAM) == set(TRAINED)
    assert all(r.name == name for name, r in TASKS.items()) and rules(None) is TASKS["detect"]


def test_what_each_record_says_of_its_task():
    assert [n for n, r in TASKS.items() if r.fast_paths] == ["detect"]
    assert [n for n, r in TASKS.items() if r.auto_gpu_input] == ["detect"]  # the others until measured on GPUs
    c = rules("classify")
    assert c.folders and not c.mosaic and c.mean_loss and not c.shared_cache and not c.multi_scale and not c.boxes
    assert c.loss_base(64) == 1 and rules("segment").loss_base(64) == 64
    assert [m.key for m in rules("segment").results] == ["map50", "map50_95", "map50_mask", "map50_95_mask"]
    assert c.headline.key == "top1" and rules("pose").headline.key == "map50"
    assert rules("obb").quality.words == "box mAP50-95 (rotated boxes)" and c.quality.key == "top1"


def _finished(tmp_path, task: str, metrics: dict) -> RunFolder:
    """A finished run's folder with the summary.json rank 0 writes for a `task` run that validated to `metrics`."""
    plan = SimpleNamespace(task=task, world_size=2, mode="ddp", backend="gloo", device="cpu", global_batch=16,
                           batch_per_device=8, accumulate=1, auto_batch=None, lr0=0.01, warmup_iterations=0,
                           images={})
    state = SimpleNamespace(metrics=metrics, epoch=1, validated_epochs=[2], fitness_epoch=2, resumed_from=None)
    rank = {"images_per_s": 10.0, "steps_measured": 4, "data_wait": 0.0, "params_sha256": "x", "loss": {}}
    s = summary(plan=plan, state=state, epochs=2, reports=[rank, rank], weights="w", last="l", run_dir=tmp_path,
                started=0)
    folder = RunFolder(tmp_path / task)
    folder.write_json("summary.json", json.loads(json.dumps(s)))
    return folder


def _said(call) -> str:
    out = io.StringIO()
    with redirect_stdout(out):
        call()
    return out.getvalue()


@pytest.mark.parametrize("task, metrics, line, headline", [
    ("classify", {TOP1: 0.75, TOP5: 1.0}, "top-1 0.7500  top-5 1.0000", "top-1 0.7500"),
    ("segment", {"metrics/mAP50(B)": 0.5, "metrics/mAP50-95(B)": 0.25, "metrics/mAP50(M)": 0.4,
                 "metrics/mAP50-95(M)": 0.2}, "mAP50 0.5000  mAP50-95 0.2500  mask mAP50 0.4000  mask mAP50-95 "
     "0.2000", "mAP50 0.5000"),
    ("obb", {"metrics/mAP50(B)": 0.5, "metrics/mAP50-95(B)": 0.25}, "mAP50 0.5000  mAP50-95 0.2500 (rotated boxes)",
     "mAP50 0.5000"),
])
def test_the_summary_names_its_headline_and_the_final_lines_print_the_tasks_metrics(tmp_path, task, metrics, line,
                                                                                     headline):
    folder = _finished(tmp_path, task, metrics)
    s = folder.summary()
    assert s["headline"] == rules(task).headline.key and s["task"] == task
    said = _said(lambda: report(folder, 0, None, 0))
    assert f"\n{line}\n" in said and ("mAP50" in said) == (task != "classify")
    assert f"2 epoch(s), {headline}; nothing to resume" in _said(lambda: say_finished(folder))

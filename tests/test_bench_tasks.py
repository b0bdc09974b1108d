"""ddp-bench measures detection, segmentation, pose and obb models: each cell times the task's own training step and
its data-free ceiling on the task's own batches, time_to_model races Ultralytics' trainer of that task and compares
the task's own mAP beside the box one, and a task it does not measure (classification) is refused in one line before
anything runs. (DataParallel's gathered loss for each task: tests/test_dp.py.)"""

from __future__ import annotations

import json

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from launcher.bench import bench_tasks, report
from launcher.bench import time_to_model_report as ttr
from launcher.bench.ddp_bench import run_bench
from launcher.problems import PlanError
from launcher.rank.run.runs import batch_labels
from tests.conftest import CONF, TINY, ddp_launch
from tests.test_time_to_model import side


def bench_config(overrides: list[str]) -> dict:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return OmegaConf.to_container(compose("bench", overrides=overrides), resolve=True)


# --- which models it takes --------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", [["model=custom", "model.cfg=yolov8n-cls.yaml"],
                                   ["model=checkpoint", "model.weights=yolo11n-cls.pt"]])
def test_a_classification_model_is_refused_in_one_line_before_anything_runs(model, tmp_path):
    cfg = bench_config([*model, "gpus=0", "bench.sizes=[1]", "bench.modes=[single]"])
    with pytest.raises(PlanError) as e:
        run_bench(cfg, tmp_path / "run", tmp_path, "ddp-bench")
    assert len(e.value.problems) == 1, e.value.problems
    said = e.value.problems[0].message
    assert "is a classification model, and ddp-bench measures detection, segmentation, pose and obb models" in said
    assert "yolo classify train" in said and "\n" not in said
    assert not (tmp_path / "run").exists()


def test_it_measures_every_task_ddp_launch_trains_each_baseline_its_task_trainer():
    from ultralytics import YOLO

    for arch in ("yolov8n.yaml", "yolov8n-seg.yaml", "yolov8n-pose.yaml", "yolov8n-obb.yaml", None):
        assert bench_tasks.refusal(arch) is None
    for task in bench_tasks.MEASURED:  # the names the reports print are the classes YOLO(model).train runs
        assert YOLO.task_map.fget(None)[task]["trainer"].__name__ == bench_tasks.trainer(task)


def test_a_setting_the_task_lacks_is_refused_before_any_cell_runs(tmp_path, cache_dir):
    cfg = bench_config(["model=custom", "model.cfg=yolov8n-seg.yaml", "gpus=0", "bench.sizes=[1]",
                        "bench.modes=[single]", "loader.augment_on=gpu", "data=shapes", *TINY])
    with pytest.raises(PlanError, match="loader.augment_on=gpu with a segment model"):
        run_bench(cfg, tmp_path / "run", tmp_path, "ddp-bench")
    assert not (tmp_path / "run" / "cells").exists()


def test_a_model_that_does_not_fit_the_data_is_refused_as_ddp_launch_refuses_it(tmp_path, cache_dir):
    from tests.test_data_check import box_dataset

    data = box_dataset(tmp_path / "ds")
    cfg = bench_config(["model=custom", "model.cfg=yolov8n-pose.yaml", "data=custom", f"data.path={data}", "gpus=0",
                        "+experiment=time_to_model", "dry_run=true"])
    with pytest.raises(PlanError, match="yolov8n-pose.yaml is a pose model, and the data YAML has no kpt_shape"):
        run_bench(cfg, tmp_path / "run", tmp_path, "ddp-bench")


# --- throughput: the task's step, its ceiling on its own batches ---------------------------------------------------
def test_the_ceiling_batches_are_named_by_what_their_targets_hold():
    boxes = {"bboxes": torch.zeros(3, 4)}
    assert batch_labels(boxes) == ["boxes"]
    assert batch_labels({**boxes, "masks": torch.zeros(2, 16, 16)}) == ["boxes", "masks"]
    assert batch_labels({**boxes, "keypoints": torch.zeros(3, 4, 3)}) == ["boxes", "keypoints"]
    assert batch_labels({"bboxes": torch.zeros(3, 5)}) == ["rotated boxes"]


def test_the_throughput_report_names_the_task_and_what_its_ceiling_held():
    cell = {**report.aggregate("single", 1, [{"images_per_s": 10.0, "data_wait": 0.0, "steps_measured": 5,
                                              "step_ms": 400.0, "ceiling_images_per_s": 12.0,
                                              "ceiling_labels": ["boxes", "keypoints"]}]), "verdict": "fed"}
    report.add_speedups([cell])
    env = {"gpus": [], "torch": "2", "cpu_count": 2, "python": "3.11"}
    md = report.markdown({"command": "ddp-bench", "task": "pose", "cells": [cell], "environment": env,
                          "settings": {"warmup_steps": 1, "steps": 5}})
    assert "Task: pose; each cell times its training step (its loss on its own batches), and the data-free " \
           "ceiling's batches hold its boxes, keypoints." in md


@pytest.mark.slow
def test_a_segmentation_cell_on_the_cpu_reports_images_per_s_and_a_ceiling_on_its_masks(tmp_path, cache_dir):
    out = tmp_path / "b"
    args = ["model=yolov8n-seg.yaml", "gpus=0", "bench.sizes=[1]", "bench.modes=[single]", "data=shapes", *TINY,
            "data.synthetic.train_images=32", "data.synthetic.val_images=8", "train.batch_per_device=4",
            "bench.warmup_steps=2", "bench.steps=4", "bench.repeats=1", "bench.ceiling_batches=2",
            "loader.workers=1", f"hydra.run.dir={out}"]
    result = ddp_launch(args, cwd=tmp_path, timeout=300, tool="ddp-bench")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "ddp-bench: 1 cell(s), task segment, on" in result.stdout
    data = json.loads((out / "bench.json").read_text())
    assert data["task"] == "segment"
    [c] = data["cells"]
    assert c["images_per_s"] > 0 and c["ceiling_images_per_s"] > 0 and c["steps_measured"] == 4
    assert c["ceiling_labels"] == ["boxes", "masks"]  # the task's own collated batches, masks included
    assert json.loads((out / "cells" / "single-1" / "cell.json").read_text())["task"] == "segment"
    md = (out / "bench.md").read_text()
    assert "Task: segment;" in md and "ceiling's batches hold its boxes, masks" in md
    assert f"| {c['images_per_s']:.1f} |" in md and f"| {c['ceiling_images_per_s']:.1f} |" in md


# --- time_to_model: Ultralytics' trainer of the task, the task's own mAP -----------------------------------------
def test_the_time_to_model_dry_run_of_a_pose_model_races_ultralytics_pose_trainer(tmp_path, capsys, cache_dir):
    cfg = bench_config(["+experiment=time_to_model", "model=custom", "model.cfg=yolov8n-pose.yaml", "data=shapes",
                        "gpus=0", "dry_run=true", "bench.seeds=[0]"])
    assert run_bench(cfg, tmp_path / "run", tmp_path, "ddp-bench") == 0
    out = capsys.readouterr().out
    assert "2 run(s), task pose, on the CPU" in out
    assert "Ultralytics' side is its PoseTrainer, each side's quality its pose mAP50-95" in out
    line = next(x for x in out.splitlines() if x.strip().startswith("ultralytics seed 0:"))
    assert "Ultralytics' PoseTrainer: YOLO('yolov8n-pose.yaml', task='pose').train(" in line
    assert "'task': 'pose'" in line
    assert "dry run: nothing started" in out and not (tmp_path / "run").exists()


def _seg(name: str, seed: int, wall: float, box: float, mask: float, wait: float) -> dict:
    return {**side(name, seed, wall, box, wait), "quality": mask}


def test_a_segmentation_race_is_judged_on_the_mask_map_with_the_box_map_beside_it(tmp_path):
    sides = [_seg("ultralytics", 0, 100.0, 0.80, 0.70, 0.30), _seg("ddp_launch", 0, 40.0, 0.78, 0.705, 0.02)]
    out = ttr.summarize(sides, task="segment")
    assert out["quality_diff"] == pytest.approx(0.005) and out["map50_95_diff"] == pytest.approx(-0.02)
    v = out["verdict"]
    assert v["same_map"] is True and v["met"] is True  # the masks' within tolerance; the boxes' not the criterion
    assert "mask mAP50-95 +0.0050 (within 0.01), box mAP50-95 -0.0200" in v["text"]
    out.update(kind="time_to_model", command="ddp-bench", environment={
        "gpus": [], "torch": "2", "cpu_count": 2, "python": "3.11"}, settings={
        "model": "yolov8n-seg.yaml", "task": "segment", "data": {"train_images": 8, "val_images": 4,
                                                                 "mean_train_file_kb": 3.0},
        "imgsz": 64, "epochs": 1, "batch": 4, "lr0": 0.01, "close_mosaic": 0, "device": "CPU", "seeds": [0]})
    ttr.write(out, tmp_path)
    md = (tmp_path / "bench.md").read_text()
    assert "Task segment: Ultralytics' side runs its SegmentationTrainer, and the sides are compared on the mask " \
           "mAP50-95, the box one beside it." in md
    assert "| mAP50 | mAP50-95 | mask mAP50-95 | data wait |" in md
    assert "| 0.9000 | 0.8000 | 0.7000 | 30.0 % |" in md  # Ultralytics' run: box mAP50-95, then the masks'


@pytest.mark.parametrize("task, words", [("obb", "box mAP50-95 (rotated boxes) +0.0000"),
                                         ("detect", "mAP50-95 +0.0000")])
def test_detection_and_obb_races_are_judged_on_the_box_map(task, words):
    sides = [side("ultralytics", 0, 100.0, 0.5, 0.3), side("ddp_launch", 0, 50.0, 0.5, 0.02)]
    v = ttr.summarize(sides, task=task)["verdict"]
    assert f"{words} (within 0.01)" in v["text"] and "box mAP50-95 +" not in v["text"].replace(words, "")


def test_the_label_scan_before_the_timed_sides_writes_the_cache_a_pose_side_reads(tmp_path):
    """The scan reads keypoints for a pose model: the cache it writes is the one the pose sides load, not one they
    would write again (its hash holds whether keypoints were read) inside their timed start-up."""
    import numpy as np
    from ultralytics.data import YOLODataset
    from ultralytics.data.utils import check_det_dataset

    from launcher.inputs import shapes
    from launcher.rank.ultralytics.time_to_model_ultralytics import scan

    spec = shapes.ShapesSpec(train_images=4, val_images=2, width=64, height=64, task="pose")
    data_yaml = shapes.ensure_dataset(tmp_path, spec, workers=1, log=lambda _: None)
    scan(str(data_yaml), "pose")
    cache = next(tmp_path.rglob("labels/train.cache"))
    written = cache.stat().st_mtime_ns
    labels = np.load(cache, allow_pickle=True).item()["labels"]
    assert len(labels) == 4 and all(lb["keypoints"].shape[1:] == (4, 3) for lb in labels)
    data = check_det_dataset(str(data_yaml))
    YOLODataset(img_path=data["train"], data=data, task="pose", augment=False)  # as the pose side opens it
    assert cache.stat().st_mtime_ns == written

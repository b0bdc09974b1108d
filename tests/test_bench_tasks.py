"""ddp-bench measures detection, segmentation, pose, obb and classification models: each cell times the task's own
training step and its data-free ceiling on the task's own batches, time_to_model races Ultralytics' trainer of that
task and compares the task's own metric (its mAP beside the box one; a classifier's top-1 accuracy, on its class
folders), and a task it does not measure (depth) is refused in one line before anything runs. (DataParallel's
gathered loss for each task: tests/test_dp.py.)"""

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
def test_a_model_of_a_task_it_does_not_measure_is_refused_in_one_line_before_anything_runs(tmp_path):
    depth = tmp_path / "depth-net.yaml"  # a depth head: a task neither ddp-launch nor ddp-bench takes
    depth.write_text("nc: 1\nbackbone:\n  - [-1, 1, Conv, [16, 3, 2]]\nhead:\n  - [-1, 1, Depth, [nc]]\n")
    cfg = bench_config(["model=custom", f"model.cfg={depth}", "gpus=0", "bench.sizes=[1]", "bench.modes=[single]"])
    with pytest.raises(PlanError) as e:
        run_bench(cfg, tmp_path / "run", tmp_path, "ddp-bench")
    assert len(e.value.problems) == 1, e.value.problems
    said = e.value.problems[0].message
    assert "is a depth model, and ddp-bench measures detection, segmentation, pose, obb and classification" in said
    assert "yolo depth train" in said and "\n" not in said
    assert not (tmp_path / "run").exists()


def test_it_measures_every_task_ddp_launch_trains_each_baseline_its_task_trainer():
    from ultralytics import YOLO

    from launcher.inputs.model_task import TRAINED

    assert set(bench_tasks.MEASURED) == set(TRAINED)
    for arch in ("yolov8n.yaml", "yolov8n-seg.yaml", "yolov8n-pose.yaml", "yolov8n-obb.yaml", "yolov8n-cls.yaml",
                 "yolo11n-cls.pt", None):
        assert bench_tasks.refusal(arch) is None
    for task in bench_tasks.MEASURED:  # the names the reports print are the classes YOLO(model).train runs
        assert YOLO.task_map.fget(None)[task]["trainer"].__name__ == bench_tasks.trainer(task)


def test_a_setting_the_task_lacks_is_refused_before_any_cell_runs(tmp_path, cache_dir):
    cfg = bench_config(["model=custom", "model.cfg=yolov8n-cls.yaml", "gpus=0", "bench.sizes=[1]",
                        "bench.modes=[single]", "val.engine=fast", "data=shapes", *TINY])
    with pytest.raises(PlanError, match="val.engine=fast with a classify model"):
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
    assert batch_labels({"img": torch.zeros(2, 3, 8, 8), "cls": torch.zeros(2)}) == ["classes"]  # a classifier's


@pytest.mark.parametrize("task, held", [("pose", ["boxes", "keypoints"]), ("classify", ["classes"])])
def test_the_throughput_report_names_the_task_and_what_its_ceiling_held(task, held):
    cell = {**report.aggregate("single", 1, [{"images_per_s": 10.0, "data_wait": 0.0, "steps_measured": 5,
                                              "step_ms": 400.0, "ceiling_images_per_s": 12.0,
                                              "ceiling_labels": held}]), "verdict": "fed"}
    report.add_speedups([cell])
    env = {"gpus": [], "torch": "2", "cpu_count": 2, "python": "3.11"}
    md = report.markdown({"command": "ddp-bench", "task": task, "cells": [cell], "environment": env,
                          "settings": {"warmup_steps": 1, "steps": 5}})
    assert f"Task: {task}; each cell times its training step (its loss on its own batches), and the data-free " \
           f"ceiling's batches hold its {', '.join(held)}." in md


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
@pytest.mark.parametrize("model, task, trainer, words", [
    ("yolov8n-pose.yaml", "pose", "PoseTrainer", "pose mAP50-95"),
    ("yolov8n-cls.yaml", "classify", "ClassificationTrainer", "top-1 accuracy")])
def test_the_time_to_model_dry_run_races_ultralytics_trainer_of_the_task(model, task, trainer, words, tmp_path,
                                                                          capsys, cache_dir):
    cfg = bench_config(["+experiment=time_to_model", "model=custom", f"model.cfg={model}", "data=shapes",
                        "gpus=0", "dry_run=true", "bench.seeds=[0]"])
    assert run_bench(cfg, tmp_path / "run", tmp_path, "ddp-bench") == 0
    out = capsys.readouterr().out
    assert f"2 run(s), task {task}, on the CPU" in out
    assert f"Ultralytics' side is its {trainer}, each side's quality its {words}" in out
    line = next(x for x in out.splitlines() if x.strip().startswith("ultralytics seed 0:"))
    ours = next(x for x in out.splitlines() if x.strip().startswith("ddp_launch seed 0:"))
    assert f"Ultralytics' {trainer}: YOLO('{model}', task='{task}').train(" in line and f"'task': '{task}'" in line
    # both sides read the same data: a data YAML written for them; a classifier's class folders as given
    data = line.split("'data': '")[1].split("'")[0]
    assert f"data.path={data} " in ours
    assert data.endswith("data.yaml") != (task == "classify") and (task != "classify" or "/shapes-" in data)
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


def _cls(name: str, seed: int, wall: float, top1: float, wait: float) -> dict:
    """A classifier's side as run_side records it: its top-1 accuracy, no box mAP."""
    return {**side(name, seed, wall, 0.0, wait), "map50": None, "map50_95": None, "quality": top1}


def test_a_classifier_side_records_its_top1_as_its_quality_and_no_box_map(tmp_path, monkeypatch):
    """run_side on a finished ddp-launch side whose summary.json is a classifier's (its mAP fields 0)."""
    from launcher.bench import time_to_model as ttm
    from tests.test_time_to_model import T0, ddp_launch_timeline

    def finished(cmd, **kwargs):  # the side's command, faked: its run folder's summary.json, no signal meanwhile
        run = tmp_path / "side" / "run"
        run.mkdir(parents=True)
        (run / "summary.json").write_text(json.dumps({"map50": 0.0, "map50_95": 0.0, "top1": 0.8125, "top5": 1.0,
                                                      "timeline": ddp_launch_timeline()}))
        return 0, None

    monkeypatch.setattr(ttm, "run_side_process", finished)
    monkeypatch.setattr(ttm.time, "time", lambda: T0)
    cfg = bench_config(["+experiment=time_to_model", "model=custom", "model.cfg=yolov8n-cls.yaml", "gpus=0"])
    record = ttm.run_side("ddp_launch", 0, tmp_path / "side", cfg, None, tmp_path / "folders", False, {},
                          task="classify")
    assert record["quality"] == 0.8125 and record["map50"] is None and record["map50_95"] is None
    assert "data.path=" + str(tmp_path / "folders") in record["command_line"]


def test_a_classification_race_is_judged_on_the_top1_accuracy_with_no_box_map(tmp_path):
    assert bench_tasks.quality("classify") == ("top1", "top-1 accuracy")  # the key summary.json and result.json hold
    sides = [_cls("ultralytics", 0, 100.0, 0.90, 0.30), _cls("ddp_launch", 0, 40.0, 0.875, 0.02)]
    out = ttr.summarize(sides, task="classify")
    assert out["quality_diff"] == pytest.approx(-0.025) and out["map50_95_diff"] is None
    v = out["verdict"]
    assert v["same_map"] is False and v["met"] is False  # 2.5 points of top-1 lost: outside the tolerance
    assert "top-1 accuracy -0.0250 (outside 0.01)." in v["text"] and "box mAP50-95" not in v["text"]
    out.update(kind="time_to_model", command="ddp-bench", environment={
        "gpus": [], "torch": "2", "cpu_count": 2, "python": "3.11"}, settings={
        "model": "yolov8n-cls.yaml", "task": "classify", "data": {"train_images": 8, "val_images": 4,
                                                                  "mean_train_file_kb": 3.0},
        "imgsz": 64, "epochs": 1, "batch": 4, "lr0": 0.01, "close_mosaic": 0, "device": "CPU", "seeds": [0]},
        variants={"w4": {"overrides": ["loader.workers=4"], "wall_s": 30.0, "map50_95": None, "quality": 0.9,
                         "vs_defaults": 1.3, "vs_ultralytics": 3.3}})
    ttr.write(out, tmp_path)
    md = (tmp_path / "bench.md").read_text()
    assert "Task classify: Ultralytics' side runs its ClassificationTrainer, and the sides are compared on the " \
           "top-1 accuracy." in md
    assert "lr0 0.01, validation after every epoch" in md and "close_mosaic" not in md  # a classifier has no mosaic
    assert "| mAP50 | mAP50-95 | top-1 accuracy | data wait |" in md
    assert "| - | - | 0.9000 | 30.0 % |" in md  # Ultralytics' run: no box mAP, its top-1
    assert "30.0 s, top-1 accuracy 0.9000; the defaults'" in md  # a variant's line names the metric compared


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


def test_the_scan_before_the_timed_sides_writes_the_split_caches_a_classifier_side_reads(tmp_path):
    """A classifier's sides read the class folders: the scan writes each split's *.cache (ClassificationDataset's),
    which the sides then load, not write again inside their timed start-up."""
    from ultralytics.cfg import get_cfg
    from ultralytics.data import ClassificationDataset

    from launcher.inputs import shapes
    from launcher.rank.ultralytics.time_to_model_ultralytics import scan

    spec = shapes.ShapesSpec(train_images=6, val_images=3, width=32, height=32, task="classify")
    folder = shapes.ensure_dataset(tmp_path, spec, workers=1, log=lambda _: None).parent
    scan(str(folder), "classify")
    caches = {split: folder / f"{split}.cache" for split in ("train", "val")}
    written = {split: c.stat().st_mtime_ns for split, c in caches.items()}
    ClassificationDataset(root=str(folder / "train"), args=get_cfg(), augment=True, prefix="train")  # as a side
    assert {split: c.stat().st_mtime_ns for split, c in caches.items()} == written

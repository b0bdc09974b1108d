"""A segmentation, a pose, an obb and a classification model trained end to end on two CPU ranks (gloo) through the
real `ddp-launch`: the README's command for each, shorter and smaller, on the synthetic shapes labelled for their task
(polygons, four keypoints, rotated boxes, class folders): Ultralytics' pipeline, loss and validator of the task (the
segmentation, pose and obb runs' input on the GPU pipeline, run on the CPU: the polygons warped and flipped, boxes and
masks made from them; the keypoints warped and flipped with their boxes; the corners warped, clipped as rotated boxes
and flipped), a metric above zero (a classifier's top-1 above chance), and a best.pt that Ultralytics loads as that
task. The pose and segmentation runs validate with the fast validator (their default: keypoints matched by OKS,
masks made from the prototypes and matched by IoU), each sharded over the two ranks and gathered; the others with
Ultralytics' validator of their task."""

from __future__ import annotations

import csv
import json
import shlex

import pytest

from tests.conftest import ddp_launch, run_dir_of
from tests.test_readme import readme_commands

pytestmark = [pytest.mark.slow, pytest.mark.dist]

# small and short, yet learning: one or two shapes per 96 px image, no mosaic (it would shrink them), a brisk
# unscaled lr after one epoch of warmup, validated every fourth epoch, no plots
SHORT = ["data.synthetic.train_images=128", "data.synthetic.val_images=16", "data.synthetic.width=96",
         "data.synthetic.height=96", "data.synthetic.max_objects=2", "train.imgsz=96", "train.batch_per_device=8",
         "train.epochs=8", "train.close_mosaic=8", "train.val_interval=4", "train.plots=false",
         "log.interval_steps=8", "optim.base_lr=0.02", "optim.lr_scaling=none", "optim.warmup_epochs=1"]
# a classifier: one shape per 32 px image in class folders, 8 epochs at AdamW's lr (Ultralytics' pick for a short
# classification run), validated every fourth epoch, no plots
CLASSIFY = ["data.synthetic.train_images=96", "data.synthetic.val_images=24", "data.synthetic.width=32",
            "data.synthetic.height=32", "train.imgsz=32", "train.batch_per_device=8", "train.epochs=8",
            "train.val_interval=4", "train.plots=false", "log.interval_steps=8", "optim.name=adamw",
            "optim.base_lr=0.002", "optim.lr_scaling=none", "optim.warmup_epochs=1"]
# the model, the task's loss term and metrics (Ultralytics' names), summary.json's name for its mAP (top-1)
CASES = {"segment": ("yolov8n-seg.yaml", "train/seg_loss", "metrics/mAP50-95(M)", "map50_mask"),
         "pose": ("yolov8n-pose.yaml", "train/pose_loss", "metrics/mAP50-95(P)", "map50_pose"),
         "obb": ("yolov8n-obb.yaml", "train/box_loss", "metrics/mAP50-95(B)", "map50"),  # B: the rotated boxes'
         "classify": ("yolov8n-cls.yaml", "train/loss", "metrics/accuracy_top1", "top1")}
FINAL = {"segment": "mask mAP50 {:.4f}", "pose": "pose mAP50 {:.4f}", "obb": "mAP50 {:.4f}",  # the final lines
         "classify": "top-1 {:.4f}"}
INPUT = {task: ["loader.augment_on=gpu"] for task in ("pose", "segment", "obb")}  # not the CPU pipeline
PATHS = {"pose": "; the GPU input pipeline (keypoints warped and flipped with their boxes)",  # the plan's task line
         "segment": "; the GPU input pipeline (polygons warped and flipped, boxes made from them, masks drawn",
         "obb": "; the GPU input pipeline (corners warped, clipped as rotated boxes and flipped)"}
# a classifier's run on its own GPU input too (rank/gpu_data/classify_input.py: Ultralytics' classify transforms)
INPUT["classify"] = ["loader.augment_on=gpu"]
PATHS["pose"] += ", Ultralytics' loss, the fast validator (keypoints matched by OKS"
PATHS["segment"] += " on the device), Ultralytics' loss, the fast validator (masks made and matched"
PATHS["classify"] = "; the GPU input pipeline (class folders decoded and augmented on the device"
ABOVE = {"classify": 0.5}  # the metric's floor: a classifier's top-1 above chance (a third), the mAPs above zero


@pytest.fixture(scope="module", params=list(CASES))
def trained(request, tmp_path_factory, cache_dir):
    task = request.param
    command = next(c for c in readme_commands("ddp-launch") if f"model={CASES[task][0]}" in c)
    short = CLASSIFY if task == "classify" else SHORT
    result = ddp_launch([*shlex.split(command)[1:], *short, *INPUT.get(task, [])], cwd=tmp_path_factory.mktemp(task))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return task, result, run_dir_of(result)


def test_each_task_trains_on_two_ranks_its_loss_falling_to_a_metric_above_zero(trained):
    task, result, run_dir = trained
    model, loss, column, metric = CASES[task]
    assert f"task            {task} (from {model}){PATHS.get(task, '')}" in result.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["task"] == task and summary["world_size"] == 2 and summary["ranks_params_identical"] is True
    # from scratch in 64 steps: mAPs of a few thousandths, but above zero (the boxes', or the masks' or keypoints')
    assert max(summary["map50"], summary[metric]) > ABOVE.get(task, 0), summary
    assert FINAL[task].format(summary[metric]) in result.stdout  # the final lines name it
    assert (task == "obb") == ("(rotated boxes)" in result.stdout)
    with (run_dir / "results.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 8 and column in rows[0]  # the task's own metrics beside the boxes', per epoch
    if task in INPUT:  # the targets the GPU input made were learned: their mAP above zero at a validation
        own = column.replace("mAP50-95", "mAP50")
        assert max(float(r[own]) for r in rows if r[own] != "nan") > 0, rows
    assert float(rows[-1][loss]) < 0.7 * float(rows[0][loss])  # the mask or keypoint term learned


def test_best_pt_loads_in_ultralytics_as_its_task(trained):
    from ultralytics import YOLO
    from ultralytics.nn.tasks import ClassificationModel, OBBModel, PoseModel, SegmentationModel

    task, _, run_dir = trained
    model = YOLO(str(run_dir / "weights" / "best.pt"))
    assert model.task == task
    assert type(model.model) is {"segment": SegmentationModel, "pose": PoseModel, "obb": OBBModel,
                                  "classify": ClassificationModel}[task]

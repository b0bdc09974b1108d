"""Which tasks ddp-bench measures, and what each compares: the one place a model's task is let into the benchmark (or
refused), the Ultralytics trainer its baselines run, and the validation metric its time_to_model report names (the
task's record: plan/task_rules.py TaskRules.quality).

A throughput cell of any of these tasks is the task's own training step (its loss, and its pipeline: masks, keypoints
or rotated boxes collated by Ultralytics, a classifier's class folders), and its data-free ceiling is that step on
batches of the same loader held on the device (rank/run/runs.py, bench_cell). DataParallel runs every one of them: the
loss is taken on the predictions gathered from the replicas, which equals the whole batch's (tests/test_dp.py).
"""

from __future__ import annotations

from pathlib import Path

from launcher.inputs.model_task import WORDS, model_task
from launcher.plan.task_rules import rules

MEASURED = ("detect", "segment", "pose", "obb", "classify")  # a task ddp-launch trains joins once its cell is measured
# Ultralytics' trainer of each task (ultralytics.models.yolo.<task>): what YOLO(model).train runs for the baselines
TRAINERS = {"detect": "DetectionTrainer", "segment": "SegmentationTrainer", "pose": "PoseTrainer",
            "obb": "OBBTrainer", "classify": "ClassificationTrainer"}


def arch_of(model_cfg: dict) -> str | None:
    """The model as typed (model.cfg, else model.weights): what its task is read from before the files are resolved."""
    value = model_cfg.get("cfg") or model_cfg.get("weights")
    return str(value) if value else None


def refusal(arch: str | None) -> str | None:
    """One line refusing a model whose task ddp-bench does not measure; None for one it measures, or where the task
    cannot be told (a detection model, as ddp-launch takes it)."""
    task = model_task(arch)
    if task is None or task in MEASURED:
        return None
    word = WORDS.get(task, task)
    return (f"model: {Path(str(arch)).name} is a {word} model, and ddp-bench measures detection, segmentation, pose, "
            f"obb and classification models (a {word} cell's step and ceiling are not built); benchmark one of those "
            f"(model=yolov8n-seg.yaml), or time Ultralytics' own trainer for this one: yolo {task} train model=... "
            "data=...")


def trainer(task: str) -> str:
    """Ultralytics' trainer class for `task`, as the baselines run it (YOLO(model, task=task).train)."""
    return TRAINERS[task]


def quality(task: str) -> tuple[str, str]:
    """(summary.json's key of the metric time_to_model compares the sides on, its words): the task's own mAP50-95
    (the box one's for detection and obb), a classifier's top-1 accuracy."""
    q = rules(task).quality
    return q.key, q.words

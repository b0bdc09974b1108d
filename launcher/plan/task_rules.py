"""What the task a run trains (inputs/model_task.py) changes in the plan.

Detection has ddp-launch's fast paths: the input augmented on the GPU, the fast validation engine, the whole step
captured as one CUDA graph, the auto batch's probe. Segmentation, pose and obb train through Ultralytics' own
pipeline (its transforms warp polygons, keypoints and corners), its validator (masks, keypoints and rotated boxes
scored as it scores them) and its loss, normalised over the ranks but eager (its mask, keypoint and rotated-box
terms have shapes that follow the targets); the network alone is graphed on GPUs. Classification trains on
Ultralytics' ClassificationDataset (class folders, its own augmentations; no mosaic: close_mosaic and the mosaic
buffer mean nothing there), its ClassificationValidator (top-1, top-5) and its cross-entropy, a mean over the batch.
`auto` settings resolve to those paths; a setting that asks for a fast path the task lacks is refused here.
"""

from __future__ import annotations

from launcher.problems import Problem

FAST_PATHS = ("detect",)  # the tasks with the GPU input, the fast validator, the captured step and the auto batch
MEAN_LOSS = ("classify",)  # the tasks whose Ultralytics loss is a mean over the batch, not a sum over its images
WHAT = {"classify": "class folders (Ultralytics' ClassificationDataset)"}  # what a task's input is, where not boxes


def has_fast_paths(task: str) -> bool:
    return task in FAST_PATHS


def has_mosaic(task: str) -> bool:
    """Whether the task's training set has Ultralytics' mosaic (and so close_mosaic): classification's has not."""
    return task != "classify"


def loss_base(task: str, base_batch: int) -> int:
    """The batch the step's loss scale aims at (plan/lr.py loss_scale): base_batch for the losses Ultralytics sums
    over the batch's images (its lr0 meant at nbs images), 1 for a mean loss (classify: the step then takes the
    gradient of the mean over the global batch, Ultralytics' classification step at a batch of nbs)."""
    return 1 if task in MEAN_LOSS else base_batch


def task_problems(cfg: dict, task: str, *, device: str) -> list[Problem]:
    """The settings that ask for a path `task` does not have, each with what to set instead."""
    if has_fast_paths(task):
        return []
    train, loader, val = cfg["train"], cfg.get("loader") or {}, cfg.get("val") or {}
    problems = []
    if loader.get("augment_on") == "gpu":
        takes = f"a {task} model takes {WHAT[task]}" if task in WHAT else "not masks, keypoints or corners"
        problems.append(Problem(f"loader.augment_on=gpu with a {task} model: the GPU input pipeline augments upright "
                                f"boxes only ({takes}); use loader.augment_on=cpu (or auto)"))
    if val.get("engine") == "fast":
        problems.append(Problem(f"val.engine=fast with a {task} model: the fast engine scores upright boxes only; use "
                                "val.engine=ultralytics (or auto)"))
    if train.get("batch_per_device") == "auto" and device == "cuda":
        problems.append(Problem(f"train.batch_per_device=auto with a {task} model: the probe measures the detection "
                                "step only; give train.batch_per_device as a number"))
    if task == "classify" and train.get("cache") == "shared":
        problems.append(Problem("train.cache=shared with a classify model: the node's shared cache holds the detection "
                                "datasets' images; use train.cache=ram or disk (Ultralytics' ClassificationDataset "
                                "caches), or false"))
    extra = train.get("extra") or {}
    if task == "classify" and extra.get("multi_scale"):
        problems.append(Problem("train.extra.multi_scale with a classify model: Ultralytics' classification trainer "
                                "trains at imgsz alone (its crops are imgsz square); leave multi_scale off"))
    accumulate = train.get("accumulate", 1)
    if task == "segment" and extra.get("overlap_mask") is False and isinstance(accumulate, int) and accumulate > 1:
        problems.append(Problem("train.extra.overlap_mask=false with train.accumulate > 1: the micro-batches split "
                                "masks per image; leave overlap_mask at true, or train.accumulate=1"))
    return problems


def task_text(task: str, task_from: str | None) -> str:
    """The plan's task line: the task, what it was read from, and the paths it takes."""
    source = f" (from {task_from})" if task_from else ""
    if has_fast_paths(task):
        return f"{task}{source}"
    if task == "classify":
        return (f"{task}{source}; Ultralytics' CPU pipeline (ClassificationDataset on class folders), "
                "ClassificationValidator (top-1, top-5) and cross-entropy loss (the GPU input, the fast validator and "
                "the captured step are detection's)")
    return (f"{task}{source}; Ultralytics' CPU pipeline, validator and loss (the GPU input, the fast validator and "
            "the captured step are detection's)")

"""The task a model trains for (detect, segment, pose, obb, classify, ...), read as Ultralytics' guess_model_task
reads it: from the architecture YAML's last head module, or from the file name (-seg, -pose, -obb, -cls) where no
YAML can be read. ddp-launch trains detectors; any other task is refused in the plan, before a process starts,
instead of training its box head alone and leaving a model that looks trained."""

from __future__ import annotations

from pathlib import Path

import yaml

from launcher.inputs import ultralytics_files

TRAINED = "detect"
NAME_TASKS = (("-seg", "segment"), ("-pose", "pose"), ("-obb", "obb"), ("-cls", "classify"))
WORDS = {"segment": "segmentation", "semantic": "semantic segmentation", "pose": "pose", "obb": "rotated-box (obb)",
         "classify": "classification", "depth": "depth"}


def head_task(head: str) -> str | None:
    """Ultralytics' cfg2task on the last head module's name."""
    m = head.lower()
    if m in {"classify", "classifier", "cls", "fc"}:
        return "classify"
    for key, task in (("detect", "detect"), ("semanticsegment", "semantic"), ("segment", "segment"),
                      ("pose", "pose"), ("obb", "obb"), ("depth", "depth")):
        if key in m:
            return task
    return None


def model_task(arch: str | None) -> str | None:
    """The task of the architecture `arch` (a YAML path, a shipped YAML name or a checkpoint's YAML file name);
    None where neither its YAML nor its name tells."""
    if not arch:
        return None
    path = Path(arch)
    found = None
    if path.suffix in (".yaml", ".yml"):
        found = path if path.is_file() else ultralytics_files.find_model_yaml(path.name)
    if found is not None:
        try:
            head = (yaml.safe_load(found.read_text()) or {}).get("head") or []
            task = head_task(str(head[-1][-2])) if head and len(head[-1]) >= 3 else None
        except (OSError, ValueError, yaml.YAMLError, TypeError, IndexError, AttributeError):
            task = None
        if task:
            return task
    stem = path.stem.lower()
    return next((task for key, task in NAME_TASKS if key in stem), None)


def task_problem(arch: str | None, key: str) -> str | None:
    """One line refusing a model of another task than detection (`key`: the setting that named it); None for a
    detector or where the task cannot be told."""
    task = model_task(arch)
    if task is None or task == TRAINED:
        return None
    name, word = Path(str(arch)).name, WORDS.get(task, task)
    return (f"{key}: {name} is a {word} model, and ddp-launch trains detection models only ({word} is not built yet; "
            "training its box head alone would give a model that only looks trained). Use a detection model "
            f"(model=yolo11n.pt, model=yolov8s.yaml), or Ultralytics' own trainer for this one: yolo {task} train "
            "model=... data=... device=0,1")

"""The task a run trains (detect, segment, pose, obb, classify), decided from the model and the dataset before any
process starts.

The model's task is read as Ultralytics' guess_model_task reads it: from the architecture YAML's last head module,
or from the file name (-seg, -pose, -obb, -cls) where no YAML can be read. The dataset must fit it: a data YAML with
`kpt_shape` holds keypoints, which only a pose model trains on, and a pose model needs one. Segmentation labels are
polygons, which the data YAML does not say: the model decides. Rotated boxes (obb) are rows of a class and four
corners, which the label check counts (labels.py, `forms`): an obb model refuses box rows (class x y w h), which
have no corners, and a detection model refuses labels that are all corners (it would train the upright boxes
around them). A classification model trains on class folders (inputs/class_folders.py: data=path/to/folder, as
Ultralytics' data= for classify) and only on them: a data YAML of labels is refused for it, and class folders for
any other model. Semantic segmentation and depth models are refused: ddp-launch does not train those tasks.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from launcher.inputs import class_folders, labels, ultralytics_files

DETECT = "detect"
# the tasks ddp-launch trains (rank/ultralytics/tasks.py builds each)
TRAINED = ("detect", "segment", "pose", "obb", "classify")
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
    """One line refusing a model of a task ddp-launch does not train (semantic segmentation, depth; `key`: the
    setting that named it); None for detection, segmentation, pose, obb and classification models, and where the
    task cannot be told."""
    task = model_task(arch)
    if task is None or task in TRAINED:
        return None
    name, word = Path(str(arch)).name, WORDS.get(task, task)
    return (f"{key}: {name} is a {word} model; ddp-launch trains detection, segmentation, pose, obb and "
            f"classification models ({word} is not among them: its data, loss and validator are not wired into the "
            "ranks). Use one of those (model=yolo11n.pt, model=yolov8n-seg.yaml, model=yolo11n-cls.yaml), or "
            f"Ultralytics' own trainer for this one: yolo {task} train model=... data=... device=0,1")


def run_task(arch: str | None, data_spec: dict | None, key: str,
             checks: dict | None = None) -> tuple[str, list[str]]:
    """(the task the run trains, problems): the model's task (detect where it cannot be told), refused where the
    dataset does not fit it (class folders for a classifier and for it alone: _folders; `data_spec`: the data YAML as
    the ranks get it; `checks`: its splits' label checks, labels.SplitCheck.to_dict; `key`: the setting that named
    the model)."""
    task = model_task(arch) or DETECT
    if task not in TRAINED:
        return task, []  # task_problem words it
    name = Path(str(arch)).name
    folders = _folders(task, name, key, data_spec)
    if folders or task == "classify":
        return task, folders
    forms = _forms(task, name, key, checks or {})
    if forms:
        return task, forms
    kpt_shape = (data_spec or {}).get("kpt_shape")
    if task == "pose" and not kpt_shape:
        return task, [f"{key}: {name} is a pose model, and the data YAML has no kpt_shape: add `kpt_shape: [K, 3]` "
                      "(K keypoints per object, each x, y, visible; and flip_idx for the horizontal flip) with "
                      "keypoint labels, or train a detection model on this data (model=yolo11n.pt)"]
    if task == "pose":
        return task, _keypoint_problems(kpt_shape, data_spec.get("flip_idx"))
    if kpt_shape:
        return task, [f"{key}: the data YAML has kpt_shape {list(kpt_shape)} (keypoint labels), which only a pose "
                      f"model trains on, and {name} is a {WORDS.get(task, task)} model: use a pose model "
                      "(model=yolov8n-pose.yaml, model=yolo11n-pose.pt), or remove kpt_shape to train boxes only"]
    return task, []


def _folders(task: str, name: str, key: str, data_spec: dict | None) -> list[str]:
    """A classification model on a data YAML of labels, or another model on class folders: one line."""
    if data_spec is None:
        return []
    folders = class_folders.is_class_folders(data_spec)
    if task == "classify" and not folders:
        return [f"{key}: {name} is a classification model, and the data is a data YAML of labels (boxes, polygons or "
                f"keypoints): give it a folder of class folders (data=path/to/folder holding {class_folders.LAYOUT}), "
                "or train a detection model on this data (model=yolo11n.pt)"]
    if task != "classify" and folders:
        return [f"{key}: {name} is a {WORDS.get(task, task)} model, and the data ({data_spec.get('path')}) is class "
                "folders (a classification dataset, no labels): use a classification model (model=yolo11n-cls.yaml, "
                "model=yolov8n-cls.pt), or give a data YAML with labels (data=my.yaml)"]
    return []


def _forms(task: str, name: str, key: str, checks: dict) -> list[str]:
    """An obb model on box rows, or a detection model on rows that are all rotated boxes' corners: one line each."""
    for split, check in checks.items():
        forms = check.get("forms") or {}
        if task == "obb" and forms.get(labels.BOX_ROWS):
            return [f"{key}: {name} is an obb model, and {forms[labels.BOX_ROWS]} {split} image(s) have box label "
                    "rows (class x y w h), which have no corners: give each object a row of its class and four "
                    "corners (class x1 y1 x2 y2 x3 y3 x4 y4, normalised), or train a detection model on this data "
                    "(model=yolo11n.pt)"]
        if task == DETECT and forms.get(labels.OBB_ROWS) and set(forms) == {labels.OBB_ROWS}:
            return [f"{key}: every {split} label row is a class and four corners (Ultralytics' obb labels), and {name} "
                    "is a detection model, which would train on the upright boxes around them: use an obb model "
                    "(model=yolo11n-obb.yaml, model=yolo11n-obb.pt), or write the labels as boxes (class x y w h)"]
    return []


def _keypoint_problems(kpt_shape, flip_idx) -> list[str]:
    """The data YAML's keypoint keys as Ultralytics needs them: kpt_shape [K, 2 or 3], flip_idx K indices (or none:
    Ultralytics then turns the horizontal flip off)."""
    if not (isinstance(kpt_shape, (list, tuple)) and len(kpt_shape) == 2 and all(isinstance(v, int) for v in kpt_shape)
            and kpt_shape[0] > 0 and kpt_shape[1] in (2, 3)):
        return [f"the data YAML's kpt_shape {kpt_shape!r}: expected [K, 2] or [K, 3] (K keypoints per object, each x, "
                "y and, with 3, visible)"]
    if flip_idx is not None and (not isinstance(flip_idx, (list, tuple)) or len(flip_idx) != kpt_shape[0]
                                 or sorted(flip_idx) != list(range(kpt_shape[0]))):
        return [f"the data YAML's flip_idx {flip_idx!r}: expected the {kpt_shape[0]} keypoint indices of kpt_shape "
                "in their mirrored order (each keypoint's partner under a horizontal flip), or no flip_idx"]
    return []


def task_source(arch: str | None) -> str:
    """What the task was read from, for the plan's line: the architecture's file name."""
    return Path(str(arch)).name if arch else "the model"

"""Models of a task ddp-launch does not train (semantic segmentation, depth) are refused in the plan, before anything
starts, by their YAML's head: trained as a detector such a model would only look trained. Detection, segmentation,
pose, obb and classification models pass (tests/test_tasks.py, tests/test_classify.py: the task they train)."""

from __future__ import annotations

import pytest

from launcher.inputs.model_task import model_task
from launcher.inputs.models import resolve_model


@pytest.mark.parametrize("cfg, task", [("yolo26n-sem.yaml", "semantic segmentation"), ("yolo26n-depth.yaml", "depth")])
def test_a_model_of_a_task_ddp_launch_does_not_train_is_refused_with_what_to_use(cfg, task):
    spec, problems = resolve_model({"name": "custom", "cfg": cfg}, base_dir=".")
    assert spec is None and len(problems) == 1
    assert f"is a {task} model" in problems[0] and "is not among them" in problems[0]
    assert "model=yolo11n.pt" in problems[0] and "model=yolo11n-cls.yaml" in problems[0] and "yolo " in problems[0]


def test_detection_segmentation_pose_obb_and_classify_models_and_their_own_yaml_pass(tmp_path):
    for cfg in ("yolov8s.yaml", "yolo11n.yaml", "yolo26n.yaml", "yolov8n-seg.yaml", "yolo11n-pose.yaml", "yolo11s-obb.yaml",
                "yolo11n-cls.yaml", "yolov8s-cls.yaml"):
        spec, problems = resolve_model({"name": "custom", "cfg": cfg}, base_dir=tmp_path)
        assert spec is not None and not problems, problems
    own = tmp_path / "mine.yaml"  # a user's YAML: its head decides, not its name
    own.write_text("nc: 3\nbackbone: [[-1, 1, Conv, [16, 3, 2]]]\nhead: [[[0], 1, Depth, [3]]]\n")
    spec, problems = resolve_model({"name": "custom", "cfg": str(own)}, base_dir=tmp_path)
    assert spec is None and "mine.yaml is a depth model" in problems[0]
    assert model_task("yolo11n-cls.yaml") == "classify"
    assert model_task("yolo11s-obb.yaml") == "obb"
    assert model_task("yolov8n-seg.yaml") == "segment" and model_task("yolov8n.yaml") == "detect"


def test_a_checkpoint_named_for_a_task_it_trains_passes(tmp_path):
    (tmp_path / "yolov8n-cls.pt").write_bytes(b"")
    spec, problems = resolve_model({"name": "custom", "weights": "yolov8n-cls.pt"}, base_dir=tmp_path)
    assert spec is not None and not problems, problems


def test_a_checkpoint_of_another_task_is_refused_by_what_it_holds(tmp_path, cache_dir):
    """A classification checkpoint renamed best.pt on the built-in data labelled for detection (its name says no
    task): the plan opens it (launch/starting_weights.py) and refuses it by its architecture, which needs class
    folders, before any process starts. (On the built-in data left to follow the model, the data comes as class
    folders: tests/test_classify.py.)"""
    import torch
    from ultralytics.nn.tasks import ClassificationModel

    from tests.conftest import ddp_launch

    torch.save({"model": ClassificationModel("yolov8n-cls.yaml", nc=3, verbose=False).half(), "ema": None,
                "train_args": {}, "epoch": -1}, tmp_path / "best.pt")
    r = ddp_launch(["model=best.pt", "data.synthetic.task=detect", "gpus=0", "dry_run=true"], cwd=tmp_path)
    assert r.returncode != 0 and "is a classification model" in r.stdout + r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
    assert "Traceback" not in r.stdout + r.stderr

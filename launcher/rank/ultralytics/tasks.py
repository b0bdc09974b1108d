"""The per-task seam: what differs between the tasks ddp-launch trains, each Ultralytics' own.

A task gives the network's class (ultralytics.nn.tasks), the arguments its constructor takes from the dataset
(PoseModel's kpt_shape) and the validator Ultralytics trains it with. The rest follows from Ultralytics' own
switches, set once: the hyperparameters' `task` (build.hyperparameters) makes build_yolo_dataset load polygons
(use_segments), keypoints (use_keypoints) or rotated boxes (use_obb: the corners' rows turned into x, y, w, h,
angle) and YOLODataset.collate_fn batch the masks or keypoints; the network's init_criterion gives the loss
(v8SegmentationLoss, v8PoseLoss, v8OBBLoss), which task_loss.training_criterion normalises over the ranks; the
checkpoint holds the network of that class with `task` in its arguments, so YOLO("best.pt").task is it.

Classification (TaskRules.folders) reads class folders, not labels: Ultralytics' ClassificationDataset (its
augmentations at imgsz, the default collation of {img, cls}) for both splits (datasets.py), the ClassificationModel
with the hyperparameters' dropout on its head, v8ClassificationLoss (a mean over the batch:
task_loss.ClassificationLoss) and the ClassificationValidator's top-1 and top-5. It has no mosaic, no max_det and no
per-box class weights.

Which tasks the plan lets through, and what they change (their paths, input, loss and metrics), is the plan's
record of each task (plan/task_rules.py TaskRules, by the same name); this module holds only Ultralytics' classes.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from ultralytics.models.yolo.classify import ClassificationValidator
from ultralytics.models.yolo.detect import DetectionValidator
from ultralytics.models.yolo.obb import OBBValidator
from ultralytics.models.yolo.pose import PoseValidator
from ultralytics.models.yolo.segment import SegmentationValidator
from ultralytics.nn.tasks import ClassificationModel, DetectionModel, OBBModel, PoseModel, SegmentationModel

from launcher.plan.task_rules import rules


@dataclass(frozen=True)
class Task:
    name: str  # Ultralytics' task name: detect | segment | pose | obb | classify
    model: type  # the network's class
    validator: type  # Ultralytics' validator for it (val.engine=ultralytics)
    data_keys: tuple[tuple[str, str], ...] = ()  # (data YAML key, the network constructor's argument)

    def network(self, arch, data: dict, dropout: float = 0.0):
        """The network of this task for the architecture `arch` (a YAML path or dict) and the dataset `data`; a
        classifier's Dropout at `dropout` where it is set (ClassificationTrainer.get_model)."""
        extra = {arg: data[key] for key, arg in self.data_keys if data.get(key)}
        net = self.model(arch, nc=data["nc"], ch=data["channels"], verbose=False, **extra)
        if rules(self.name).folders and dropout:
            for m in net.modules():
                if isinstance(m, nn.Dropout):
                    m.p = dropout
        return net


TASKS = {
    "detect": Task("detect", DetectionModel, DetectionValidator),
    "segment": Task("segment", SegmentationModel, SegmentationValidator),
    "pose": Task("pose", PoseModel, PoseValidator, data_keys=(("kpt_shape", "data_kpt_shape"),)),
    "obb": Task("obb", OBBModel, OBBValidator),  # its box metrics (B) are the rotated boxes'
    "classify": Task("classify", ClassificationModel, ClassificationValidator),
}


def task_of(name: str | None) -> Task:
    """The task named `name` (a plan's, or the hyperparameters'); KeyError for one ddp-launch does not train."""
    return TASKS[name or "detect"]

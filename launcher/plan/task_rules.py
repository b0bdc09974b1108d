"""What the task a run trains (inputs/model_task.py) changes, as one record per task (TaskRules), looked up once by
name with rules(task): the plan, the ranks, the final lines and ddp-bench ask it for a property.

Detection has ddp-launch's fast paths: the input augmented on the GPU, the fast validation engine, the whole step
captured as one CUDA graph, the auto batch's probe. Pose, segmentation and obb have the GPU input too (a pose model's
keypoints follow the matrix and flips of their boxes: rank/gpu_data/augment_keypoints.py; a segmentation model's
polygons too, its boxes made from them and its masks drawn on the device: augment_segments.py, segment_masks.py; an obb
model's corners, clipped as rotated boxes: augment_obb.py), and classification its own (rank/gpu_data/classify_input.py:
Ultralytics' classify transforms on the device), taken when asked: `auto` keeps them on the CPU pipeline until the GPU
input is measured ahead for them. Pose and segmentation validate with the fast validator too (keypoints matched by
OKS as PoseValidator matches them, rank/validate/matching.py; masks made from the prototypes and matched by IoU as
SegmentationValidator does, masks.py: each measured ahead on a GPU, so `auto` takes it); obb through Ultralytics'
validator (rotated boxes scored as it scores them). All three train with Ultralytics' loss, normalised over the ranks
but eager (its mask, keypoint and rotated-box terms have shapes that follow the targets); the network alone is graphed
on GPUs.
Classification trains on Ultralytics' ClassificationDataset (class folders, its own augmentations; no mosaic:
close_mosaic and the mosaic buffer mean nothing there), its ClassificationValidator (top-1, top-5) and its
cross-entropy, a mean over the batch.
`auto` settings resolve to those paths; a setting that asks for a fast path the task lacks is refused here.
"""

from __future__ import annotations

from dataclasses import dataclass

from launcher.problems import Problem


@dataclass(frozen=True)
class Metric:
    """A validation metric as summary.json names it (`key`), as Ultralytics' results_dict names it (`source`) and
    as the final lines and reports say it (`words`)."""

    key: str
    source: str
    words: str


BOX = (Metric("map50", "metrics/mAP50(B)", "mAP50"), Metric("map50_95", "metrics/mAP50-95(B)", "mAP50-95"))
TOP1, TOP5 = "metrics/accuracy_top1", "metrics/accuracy_top5"  # a classifier's validation metrics (ClassifyMetrics)
EAGER = "the GPU input, the fast validator and the captured step are detection's"
OWN_EAGER = "the fast validator and the captured step are detection's"  # a task with the GPU input
STEP_EAGER = "the captured step is detection's"  # a task with the GPU input and the fast validator
POSE_VALIDATORS = ("PoseValidator (val.engine=ultralytics, or asked for save_json or save_txt)",
                   "the fast validator (keypoints matched by OKS as PoseValidator matches them)")
SEGMENT_VALIDATORS = ("SegmentationValidator (val.engine=ultralytics, or asked for overlap_mask=false, save_json or "
                      "save_txt)",
                      "the fast validator (masks made and matched as SegmentationValidator makes and matches them)")


def _own(suffix: str, name: str) -> tuple[Metric, ...]:
    """A task's own mAP beside the boxes': Ultralytics' `suffix` (M, P), summary.json's `name` (mask, pose)."""
    return (Metric(f"map50_{name}", f"metrics/mAP50({suffix})", f"{name} mAP50"),
            Metric(f"map50_95_{name}", f"metrics/mAP50-95({suffix})", f"{name} mAP50-95"))


@dataclass(frozen=True)
class TaskRules:
    """What one task changes: its paths, its input, its loss and the metrics its run reports."""

    name: str  # Ultralytics' task name: detect | segment | pose | obb | classify
    fast_paths: bool = False  # the captured step and the auto batch (detection's)
    fast_validator: bool = False  # val.engine=fast: where it scores as the task's validator
    auto_fast_validator: bool = False  # val.engine=auto may pick it (plan/decisions.py): where measured ahead on GPUs
    validators: tuple[str, str] = ("", "")  # the pipeline's {validator} by val.engine resolved: ultralytics, fast
    auto_gpu_input: bool = False  # loader.augment_on=auto may pick it (plan/checks.py): where measured ahead on GPUs
    folders: bool = False  # class folders (ClassificationDataset), not images and label files (YOLODataset)
    mosaic: bool = True  # Ultralytics' mosaic (and so close_mosaic and the mosaic buffer)
    mean_loss: bool = False  # Ultralytics' loss is a mean over the batch, not a sum over its images
    masks: bool = False  # its targets hold masks (train.extra.overlap_mask applies)
    shared_cache: bool = True  # train.cache=shared (the node's cache of detection datasets' images) applies
    multi_scale: bool = True  # train.extra.multi_scale applies
    boxes: bool = True  # box metrics (B): summary.json's map50, map50_95 (a classifier's stay 0)
    own: tuple[Metric, ...] = ()  # the task's own metrics in summary.json, beside the boxes'
    quality: Metric = Metric("map50_95", BOX[1].source, "box mAP50-95")  # what time_to_model compares the sides on
    note: str = ""  # after the final line's metrics
    pipeline: str = ""  # the plan's task line after the task and its source
    gpu_pipeline: str = ""  # ... instead, with the input on the GPU

    @property
    def results(self) -> tuple[Metric, ...]:
        """The metrics a finished run reports, in the final line's order; the first is its headline."""
        return (BOX if self.boxes else ()) + self.own

    @property
    def headline(self) -> Metric:
        """The metric summary.json names as its headline ("headline"), as a resumed finished run prints it."""
        return self.results[0]

    def loss_base(self, base_batch: int) -> int:
        """The batch the step's loss scale aims at (plan/lr.py loss_scale): base_batch for the losses Ultralytics
        sums over the batch's images (its lr0 meant at nbs images), 1 for a mean loss (classify: the step then takes
        the gradient of the mean over the global batch, Ultralytics' classification step at a batch of nbs)."""
        return 1 if self.mean_loss else base_batch

    def text(self, task_from: str | None, augment_on: str = "cpu", val_engine: str = "ultralytics") -> str:
        """The plan's task line: the task, what it was read from, and the paths it takes (its input's by
        `augment_on`, the plan's loader.augment_on resolved; its validator's by `val_engine`, val.engine resolved)."""
        paths = self.gpu_pipeline if augment_on == "gpu" else self.pipeline
        paths = paths.replace("{validator}", self.validators[val_engine == "fast"])
        return f"{self.name}{f' (from {task_from})' if task_from else ''}{paths}"

    def result_line(self, summary: dict) -> str:
        """The final line of a finished run's metrics, from its summary.json."""
        return "  ".join(f"{m.words} {summary[m.key]:.4f}" for m in self.results if m.key in summary) + self.note


TASKS = {
    "detect": TaskRules("detect", fast_paths=True, fast_validator=True, auto_fast_validator=True,
                        auto_gpu_input=True),
    "segment": TaskRules("segment", masks=True, fast_validator=True, auto_fast_validator=True,
                         validators=SEGMENT_VALIDATORS,
                         own=_own("M", "mask"), quality=_own("M", "mask")[1],
                         pipeline=f"; Ultralytics' CPU pipeline and loss, {{validator}} ({STEP_EAGER})",
                         gpu_pipeline="; the GPU input pipeline (polygons warped and flipped, boxes made from them, "
                                      f"masks drawn on the device), Ultralytics' loss, {{validator}} ({STEP_EAGER})"),
    "pose": TaskRules("pose", fast_validator=True, auto_fast_validator=True, validators=POSE_VALIDATORS,
                      own=_own("P", "pose"), quality=_own("P", "pose")[1],
                      pipeline=f"; Ultralytics' CPU pipeline and loss, {{validator}} ({STEP_EAGER})",
                      gpu_pipeline="; the GPU input pipeline (keypoints warped and flipped with their boxes), "
                                   f"Ultralytics' loss, {{validator}} ({STEP_EAGER})"),
    # its box metrics (B) are the rotated boxes'
    "obb": TaskRules("obb", quality=Metric("map50_95", BOX[1].source, "box mAP50-95 (rotated boxes)"),
                     note=" (rotated boxes)",
                     pipeline=f"; Ultralytics' CPU pipeline, validator and loss ({OWN_EAGER})",
                     gpu_pipeline="; the GPU input pipeline (corners warped, clipped as rotated boxes and flipped), "
                                  f"Ultralytics' validator and loss ({OWN_EAGER})"),
    "classify": TaskRules(
        "classify", folders=True, mosaic=False, mean_loss=True,
        shared_cache=False,
        multi_scale=False,
        boxes=False, own=(Metric("top1", TOP1, "top-1"), Metric("top5", TOP5, "top-5")),
        quality=Metric("top1", TOP1, "top-1 accuracy"),
        pipeline="; Ultralytics' CPU pipeline (ClassificationDataset on class folders), ClassificationValidator "
                 f"(top-1, top-5) and cross-entropy loss ({EAGER})",
        gpu_pipeline="; the GPU input pipeline (class folders decoded and augmented on the device as Ultralytics' "
                     "classify transforms: crop, flips, RandAugment or ColorJitter, erasing), ClassificationValidator "
                     f"(top-1, top-5) and cross-entropy loss ({OWN_EAGER})"),
}
GPU_AUTO_AUGMENT = ("randaugment",)  # a classifier's auto_augment policies the GPU input builds (or none: ColorJitter)


def rules(task: str | None) -> TaskRules:
    """The record of the task named `task` (a plan's, a summary's; detect where none is named); KeyError for one
    ddp-launch does not train."""
    return TASKS[task or "detect"]


def task_problems(cfg: dict, task: str, *, device: str) -> list[Problem]:
    """The settings that ask for a path `task` does not have, each with what to set instead."""
    r = rules(task)
    train, loader, val = cfg["train"], cfg.get("loader") or {}, cfg.get("val") or {}
    problems = []
    if not r.fast_validator and val.get("engine") == "fast":
        problems.append(Problem(f"val.engine=fast with a {task} model: the fast engine scores upright boxes, "
                                "keypoints and masks only; use val.engine=ultralytics (or auto)"))
    if not r.fast_paths and train.get("batch_per_device") == "auto" and device == "cuda":
        problems.append(Problem(f"train.batch_per_device=auto with a {task} model: the probe measures the detection "
                                "step only; give train.batch_per_device as a number"))
    if not r.shared_cache and train.get("cache") == "shared":
        on_gpu = loader.get("augment_on") == "gpu"  # its caches hold decoded images for the CPU pipeline
        problems.append(Problem(f"train.cache=shared with a {task} model: the node's shared cache holds the detection "
                                "datasets' images; use train.cache=" + ("false (or ram or disk with "
                                "loader.augment_on=cpu: Ultralytics' ClassificationDataset caches)" if on_gpu else
                                "ram or disk (Ultralytics' ClassificationDataset caches), or false")))
    extra = train.get("extra") or {}
    if not r.multi_scale and extra.get("multi_scale"):
        problems.append(Problem(f"train.extra.multi_scale with a {task} model: Ultralytics' classification trainer "
                                "trains at imgsz alone (its crops are imgsz square); leave multi_scale off"))
    policy = extra.get("auto_augment")
    if r.folders and loader.get("augment_on") == "gpu" and policy and policy not in GPU_AUTO_AUGMENT:
        problems.append(Problem(f"train.extra.auto_augment={policy} with loader.augment_on=gpu: the GPU input builds "
                                f"{', '.join(GPU_AUTO_AUGMENT)} (or none: ColorJitter) only; use "
                                "loader.augment_on=cpu for it"))
    accumulate = train.get("accumulate", 1)
    if r.masks and extra.get("overlap_mask") is False and isinstance(accumulate, int) and accumulate > 1:
        problems.append(Problem("train.extra.overlap_mask=false with train.accumulate > 1: the micro-batches split "
                                "masks per image; leave overlap_mask at true, or train.accumulate=1"))
    if r.masks and extra.get("overlap_mask") is False and val.get("engine") == "fast":
        problems.append(Problem("train.extra.overlap_mask=false with val.engine=fast: the fast validator keeps a "
                                "split's masks as one image of target indices each; leave overlap_mask at true, or "
                                "use val.engine=ultralytics (or auto)"))
    return problems

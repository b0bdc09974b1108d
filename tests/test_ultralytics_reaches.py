"""Each reach into Ultralytics' internals that rank/ultralytics/__init__.py names is there in the installed release,
in the shape the adapter uses: the module, class and attribute it reads, calls, wraps or replaces (a replaced name
that is missing would replace nothing, silently). What each reach computes is checked against Ultralytics' own by the
test files of BEHAVIOUR; scripts/try-ultralytics.sh runs both against another release and names the reach that broke.
"""

from __future__ import annotations

import importlib
import inspect

import pytest

# reach (the module of rank/ultralytics/ that makes it) -> [(Ultralytics module, "Class.attribute" or "name", ...)]
REACHES = {
    "validation.py": [("ultralytics.models.yolo.detect", "DetectionValidator.__call__", "DetectionValidator.init_metrics",
                       "DetectionValidator.update_metrics", "DetectionValidator.get_desc"),
                      ("ultralytics.models.yolo.segment", "SegmentationValidator.get_desc"),
                      ("ultralytics.models.yolo.pose", "PoseValidator.get_desc"),
                      ("ultralytics.models.yolo.obb", "OBBValidator.get_desc"),
                      ("ultralytics.models.yolo.classify", "ClassificationValidator.get_desc",
                       "ClassificationValidator.gather_stats")],
    "results_table.py": [("ultralytics.engine.validator", "TQDM", "BaseValidator.__call__"),
                         ("ultralytics.models.yolo.detect", "DetectionValidator.print_results"),
                         ("ultralytics.models.yolo.classify", "ClassificationValidator.print_results")],
    "fast_validation.py": [("ultralytics.models.yolo.detect", "DetectionValidator.init_metrics",
                            "DetectionValidator.finalize_metrics", "DetectionValidator.plot_val_samples",
                            "DetectionValidator.plot_predictions", "DetectionValidator.print_results"),
                           ("ultralytics.models.yolo.pose", "PoseValidator.init_metrics", "PoseValidator.postprocess",
                            "PoseValidator._prepare_batch", "PoseValidator._process_batch"),
                           ("ultralytics.models.yolo.segment", "SegmentationValidator.init_metrics",
                            "SegmentationValidator.postprocess", "SegmentationValidator._prepare_batch",
                            "SegmentationValidator._process_batch", "SegmentationValidator.plot_predictions"),
                           ("ultralytics.utils.ops", "process_mask", "crop_mask"),
                           ("ultralytics.utils.metrics", "DetMetrics.clear_stats", "DetMetrics.results_dict",
                            "ConfusionMatrix.process_batch", "kpt_iou", "mask_iou")],
    "deferred_plots.py": [("ultralytics.engine.validator", "BaseValidator.plot_val_samples",
                           "BaseValidator.plot_predictions", "BaseValidator.get_stats", "BaseValidator.finalize_metrics"),
                          ("ultralytics.models.yolo.detect", "DetectionValidator.get_stats",
                           "DetectionValidator.finalize_metrics"),
                          ("ultralytics.models.yolo.classify", "ClassificationValidator.finalize_metrics"),
                          ("ultralytics.utils.metrics", "DetMetrics.process", "SegmentMetrics", "PoseMetrics",
                           "OBBMetrics", "ConfusionMatrix.plot")],
    "class_metrics.py": [("ultralytics.utils.metrics", "DetMetrics.process", "PoseMetrics.process",
                          "SegmentMetrics.process", "ap_per_class", "compute_ap", "smooth")],
    "folded.py": [("ultralytics.nn.modules", "Conv.forward_fuse", "DWConv"), ("ultralytics.nn.tasks", "BaseModel.fuse")],
    "loss.py": [("ultralytics.utils.loss", "v8DetectionLoss.get_assigned_targets_and_loss", "v8DetectionLoss.preprocess",
                 "BboxLoss.forward", "DFLoss.__call__"),
                ("ultralytics.utils.tal", "TaskAlignedAssigner.get_box_metrics",
                 "TaskAlignedAssigner.select_candidates_in_gts", "bbox2dist", "make_anchors")],
    "task_loss.py": [("ultralytics.utils.loss", "E2ELoss", "v8SegmentationLoss.loss", "v8PoseLoss.loss",
                      "v8SegmentationLoss.calculate_segmentation_loss", "v8SegmentationLoss.single_mask_loss",
                      "v8PoseLoss.calculate_keypoints_loss", "v8OBBLoss.loss", "v8ClassificationLoss.__call__"),
                     ("ultralytics.utils.ops", "crop_mask")],
    "datasets.py": [("ultralytics.data.base", "BaseDataset.get_img_files", "BaseDataset.load_image"),
                    ("ultralytics.data.augment", "Mosaic"), ("ultralytics.data.build", "InfiniteDataLoader.__iter__",
                                                            "seed_worker"),
                    ("ultralytics.data.utils", "get_split_fraction"), ("ultralytics.utils.patches", "imread"),
                    ("ultralytics.data.dataset", "ClassificationDataset.__getitem__")],
    "tasks.py": [("ultralytics.models.yolo.classify", "ClassificationTrainer.get_model")],
    "build.py": [("ultralytics.engine.trainer", "BaseTrainer.build_optimizer", "BaseTrainer._setup_train"),
                 ("ultralytics.models.yolo.detect", "DetectionTrainer.compute_class_weights",
                  "DetectionValidator._check_max_det"),
                 ("ultralytics.utils.torch_utils", "init_seeds", "ModelEMA")],
    "blocks.py": [("ultralytics.nn.modules.block", "C2f.forward", "SPPF.forward"),
                  ("ultralytics.nn.modules.conv", "Concat.forward")],
    "checkpoint.py": [("ultralytics.engine.trainer", "BaseTrainer.save_model"),
                      ("ultralytics.utils.torch_utils", "strip_optimizer", "convert_optimizer_state_dict_to_fp16")],
    "baseline.py": [("ultralytics.engine.trainer", "check_amp", "BaseTrainer.read_results_csv")],
    "time_to_model_ultralytics.py": [("ultralytics.engine.trainer", "check_amp", "BaseTrainer.read_results_csv",
                          "strip_optimizer")],
}

# reach -> the tests (files or node ids) that compare what it computes with what Ultralytics computes
BEHAVIOUR = {
    "validation.py": ["tests/test_validation_split.py", "tests/test_e2e_tasks.py"],
    "results_table.py": ["tests/test_fast_validation.py"],
    "fast_validation.py": ["tests/test_validation_split.py", "tests/test_confusion.py",
                           "tests/test_fast_pose_validation.py", "tests/test_fast_segment_validation.py"],
    "deferred_plots.py": ["tests/test_deferred_plots.py"],
    "class_metrics.py": ["tests/test_fast_validation.py", "tests/test_fast_pose_validation.py",
                         "tests/test_fast_segment_validation.py"],
    "folded.py": ["tests/test_folded_copy.py"],
    "loss.py": ["tests/test_loss.py"],
    "task_loss.py": ["tests/test_task_loss.py", "tests/test_tasks.py::test_the_task_loss_is_ultralytics_own_on_one_process",
                     "tests/test_tasks.py::test_two_ranks_of_b_take_the_same_step_as_one_process_of_2b",
                     "tests/test_classify.py::test_the_classification_loss_is_ultralytics_mean_summed_over_the_images"],
    "datasets.py": ["tests/test_image_cache.py", "tests/test_gpu_augment.py", "tests/test_gpu_augment_mixes.py",
                    "tests/test_data_check.py::test_the_split_lists_the_files_ultralytics_lists",
                    "tests/test_ultralytics_reaches.py::test_a_loader_forks_its_workers_at_its_first_iteration",
                    "tests/test_validation_split.py::test_a_split_read_ahead_during_training_validates_as_one_read",
                    "tests/test_classify.py::test_the_built_in_shapes_in_class_folders_are_read_by_ultralytics_as_the_plan_read_them"],
    "build.py": ["tests/test_ultralytics_adapter.py"],
    "tasks.py": ["tests/test_e2e_tasks.py"],
    "blocks.py": ["tests/test_step.py"],
    "checkpoint.py": ["tests/test_checkpointer.py"],
    "time_to_model_ultralytics.py": ["tests/test_time_to_model.py"],
    # the launcher's own re-statements, read from Ultralytics' files without importing it
    "inputs/labels.py": ["tests/test_data_check.py::test_the_check_drops_exactly_what_ultralytics_drops_with_a_reason_each",
                         "tests/test_ultralytics_reaches.py::test_the_launchers_copies_of_ultralytics_constants"],
    "plan/ultralytics_values.py": ["tests/test_bad_input.py::test_train_extra_values_are_checked_as_ultralytics_checks_them",
                                   "tests/test_ultralytics_reaches.py::test_the_launchers_copies_of_ultralytics_constants"],
    "launch/ultralytics_home.py": ["tests/test_ultralytics_reaches.py::test_the_launchers_copies_of_ultralytics_constants"],
}


def each_reach():
    for reach, places in REACHES.items():
        for module, *names in places:
            for name in names:
                yield pytest.param(module, name, id=f"{reach}: {module}.{name}")


@pytest.mark.parametrize("module,name", list(each_reach()))
def test_each_reach_is_in_the_installed_release(module, name):
    found = importlib.import_module(module)
    for part in name.split("."):
        assert hasattr(found, part), f"{module}.{name}: {part} is not there"
        found = getattr(found, part)


def test_the_reaches_keep_the_signatures_the_adapter_calls():
    """The calls whose arguments the adapter passes by position or by a name Ultralytics could rename."""
    from ultralytics.data.base import BaseDataset
    from ultralytics.models.yolo.detect import DetectionValidator
    from ultralytics.utils.loss import v8DetectionLoss, v8OBBLoss, v8PoseLoss, v8SegmentationLoss
    from ultralytics.utils.metrics import ConfusionMatrix
    from ultralytics.utils.torch_utils import strip_optimizer

    def parameters(f) -> list[str]:
        return list(inspect.signature(f).parameters)

    assert parameters(BaseDataset.get_img_files)[:2] == ["self", "img_path"]
    assert parameters(DetectionValidator._check_max_det)[:2] == ["args", "datasets"]  # a static method
    assert {"updates"} <= set(parameters(strip_optimizer))
    assert {"conf"} <= set(parameters(ConfusionMatrix.process_batch))
    assert "preprocess" in vars(v8DetectionLoss)
    from ultralytics.engine.validator import BaseValidator
    from ultralytics.utils.metrics import DetMetrics, OBBMetrics, PoseMetrics, SegmentMetrics

    # deferred_plots: the validator's plot calls by position, the metrics' drawing by name
    assert parameters(BaseValidator.plot_val_samples)[:3] == ["self", "batch", "ni"]
    assert parameters(BaseValidator.plot_predictions)[:4] == ["self", "batch", "preds", "ni"]
    for metrics in (DetMetrics, SegmentMetrics, PoseMetrics, OBBMetrics):
        assert "names" in parameters(metrics.__init__)
        assert {"save_dir", "plot", "on_plot"} <= set(parameters(metrics.process))
    for task_loss in (v8SegmentationLoss, v8PoseLoss):  # their box terms: TaskLoss hands them to DetectionLoss
        assert "self.get_assigned_targets_and_loss(preds, batch)" in inspect.getsource(task_loss.loss)
    obb = inspect.getsource(v8OBBLoss.loss)  # OBBLoss: one assignment, every term over its clamped target weight
    assert obb.count("self.assigner(") == 1 and "target_scores_sum = max(target_scores.sum(), 1)" in obb


def test_a_loader_forks_its_workers_at_its_first_iteration():
    """datasets.start_workers forks the validation loader's workers when ddp-launch chooses (read_ahead, during the
    first epoch); Ultralytics' loader must not have forked them when it was built (it did up to 8.4.157)."""
    from ultralytics.data.build import InfiniteDataLoader

    loader = InfiniteDataLoader(list(range(4)), batch_size=2, num_workers=1)
    assert loader.iterator is None


def test_the_launchers_copies_of_ultralytics_constants():
    """What the launcher reads without importing Ultralytics: its settings file version and image suffixes."""
    from ultralytics.data.utils import IMG_FORMATS
    from ultralytics.utils import SETTINGS

    from launcher.inputs import labels, ultralytics_files
    from launcher.launch.ultralytics_home import ULTRALYTICS_SETTINGS_VERSION

    assert labels.IMG_FORMATS == set(IMG_FORMATS)
    assert SETTINGS.version == ULTRALYTICS_SETTINGS_VERSION
    assert set(ultralytics_files.cfg_type_rules()) == set(ultralytics_files.CFG_TABLES)


def test_every_reach_the_package_names_is_in_the_table():
    """rank/ultralytics/__init__.py lists its reaches by module; each has its row here."""
    import launcher.rank.ultralytics as adapter

    named = {line.split(":")[0].strip("- ") for line in adapter.__doc__.splitlines() if line.startswith("- ")}
    assert named == set(REACHES)

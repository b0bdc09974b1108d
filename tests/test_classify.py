"""Classification models train on class folders (Ultralytics' data=path/to/folder), decided before any process starts:
the folders checked (a missing split, no class folder, a validation class the training split lacks: refused in one
line), a classify model refused on a data YAML of labels and any other model on class folders, the built-in shapes
in class folders, the plan's paths (Ultralytics' CPU pipeline and ClassificationValidator), Ultralytics' cross-entropy
summed so that two ranks of b take the step one process takes on 2b. tests/test_e2e_tasks.py trains one on two
ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from launcher.inputs import class_folders, shapes
from launcher.inputs.data import resolve_data
from launcher.inputs.model_task import run_task
from launcher.machine.hardware import Gpu, Hardware
from launcher.plan.describe import describe
from launcher.plan.plan import make_plan
from tests.conftest import compose_config, ddp_launch

FEW_CORES = Hardware(gpus=tuple(Gpu(i, "NVIDIA H200", 141.0) for i in range(8)), cpu_count=16, nccl_available=True)


def _folders(root: Path, splits: dict[str, dict[str, int]]) -> Path:
    """root/<split>/<class>/<i>.jpg: `splits` gives each split's classes and their image counts (32 px JPEGs)."""
    import cv2
    import numpy as np

    for split, classes in splits.items():
        (root / split).mkdir(parents=True, exist_ok=True)
        for name, n in classes.items():
            (root / split / name).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                cv2.imwrite(str(root / split / name / f"{i}.jpg"), np.full((32, 32, 3), 40 * i, np.uint8))
    return root


# --- class folders, and the task they decide ----------------------------------------------------------------------
def test_a_folder_of_class_folders_is_a_classification_dataset_that_a_classify_model_trains_on(tmp_path):
    root = _folders(tmp_path / "pets", {"train": {"dog": 3, "cat": 2}, "test": {"cat": 1, "dog": 1}})
    data, problems = resolve_data({"name": "custom", "kind": "yaml", "path": str(root)}, tmp_path)
    assert not problems and data.name == "pets"
    assert data.spec["names"] == {0: "cat", 1: "dog"} and data.spec["val"] == str(root / "test")  # sorted; test/
    assert class_folders.is_class_folders(data.spec) and (data.train_images, data.val_images) == (5, 2)
    assert run_task("yolov8n-cls.yaml", data.spec, "model=m", data.checks) == ("classify", [])
    # the run folder's data.yaml (the spec, written as the ranks get it) reads back as the same dataset
    (tmp_path / "data.yaml").write_text(yaml.safe_dump(data.spec, sort_keys=False))
    again, problems = resolve_data({"name": "pets", "path": str(tmp_path / "data.yaml")}, tmp_path)
    assert not problems and again.spec == data.spec and again.checks == data.checks


@pytest.mark.parametrize("splits, says", [
    ({"val": {"a": 1}}, "no train/ folder"),
    ({"images": {"train": 1}, "labels": {}}, "images/ beside labels/ is a detection layout: give its data YAML"),
    ({"train": {"a": 1, "b": 1}}, "no val/ folder (nor validation/, valid/ or test/)"),
    ({"train": {}, "val": {"a": 1}}, "no class folder with images under train/"),
    ({"train": {"a": 2}, "val": {"a": 1}}, "train/ has one class (a)"),
    ({"train": {"a": 1, "b": 1}, "val": {"a": 1, "c": 1}}, "val/ has class folder(s) train/ lacks: c"),
    ({"train": {"a": 1, "b": 1}, "val": {"a": 0}}, "no images under val/<class>/"),
])
def test_class_folders_that_ultralytics_would_misread_are_refused_with_the_layout(tmp_path, splits, says):
    root = _folders(tmp_path / "d", splits)
    data, problems = resolve_data({"name": "custom", "path": str(root)}, tmp_path)
    assert data is None and len(problems) == 1 and says in problems[0].message, [p.message for p in problems]


def test_a_classify_model_needs_class_folders_and_class_folders_need_a_classify_model():
    _, problems = run_task("yolo11n-cls.yaml", {"names": {0: "a"}, "train": "x", "val": "y"}, "model=yolo11n-cls.yaml")
    assert len(problems) == 1 and "yolo11n-cls.yaml is a classification model, and the data is a data YAML of " \
        "labels" in problems[0] and "data=path/to/folder" in problems[0] and "model=yolo11n.pt" in problems[0]
    folders = {"path": "/d", "names": {0: "a", 1: "b"}, class_folders.MARK: True}
    for arch in ("yolo11n.pt", "yolov8n-seg.yaml"):
        _, problems = run_task(arch, folders, f"model={arch}")
        assert len(problems) == 1 and "is class folders (a classification dataset" in problems[0]
        assert "model=yolo11n-cls.yaml" in problems[0]


def test_the_built_in_shapes_in_class_folders_are_read_by_ultralytics_as_the_plan_read_them(tmp_path):
    from ultralytics.cfg import get_cfg
    from ultralytics.data.utils import check_cls_dataset

    from launcher.rank.ultralytics.datasets import class_folders as ultralytics_split

    cfg = {"name": "shapes", "kind": "synthetic", "root": str(tmp_path),
           "synthetic": {"train_images": 6, "val_images": 3, "width": 32, "height": 32, "task": "auto"}}
    pending, problems = resolve_data(cfg, tmp_path, generate=False, model_task="classify")
    assert not problems and class_folders.is_class_folders(pending.spec) and pending.note
    data, problems = resolve_data(cfg, tmp_path, model_task="classify")
    assert not problems and data.spec == pending.spec and (data.train_images, data.val_images) == (6, 3)
    assert sorted(p.name for p in Path(data.spec["train"]).iterdir()) == list(shapes.CLASSES)
    assert check_cls_dataset(data.spec["path"])["names"] == data.spec["names"]  # Ultralytics' own reading
    hyp = get_cfg(overrides={"task": "classify", "imgsz": 32})
    item = ultralytics_split(hyp, data.spec, "val")[0]
    assert tuple(item["img"].shape) == (3, 32, 32) and item["im_file"].endswith(".jpg")
    assert item["cls"] == shapes.CLASSES.index(Path(item["im_file"]).parent.name)  # its folder's class


# --- the plan ------------------------------------------------------------------------------------------------------
def test_classify_takes_ultralytics_paths_and_refuses_detections_fast_ones_with_what_to_set():
    plan, problems = make_plan(compose_config(["train.imgsz=640"]), FEW_CORES, task="classify",
                               task_from="yolo11n-cls.yaml")
    assert not problems
    assert (plan.augment_on, plan.val_engine, plan.graph_scope) == ("cpu", "ultralytics", "network")
    text = describe(plan, None, None, cfg=compose_config(["train.imgsz=640"]))
    assert "task            classify (from yolo11n-cls.yaml); Ultralytics' CPU pipeline (ClassificationDataset" in text
    assert "ClassificationValidator (top-1, top-5)" in text and "no mosaic" in text and "mosaic off" not in text
    cfg = compose_config(["val.engine=fast", "train.cache=shared",
                          "+train.extra.multi_scale=0.5", "+train.extra.mosaic=1.0", "train.close_mosaic=3"])
    _, problems = make_plan(cfg, FEW_CORES, task="classify")
    text = "\n".join(p.message for p in problems)
    assert "val.engine=fast with a classify model" in text
    assert "train.cache=shared with a classify model" in text and "train.cache=ram or disk" in text
    assert "multi_scale with a classify model" in text
    assert len(problems) == 3  # mosaic's keys mean nothing to a classifier's set: nothing to refuse there


def test_ddp_launch_refuses_a_classify_model_on_labels_and_a_detector_on_class_folders(tmp_path, cache_dir):
    root = _folders(tmp_path / "pets", {"train": {"cat": 1, "dog": 1}, "val": {"cat": 1}})
    for args, says in ((["model=yolov8n-cls.yaml", "data.synthetic.task=detect"], "is a classification model"),
                       ([f"data={root}", "model=yolov8n.yaml"], "is class folders (a classification dataset")):
        cwd = tmp_path / says.split()[-1]
        cwd.mkdir()
        r = ddp_launch([*args, "gpus=0", "dry_run=true"], cwd=cwd)
        assert r.returncode != 0 and says in r.stdout + r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
        assert "Traceback" not in r.stdout + r.stderr and not (cwd / "runs").exists()


def test_a_renamed_classifier_checkpoint_takes_the_built_in_data_as_class_folders(tmp_path, cache_dir):
    """model=mynet.pt, a classifier's checkpoint whose name does not say so, and no data=: the built-in shapes come
    as class folders for the task its network has, not as boxes it would then be refused on."""
    import torch
    from ultralytics.nn.tasks import ClassificationModel

    net = ClassificationModel("yolov8n-cls.yaml", nc=3, verbose=False)
    torch.save({"model": net.half(), "train_args": {"task": "classify"}, "epoch": -1}, tmp_path / "mynet.pt")
    r = ddp_launch(["model=mynet.pt", "gpus=0", "dry_run=true"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "task            classify (from yolov8n-cls.yaml)" in r.stdout and "class folders" in r.stdout


# --- the loss, and one DDP step ------------------------------------------------------------------------------------
def _model_and_batch(images: int = 4):
    import torch
    from ultralytics.cfg import get_cfg

    from launcher.rank.ultralytics.tasks import task_of

    torch.manual_seed(0)
    net = task_of("classify").network("yolov8n-cls.yaml", {"nc": 3, "channels": 3})
    net.args = get_cfg(overrides={"task": "classify"})
    g = torch.Generator().manual_seed(1)
    return net, {"img": torch.rand(images, 3, 32, 32, generator=g), "cls": torch.tensor([0, 2, 1, 2][:images])}


def test_the_classification_loss_is_ultralytics_mean_summed_over_the_images():
    import torch

    from launcher.rank.ultralytics.task_loss import ClassificationLoss, training_criterion

    net, batch = _model_and_batch()
    net.train()
    preds = net(batch["img"])
    expected, items = net.init_criterion()(preds, batch)
    criterion, over_ranks = training_criterion(net)
    assert isinstance(criterion, ClassificationLoss) and over_ranks
    loss, got = criterion(preds, batch)
    torch.testing.assert_close(loss, expected * 4)
    torch.testing.assert_close(got["loss"], items["loss"])  # the item stays Ultralytics' mean


def _step(model, batch: dict, local_batch: int, accumulate: int = 1) -> None:
    """One ddp-launch step as the run takes it (frozen BatchNorm statistics): the classification loss scaled by its
    loss base (task_rules), a class per image."""
    from launcher.plan.task_rules import rules
    from launcher.rank.data.pipeline import TARGETS_PER_IMAGE
    from tests.test_ddp_equivalence import BASE_BATCH, one_step

    one_step(model, {**batch, TARGETS_PER_IMAGE: [1] * len(batch["img"])}, local_batch, accumulate,
             base_batch=rules("classify").loss_base(BASE_BATCH))


def _rank(rank: int, world: int, init_file: str, out: str):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    net, batch = _model_and_batch()
    per = len(batch["img"]) // world
    _step(torch.nn.parallel.DistributedDataParallel(net),
          {k: v[rank * per:(rank + 1) * per] for k, v in batch.items()}, per)
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in net.named_parameters()}, out)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.dist
def test_two_ranks_of_b_take_the_same_step_as_one_process_of_2b_and_as_two_micro_batches(tmp_path):
    """Each rank's mean over its b images, times b, scaled by 1/b: DDP's average over equal batches is the mean
    over the 2b images, the gradient one process takes on them (and one process accumulating two micro-batches)."""
    import torch.multiprocessing as mp

    from tests.test_ddp_equivalence import assert_same_step, parameters

    net, batch = _model_and_batch()
    before = parameters(net)
    _step(net, batch, 4)
    accumulated, _ = _model_and_batch()
    _step(accumulated, batch, 4, accumulate=2)
    assert_same_step(parameters(accumulated), parameters(net), before)
    out = tmp_path / "ddp.pt"
    mp.start_processes(_rank, args=(2, str(tmp_path / "init"), str(out)), nprocs=2, start_method="spawn")
    import torch

    assert_same_step(torch.load(out), parameters(net), before)

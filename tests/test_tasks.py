"""The task a run trains follows from the model and the dataset, decided in the plan before any process starts:
segmentation, pose and obb models train through Ultralytics' loss (normalised over the ranks) and validator (a
pose or segmentation model through the fast validator, which scores keypoints and masks as Ultralytics'
validators do), on its CPU pipeline or, when asked, the GPU input; a model that does not fit its data
is refused with what to change, and the synthetic shapes are labelled for the model's task. tests/test_e2e_tasks.py
trains each task on two ranks."""

from __future__ import annotations

import pytest
import yaml

from launcher.inputs import labels, shapes
from launcher.inputs.model_task import run_task
from launcher.machine.hardware import Gpu, Hardware
from launcher.plan.describe import describe
from launcher.plan.plan import LaunchPlan, make_plan
from tests.conftest import compose_config, ddp_launch

FEW_CORES = Hardware(gpus=tuple(Gpu(i, "NVIDIA H200", 141.0) for i in range(8)), cpu_count=16, nccl_available=True)
MODELS = {"segment": "yolov8n-seg.yaml", "pose": "yolov8n-pose.yaml", "obb": "yolov8n-obb.yaml"}
POSE_DATA = {"names": {0: "a"}, "kpt_shape": [4, 3], "flip_idx": [0, 3, 2, 1]}


# --- the task, from the model and the data --------------------------------------------------------------------
@pytest.mark.parametrize("arch, data, task", [("yolov8n.yaml", {}, "detect"), ("yolov8n-seg.yaml", {}, "segment"),
                                              ("yolo11n-pose.yaml", POSE_DATA, "pose"), (None, {}, "detect")])
def test_the_task_is_the_models_where_the_data_fits_it(arch, data, task):
    assert run_task(arch, data, "model=m") == (task, [])


def test_a_pose_model_needs_keypoints_and_keypoints_need_a_pose_model():
    _, problems = run_task("yolov8n-pose.yaml", {"names": {0: "a"}}, "model=yolov8n-pose.yaml")
    assert len(problems) == 1 and "has no kpt_shape" in problems[0] and "kpt_shape: [K, 3]" in problems[0]
    for kpt_shape, flip_idx, says in (([4], None, "expected [K, 2] or [K, 3]"), ([4, 3], [0, 1, 2], "flip_idx"),
                                      ([4, 3], [0, 1, 1, 3], "mirrored order")):
        _, problems = run_task("yolov8n-pose.yaml", {"kpt_shape": kpt_shape, "flip_idx": flip_idx}, "model=m")
        assert len(problems) == 1 and says in problems[0], problems
    assert run_task("yolov8n-pose.yaml", {"kpt_shape": [17, 2]}, "model=m") == ("pose", [])  # no flip_idx: no flip
    for arch in ("yolov8n.yaml", "yolov8n-seg.yaml"):
        _, problems = run_task(arch, POSE_DATA, f"model={arch}")
        assert len(problems) == 1 and "only a pose model trains on" in problems[0]
        assert "model=yolov8n-pose.yaml" in problems[0] and "remove kpt_shape" in problems[0]


def _checked(**forms) -> dict:
    return {"train": {"forms": forms}, "val": {"forms": forms}}


def test_an_obb_model_needs_corner_rows_and_corner_rows_need_an_obb_model():
    assert run_task("yolov8n-obb.yaml", {}, "model=m", _checked(obb=8)) == ("obb", [])
    assert run_task("yolov8n-obb.yaml", {}, "model=m", _checked(obb=8, polygons=2)) == ("obb", [])  # minAreaRect
    _, problems = run_task("yolov8n-obb.yaml", {}, "model=yolov8n-obb.yaml", _checked(boxes=3, obb=5))
    assert len(problems) == 1 and "yolov8n-obb.yaml is an obb model, and 3 train image(s) have box label rows" in \
        problems[0] and "class x1 y1 x2 y2 x3 y3 x4 y4" in problems[0] and "model=yolo11n.pt" in problems[0]
    _, problems = run_task("yolo11n.pt", {}, "model=yolo11n.pt", _checked(obb=8))
    assert len(problems) == 1 and "every train label row is a class and four corners" in problems[0]
    assert "model=yolo11n-obb.yaml" in problems[0] and "class x y w h" in problems[0]
    for arch, forms in (("yolo11n.pt", {"obb": 8, "boxes": 1}), ("yolov8n-seg.yaml", {"obb": 8})):
        assert run_task(arch, {}, "model=m", _checked(**forms))[1] == []  # mixed, or polygons for masks


def test_an_obb_model_on_box_labels_is_refused_by_the_plan(tmp_path, cache_dir):
    from launcher.launch.start import start
    from launcher.problems import PlanError
    from tests.test_data_check import box_dataset

    data = box_dataset(tmp_path / "ds")
    cfg = compose_config(["data=custom", f"data.path={data}", "model=custom", "model.cfg=yolov8n-obb.yaml", "gpus=0"])
    with pytest.raises(PlanError, match="is an obb model, and 1 train image"):
        start(cfg, tmp_path / "run", tmp_path)
    assert not (tmp_path / "run").exists()


# --- what the task changes in the plan ------------------------------------------------------------------------
def test_segment_pose_and_obb_take_ultralytics_paths_where_detection_takes_the_fast_ones():
    cfg = compose_config(["train.imgsz=640"])
    detect, problems = make_plan(cfg, FEW_CORES)
    assert not problems and (detect.augment_on, detect.val_engine, detect.graph_scope) == ("gpu", "fast", "step")
    for task in ("segment", "pose", "obb"):
        plan, problems = make_plan(cfg, FEW_CORES, task=task, task_from=MODELS[task])
        assert not problems
        # auto: the CPU pipeline (they take the GPU input when asked: the next test); pose's and segmentation's fast
        # validator, measured ahead on a GPU (docs/benchmarks sections 19-20), obb's Ultralytics' validator
        engine = "ultralytics" if task == "obb" else "fast"
        assert (plan.task, plan.augment_on, plan.val_engine, plan.graph_scope, plan.cuda_graphs) == (
            task, "cpu", engine, "network", True)
        text = describe(plan, None, None)
        assert f"task            {task} (from {MODELS[task]}); Ultralytics' CPU pipeline" in text
        assert ("the fast validator (keypoints matched by OKS" in text) == (task == "pose")
        assert ("the fast validator (masks made and matched as SegmentationValidator" in text) == (task == "segment")
        assert f"the network's forward and backward only (train.cuda_graphs): the {task} loss runs eagerly" in text
    assert "task            detect" in describe(detect, None, None)


@pytest.mark.parametrize("task,carried", [("pose", "keypoints"), ("segment", "polygons"), ("obb", "corners")])
def test_pose_segment_and_obb_take_the_gpu_input_when_asked_and_ultralytics_pipeline_on_cpu(task, carried):
    for value, on in (("gpu", "gpu"), ("cpu", "cpu")):
        cfg = compose_config([f"loader.augment_on={value}", "train.imgsz=640"])
        plan, problems = make_plan(cfg, FEW_CORES, task=task, task_from=MODELS[task])
        assert not problems and plan.augment_on == on
        assert plan.val_engine == ("ultralytics" if task == "obb" else "fast")
        paths = f"the GPU input pipeline ({carried}" if on == "gpu" else "Ultralytics' CPU pipeline"
        assert f"task            {task} (from {MODELS[task]}); {paths}" in describe(plan, None, None)
    cfg = compose_config(["loader.augment_on=gpu", "val.engine=fast", "train.batch_per_device=auto"])
    _, problems = make_plan(cfg, FEW_CORES, task=task)
    text = "\n".join(p.message for p in problems)
    assert "loader.augment_on" not in text  # the GPU input is the task's; the probe is not
    assert (f"val.engine=fast with a {task} model" in text) == (task == "obb")  # pose's and segment's fast validator
    assert f"train.batch_per_device=auto with a {task} model" in text


@pytest.mark.parametrize("task,says", [
    ("pose", "the fast validator (keypoints matched by OKS as PoseValidator matches them)"),
    ("segment", "the fast validator (masks made and matched as SegmentationValidator makes and matches them)")])
def test_pose_and_segment_models_validate_with_the_fast_validator_by_default(task, says):
    """val.engine=fast: the fast validator, whose OKS and mask matching are Ultralytics' validators'
    (test_fast_pose_validation.py, test_fast_segment_validation.py), and `auto` takes it (measured ahead on a GPU);
    save_json is refused with it, and `auto` then takes Ultralytics' validator, which writes it; so does a
    segmentation run's overlap_mask=false, whose separate masks the fast validator does not keep."""
    for on in ("cpu", "gpu"):
        cfg = compose_config([f"loader.augment_on={on}", "val.engine=fast", "train.imgsz=640"])
        plan, problems = make_plan(cfg, FEW_CORES, task=task, task_from=MODELS[task])
        assert not problems and plan.val_engine == "fast"
        assert says in describe(plan, None, None)
    cfg = compose_config(["val.engine=fast", "+train.extra.save_json=true"])
    _, problems = make_plan(cfg, FEW_CORES, task=task)
    assert "train.extra.save_json=true: the fast validation engine does not write it" in "\n".join(
        p.message for p in problems)
    plan, problems = make_plan(compose_config(["+train.extra.save_json=true"]), FEW_CORES, task=task,
                               task_from=MODELS[task])
    assert not problems and plan.val_engine == "ultralytics"
    validator = "PoseValidator" if task == "pose" else "SegmentationValidator"
    assert f"{validator} (val.engine=ultralytics, or asked for" in describe(plan, None, None)
    for engine in ("auto", "fast"):
        cfg = compose_config([f"val.engine={engine}", "+train.extra.overlap_mask=false"])
        plan, problems = make_plan(cfg, FEW_CORES, task=task, task_from=MODELS[task])
        refused = "train.extra.overlap_mask=false with val.engine=fast" in "\n".join(p.message for p in problems)
        assert refused == (task == "segment" and engine == "fast")
        if not problems:
            assert plan.val_engine == ("ultralytics" if task == "segment" else "fast")


def test_settings_that_ask_a_segment_model_for_detections_fast_paths_are_refused_with_what_to_set():
    cfg = compose_config(["loader.augment_on=gpu", "val.engine=fast", "train.batch_per_device=auto",
                          "train.accumulate=2", "+train.extra.overlap_mask=false"])
    _, problems = make_plan(cfg, FEW_CORES, task="segment")
    text = "\n".join(p.message for p in problems)
    assert "loader.augment_on" not in text  # the GPU input takes a segment model's polygons
    assert "overlap_mask=false with val.engine=fast" in text and "val.engine=ultralytics" in text
    assert "train.batch_per_device=auto with a segment model" in text
    assert "overlap_mask=false with train.accumulate > 1" in text
    _, problems = make_plan(cfg, FEW_CORES)
    assert "segment" not in "\n".join(p.message for p in problems)


def test_a_plan_json_without_a_task_is_a_detection_run():
    cfg = compose_config(["gpus=0"])
    plan, _ = make_plan(cfg, Hardware(gpus=(), cpu_count=2))
    older = {k: v for k, v in plan.to_dict().items() if k not in ("task", "task_from")}
    assert LaunchPlan.from_dict(older, cfg).task == "detect" and LaunchPlan.from_dict(older, cfg) == plan


# --- through ddp-launch: the plan's line, and the refusals before anything starts --------------------------------
def test_the_plan_names_the_task_and_refuses_a_model_that_does_not_fit_the_data(tmp_path, cache_dir):
    r = ddp_launch(["model=custom", "model.cfg=yolov8n-seg.yaml", "gpus=0", "dry_run=true"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "task            segment (from yolov8n-seg.yaml)" in r.stdout
    for args, says in ((["model=custom", "model.cfg=yolov8n-pose.yaml", "data.synthetic.task=detect"], "no kpt_shape"),
                       (["data.synthetic.task=pose"], "only a pose model trains on")):
        cwd = tmp_path / says.split()[-1]
        cwd.mkdir()
        r = ddp_launch([*args, "gpus=0", "dry_run=true"], cwd=cwd)
        assert r.returncode != 0 and says in r.stdout + r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
        assert "Traceback" not in r.stdout + r.stderr and not (cwd / "runs").exists()


# --- the synthetic shapes, labelled for the task -----------------------------------------------------------------
@pytest.mark.parametrize("task", ["segment", "pose", "obb"])
def test_the_synthetic_shapes_carry_polygons_keypoints_or_corners_that_ultralytics_checks_pass(task, tmp_path):
    spec = shapes.ShapesSpec(train_images=4, val_images=2, width=64, height=64, task=task)
    assert spec.digest() != shapes.ShapesSpec(train_images=4, val_images=2, width=64, height=64).digest()
    data = yaml.safe_load(shapes.ensure_dataset(tmp_path, spec, workers=1, log=lambda _: None).read_text())
    assert (data.get("kpt_shape"), data.get("flip_idx")) == (([4, 3], [0, 3, 2, 1]) if task == "pose" else (None, None))
    check = labels.check_split([f"{data['path']}/{data['train']}"], 3, kpt_shape=data.get("kpt_shape"))
    assert check.usable == check.images == 4 and not check.dropped
    assert set(check.forms) == {{"segment": "polygons", "pose": "boxes", "obb": "obb"}[task]}
    rows = [line.split() for f in sorted(tmp_path.rglob("labels/train/*.txt")) for line in f.read_text().splitlines()]
    assert rows and all(len(r) == (1 + 4 + 4 * 3 if task == "pose" else len(r)) for r in rows)
    assert task == "pose" or all(len(r) >= 7 and len(r) % 2 for r in rows)  # class and x, y pairs: a polygon
    if task == "obb":  # a rectangle: its opposite sides of one length, turned from upright in some images
        import numpy as np

        corners = np.array([r[1:] for r in rows], np.float64).reshape(-1, 4, 2) * 64
        sides = np.linalg.norm(np.roll(corners, -1, 1) - corners, axis=2)
        np.testing.assert_allclose(sides[:, :2], sides[:, 2:], atol=1e-3)
        assert (np.abs(corners[:, 0, 1] - corners[:, 1, 1]) > 1).any()


def test_a_synthetic_task_it_does_not_know_is_refused():
    assert any("data.synthetic.task='depth'" in m for m in shapes.ShapesSpec(task="depth").problems())


# --- the loss: Ultralytics' values, its box terms from the run's detection loss ------------------------------------
def _batch(task: str):
    import torch

    from launcher.rank.data.pipeline import MAX_TARGETS

    g = torch.Generator().manual_seed(0)
    batch = {"img": torch.rand(2, 3, 64, 64, generator=g), "batch_idx": torch.tensor([0.0, 0.0, 1.0]),
             "cls": torch.tensor([[0.0], [1.0], [2.0]]),
             "bboxes": torch.tensor([[0.3, 0.3, 0.3, 0.3], [0.7, 0.6, 0.4, 0.5], [0.5, 0.5, 0.6, 0.6]]),
             MAX_TARGETS: 2}
    if task == "segment":  # overlap masks at the prototypes' resolution: object i of an image is i + 1
        masks = torch.zeros(2, 16, 16)
        masks[0, 3:8, 3:8], masks[0, 7:13, 9:14], masks[1, 3:13, 3:13] = 1, 2, 1
        batch["masks"] = masks
    elif task == "obb":  # x, y, w, h and the angle in radians
        batch["bboxes"] = torch.cat((batch["bboxes"], torch.tensor([[0.3], [-0.7], [1.2]])), 1)
    else:
        batch["keypoints"] = torch.rand(3, 4, 3, generator=g).clamp(0.1, 0.9)
        batch["keypoints"][..., 2] = 2.0
    return batch


@pytest.mark.parametrize("task", ["segment", "pose", "obb"])
def test_the_task_loss_is_ultralytics_own_on_one_process(task):
    import torch
    from ultralytics.cfg import get_cfg

    from launcher.rank.ultralytics.task_loss import OBBLoss, TaskLoss, training_criterion
    from launcher.rank.ultralytics.tasks import task_of

    torch.manual_seed(0)
    net = task_of(task).network(MODELS[task], {"nc": 3, "channels": 3, "kpt_shape": [4, 3]})
    net.args = get_cfg(overrides={"task": task})
    net.train()
    preds = net(_batch(task)["img"])
    expected, expected_items = net.init_criterion()(preds, _batch(task))
    for sync_free in (True, False):
        criterion, global_boxes = training_criterion(net, sync_free=sync_free)
        assert isinstance(criterion, OBBLoss if task == "obb" else TaskLoss) and global_boxes
        assert not hasattr(criterion, "defer_normaliser")
        loss, items = criterion(preds, _batch(task))
        torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-5)
        assert list(items) == list(expected_items)


# --- on two ranks: the same step as one process on the whole batch ------------------------------------------------
BOXES = (3, 1, 2, 0)  # per image: unequal, so that a normaliser taken per rank would give another step


def _task_model_and_batch(task: str):
    """A network of `task` and a batch of 4 images, 64 px, with BOXES targets each (boxes, and their masks at the
    prototypes' 16 px, four keypoints inside each box, or each box turned)."""
    import torch
    from ultralytics.cfg import get_cfg

    from launcher.rank.data.pipeline import TARGETS_PER_IMAGE
    from launcher.rank.ultralytics.tasks import task_of

    torch.manual_seed(0)
    net = task_of(task).network(MODELS[task], {"nc": 3, "channels": 3, "kpt_shape": [4, 3]})
    net.args = get_cfg(overrides={"task": task})
    rows = [(i, (i + k) % 3, 0.2 + 0.3 * k, 0.5, 0.25, 0.4) for i, n in enumerate(BOXES) for k in range(n)]
    t = torch.tensor(rows, dtype=torch.float32)
    batch = {"img": torch.rand(len(BOXES), 3, 64, 64, generator=torch.Generator().manual_seed(1)),
             "batch_idx": t[:, 0], "cls": t[:, 1:2], "bboxes": t[:, 2:], TARGETS_PER_IMAGE: list(BOXES)}
    if task == "segment":  # overlap masks: object k of an image is k + 1, over its box
        batch["masks"] = torch.zeros(len(BOXES), 16, 16)
        for i in range(len(BOXES)):
            for k, (_, _, cx, cy, w, h) in enumerate(r for r in rows if r[0] == i):
                x0, x1, y0, y1 = (int(16 * v) for v in (cx - w / 2, cx + w / 2, cy - h / 2, cy + h / 2))
                batch["masks"][i, y0:y1, x0:x1] = k + 1
    elif task == "obb":  # turned by an angle of its own
        batch["bboxes"] = torch.cat((batch["bboxes"], torch.linspace(-1.2, 1.2, len(rows)).view(-1, 1)), 1)
    else:  # the box's top, right, bottom and left points
        batch["keypoints"] = torch.tensor([[[cx, cy - h / 2, 2], [cx + w / 2, cy, 2], [cx, cy + h / 2, 2],
                                            [cx - w / 2, cy, 2]] for _, _, cx, cy, w, h in rows])
    return net, batch


def _task_shard(batch: dict, rank: int, world: int) -> dict:
    from launcher.rank.step.train_step import micro_batches

    return micro_batches(batch, world)[rank]


def _task_rank(rank: int, world: int, init_file: str, out: str, task: str):
    import torch
    import torch.distributed as dist

    from tests.test_ddp_equivalence import one_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    net, batch = _task_model_and_batch(task)
    one_step(torch.nn.parallel.DistributedDataParallel(net), _task_shard(batch, rank, world), len(BOXES) // world)
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in net.named_parameters()}, out)
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.dist
@pytest.mark.parametrize("task", ["segment", "pose", "obb"])
def test_two_ranks_of_b_take_the_same_step_as_one_process_of_2b(task, tmp_path):
    """The mask and keypoint terms too: each rank divides by the ranks' mean foreground, not its own; the rotated
    boxes' terms by the ranks' mean target weight."""
    import torch
    import torch.multiprocessing as mp

    from tests.test_ddp_equivalence import assert_same_step, one_step, parameters

    net, batch = _task_model_and_batch(task)
    before = parameters(net)
    one_step(net, batch, len(BOXES))
    out = tmp_path / "ddp.pt"
    mp.start_processes(_task_rank, args=(2, str(tmp_path / "init"), str(out), task), nprocs=2, start_method="spawn")
    assert_same_step(torch.load(out), parameters(net), before)

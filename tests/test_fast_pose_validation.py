"""The fast validation engine for a pose model against Ultralytics' PoseValidator: the keypoints the NMS keeps with
each detection, the true positives by keypoint similarity (OKS), the pose metrics from the same predictions, and the
same results as PoseValidator on a real pose model and data (CPU, fp32). Detection's: tests/test_fast_validation.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from ultralytics.cfg import get_cfg
from ultralytics.models.yolo.pose import PoseValidator
from ultralytics.nn.tasks import PoseModel
from ultralytics.utils import YAML, metrics
from ultralytics.utils import nms as ultralytics_nms

from launcher.inputs.shapes import CLASSES, ShapesSpec, ensure_dataset
from launcher.rank.group.dist import Comm
from launcher.rank.ultralytics import datasets
from launcher.rank.ultralytics.fast_validation import FastValidator, claims_rule, gathered_stats, nms_settings
from launcher.rank.ultralytics.validation import Validator
from launcher.rank.validate.engine import NmsSettings, run_pass
from launcher.rank.validate.nms import batched_nms
from launcher.rank.validate.store import PreloadedSplit

from tests.test_fast_validation import NC, _loader_batches, head_output, rows
from tests.test_validation_split import finding_boxes

KPT_SHAPE = [4, 3]  # the project's synthetic pose shapes: four keypoints with visibility


def corners(xywh: torch.Tensor) -> torch.Tensor:
    """(..., 4, 2) the corners of xywh boxes (..., 4), clockwise from the top left."""
    xy, half = xywh[..., :2], xywh[..., 2:] / 2
    signs = torch.tensor([[-1.0, -1.0], [1.0, -1.0], [1.0, 1.0], [-1.0, 1.0]])
    return xy[..., None, :] + signs * half[..., None, :]


def pose_output(b: int, anchors: int, seed: int) -> torch.Tensor:
    """A pose head's inference output (B, 4 + nc + 12, anchors): head_output's boxes with keypoints near their
    corners (a few pixels off) and visibility scores in (0, 1)."""
    boxes = head_output(b, NC, anchors, seed=seed, size=90.0)
    g = torch.Generator().manual_seed(seed + 100)
    xy = corners(boxes[:, :4].transpose(1, 2)) + torch.randn(b, anchors, 4, 2, generator=g) * 2
    vis = torch.rand(b, anchors, 4, 1, generator=g)
    kpts = torch.cat([xy, vis], -1).reshape(b, anchors, 12).transpose(1, 2)
    return torch.cat([boxes, kpts], 1)


def pose_batches(b: int, per_batch: int, shape=(96, 128), seed: int = 5) -> list[dict]:
    """_loader_batches with each target's keypoints: its corners, normalised, one in five not visible (0)."""
    out = _loader_batches(b, per_batch, shape=shape, seed=seed)
    g = torch.Generator().manual_seed(seed)
    for batch in out:
        n = batch["bboxes"].shape[0]
        vis = torch.where(torch.rand(n, 4, 1, generator=g) < 0.2, 0.0, 2.0)
        batch["keypoints"] = torch.cat([corners(batch["bboxes"]), vis], -1)
    return out


def _pose_validator(save_dir) -> PoseValidator:
    v = PoseValidator(save_dir=save_dir, args={"conf": None, "plots": False})  # conf 0.001, as in training
    v.training, v.device, v.data = True, torch.device("cpu"), {"val": "", "kpt_shape": KPT_SHAPE}
    v.init_metrics(SimpleNamespace(names=dict(enumerate(CLASSES))))
    return v


def test_the_nms_keeps_each_detections_keypoints_as_ultralytics():
    pred = pose_output(4, 150, seed=2)
    ref = ultralytics_nms.non_max_suppression(pred.clone(), 0.001, 0.7, nc=NC, multi_label=True, max_det=300)
    det = batched_nms(pred, 0.001, 0.7, max_det=300, nc=NC)
    assert sum(len(r) for r in ref) > 4 * 20
    for i, want in enumerate(ref):
        n = int(det.count[i])
        assert torch.equal(torch.cat([rows(det, i), det.extra[i, :n]], 1), want), i
    none = batched_nms(pred, 2.0, 0.7, max_det=300, nc=NC)  # nothing above conf: no rows, still 12 channels
    assert none.extra.shape == (4, 0, 12)
    # an end-to-end head (yolo26-pose with nms=False): its rows x1, y1, x2, y2, score, class, then the keypoints
    rows26 = torch.cat([torch.rand(4, 50, 4) * 90, torch.rand(4, 50, 1), torch.randint(0, NC, (4, 50, 1)).float(),
                        torch.rand(4, 50, 12) * 90], -1)
    ref = ultralytics_nms.non_max_suppression(rows26.clone(), 0.3, 0.7, nc=NC, max_det=20, end2end=True)
    det = batched_nms(rows26, 0.3, 0.7, max_det=20, nc=NC, end2end=True)
    for i, want in enumerate(ref):
        n = int(det.count[i])
        assert n and torch.equal(torch.cat([rows(det, i), det.extra[i, :n]], 1), want), i


@pytest.mark.parametrize("replayed,per_image", [(False, False), (True, False), (False, True)])
def test_pose_metrics_from_the_same_predictions_equal_pose_validators(tmp_path, monkeypatch, replayed, per_image):
    """PoseValidator's postprocess and update_metrics per batch against the fast engine's pass over the same batches
    preloaded, two ranks' shards gathered in rank order: box and pose metrics equal. `per_image`: the matching by
    PoseValidator's own match_predictions, image by image (the fast validator's rule where the installed release
    does not claim greedily: releases.GREEDY_MATCHING)."""
    from launcher.rank.ultralytics import releases

    if per_image:
        monkeypatch.setattr(releases, "GREEDY_MATCHING", False)
    batches = pose_batches(10, 4)
    preds = [pose_output(len(b["im_file"]), 300, seed=5 + k) for k, b in enumerate(batches)]
    ref = _pose_validator(tmp_path)
    for batch, pred in zip(batches, preds):
        ref.update_metrics(ref.postprocess(pred.clone()), {**batch, "img": batch["img"].float() / 255})
    want = ref.get_stats()

    per_rank = []
    for shard_batches, shard_preds in (batches[:2], preds[:2]), (batches[2:], preds[2:]):
        split = PreloadedSplit.load(shard_batches, torch.device("cpu"))
        replies, static = iter(shard_preds), torch.zeros_like(shard_preds[0])

        def forward(img):
            pred = next(replies)
            return static[: len(pred)].copy_(pred) if replayed else pred

        result = run_pass(split, forward, batch=4, nc=NC, nms=nms_settings(ref.args, False),
                          kpt_sigma=torch.as_tensor(ref.sigma), claim=claims_rule(ref))
        per_rank.append(result.stats)
    mine = _pose_validator(tmp_path)
    mine.metrics.stats = gathered_stats(per_rank)
    got = mine.get_stats()
    assert want["metrics/mAP50(P)"] > 0.02 and want["metrics/mAP50-95(P)"] < want["metrics/mAP50(P)"]
    nothing = run_pass(PreloadedSplit.load(batches[:1], torch.device("cpu")), lambda img: preds[0], batch=4, nc=NC,
                       nms=NmsSettings(conf=2.0), kpt_sigma=torch.as_tensor(ref.sigma))  # no detection above conf
    assert nothing.stats["tp_p"].shape == (0, 10) and len(nothing.stats["target_cls"]) > 0
    assert list(got) == list(want)
    for k in want:
        assert got[k] == pytest.approx(want[k], abs=1e-6), k


def split_data(root, task: str, images: int) -> dict:
    """The project's synthetic shapes labelled for `task` at odd sizes (97x71: rect batches with padding), as the
    validators read the data YAML."""
    spec = ShapesSpec(train_images=2, val_images=images, width=97, height=71, seed=3, task=task)
    path = ensure_dataset(root, spec, workers=1, log=lambda *_: None)
    data = YAML.load(path)
    return {**data, "val": str(path.parent / data["val"]), "nc": len(data["names"]), "channels": 3}


@pytest.fixture(scope="module")
def pose_split(tmp_path_factory):
    return split_data(tmp_path_factory.mktemp("pose"), "pose", 6)


def a_pose_model_that_finds_objects(data: dict) -> PoseModel:
    """yolov8n-pose whose head finds some shapes and their keypoints untrained: boxes one stride each side of every
    anchor, scores spread over (0, 1), and the four keypoints at the boxes' top, right, bottom and left midpoints
    (where the shapes' keypoints are)."""
    torch.manual_seed(0)
    model = PoseModel("yolov8n-pose.yaml", nc=data["nc"], data_kpt_shape=tuple(data["kpt_shape"]), verbose=False)
    model.args, model.names = get_cfg(overrides={"task": "pose"}), data["names"]
    head = model.model[-1]
    # Pose.kpts_decode: (output * 2 + anchor - 0.5) * stride, so an offset of d strides is an output of (d + 0.5) / 2
    midpoints = torch.tensor([[0.0, -1.0], [1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    keypoints = torch.cat([(midpoints + 0.5) / 2, torch.full((4, 1), 5.0)], 1).flatten()
    finding_boxes(head)
    with torch.no_grad():
        for level in head.cv4:
            level[-1].weight.zero_()
            level[-1].bias.copy_(keypoints)
    return model


def test_the_fast_validator_gives_what_pose_validator_gives_on_a_real_model(pose_split, tmp_path, monkeypatch):
    """A pose model's weights and a pose split through both engines: the metric keys (box and pose), their values,
    the validation losses (the keypoints' among them) and the confusion matrix equal (CPU, fp32). Nothing drawn."""
    from ultralytics.models.yolo.detect import DetectionValidator

    for owner, name in [(DetectionValidator, "plot_val_samples"), (DetectionValidator, "plot_predictions"),
                        (metrics.ConfusionMatrix, "plot"), (metrics, "plot_pr_curve"), (metrics, "plot_mc_curve")]:
        monkeypatch.setattr(owner, name, lambda *args, **kwargs: None)
    data = pose_split
    ema = SimpleNamespace(ema=a_pose_model_that_finds_objects(data))
    hyp = get_cfg(overrides={"imgsz": 64, "plots": False, "task": "pose"})
    loaders = [datasets.val_loader(hyp, data, 4, 32, 0, torch.device("cpu")) for _ in range(2)]
    kwargs = dict(device=torch.device("cpu"), data=data, amp=False, epoch=0, epochs=1,
                  loss_items={k: torch.zeros(()) for k in ("box_loss", "pose_loss", "kobj_loss", "cls_loss",
                                                           "dfl_loss")})
    ref = Validator(loaders[0], hyp, tmp_path / "a")
    want, want_fitness = ref.validate(ema, Comm(), **kwargs, plots=True)
    fast = FastValidator(loaders[1], hyp, tmp_path / "b", batch=4, amp_dtype=None, cuda_graphs=False, log=print)
    got, got_fitness = fast.validate(ema, Comm(), **kwargs, plots=True, draw=lambda what, drawing: None)
    assert isinstance(fast.validator, PoseValidator)
    assert np.array_equal(fast.validator.confusion_matrix.matrix, ref.validator.confusion_matrix.matrix)
    assert list(got) == list(want) and "metrics/mAP50-95(P)" in got and "val/pose_loss" in got
    assert got == pytest.approx(want, abs=1e-4) and got_fitness == pytest.approx(want_fitness, abs=1e-4)
    assert want["metrics/recall(B)"] > 0 and want["metrics/recall(P)"] > 0  # not a comparison of zeros


def fast_and_ultralytics_on_cuda(tmp_path, task: str, make_model, imgsz: int, own: str) -> None:
    """On CUDA (fp16, CUDA graphs, the Triton scans), Ultralytics' validator of `task` and the fast one on the same
    weights (`make_model(data)`) and a 64-image split of the synthetic shapes: the same box mAP and the task's own
    (suffix `own`: P, M) up to fp16 rounding."""
    data = split_data(tmp_path / "data", task, 64)
    device = torch.device("cuda", 0)
    ema = SimpleNamespace(ema=make_model(data).to(device))
    hyp = get_cfg(overrides={"imgsz": imgsz, "plots": False, "task": task})
    kwargs = dict(device=device, data=data, amp=True, epoch=0, epochs=1,
                  loss_items={k: torch.zeros((), device=device) for k in ema.ema.init_criterion().loss_names})
    results = {}
    for name in ("ultralytics", "fast"):
        loader = datasets.val_loader(hyp, data, 16, 32, 2, device)
        validator = (Validator(loader, hyp, tmp_path / name) if name == "ultralytics" else
                     FastValidator(loader, hyp, tmp_path / name, batch=32, amp_dtype=torch.float16, log=print))
        validator.validate(ema, Comm(), **kwargs)  # the preload and the graphs' capture
        results[name], _ = validator.validate(ema, Comm(), **kwargs)
    want, got = results["ultralytics"], results["fast"]
    assert want["metrics/recall(B)"] > 0 and want[f"metrics/recall({own})"] > 0 and list(got) == list(want)
    for key in ("metrics/mAP50(B)", "metrics/mAP50-95(B)", f"metrics/mAP50({own})", f"metrics/mAP50-95({own})"):
        assert abs(got[key] - want[key]) <= 0.05 * want[key] + 1e-4, (key, got[key], want[key])  # both in fp16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_fast_validator_on_cuda_gives_pose_validators_map(tmp_path):
    fast_and_ultralytics_on_cuda(tmp_path, "pose", a_pose_model_that_finds_objects, 64, "P")

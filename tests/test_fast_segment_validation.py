"""The fast validation engine for a segmentation model against Ultralytics' SegmentationValidator: the detections'
masks made from the prototypes, the targets' from the loader's overlapping masks, the true positives by mask IoU,
the mask metrics from the same predictions, and the same results as SegmentationValidator on a real segmentation
model and data (CPU, fp32). Detection's: tests/test_fast_validation.py; pose's: tests/test_fast_pose_validation.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from ultralytics.cfg import get_cfg
from ultralytics.models.yolo.segment import SegmentationValidator
from ultralytics.nn.tasks import SegmentationModel
from ultralytics.utils import metrics, ops

from launcher.inputs.shapes import CLASSES
from launcher.rank.group.dist import Comm
from launcher.rank.ultralytics import datasets
from launcher.rank.ultralytics.fast_validation import FastValidator, claims_rule, gathered_stats, nms_settings
from launcher.rank.ultralytics.validation import Validator
from launcher.rank.validate.engine import NmsSettings, run_pass
from launcher.rank.validate.masks import predicted_masks, target_masks
from launcher.rank.validate.nms import batched_nms
from launcher.rank.validate.store import PreloadedSplit

from tests.test_fast_pose_validation import fast_and_ultralytics_on_cuda, split_data
from tests.test_fast_validation import NC, _loader_batches, head_output
from tests.test_validation_split import finding_boxes

NM = 8  # mask coefficients per detection (Ultralytics' heads have 32; any number is the same operations)


def overlap_masks(batch: dict, ratio: int = 4) -> torch.Tensor:
    """(b, H / ratio, W / ratio) uint8 as Ultralytics' loader gives them with overlap_mask: each target's box
    filled with its index + 1, the larger first (a smaller target in front of a larger one)."""
    b, _, h, w = batch["img"].shape
    masks = torch.zeros((b, h // ratio, w // ratio), dtype=torch.uint8)
    idx = batch["batch_idx"].long()
    for i in range(b):
        xywh = batch["bboxes"][idx == i] * torch.tensor([w, h, w, h]) / ratio
        for j in (xywh[:, 2] * xywh[:, 3]).argsort(descending=True).tolist():
            x, y, bw, bh = xywh[j].tolist()
            masks[i, round(y - bh / 2) : round(y + bh / 2), round(x - bw / 2) : round(x + bw / 2)] = j + 1
    return masks


def segment_batches(b: int, per_batch: int, shape=(96, 128), seed: int = 5) -> list[dict]:
    return [{**batch, "masks": overlap_masks(batch)} for batch in _loader_batches(b, per_batch, shape, seed)]


def segment_output(b: int, anchors: int, shape, seed: int):
    """A segmentation model's eval output ((rows, prototypes), None): head_output's rows with NM mask coefficients
    each, and prototypes whose first channel is 1 (the coefficient there a detection's bias, in (-0.5, 2)) and the
    rest noise: each detection's mask fills between none and all of its box."""
    g = torch.Generator().manual_seed(seed)
    bias = torch.rand(b, 1, anchors, generator=g) * 2.5 - 0.5
    coefficients = torch.cat([bias, torch.randn(b, NM - 1, anchors, generator=g)], 1)
    proto = torch.cat([torch.ones(b, 1, shape[0] // 4, shape[1] // 4),
                       torch.randn(b, NM - 1, shape[0] // 4, shape[1] // 4, generator=g) * 0.2], 1)
    return (torch.cat([head_output(b, NC, anchors, seed=seed, size=90.0), coefficients], 1), proto), None


def test_the_masks_of_detections_and_targets_are_ultralytics():
    """predicted_masks is ops.process_mask image by image; target_masks is SegmentationValidator._prepare_batch's
    masks, also where the loader's masks are not at a quarter of the input (mask_ratio 2: resized)."""
    g = torch.Generator().manual_seed(0)
    proto, coefficients = torch.randn(3, NM, 24, 32, generator=g), torch.randn(3, 50, NM, generator=g)
    xy, wh = torch.rand(3, 50, 2, generator=g) * 128, torch.rand(3, 50, 2, generator=g) * 60
    boxes = torch.cat([xy - wh / 2, xy + wh / 2], -1)
    got = predicted_masks(proto, coefficients, boxes, (96, 128))
    for i in range(3):
        assert torch.equal(got[i], ops.process_mask(proto[i], coefficients[i], boxes[i], shape=(96, 128))), i
    batch = segment_batches(4, 4)[0]
    v = SegmentationValidator(args={"overlap_mask": True})
    v.process = ops.process_mask
    for ratio in 4, 2:
        batch["masks"] = overlap_masks(batch, ratio)
        counts = torch.bincount(batch["batch_idx"].long(), minlength=4)
        mine = target_masks(batch["masks"], int(counts.max()), (24, 32))
        for i in range(4):
            want = v._prepare_batch(i, {**batch, "masks": batch["masks"].float()})["masks"]
            assert torch.equal(mine[i, : counts[i]], want), (ratio, i)
            assert not mine[i, counts[i]:].any()  # padding: no pixels


def test_the_mask_matching_a_few_images_at_a_time_is_the_same_as_all_at_once(monkeypatch):
    """mask_true_positives holds MASK_ELEMENTS mask pixels at once: one image at a time gives the same flags."""
    from launcher.rank.validate import masks

    batch = segment_batches(6, 6)[0]
    (rows, proto), _ = segment_output(6, 120, (96, 128), seed=3)
    det = batched_nms(rows, 0.001, 0.7, max_det=100, nc=NC)
    split = PreloadedSplit.load([batch], torch.device("cpu"))
    vb = next(split.batches(6))
    args = (proto, det.extra, det.boxes, det.cls, det.valid(), vb.masks, vb.cls, vb.valid(), (96, 128))
    at_once = masks.mask_true_positives(*args)
    monkeypatch.setattr(masks, "MASK_ELEMENTS", 1)
    assert at_once.any() and torch.equal(masks.mask_true_positives(*args), at_once)


def _segment_validator(save_dir) -> SegmentationValidator:
    v = SegmentationValidator(save_dir=save_dir, args={"conf": None, "plots": False})  # conf 0.001, as in training
    v.training, v.device, v.data = True, torch.device("cpu"), {"val": ""}
    v.init_metrics(SimpleNamespace(names=dict(enumerate(CLASSES))))
    return v


@pytest.mark.parametrize("replayed,per_image", [(False, False), (True, False), (False, True)])
def test_mask_metrics_from_the_same_predictions_equal_segmentation_validators(tmp_path, monkeypatch, replayed,
                                                                              per_image):
    """SegmentationValidator's postprocess and update_metrics per batch against the fast engine's pass over the same
    batches preloaded, two ranks' shards gathered in rank order: box and mask metrics equal. `per_image`: the
    matching by the validator's own match_predictions (where the installed release does not claim greedily)."""
    from launcher.rank.ultralytics import releases

    if per_image:
        monkeypatch.setattr(releases, "GREEDY_MATCHING", False)
    batches = segment_batches(10, 4)
    preds = [segment_output(len(b["im_file"]), 300, (96, 128), seed=5 + k) for k, b in enumerate(batches)]
    ref = _segment_validator(tmp_path)
    for batch, pred in zip(batches, preds):
        batch = {**batch, "img": batch["img"].float() / 255, "masks": batch["masks"].float()}
        ref.update_metrics(ref.postprocess(((pred[0][0].clone(), pred[0][1]), None)), batch)
    want = ref.get_stats()

    per_rank = []
    for shard_batches, shard_preds in (batches[:2], preds[:2]), (batches[2:], preds[2:]):
        split = PreloadedSplit.load(shard_batches, torch.device("cpu"))
        replies = iter(shard_preds)
        static = (torch.zeros_like(shard_preds[0][0][0]), torch.zeros_like(shard_preds[0][0][1]))

        def forward(img):
            (rows, proto), _ = next(replies)
            if replayed:  # a graph's outputs: the same tensors each batch
                return (static[0][: len(rows)].copy_(rows), static[1][: len(rows)].copy_(proto)), None
            return (rows, proto), None

        result = run_pass(split, forward, batch=4, nc=NC, nms=nms_settings(ref.args, False), masks=True,
                          claim=claims_rule(ref))
        per_rank.append(result.stats)
    mine = _segment_validator(tmp_path)
    mine.metrics.stats = gathered_stats(per_rank)
    got = mine.get_stats()
    assert want["metrics/recall(M)"] > 0.05 and want["metrics/mAP50-95(M)"] < want["metrics/mAP50(M)"]
    assert want["metrics/mAP50(M)"] != want["metrics/mAP50(B)"]  # the masks' own matches, not the boxes'
    nothing = run_pass(PreloadedSplit.load(batches[:1], torch.device("cpu")), lambda img: preds[0], batch=4, nc=NC,
                       nms=NmsSettings(conf=2.0), masks=True)  # no detection above conf
    assert nothing.stats["tp_m"].shape == (0, 10) and len(nothing.stats["target_cls"]) > 0
    assert list(got) == list(want)
    for k in want:
        assert got[k] == pytest.approx(want[k], abs=1e-6), k


@pytest.fixture(scope="module", params=["shapes", "crowded"])
def segment_split(request, tmp_path_factory):
    """The shapes' polygons; crowded: the same with an image without targets (Ultralytics' loader gives its mask in
    float, and so the batch's) and one with 300 more (its mask in int32), in one batch."""
    data = split_data(tmp_path_factory.mktemp("segment"), "segment", 6)
    if request.param == "crowded":
        labels = sorted((Path(data["val"]).parent.parent / "labels" / "val").glob("*.txt"))
        labels[0].write_text("")
        squares = [(0.02 + 0.048 * (i % 20), 0.03 + 0.064 * (i // 20)) for i in range(300)]  # 3 px each, a grid
        with labels[1].open("a") as f:
            f.writelines(f"{i % 3} {x:.4f} {y:.4f} {x + 0.03:.4f} {y:.4f} {x + 0.03:.4f} {y + 0.04:.4f} {x:.4f} "
                         f"{y + 0.04:.4f}\n" for i, (x, y) in enumerate(squares))
    return data


def a_segment_model_that_finds_objects(data: dict) -> SegmentationModel:
    """yolov8n-seg whose head finds some shapes untrained: boxes one stride each side of every anchor, scores spread
    over (0, 1), and masks that fill most of each box (the prototypes' first channel a constant the coefficients
    weigh most, the others the untrained network's)."""
    torch.manual_seed(0)
    model = SegmentationModel("yolov8n-seg.yaml", nc=data["nc"], verbose=False)
    model.args, model.names = get_cfg(overrides={"task": "segment"}), data["names"]
    head = model.model[-1]
    last = head.proto.cv3  # Conv: conv, bn, act
    finding_boxes(head)
    with torch.no_grad():
        for level in head.cv4:
            level[-1].weight.zero_()
            level[-1].bias.copy_(torch.cat([torch.tensor([3.0]), torch.randn(head.nm - 1) * 0.1]))
        last.conv.weight[0].zero_()
        last.bn.weight[0], last.bn.bias[0] = 0.0, 1.0  # channel 0: SiLU(1) everywhere
    return model


def loss_names(model) -> tuple[str, ...]:
    """The model's loss items (the trainer's), as its criterion names them."""
    return model.init_criterion().loss_names


def test_the_fast_validator_gives_what_segmentation_validator_gives_on_a_real_model(segment_split, tmp_path,
                                                                                    monkeypatch, request):
    """A segmentation model's weights and a polygon split through both engines: the metric keys (box and mask),
    their values, the validation losses (the masks' among them) and the confusion matrix equal (CPU, fp32). The
    plots handed to be drawn: the first batch's labels and predictions with their masks, drawn."""
    from ultralytics.models.yolo.detect import DetectionValidator

    drawn = []
    monkeypatch.setattr(DetectionValidator, "plot_val_samples", lambda v, batch, ni: drawn.append(("labels", batch)))
    monkeypatch.setattr(DetectionValidator, "plot_predictions",
                        lambda v, batch, preds, ni, **kw: drawn.append(("predictions", preds)))
    for owner, name in [(metrics.ConfusionMatrix, "plot"), (metrics, "plot_pr_curve"), (metrics, "plot_mc_curve")]:
        monkeypatch.setattr(owner, name, lambda *args, **kwargs: None)
    ema = SimpleNamespace(ema=a_segment_model_that_finds_objects(segment_split))
    hyp = get_cfg(overrides={"imgsz": 128, "plots": False, "task": "segment"})
    loaders = [datasets.val_loader(hyp, segment_split, 4, 32, 0, torch.device("cpu")) for _ in range(2)]
    kwargs = dict(device=torch.device("cpu"), data=segment_split, amp=False, epoch=0, epochs=1,
                  loss_items={k: torch.zeros(()) for k in loss_names(ema.ema)})
    ref = Validator(loaders[0], hyp, tmp_path / "a")
    want, want_fitness = ref.validate(ema, Comm(), **kwargs)
    fast = FastValidator(loaders[1], hyp, tmp_path / "b", batch=4, amp_dtype=None, cuda_graphs=False, log=print)
    drawings = []
    got, got_fitness = fast.validate(ema, Comm(), **kwargs, plots=True, draw=lambda what, drawing: drawings.append(
        drawing))
    assert isinstance(fast.validator, SegmentationValidator)
    assert list(got) == list(want) and "metrics/mAP50-95(M)" in got and "val/seg_loss" in got
    assert got == pytest.approx(want, abs=1e-4) and got_fitness == pytest.approx(want_fitness, abs=1e-4)
    assert want["metrics/recall(B)"] > 0 and want["metrics/recall(M)"] > 0  # not a comparison of zeros
    assert want["metrics/mAP50-95(M)"] != want["metrics/mAP50-95(B)"]
    most = max(int(g.masks.max()) for g in fast.split.groups.values())  # the split's target indices, kept whole
    assert (most > 255) == (request.node.callspec.params["segment_split"] == "crowded")
    drawings[0]()
    (_, labels), (_, preds) = drawn[:2]
    assert labels["masks"].shape[0] == labels["img"].shape[0] and labels["masks"].max() >= 1
    h, w = labels["img"].shape[2:]
    assert preds[0]["masks"].shape == (len(preds[0]["cls"]), h // 4, w // 4) and preds[0]["masks"].any()


def test_the_fast_validator_refuses_separate_masks(tmp_path):
    hyp = get_cfg(overrides={"task": "segment", "overlap_mask": False})
    with pytest.raises(ValueError, match="overlap_mask"):
        FastValidator(None, hyp, tmp_path, batch=4, amp_dtype=None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_fast_validator_on_cuda_gives_segmentation_validators_map(tmp_path):
    fast_and_ultralytics_on_cuda(tmp_path, "segment", a_segment_model_that_finds_objects, 128, "M")

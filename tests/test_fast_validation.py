"""The fast validation engine (val.engine=fast) against Ultralytics' own: the same boxes kept by NMS, the same true
positives, the same metrics from the same predictions, and the same results as DetectionValidator on a real model
and data (CPU, fp32: the same pixels and arithmetic, so to 1e-4)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from ultralytics.models.yolo.detect import DetectionValidator
from ultralytics.utils import nms as ultralytics_nms

from launcher.inputs.shapes import CLASSES
from launcher.rank.ultralytics.fast_validation import claims_rule, gathered_stats, nms_settings
from launcher.rank.validate.engine import run_pass
from launcher.rank.validate.matching import IOU_THRESHOLDS, true_positives
from launcher.rank.validate.nms import batched_nms
from launcher.rank.validate.store import PreloadedSplit

NC = 3
# Ultralytics' NMS is handed a copy of the predictions: up to 8.4.159 it converts their boxes to xyxy in place.


def head_output(b: int, nc: int, anchors: int, seed: int, size: float = 160.0) -> torch.Tensor:
    """A detector's inference output (B, 4 + nc, anchors): xywh boxes crowded around a few objects, scores in [0, 1)
    (cubed: most near 0, as a trained head's)."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.rand(b, 2, 5, generator=g) * size
    pick = torch.randint(0, 5, (b, 1, anchors), generator=g).expand(b, 2, anchors)
    xy = centres.gather(2, pick) + torch.randn(b, 2, anchors, generator=g) * 4
    wh = 10 + torch.rand(b, 2, anchors, generator=g) * 30
    return torch.cat([xy, wh, torch.rand(b, nc, anchors, generator=g) ** 3], 1)


def rows(det, i: int) -> torch.Tensor:
    n = int(det.count[i])
    return torch.cat([det.boxes[i, :n], det.conf[i, :n, None], det.cls[i, :n, None]], 1)


@pytest.mark.parametrize("nc,multi_label,agnostic,max_det", [
    (3, True, False, 300), (3, True, False, 40), (1, True, False, 300), (3, False, False, 300), (3, True, True, 300),
    (12, True, False, 100),
])
def test_batched_nms_keeps_the_boxes_ultralytics_keeps(nc, multi_label, agnostic, max_det):
    pred = head_output(4, nc, 120 if nc < 10 else 40, seed=nc + max_det)
    ref = ultralytics_nms.non_max_suppression(pred.clone(), 0.001, 0.7, multi_label=multi_label, agnostic=agnostic,
                                              max_det=max_det)
    det = batched_nms(pred, 0.001, 0.7, max_det=max_det, multi_label=multi_label, agnostic=agnostic)
    assert sum(len(r) for r in ref) > 4 * 20  # enough survivors, and suppression happened
    for i, want in enumerate(ref):
        assert torch.equal(rows(det, i), want), i


@pytest.mark.parametrize("max_det", [300, 30, 3])
def test_images_with_more_candidates_than_a_chunk_keep_the_boxes_ultralytics_keeps(monkeypatch, max_det):
    """A weak model's tens of thousands of candidates per image, at a small scale: the later chunks lose boxes to
    the survivors of the earlier ones (max_det 300: every chunk runs), or are never looked at (max_det 3)."""
    from launcher.rank.validate import nms

    monkeypatch.setattr(nms, "CHUNK", 64)  # image 0 has ~600 candidates, the others fewer than 64
    pred = head_output(3, 3, 200, seed=7)
    pred[1:, 4:] *= 0.05
    ref = ultralytics_nms.non_max_suppression(pred.clone(), 0.001, 0.7, multi_label=True, max_det=max_det)
    det = batched_nms(pred, 0.001, 0.7, max_det=max_det)
    assert len(ref[0]) == max_det or len(ref[0]) > 64  # image 0's survivors span several chunks
    for i, want in enumerate(ref):
        assert torch.equal(rows(det, i), want), i


def test_a_chain_of_overlapping_boxes_is_suppressed_as_greedy_nms_does():
    """40 boxes in a row, each overlapping the next (IoU 0.78) but not the one after (0.6), in descending score:
    greedy NMS keeps every second box, each survivor decided by the one before it (a suppressed box suppresses
    nothing); one box per image."""
    n = 40
    xywh = torch.stack([100 + 5 * torch.arange(n), torch.full((n,), 100), torch.full((n,), 40),
                        torch.full((n,), 40)]).float()
    pred = torch.cat([xywh, (0.9 - 0.01 * torch.arange(n)).float()[None]])[None].repeat(2, 1, 1)
    pred[1, 4, 1::2] = 0  # the second image: the odd boxes below conf, nothing suppressed
    ref = ultralytics_nms.non_max_suppression(pred.clone(), 0.001, 0.7, max_det=300)
    det = batched_nms(pred, 0.001, 0.7, max_det=300)
    assert [len(r) for r in ref] == [20, 20] and torch.equal(ref[0][:, 0], 80 + 10 * torch.arange(20).float())
    for i, want in enumerate(ref):
        assert torch.equal(rows(det, i), want), i


def compare_scans_in_interpreter() -> None:
    """Run in a process started with TRITON_INTERPRET=1: batched NMS and the matching with their Triton scans
    (scans.py, on CPU tensors) against Ultralytics, and each scan against the PyTorch form it replaces."""
    from launcher.rank.kernels import scans
    from launcher.rank.validate import matching, nms

    assert scans.usable(torch.zeros(1)), "Triton's interpreter is not active"
    for nc, multi_label, max_det in ((3, True, 300), (1, True, 40)):
        pred = head_output(2, nc, 100, seed=nc + max_det)
        ref = ultralytics_nms.non_max_suppression(pred.clone(), 0.001, 0.7, multi_label=multi_label, max_det=max_det)
        det = batched_nms(pred, 0.001, 0.7, max_det=max_det, multi_label=multi_label)
        assert all(torch.equal(rows(det, i), want) for i, want in enumerate(ref)), (nc, multi_label, max_det)
    g = torch.Generator().manual_seed(0)
    xy = torch.rand(2, 200, 2, generator=g) * 200
    boxes = torch.cat([xy, xy + 1 + torch.rand(2, 200, 2, generator=g) * 60], -1)
    boxes[:, 1::7] = boxes[:, ::7][:, : boxes[:, 1::7].shape[1]]  # identical boxes (IoU 1)
    alive = torch.rand(2, 200, generator=g) > 0.1
    full = nms._torchvision_nms(boxes, alive, 0.7)
    assert torch.equal(scans.greedy_nms(boxes, alive, 0.7), full)
    scans.CANDIDATES = 64  # four tiles: the later ones lose boxes to the earlier ones' survivors
    assert torch.equal(scans.greedy_nms(boxes, alive, 0.7), full)
    for limit in (5, 70):  # the first `limit` survivors, not one more (inside the first tile, and after it)
        assert torch.equal(scans.greedy_nms(boxes, alive, 0.7, limit=limit), full & (full.cumsum(1) <= limit))
    pred = head_output(3, 3, 200, seed=7)  # image 0: ~600 candidates, ten tiles
    for max_det in (300, 3):
        ref = ultralytics_nms.non_max_suppression(pred.clone(), 0.001, 0.7, multi_label=True, max_det=max_det)
        det = batched_nms(pred, 0.001, 0.7, max_det=max_det)
        assert all(torch.equal(rows(det, i), want) for i, want in enumerate(ref)), max_det
    scans.CANDIDATES = 2048
    pred = head_output(3, NC, 150, seed=3)
    det = batched_nms(pred, 0.001, 0.7, max_det=300)
    cls, truth, count = _targets(3, seed=3)
    valid_t = torch.arange(cls.shape[1]) < count[:, None]
    iou = matching.box_iou(truth, det.boxes) * ((cls[:, :, None] == det.cls[:, None, :]) & valid_t[:, :, None]
                                                & det.valid()[:, None, :])
    ours = scans.claims(iou, IOU_THRESHOLDS)
    assert torch.equal(ours, matching._claims(iou, IOU_THRESHOLDS)) and ours.sum() > 10
    print("the scans agree")


def test_the_triton_scans_keep_and_match_what_ultralytics_does():
    """Greedy NMS and the matching as one Triton program per image (what CUDA runs), through Triton's interpreter:
    the boxes Ultralytics keeps, and the PyTorch forms' answers, identical boxes and ties included."""
    import os
    import subprocess
    import sys

    code = "from tests.test_fast_validation import compare_scans_in_interpreter; compare_scans_in_interpreter()"
    r = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent.parent, capture_output=True, text=True,
                       timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "the scans agree" in r.stdout


def test_an_end_to_end_head_is_only_filtered_by_confidence():
    g = torch.Generator().manual_seed(0)
    pred = torch.rand(4, 50, 6, generator=g)
    ref = ultralytics_nms.non_max_suppression(pred.clone(), 0.3, 0.7, max_det=20, end2end=True)
    det = batched_nms(pred, 0.3, 0.7, max_det=20, end2end=True)
    for i, want in enumerate(ref):
        assert torch.equal(rows(det, i), want), i


def _targets(b: int, seed: int, size: float = 160.0, most: int = 6):
    """Per image 0..most targets (cls, xyxy in pixels), padded: (cls (B, T), boxes (B, T, 4), count (B,)); placed
    where head_output(seed=seed) crowds its boxes, so that detections match some at some thresholds."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.rand(b, 2, 5, generator=g) * size  # head_output's first draw with this seed
    count = torch.randint(0, most + 1, (b,), generator=g)
    count[0] = most
    xy = centres.transpose(1, 2)[:, torch.arange(most) % 5] + torch.randn(b, most, 2, generator=g) * 3
    wh = 15 + torch.rand(b, most, 2, generator=g) * 20
    return torch.randint(0, NC, (b, most), generator=g).float(), torch.cat([xy - wh / 2, xy + wh / 2], -1), count


def test_true_positives_are_ultralytics_match_predictions(tmp_path):
    pred = head_output(6, NC, 200, seed=3)
    det = batched_nms(pred, 0.001, 0.7, max_det=300)
    cls, boxes, count = _targets(6, seed=3)
    valid_t = torch.arange(cls.shape[1]) < count[:, None]
    tp = true_positives(det.boxes, det.cls, det.valid(), boxes, cls, valid_t)
    v = DetectionValidator(save_dir=tmp_path, args={"conf": 0.001, "plots": False})
    total = 0
    for i in range(6):
        n, m = int(det.count[i]), int(count[i])
        want = v._process_batch({"cls": det.cls[i, :n], "bboxes": det.boxes[i, :n]},
                                {"cls": cls[i, :m], "bboxes": boxes[i, :m]})["tp"]
        assert np.array_equal(tp[i, :n].numpy(), want), i
        total += want.sum()
    assert tp[..., 0].sum() > 10 and tp[..., -1].sum() < tp[..., 0].sum()  # matches, fewer at stricter thresholds


def _loader_batches(b: int, per_batch: int, shape=(96, 128), seed: int = 5) -> list[dict]:
    """Batches as Ultralytics' validation loader collates them (uint8 images, flat normalised xywh labels); batch k's
    targets lie where head_output(seed=seed + k, size=90) crowds its boxes."""
    g = torch.Generator().manual_seed(seed)
    h, w = shape
    out = []
    for k, start in enumerate(range(0, b, per_batch)):
        n = min(per_batch, b - start)
        cls, xyxy, count = _targets(n, seed + k, size=90.0)
        idx, c, xywh = [], [], []
        for i in range(n):
            m = int(count[i])
            box = xyxy[i, :m]
            idx += [i] * m
            c.append(cls[i, :m])
            xywh.append(torch.cat([(box[:, :2] + box[:, 2:]) / 2, box[:, 2:] - box[:, :2]], 1) / torch.tensor([w, h, w, h]))
        out.append({"img": torch.randint(0, 255, (n, 3, h, w), dtype=torch.uint8, generator=g),
                    "batch_idx": torch.tensor(idx, dtype=torch.float32), "cls": torch.cat(c)[:, None],
                    "bboxes": torch.cat(xywh), "im_file": [f"im{start + i}.jpg" for i in range(n)],
                    "ori_shape": [(h, w)] * n, "ratio_pad": [((1.0, 1.0), (0.0, 0.0))] * n})
    return out


def _ultralytics_validator(save_dir: Path):
    v = DetectionValidator(save_dir=save_dir, args={"conf": None, "plots": False})  # conf 0.001, as in training
    v.training, v.device, v.data = True, torch.device("cpu"), {"val": ""}
    v.init_metrics(SimpleNamespace(names=dict(enumerate(CLASSES))))
    return v


@pytest.mark.parametrize("replayed", [False, True])
def test_metrics_from_the_same_predictions_equal_ultralytics(tmp_path, replayed):
    """Ultralytics' postprocess and update_metrics per batch, against the fast engine's pass over the same batches
    preloaded (two ranks' shards gathered in rank order, as rank 0 does). `replayed`: the forward writes every
    batch's output into the same tensor, as a replayed CUDA graph does: each batch is post-processed before the
    next forward."""
    batches = _loader_batches(10, 4)
    preds = [head_output(len(b["im_file"]), NC, 300, seed=5 + k, size=90.0) for k, b in enumerate(batches)]
    ref = _ultralytics_validator(tmp_path)
    for batch, pred in zip(batches, preds):
        ref.update_metrics(ref.postprocess(pred.clone()), {**batch, "img": batch["img"].float() / 255})
    want = ref.get_stats()

    shards = [(batches[:2], preds[:2]), (batches[2:], preds[2:])]
    per_rank = []
    for shard_batches, shard_preds in shards:
        split = PreloadedSplit.load(shard_batches, torch.device("cpu"))
        replies, static = iter(shard_preds), torch.zeros_like(shard_preds[0])

        def forward(img):
            pred = next(replies)
            return static[: len(pred)].copy_(pred) if replayed else pred

        result = run_pass(split, forward, batch=4, nc=NC, nms=nms_settings(ref.args, False), claim=claims_rule(ref))
        per_rank.append(result.stats)
    mine = _ultralytics_validator(tmp_path)
    mine.metrics.stats = gathered_stats(per_rank)
    got = mine.get_stats()
    assert want["metrics/mAP50(B)"] > 0.02  # the predictions do find targets
    for k in want:
        assert got[k] == pytest.approx(want[k], abs=1e-4), k
    assert got == want  # and in fact exactly


def _stats(n: int, nc: int, targets: int, seed: int) -> dict[str, np.ndarray]:
    """DetMetrics.stats as a validation collects them, with many confidence ties (fp16 values, as the network's) and
    classes without predictions or without targets."""
    rng = np.random.default_rng(seed)
    conf = (rng.random(n) ** 3).astype(np.float16).astype(np.float32)
    return {"tp": rng.random((n, 10)) < np.linspace(0.4, 0.05, 10), "conf": conf,
            "pred_cls": rng.integers(0, nc, n).astype(np.float32),
            "target_cls": rng.integers(1, nc + 2, targets).astype(np.float32),  # class 0 never a target, nc+1 never
            "target_img": rng.integers(0, nc, targets // 2).astype(np.float32)}  # predicted


@pytest.mark.parametrize("n,nc,seed", [(0, 3, 0), (1, 3, 1), (5000, 3, 2), (20000, 80, 3)])
def test_the_metrics_grouped_by_class_are_ultralytics_bit_for_bit(n, nc, seed):
    """class_metrics.ap_per_class against Ultralytics' on the same statistics: every array it returns equal, ties in
    confidence included, also for class ids that are not whole numbers (grouped by their float values); and
    DetMetrics' results through class_metrics.process equal get_stats'."""
    from ultralytics.utils import metrics

    from launcher.rank.ultralytics import class_metrics

    st = _stats(n, nc, 300, seed)
    want = metrics.ap_per_class(st["tp"], st["conf"], st["pred_cls"], st["target_cls"])
    got = class_metrics.ap_per_class(st["tp"], st["conf"], st["pred_cls"], st["target_cls"])
    odd = {"pred_cls": st["pred_cls"] + 0.5, "target_cls": st["target_cls"] + 0.5}
    for a, b in zip(class_metrics.ap_per_class(st["tp"], st["conf"], odd["pred_cls"], odd["target_cls"]),
                    metrics.ap_per_class(st["tp"], st["conf"], odd["pred_cls"], odd["target_cls"])):
        assert np.array_equal(a, b)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and np.array_equal(a, b), (a, b)
    if n >= 5000:
        assert len(np.unique(st["conf"])) < 0.8 * n and want[5].max() > 0  # ties, and some AP to get right
    names = {i: str(i) for i in range(nc + 2)}
    ours, theirs = metrics.DetMetrics(names=names), metrics.DetMetrics(names=names)
    for m in ours, theirs:
        for k, v in st.items():
            m.stats[k].append(v)
    theirs.process()
    class_metrics.process(ours)
    assert ours.results_dict == theirs.results_dict
    assert np.array_equal(ours.nt_per_class, theirs.nt_per_class)
    assert np.array_equal(ours.nt_per_image, theirs.nt_per_image)
    assert np.array_equal(ours.box.ap_class_index, theirs.box.ap_class_index)


@pytest.mark.parametrize("kind,key,suffix", [("PoseMetrics", "tp_p", "P"), ("SegmentMetrics", "tp_m", "M")])
def test_a_tasks_own_metrics_grouped_by_class_are_its_metrics_process(kind, key, suffix):
    """class_metrics.process on PoseMetrics' (SegmentMetrics') statistics: its box and pose (mask) results as its own
    process gives them."""
    from ultralytics.utils import metrics

    from launcher.rank.ultralytics import class_metrics

    st = _stats(5000, 3, 300, seed=4)
    st[key] = np.random.default_rng(5).random((5000, 10)) < np.linspace(0.3, 0.02, 10)
    names = {i: str(i) for i in range(5)}
    ours, theirs = getattr(metrics, kind)(names=names), getattr(metrics, kind)(names=names)
    ours.stats, theirs.stats = {k: [v] for k, v in st.items()}, {k: [v] for k, v in st.items()}
    theirs.process()
    class_metrics.process(ours)
    assert ours.results_dict == theirs.results_dict and theirs.results_dict[f"metrics/mAP50({suffix})"] > 0

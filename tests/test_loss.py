"""The training loss (rank/ultralytics/loss.py) is Ultralytics' loss: the same values and gradients, to float
rounding, with and without the sync-free parts, for every detection family's criterion."""

from __future__ import annotations

import pytest
import torch

from launcher.rank.data.pipeline import MAX_TARGETS, max_targets_per_image
from launcher.rank.ultralytics.loss import DenseBboxLoss, DenseTaskAlignedAssigner, DetectionLoss
from launcher.rank.ultralytics.task_loss import OBBLoss, training_criterion

IMGSZ, BATCH = 128, 6


def _model(yaml: str = "yolov8n.yaml"):
    from ultralytics.cfg import get_cfg
    from ultralytics.nn.tasks import DetectionModel, OBBModel, SegmentationModel

    torch.manual_seed(0)
    model = (SegmentationModel if "-seg" in yaml else OBBModel if "-obb" in yaml else DetectionModel)(
        yaml, nc=3, verbose=False)
    model.args = get_cfg()
    return model.train()


def _batch(counts: list[int], seed: int) -> dict:
    """Random boxes, `counts[i]` in image i (grouped by image, as the collate function makes them): small ones
    (below the assigner's stride floor), large overlapping ones, and images without any."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i, n in enumerate(counts):
        for _ in range(n):
            wh = torch.rand(2, generator=g) * 0.6 + 0.02
            cxy = wh / 2 + torch.rand(2, generator=g) * (1 - wh)
            rows.append([i, float(torch.randint(0, 3, (1,), generator=g)), *cxy.tolist(), *wh.tolist()])
    t = torch.tensor(rows, dtype=torch.float32).view(-1, 6)
    return {
        "img": torch.rand(len(counts), 3, IMGSZ, IMGSZ, generator=g),
        "batch_idx": t[:, 0],
        "cls": t[:, 1:2],
        "bboxes": t[:, 2:],
    }


def _loss_and_grads(model, criterion, batch):
    model.zero_grad()
    preds = model(batch["img"])
    loss, items = criterion(preds, batch)
    loss.sum().backward()
    return loss.detach(), {k: v.detach() for k, v in items.items()}, [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize(
    "counts",
    [[3, 0, 7, 1, 2, 5], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 4], [0] * BATCH, [12, 9, 0, 11, 2, 10]],
    ids=["mixed", "one-each", "one-image", "no-targets", "crowded"],
)
@pytest.mark.parametrize("host_count", [True, False], ids=["host-count", "device-count"])
@pytest.mark.parametrize("sync_free", [True, False], ids=["sync-free", "ultralytics-parts"])
def test_the_training_loss_equals_ultralytics_loss(counts, host_count, sync_free):
    model = _model()
    batch = _batch(counts, seed=sum(counts))
    ours, detection = training_criterion(model, sync_free=sync_free)
    assert detection and type(ours) is DetectionLoss
    theirs = model.init_criterion()
    ours_batch = {**batch, MAX_TARGETS: max_targets_per_image(batch["batch_idx"], BATCH) if host_count else None}

    ref_loss, ref_items, ref_grads = _loss_and_grads(model, theirs, batch)
    loss, items, grads = _loss_and_grads(model, ours, ours_batch)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for k in ref_items:
        torch.testing.assert_close(items[k], ref_items[k], rtol=1e-5, atol=1e-6, msg=k)
    assert len(grads) == len(ref_grads)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    if sum(counts):
        assert ref_loss.sum() > 0 and any(g.abs().sum() > 0 for g in ref_grads), "the case trained nothing"


def test_each_detection_familys_loss_gets_the_global_normaliser_and_the_sync_free_parts():
    from ultralytics.utils.loss import BboxLoss, E2ELoss, TaskAlignedAssigner, v8OBBLoss, v8SegmentationLoss

    from launcher.rank.ultralytics.task_loss import SegmentationLoss

    v8, _ = training_criterion(_model())
    assert type(v8.assigner) is DenseTaskAlignedAssigner and type(v8.bbox_loss) is DenseBboxLoss
    plain, _ = training_criterion(_model(), sync_free=False)
    assert type(plain) is DetectionLoss  # the global normaliser either way
    assert type(plain.assigner) is TaskAlignedAssigner and type(plain.bbox_loss) is BboxLoss
    e2e, detection = training_criterion(_model("yolo26n.yaml"))
    assert detection and type(e2e) is E2ELoss
    assert type(e2e.one2many) is type(e2e.one2one) is DetectionLoss
    assert (e2e.one2many.assigner.topk, e2e.one2one.assigner.topk, e2e.one2one.assigner.topk2) == (10, 7, 1)
    seg, detection = training_criterion(_model("yolov8n-seg.yaml"))  # its box terms: tests/test_tasks.py
    assert detection and isinstance(seg, v8SegmentationLoss) and type(seg) is SegmentationLoss
    assert type(seg.boxes) is DetectionLoss and type(seg.boxes.assigner) is DenseTaskAlignedAssigner
    obb, detection = training_criterion(_model("yolov8n-obb.yaml"))  # its normaliser: tests/test_tasks.py
    assert detection and isinstance(obb, v8OBBLoss) and type(obb) is OBBLoss


def test_the_host_reads_the_largest_per_image_count_off_the_cpu_batch():
    batch_idx = torch.tensor([0, 0, 2, 2, 2, 5], dtype=torch.float32)
    assert max_targets_per_image(batch_idx, 6) == 3
    assert max_targets_per_image(torch.zeros(0), 6) == 0
    if torch.cuda.is_available():
        assert max_targets_per_image(batch_idx.cuda(), 6) is None  # on the device it would be a sync


@pytest.mark.parametrize("counts", [[3, 0, 7, 1, 2, 5], [0] * BATCH], ids=["mixed", "no-targets"])
def test_targets_padded_to_a_larger_bucket_give_the_same_loss_and_gradients(counts):
    """The captured step pads every image's targets to a fixed bucket (rank/step/captured_step.py): the zero rows
    are masked out of the assignment, so the loss is the one Ultralytics computes on its own padding."""
    from launcher.rank.ultralytics.loss import PADDED_TARGETS

    model = _model()
    batch = _batch(counts, seed=3)
    theirs = model.init_criterion()
    ours, _ = training_criterion(model)
    ref_loss, ref_items, ref_grads = _loss_and_grads(model, theirs, batch)
    for n in (max(counts), 16, 64):
        padded = ours.padded_targets(batch, n)
        assert padded.shape == (BATCH, n, 5)
        loss, items, grads = _loss_and_grads(model, ours, {"img": batch["img"], PADDED_TARGETS: padded, MAX_TARGETS: n})
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        for k in ref_items:
            torch.testing.assert_close(items[k], ref_items[k], rtol=1e-5, atol=1e-6, msg=k)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_the_dfl_term_is_ultralytics_bit_for_bit_and_its_backward_scatters_nothing():
    """loss.dfl_loss weighs the bins with a dense mask: the values and gradients of Ultralytics' DFLoss exactly (fp32
    and fp16 logits; targets on bin edges, inside bins, past the last bin), and a backward with no gather's scatter,
    which deterministic mode runs as a sort (the module docstring)."""
    from ultralytics.utils.loss import DFLoss

    from launcher.rank.ultralytics.loss import dfl_loss

    g = torch.Generator().manual_seed(0)
    edges = torch.tensor([[0.0, 1.0, 14.99, 15.0], [3.5, 7.0, 16.2, 0.01]])
    target = torch.cat([torch.rand(250, 4, generator=g) * 15, edges])
    for dtype in (torch.float32, torch.float16):
        logits = (torch.randn(len(target) * 4, 16, generator=g) * 3).to(dtype).requires_grad_()
        want = DFLoss(16)(logits, target.clone())
        (want_grad,) = torch.autograd.grad(want.sum(), logits)
        got = dfl_loss(logits, target.clone(), 16)
        (got_grad,) = torch.autograd.grad(got.sum(), logits)
        assert torch.equal(got, want) and torch.equal(got_grad, want_grad), dtype
    nodes, stack = set(), [got.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and type(node).__name__ not in nodes:
            nodes.add(type(node).__name__)
            stack.extend(n for n, _ in node.next_functions)
    assert not {n for n in nodes if "Gather" in n or "Index" in n or "Scatter" in n}, nodes

"""The sync-free detection loss is Ultralytics' loss: the same values and gradients, to float rounding."""

from __future__ import annotations

import pytest
import torch

from launcher.fast_loss import (
    MAX_TARGETS,
    DenseBboxLoss,
    DenseTaskAlignedAssigner,
    SyncFreeDetectionLoss,
    make_sync_free,
    max_targets_per_image,
)

IMGSZ, BATCH = 128, 6


def _model():
    from ultralytics.cfg import get_cfg
    from ultralytics.nn.tasks import DetectionModel

    torch.manual_seed(0)
    model = DetectionModel("yolov8n.yaml", nc=3, verbose=False)
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
def test_the_sync_free_loss_equals_ultralytics_loss(counts, host_count):
    model = _model()
    batch = _batch(counts, seed=sum(counts))
    ours = model.init_criterion()
    assert make_sync_free(ours) == 1
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


def test_only_ultralytics_own_detection_classes_are_swapped():
    from ultralytics.utils.loss import v8DetectionLoss, v8SegmentationLoss

    model = _model()
    criterion = model.init_criterion()
    assert type(criterion) is v8DetectionLoss
    make_sync_free(criterion)
    assert type(criterion) is SyncFreeDetectionLoss
    assert type(criterion.assigner) is DenseTaskAlignedAssigner and type(criterion.bbox_loss) is DenseBboxLoss
    assert make_sync_free(criterion) == 0, "a second call changes nothing"

    seg = object.__new__(v8SegmentationLoss)  # a subclass: left alone
    assert make_sync_free(seg) == 0 and type(seg) is v8SegmentationLoss


def test_the_host_reads_the_largest_per_image_count_off_the_cpu_batch():
    batch_idx = torch.tensor([0, 0, 2, 2, 2, 5], dtype=torch.float32)
    assert max_targets_per_image(batch_idx, 6) == 3
    assert max_targets_per_image(torch.zeros(0), 6) == 0
    assert max_targets_per_image(batch_idx, 6, read_device=True) == 3
    if torch.cuda.is_available():
        assert max_targets_per_image(batch_idx.cuda(), 6) is None  # on the device: only when asked (a sync)
        assert max_targets_per_image(batch_idx.cuda(), 6, read_device=True) == 3

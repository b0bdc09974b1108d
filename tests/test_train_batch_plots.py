"""train_batch<N>.jpg (rank/run/train_batches.py, rank/ultralytics/plots.py): what Ultralytics' plot_images is handed
for a batch of each kind, as Ultralytics' own trainers hand it: boxes, and a pose batch's keypoints or a segmentation
batch's masks with them; a classifier's batch as its classes per image."""

from __future__ import annotations

import torch

from launcher.rank.run.train_batches import host_copy
from launcher.rank.ultralytics import plots


def _drawn(batch: dict, monkeypatch) -> dict:
    import ultralytics.utils.plotting as plotting

    seen = {}
    monkeypatch.setattr(plotting, "plot_images", lambda labels, paths, fname, threaded: seen.update(labels))
    copy, copied = host_copy(batch)
    plots._plot_train_batch(copy, "unused.jpg", copied)
    return seen


def _batch(n: int = 20, **extra) -> dict:
    targets = 2 * n
    return {"img": torch.rand(n, 3, 8, 8), "im_file": [f"{i}.jpg" for i in range(n)],
            "batch_idx": torch.arange(targets).float() % n, "cls": torch.zeros(targets, 1),
            "bboxes": torch.rand(targets, 4), **extra}


def test_a_pose_batchs_keypoints_and_a_segmentation_batchs_masks_are_drawn_with_their_boxes(monkeypatch):
    keypoints = torch.rand(40, 17, 3)
    seen = _drawn(_batch(keypoints=keypoints), monkeypatch)
    assert torch.equal(seen["keypoints"], keypoints) and len(seen["bboxes"]) == 40
    assert len(seen["img"]) == 16  # plot_images draws 16 images; every label goes, it leaves out the others'
    masks = torch.randint(0, 3, (20, 2, 2), dtype=torch.uint8)
    assert torch.equal(_drawn(_batch(masks=masks), monkeypatch)["masks"], masks)
    assert "keypoints" not in _drawn(_batch(), monkeypatch)  # a detection batch: its boxes alone


def test_a_classifiers_batch_is_drawn_as_a_class_per_image(monkeypatch):
    seen = _drawn({"img": torch.rand(20, 3, 8, 8), "im_file": [f"{i}.jpg" for i in range(20)],
                   "cls": torch.arange(20)}, monkeypatch)
    assert torch.equal(seen["cls"], torch.arange(16)) and torch.equal(seen["batch_idx"], torch.arange(16))

"""A detection dataset labelled with polygons (as Ultralytics' COCO labels are) through the GPU input pipeline
(rank/gpu_data/gpu_augment.py): its polygons travel with their rows and make the boxes, as Ultralytics 8.4.190's
RandomPerspective makes them from the warped polygons, and the batch is a detector's (no masks). All on CPU tensors."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from launcher.rank.data.encoded import outlined
from launcher.rank.gpu_data import augment_segments
from launcher.rank.gpu_data.gpu_augment import GpuAugment
from tests.raw_batches import RawTrainDataset
from tests.test_gpu_augment import ultralytics_sample  # Ultralytics' detection transforms on our draws
from tests.test_gpu_keypoints import STRONG, shapes_data, ul  # noqa: F401 - ul: the module's Ultralytics fixture

IMGSZ = 128
M = augment_segments.SEGMENT_POINTS


@pytest.fixture(scope="module")
def polygon_data(tmp_path_factory) -> dict:
    return shapes_data(tmp_path_factory, "segment")  # label files of polygons


@pytest.fixture(scope="module")
def hyp(ul):
    get_cfg, _ = ul
    return get_cfg(overrides={"imgsz": IMGSZ, "task": "detect", **STRONG})


@pytest.mark.parametrize("mosaic", [True, False])
def test_a_detection_datasets_polygons_make_its_boxes_as_ultralytics_makes_them(ul, polygon_data, hyp, monkeypatch,
                                                                                 mosaic):
    """Rotation, shear and perspective: the same instances (segment2box's boxes, the 0.01 area rule) with the same
    boxes (1/20 pixel) and classes as Ultralytics', no masks; warping the boxes as boxes would not give them."""
    from launcher.rank.ultralytics.datasets import raw_train_dataset

    dataset = raw_train_dataset(hyp, polygon_data, 8)
    assert not dataset.use_segments and outlined(dataset)  # a detector's dataset whose label rows hold polygons
    raw_ds = RawTrainDataset(dataset, 0, mosaic=mosaic, segment_points=M)
    samples = [raw_ds[(0, i)] for i in range(16)]
    raw = raw_ds.collate_fn(samples)
    assert raw.segments is not None
    aug = GpuAugment(IMGSZ, hyp, segments=M, masks=False)
    params = aug.draw(raw, torch.Generator().manual_seed(3))
    ours = aug.apply(raw, params)
    assert "masks" not in ours and "sem_masks" not in ours
    as_boxes = GpuAugment(IMGSZ, hyp).apply(replace(raw, segments=None), params)  # the corners' boxes instead
    differs = False
    for b, sample in enumerate(samples):
        theirs = ultralytics_sample(ul, monkeypatch, raw_ds, hyp, params, b, [t.index for t in sample.tiles])
        mine = ours["batch_idx"] == b
        boxes, cls = ours["bboxes"][mine], ours["cls"][mine]
        assert len(boxes) == len(theirs["bboxes"]), b
        if not len(boxes):
            continue
        gap = (boxes[:, None] - theirs["bboxes"][None]).abs().amax(-1)
        match = gap.argmin(1)
        assert sorted(match.tolist()) == list(range(len(boxes))), b
        assert gap.min(1).values.max() < 0.05 / IMGSZ, b
        assert torch.equal(cls, theirs["cls"][match]), b
        corners = as_boxes["bboxes"][as_boxes["batch_idx"] == b]
        differs |= len(corners) != len(boxes) or bool((corners - boxes).abs().max() > 1 / IMGSZ)
    assert differs  # the strong warps make the corners' boxes looser than the polygons'


def test_masks_are_refused_without_a_segmentation_datasets_polygons(hyp):
    with pytest.raises(ValueError, match="masks"):
        GpuAugment(IMGSZ, hyp, masks=True)
    assert GpuAugment(IMGSZ, hyp, segments=M).masks and not GpuAugment(IMGSZ, hyp, segments=M, masks=False).masks

"""A pose dataset's keypoints through the GPU input pipeline (rank/gpu_data/augment_keypoints.py, gpu_augment.py,
gpu_input.py) against Ultralytics 8.4.190's transforms: given GpuAugment's draws, Mosaic, RandomPerspective,
RandomFlip with flip_idx and Format(normalize=True) give the same keypoints; by hand, on a tiny batch, the flip's
reordering, visibility 0 outside the image, and keypoints that leave with their boxes. All on CPU tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from launcher.inputs import shapes
from launcher.rank.data.raw_batch import RawBatch
from launcher.rank.gpu_data.augment_keypoints import clipped, cutmix_keypoints
from launcher.rank.gpu_data.gpu_augment import GpuAugment
from tests.raw_batches import RawTrainDataset
from tests.test_gpu_augment import Scripted, scripted_calls

IMGSZ = 64
FLIP_IDX = [0, 3, 2, 1]  # the synthetic shapes' keypoints: top, right, bottom, left
STRONG = dict(degrees=30.0, translate=0.4, scale=0.9, shear=10.0, perspective=0.0005, fliplr=0.5, flipud=0.5,
              hsv_h=0.0, hsv_s=0.0, hsv_v=0.0)


@pytest.fixture(scope="module")
def ul():
    from ultralytics.cfg import get_cfg
    from ultralytics.data import augment

    return get_cfg, augment


def shapes_data(tmp_path_factory, task: str) -> dict:
    """24 small training images of the synthetic shapes labelled for `task`, as a data dict."""
    spec = shapes.ShapesSpec(train_images=24, val_images=1, width=96, height=72, max_objects=4, task=task)
    root = shapes.ensure_dataset(tmp_path_factory.mktemp(task), spec, workers=1, log=lambda _: None).parent
    return {"train": str(root / "images" / "train"), "names": dict(enumerate(shapes.CLASSES)), "nc": 3,
            "channels": 3}


@pytest.fixture(scope="module")
def pose_data(tmp_path_factory) -> dict:
    return {**shapes_data(tmp_path_factory, "pose"), "kpt_shape": shapes.KPT_SHAPE, "flip_idx": shapes.FLIP_IDX}


def ultralytics_keypoints(ul, monkeypatch, ds, hyp_ns, params, b: int, tiles: list[int]) -> dict:
    """Ultralytics' pose transforms as v8_transforms composes them (no mix, no HSV), given GpuAugment's draws for
    sample b."""
    _, augment = ul
    mosaic = bool(params.mosaic[b])
    monkeypatch.setattr(augment, "random", Scripted(scripted_calls(params, b, tiles)))
    pipeline = augment.Compose([
        augment.Mosaic(ds, imgsz=hyp_ns.imgsz, p=hyp_ns.mosaic if mosaic else 0.0),
        augment.RandomPerspective(degrees=hyp_ns.degrees, translate=hyp_ns.translate, scale=hyp_ns.scale,
                                  shear=hyp_ns.shear, perspective=hyp_ns.perspective,
                                  size=(hyp_ns.imgsz, hyp_ns.imgsz)),
        augment.RandomFlip(direction="vertical", p=hyp_ns.flipud, flip_idx=FLIP_IDX),
        augment.RandomFlip(direction="horizontal", p=hyp_ns.fliplr, flip_idx=FLIP_IDX),
        augment.Format(bbox_format="xywh", normalize=True, return_keypoint=True, batch_idx=True),
    ])
    out = pipeline(ds.get_image_and_label(tiles[0]))
    monkeypatch.undo()
    return out


@pytest.mark.parametrize("mosaic", [True, False])
def test_given_the_same_draws_keypoints_are_ultralytics(ul, pose_data, monkeypatch, mosaic):
    """Mosaic (its canvas clip), rotation, shear, perspective, both flips with flip_idx, Format's normalisation."""
    from launcher.rank.ultralytics.datasets import raw_train_dataset

    get_cfg, _ = ul
    hyp_ns = get_cfg(overrides={"imgsz": IMGSZ, "task": "pose", **STRONG})
    raw_ds = RawTrainDataset(raw_train_dataset(hyp_ns, pose_data, 8), 0, mosaic=mosaic)
    samples = [raw_ds[(0, i)] for i in range(16)]
    raw = raw_ds.collate_fn(samples)
    aug = GpuAugment(IMGSZ, hyp_ns, keypoints=4, flip_idx=FLIP_IDX)
    params = aug.draw(raw, torch.Generator().manual_seed(3))
    assert params.flip_lr.any() and params.flip_ud.any() and (params.flip_lr & params.flip_ud).any()
    ours = aug.apply(raw, params)
    assert ours["keypoints"].shape == (len(ours["bboxes"]), 4, 3) and ours["keypoints"].dtype == torch.float32
    hidden = 0
    for b, sample in enumerate(samples):
        theirs = ultralytics_keypoints(ul, monkeypatch, raw_ds.dataset, hyp_ns, params, b,
                                       [t.index for t in sample.tiles])
        mine = ours["keypoints"][ours["batch_idx"] == b]
        assert mine.shape == theirs["keypoints"].shape, b
        torch.testing.assert_close(mine[..., :2], theirs["keypoints"][..., :2], atol=2e-3, rtol=0)  # 1/8 pixel
        torch.testing.assert_close(mine[..., 2], theirs["keypoints"][..., 2])
        torch.testing.assert_close(ours["bboxes"][ours["batch_idx"] == b], theirs["bboxes"], atol=2e-3, rtol=0)
        hidden += int((theirs["keypoints"][..., 2] == 0).sum())
    assert hidden > 0  # some points left the image (or the canvas) and were hidden on both sides


def tiny_pose_batch() -> RawBatch:
    """One 64 x 64 image without mosaic: a 20-pixel square with its top, right, bottom and left points, and a box
    too small to survive (box_candidates: 2 pixels wide at most) with its own points."""
    points = [[(20, 10, 1), (30, 20, 1), (20, 30, 1), (10, 20, 1)], [(5, 5, 1)] * 4]
    return RawBatch(
        images=torch.full((1, IMGSZ, IMGSZ, 3), 114, dtype=torch.uint8),
        sizes=torch.tensor([[IMGSZ, IMGSZ]]),
        groups=torch.zeros((1, 1), dtype=torch.int64),
        labels=torch.tensor([[0, 0, 0, 10, 10, 30, 30], [0, 0, 1, 4, 4, 6, 6]], dtype=torch.float32),
        im_file=("a.jpg",), ori_shape=((IMGSZ, IMGSZ),), ratio_pad=((1.0, 1.0),),
        keypoints=torch.tensor(points, dtype=torch.float32),
    )


def test_a_flip_mirrors_and_reorders_the_points_hides_those_outside_and_drops_them_with_their_box():
    raw = tiny_pose_batch()
    aug = GpuAugment(IMGSZ, dict(mosaic=0.0, translate=0.0, scale=0.0, fliplr=1.0), keypoints=4, flip_idx=FLIP_IDX)
    p = aug.draw(raw, torch.Generator().manual_seed(0))
    p.matrix = torch.tensor([[[1.0, 0, 40], [0, 1, 0], [0, 0, 1]]])  # 40 pixels right: the right point leaves
    out = aug.apply(raw, p)
    assert out["bboxes"].shape == (1, 4) and out["keypoints"].shape == (1, 4, 3)  # the small box's points went too
    # warped: top (60, 10), right (70 -> 64, hidden), bottom (60, 30), left (50, 20); mirrored x -> 64 - x; then
    # flip_idx swaps right and left
    expected = torch.tensor([[(4, 10, 1), (14, 20, 1), (4, 30, 1), (0, 20, 0)]], dtype=torch.float32)
    torch.testing.assert_close(out["keypoints"], expected / torch.tensor([IMGSZ, IMGSZ, 1.0]))


def test_both_flips_reorder_twice_as_ultralytics_two_random_flips_do(ul):
    """RandomFlip up-down and left-right each apply flip_idx to the points (v8_transforms gives both the index)."""
    _, augment = ul
    from ultralytics.utils.instance import Instances

    raw = tiny_pose_batch()
    flip_idx = [1, 2, 3, 0]  # not its own inverse: the order of the two reorderings shows
    aug = GpuAugment(IMGSZ, dict(mosaic=0.0, translate=0.0, scale=0.0, fliplr=1.0, flipud=1.0), keypoints=4,
                     flip_idx=flip_idx)
    p = aug.draw(raw, torch.Generator().manual_seed(0))
    out = aug.apply(raw, p)
    instances = Instances(np.array([[10, 10, 30, 30]], np.float32), keypoints=raw.keypoints[:1].numpy().copy(),
                          bbox_format="xyxy", normalized=False)
    labels = {"img": np.zeros((IMGSZ, IMGSZ, 3), np.uint8), "instances": instances, "cls": np.zeros((1, 1))}
    for direction in ("vertical", "horizontal"):
        labels = augment.RandomFlip(direction=direction, p=1.0, flip_idx=flip_idx)(labels)
    theirs = torch.from_numpy(labels["instances"].keypoints) / torch.tensor([IMGSZ, IMGSZ, 1.0])
    torch.testing.assert_close(out["keypoints"], theirs)


def test_a_pose_dataset_without_flip_idx_is_not_flipped_and_a_wrong_one_is_refused():
    assert GpuAugment(IMGSZ, dict(fliplr=0.5, flipud=0.5), keypoints=4).p_fliplr == 0.0
    assert GpuAugment(IMGSZ, dict(fliplr=0.5, flipud=0.5), keypoints=4).p_flipud == 0.0
    assert GpuAugment(IMGSZ, dict(fliplr=0.5)).p_fliplr == 0.5  # boxes alone: no flip_idx needed
    with pytest.raises(ValueError, match="flip_idx"):
        GpuAugment(IMGSZ, {}, keypoints=4, flip_idx=[0, 1, 2])


def test_cutmix_clips_its_partners_points_to_the_pasted_area_and_hides_those_outside():
    aug = GpuAugment(IMGSZ, dict(cutmix=0.5), keypoints=1)
    points = torch.tensor([[[5.0, 5.0, 1.0]], [[5.0, 5.0, 1.0]], [[20.0, 30.0, 1.0]]])
    host, block = torch.zeros(3, dtype=torch.int64), torch.tensor([0, 1, 1])  # own row, then CutMix's partner
    out = cutmix_keypoints(aug, points, host, block, torch.tensor([[10.0, 10.0, 40.0, 40.0]]))
    torch.testing.assert_close(out, torch.tensor([[[5.0, 5.0, 1.0]], [[10.0, 10.0, 0.0]], [[20.0, 30.0, 1.0]]]))
    edge = clipped(torch.tensor([[[64.0, 0.0, 1.0], [64.5, 3.0, 1.0]]]), 0.0, 64.0)  # on the border: still visible
    torch.testing.assert_close(edge, torch.tensor([[[64.0, 0.0, 1.0], [64.0, 3.0, 0.0]]]))


def test_through_decode_and_the_image_buffer_each_point_stays_with_its_box(tmp_path):
    """The rank's path: labels with keypoints (each box's centre) into the workers' batch (pickled as a worker hands
    it over), the image buffer's label store (grown past its width), mosaic, an affine warp and both flips: every
    box that no border cut keeps its centre point, visible."""
    import pickle

    from launcher.rank.data.encoded import EncodedImages, EncodedTrainDataset
    from launcher.rank.gpu_data.gpu_input import Decoder, GpuInput
    from tests.test_gpu_input_batches import rectangles

    boxes, _ = rectangles(tmp_path, 16)
    images = EncodedImages(*boxes[:4], keypoints=np.concatenate(
        (boxes.xywh[:, None, :2], np.ones((len(boxes.cls), 1, 1), np.float32)), 2))
    ds = EncodedTrainDataset(images, decode_all=True)
    hyp = dict(mosaic=1.0, degrees=20.0, translate=0.1, scale=0.3, shear=5.0, fliplr=0.5, flipud=0.5)
    gi = GpuInput(GpuAugment(IMGSZ, hyp, keypoints=1, flip_idx=[0]), Decoder(torch.device("cpu"), images.files),
                  capacity=16, device=torch.device("cpu"))
    gi.labels, gi.points = gi.labels[:, :1], gi.points[:, :1]  # one label per slot: the first batch grows both
    checked = 0
    for k in range(2):
        encoded = pickle.loads(pickle.dumps(ds.collate_fn([ds[(0, i)] for i in range(8 * k, 8 * k + 8)])))
        batch = gi(encoded, torch.Generator().manual_seed(k))
        assert batch["keypoints"].shape == (len(batch["bboxes"]), 1, 3)
        x, y, w, h = (batch["bboxes"] * IMGSZ).unbind(1)
        whole = (x - w / 2 > 0.5) & (y - h / 2 > 0.5) & (x + w / 2 < IMGSZ - 0.5) & (y + h / 2 < IMGSZ - 0.5)
        torch.testing.assert_close(batch["keypoints"][whole, 0, :2], batch["bboxes"][whole, :2], atol=1e-4, rtol=0)
        assert (batch["keypoints"][whole, 0, 2] == 1).all()
        checked += int(whole.sum())
    assert gi.points.shape[1] == 2 and checked > 10

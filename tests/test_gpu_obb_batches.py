"""An obb dataset's rotated boxes through the GPU input pipeline (rank/gpu_data/augment_obb.py, gpu_augment.py) against
Ultralytics 8.4.190's transforms: given GpuAugment's draws, Mosaic (its preserve_obb clip at 2S), RandomPerspective
(segment2box, the preserve_obb clip at S, box_candidates' 0.01), MixUp, CutMix (the clip in the pasted area's frame,
zero-area rows dropped), both RandomFlips and Format(return_obb=True) give the same rows in the same order, the
same classes and the same rotated boxes; by hand: a box pushed across the border keeps its direction (a
coordinate-wise clip of its corners would turn it), a row mostly pushed out meets the 0.01 area rule, CutMix drops
a partner row whose corners miss its area; through decode and the image buffer each rotated box frames its object.
All on CPU tensors.

Tolerance: each row's rectangle (xywhr in pixels, made into corners) within 2e-3 px of Ultralytics' up to the
corners' cyclic order, and where it is no near-square (sides 1 % apart) w, h within 2e-3 px and theta within 1e-3
rad (modulo pi, at the ends of its range). Both sides compute in float32; Ultralytics on 100 points per row, here on
its 4 corners."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from launcher.rank.data.raw_batch import RawBatch
from launcher.rank.gpu_data import augment_obb
from launcher.rank.gpu_data.augment_obb import OBB_CORNERS, obb_targets
from launcher.rank.gpu_data.gpu_augment import GpuAugment
from tests.raw_batches import RawTrainDataset
from tests.test_gpu_keypoints import STRONG, shapes_data, ul  # noqa: F401 - ul: the module's Ultralytics fixture
from tests.test_gpu_segments import ultralytics_segments

IMGSZ = 128
ATOL = 2e-3  # px
THETA = 1e-3  # rad


@pytest.fixture(scope="module")
def obb_data(tmp_path_factory) -> dict:
    return shapes_data(tmp_path_factory, "obb")


def rect_corners(xywhr: torch.Tensor, s: int = IMGSZ) -> np.ndarray:
    """(N, 5) normalised xywhr of an s-pixel image -> (N, 4, 2) corners in pixels."""
    from ultralytics.utils import ops

    return ops.xywhr2xyxyxyxy(xywhr.double() * torch.tensor([s] * 4 + [1.0], dtype=torch.float64)).numpy()


class Agreement:
    """Our batch's samples against Ultralytics' (`add`), then `check`: the same rows in the same order, the same
    classes, the rotated boxes within the module's tolerance."""

    def __init__(self, ours: dict):
        self.ours, self.rows, self.strict = ours, 0, 0

    def add(self, b: int, theirs: dict) -> None:
        mine = self.ours["batch_idx"] == b
        boxes, cls = self.ours["bboxes"][mine], self.ours["cls"][mine]
        assert theirs["bboxes"].shape == (len(theirs["cls"]), 5) and boxes.dtype == torch.float32
        assert len(boxes) == len(theirs["bboxes"]), (b, len(boxes), len(theirs["bboxes"]))
        assert torch.equal(cls, theirs["cls"]), b
        if not len(boxes):
            return
        a, t = rect_corners(boxes), rect_corners(theirs["bboxes"])
        gap = np.min([np.linalg.norm(a - np.roll(t, k, 1), axis=-1).max(1) for k in range(4)], 0)
        assert gap.max() < ATOL, (b, gap.max())
        px = torch.tensor([IMGSZ] * 4 + [1.0])
        ours, ref = (boxes * px).double(), (theirs["bboxes"] * px).double()
        distinct = (ref[:, 2] - ref[:, 3]).abs() > 0.01 * ref[:, 2]  # not a near-square: w, h, theta fixed
        torch.testing.assert_close(ours[distinct, :4], ref[distinct, :4], atol=ATOL, rtol=0)
        turn = torch.remainder(ours[distinct, 4] - ref[distinct, 4] + math.pi / 2, math.pi) - math.pi / 2
        assert turn.abs().max() < THETA if len(turn) else True, b
        self.rows, self.strict = self.rows + len(boxes), self.strict + int(distinct.sum())

    def check(self, least: int = 20) -> None:
        assert self.rows >= least and self.strict >= least // 2, (self.rows, self.strict)


class Crossings:
    """Wraps augment_obb.clipped_obbs to count the rows that cross the canvas it clips to (those its preserve_obb
    rule changes), to show the comparison exercises it."""

    def __init__(self, monkeypatch):
        self.inner, self.crossing = augment_obb.clipped_obbs, 0
        monkeypatch.setattr(augment_obb, "clipped_obbs", self)

    def __call__(self, corners, w, h, x0=0.0, y0=0.0):
        boxes, out, visible = self.inner(corners, w, h, x0, y0)
        self.crossing += int((visible & (out != corners).any(-1).any(-1)).sum())
        return boxes, out, visible


@pytest.mark.parametrize("mosaic", [True, False])
def test_given_the_same_draws_rotated_boxes_are_ultralytics(ul, obb_data, monkeypatch, mosaic):
    """Mosaic's clip at 2S, rotation, shear, perspective, the clip at S and the 0.01 area rule, both flips and
    Format's xywhr: the same rows, classes and rotated boxes, with rows crossing the borders among them."""
    from launcher.rank.ultralytics.datasets import raw_train_dataset

    get_cfg, _ = ul
    hyp_ns = get_cfg(overrides={"imgsz": IMGSZ, "task": "obb", **STRONG})
    raw_ds = RawTrainDataset(raw_train_dataset(hyp_ns, obb_data, 8), 0, mosaic=mosaic, segment_points=OBB_CORNERS)
    samples = [raw_ds[(0, i)] for i in range(16)]
    raw = raw_ds.collate_fn(samples)
    assert raw.segments.shape == (len(raw.labels), 4, 2)
    aug = GpuAugment(IMGSZ, hyp_ns, segments=OBB_CORNERS, obb=True)
    params = aug.draw(raw, torch.Generator().manual_seed(3))
    assert params.flip_lr.any() and params.flip_ud.any()
    crossings = Crossings(monkeypatch)
    ours = aug.apply(raw, params)
    monkeypatch.undo()
    assert ours["bboxes"].shape == (len(ours["cls"]), 5) and "masks" not in ours
    assert crossings.crossing >= 5, crossings.crossing
    seen = Agreement(ours)
    for b, sample in enumerate(samples):
        seen.add(b, ultralytics_segments(ul, monkeypatch, raw_ds.dataset, hyp_ns, params, b,
                                         [t.index for t in sample.tiles]))
    seen.check()


def test_mixed_samples_are_ultralytics_mixup_and_cutmix_with_their_corners(ul, obb_data, monkeypatch):
    """Each sample's own render and partners' (mosaic, warp, clip), mixed by Ultralytics' MixUp and CutMix (its 0.01
    rule, the partner's rows clipped with preserve_obb in the pasted area's frame, those of no area dropped), flipped
    and formatted by Ultralytics, against GpuAugment's mixed batch on the same draws."""
    from ultralytics.utils import ops
    from ultralytics.utils.instance import Instances

    from launcher.rank.gpu_data.augment_obb import warped_obbs
    from launcher.rank.gpu_data.augment_params import mosaic_tiles
    from tests.test_gpu_augment_mixes import ultralytics_mixed
    from tests.test_gpu_segments import outlined_mix

    b = 16
    hyp_ns, raw_all, raw, aug, p = outlined_mix(ul, obb_data, "obb", OBB_CORNERS, b, obb=True)
    crossings = Crossings(monkeypatch)
    ours = aug.apply(raw, p)
    monkeypatch.undo()
    # every row (samples and partners) unmixed, unflipped: Ultralytics' labels after RandomPerspective
    plain = replace(p, flip_ud=torch.zeros_like(p.flip_ud), flip_lr=torch.zeros_like(p.flip_lr), mixup=None,
                    mix_ratio=None, cutmix=None, cut_areas=None, cut_pick=None)
    alone = GpuAugment(IMGSZ, dict(vars(hyp_ns), mixup=0.0, cutmix=0.0), segments=OBB_CORNERS, obb=True)
    images = alone.apply(raw_all, plain)["img"]
    row, xyxy, keep, corners = warped_obbs(alone, raw_all, plain, mosaic_tiles(alone, raw_all, plain))
    parts = {}
    for r in range(3 * b):
        k = keep & (row == r)
        outlines = ops.resample_segments(list(corners[k].numpy()), n=100)  # as Ultralytics' rows travel
        parts[r] = {"img": images[r].permute(1, 2, 0).numpy()[..., ::-1].copy(),
                    "cls": raw_all.labels[k, 2:3].numpy().copy(),
                    "instances": Instances(xyxy[k].numpy().copy(),
                                           segments=np.stack(outlines) if outlines else np.zeros((0, 100, 2),
                                                                                                 np.float32),
                                           bbox_format="xyxy", normalized=False)}
    seen, mixed = Agreement(ours), {"mixup": 0, "cutmix": 0}
    for i in range(b):
        theirs = ultralytics_mixed(ul, monkeypatch, hyp_ns, p, i, parts, obb=True, return_obb=True)
        seen.add(i, theirs)
        mixed["mixup"] += bool(p.mixup[i])
        mixed["cutmix"] += bool(p.cutmix[i]) and len(theirs["cls"]) > len(parts[i]["cls"]) + (
            len(parts[b + i]["cls"]) if p.mixup[i] else 0)
    seen.check()
    assert min(mixed.values()) >= 2 and crossings.crossing >= 5, (mixed, crossings.crossing)


def one_image(corners: list[list[tuple[float, float]]]) -> RawBatch:
    """One 64 x 64 image without mosaic and its rows' corners, each with its corners' box."""
    c = np.asarray(corners, np.float32)
    boxes = np.concatenate((c.min(1), c.max(1)), 1)
    labels = np.concatenate((np.zeros((len(c), 3)), boxes), 1)
    return RawBatch(
        images=torch.full((1, 64, 64, 3), 114, dtype=torch.uint8), sizes=torch.tensor([[64, 64]]),
        groups=torch.zeros((1, 1), dtype=torch.int64), labels=torch.tensor(labels, dtype=torch.float32),
        im_file=("a.jpg",), ori_shape=((64, 64),), ratio_pad=((1.0, 1.0),), segments=torch.from_numpy(c),
    )


def test_a_box_pushed_across_the_border_keeps_its_direction():
    """A 30-degree rectangle shifted half out of the image: its target is the rectangle along 30 degrees bounding
    its visible part (Ultralytics' preserve_obb clip), which a coordinate-wise clip of the corners would turn; the
    row flipped left-right mirrors it."""
    from ultralytics.utils import ops
    from ultralytics.utils.instance import Instances

    theta = math.radians(30.0)
    corners = ops.xywhr2xyxyxyxy(np.array([[20.0, 32.0, 30.0, 12.0, theta]], np.float32))
    raw = one_image(corners.tolist())
    hyp = dict(mosaic=0.0, translate=0.0, scale=0.0, fliplr=0.0, hsv_h=0.0, hsv_s=0.0, hsv_v=0.0)
    aug = GpuAugment(64, hyp, segments=OBB_CORNERS, obb=True)
    p = aug.draw(raw, torch.Generator().manual_seed(0))
    p.matrix = torch.tensor([[[1.0, 0, -20], [0, 1, 0], [0, 0, 1]]])  # centre at x = 0: about half leaves
    out = aug.apply(raw, p)["bboxes"]
    shifted = corners - np.array([20.0, 0.0], np.float32)
    segments = np.stack(ops.resample_segments(list(shifted), n=100))
    instances = Instances(np.zeros((1, 4), np.float32), segments, bbox_format="xyxy", normalized=False)
    instances.clip(64, 64, preserve_obb=True)
    theirs = ops.xyxyxyxy2xywhr(torch.from_numpy(instances.segments)) / torch.tensor([64.0] * 4 + [1.0])
    torch.testing.assert_close(out, theirs, atol=1e-4, rtol=0)
    assert out[0, 4] == pytest.approx(theta, abs=1e-5) and out[0, 2] * 64 < 30.0 - 5  # turned no bit, shorter
    clamped = obb_targets(torch.from_numpy(shifted).clamp(0, 64), 64)  # a coordinate-wise clip instead
    assert abs(float(clamped[0, 4]) - theta) > 0.05
    mirrored = aug.apply(raw, replace(p, flip_lr=torch.ones_like(p.flip_lr)))["bboxes"]
    a, b = rect_corners(mirrored, 64)[0], rect_corners(out, 64)[0] * [-1, 1] + [64, 0]
    assert min(np.abs(a - np.roll(q, k, 0)).max() for q in (b, b[::-1]) for k in range(4)) < 1e-4


def test_a_row_mostly_pushed_out_is_judged_by_the_polygons_area_rule():
    """box_candidates' 0.01 (Ultralytics' threshold where rows have segments, as an obb dataset's do): a 40 x 20 box
    with 3 x 20 px of it left in the image (7.5 % of its area) is kept; the box rule's 0.1 would drop it."""
    raw = one_image([[(10.0, 20.0), (50.0, 20.0), (50.0, 40.0), (10.0, 40.0)]])
    aug = GpuAugment(64, dict(mosaic=0.0, translate=0.0, scale=0.0, fliplr=0.0), segments=OBB_CORNERS, obb=True)
    p = aug.draw(raw, torch.Generator().manual_seed(0))
    p.matrix = torch.tensor([[[1.0, 0, -47], [0, 1, 0], [0, 0, 1]]])  # x from -37 to 3
    out = aug.apply(raw, p)["bboxes"] * torch.tensor([64.0] * 4 + [1.0])
    torch.testing.assert_close(out[:, :4], torch.tensor([[1.5, 30.0, 20.0, 3.0]]), atol=1e-4, rtol=0)


def test_cutmix_drops_a_partner_row_whose_polygon_misses_the_area_its_box_touches():
    """CutMix with preserve_obb: a partner's diamond whose box reaches 1 % into the pasted area, the diamond itself
    not, clips to nothing and is dropped (remove_zero_area_boxes); a partner's row across the area's edge is clipped
    into it as Ultralytics clips it in the area's frame; the sample's own row is left as it is."""
    from ultralytics.utils import ops
    from ultralytics.utils.instance import Instances

    from launcher.rank.gpu_data.augment_obb import cutmix_obbs

    aug = GpuAugment(64, dict(cutmix=0.5), segments=OBB_CORNERS, obb=True)
    own = [(20.0, 16.0), (40.0, 16.0), (40.0, 40.0), (20.0, 40.0)]
    diamond = [(10.0, 5.0), (15.0, 10.0), (10.0, 15.0), (5.0, 10.0)]  # its box [5, 15]^2 meets the area's corner
    across = ops.xywhr2xyxyxyxy(np.array([[30.0, 12.0, 16.0, 8.0, 0.5]], np.float32))[0].tolist()
    corners = torch.tensor([own, diamond, across])
    area = torch.tensor([[14.0, 14.0, 30.0, 30.0]])
    out, keep = cutmix_obbs(aug, corners, torch.zeros(3, dtype=torch.int64), torch.tensor([0, 1, 1]), area,
                            torch.ones(3, dtype=torch.bool))
    assert keep.tolist() == [True, False, True] and torch.equal(out[0], corners[0])
    assert not torch.equal(out[2], corners[2])  # clipped
    segments = np.stack(ops.resample_segments([corners[2].numpy() - 14.0], n=100))
    theirs = Instances(np.zeros((1, 4), np.float32), segments, bbox_format="xyxy", normalized=False)
    theirs.clip(16, 16, preserve_obb=True)
    torch.testing.assert_close(obb_targets(out[2:], 64), obb_targets(torch.from_numpy(theirs.segments + 14.0), 64),
                               atol=1e-5, rtol=0)


def test_an_obb_batch_is_the_same_on_every_device_it_is_built_on():
    """The case the CUDA test compares devices with (tests/test_cuda_input.py): rotated rectangles, some crossing the
    borders, mixed and flipped samples; on the CPU twice, the same batch of (N, 5) targets."""
    from tests.test_gpu_segments import segment_case

    aug, raw, p = segment_case(torch.device("cpu"), obb=True)
    assert aug.obb and raw.segments.shape[1:] == (4, 2)
    one, two = aug.apply(raw, p), aug.apply(*segment_case(torch.device("cpu"), obb=True)[1:])
    assert one["bboxes"].shape == (len(one["cls"]), 5) and len(one["cls"]) > 20
    assert torch.equal(one["bboxes"], two["bboxes"]) and torch.equal(one["batch_idx"], two["batch_idx"])


def test_through_decode_and_the_image_buffer_each_rotated_box_frames_its_rectangle(tmp_path):
    """The rank's path: each rectangle's corners as an obb label row (normalised, in the workers' pickled batch), the
    image buffer's corner store, mosaic, a turning and shearing warp and both flips: each target's rotated box
    (Format's xywhr, as the loss reads it) holds its rectangle's colour, which boxes turned by 0.5 rad would not."""
    import pickle

    from launcher.rank.data.encoded import EncodedImages, EncodedTrainDataset
    from launcher.rank.gpu_data.gpu_input import Decoder, GpuInput
    from tests.test_gpu_input_batches import rectangles

    boxes, colours = rectangles(tmp_path, 16)
    xy, wh = boxes.xywh[:, :2], boxes.xywh[:, 2:] / 2
    corners = np.stack((xy - wh, xy + wh * [1, -1], xy + wh, xy + wh * [-1, 1]), 1).reshape(-1, 2)
    images = EncodedImages(*boxes[:4], segments=corners.astype(np.float32),
                           segment_starts=np.arange(0, len(corners) + 1, 4), segment_points=OBB_CORNERS)
    ds = EncodedTrainDataset(images, decode_all=True)
    hyp = dict(mosaic=1.0, degrees=30.0, translate=0.1, scale=0.3, shear=5.0, fliplr=0.5, flipud=0.5,
               hsv_h=0.0, hsv_s=0.0, hsv_v=0.0)
    gi = GpuInput(GpuAugment(64, hyp, segments=OBB_CORNERS, obb=True), Decoder(torch.device("cpu"), images.files),
                  capacity=16, device=torch.device("cpu"))
    centres = torch.stack(torch.meshgrid(torch.arange(64.0), torch.arange(64.0), indexing="xy"), -1) + 0.5

    def inside(x, y, w, h, theta) -> torch.Tensor:  # the pixels whose centres the rotated box holds, half a pixel out
        d = centres - torch.tensor([x, y])
        along = d[..., 0] * math.cos(theta) + d[..., 1] * math.sin(theta)
        across = d[..., 1] * math.cos(theta) - d[..., 0] * math.sin(theta)
        return (along.abs() <= w / 2 + 0.5) & (across.abs() <= h / 2 + 0.5)

    held, framed, turned = [], [], []
    for k in range(2):
        encoded = pickle.loads(pickle.dumps(ds.collate_fn([ds[(0, i)] for i in range(8 * k, 8 * k + 8)])))
        batch = gi(encoded, torch.Generator().manual_seed(k))
        assert batch["bboxes"].shape == (len(batch["cls"]), 5) and "masks" not in batch
        for j in range(len(batch["cls"])):
            b, c = int(batch["batch_idx"][j]), int(batch["cls"][j])
            if ((batch["batch_idx"] == b) & (batch["cls"][:, 0] == c)).sum() > 1:  # a partner drawn twice
                continue
            shown = (batch["img"][b] == torch.tensor(colours[c], dtype=torch.uint8)[:, None, None]).all(0)
            x, y, w, h, theta = (batch["bboxes"][j] * torch.tensor([64.0] * 4 + [1.0])).tolist()
            if shown.sum() >= 16:
                box = inside(x, y, w, h, theta)
                held.append(float((shown & box).sum() / shown.sum()))
                framed.append(float((shown & box).sum() / box.sum()))  # edges blend: not the exact colour there
                turned.append(float((shown & inside(x, y, w, h, theta + 0.5)).sum() / shown.sum()))
    assert len(held) > 10 and min(held) > 0.95 and np.mean(framed) > 0.6, (held, framed)
    assert np.mean(held) > 0.99 and np.mean(turned) < 0.95, (held, turned)

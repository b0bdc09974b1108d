"""A segmentation dataset's polygons through the GPU input pipeline (rank/gpu_data/augment_segments.py,
segment_masks.py, gpu_augment.py, gpu_input.py) against Ultralytics 8.4.190's transforms: given GpuAugment's draws,
Mosaic, RandomPerspective (boxes from the warped polygons), both RandomFlips and Format(return_mask=True, overlap) give
the same instances, boxes and sort order, and masks of the same pixels but for the rasterisers' edges; by hand, on tiny
batches: the boxes are the polygons' (not the warped corners'), the area sort and its drawing order, overlap_mask=False,
a flip mirrors the masks, CutMix clamps its partner's polygons. All on CPU tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from launcher.rank.data.encoded import resample_segments
from launcher.rank.data.raw_batch import RawBatch
from launcher.rank.gpu_data import augment_segments, segment_masks
from launcher.rank.gpu_data.augment_segments import cutmix_segments, segment_boxes
from launcher.rank.gpu_data.gpu_augment import GpuAugment
from tests.raw_batches import RawTrainDataset
from tests.test_gpu_augment import Scripted, scripted_calls
from tests.test_gpu_keypoints import STRONG, shapes_data, ul  # noqa: F401 - ul: the module's Ultralytics fixture

IMGSZ = 128
M = augment_segments.SEGMENT_POINTS


@pytest.fixture(scope="module")
def segment_data(tmp_path_factory) -> dict:
    return shapes_data(tmp_path_factory, "segment")


def ultralytics_segments(ul, monkeypatch, ds, hyp_ns, params, b: int, tiles: list[int]) -> dict:
    """Ultralytics' segmentation transforms as v8_transforms composes them (no mix, no HSV; CopyPaste at p=0 does
    nothing), given GpuAugment's draws for sample b; an obb dataset's (`ds.use_obb`: preserve_obb, Format's xywhr)."""
    _, augment = ul
    obb = getattr(ds, "use_obb", False)
    formats = dict(return_obb=True) if obb else dict(return_mask=True, mask_ratio=hyp_ns.mask_ratio, mask_overlap=True)
    monkeypatch.setattr(augment, "random", Scripted(scripted_calls(params, b, tiles)))
    pipeline = augment.Compose([
        augment.Mosaic(ds, imgsz=hyp_ns.imgsz, p=hyp_ns.mosaic if bool(params.mosaic[b]) else 0.0),
        augment.RandomPerspective(degrees=hyp_ns.degrees, translate=hyp_ns.translate, scale=hyp_ns.scale,
                                  shear=hyp_ns.shear, perspective=hyp_ns.perspective,
                                  size=(hyp_ns.imgsz, hyp_ns.imgsz), preserve_obb=obb),
        augment.RandomFlip(direction="vertical", p=hyp_ns.flipud),
        augment.RandomFlip(direction="horizontal", p=hyp_ns.fliplr),
        augment.Format(bbox_format="xywh", normalize=True, batch_idx=True, **formats),
    ])
    out = pipeline(ds.get_image_and_label(tiles[0]))
    monkeypatch.undo()
    return out


@pytest.mark.parametrize("mosaic", [True, False])
def test_given_the_same_draws_instances_boxes_order_and_masks_are_ultralytics(ul, segment_data, monkeypatch, mosaic):
    """Mosaic (its canvas clamp), rotation, shear, perspective, segment2box's boxes and 0.01 area rule, both flips,
    Format's area sort and overlap masks: the same instances in the same order with the same boxes (1/20 pixel),
    and per instance of 20 mask pixels or more a mask IoU of 0.9 at least (0.95 on average)."""
    from launcher.rank.ultralytics.datasets import raw_train_dataset

    get_cfg, _ = ul
    hyp_ns = get_cfg(overrides={"imgsz": IMGSZ, "task": "segment", **STRONG})
    raw_ds = RawTrainDataset(raw_train_dataset(hyp_ns, segment_data, 8), 0, mosaic=mosaic, segment_points=M)
    samples = [raw_ds[(0, i)] for i in range(16)]
    raw = raw_ds.collate_fn(samples)
    aug = GpuAugment(IMGSZ, hyp_ns, segments=M)
    params = aug.draw(raw, torch.Generator().manual_seed(3))
    ours = aug.apply(raw, params)
    h = IMGSZ // 4
    assert ours["masks"].shape == (16, h, h) and ours["masks"].dtype == torch.uint8
    assert ours["sem_masks"].shape == (16, h, h) and ours["sem_masks"].dtype == torch.float32
    seen = Agreement(ours, mask_areas(hyp_ns, raw, params))
    for b, sample in enumerate(samples):
        theirs = ultralytics_segments(ul, monkeypatch, raw_ds.dataset, hyp_ns, params, b,
                                      [t.index for t in sample.tiles])
        seen.add(b, theirs)
    seen.check()


def mask_areas(hyp, raw: RawBatch, params) -> torch.Tensor:
    """Each row's own mask area (overlap_mask=False: before smaller ones are drawn over it) on the same draws, in
    the order of the overlap batch's rows."""
    alone = GpuAugment(IMGSZ, dict(vars(hyp) if not isinstance(hyp, dict) else hyp, overlap_mask=False),
                       segments=M).apply(raw, params)
    ours = GpuAugment(IMGSZ, hyp, segments=M).apply(raw, params)
    gap = (ours["bboxes"][:, None] - alone["bboxes"][None]).abs().amax(-1)
    gap += (ours["batch_idx"][:, None] != alone["batch_idx"][None]) * 1e9
    return alone["masks"].flatten(1).sum(1)[gap.argmin(1)]


class Agreement:
    """Our batch's samples against Ultralytics' (`add`), then `check`: the same instances with the same boxes (1/20
    pixel) and classes, in the same order where their masks of 10 pixels or more differ in area by a quarter
    (near-equal areas may swap at a pixel's difference), a mask IoU of `least` at least (0.95 on average) for each
    instance of 20 mask pixels or more, and sem_masks' classes where both cover a pixel. `areas`: our rows' own mask
    areas (mask_areas)."""

    def __init__(self, ours: dict, areas: torch.Tensor, least: float = 0.9):
        self.ours, self.areas, self.least = ours, areas, least
        self.ious, self.pairs, self.same_sem = [], 0, []

    def add(self, b: int, theirs: dict) -> None:
        ours = self.ours
        mine = ours["batch_idx"] == b
        boxes, cls = ours["bboxes"][mine], ours["cls"][mine]
        assert len(boxes) == len(theirs["bboxes"]), b  # the same instances survive the area rule and the border
        if not len(boxes):
            return
        gap = (boxes[:, None] - theirs["bboxes"][None]).abs().amax(-1)  # each of our rows is one of theirs
        match = gap.argmin(1)
        assert sorted(match.tolist()) == list(range(len(boxes))), b
        assert gap.min(1).values.max() < 0.05 / IMGSZ, b
        assert torch.equal(cls, theirs["cls"][match]), b
        ours_m, theirs_m = ours["masks"][b], theirs["masks"][0]
        for i, j in enumerate(match.tolist()):
            a, t = ours_m == i + 1, theirs_m == j + 1
            if t.sum() >= 20:
                self.ious.append(float((a & t).sum() / (a | t).sum()))
        area = self.areas[mine]
        for i in range(len(boxes)):
            for k in range(i + 1, len(boxes)):
                ai, ak = area[i], area[k]
                if min(ai, ak) >= 10 and max(ai, ak) > 1.25 * min(ai, ak):
                    assert match[i] < match[k], (b, i, k)
                    self.pairs += 1
        both = (ours_m > 0) & (theirs_m > 0)  # sem_masks: the class of the instance drawn on top
        self.same_sem.append(float((ours["sem_masks"][b] == theirs["sem_masks"])[both].float().mean()))

    def check(self) -> None:
        assert len(self.ious) >= 10 and min(self.ious) > self.least and np.mean(self.ious) > 0.95, self.ious
        assert self.pairs >= 10 and np.mean(self.same_sem) > 0.95, (self.pairs, self.same_sem)


def test_mixed_samples_are_ultralytics_mixup_and_cutmix_with_their_polygons(ul, segment_data, monkeypatch):
    """Each sample's own render and partners' (mosaic, warp, boxes from polygons), mixed by Ultralytics' MixUp and
    CutMix (its 0.01 rule for polygons, the partner's polygons clamped into the area), flipped and formatted into
    masks by Ultralytics, against GpuAugment's mixed batch on the same draws."""
    from dataclasses import replace

    from launcher.rank.gpu_data.augment_boxes import warped_boxes
    from launcher.rank.gpu_data.augment_params import mosaic_tiles
    from launcher.rank.gpu_data.augment_segments import clamped_into, warped_segments
    from tests.test_gpu_augment_mixes import ultralytics_mixed
    from ultralytics.utils.instance import Instances

    b = 16
    hyp_ns, raw_all, raw, aug, p = outlined_mix(ul, segment_data, "segment", M, b)
    ours = aug.apply(raw, p)
    # every row (samples and partners) rendered unmixed, unflipped: Ultralytics' labels after RandomPerspective
    plain = replace(p, flip_ud=torch.zeros_like(p.flip_ud), flip_lr=torch.zeros_like(p.flip_lr), mixup=None,
                    mix_ratio=None, cutmix=None, cut_areas=None, cut_pick=None)
    alone = GpuAugment(IMGSZ, dict(vars(hyp_ns), mixup=0.0, cutmix=0.0), segments=M)
    images = alone.apply(raw_all, plain)["img"]
    tiles = mosaic_tiles(alone, raw_all, plain)
    outlines = warped_segments(alone, raw_all, plain, tiles)
    boxes = segment_boxes(outlines, IMGSZ)
    row, xyxy, keep = warped_boxes(alone, raw_all, plain, tiles, boxes)
    outlines = clamped_into(outlines, boxes)
    parts = {}
    for r in range(3 * b):
        k = keep & (row == r)
        parts[r] = {"img": images[r].permute(1, 2, 0).numpy()[..., ::-1].copy(),
                    "cls": raw_all.labels[k, 2:3].numpy().copy(),
                    "instances": Instances(xyxy[k].numpy().copy(), segments=outlines[k].numpy().copy(),
                                           bbox_format="xyxy", normalized=False)}
    # MixUp lays instances over each other: a pixel on an edge between two goes to the one drawn last, on both sides
    seen, mixed = Agreement(ours, mask_areas(hyp_ns, raw, p), least=0.85), {"mixup": 0, "cutmix": 0}
    for i in range(b):
        theirs = ultralytics_mixed(ul, monkeypatch, hyp_ns, p, i, parts, return_mask=True, mask_ratio=4,
                                   mask_overlap=True)
        seen.add(i, theirs)
        mixed["mixup"] += bool(p.mixup[i])
        mixed["cutmix"] += bool(p.cutmix[i]) and len(theirs["cls"]) > len(parts[i]["cls"]) + (
            len(parts[b + i]["cls"]) if p.mixup[i] else 0)
    seen.check()
    assert min(mixed.values()) >= 2, mixed


def outlined_mix(ul, data: dict, task: str, points: int, b: int, **augment):
    """A mixed batch of a dataset whose rows carry outlines (`points` each): b samples of Ultralytics' images and 2 b
    partners (MixUp's, then CutMix's), strong warps, mixup 0.5, cutmix 0.7. Returns (hyp, the RawBatch of every row,
    the batch's RawBatch, its GpuAugment (`augment`: its further arguments), its draws)."""
    from launcher.rank.ultralytics.datasets import raw_train_dataset
    from tests.test_gpu_augment_mixes import with_partners

    get_cfg, _ = ul
    hyp_ns = get_cfg(overrides={"imgsz": IMGSZ, "task": task, **dict(STRONG, translate=0.3), "mixup": 0.5,
                                "cutmix": 0.7})
    ds = RawTrainDataset(raw_train_dataset(hyp_ns, data, 8), 0, segment_points=points)
    raw_all = ds.collate_fn([ds[(i // len(ds), i % len(ds))] for i in range(3 * b)])
    raw = with_partners(raw_all, b)
    aug = GpuAugment(IMGSZ, hyp_ns, segments=points, **augment)
    return hyp_ns, raw_all, raw, aug, aug.draw(raw, torch.Generator().manual_seed(1))


def square(x1, y1, x2, y2) -> list[tuple[float, float]]:
    return [(x1, y1), (x2, y1), (x2, y2), (x1, y2)]


def tiny_segment_batch(polygons: list[list[tuple[float, float]]], cls: list[int] | None = None) -> RawBatch:
    """One 64 x 64 image without mosaic and its polygons (resampled to M points), each with its polygon's box."""
    flat = np.concatenate([np.asarray(p, np.float32) for p in polygons])
    starts = np.concatenate(([0], np.cumsum([len(p) for p in polygons]))).astype(np.int64)
    outlines = resample_segments(flat, starts, M)
    boxes = np.concatenate((outlines.min(1), outlines.max(1)), 1)
    cls = cls or list(range(len(polygons)))
    labels = np.concatenate((np.zeros((len(polygons), 2)), np.array(cls)[:, None], boxes), 1)
    return RawBatch(
        images=torch.full((1, 64, 64, 3), 114, dtype=torch.uint8), sizes=torch.tensor([[64, 64]]),
        groups=torch.zeros((1, 1), dtype=torch.int64), labels=torch.tensor(labels, dtype=torch.float32),
        im_file=("a.jpg",), ori_shape=((64, 64),), ratio_pad=((1.0, 1.0),), segments=torch.from_numpy(outlines),
    )


def apply(raw: RawBatch, matrix: torch.Tensor | None = None, **hyp) -> dict:
    aug = GpuAugment(64, dict(dict(mosaic=0.0, translate=0.0, scale=0.0, fliplr=0.0), **hyp), segments=M)
    p = aug.draw(raw, torch.Generator().manual_seed(0))
    if matrix is not None:
        p.matrix = matrix[None]
    return aug.apply(raw, p)


def rotation(degrees: float, about=(32.0, 32.0)) -> torch.Tensor:
    a = np.deg2rad(degrees)
    c, s = np.cos(a), np.sin(a)
    x, y = about
    return torch.tensor([[c, -s, x - c * x + s * y], [s, c, y - s * x - c * y], [0, 0, 1]], dtype=torch.float32)


def test_boxes_are_the_warped_polygons_extent_not_the_warped_corners():
    """A disc turned by 45 degrees keeps its 20-pixel box (the corners' box would grow to 28); a disc pushed half out
    of the image gets the box of its visible half, with the image's border crossings."""
    angles = np.linspace(0, 2 * np.pi, 48, endpoint=False)
    disc = [(32 + 10 * np.cos(t), 32 + 10 * np.sin(t)) for t in angles]
    out = apply(tiny_segment_batch([disc]), rotation(45.0))
    torch.testing.assert_close(out["bboxes"] * 64, torch.tensor([[32.0, 32.0, 20.0, 20.0]]), atol=0.1, rtol=0)
    shift = torch.tensor([[1.0, 0, 32], [0, 1, 0], [0, 0, 1]])  # centre at x = 64: the right half leaves
    out = apply(tiny_segment_batch([disc]), shift)
    torch.testing.assert_close(out["bboxes"] * 64, torch.tensor([[59.0, 32.0, 10.0, 20.0]]), atol=0.1, rtol=0)
    corner = torch.tensor([square(-10.0, -10.0, 10.0, 10.0)])  # a polygon round the image's corner: it is enclosed
    torch.testing.assert_close(segment_boxes(corner, 64), torch.tensor([[0.0, 0.0, 10.0, 10.0]]))
    outside = torch.tensor([square(70.0, 10.0, 80.0, 20.0)])
    torch.testing.assert_close(segment_boxes(outside, 64), torch.zeros(1, 4))


def test_rows_are_sorted_by_mask_area_and_smaller_masks_drawn_over_larger():
    """Label order small, large, middle: Format reorders them large, middle, small (the classes and boxes with them)
    and the small square, inside the large one, keeps its own value."""
    raw = tiny_segment_batch([square(20.3, 20.3, 27.7, 27.7), square(4.1, 4.1, 44.3, 44.3),
                              square(48.2, 8.2, 60.1, 40.4)], cls=[0, 1, 2])
    out = apply(raw)
    assert out["cls"].view(-1).tolist() == [1.0, 2.0, 0.0]
    masks = out["masks"][0]
    areas = [int((masks == v).sum()) for v in (1, 2, 3)]
    assert areas[0] > areas[1] > areas[2] > 0
    small = masks[5:7, 5:7]  # mask pixels whose centres (4u + 2) lie inside the small square
    assert (small == 3).all() and (masks[2, 2] == 1)
    x, y, w, h = (out["bboxes"][2] * 64).tolist()  # the small square's box is the last row
    torch.testing.assert_close(torch.tensor([x, y, w, h]), torch.tensor([24.0, 24.0, 7.4, 7.4]), atol=1e-4, rtol=0)
    # the class of the instance drawn last; where none is, the class of the last row (Format indexes them by mask - 1)
    assert torch.equal(out["sem_masks"][0], torch.tensor([0.0, 1.0, 2.0, 0.0])[masks.long()])


def test_without_overlap_each_row_has_its_own_mask_in_row_order():
    raw = tiny_segment_batch([square(20.3, 20.3, 27.7, 27.7), square(4.1, 4.1, 44.3, 44.3)])
    overlap, alone = apply(raw), apply(raw, overlap_mask=False)
    assert alone["masks"].shape == (2, 16, 16) and alone["masks"].dtype == torch.uint8
    assert alone["cls"].view(-1).tolist() == [0.0, 1.0]  # not sorted
    assert alone["masks"][0].sum() < alone["masks"][1].sum() and (alone["masks"][0] <= alone["masks"][1]).all()
    assert torch.equal(alone["masks"][0].bool(), overlap["masks"][0] == 2)


def test_a_flip_mirrors_the_masks_and_the_boxes():
    triangle = [(10.3, 8.7), (50.2, 20.1), (18.9, 55.6)]
    plain = apply(tiny_segment_batch([triangle]))
    both = apply(tiny_segment_batch([triangle]), fliplr=1.0, flipud=1.0)
    assert torch.equal(both["masks"], plain["masks"].flip(-1, -2))
    torch.testing.assert_close(both["bboxes"], torch.tensor([[1.0, 1.0, 0.0, 0.0]]) - plain["bboxes"] *
                               torch.tensor([1.0, 1.0, -1.0, -1.0]))


def test_cutmix_clamps_its_partners_polygons_into_the_pasted_area():
    aug = GpuAugment(64, dict(cutmix=0.5), segments=2)
    points = torch.tensor([[[5.0, 5.0], [30.0, 30.0]], [[5.0, 5.0], [50.0, 20.0]]])
    host, block = torch.zeros(2, dtype=torch.int64), torch.tensor([0, 1])  # own row, then CutMix's partner
    out = cutmix_segments(aug, points, host, block, torch.tensor([[10.0, 10.0, 40.0, 40.0]]))
    torch.testing.assert_close(out, torch.tensor([[[5.0, 5.0], [30.0, 30.0]], [[10.0, 10.0], [40.0, 20.0]]]))


def test_resampling_keeps_every_vertex_and_the_passes_change_nothing(monkeypatch):
    triangle = np.array([[0, 0], [4, 0], [0, 3]], np.float32)
    many = np.stack([np.cos(np.linspace(0, 6.28, 300)), np.sin(np.linspace(0, 6.28, 300))], 1).astype(np.float32)
    flat = np.concatenate((triangle, many))
    out = resample_segments(flat, np.array([0, 3, 3, 303]), 10)
    assert out.shape == (3, 10, 2)
    assert all(any(np.allclose(v, p) for p in out[0]) for v in triangle)  # the vertices, and points on the edges
    assert (out[1] == 0).all()  # a row without a polygon
    assert np.abs(np.hypot(*out[2].T) - 1).max() < 1e-3  # more vertices than points: sampled along the outline
    angles = torch.linspace(0, 6.28, M)
    discs = torch.stack([torch.stack((c + r * torch.cos(angles), c + r * torch.sin(angles)), 1)
                         for c, r in ((30.0, 20.0), (10.0, 5.0), (50.0, 9.0))])
    whole = segment_masks.rasterized(discs, 16, 4)
    monkeypatch.setattr(segment_masks, "ELEMENTS_PER_PASS", 1)  # one instance per pass
    assert torch.equal(segment_masks.rasterized(discs, 16, 4), whole)
    monkeypatch.setattr(augment_segments, "POINTS_PER_PASS", 1)
    torch.testing.assert_close(segment_boxes(discs, 64), augment_segments._segment_boxes(discs, 64.0))


def test_through_decode_and_the_image_buffer_each_mask_covers_its_rectangle(tmp_path):
    """The rank's path: polygons (each rectangle's corners) into the workers' batch (pickled as a worker hands it
    over), the image buffer's polygon store (grown past its width), mosaic, an affine warp and both flips: each
    instance's mask lies where its rectangle's colour shows in the augmented image."""
    import pickle

    from launcher.rank.data.encoded import EncodedImages, EncodedTrainDataset
    from launcher.rank.gpu_data.gpu_input import Decoder, GpuInput
    from tests.test_gpu_input_batches import rectangles

    boxes, colours = rectangles(tmp_path, 16)
    xy, wh = boxes.xywh[:, :2], boxes.xywh[:, 2:] / 2
    corners = np.stack((xy - wh, xy + wh * [1, -1], xy + wh, xy + wh * [-1, 1]), 1).reshape(-1, 2)
    images = EncodedImages(*boxes[:4], segments=corners.astype(np.float32),
                           segment_starts=np.arange(0, len(corners) + 1, 4), segment_points=16)
    ds = EncodedTrainDataset(images, decode_all=True)
    hyp = dict(mosaic=1.0, degrees=20.0, translate=0.1, scale=0.3, shear=5.0, fliplr=0.5, flipud=0.5,
               hsv_h=0.0, hsv_s=0.0, hsv_v=0.0)
    gi = GpuInput(GpuAugment(64, hyp, segments=16), Decoder(torch.device("cpu"), images.files), capacity=16,
                  device=torch.device("cpu"))
    gi.labels, gi.segments = gi.labels[:, :1], gi.segments[:, :1]  # one label per slot: the first batch grows both
    covered, within = [], []
    for k in range(2):
        encoded = pickle.loads(pickle.dumps(ds.collate_fn([ds[(0, i)] for i in range(8 * k, 8 * k + 8)])))
        batch = gi(encoded, torch.Generator().manual_seed(k))
        assert batch["masks"].shape == (8, 16, 16)
        for j in range(len(batch["cls"])):
            b, c = int(batch["batch_idx"][j]), int(batch["cls"][j])
            if ((batch["batch_idx"] == b) & (batch["cls"][:, 0] == c)).sum() > 1:  # a partner drawn twice
                continue
            shown = (batch["img"][b] == torch.tensor(colours[c], dtype=torch.uint8)[:, None, None]).all(0)
            shown = torch.nn.functional.avg_pool2d(shown[None].float(), 4)[0] > 0.5
            rank = int((batch["batch_idx"][:j] == b).sum())
            mask = batch["masks"][b] == rank + 1
            near = torch.nn.functional.max_pool2d(shown[None].float(), 3, stride=1, padding=1)[0].bool()
            if shown.sum() >= 4:  # the mask covers the colour and stays within a mask pixel of it
                covered.append(float((mask & shown).sum() / shown.sum()))
                within.append(float((mask & near).sum() / mask.sum()))
    assert gi.segments.shape[1] == 2 and len(covered) > 10, covered
    assert min(covered) > 0.9 and min(within) > 0.9, (covered, within)


def segment_case(device: torch.device, seed: int = 0, obb: bool = False):
    """A segmentation batch on `device`: 8 samples of 4 mosaic tiles, each tile with 1 to 5 random polygons (some
    crossing the borders), strong warps, both flips, MixUp and CutMix partners; its draws made on the CPU and moved
    there. With `obb` an obb batch instead: each polygon's 4 corners of a rotated rectangle. Returns (GpuAugment,
    RawBatch, AugmentParams)."""
    from dataclasses import fields, replace

    rng = np.random.default_rng(seed)
    b, mixes = 8, 2
    rows = b * (1 + mixes)
    polygons, labels = [], []
    for r in range(rows):
        for t in range(4):
            for _ in range(int(rng.integers(1, 6))):
                centre, radius = rng.uniform(-5, 69, 2), rng.uniform(3, 25)
                angles = np.sort(rng.uniform(0, 2 * np.pi, int(rng.integers(3, 12))))
                if obb:  # a rectangle's corners: two opposite pairs on the circle
                    angles = angles[0] + np.array([0.0, angles[1] - angles[0], np.pi, np.pi + angles[1] - angles[0]])
                polygon = centre + radius * np.stack((np.cos(angles), np.sin(angles)), 1)
                polygons.append(polygon.astype(np.float32))
                labels.append([r, t, int(rng.integers(0, 3)), *polygon.min(0).clip(0, 64), *polygon.max(0).clip(0, 64)])
    starts = np.concatenate(([0], np.cumsum([len(p) for p in polygons]))).astype(np.int64)
    n = rows * 4
    raw = RawBatch(images=torch.full((n, 64, 64, 3), 114, dtype=torch.uint8), sizes=torch.tensor([[64, 64]] * n),
                   groups=torch.arange(n).view(rows, 4), labels=torch.tensor(labels, dtype=torch.float32),
                   im_file=("a.jpg",) * b, ori_shape=((64, 64),) * b, ratio_pad=((1.0, 1.0),) * b,
                   segments=torch.from_numpy(resample_segments(np.concatenate(polygons), starts, 4 if obb else M)))
    aug = GpuAugment(64, dict(STRONG, mixup=0.5, cutmix=0.7), segments=4 if obb else M, obb=obb)
    params = aug.draw(raw, torch.Generator().manual_seed(seed))
    moved = {f.name: getattr(params, f.name).to(device) for f in fields(params)
             if isinstance(getattr(params, f.name), torch.Tensor)}
    return aug, raw.to(device), replace(params, **moved)


def test_a_segment_batch_is_the_same_on_every_device_it_is_built_on():
    """The helper the CUDA test compares devices with (tests/test_cuda_input.py): on the CPU twice, the same batch;
    with polygons crossing the borders, mixed and flipped samples and both mask formats."""
    for overlap in (True, False):
        aug, raw, p = segment_case(torch.device("cpu"))
        aug.overlap_mask = overlap
        one, two = aug.apply(raw, p), aug.apply(*segment_case(torch.device("cpu"))[1:])
        assert len(one["cls"]) > 20 and torch.equal(one["masks"], two["masks"]) and torch.equal(one["cls"], two["cls"])

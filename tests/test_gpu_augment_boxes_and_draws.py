"""GpuAugment (rank/gpu_data/gpu_augment.py) checked by its own meaning rather than against Ultralytics' pipeline: every
box frames the object it labels through mosaic, rotation, shear, scale and flips; the random choices follow the
configured distributions; after close_mosaic each sample is its own image; the generator alone decides. All on CPU
tensors. Draw for draw against Ultralytics, the batch format and statistics: tests/test_gpu_augment.py; MixUp and
CutMix: tests/test_gpu_augment_mixes.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from launcher.rank.data.raw_batch import RawBatch
from launcher.rank.gpu_data.gpu_augment import GpuAugment
from tests.test_gpu_augment import IMGSZ, STRONG, data, generator, hyp, raw_dataset, ul  # and its fixtures


# --- every box frames the object it labels --------------------------------------------------------------------
def separate_boxes(rng, w: int, h: int, n: int, sides: tuple[int, int]) -> list[tuple[int, int, int, int]]:
    """n boxes (x1, y1, x2, y2) inside w x h, sides in [sides), at least 2 pixels apart from each other."""
    placed: list[tuple[int, int, int, int]] = []
    while len(placed) < n:
        bw, bh = rng.integers(*sides, 2)
        x1, y1 = int(rng.integers(0, w - bw)), int(rng.integers(0, h - bh))
        box = (x1, y1, x1 + int(bw), y1 + int(bh))
        if all(box[0] > o[2] + 2 or o[0] > box[2] + 2 or box[1] > o[3] + 2 or o[1] > box[3] + 2 for o in placed):
            placed.append(box)
    return placed


def rectangles_batch(b: int, s: int, seed: int) -> tuple[RawBatch, dict[int, tuple[int, int, int]]]:
    """b mosaic samples of 4 distinct raw images (s x 3s/4), 3 solid rectangles each; class = colour = object."""
    rng = np.random.default_rng(seed)
    levels = (0, 64, 128, 192, 255)
    colours = [c for c in np.ndindex(5, 5, 5) if len(set(c)) > 1]  # no greys, so never the 114 border
    rng.shuffle(colours)
    h, w = 3 * s // 4, s
    images = torch.full((4 * b, s, s, 3), 114, dtype=torch.uint8)
    images[:, :h, :w] = torch.tensor((30, 30, 30), dtype=torch.uint8)
    rows, palette = [], {}
    for n in range(4 * b):
        for box in separate_boxes(rng, w, h, 3, (14, 35)):
            obj = len(palette)
            palette[obj] = tuple(levels[i] for i in colours[obj])  # BGR
            images[n, box[1] : box[3], box[0] : box[2]] = torch.tensor(palette[obj], dtype=torch.uint8)
            rows.append((n // 4, n % 4, obj, *box))
    raw = RawBatch(
        images=images,
        sizes=torch.tensor([(h, w)] * 4 * b),
        groups=torch.arange(4 * b).view(b, 4),
        labels=torch.tensor(rows, dtype=torch.float32),
        im_file=tuple(f"im{i}.jpg" for i in range(b)),
        ori_shape=((h, w),) * b,
        ratio_pad=((1.0, 1.0),) * b,
    )
    return raw, palette


def visible_box(img: torch.Tensor, colour_rgb) -> tuple[torch.Tensor, int] | None:
    """The pixel box of the object of this colour in a (3, S, S) image, and its pixel count, or None if it shows no
    3 x 3 block of its colour. Pixels of exactly the colour count when within 3 pixels of such a block: this keeps
    the thin corners of a rotated rectangle and drops blends elsewhere that happen to equal the colour."""
    mask = (img == torch.tensor(colour_rgb, dtype=torch.uint8)[:, None, None]).all(0).float()[None, None]
    core = -torch.nn.functional.max_pool2d(-mask, 3, stride=1, padding=1)  # 3 x 3 erosion
    if core.sum() == 0:
        return None
    near = mask * torch.nn.functional.max_pool2d(core, 7, stride=1, padding=3)
    ys, xs = torch.nonzero(near[0, 0], as_tuple=True)
    return torch.tensor([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], dtype=torch.float32), int(mask.sum())


def fully_inside(raw: RawBatch, p, row: torch.Tensor, s: int) -> bool:
    """Whether the object of this label row lies wholly on the mosaic canvas and, warped, wholly in the output."""
    b, q = int(row[0]), int(row[1])
    h, w = raw.sizes[raw.groups[b, q]].tolist()
    xc, yc = p.centre[b].tolist()
    pad = torch.tensor([xc - w if q in (0, 2) else xc, yc - h if q in (0, 1) else yc] * 2, dtype=torch.float32)
    box = row[3:] + pad
    corners = torch.tensor([[box[0], box[1], 1], [box[2], box[1], 1], [box[0], box[3], 1], [box[2], box[3], 1]])
    warped = corners @ p.matrix[b].T
    warped = warped[:, :2] / warped[:, 2:]
    return bool((box >= 0).all() and (box <= 2 * s).all() and (warped >= 0).all() and (warped <= s).all())


def test_every_box_frames_its_object_through_mosaic_rotation_shear_scale_and_flips():
    s = 96
    aug = GpuAugment(s, dict(STRONG, mosaic=1.0, hsv_h=0.0, hsv_s=0.0, hsv_v=0.0))
    tight = shown = 0
    for seed in range(4):
        raw, palette = rectangles_batch(8, s, seed)
        p = aug.draw(raw, generator(seed))
        out = aug.apply(raw, p)
        rows = {(int(r[0]), int(r[2])): r for r in raw.labels}  # (sample, object) -> its raw label row
        labelled = set()
        for k in range(len(out["bboxes"])):
            b, obj = int(out["batch_idx"][k]), int(out["cls"][k, 0])
            labelled.add((b, obj))
            cx, cy, bw, bh = (out["bboxes"][k] * s).tolist()
            label = torch.tensor([cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2])
            found = visible_box(out["img"][b], palette[obj][::-1])
            assert found is not None or min(bw, bh) < 8, f"sample {b}: object {obj} is labelled but not visible"
            if found is None:
                continue
            gap = found[0] - label  # > 0 on the left and top sides: the box is wider than what shows
            # Never narrower than the object (a pixel of slack for the grid). Where nothing was clipped, no wider than
            # the grid plus the rim where the bilinear filter blends the object's colour into its surroundings (half a
            # source pixel each side, scaled, rotated and sheared): 1.5 + scale pixels.
            assert (gap[:2] > -1).all() and (gap[2:] < 1).all(), (b, obj, found[0], label)
            if fully_inside(raw, p, rows[b, obj], s):
                rim = 1.5 + float(p.scale[b])
                assert (gap[:2] < rim).all() and (gap[2:] > -rim).all(), (b, obj, found[0], label)
                tight += 1
        # the other way round: an object that shows a quarter of its (scaled) self is labelled
        for (b, obj), row in rows.items():
            found = visible_box(out["img"][b], palette[obj][::-1])
            area = float((row[5] - row[3]) * (row[6] - row[4])) * float(p.scale[b]) ** 2
            if found is not None and found[1] >= 0.25 * area:
                assert (b, obj) in labelled, f"sample {b}: object {obj} shows {found[1]} pixels and has no label"
                shown += 1
    assert tight > 40 and shown > 100, (tight, shown)  # the checks above did run, on many objects


# --- the random choices follow the configured distributions --------------------------------------------------
def empty_raw(n: int) -> RawBatch:
    """n mosaic samples of one blank image: enough for `draw`."""
    return RawBatch(
        images=torch.zeros(1, IMGSZ, IMGSZ, 3, dtype=torch.uint8),
        sizes=torch.tensor([[48, 64]]),
        groups=torch.zeros(n, 4, dtype=torch.int64),
        labels=torch.zeros(0, 7),
        im_file=("a.jpg",) * n,
        ori_shape=((48, 64),) * n,
        ratio_pad=((1.0, 1.0),) * n,
    )


def assert_uniform(x: torch.Tensor, lo: float, hi: float, what: str) -> None:
    x, width = x.double(), hi - lo
    assert lo <= x.min() < lo + 0.01 * width, f"{what}: minimum {x.min()}"
    assert hi - 0.01 * width < x.max() <= hi, f"{what}: maximum {x.max()}"
    assert abs(x.mean() - (lo + hi) / 2) < 0.012 * width, f"{what}: mean {x.mean()}"  # 5 standard errors at n=20000
    assert abs(x.std() - width / math.sqrt(12)) < 0.01 * width, f"{what}: std {x.std()}"


def assert_rate(flags: torch.Tensor, p: float, what: str) -> None:
    assert abs(flags.double().mean() - p) < 0.016, f"{what}: rate {flags.double().mean()} for p={p}"  # 5 s.e.


def test_random_choices_follow_ultralytics_defaults(ul):
    n = 20000
    p = GpuAugment(IMGSZ, hyp(ul, mosaic=0.7)).draw(empty_raw(n), generator(0))  # every other value: the default
    assert_rate(p.mosaic, 0.7, "mosaic")
    centres = p.centre[p.mosaic]
    assert_uniform(centres + 0.5, IMGSZ / 2, 3 * IMGSZ / 2, "mosaic centre")  # integers, int(uniform(s/2, 3s/2))
    assert (p.centre[~p.mosaic] == 0).all()
    assert_uniform(p.scale, 0.5, 1.5, "scale")
    for k in range(2):
        assert_uniform(p.translate[:, k], 0.4, 0.6, "translate")
    assert (p.angle == 0).all() and (p.shear == 0).all() and (p.perspective == 0).all()
    for k, gain in enumerate((0.015, 0.7, 0.4)):
        assert_uniform(p.hsv[:, k], -gain, gain, f"hsv gain {k}")
    assert_rate(p.flip_lr, 0.5, "fliplr")
    assert not p.flip_ud.any() and p.rgb.all()


def test_random_choices_follow_strong_settings(ul):
    n = 20000
    p = GpuAugment(IMGSZ, hyp(ul, **STRONG, perspective=0.001, bgr=0.25)).draw(empty_raw(n), generator(1))
    assert p.mosaic.all()
    assert_uniform(p.angle, -30, 30, "degrees")
    for k in range(2):
        assert_uniform(p.shear[:, k], -10, 10, "shear")
        assert_uniform(p.translate[:, k], 0.3, 0.7, "translate")
        assert_uniform(p.perspective[:, k], -0.001, 0.001, "perspective")
    assert_rate(p.flip_ud, 0.5, "flipud")
    assert_rate(~p.rgb, 0.25, "bgr")
    flips = torch.stack((p.flip_lr, p.flip_ud), 1).double()
    assert abs(torch.corrcoef(flips.T)[0, 1]) < 0.04  # every choice is its own draw


# --- what decides the draws -----------------------------------------------------------------------------------
def test_after_close_mosaic_each_sample_is_its_own_image(ul, data):
    raw_ds = raw_dataset(ul, data)
    raw_ds.close_mosaic()
    raw = raw_ds.collate_fn([raw_ds[(7, i)] for i in range(8)])
    assert raw.groups.shape == (8, 1) and raw.images.shape[0] == 8
    aug = GpuAugment(IMGSZ, hyp(ul))
    assert not aug.draw(raw, generator(0)).mosaic.any()


def test_the_generator_alone_decides(ul, data):
    raw_ds = raw_dataset(ul, data)
    raw = raw_ds.collate_fn([raw_ds[(0, i)] for i in range(8)])
    aug = GpuAugment(IMGSZ, hyp(ul))
    a, b, c = aug(raw, generator(5)), aug(raw, generator(5)), aug(raw, generator(6))
    assert all(torch.equal(a[k], b[k]) for k in ("img", "bboxes", "cls", "batch_idx"))
    assert not torch.equal(a["img"], c["img"])

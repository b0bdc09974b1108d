"""GPU-side augmentation (rank/data/gpu_augment.py, rendered by warp.py) against Ultralytics 8.4.190's own pipeline.

All on CPU tensors, on a small generated dataset: the strongest check feeds Ultralytics' Mosaic, RandomPerspective,
RandomHSV, RandomFlip and Format the random draws GpuAugment made and compares images and boxes; the others check
the semantics on their own (boxes frame what they label, parameter distributions, the batch format, the identity,
batch statistics against Ultralytics' randomly seeded pipeline) and the loader's determinism.
"""

from __future__ import annotations

import copy
import math
from dataclasses import fields, replace

import numpy as np
import pytest
import torch

from launcher.inputs import shapes
from launcher.rank.data.augment_boxes import box_candidates
from launcher.rank.data.gpu_augment import GpuAugment
from launcher.rank.data.pipeline import MAX_TARGETS, TARGETS_PER_IMAGE
from launcher.rank.data.raw_batch import RawBatch
from launcher.rank.data.warp import hsv_shift
from tests.raw_batches import RawTrainDataset

IMGSZ = 64
STRONG = dict(degrees=30.0, translate=0.2, scale=0.5, shear=10.0, fliplr=0.5, flipud=0.5)


@pytest.fixture(scope="module")
def ul():
    """Ultralytics' modules, imported when the first test needs them."""
    from ultralytics.cfg import get_cfg
    from ultralytics.data import augment

    return get_cfg, augment


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    spec = shapes.ShapesSpec(train_images=48, val_images=1, width=96, height=72, max_objects=5, texture=True)
    yaml_path = shapes.ensure_dataset(tmp_path_factory.mktemp("shapes"), spec, workers=1)
    root = yaml_path.parent
    return {"train": str(root / "images" / "train"), "names": dict(enumerate(shapes.CLASSES)), "nc": 3, "channels": 3}


def hyp(ul, imgsz=IMGSZ, **overrides):
    get_cfg, _ = ul
    return get_cfg(overrides={"imgsz": imgsz, **overrides})


def raw_dataset(ul, data, seed=0, imgsz=IMGSZ, **kw) -> RawTrainDataset:
    from launcher.rank.ultralytics.datasets import raw_train_dataset

    return RawTrainDataset(raw_train_dataset(hyp(ul, imgsz), data, 8), seed, **kw)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- against Ultralytics, draw for draw ------------------------------------------------------------------------------
class Scripted:
    """Stands in for Python's `random` inside ultralytics.data.augment: returns the given values in the given order."""

    def __init__(self, calls: list[tuple[str, object]]):
        self.calls = list(calls)

    def _next(self, name):
        expected, value = self.calls.pop(0)
        assert expected == name, f"Ultralytics called random.{name}, the script expected random.{expected}"
        return value

    def uniform(self, a, b):
        return self._next("uniform")

    def random(self):
        return self._next("random")

    def choices(self, population, k):
        return self._next("choices")

    def randint(self, a, b):
        return self._next("randint")


def scripted_calls(params, b: int, tiles: list[int]) -> list[tuple[str, object]]:
    """The `random` calls Mosaic, RandomPerspective, the two RandomFlips and Format make for sample b, answered with
    GpuAugment's draws (`tiles`: the sample's raw images, its own first)."""
    mosaic = bool(params.mosaic[b])
    xc, yc = params.centre[b].tolist()
    calls = [("uniform", 0.0 if mosaic else 1.0)]  # Mosaic's "apply?" draw, against p
    if mosaic:
        calls += [("choices", tiles[1:]), ("uniform", yc), ("uniform", xc)]
    calls += [("uniform", float(v)) for v in params.perspective[b]]
    calls += [("uniform", float(params.angle[b])), ("uniform", float(params.scale[b]))]
    calls += [("uniform", float(v)) for v in params.shear[b]] + [("uniform", float(v)) for v in params.translate[b]]
    calls += [("random", 0.0 if params.flip_ud[b] else 0.999), ("random", 0.0 if params.flip_lr[b] else 0.999)]
    return calls + [("uniform", 0.5)]  # Format: RGB


def ultralytics_sample(ul, monkeypatch, raw_ds, hyp_ns, params, b: int, tiles: list[int]) -> dict:
    """Ultralytics' classes composed as v8_transforms composes them (mixup, cutmix, copy_paste are 0 and skipped),
    given GpuAugment's draws for sample b."""
    _, augment = ul
    ds = raw_ds.dataset
    mosaic = bool(params.mosaic[b])
    monkeypatch.setattr(augment, "random", Scripted(scripted_calls(params, b, tiles)))
    gains = np.array([hyp_ns.hsv_h, hyp_ns.hsv_s, hyp_ns.hsv_v])
    unit = np.divide(params.hsv[b].double().numpy(), gains, out=np.zeros(3), where=gains > 0)
    monkeypatch.setattr(augment.np.random, "uniform", lambda lo, hi, n: unit)

    pipeline = augment.Compose(
        [
            augment.Mosaic(ds, imgsz=hyp_ns.imgsz, p=hyp_ns.mosaic if mosaic else 0.0),  # 0 after close_mosaic
            augment.RandomPerspective(
                degrees=hyp_ns.degrees,
                translate=hyp_ns.translate,
                scale=hyp_ns.scale,
                shear=hyp_ns.shear,
                perspective=hyp_ns.perspective,
                size=(hyp_ns.imgsz, hyp_ns.imgsz),
            ),
            augment.RandomHSV(hgain=hyp_ns.hsv_h, sgain=hyp_ns.hsv_s, vgain=hyp_ns.hsv_v),
            augment.RandomFlip(direction="vertical", p=hyp_ns.flipud),
            augment.RandomFlip(direction="horizontal", p=hyp_ns.fliplr),
            augment.Format(bbox_format="xywh", normalize=True, batch_idx=True),
        ]
    )
    out = pipeline(ds.get_image_and_label(tiles[0]))
    monkeypatch.undo()
    return out


@pytest.mark.parametrize(("mosaic", "hsv"), [(True, False), (False, False), (True, True)])
def test_given_the_same_draws_images_and_boxes_are_ultralytics(ul, data, monkeypatch, mosaic, hsv):
    """With mosaic, and without (after close_mosaic), with rotation, shear, perspective, both flips, and HSV."""
    # translate 0.4 and scale 0.9: many boxes end cut by the border, where box_candidates decides
    no_hsv = {} if hsv else dict(hsv_h=0.0, hsv_s=0.0, hsv_v=0.0)
    hyp_ns = hyp(ul, **dict(STRONG, translate=0.4, scale=0.9), perspective=0.0005, **no_hsv)
    raw_ds = raw_dataset(ul, data, mosaic=mosaic)
    samples = [raw_ds[(0, i)] for i in range(16)]
    raw = raw_ds.collate_fn(samples)
    aug = GpuAugment(IMGSZ, hyp_ns)
    params = aug.draw(raw, generator(1))
    ours = aug.apply(raw, params)

    diffs = []
    for b, sample in enumerate(samples):
        tiles = [t.index for t in sample.tiles]
        theirs = ultralytics_sample(ul, monkeypatch, raw_ds, hyp_ns, params, b, tiles)
        diffs.append((ours["img"][b].int() - theirs["img"].int()).abs())
        mine = ours["bboxes"][ours["batch_idx"] == b]
        assert len(mine) == len(theirs["bboxes"]), f"sample {b}: {len(mine)} boxes, Ultralytics {len(theirs['bboxes'])}"
        torch.testing.assert_close(mine, theirs["bboxes"], atol=2e-3, rtol=0)  # 2e-3 x 64 px: an eighth of a pixel
        torch.testing.assert_close(ours["cls"][ours["batch_idx"] == b], theirs["cls"])
    diff = torch.stack(diffs).float()
    if hsv:  # float HSV against Ultralytics' uint8 lookup tables: the rounding of theirs (see test_hsv_...)
        assert diff.mean() < 1.0, f"mean |difference| {diff.mean():.4f} grey levels"
        assert diff.flatten().quantile(0.999) <= 10 and diff.max() <= 20, float(diff.max())
        return
    # The warps round a few values differently (~0.02 %); nothing else differs.
    assert (diff > 0).float().mean() < 1e-3, f"{(diff > 0).float().mean():.5f} of the values differ"
    assert diff.mean() < 0.01, f"mean |difference| {diff.mean():.4f} grey levels"


def test_box_candidates_are_ultralytics(ul):
    _, augment = ul
    g = generator(0)
    before = torch.rand(5000, 2, generator=g) * 40  # (w, h) x scale
    after = torch.rand(5000, 4, generator=g) * 40
    after[:, 2:] += after[:, :2]  # xyxy, some thinner than 2 px, some with a tenth of the area, some very elongated
    after[::7, 3] = after[::7, 1] + 0.3
    before_xyxy = torch.cat((torch.zeros_like(before), before), 1)
    theirs = augment.RandomPerspective.box_candidates(before_xyxy.T.numpy(), after.T.numpy())
    assert 0.05 < theirs.mean() < 0.95
    np.testing.assert_array_equal(box_candidates(before, after).numpy(), theirs)


def test_hsv_is_ultralytics_random_hsv_up_to_its_uint8_rounding(ul, monkeypatch):
    """Ultralytics goes through OpenCV's uint8 HSV (hue in 2-degree steps) and truncating lookup tables; the GPU pass
    computes the same transform in float. Greys stay grey, zero gains change nothing, and the rest agrees to the
    rounding of a 2-degree hue step (up to ~9 grey levels on saturated bright pixels, under one on average)."""
    _, augment = ul
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
    img[:4] = rng.integers(0, 256, (4, 64, 1))  # greys: no saturation, hue 0
    rgb = torch.from_numpy(img[..., ::-1].copy()).float().view(1, -1, 3)
    same = hsv_shift(*rgb.unbind(-1), torch.zeros(1, 3))
    torch.testing.assert_close(torch.stack(same, -1), rgb, atol=1e-3, rtol=0)
    for gains in ((0.5, 0.5, 0.25), (0.015, 0.7, 0.4)):
        r = torch.tensor(rng.uniform(-1, 1, 3) * gains, dtype=torch.float32)
        unit = r.double().numpy() / np.array(gains)
        monkeypatch.setattr(augment.np.random, "uniform", lambda lo, hi, n: unit)
        theirs = augment.RandomHSV(*gains).apply_image({"img": img.copy()})["img"][..., ::-1]  # BGR -> RGB
        ours = torch.stack(hsv_shift(*rgb.unbind(-1), r[None]), -1).view(img.shape)
        diff = (ours - torch.from_numpy(theirs.copy()).float()).abs()
        grey = ours[:4]
        assert (grey.amax(-1) - grey.amin(-1)).max() < 1e-3  # greys stay grey
        assert diff.mean() < 1.0 and diff.flatten().quantile(0.99) <= 6 and diff.max() <= 16, (diff.mean(), diff.max())


# --- (a) every box frames the object it labels --------------------------------------------------------------------
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


# --- (b) the random choices follow the configured distributions --------------------------------------------------
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


# --- (c) the batch Ultralytics' collate_fn gives -------------------------------------------------------------------
def ultralytics_dataset(ul, data, args):
    from ultralytics.data.build import build_yolo_dataset

    from launcher.rank.data.sampler import EpochSeededDataset

    return EpochSeededDataset(build_yolo_dataset(args, data["train"], 8, data, mode="train"), 0)


def test_the_batch_has_ultralytics_collated_format(ul, data):
    args = hyp(ul)
    keys = [(0, i) for i in range(8)]
    theirs_ds = ultralytics_dataset(ul, data, args)
    theirs = theirs_ds.collate_fn([theirs_ds[k] for k in keys])
    raw_ds = raw_dataset(ul, data)
    ours = GpuAugment(IMGSZ, args)(raw_ds.collate_fn([raw_ds[k] for k in keys]), generator(0))

    most, counts = ours.pop(MAX_TARGETS), ours.pop(TARGETS_PER_IMAGE)  # for the loss, not in Ultralytics' batch
    assert list(ours) == list(theirs)  # the same keys, in the same (sorted) order
    assert counts == torch.bincount(ours["batch_idx"].long(), minlength=8).tolist() and most == max(counts)
    for key, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert (ours[key].dtype, ours[key].shape[1:]) == (value.dtype, value.shape[1:]), key
        else:
            assert ours[key] == value, key  # im_file, ori_shape, ratio_pad, resized_shape: the same samples
    assert ours["img"].shape == (8, 3, IMGSZ, IMGSZ) and ours["img"].is_contiguous()
    n = len(ours["batch_idx"])
    assert n > 8 and ours["cls"].shape == (n, 1) and ours["bboxes"].shape == (n, 4)
    assert (ours["batch_idx"].diff() >= 0).all() and set(ours["batch_idx"].tolist()) <= set(range(8))
    xy, wh = ours["bboxes"][:, :2], ours["bboxes"][:, 2:]
    assert (wh > 0).all() and (xy - wh / 2 >= -1e-6).all() and (xy + wh / 2 <= 1 + 1e-6).all()


# --- (d) no augmentation: exactly LetterBox and Format ------------------------------------------------------------
def test_with_every_strength_zero_and_no_mosaic_the_batch_is_letterbox_and_format(ul, data):
    """96 x 72 images load as 64 x 48: centring them pads 8 rows above and below, as LetterBox does."""
    _, augment = ul
    zero = dict(degrees=0.0, translate=0.0, scale=0.0, shear=0.0, hsv_h=0.0, hsv_s=0.0, hsv_v=0.0, fliplr=0.0)
    raw_ds = raw_dataset(ul, data, mosaic=False)
    ours = GpuAugment(IMGSZ, hyp(ul, **zero))(raw_ds.collate_fn([raw_ds[(0, i)] for i in range(8)]), generator(0))
    ds = raw_ds.dataset
    letterbox = augment.Compose([augment.LetterBox(new_shape=IMGSZ, scaleup=False), augment.Format(batch_idx=True)])
    theirs = ds.collate_fn([letterbox(ds.get_image_and_label(i)) for i in range(8)])
    assert torch.equal(ours["img"], theirs["img"])
    for key in ("batch_idx", "cls", "bboxes"):
        torch.testing.assert_close(ours[key], theirs[key], atol=1e-5, rtol=0)


# --- (e) batch statistics: Ultralytics' own randomly seeded pipeline on the same keys ------------------------------
def batch_statistics(batches: list[dict]) -> dict:
    img = torch.cat([b["img"] for b in batches]).float()
    boxes = torch.cat([b["bboxes"] for b in batches])
    return {
        "boxes per image": len(boxes) / len(img),
        "box side": float((boxes[:, 2] * boxes[:, 3]).sqrt().mean()),
        "box centre spread": float(boxes[:, :2].std()),
        "grey pixels": float(((img[:, 0] == img[:, 1]) & (img[:, 1] == img[:, 2])).float().mean()),  # mostly border
        "channel means": img.mean((0, 2, 3)),
        "pixel std": float(img.std()),
    }


def test_batches_look_like_ultralytics_batches(ul, data):
    """Ultralytics' defaults, the same 192 keys, each side with its own randomness: the statistics agree within
    about twice what two seeds of Ultralytics' own pipeline differ by."""
    args = hyp(ul)
    keys = [(e, i) for e in range(4) for i in range(48)]
    theirs_ds = ultralytics_dataset(ul, data, args)
    chunks = [keys[j : j + 48] for j in range(0, len(keys), 48)]
    theirs = batch_statistics([theirs_ds.collate_fn([theirs_ds[k] for k in chunk]) for chunk in chunks])
    raw_ds, aug = raw_dataset(ul, data), GpuAugment(IMGSZ, args)
    raws = [raw_ds.collate_fn([raw_ds[k] for k in chunk]) for chunk in chunks]
    ours = batch_statistics([aug(raw, generator(j)) for j, raw in enumerate(raws)])

    for key, tolerance in (("boxes per image", 0.10), ("box side", 0.06), ("box centre spread", 0.05)):
        assert abs(ours[key] / theirs[key] - 1) < tolerance, (key, ours[key], theirs[key])
    assert abs(ours["grey pixels"] - theirs["grey pixels"]) < 0.02, (ours["grey pixels"], theirs["grey pixels"])
    means = ours["channel means"], theirs["channel means"]
    assert (means[0] - means[1]).abs().max() < 8, means
    assert abs(ours["pixel std"] - theirs["pixel std"]) < 3, (ours["pixel std"], theirs["pixel std"])


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


@pytest.mark.parametrize("key", ["copy_paste", "augmentations"])
def test_refuses_what_it_does_not_implement(key):
    with pytest.raises(ValueError, match=key):
        GpuAugment(IMGSZ, {key: 0.1})


def test_a_mosaic_batch_without_the_partners_its_mixes_need_is_refused():
    """GpuInput brings a block of partners per mix that is on; a batch without them cannot be mixed."""
    with pytest.raises(ValueError, match="it needs 24 .*GpuInput draws them"):
        GpuAugment(IMGSZ, {"mixup": 0.5, "cutmix": 0.5}).draw(empty_raw(8), generator(0))


# --- (f) MixUp and CutMix ------------------------------------------------------------------------------------------
def with_partners(raw: RawBatch, samples: int) -> RawBatch:
    """`raw`'s first `samples` rows as the output samples, the rows after them as their mix partners."""
    return replace(raw, im_file=raw.im_file[:samples], ori_shape=raw.ori_shape[:samples],
                   ratio_pad=raw.ratio_pad[:samples])


def test_mix_choices_follow_ultralytics_distributions(ul):
    """How often each mix applies, MixUp's r ~ Beta(32, 32), and CutMix's candidate areas against Ultralytics' own
    CutMix._rand_bbox sampled as often."""
    _, augment = ul
    n, s = 20000, IMGSZ
    aug = GpuAugment(s, {"mixup": 0.3, "cutmix": 0.6})
    assert aug.mixes == 2
    p = aug.draw(with_partners(empty_raw(3 * n), n), generator(0))
    assert p.scale.shape == (3 * n,) and p.mixup.shape == (n,)
    assert_rate(p.mixup, 0.3, "mixup")
    assert_rate(p.cutmix, 0.6, "cutmix")
    assert abs(torch.corrcoef(torch.stack((p.mixup, p.cutmix)).double())[0, 1]) < 0.04
    theirs = np.random.default_rng(0).beta(32.0, 32.0, n)
    r = p.mix_ratio.double().numpy()
    assert abs(r.mean() - 0.5) < 5 * 0.062 / math.sqrt(n) and abs(r.std() / theirs.std() - 1) < 0.03, (r.mean(), r.std())
    quantiles = np.linspace(0.01, 0.99, 25)
    assert np.abs(np.quantile(r, quantiles) - np.quantile(theirs, quantiles)).max() < 0.004

    np.random.seed(0)
    cut = augment.CutMix(dataset=None)
    theirs = np.array([cut._rand_bbox(s, s) for _ in range(10000)], np.float32)  # ~1 s of Python calls
    ours = p.cut_areas.reshape(-1, 4).numpy()
    assert (ours == np.round(ours)).all() and ours.min() >= 0 and ours.max() <= s
    for what, a, b in (("x1", ours[:, 0], theirs[:, 0]), ("y2", ours[:, 3], theirs[:, 3]),
                       ("width", ours[:, 2] - ours[:, 0], theirs[:, 2] - theirs[:, 0]),
                       ("height", ours[:, 3] - ours[:, 1], theirs[:, 3] - theirs[:, 1])):
        assert np.abs(np.quantile(a, quantiles) - np.quantile(b, quantiles)).max() <= 1, what
        assert abs(a.mean() - b.mean()) < 0.7, (what, a.mean(), b.mean())  # ~4 standard errors
    whole = (ours[:, :2] > 0).all(1) & (ours[:, 2:] < s).all(1)  # not clipped: a square of even side around cx, cy
    side = ours[whole, 2] - ours[whole, 0]
    assert (side == ours[whole, 3] - ours[whole, 1]).all() and (side % 2 == 0).all()

    only = GpuAugment(s, {"cutmix": 0.5}).draw(with_partners(empty_raw(2 * n), n), generator(1))
    assert not only.mixup.any() and abs(only.cutmix.double().mean() - 0.5) < 0.016
    closed = empty_raw(n)
    closed.groups = closed.groups[:, :1]  # close_mosaic: one tile, no partners, no mix
    assert GpuAugment(s, {"mixup": 0.5, "cutmix": 0.5}).draw(closed, generator(0)).mixup is None


class Partner:
    """A dataset of one image for Ultralytics' MixUp and CutMix: the partner GpuAugment rendered (`use_obb`: an obb
    dataset's, which CutMix clips with preserve_obb)."""

    def __init__(self, labels: dict, use_obb: bool = False):
        self.labels, self.use_obb = labels, use_obb

    def __len__(self) -> int:
        return 1

    def get_image_and_label(self, index: int) -> dict:
        return copy.deepcopy(self.labels)


def as_ultralytics(ul, img: torch.Tensor, bboxes: torch.Tensor, cls: torch.Tensor, s: int) -> dict:
    """A rendered, unmixed sample as Ultralytics' labels after RandomPerspective: BGR HWC, pixel xyxy boxes."""
    from ultralytics.utils.instance import Instances

    xywh = bboxes.double().numpy() * s
    xyxy = np.concatenate((xywh[:, :2] - xywh[:, 2:] / 2, xywh[:, :2] + xywh[:, 2:] / 2), 1).astype(np.float32)
    return {"img": img.permute(1, 2, 0).numpy()[..., ::-1].copy(), "cls": cls.numpy().copy(),
            "instances": Instances(xyxy, bbox_format="xyxy", normalized=False)}


def ultralytics_mixed(ul, monkeypatch, hyp_ns, p, b: int, parts: dict, obb: bool = False, **masks) -> dict:
    """Ultralytics' MixUp, CutMix, RandomHSV, RandomFlip and Format, as v8_transforms composes them, on sample b's
    rendered parts (`parts[row]`: its own image, its MixUp partner, its CutMix partner, unflipped, without HSV),
    given GpuAugment's draws for sample b. `obb`: the parts are an obb dataset's; `masks`: Format's further
    arguments (return_mask=True, ..., return_obb=True)."""
    _, augment = ul
    mixup_draw, cutmix_draw = bool(p.mixup[b]), bool(p.cutmix[b])
    calls = [("uniform", 0.0 if mixup_draw else 1.0)] + [("randint", 0)] * mixup_draw
    calls += [("uniform", 0.0 if cutmix_draw else 1.0)] + [("randint", 0)] * cutmix_draw
    calls += [("random", 0.0 if p.flip_ud[b] else 0.999), ("random", 0.0 if p.flip_lr[b] else 0.999)]
    calls += [("uniform", 0.5)]  # Format: RGB
    monkeypatch.setattr(augment, "random", Scripted(calls))
    monkeypatch.setattr(augment.np.random, "beta", lambda a, c: float(p.mix_ratio[b]))
    areas = iter(p.cut_areas[b].numpy().tolist())
    monkeypatch.setattr(augment.CutMix, "_rand_bbox", lambda self, w, h: tuple(next(areas)))
    monkeypatch.setattr(augment.np.random, "choice", lambda idx: idx[int(float(p.cut_pick[b]) * len(idx))])
    gains = np.array([hyp_ns.hsv_h, hyp_ns.hsv_s, hyp_ns.hsv_v])
    unit = np.divide(p.hsv[b].double().numpy(), gains, out=np.zeros(3), where=gains > 0)
    monkeypatch.setattr(augment.np.random, "uniform", lambda lo, hi, n: unit)
    n = len(p.mixup)
    pipeline = augment.Compose([
        augment.MixUp(Partner(parts[n + b], obb), p=hyp_ns.mixup),
        augment.CutMix(Partner(parts[2 * n + b], obb), p=hyp_ns.cutmix),
        augment.RandomHSV(hgain=hyp_ns.hsv_h, sgain=hyp_ns.hsv_s, vgain=hyp_ns.hsv_v),
        augment.RandomFlip(direction="vertical", p=hyp_ns.flipud),
        augment.RandomFlip(direction="horizontal", p=hyp_ns.fliplr),
        augment.Format(bbox_format="xywh", normalize=True, batch_idx=True, **masks),
    ])
    out = pipeline(copy.deepcopy(parts[b]))
    monkeypatch.undo()
    return out


def mix_batch(ul, data, hyp_ns, seed: int, b: int = 16):
    """b samples of Ultralytics' images with 2 b partners (MixUp's, then CutMix's), their draws, the mixed batch
    and each row's unmixed render (unflipped, no HSV), as Ultralytics' labels."""
    raw_all = raw_dataset(ul, data, seed=seed).collate_fn([raw_dataset(ul, data, seed=seed)[(0, i)] for i in range(3 * b)])
    raw = with_partners(raw_all, b)
    aug = GpuAugment(IMGSZ, hyp_ns)
    p = aug.draw(raw, generator(seed))
    ours = aug.apply(raw, p)
    plain = replace(p, hsv=torch.zeros_like(p.hsv), flip_ud=torch.zeros_like(p.flip_ud),
                    flip_lr=torch.zeros_like(p.flip_lr), rgb=torch.ones_like(p.rgb), mixup=None, mix_ratio=None,
                    cutmix=None, cut_areas=None, cut_pick=None)
    rows = GpuAugment(IMGSZ, dict(vars(hyp_ns), mixup=0.0, cutmix=0.0, hsv_h=0.0, hsv_s=0.0, hsv_v=0.0)).apply(raw_all, plain)
    parts = {r: as_ultralytics(ul, rows["img"][r], rows["bboxes"][rows["batch_idx"] == r],
                               rows["cls"][rows["batch_idx"] == r], IMGSZ) for r in range(3 * b)}
    return raw, aug, p, ours, parts


@pytest.mark.parametrize("hsv", [False, True])
def test_mixed_samples_are_ultralytics_mixup_and_cutmix_then_hsv_and_flips(ul, data, monkeypatch, hsv):
    """Each sample's own image and partners as GpuAugment renders them, mixed by Ultralytics' MixUp and CutMix (its
    bbox_ioa, area choice, apply_image and apply_instances), then its RandomHSV, flips and Format, on the same draws:
    the mixed batch is theirs (boxes in Ultralytics' order: the sample's, MixUp's partner's, CutMix's partner's)."""
    from ultralytics.utils.metrics import bbox_ioa as their_ioa

    no_hsv = {} if hsv else dict(hsv_h=0.0, hsv_s=0.0, hsv_v=0.0)
    hyp_ns = hyp(ul, **dict(STRONG, translate=0.3), mixup=0.5, cutmix=0.7, **no_hsv)
    seen = {"mixup": 0, "cutmix": 0, "cutmix skipped": 0, "neither": 0}
    diffs = []
    for seed in range(2):
        raw, aug, p, ours, parts = mix_batch(ul, data, hyp_ns, seed)
        for b in range(raw.samples):
            theirs = ultralytics_mixed(ul, monkeypatch, hyp_ns, p, b, parts)
            mine = ours["bboxes"][ours["batch_idx"] == b]
            assert len(mine) == len(theirs["bboxes"]), f"sample {b}: {len(mine)} boxes, Ultralytics {len(theirs['bboxes'])}"
            torch.testing.assert_close(mine, theirs["bboxes"], atol=2e-3, rtol=0)
            torch.testing.assert_close(ours["cls"][ours["batch_idx"] == b], theirs["cls"])
            diffs.append((ours["img"][b].int() - theirs["img"].int()).abs())
            pasted = bool(p.cutmix[b]) and len(theirs["bboxes"]) > len(parts[b]["cls"]) + (
                len(parts[raw.samples + b]["cls"]) if p.mixup[b] else 0)
            seen["mixup"] += bool(p.mixup[b])
            seen["cutmix"] += pasted
            seen["cutmix skipped"] += bool(p.cutmix[b]) and not pasted
            seen["neither"] += not (p.mixup[b] or p.cutmix[b])
            if pasted:  # the area is one no box of the sample touched, by Ultralytics' own bbox_ioa
                areas = p.cut_areas[b].numpy()
                assert (their_ioa(areas, parts[b]["instances"].bboxes).sum(1) <= 0).any()
    assert min(seen.values()) >= 2, seen  # every case ran
    diff = torch.stack(diffs).float()
    if hsv:  # float HSV against Ultralytics' uint8 lookup tables, as in test_given_the_same_draws_...
        assert diff.mean() < 1.0 and diff.flatten().quantile(0.999) <= 10 and diff.max() <= 20, float(diff.max())
        return
    # MixUp's float32 blend against NumPy's float64 and the flips folded into the warps: a grey level, rarely
    assert diff.max() <= 1 and (diff > 0).float().mean() < 2e-3, (float(diff.max()), float((diff > 0).float().mean()))


def test_a_flipped_mixed_sample_has_its_image_and_boxes_flipped_together(ul, data):
    """The same draws with every sample flipped left-right and up-down, then without: image and boxes mirror each
    other, the MixUp blend, the CutMix area and HSV included."""
    hyp_ns = hyp(ul, **STRONG, mixup=0.6, cutmix=0.8)
    raw = with_partners(raw_dataset(ul, data).collate_fn([raw_dataset(ul, data)[(0, i)] for i in range(48)]), 16)
    aug = GpuAugment(IMGSZ, hyp_ns)
    p = aug.draw(raw, generator(3))
    assert p.mixup.sum() >= 4 and p.cutmix.sum() >= 4
    on, off = (aug.apply(raw, replace(p, flip_lr=torch.full_like(p.flip_lr, v), flip_ud=torch.full_like(p.flip_ud, v)))
               for v in (True, False))
    assert torch.equal(on["batch_idx"], off["batch_idx"]) and torch.equal(on["cls"], off["cls"])
    mirrored = off["bboxes"].clone()
    mirrored[:, :2] = 1 - mirrored[:, :2]
    torch.testing.assert_close(on["bboxes"], mirrored, atol=1e-5, rtol=0)
    diff = (on["img"].int() - off["img"].flip(-1, -2).int()).abs()
    assert (diff > 0).float().mean() < 2e-3 and diff.max() <= 10, (float((diff > 0).float().mean()), int(diff.max()))


def solid_mix_batch(b: int, s: int, own_box, partner_boxes) -> RawBatch:
    """b samples of one colour each, (50, 90, 200) BGR, with one box; partners of another, (240, 20, 60), with
    `partner_boxes`; every image fills the S x S output (no mosaic, no warp)."""
    images = torch.empty((3 * b, s, s, 3), dtype=torch.uint8)
    images[:b] = torch.tensor((50, 90, 200), dtype=torch.uint8)
    images[b:] = torch.tensor((240, 20, 60), dtype=torch.uint8)
    rows = [(i, 0, 0, *own_box) for i in range(b)]
    rows += [(i, 0, 1 + k, *box) for i in range(b, 3 * b) for k, box in enumerate(partner_boxes)]
    return RawBatch(images=images, sizes=torch.tensor([(s, s)] * 3 * b), groups=torch.arange(3 * b)[:, None].repeat(1, 4),
                    labels=torch.tensor(rows, dtype=torch.float32), im_file=tuple(f"{i}.jpg" for i in range(b)),
                    ori_shape=((s, s),) * b, ratio_pad=((1.0, 1.0),) * b)


def test_on_solid_images_mixup_blends_and_cutmix_pastes_the_partner_with_the_boxes_ultralytics_keeps():
    from ultralytics.utils.instance import Instances
    from ultralytics.utils.metrics import bbox_ioa as their_ioa

    s, b = 64, 64
    still = dict(mosaic=0.0, degrees=0.0, translate=0.0, scale=0.0, shear=0.0, hsv_h=0.0, hsv_s=0.0, hsv_v=0.0,
                 fliplr=0.0)
    own_box = (4.0, 4.0, 28.0, 20.0)
    partner_boxes = [(2.0, 30.0, 22.0, 60.0), (30.0, 34.0, 62.0, 50.0), (40.0, 2.0, 60.0, 12.0), (20.0, 20.0, 44.0, 40.0)]
    raw = solid_mix_batch(b, s, own_box, partner_boxes)

    mixup = GpuAugment(s, dict(still, mixup=1.0))
    first = replace(raw, groups=raw.groups[: 2 * b], labels=raw.labels[raw.labels[:, 0] < 2 * b])  # one block
    p = mixup.draw(first, generator(0))
    out = mixup.apply(first, p)
    assert p.mixup.all()
    for i in range(b):
        r = float(p.mix_ratio[i])
        expected = (np.array((200, 90, 50)) * r + np.array((60, 20, 240)) * (1 - r)).astype(np.uint8)  # RGB
        assert (out["img"][i].int() - torch.tensor(expected)[:, None, None]).abs().max() <= 1
        boxes = out["bboxes"][out["batch_idx"] == i] * s
        xyxy = torch.cat((boxes[:, :2] - boxes[:, 2:] / 2, boxes[:, :2] + boxes[:, 2:] / 2), 1)
        torch.testing.assert_close(xyxy, torch.tensor([own_box, *partner_boxes]), atol=1e-4, rtol=0)
        assert out["cls"][out["batch_idx"] == i, 0].tolist() == [0, 1, 2, 3, 4]

    cutmix = GpuAugment(s, dict(still, cutmix=1.0))
    labels = raw.labels[(raw.labels[:, 0] < b) | (raw.labels[:, 0] >= 2 * b)].clone()
    labels[labels[:, 0] >= 2 * b, 0] -= b  # the other block of partners, right after the samples
    raw = replace(raw, groups=torch.cat((raw.groups[:b], raw.groups[2 * b :])), labels=labels)
    p = cutmix.draw(raw, generator(1))
    out = cutmix.apply(raw, p)
    pasted = 0
    for i in range(b):
        img = out["img"][i]
        partner = (img == torch.tensor((60, 20, 240), dtype=torch.uint8)[:, None, None]).all(0)
        own = (img == torch.tensor((200, 90, 50), dtype=torch.uint8)[:, None, None]).all(0)
        assert (partner | own).all()  # every pixel is one image's or the other's
        free = their_ioa(p.cut_areas[i].numpy(), np.array([own_box], np.float32)).sum(1) <= 0
        boxes = out["bboxes"][out["batch_idx"] == i] * s
        xyxy = torch.cat((boxes[:, :2] - boxes[:, 2:] / 2, boxes[:, :2] + boxes[:, 2:] / 2), 1)
        if not partner.any():  # skipped: no free area, or none that holds a tenth of a partner box
            assert len(xyxy) == 1
            assert not free.any() or (their_ioa(p.cut_areas[i, free].numpy(), np.array(partner_boxes, np.float32))
                                      < 0.1).all(1).any()
            continue
        ys, xs = torch.nonzero(partner, as_tuple=True)
        area = np.array([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], np.float32)
        assert partner.sum() == (area[2] - area[0]) * (area[3] - area[1])  # a rectangle
        assert any((area == candidate).all() for candidate in p.cut_areas[i, free].numpy())
        keep = np.nonzero(their_ioa(area[None], np.array(partner_boxes, np.float32))[0] >= 0.1)[0]
        theirs = Instances(np.array(partner_boxes, np.float32)[keep], bbox_format="xyxy", normalized=False)
        theirs.add_padding(-area[0], -area[1])
        theirs.clip(area[2] - area[0], area[3] - area[1])
        theirs.add_padding(area[0], area[1])
        torch.testing.assert_close(xyxy, torch.tensor(np.concatenate(([own_box], theirs.bboxes)), dtype=torch.float32), atol=1e-4, rtol=0)
        assert out["cls"][out["batch_idx"] == i, 0].tolist() == [0, *(1 + keep).tolist()]
        pasted += 1
    assert 10 < pasted < b, pasted  # both cases ran


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the Triton render")
@pytest.mark.parametrize("out_dtype", [None, torch.float16])
def test_on_cuda_a_mixed_batch_is_the_cpu_maths_batch(ul, data, out_dtype):
    """Both passes on CUDA (the batch, then the mixed samples' parts: warp.py's Triton kernels) against the torch
    twins that CPU runs use, on the same draws: the same boxes, the same images to two grey levels."""
    hyp_ns = hyp(ul, **dict(STRONG, translate=0.3), mixup=0.5, cutmix=0.7)
    raw, _, p, _, _ = mix_batch(ul, data, hyp_ns, seed=0)
    assert p.mixup.any() and p.cutmix.any()
    aug = GpuAugment(IMGSZ, hyp_ns, out_dtype=out_dtype)
    cpu = aug.apply(raw, p)
    on_cuda = {f.name: getattr(p, f.name) for f in fields(p)}
    cuda = aug.apply(raw.to("cuda"), replace(p, **{k: v.cuda() for k, v in on_cuda.items() if v is not None}))
    for key in ("batch_idx", "cls"):
        assert torch.equal(cuda[key].cpu(), cpu[key]), key
    torch.testing.assert_close(cuda["bboxes"].cpu(), cpu["bboxes"], atol=1e-4, rtol=0)
    scale = 255.0 if out_dtype is not None else 1.0  # a grey level in the output's range
    diff = (cuda["img"].cpu().float() - cpu["img"].float()).abs() * scale
    often = float((diff > 0.5).float().mean())  # uint8: differs at all; fp16: by more than its rounding
    # a grey level of the bilinear weights' rounding, which HSV's gains (up to 1.7) after the mix can make two
    assert diff.max() <= 2.0 + 1e-3 and often < 1e-3, (float(diff.max()), often)


@pytest.mark.slow
def test_a_run_trains_with_device_augmentation_on_the_cpu(tmp_path, cache_dir):
    """loader.augment_on=gpu end to end on CPU tensors: file bytes and labels from the workers (served by the
    node-shared cache of the files), decode, the image buffer, the one-pass render, MixUp and CutMix (epoch 0; epoch 1
    is close_mosaic's), batches prepared by the background threads, the target count taken where the labels are made.
    Its batches are drawn as train_batch<N>.jpg; Ultralytics' validation engine prints the fast one's tables."""
    import json

    import yaml

    from tests.conftest import TINY, ddp_launch, run_dir_of, validation_tables

    r = ddp_launch([*TINY, "train.plots=true", "train.epochs=2", "loader.augment_on=gpu", "train.cache=shared",
                    "+train.extra.mixup=0.5", "+train.extra.cutmix=0.5", "val.engine=ultralytics"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((run_dir_of(r) / "summary.json").read_text())
    assert summary["epochs_completed"] == 2
    losses = summary["ranks"][0]["loss"]
    assert losses and all(math.isfinite(v) and v > 0 for v in losses.values()), losses
    threads = summary["ranks"][0]["input_threads"]  # where the input's two threads spent their time
    assert set(threads) == {"decode", "prepare"}, threads
    assert all(t["batches"] > 0 and t["working_ms"] > 0 and 0 < t["busy"] <= 1 for t in threads.values()), threads
    log = (run_dir_of(r) / "logs" / "rank0.log").read_text()
    assert "the input's threads, ms per batch: decode thread (reads the loader's batches, decodes) waiting " in log
    steps = 64 // 8  # per epoch: the first three batches, and the first three once mosaic closes (epoch 1)
    for ni in (0, 1, 2, steps, steps + 1, steps + 2):
        assert (run_dir_of(r) / f"train_batch{ni}.jpg").stat().st_size > 0, ni
    names = list(yaml.safe_load((run_dir_of(r) / "data.yaml").read_text())["names"].values())
    assert validation_tables(r.stdout) == [["all"], ["all"], ["all", *names]], r.stdout[-3000:]

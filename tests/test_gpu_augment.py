"""GPU-side augmentation (rank/gpu_data/gpu_augment.py, rendered by warp.py) against Ultralytics 8.4.190's own pipeline.

All on CPU tensors, on a small generated dataset: the strongest check feeds Ultralytics' Mosaic, RandomPerspective,
RandomHSV, RandomFlip and Format the random draws GpuAugment made and compares images and boxes; the others compare
box_candidates, HSV, the collated batch format, the identity (LetterBox and Format), batch statistics against
Ultralytics' randomly seeded pipeline and the refusal of what it does not implement; one slow run trains with it
end to end. Boxes that frame their objects and the draws' distributions: tests/test_gpu_augment_boxes_and_draws.py;
MixUp and CutMix: tests/test_gpu_augment_mixes.py. This module holds the helpers and fixture makers they share.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from launcher.inputs import shapes
from launcher.rank.data.pipeline import MAX_TARGETS, TARGETS_PER_IMAGE
from launcher.rank.gpu_data.augment_boxes import box_candidates
from launcher.rank.gpu_data.gpu_augment import GpuAugment
from launcher.rank.gpu_data.warp import hsv_shift
from tests.raw_batches import RawTrainDataset

IMGSZ = 64
STRONG = dict(degrees=30.0, translate=0.2, scale=0.5, shear=10.0, fliplr=0.5, flipud=0.5)


def ultralytics_modules() -> tuple:
    """Ultralytics' get_cfg and augment module, imported when the first test needs them (each module's `ul`)."""
    from ultralytics.cfg import get_cfg
    from ultralytics.data import augment

    return get_cfg, augment


def textured_shapes(tmp_path_factory) -> dict:
    """48 textured 96 x 72 training images of the synthetic shapes, as a data dict (each module's `data`)."""
    spec = shapes.ShapesSpec(train_images=48, val_images=1, width=96, height=72, max_objects=5, texture=True)
    yaml_path = shapes.ensure_dataset(tmp_path_factory.mktemp("shapes"), spec, workers=1)
    root = yaml_path.parent
    return {"train": str(root / "images" / "train"), "names": dict(enumerate(shapes.CLASSES)), "nc": 3, "channels": 3}


@pytest.fixture(scope="module")
def ul():
    return ultralytics_modules()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    return textured_shapes(tmp_path_factory)


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


# --- the batch Ultralytics' collate_fn gives -------------------------------------------------------------------
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


# --- no augmentation: exactly LetterBox and Format ------------------------------------------------------------
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


# --- batch statistics: Ultralytics' own randomly seeded pipeline on the same keys ------------------------------
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


@pytest.mark.parametrize("key", ["copy_paste", "augmentations"])
def test_refuses_what_it_does_not_implement(key):
    with pytest.raises(ValueError, match=key):
        GpuAugment(IMGSZ, {key: 0.1})


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

"""A classification model's GPU input (loader.augment_on=gpu with a -cls model) applies Ultralytics' classify
transforms (torchvision's, on PIL images) to a whole batch on the device: each operation matches torchvision's own on
the same image and the same parameters (the colour ones exactly, the resampling ones to uint8 rounding), the random
draws follow torchvision's rules per image, a batch has Ultralytics' keys, shapes, types and range, and the plan takes
it when asked. Run on the CPU (the same tensor maths)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torchvision.transforms as T
import torchvision.transforms.functional as TF
from PIL import Image
from torchvision.transforms import InterpolationMode
from torchvision.transforms.autoaugment import _apply_op

from launcher.plan.describe import describe
from launcher.plan.plan import make_plan
from launcher.rank.gpu_data import classify_colour as colour
from launcher.rank.gpu_data import classify_geometry as geometry
from launcher.rank.gpu_data.classify_augment import ClassifyAugment
from launcher.rank.gpu_data.classify_params import RAND_OPS, SIGNED, ClassifyDraws, boxes, magnitude
from tests.test_classify import FEW_CORES
from tests.conftest import compose_config

BILINEAR = InterpolationMode.BILINEAR
HYP = dict(imgsz=32, scale=0.5, fliplr=0.5, flipud=0.0, auto_augment="randaugment", hsv_h=0.015, hsv_s=0.4,
           hsv_v=0.4, erasing=0.4)  # Ultralytics' classification defaults, at 32 px


def _image(h: int = 48, w: int = 40, seed: int = 0) -> np.ndarray:
    """Gradients in each channel with noise: every value range and edges, as a photograph has them."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    smooth = np.stack([(xx * 6) % 256, (yy * 5) % 256, ((xx + yy) * 3) % 256], -1)
    return np.clip(smooth + rng.integers(-20, 20, (h, w, 3)), 0, 255).astype(np.uint8)


def _t(image) -> torch.Tensor:
    """A PIL image or HWC array as a (1, 3, h, w) float batch of its uint8 values."""
    return torch.from_numpy(np.array(image)).permute(2, 0, 1)[None].float()


def _off(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(largest difference, fraction of values that differ)."""
    return (got - want).abs().max().item(), (got != want).float().mean().item()


# --- each operation against torchvision's, same image, same parameter ----------------------------------------------
@pytest.mark.parametrize("factor", [0.73, 1.27])
@pytest.mark.parametrize("ours, theirs", [(colour.brightness, TF.adjust_brightness),
                                          (colour.saturation, TF.adjust_saturation),
                                          (colour.contrast, TF.adjust_contrast),
                                          (colour.sharpness, TF.adjust_sharpness)])
def test_the_enhancements_equal_torchvisions_on_pil_exactly(ours, theirs, factor):
    image = _image()
    assert _off(ours(_t(image), torch.tensor([factor])), _t(theirs(Image.fromarray(image), factor))) == (0, 0)


def test_posterize_solarize_autocontrast_and_equalize_equal_torchvisions_exactly():
    image, pil = _image(), Image.fromarray(_image())
    assert _off(colour.posterize(_t(image), torch.tensor([7])), _t(TF.posterize(pil, 7))) == (0, 0)
    assert _off(colour.solarize(_t(image), torch.tensor([178.5])), _t(TF.solarize(pil, 178.5))) == (0, 0)
    assert _off(colour.autocontrast(_t(image)), _t(TF.autocontrast(pil))) == (0, 0)
    assert _off(colour.equalize(_t(image)), _t(TF.equalize(pil))) == (0, 0)
    flat = np.full((8, 8, 3), 77, np.uint8)  # one value: both leave it alone
    assert _off(colour.equalize(_t(flat)), _t(flat)) == _off(colour.autocontrast(_t(flat)), _t(flat)) == (0, 0)


@pytest.mark.parametrize("factor", [-0.3, 0.0, 0.015, 0.1])
def test_hue_follows_pils_hsv_round_trip_to_a_few_levels_on_a_few_pixels(factor):
    image = _image()
    most, share = _off(colour.hue(_t(image), torch.tensor([factor])), _t(TF.adjust_hue(Image.fromarray(image), factor)))
    assert most <= 3 and share < 0.005, (most, share)


@pytest.mark.parametrize("op, m", [("ShearX", 0.09), ("ShearX", -0.09), ("ShearY", 0.09), ("TranslateX", 14.5),
                                   ("TranslateY", -14.5), ("Rotate", 9.0), ("Rotate", -9.0)])
def test_randaugments_geometric_ops_equal_torchvisions_to_uint8_rounding(op, m):
    square = Image.fromarray(_image(40, 40))
    want = _t(_apply_op(square, op, m, interpolation=BILINEAR, fill=None))
    got = geometry.affine(_t(square), torch.tensor([geometry.rand_affine(op, m, 40)]))
    most, share = _off(got, want)
    assert most <= 1 and share < 0.005, (most, share)


@pytest.mark.parametrize("box", [(30, 50, 300, 200), (0, 0, 480, 400), (5, 5, 64, 64), (100, 20, 120, 90),
                                 (3, 7, 20, 30)])
def test_the_crop_and_resize_equal_torchvisions_pil_resize_to_uint8_rounding(box):
    image = _image(480, 400)
    want = _t(TF.resized_crop(Image.fromarray(image), *box, [64, 64], interpolation=BILINEAR, antialias=True))
    got = geometry.crop_resize([_t(image)[0].to(torch.uint8)], [list(box)], 64, torch.zeros(1, 3, 64, 64))
    most, share = _off(got, want)
    assert most <= 1 and share < 0.25, (most, share)  # Pillow's pass order and fixed-point weights against float


def test_randaugments_magnitudes_are_torchvisions_bin_9_of_31():
    space = T.RandAugment()._augmentation_space(31, (32, 32))
    for op in RAND_OPS:
        values, _ = space[op]
        assert magnitude(op, 32) == pytest.approx(float(values[9]) if values.ndim else 0.0), op


# --- the draws -----------------------------------------------------------------------------------------------------
def test_the_crop_box_follows_torchvisions_rule_in_distribution_and_fallback():
    g, n = torch.Generator().manual_seed(0), 4000
    for h, w, scale in ((60, 40, (0.08, 1.0)), (30, 90, (0.5, 1.0)), (20, 100, (0.9, 1.0))):
        ours, _ = boxes(torch.tensor([[h, w]] * n), scale, (3 / 4, 4 / 3), g)
        torch.manual_seed(1)
        crop = T.RandomResizedCrop(8, scale=scale)
        theirs = torch.tensor([crop.get_params(torch.zeros(1, h, w), list(scale), [3 / 4, 4 / 3]) for _ in range(n)])
        for boxes_ in (ours, theirs):
            assert ((boxes_[:, 0] + boxes_[:, 2] <= h) & (boxes_[:, 1] + boxes_[:, 3] <= w)).all()
        area = [float((b[:, 2] * b[:, 3]).double().mean()) / (h * w) for b in (ours, theirs)]
        aspect = [float((b[:, 3] / b[:, 2]).log().mean()) for b in (ours, theirs)]
        left = [float((b[:, 1].double() / (w - b[:, 3] + 1).clamp(min=1)).mean()) for b in (ours, theirs)]
        assert area[0] == pytest.approx(area[1], abs=0.02) and aspect[0] == pytest.approx(aspect[1], abs=0.03)
        assert left[0] == pytest.approx(left[1], abs=0.03)  # uniform positions
        central = [float((b == torch.tensor(_central(h, w))).all(1).double().mean()) for b in (ours, theirs)]
        assert central[0] == pytest.approx(central[1], abs=0.03), (h, w, central)  # the fallback as often


def _central(h: int, w: int) -> tuple[int, int, int, int]:
    ratio = w / h
    ch, cw = (round(w / (3 / 4)), w) if ratio < 3 / 4 else ((h, round(h * 4 / 3)) if ratio > 4 / 3 else (h, w))
    return (h - ch) // 2, (w - cw) // 2, ch, cw


def test_the_erased_area_follows_torchvisions_rule():
    g, n = torch.Generator().manual_seed(0), 4000
    ours, found = boxes(torch.tensor([[32, 32]] * n), (0.02, 0.33), (0.3, 3.3), g, erasing=True)
    torch.manual_seed(1)
    theirs = torch.tensor([T.RandomErasing.get_params(torch.zeros(3, 32, 32), (0.02, 0.33), (0.3, 3.3), [0])[:4]
                           for _ in range(n)])
    theirs_found = theirs[:, 2] < 32
    assert float(found.double().mean()) == pytest.approx(float(theirs_found.double().mean()), abs=0.02)
    ours, theirs = ours[found], theirs[theirs_found]
    assert ((ours[:, 0] + ours[:, 2] <= 32) & (ours[:, 1] + ours[:, 3] <= 32)).all()
    for i in range(4):
        assert float(ours[:, i].double().mean()) == pytest.approx(float(theirs[:, i].double().mean()), rel=0.05), i


# --- the whole batch -----------------------------------------------------------------------------------------------
def _forced(b: int, s: int, ops: list[tuple[int, int]], signs: list[tuple[float, float]]) -> ClassifyDraws:
    return ClassifyDraws(crops=torch.tensor([[0, 0, s, s]] * b), hflip=torch.zeros(b, dtype=torch.bool),
                         vflip=torch.zeros(b, dtype=torch.bool), ops=torch.tensor(ops), signs=torch.tensor(signs),
                         jitter=None, order=None, erase=torch.zeros((b, 4), dtype=torch.int64))


def test_each_image_takes_its_own_randaugment_ops_as_torchvision_applies_them():
    """Identical images, each with its own pair of ops: each comes out as torchvision's RandAugment makes it with
    those ops; a batch sharing one choice would fail here."""
    s, image = 32, _image(32, 32)
    pairs = [(a, (a * 5 + 3) % len(RAND_OPS)) for a in range(len(RAND_OPS))]
    signs = [(1.0 if k % 2 else -1.0, -1.0 if k % 3 else 1.0) for k in range(len(pairs))]
    augment = ClassifyAugment(s, SimpleNamespace(**HYP))
    images = [_t(image)[0].to(torch.uint8)] * len(pairs)
    out = augment(images, _forced(len(pairs), s, pairs, signs), torch.device("cpu"))
    assert out.shape == (len(pairs), 3, s, s) and out.dtype == torch.float32
    for k, (ops, sign) in enumerate(zip(pairs, signs)):
        want = Image.fromarray(image)
        for op, sg in zip(ops, sign):
            m = magnitude(RAND_OPS[op], s)
            want = _apply_op(want, RAND_OPS[op], m * sg if RAND_OPS[op] in SIGNED else m, BILINEAR, None)
        most, share = _off((out[k : k + 1] * 255).round(), _t(want))
        assert most <= 3 and share < 0.01, (k, [RAND_OPS[o] for o in ops], most, share)
    assert len({tuple(o.flatten().tolist()[:64]) for o in out}) > len(pairs) // 2  # not one choice for the batch


def test_the_whole_chain_is_torchvisions_crop_flips_ops_and_erasing_in_ultralytics_order():
    image, s = _image(60, 50), 32
    augment = ClassifyAugment(s, SimpleNamespace(**{**HYP, "flipud": 0.5}))
    d = _forced(2, s, [(RAND_OPS.index("Rotate"), RAND_OPS.index("Contrast"))] * 2, [(-1.0, 1.0)] * 2)
    d.crops = torch.tensor([[5, 3, 40, 36], [0, 10, 60, 30]])
    d.hflip, d.vflip = torch.tensor([True, False]), torch.tensor([True, True])
    d.erase = torch.tensor([[2, 4, 10, 6], [0, 0, 0, 0]])
    out = augment([_t(image)[0].to(torch.uint8)] * 2, d, torch.device("cpu"))
    for k in range(2):
        want = TF.resized_crop(Image.fromarray(image), *d.crops[k].tolist(), [s, s], interpolation=BILINEAR,
                               antialias=True)
        want = TF.vflip(TF.hflip(want) if d.hflip[k] else want)
        want = _apply_op(_apply_op(want, "Rotate", -magnitude("Rotate", s), BILINEAR, None), "Contrast",
                         magnitude("Contrast", s), BILINEAR, None)
        want = TF.erase(TF.to_tensor(want), *d.erase[k].tolist(), torch.tensor(0.0)) if d.erase[k, 2] else \
            TF.to_tensor(want)
        most, share = _off((out[k] * 255).round(), (want * 255).round())
        assert most <= 2 and share < 0.25, (k, most, share)  # the resize's level, through the rotation and contrast


def test_the_draws_are_per_image_and_a_function_of_the_seed():
    augment = ClassifyAugment(32, SimpleNamespace(**HYP))
    sizes = torch.tensor([[48, 40]] * 64)
    a, b = (augment.draws(sizes, torch.Generator().manual_seed(7)) for _ in range(2))
    c = augment.draws(sizes, torch.Generator().manual_seed(8))
    assert all(torch.equal(getattr(a, k), getattr(b, k)) for k in ("crops", "ops", "signs", "erase", "hflip"))
    assert not torch.equal(a.crops, c.crops)
    assert len(set(map(tuple, a.ops.tolist()))) > 16 and len(set(map(tuple, a.crops.tolist()))) > 32
    assert 0.3 < a.hflip.double().mean() < 0.7 and not a.vflip.any()  # fliplr 0.5, flipud 0
    assert 0.2 < (a.erase[:, 2] > 0).double().mean() < 0.6  # erasing 0.4


def test_colour_jitter_takes_each_images_factors_in_its_own_order_when_auto_augment_is_off():
    s, image = 32, _image(32, 32)
    augment = ClassifyAugment(s, SimpleNamespace(**{**HYP, "auto_augment": None}))
    d = augment.draws(torch.tensor([[s, s]] * 6), torch.Generator().manual_seed(3))
    assert d.ops is None and d.jitter is not None and len({tuple(o) for o in d.order.tolist()}) > 1
    d.crops[:] = torch.tensor([0, 0, s, s])
    d.hflip[:], d.erase[:] = False, 0
    out = augment([_t(image)[0].to(torch.uint8)] * 6, d, torch.device("cpu"))
    adjust = (TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation, TF.adjust_hue)
    for k in range(6):
        want = Image.fromarray(image)
        for fn in d.order[k].tolist():
            want = adjust[fn](want, float(d.jitter[k, fn]))
        most, share = _off((out[k : k + 1] * 255).round(), _t(want))
        assert most <= 6 and share < 0.01, (k, most, share)  # the hue's few levels, scaled by the contrast after it
    still = ClassifyAugment(s, SimpleNamespace(**{**HYP, "auto_augment": None, "hsv_h": 0.0, "hsv_s": 0.0,
                                                  "hsv_v": 0.0}))
    d.jitter, d.ops = still.draws(torch.tensor([[s, s]] * 6), torch.Generator().manual_seed(3)).jitter, None
    assert torch.equal(still([_t(image)[0].to(torch.uint8)] * 6, d, torch.device("cpu")) * 255,
                       _t(image).expand(6, -1, -1, -1))  # strengths of 0: no adjustment (not even hue's round trip)


def test_a_batch_from_the_gpu_input_has_ultralytics_keys_shapes_types_and_range(tmp_path):
    import cv2

    from launcher.rank.data.encoded import EncodedTrainDataset
    from launcher.rank.gpu_data.classify_input import ClassifyInput, class_folder_images
    from launcher.rank.gpu_data.gpu_input import Decoder

    samples = []
    for k, (h, w) in enumerate(((40, 60), (64, 32), (25, 25), (90, 70))):
        path = tmp_path / f"{k}.jpg"
        cv2.imwrite(str(path), _image(h, w, seed=k))
        samples.append((str(path), k % 2))
    images = class_folder_images(samples)
    dataset = EncodedTrainDataset(images, decode_all=True)
    device = torch.device("cpu")
    gpu_input = ClassifyInput(ClassifyAugment(32, SimpleNamespace(**HYP), out_dtype=torch.bfloat16),
                              Decoder(device, images.files), device=device)
    batch = gpu_input(dataset.collate_fn([dataset[(0, i)] for i in range(4)]), torch.Generator().manual_seed(5))
    assert set(batch) == {"img", "cls", "im_file"} and batch["im_file"] == images.files
    assert batch["img"].shape == (4, 3, 32, 32) and batch["img"].dtype == torch.bfloat16
    assert batch["img"].is_contiguous(memory_format=torch.channels_last)
    assert 0 <= batch["img"].min() and batch["img"].max() <= 1 and batch["img"].float().std() > 0.05
    assert batch["cls"].dtype == torch.int64 and batch["cls"].tolist() == [0, 1, 0, 1]
    again = gpu_input(dataset.collate_fn([dataset[(0, i)] for i in range(4)]), torch.Generator().manual_seed(5))
    assert torch.equal(again["img"], batch["img"])  # the seed decides the batch


# --- the plan ------------------------------------------------------------------------------------------------------
def test_the_plan_takes_the_gpu_input_for_a_classifier_when_asked_and_auto_keeps_ultralytics():
    plan, problems = make_plan(compose_config(["loader.augment_on=gpu"]), FEW_CORES, task="classify")
    assert not problems and plan.augment_on == "gpu"
    text = describe(plan, None, None, cfg=compose_config(["loader.augment_on=gpu"]))
    assert "task            classify; the GPU input pipeline (class folders decoded and augmented" in text
    assert plan.device != "cuda" or "the device applies the classify transforms" in text  # not detection's one pass
    plan, problems = make_plan(compose_config(["train.imgsz=640"]), FEW_CORES, task="classify")
    assert not problems and plan.augment_on == "cpu"  # auto: Ultralytics' pipeline until measured on GPUs
    for policy in ("augmix", "autoaugment"):
        _, problems = make_plan(compose_config(["loader.augment_on=gpu", f"+train.extra.auto_augment={policy}"]),
                                FEW_CORES, task="classify")
        assert len(problems) == 1 and f"train.extra.auto_augment={policy} with loader.augment_on=gpu" in \
            problems[0].message and "use loader.augment_on=cpu" in problems[0].message
    _, problems = make_plan(compose_config(["loader.augment_on=cpu", "+train.extra.auto_augment=augmix"]),
                            FEW_CORES, task="classify")
    assert not problems
    _, problems = make_plan(compose_config(["loader.augment_on=gpu", "train.cache=shared"]), FEW_CORES, task="classify")
    assert len(problems) == 1 and "use train.cache=false (or ram or disk with loader.augment_on=cpu" in \
        problems[0].message  # not the cache the GPU input refuses


def test_an_input_bound_classifier_on_the_gpu_input_is_told_a_setting_it_has():
    """A classifier has no node-shared cache (train.cache=shared is refused for it): the input-bound line names the
    loader's workers only, where a detector's names the shared cache too."""
    from launcher.plan.describe import input_bound_advice
    from launcher.plan.task_rules import rules

    assert input_bound_advice(True, 4, shared_cache=rules("classify").shared_cache) == "raise loader.workers (now 4)"
    assert "set train.cache=shared" in input_bound_advice(True, 4, shared_cache=rules("detect").shared_cache)

"""MixUp and CutMix in GpuAugment (rank/gpu_data/gpu_augment.py, rendered by warp.py) against Ultralytics 8.4.190's:
the mix choices' distributions, each mixed sample against Ultralytics' MixUp, CutMix, RandomHSV, flips and Format on
the same draws, a flipped mixed sample, solid images whose blend and pasted area are known, a batch without the
partners its mixes need, and on CUDA the Triton render against the CPU maths. The single-image pipeline against
Ultralytics: tests/test_gpu_augment.py; boxes and draws on their own: tests/test_gpu_augment_boxes_and_draws.py."""

from __future__ import annotations

import copy
import math
from dataclasses import fields, replace

import numpy as np
import pytest
import torch

from launcher.rank.data.raw_batch import RawBatch
from launcher.rank.gpu_data.gpu_augment import GpuAugment
from tests.test_gpu_augment import IMGSZ, STRONG, Scripted, data, generator, hyp, raw_dataset, ul  # and fixtures
from tests.test_gpu_augment_boxes_and_draws import assert_rate, empty_raw


def with_partners(raw: RawBatch, samples: int) -> RawBatch:
    """`raw`'s first `samples` rows as the output samples, the rows after them as their mix partners."""
    return replace(raw, im_file=raw.im_file[:samples], ori_shape=raw.ori_shape[:samples],
                   ratio_pad=raw.ratio_pad[:samples])


def test_a_mosaic_batch_without_the_partners_its_mixes_need_is_refused():
    """GpuInput brings a block of partners per mix that is on; a batch without them cannot be mixed."""
    with pytest.raises(ValueError, match="it needs 24 .*GpuInput draws them"):
        GpuAugment(IMGSZ, {"mixup": 0.5, "cutmix": 0.5}).draw(empty_raw(8), generator(0))


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
    if hsv:  # float HSV against Ultralytics' uint8 lookup tables, as in tests/test_gpu_augment.py
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

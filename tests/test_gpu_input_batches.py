"""The GPU input pipeline's device half (rank/gpu_data/gpu_input.py, gpu_augment.py) on the CPU, end to end on known
images: each box frames its object through decode, load, mosaic, warp and flips; mosaic partners come from the
recently decoded images or from the batch, mix partners with their own until close_mosaic; the batch tables go up
in one copy each. Decoding: tests/test_gpu_input.py; the plan's choice of input: tests/test_gpu_input_plan.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from launcher.rank.data.encoded import EncodedImages, EncodedTrainDataset
from launcher.rank.data.pipeline import MAX_TARGETS
from launcher.rank.gpu_data.gpu_augment import GpuAugment
from launcher.rank.gpu_data.gpu_input import Decoder, GpuInput, buffer_capacity, upload


def rectangles(folder: Path, n: int, size=(64, 48)):
    """n PNG files of 2 solid rectangles on dark grey; class = the rectangle's colour index (no two alike)."""
    from tests.test_gpu_augment_boxes_and_draws import separate_boxes

    rng = np.random.default_rng(3)
    palette = [c for c in np.ndindex(4, 4, 4) if len(set(c)) > 1]
    rng.shuffle(palette)
    colours, files, cls, xywh, starts = [], [], [], [], [0]
    w, h = size
    for i in range(n):
        im = np.full((h, w, 3), 30, np.uint8)
        for box in separate_boxes(rng, w, h, 2, (12, 22)):
            colour = tuple(int(85 * c) for c in palette[len(colours)])
            im[box[1] : box[3], box[0] : box[2]] = colour
            cls.append(len(colours))
            colours.append(colour)
            xywh.append(((box[0] + box[2]) / 2 / w, (box[1] + box[3]) / 2 / h, (box[2] - box[0]) / w, (box[3] - box[1]) / h))
        files.append(str(folder / f"r{i}.png"))
        Image.fromarray(im).save(files[-1])
        starts.append(len(cls))
    images = EncodedImages(files, np.array(cls, np.float32), np.array(xywh, np.float32), np.array(starts, np.int64))
    return images, colours


def test_every_box_frames_its_object_through_decode_load_mosaic_warp_and_flips(tmp_path):
    """Known images through the whole device half: each output box is where its rectangle's colour is."""
    from tests.test_gpu_augment_boxes_and_draws import visible_box

    s = 64
    images, colours = rectangles(tmp_path, 16)
    ds = EncodedTrainDataset(images, decode_all=True)
    hyp = dict(mosaic=1.0, degrees=20.0, translate=0.1, scale=0.3, shear=5.0, fliplr=0.5, flipud=0.5,
               hsv_h=0.0, hsv_s=0.0, hsv_v=0.0)
    gi = GpuInput(GpuAugment(s, hyp), Decoder(torch.device("cpu"), images.files), capacity=16, device=torch.device("cpu"))
    checked = 0
    for k in range(2):
        batch = gi(ds.collate_fn([ds[(0, i)] for i in range(8 * k, 8 * k + 8)]), torch.Generator().manual_seed(k))
        # the sync-free loss pads every image's targets to this: it must be the batch's true largest count
        assert batch[MAX_TARGETS] == int(torch.bincount(batch["batch_idx"].long(), minlength=8).max()) > 2
        for j in range(len(batch["cls"])):
            b, c = int(batch["batch_idx"][j]), int(batch["cls"][j])
            twins = ((batch["batch_idx"] == b) & (batch["cls"][:, 0] == c)).sum()
            if twins > 1:  # a partner drawn twice (or the sample itself): the colour shows in two places
                continue
            x, y, w, h = (batch["bboxes"][j] * s).tolist()
            seen = visible_box(batch["img"][b], colours[c])
            if seen is None or w < 6 or h < 6:  # hidden under the border or too small to see whole
                continue
            box, _ = seen
            mine = torch.tensor([x - w / 2, y - h / 2, x + w / 2, y + h / 2])
            inter = (torch.minimum(box[2:], mine[2:]) - torch.maximum(box[:2], mine[:2])).clamp(min=0).prod()
            union = (box[2:] - box[:2]).prod() + (mine[2:] - mine[:2]).prod() - inter
            assert inter / union > 0.6, (b, c, box.tolist(), mine.tolist())
            checked += 1
    assert checked >= 20


def test_mosaic_partners_come_from_the_recently_decoded_images_or_from_the_batch(tmp_path):
    images, _ = rectangles(tmp_path, 24)
    ds = EncodedTrainDataset(images, decode_all=True)
    groups = []

    class Spy(GpuAugment):
        def __call__(self, raw, generator):
            groups.append(raw.groups.clone())
            return super().__call__(raw, generator)

    for from_batch in (False, True):
        groups.clear()
        gi = GpuInput(Spy(32, {}), Decoder(torch.device("cpu"), images.files), capacity=12,
                      device=torch.device("cpu"), partners_from_batch=from_batch, close_at=1)
        for k in range(3):
            gi(ds.collate_fn([ds[(0, i)] for i in range(8 * k, 8 * k + 8)]), torch.Generator().manual_seed(k))
        own = [set(g[:, 0].tolist()) for g in groups]
        assert groups[0][:, 0].tolist() == list(range(8)) and groups[1][:, 0].tolist() == [8, 9, 10, 11, 0, 1, 2, 3]
        for g, mine, filled in zip(groups, own, (8, 12, 12)):
            partners = set(g[:, 1:].flatten().tolist())
            assert partners <= (mine if from_batch else set(range(filled)))
        if not from_batch:
            assert not set(groups[1][:, 1:].flatten().tolist()) <= own[1]  # older images are drawn too
    gi(ds.collate_fn([ds[(1, i)] for i in range(8)]), torch.Generator().manual_seed(0))
    assert groups[-1].shape == (8, 1)  # a batch of epoch close_at: mosaic closed, whenever it was prepared
    gi(ds.collate_fn([ds[(0, i)] for i in range(8)]), torch.Generator().manual_seed(0))
    assert groups[-1].shape == (8, 4)  # prepared after it, but of the epoch before: mosaic still on
    assert buffer_capacity(4096, 64) == 512 and buffer_capacity(100, 64) == 100 and buffer_capacity(10_000, 256) == 1000


def test_mix_partners_come_with_their_own_mosaic_partners_until_close_mosaic(tmp_path):
    """With mixup and cutmix on, each sample brings a MixUp and a CutMix partner (rows 8..15, 16..23), each another
    image with 3 mosaic partners, from the buffer or the batch; from epoch close_at on, none (Ultralytics' close_mosaic
    sets mixup and cutmix to 0 with mosaic). The batch stays Ultralytics' format, its boxes inside the image."""
    images, _ = rectangles(tmp_path, 24)
    ds = EncodedTrainDataset(images, decode_all=True)
    groups, mixed = [], []

    class Spy(GpuAugment):
        def apply(self, raw, p):
            groups.append(raw.groups.clone())
            mixed.append(None if p.mixup is None else int((p.mixup | p.cutmix).sum()))
            return super().apply(raw, p)

    for from_batch in (False, True):
        groups.clear()
        gi = GpuInput(Spy(32, {"mixup": 0.5, "cutmix": 0.5}), Decoder(torch.device("cpu"), images.files), capacity=12,
                      device=torch.device("cpu"), partners_from_batch=from_batch, close_at=1)
        for k in range(2):
            batch = gi(ds.collate_fn([ds[(0, i)] for i in range(8 * k, 8 * k + 8)]), torch.Generator().manual_seed(k))
            assert batch["img"].shape == (8, 3, 32, 32) and set(batch["batch_idx"].long().tolist()) <= set(range(8))
            xy, wh = batch["bboxes"][:, :2], batch["bboxes"][:, 2:]
            assert (wh > 0).all() and (xy - wh / 2 >= -1e-6).all() and (xy + wh / 2 <= 1 + 1e-6).all()
        assert [g.shape for g in groups] == [(24, 4)] * 2 and mixed[-1] > 0
        own = set(groups[1][:8, 0].tolist())
        partners = set(groups[1][8:].flatten().tolist())
        assert partners <= own if from_batch else not partners <= own  # from the buffer: older images too
    batch = gi(ds.collate_fn([ds[(1, i)] for i in range(8)]), torch.Generator().manual_seed(0))
    assert groups[-1].shape == (8, 1) and mixed[-1] is None  # epoch close_at: no mosaic, no mix
    assert batch["img"].shape == (8, 3, 32, 32)


# --- the batch tables' upload -----------------------------------------------------------------------------------------
def test_the_batch_tables_go_up_in_one_copy_each_where_it_was():
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    for device in devices:
        arrays = [np.arange(3, dtype=np.int64), np.zeros((0, 6), np.int64), np.full((2, 3, 5), 1.5, np.float32),
                  np.array([[7, 8]], np.int64), np.arange(3, dtype=np.float32)]  # 12 bytes: the next is realigned
        moved = upload(arrays, device)
        for a, t in zip(arrays, moved):
            assert t.device.type == device.type and t.shape == a.shape
            assert np.array_equal(t.cpu().numpy(), a)

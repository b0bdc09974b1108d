"""The GPU input pipeline (rank/data/encoded.py, gpu_input.py, warp.py) on the CPU: the Triton kernels against their
PyTorch twins (Triton's interpreter), file bytes and the decodes the workers keep, damaged files, boxes that frame
their objects through decode, load, mosaic, warp and flips, the mosaic partners' buffer, the file cache, the plan.

The same kernels on CUDA, and nvJPEG against the CPU decoder: tests/test_cuda_input.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from launcher.rank.data import image_cache, warp
from launcher.rank.data.encoded import EncodedImages, EncodedTrainDataset, decode_on_cpu, exif_orientation
from launcher.rank.data.gpu_augment import GpuAugment
from launcher.rank.data.gpu_input import Decoder, GpuInput, buffer_capacity, resized_shape, upload
from launcher.rank.data.pipeline import MAX_TARGETS

ROOT = Path(__file__).resolve().parents[1]


# --- shared cases (also used by tests/test_cuda_input.py on CUDA) -----------------------------------------------------
def render_case(device: torch.device, s: int = 48, b: int = 4, cap: int = 8):
    """warp.render's arguments for a mosaic batch with rotation, scale and perspective: every output variant."""
    g = torch.Generator().manual_seed(0)
    slots = torch.randint(0, 256, (cap, s, s, 3), generator=g, dtype=torch.uint8)
    xc, yc = torch.randint(s // 2, 3 * s // 2, (b,), generator=g), torch.randint(s // 2, 3 * s // 2, (b,), generator=g)
    img = torch.randint(0, cap, (b, 4), generator=g)
    h, w = torch.randint(10, s + 1, (b, 4), generator=g), torch.randint(10, s + 1, (b, 4), generator=g)
    quadrant = torch.arange(4)
    pad_x, pad_y = xc[:, None] - w * (1 - quadrant % 2), yc[:, None] - h * (1 - quadrant // 2)
    tiles = torch.stack([pad_x.clamp(min=0), (pad_x + w).clamp(max=2 * s), pad_y.clamp(min=0),
                         (pad_y + h).clamp(max=2 * s), img * s * s - pad_y * s - pad_x], 1).int()
    angle, scale = torch.rand(b, generator=g), 0.6 + torch.rand(b, generator=g)
    m = torch.zeros(b, 3, 3)
    m[:, 0, 0], m[:, 0, 1] = scale * torch.cos(angle), scale * torch.sin(angle)
    m[:, 1, 0], m[:, 1, 1] = -scale * torch.sin(angle), scale * torch.cos(angle)
    m[:, :2, 2], m[:, 2, 2] = (s * 0.5 - s * scale)[:, None], 1
    m[:, 2, :2] = 2e-4 * (torch.rand(b, 2, generator=g) - 0.5)  # perspective
    gains = (torch.rand(b, 3, generator=g) * 2 - 1) * torch.tensor([0.015, 0.7, 0.4])
    common = dict(slots=slots, tiles=tiles, centre=torch.stack([xc, yc], 1).int(), inverse=torch.linalg.inv(m),
                  swap=torch.tensor([False, True, False, False]))
    common = {k: v.to(device) for k, v in common.items()}
    for dtype, scale_out in ((torch.float16, 1 / 255), (torch.float32, 1 / 255), (torch.uint8, 1.0)):
        for hsv in (None, gains.to(device)):
            for bgr in (False, True):
                out = torch.empty((b, 3, s, s), dtype=dtype, device=device)
                if dtype == torch.float16:
                    out = out.to(memory_format=torch.channels_last)
                yield dict(common, gains=hsv, out=out, scale=scale_out, bgr_slots=bgr)


def load_case(device: torch.device, s: int = 48):
    """load_into_slots' arguments: a downscaled, an unchanged and an upscaled image."""
    g = torch.Generator().manual_seed(1)
    images = [torch.randint(0, 256, shape, generator=g, dtype=torch.uint8) for shape in ((3, 60, 90), (3, s, 20), (3, 17, 30))]
    rows, offset = [], 0
    for slot, im in enumerate(images):
        h, w = resized_shape(im.shape[1], im.shape[2], s)
        rows.append((offset, im.shape[1], im.shape[2], slot, h, w))
        offset += im.numel()
    flat = torch.cat([im.reshape(-1) for im in images])
    slots = torch.zeros((4, s, s, 3), dtype=torch.uint8)
    return flat.to(device), torch.tensor(rows).to(device), slots.to(device)


def write_images(folder: Path, kinds: list[str], size=(80, 60)) -> list[str]:
    """Image files of the given kinds: jpg, png, grey (a one-channel JPEG), rotated (EXIF orientation 6) and
    corrupt (JPEG markers around random bytes: passes a glance, decodes nowhere)."""
    rng = np.random.default_rng(0)
    files = []
    v, u = np.mgrid[0 : size[1], 0 : size[0]]
    for i, kind in enumerate(kinds):  # smooth, like a photo: JPEG decoders differ most on per-pixel noise
        pixels = np.stack([(u * 3 + 40 * i) % 256, (v * 4) % 256, (u + v + 90) % 256], -1).astype(np.uint8)
        path = folder / f"im{i}.{'png' if kind == 'png' else 'jpg'}"
        if kind == "corrupt":
            path.write_bytes(b"\xff\xd8\xff\xe0" + rng.integers(0, 256, 4000, dtype=np.uint8).tobytes() + b"\xff\xd9")
        elif kind == "grey":
            Image.fromarray(pixels[..., 0]).save(path, quality=95)
        elif kind == "rotated":
            exif = Image.Exif()
            exif[0x0112] = 6
            Image.fromarray(pixels).save(path, quality=95, exif=exif)
        else:
            Image.fromarray(pixels).save(path, quality=95)
        files.append(str(path))
    return files


def images_of(files: list[str], boxes_per_image: int = 2) -> EncodedImages:
    n = len(files)
    xywh = np.tile(np.array([[0.5, 0.5, 0.2, 0.3]], np.float32), (n * boxes_per_image, 1))
    return EncodedImages(files, np.zeros(n * boxes_per_image, np.float32), xywh,
                         np.arange(0, n * boxes_per_image + 1, boxes_per_image, dtype=np.int64))


def encoded_batch_of(files: list[str], decode_all: bool):
    ds = EncodedTrainDataset(images_of(files), decode_all=decode_all)
    return ds.collate_fn([ds[(0, i)] for i in range(len(files))])


# --- the kernels ------------------------------------------------------------------------------------------------------
def compare_in_interpreter() -> None:
    """Run in a process started with TRITON_INTERPRET=1: the Triton kernels, on CPU tensors, against the twins."""
    assert warp.triton_usable(torch.device("cpu")), "Triton's interpreter is not active"
    cases = 0
    for kw in render_case(torch.device("cpu")):
        ours, twin = kw["out"], kw["out"].clone()
        warp.render(**kw)
        warp._render_torch(**{**kw, "out": twin})
        diff = (ours.float() - twin.float()).abs()
        assert diff.max() <= (1e-3 if ours.dtype == torch.float16 else 1e-5), (kw["out"].dtype, float(diff.max()))
        cases += 1
    flat, meta, slots = load_case(torch.device("cpu"))
    twin = slots.clone()
    warp.load_into_slots(flat, meta, slots)
    warp._load_torch(flat, meta, twin)
    assert (slots.int() - twin.int()).abs().max() <= 1  # F.interpolate and the kernel sum in another order
    print(f"{cases} render variants and a load agree")


def test_the_triton_kernels_compute_what_their_torch_twins_compute():
    """Every output variant (fp16 channels_last, fp32, uint8; HSV or not; RGB or BGR slots) and the load, on the
    same inputs, through Triton's interpreter: the kernels CUDA runs, checked where there is no GPU."""
    code = "from tests.test_gpu_input import compare_in_interpreter; compare_in_interpreter()"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "12 render variants and a load agree" in r.stdout


def test_the_load_is_ultralytics_resize():
    """Slots hold what BaseDataset.load_image gives: long side to imgsz with cv2.INTER_LINEAR (up to the rounding of
    its fixed-point weights)."""
    import cv2

    flat, meta, slots = load_case(torch.device("cpu"))
    warp.load_into_slots(flat, meta, slots)
    for offset, h0, w0, slot, h, w in meta.tolist():
        image = flat[offset : offset + 3 * h0 * w0].view(3, h0, w0).permute(1, 2, 0).numpy()
        theirs = cv2.resize(image, (w, h), interpolation=cv2.INTER_LINEAR) if (h, w) != (h0, w0) else image
        assert np.abs(slots[slot, :h, :w].numpy().astype(int) - theirs.astype(int)).max() <= 1
    assert resized_shape(480, 640, 640) == (480, 640) and resized_shape(375, 500, 640) == (480, 640)


# --- the workers' half ------------------------------------------------------------------------------------------------
def test_workers_send_jpeg_bytes_and_decode_only_what_nvjpeg_cannot(tmp_path):
    files = write_images(tmp_path, ["jpg", "png", "rotated", "grey", "corrupt"])
    ds = EncodedTrainDataset(images_of(files))
    samples = [ds[(0, i)] for i in range(len(files))]
    jpg, png, rotated, grey, corrupt = samples
    assert jpg.payload.dim() == 1 and bytes(jpg.payload[:3].numpy()) == b"\xff\xd8\xff"  # bytes, for nvJPEG
    assert grey.payload.dim() == 1  # nvJPEG makes RGB of it
    assert png.payload.shape == (3, 60, 80)  # not a JPEG: decoded here
    assert exif_orientation(Path(files[2]).read_bytes()) == 6 and exif_orientation(Path(files[0]).read_bytes()) == 1
    assert rotated.payload.shape == (3, 80, 60)  # EXIF applied, as OpenCV (and so Ultralytics) reads it
    assert corrupt.payload.dim() == 1  # a JPEG by its first bytes: nvJPEG tries first (the Decoder's test)
    batch = ds.collate_fn(samples)
    assert batch.counts.tolist() == [2] * 5 and batch.xywh.shape == (10, 4)
    cpu = EncodedTrainDataset(images_of(files), decode_all=True)[(0, 0)]  # a CPU rank: the worker decodes all
    assert cpu.payload.shape == (3, 60, 80)
    damaged = EncodedTrainDataset(images_of(files), decode_all=True)[(0, 4)]
    assert damaged.payload.numel() == 0 and "Pillow" in damaged.error  # every decoder tried, and why each failed
    assert torch.equal(cpu.payload, decode_on_cpu(Path(files[0]).read_bytes())[0])


def test_a_batch_crosses_from_its_worker_as_one_tensor(tmp_path):
    """A worker hands the training process one shared-memory tensor per batch (each costs the training process a file
    descriptor received and mapped under its interpreter lock), not one per image; what arrives is what was read."""
    files = write_images(tmp_path, ["jpg", "png", "rotated", "grey", "corrupt", "jpg"])
    ds = EncodedTrainDataset(images_of(files, boxes_per_image=3))
    here = ds.collate_fn([ds[(2, i)] for i in range(len(files))])
    assert sum(isinstance(v, torch.Tensor) for v in here.__getstate__().values()) == 1  # the packed payloads

    loader = torch.utils.data.DataLoader(ds, batch_sampler=[[(2, i) for i in range(len(files))]], num_workers=1,
                                         collate_fn=ds.collate_fn)
    (there,) = list(loader)
    assert len({p.untyped_storage().data_ptr() for p in there.payloads}) == 1
    assert there.payloads is there.payloads  # the views made once: the decoder reads them image by image
    assert [p.shape for p in there.payloads] == [p.shape for p in here.payloads]
    assert all(torch.equal(a, b) for a, b in zip(there.payloads, here.payloads))
    assert there.payloads[1].shape == (3, 60, 80) and there.payloads[4].numel() > 0  # decoded here; bytes to try
    for k in ("cls", "xywh", "counts"):
        assert torch.equal(getattr(there, k), getattr(here, k))
    assert (there.epoch, there.indices, there.errors) == (2, list(range(6)), [""] * 6)


def registered_without_torchvision(folder: str) -> None:
    """Run in a fresh process: torchvision_ops registers torchvision's image operators without importing torchvision,
    and the CPU decoder reads a PNG and a rotated JPEG with them; a later import of torchvision.io works beside them
    and encodes and decodes alike."""
    from launcher.rank.data import torchvision_ops

    how = torchvision_ops.load()
    assert hasattr(torch.ops.image, "decode_jpegs_cuda") and how.endswith((".so", ".pyd")), how
    files = [str(Path(folder) / name) for name in ("im0.png", "im1.jpg")]
    ours = [decode_on_cpu(Path(f).read_bytes()) for f in files]
    grey = torch.from_numpy(np.tile(np.arange(64, dtype=np.uint8), (3, 48, 1)))
    data = torchvision_ops.encode_jpeg(grey)
    assert "torchvision" not in sys.modules
    import torchvision.io

    rgb = torchvision.io.ImageReadMode.RGB
    for f, (image, error) in zip(files, ours):
        theirs = torchvision.io.decode_image(torchvision.io.read_file(f), mode=rgb, apply_exif_orientation=True)
        assert not error and torch.equal(image, theirs), f
    assert [image.shape for image, _ in ours] == [(3, 60, 80), (3, 80, 60)]  # the JPEG's EXIF rotation applied
    assert torch.equal(torchvision.io.encode_jpeg(grey), data)
    assert torch.equal(torch.ops.image.decode_jpeg(data, torchvision_ops.RGB, False),
                       torchvision.io.decode_jpeg(data, mode=rgb))
    print("registered without torchvision")


def test_the_rank_decodes_with_torchvisions_operators_without_importing_torchvision(tmp_path):
    """`import torchvision.io` took 1.5-6.2 s of a rank's start on the H200 machine; the decoders need its operators
    only (rank/data/torchvision_ops.py)."""
    write_images(tmp_path, ["png", "rotated"])
    code = f"from tests.test_gpu_input import registered_without_torchvision as r; r({str(tmp_path)!r})"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "registered without torchvision" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]


def deferred_torchvision(folder: str) -> None:
    """Run in a fresh process, as the rank starts (rank/worker.py): with torchvision's import deferred, building
    the fast validator (Ultralytics' BaseValidator imports torchvision) and registering the decoders run none of
    torchvision's code; the first read of one of its names imports it, and it works."""
    from launcher.rank.data import torchvision_ops

    assert torchvision_ops.defer_package_import()
    from launcher.rank.ultralytics.fast_validation import FastValidator

    FastValidator(None, {}, Path(folder), batch=8, amp_dtype=None)
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.01)  # registers operators: reads every module's __file__
    torchvision_ops.load()
    image, error = decode_on_cpu((Path(folder) / "im0.png").read_bytes())
    assert not error and image.shape == (3, 60, 80)
    assert not any(name.startswith("torchvision.") for name in sys.modules), sorted(sys.modules)
    assert not torchvision_ops.defer_package_import()  # once per process
    import torchvision

    boxes = torch.tensor([[0.0, 0, 10, 10], [1, 1, 10, 10], [20, 20, 30, 30]])
    assert torchvision.ops.nms(boxes, torch.tensor([0.9, 0.8, 0.7]), 0.5).tolist() == [0, 2]
    import torchvision.io

    assert torch.equal(torchvision.io.decode_image(torchvision.io.read_file(str(Path(folder) / "im0.png")),
                                                   mode=torchvision.io.ImageReadMode.RGB), image)
    print("deferred")


def test_the_rank_defers_torchvisions_import_until_a_name_of_it_is_read(tmp_path):
    """Ultralytics' validator imported torchvision, which a rank on CUDA never uses (rank/data/torchvision_ops.py)."""
    write_images(tmp_path, ["png"])
    code = f"from tests.test_gpu_input import deferred_torchvision as d; d({str(tmp_path)!r})"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "deferred" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]


def test_without_torchvisions_image_extension_the_decode_imports_torchvision(monkeypatch):
    from launcher.rank.data import torchvision_ops

    monkeypatch.setattr(torchvision_ops, "_loaded", None)
    monkeypatch.setattr(torchvision_ops, "EXTENSIONS", ("no_such_extension",))
    assert torchvision_ops.load() == "torchvision.io" and "torchvision.io" in sys.modules
    assert hasattr(torch.ops.image, "decode_jpegs_cuda")


def test_a_file_nothing_can_decode_is_named_once_and_trains_grey_without_labels(tmp_path):
    files = write_images(tmp_path, ["jpg", "corrupt", "png"])
    ds = EncodedTrainDataset(images_of(files), decode_all=True)
    logged = []
    gi = GpuInput(GpuAugment(32, {"mosaic": 0.0, "fliplr": 0.0, "scale": 0.0, "translate": 0.0}),
                  Decoder(torch.device("cpu"), files, logged.append), capacity=8, device=torch.device("cpu"),
                  close_at=0)  # no mosaic from the first epoch
    for _ in range(2):
        batch = gi(ds.collate_fn([ds[(0, i)] for i in range(3)]), torch.Generator().manual_seed(0))
    assert len(logged) == 1 and files[1] in logged[0] and "grey image without labels" in logged[0]
    assert sorted(set(batch["batch_idx"].long().tolist())) == [0, 2]  # the damaged image's labels are gone
    grey = batch["img"][1].float()
    assert (grey == grey.flatten()[0]).all()  # one grey (114, its value moved by RandomHSV)


# --- the device's half, end to end on known images ---------------------------------------------------------------------
def rectangles(folder: Path, n: int, size=(64, 48)):
    """n PNG files of 2 solid rectangles on dark grey; class = the rectangle's colour index (no two alike)."""
    from tests.test_gpu_augment import separate_boxes

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
    from tests.test_gpu_augment import visible_box

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


def test_the_shared_cache_holds_the_files_bytes(tmp_path):
    files = write_images(tmp_path, ["jpg", "png", "jpg"])
    cache = image_cache.ensure_file_cache(files, dirs=[tmp_path / "cache"], threads=1, log=lambda m: None)
    assert cache.path.name.startswith("files-")
    again = image_cache.ensure_file_cache(files, dirs=[tmp_path / "cache"], threads=1, log=lambda m: None)
    assert again.path == cache.path  # found, not built twice
    direct, cached = EncodedTrainDataset(images_of(files)), EncodedTrainDataset(images_of(files), cache=cache)
    for i in range(3):
        a, b = direct[(0, i)].payload, cached[(0, i)].payload
        assert torch.equal(a, b)
    assert cache.image(0)[0].size == Path(files[0]).stat().st_size


# --- the plan -----------------------------------------------------------------------------------------------------------
def _plan(overrides: list[str], gpus: int = 1, cpus: int = 16):
    from launcher.machine.hardware import Gpu, Hardware
    from launcher.plan.plan import make_plan
    from tests.conftest import compose_config

    hw = Hardware(gpus=tuple(Gpu(i, "NVIDIA H200", 141.0) for i in range(gpus)), cpu_count=cpus, nccl_available=True)
    return make_plan(compose_config(overrides), hw, None, port_is_free=lambda port: True)


def test_auto_takes_the_gpu_input_where_cores_are_few_or_images_large_and_it_needs_four_workers():
    few, problems = _plan([], cpus=8)
    assert not problems and few.augment_on == "gpu" and few.workers_per_rank == 4
    assert [n for n in few.notes if "loader.augment_on=auto: the input on the GPU (8 core(s) per rank" in n]
    many, problems = _plan([])  # 16 cores at 160 px: Ultralytics' pipeline keeps up
    assert not problems and many.augment_on == "cpu" and many.workers_per_rank == 12 and not many.notes
    large, problems = _plan(["train.imgsz=640"])  # 16 cores at 640 px: the GPU decodes and augments faster
    assert not problems and large.augment_on == "gpu" and [n for n in large.notes if "(640 px: at 512 px" in n]
    assert _plan([], gpus=8, cpus=64)[0].augment_on == "gpu"  # 8 cores per rank
    gpu_input, problems = _plan(["loader.augment_on=gpu"])
    assert not problems and gpu_input.augment_on == "gpu" and gpu_input.workers_per_rank == 4
    assert _plan([], gpus=0, cpus=2)[0].augment_on == "cpu"  # no GPU: Ultralytics' pipeline in the workers
    on_cpu, problems = _plan(["loader.augment_on=gpu"], gpus=0, cpus=2)  # the tensor maths on the CPU (CI)
    assert on_cpu.augment_on == "gpu" and not problems


@pytest.mark.parametrize("override", ["+train.extra.copy_paste=0.2", "train.cache=ram"])
def test_auto_takes_the_cpu_pipeline_for_what_only_it_does_and_says_so(override):
    plan, problems = _plan([override], cpus=8)
    assert not problems and plan.augment_on == "cpu"
    assert [n for n in plan.notes if "loader.augment_on=auto" in n and override.lstrip("+").split("=")[0] in n]


@pytest.mark.parametrize(("override", "advice"), [
    ("+train.extra.copy_paste=0.1", "loader.augment_on=cpu"),
    ("train.cache=ram", "train.cache=shared"),
    ("loader.augment_on=gpus", "auto, cpu or gpu"),
])
def test_what_the_gpu_input_cannot_do_is_refused_with_the_setting_that_can(override, advice):
    _, problems = _plan(["loader.augment_on=gpu", override])
    assert any(advice in p.message for p in problems), [p.message for p in problems]


def test_mixup_and_cutmix_are_the_gpu_inputs_too():
    mix = ["+train.extra.mixup=0.1", "+train.extra.cutmix=0.2"]
    plan, problems = _plan(["loader.augment_on=gpu", *mix])
    assert not problems and plan.augment_on == "gpu"
    plan, problems = _plan(mix, cpus=8)  # auto: nothing in them needs the CPU pipeline
    assert not problems and plan.augment_on == "gpu"


def test_the_dry_run_names_the_input_pipeline(tmp_path, cache_dir):
    from tests.conftest import ddp_launch

    r = ddp_launch(["dry_run=true", "loader.augment_on=gpu"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    expected = ("GPU: the workers read the files, nvJPEG decodes, one pass augments" if torch.cuda.is_available()
                else "the GPU pipeline's tensor maths, run on the CPU")
    assert f"input           {expected}" in r.stdout


def test_the_batch_tables_go_up_in_one_copy_each_where_it_was():
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    for device in devices:
        arrays = [np.arange(3, dtype=np.int64), np.zeros((0, 6), np.int64), np.full((2, 3, 5), 1.5, np.float32),
                  np.array([[7, 8]], np.int64), np.arange(3, dtype=np.float32)]  # 12 bytes: the next is realigned
        moved = upload(arrays, device)
        for a, t in zip(arrays, moved):
            assert t.device.type == device.type and t.shape == a.shape
            assert np.array_equal(t.cpu().numpy(), a)


def test_a_failed_nvjpeg_warm_up_is_logged_once_and_stops_nothing(monkeypatch):
    """rank/startup/prewarm.py: the warm-up's error reaches the log at the join, once, and the set-up goes on; on the CPU, or
    with no JPEG decoded on the device, no thread starts."""
    from launcher.rank.startup import prewarm

    def refused(device, batch):
        raise RuntimeError("nvJPEG is not available")

    monkeypatch.setattr(prewarm, "nvjpeg_warm_up", refused)
    logged = []
    warm = prewarm.Prewarm(torch.device("cuda", 0), decode_batch=4, log=logged.append).start()
    warm.join()
    warm.join()
    assert len(logged) == 1 and "nvJPEG is not available" in logged[0] and "first batch" in logged[0]
    for device, batch in (("cpu", 4), ("cuda", 0)):
        idle = prewarm.Prewarm(torch.device(device), decode_batch=batch).start()
        idle.join()
        assert idle.seconds is None

"""The GPU input pipeline's decoding half (rank/data/encoded.py, rank/gpu_data/gpu_input.py, warp.py) on the CPU:
the Triton kernels against their PyTorch twins (Triton's interpreter), the load against Ultralytics' resize, file
bytes and the decodes the workers keep, torchvision's operators without torchvision, damaged files, the file cache and
the nvJPEG warm-up.

The same kernels on CUDA, and nvJPEG against the CPU decoder: tests/test_cuda_input.py. Batches through the device's
half on known images: tests/test_gpu_input_batches.py; the plan's choice of input: tests/test_gpu_input_plan.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from launcher.rank.data import image_cache
from launcher.rank.data.encoded import EncodedImages, EncodedTrainDataset, decode_on_cpu, exif_orientation
from launcher.rank.gpu_data import warp
from launcher.rank.gpu_data.gpu_augment import GpuAugment
from launcher.rank.gpu_data.gpu_input import Decoder, GpuInput, resized_shape

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


# --- the node-shared cache of the files -------------------------------------------------------------------------------
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


# --- nvJPEG's warm-up -------------------------------------------------------------------------------------------------
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

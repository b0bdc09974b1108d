"""The GPU input pipeline on CUDA: its kernels against their torch twins, nvJPEG against the CPU decoder, the
warm-ups of its kernels, and a split copied between steps. Skipped without CUDA (CI); run on the GPU machine
(`pytest -m gpu`). The same cases on the CPU: tests/test_gpu_input.py."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_the_input_kernels_on_cuda_compute_what_their_torch_twins_compute():
    """warp.py's Triton kernels against the PyTorch twins that CPU runs use, on the same CUDA tensors."""
    from tests.test_gpu_input import load_case, render_case

    from launcher.rank.gpu_data import warp

    for kw in render_case(torch.device("cuda")):
        ours, twin = kw["out"], kw["out"].clone()
        warp.render(**kw)
        warp._render_torch(**{**kw, "out": twin})
        diff = (ours.float() - twin.float()).abs()
        assert (diff > 1e-3).float().mean() < 1e-4 and diff.max() <= 1.0 + 1e-3, float(diff.max())
    flat, meta, slots = load_case(torch.device("cuda"))
    twin = slots.clone()
    warp.load_into_slots(flat, meta, slots)
    saved, warp.triton_usable = warp.triton_usable, lambda device: False
    try:
        warp.load_into_slots(flat, meta, twin)
    finally:
        warp.triton_usable = saved
    assert (slots.int() - twin.int()).abs().max() <= 1


def test_nvjpeg_decodes_what_the_cpu_decodes_and_names_what_it_cannot(tmp_path):
    """Batched nvJPEG against torchvision's CPU decoder on the same JPEGs; a damaged file in the batch is retried
    alone, reported by name, and trains as a grey image."""
    from tests.test_gpu_input import encoded_batch_of, write_images

    from launcher.rank.data.encoded import decode_on_cpu
    from launcher.rank.gpu_data.gpu_input import Decoder

    files = write_images(tmp_path, ["jpg", "jpg", "png", "corrupt", "jpg"])
    batch = encoded_batch_of(files, decode_all=False)
    logged = []
    images, failed = Decoder(torch.device("cuda"), files, logged.append)(batch)
    assert failed == [False, False, False, True, False]
    assert len(logged) == 1 and files[3] in logged[0]
    for i in (0, 1, 4):
        cpu, _ = decode_on_cpu(open(files[i], "rb").read())
        assert images[i].is_cuda and images[i].shape == cpu.shape
        assert (images[i].cpu().float() - cpu.float()).abs().mean() < 2.0


def test_the_decode_without_torchvisions_import_is_torchvisions_decode(tmp_path):
    """rank/data/torchvision_ops.py calls the operator torchvision.io.decode_jpeg calls for a batch on CUDA: the same
    images, bit for bit, and the warm-up's JPEG is torchvision's encode_jpeg."""
    from torchvision.io import ImageReadMode, decode_jpeg, encode_jpeg

    from launcher.rank.data import torchvision_ops
    from tests.test_gpu_input import write_images

    files = write_images(tmp_path, ["jpg", "grey", "jpg"])
    data = [torch.frombuffer(bytearray(open(f, "rb").read()), dtype=torch.uint8) for f in files]
    ours = torchvision_ops.decode_jpegs_cuda(data, torch.device("cuda", 0))
    theirs = decode_jpeg(data, mode=ImageReadMode.RGB, device="cuda")
    assert all(a.is_cuda and torch.equal(a, b) for a, b in zip(ours, theirs))
    grey = torch.full((3, 48, 64), 114, dtype=torch.uint8)
    assert torch.equal(torchvision_ops.encode_jpeg(grey), encode_jpeg(grey))


def test_nvjpeg_warmed_on_a_thread_beside_the_set_up_leaves_the_graph_capture_after_it_valid():
    """rank/startup/prewarm.py: the warm-up's decode on its own thread ends without error, and a CUDA graph captured after
    the join replays what the eager computation gives."""
    from launcher.rank.startup.prewarm import Prewarm

    logged = []
    prewarm = Prewarm(torch.device("cuda", 0), decode_batch=8, log=logged.append).start()
    x = torch.randn(64, 64, device="cuda")  # the set-up's own CUDA work, beside it
    prewarm.join()
    assert prewarm.error is None and not logged and prewarm.seconds > 0
    graph, static = torch.cuda.CUDAGraph(), torch.zeros_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        (static @ static).relu()  # warm-up before capture, as torch.cuda.graph's users do
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out = (static @ static).relu()
    static.copy_(x)
    graph.replay()
    torch.testing.assert_close(out, (x @ x).relu())


INPUT_LAUNCHES = """
import pathlib, sys
import torch
from launcher.rank.data.encoded import EncodedTrainDataset
from launcher.rank.gpu_data.gpu_augment import GpuAugment
from launcher.rank.gpu_data.gpu_input import Decoder, GpuInput
from tests.test_gpu_input import images_of, write_images
cache, warm, form = pathlib.Path(sys.argv[1]), sys.argv[2] == "warm", sys.argv[3]
files = write_images(cache.parent, ["jpg"] * 8, size=(96, 72))
ds = EncodedTrainDataset(images_of(files), decode_all=False)
hyp = {"mixup": 0.5} if form == "mixed" else {}
dtype = torch.float16 if form == "fp16" else None  # the AMP step's channels_last input, or Ultralytics' uint8 batch
cuda = torch.device("cuda", 0)  # as the rank's device: an index (torch's stream calls refuse "cuda" alone)
gi = GpuInput(GpuAugment(64, hyp, out_dtype=dtype), Decoder(cuda, files), capacity=16, device=cuda)
if warm:
    gi.warm_up()
before = len(list(cache.rglob("*.cubin")))
for k in range(3):
    gi(ds.collate_fn([ds[(0, i)] for i in range(8)]), torch.Generator(device="cuda").manual_seed(k))
torch.cuda.synchronize()
print(sorted(p.parent.name[:8] + "/" + p.stem for p in cache.rglob("*.cubin")), file=sys.stderr)  # which compiled
print(before, len(list(cache.rglob("*.cubin"))))
"""


@pytest.mark.parametrize("form,kernel_count", [("fp16", 2), ("uint8", 2), ("mixed", 3)])
def test_the_gpu_inputs_kernels_warmed_up_are_the_ones_its_batches_launch(tmp_path, form, kernel_count):
    """GpuInput.warm_up compiles, without a launch, the load and render kernels that its batches then launch: into
    the AMP step's fp16 channels_last input, into Ultralytics' uint8 batch, and with MixUp's second render. In a
    process with an empty Triton cache, the batches after it compile nothing more; without it they compile all."""
    import os
    import subprocess
    import sys

    counts, compiled = {}, {}
    for mode in ("warm", "cold"):
        cache = tmp_path / mode / "triton"
        cache.parent.mkdir()
        done = subprocess.run([sys.executable, "-c", INPUT_LAUNCHES, str(cache), mode, form], capture_output=True,
                              text=True, env={**os.environ, "TRITON_CACHE_DIR": str(cache)}, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        counts[mode] = tuple(int(n) for n in done.stdout.split()[-2:])
        compiled[mode] = done.stderr.strip().splitlines()[-1:]
    assert counts == {"warm": (kernel_count, kernel_count), "cold": (0, kernel_count)}, (counts, compiled)


def test_a_split_placed_between_steps_copies_on_its_own_stream_and_arrives_whole():
    """Placement on CUDA: the slices are copied on a stream of their own while the current stream is busy (a
    training step's work), each advance returns without waiting for that work, and the split that finish() gives
    is read on the current stream with every image equal to the host's."""
    from tests.test_fast_validation import _loader_batches

    from launcher.rank.validate.store import Placement, PreloadedSplit

    device = torch.device("cuda", 0)
    batches = _loader_batches(40, 8, shape=(256, 320), seed=3)
    want = PreloadedSplit.load(batches, torch.device("cpu"))
    placing = Placement(PreloadedSplit.read(batches), device, slice_bytes=4 * 3 * 256 * 320)
    assert placing.ahead and placing.stream is not None and placing.stream != torch.cuda.current_stream(device)
    busy = torch.randn(4096, 4096, device=device)
    for _ in range(6):
        done = torch.cuda.Event()
        for _ in range(20):  # the "step": tens of milliseconds of work on the current stream
            busy = torch.tanh(busy @ busy / 64)
        done.record()
        placing.advance()
        assert not done.query()  # the copy did not wait for the step
    torch.cuda.synchronize(device)
    assert placing.copied == 6 * 4 * 3 * 256 * 320 and not placing.done
    got = placing.finish()
    assert got.on_device and all(g.img.device == device for g in got.groups.values())
    for x, y in zip(got.batches(16), want.batches(16)):
        assert x.files == y.files and torch.equal(x.img.cpu(), y.img) and torch.equal(x.cls.cpu(), y.cls)


def test_a_segment_batch_on_cuda_is_the_cpu_batch():
    """The polygons' warp, boxes, CutMix clamp, flips and Format's masks (rank/gpu_data/augment_segments.py,
    segment_masks.py) on CUDA tensors against the same draws on the CPU: the same rows in the same order, boxes within
    1e-4 of the image, masks and sem_masks equal but for a pixel where float rounding moves an edge."""
    from tests.test_gpu_segments import segment_case

    for overlap in (True, False):
        batches = []
        for device in (torch.device("cuda", 0), torch.device("cpu")):
            aug, raw, params = segment_case(device)
            aug.overlap_mask = overlap
            batches.append(aug.apply(raw, params))
        cuda, cpu = batches
        assert torch.equal(cuda["batch_idx"].cpu(), cpu["batch_idx"]) and torch.equal(cuda["cls"].cpu(), cpu["cls"])
        torch.testing.assert_close(cuda["bboxes"].cpu(), cpu["bboxes"], atol=1e-4, rtol=0)
        assert cuda["masks"].dtype == cpu["masks"].dtype and cuda["masks"].shape == cpu["masks"].shape
        assert (cuda["masks"].cpu() != cpu["masks"]).float().mean() < 1e-3
        assert (cuda["sem_masks"].cpu() != cpu["sem_masks"]).float().mean() < 1e-3


def test_an_obb_batch_on_cuda_is_the_cpu_batch():
    """The corners' warp, preserve_obb clips, CutMix, flips and xywhr (rank/gpu_data/augment_obb.py) on CUDA tensors
    against the same draws on the CPU: the same rows in the same order, each rectangle's corners within 1e-3 px up to
    their order (a near-square's sides may swap with float rounding)."""
    import numpy as np

    from tests.test_gpu_obb_batches import rect_corners
    from tests.test_gpu_segments import segment_case

    cuda, cpu = (aug.apply(raw, params) for aug, raw, params in
                 (segment_case(device, obb=True) for device in (torch.device("cuda", 0), torch.device("cpu"))))
    assert torch.equal(cuda["batch_idx"].cpu(), cpu["batch_idx"]) and torch.equal(cuda["cls"].cpu(), cpu["cls"])
    a, b = rect_corners(cuda["bboxes"].cpu(), 64), rect_corners(cpu["bboxes"], 64)
    assert np.min([np.linalg.norm(a - np.roll(b, k, 1), axis=-1).max(1) for k in range(4)], 0).max() < 1e-3

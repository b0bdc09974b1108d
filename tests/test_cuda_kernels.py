"""The hand-written kernels on CUDA: the Triton kernels, the channel concatenation and the fused BatchNorm+SiLU
against their PyTorch forms, the scans, the folded fp16 copy, and the warm-ups that compile them. Skipped without
CUDA (CI); run on the GPU machine (`pytest -m gpu`), results in docs/benchmarks/."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from tests.conftest import on_cuda
from tests.test_ddp_equivalence import make_model_and_batch, with_training_loss

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_triton_kernels_on_cuda_compute_what_their_pytorch_forms_compute(dtype):
    """rank/kernels/kernels.py's Triton forms against PyTorch: the bias and SiLU in fp32, rounded once (channels_last
    and contiguous tensors, channel counts that fill no block); the upsampling and its backward bit for bit, the
    backward from gradients in either layout, through autograd as the training graphs run it."""
    import torch.nn.functional as F

    from launcher.rank.kernels import kernels

    for shape in [(2, 3, 5, 7), (4, 80, 13, 17), (2, 144, 9, 11), (1, 512, 20, 20)]:
        for layout in (torch.channels_last, torch.contiguous_format):
            y = torch.randn(shape, device="cuda").to(dtype).contiguous(memory_format=layout)
            bias = torch.randn(shape[1], device="cuda").to(dtype)
            for silu in (True, False):
                want = y.float() + bias.float().view(1, -1, 1, 1)
                want = (want * torch.sigmoid(want) if silu else want).to(dtype)
                got = kernels.bias_act_(y.clone(), bias, silu)
                torch.testing.assert_close(got, want)
                assert got.is_contiguous(memory_format=layout)
        x = torch.randn(shape, device="cuda").to(dtype).contiguous(memory_format=torch.channels_last)
        up = kernels.upsample_nearest2x(x)
        assert up.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(up, F.interpolate(x, scale_factor=2, mode="nearest"))
        n, c, h, w = shape
        for layout in (torch.channels_last, torch.contiguous_format):
            grad = torch.randn((n, c, 2 * h, 2 * w), device="cuda").to(dtype).contiguous(memory_format=layout)
            want = torch.ops.aten.upsample_nearest2d_backward(grad, [2 * h, 2 * w], list(shape), 2.0, 2.0)
            assert torch.equal(kernels.upsample_nearest2x_backward(grad), want)
            leaf = x.detach().requires_grad_()
            kernels.nearest2x(leaf).backward(grad)
            assert torch.equal(leaf.grad, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_channel_concatenation_on_triton_is_torch_cat_and_its_backward_hands_out_packed_slices(dtype):
    """kernels.channel_cat / channel_split (the training graphs' C2f, SPPF and Concat): torch.cat's values bit for
    bit, from packed channels_last tensors and from channel slices of one (C2f's halves), in the Triton copies
    (profiled); the gradients PyTorch's slices, packed channels_last; widths that are no multiple of 16 and NCHW
    tensors go to torch.cat, with the same values."""
    from torch.profiler import ProfilerActivity, profile

    from launcher.rank.kernels import kernels

    def cl(*shape):
        return torch.randn(shape, device="cuda").to(dtype).contiguous(memory_format=torch.channels_last)

    for n, h, w, widths in [(2, 40, 40, [32, 32, 32]), (3, 7, 5, [64, 16]), (1, 1, 1, [256, 128, 16]),
                            (2, 9, 11, [24, 40]), (64, 20, 20, [256, 256, 256, 256])]:
        whole = cl(n, 2 * widths[0], h, w)
        head, tail = kernels.channel_split(whole, widths[0])  # C2f's halves: a view, and a packed copy
        assert torch.equal(head, whole[:, :widths[0]]) and torch.equal(tail, whole[:, widths[0]:])
        parts = [head, tail, *(cl(n, c, h, w) for c in widths[1:])]
        leaves = [p.detach().requires_grad_() for p in parts]
        handed = [None] * len(leaves)  # the gradients as the backward hands them out (before any accumulation)
        for i, leaf in enumerate(leaves):
            leaf.register_hook(lambda g, i=i: handed.__setitem__(i, g))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            out = kernels.channel_cat(leaves)
            torch.cuda.synchronize()
        assert torch.equal(out, torch.cat(parts, 1)) and out.is_contiguous(memory_format=torch.channels_last)
        fits = all(c % 16 == 0 for c in widths)
        assert fits == ("_copy_rows_kernel" in {e.key for e in prof.key_averages()}), (widths, fits)
        grad = cl(*out.shape)
        out.backward(grad)
        at = 0
        for leaf, given in zip(leaves, handed):
            c = leaf.shape[1]
            assert torch.equal(leaf.grad, grad[:, at:at + c]) and torch.equal(given, leaf.grad)
            assert given.is_contiguous(memory_format=torch.channels_last) or not fits
            at += c
        source = whole.detach().requires_grad_()
        a, b = kernels.channel_split(source, widths[0])
        (a.float().sum() * 2 + (b.float() * 3).sum()).backward()
        want = torch.cat([torch.full_like(a, 2), torch.full_like(b, 3)], 1)
        assert torch.equal(source.grad, want)
    nchw = [torch.randn(2, 32, 8, 8, device="cuda", dtype=dtype) for _ in range(2)]
    assert torch.equal(kernels.cat_channels(nchw), torch.cat(nchw, 1))


WARMED_UP_LAUNCHES = """
import pathlib, sys
import torch
from launcher.rank.kernels import kernels
cache, warm = pathlib.Path(sys.argv[1]), sys.argv[2] == "warm"
names = {"validation": kernels.VALIDATION, "training": kernels.TRAINING, "scans": kernels.SCANS,
         "bn_act": ("bn_act",)}[sys.argv[3]]
if warm:
    kernels.warm_up(torch.device("cuda", 0), torch.float16, names)
before = len(list(cache.rglob("*.cubin")))
y = torch.randn(4, 80, 13, 17, device="cuda", dtype=torch.half).contiguous(memory_format=torch.channels_last)
if names == kernels.SCANS:
    from launcher.rank.kernels import scans
    from launcher.rank.validate import matching, nms
    boxes = torch.rand(3, 500, 4, device="cuda").cumsum(-1)
    scans.greedy_nms(boxes, torch.ones(3, 500, dtype=torch.bool, device="cuda"), 0.7)
    for targets in (5, 17):  # up to 16 and up to 32 targets an image
        scans.claims(torch.rand(3, targets, 300, device="cuda"), matching.IOU_THRESHOLDS.cuda())
    # and as a validation calls them: NMS of a head's fp16 output, then the matching of its detections to targets
    pred = torch.rand(2, 7, 4000, device="cuda")
    pred[:, :4] = pred[:, :4] * torch.tensor([600.0, 440.0, 80.0, 60.0], device="cuda")[:, None] + 20
    det = nms.batched_nms(pred.half(), 0.001, 0.7, max_det=300, nc=3)
    truth = torch.tensor([[[100.0, 100, 200, 180], [300, 50, 420, 200]]], device="cuda").repeat(2, 1, 1)
    matching.true_positives(det.boxes, det.cls, det.valid(), truth, torch.zeros(2, 2, device="cuda"),
                            torch.ones(2, 2, dtype=torch.bool, device="cuda"))
elif names == ("bn_act",):
    from launcher.rank.kernels.batchnorm_silu import bn_silu
    w, b = torch.ones(80, device="cuda", requires_grad=True), torch.zeros(80, device="cuda", requires_grad=True)
    for act, stats in ((True, True), (False, False)):  # with running statistics to update and without
        running = (torch.zeros(80, device="cuda"), torch.ones(80, device="cuda")) if stats else (None, None)
        bn_silu(y.detach().requires_grad_(), w, b, *running, 0.03, 1e-3, True, act).float().sum().backward()
elif names == kernels.VALIDATION:
    for silu in (True, False):
        kernels.bias_act_(y, torch.randn(80, device="cuda", dtype=torch.half), silu)
    kernels.upsample_nearest2x(y)
else:
    leaf = y.detach().requires_grad_()
    kernels.nearest2x(leaf).sum().backward()
    wide = torch.randn(4, 64, 13, 17, device="cuda", dtype=torch.half).contiguous(memory_format=torch.channels_last)
    kernels.channel_cat(kernels.channel_split(wide.requires_grad_(), 32)).sum().backward()
torch.cuda.synchronize()
print(before, len(list(cache.rglob("*.cubin"))))
"""


@pytest.mark.parametrize("names,kernel_count", [("validation", 3), ("training", 3), ("scans", 3), ("bn_act", 10)])
def test_the_kernels_warmed_up_on_a_thread_are_the_ones_launched_after(tmp_path, names, kernel_count):
    """kernels.warm_up compiles, without a launch, exactly the specialisations that are then launched (fp16,
    channels_last): the folded validation forward's, the training graphs' upsampling forward and backward and the
    concatenations' copy, the fused BatchNorm and SiLU's, and the validation's NMS and matching scans (called
    directly, and by batched_nms and true_positives as a validation calls them). In a process with an empty Triton cache, the launches after it
    compile nothing more; without it they compile all."""
    import os
    import subprocess
    import sys

    counts = {}
    for mode in ("warm", "cold"):
        cache = tmp_path / mode
        done = subprocess.run([sys.executable, "-c", WARMED_UP_LAUNCHES, str(cache), mode, names], capture_output=True,
                              text=True, env={**os.environ, "TRITON_CACHE_DIR": str(cache)}, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        counts[mode] = tuple(int(n) for n in done.stdout.split()[-2:])
    assert counts == {"warm": (kernel_count, kernel_count), "cold": (0, kernel_count)}, counts


def test_the_scans_on_cuda_keep_and_match_what_the_cpu_forms_do():
    """Greedy NMS and the matching as Triton programs on CUDA (rank/kernels/scans.py), at a weak model's scale
    (5,000 candidates an image, three tiles of the NMS program, crowded, identical boxes among them; 300 detections
    against 40 targets), against torchvision's NMS and the PyTorch matching on the CPU: the same answers, bit for
    bit."""
    from launcher.rank.kernels import scans
    from launcher.rank.validate import matching, nms

    g = torch.Generator().manual_seed(0)
    xy = torch.rand(6, 5000, 2, generator=g) * 400  # three tiles an image
    boxes = torch.cat([xy, xy + 1 + torch.rand(6, 5000, 2, generator=g) * 80], -1)
    boxes[:, 1::9] = boxes[:, ::9][:, : boxes[:, 1::9].shape[1]]
    alive = torch.rand(6, 5000, generator=g) > 0.05
    kept = scans.greedy_nms(boxes.cuda(), alive.cuda(), 0.7).cpu()
    full = nms._torchvision_nms(boxes, alive, 0.7)
    assert torch.equal(kept, full) and 100 < kept.sum(1).min() and full[:, 2048:].any(1).all()
    first = scans.greedy_nms(boxes.cuda(), alive.cuda(), 0.7, limit=100).cpu()  # the scan stopped at 100 survivors
    assert torch.equal(first, full & (full.cumsum(1) <= 100))
    boxes = boxes[:, :2048]
    truth = boxes[:, :40] + torch.rand(6, 40, 4, generator=g) * 10
    iou = matching.box_iou(truth, boxes[:, :300]) * (torch.rand(6, 40, 300, generator=g) > 0.3)
    claimed = scans.claims(iou.cuda(), matching.IOU_THRESHOLDS.cuda()).cpu()
    assert torch.equal(claimed, matching._claims(iou, matching.IOU_THRESHOLDS)) and claimed.sum() > 100


def test_the_folded_fp16_copy_on_cuda_is_as_close_to_fp32_as_autocast_and_its_graph_follows_a_refresh():
    """The fast validator's forward (rank/ultralytics/folded.py: BatchNorm folded, fp16, the Triton bias/SiLU and
    upsampling) against the EMA's fp32 output: no further from it than the EMA under fp16 autocast (the forward
    before the fold); replayed as a CUDA graph, a refresh after the EMA moved reaches the replay."""
    from launcher.rank.ultralytics.folded import FoldedCopy
    from launcher.rank.validate.forward import InferenceForward
    from tests.test_folded_copy import a_trained_looking_model

    ema = a_trained_looking_model().cuda()
    img = torch.randint(0, 256, (8, 3, 96, 128), dtype=torch.uint8, device="cuda")
    folded = FoldedCopy(ema, torch.float16)
    forward = InferenceForward(folded.model, torch.device("cuda"), batch=8, amp_dtype=None, graphs=True)
    amp = InferenceForward(ema, torch.device("cuda"), batch=8, amp_dtype=torch.float16, graphs=False)

    def outputs():
        with torch.inference_mode():
            want = ema(img.float().contiguous(memory_format=torch.channels_last) / 255)[0]
            return want, forward(img)[0].float(), amp(img)[0].float()

    for moved in (False, True):
        if moved:
            with torch.no_grad():  # up to 2 % on every weight and statistic (more overflows fp16 in 60 layers)
                for t in ema.state_dict().values():
                    if t.is_floating_point():
                        t.mul_(1 + 0.02 * torch.rand_like(t))
            folded.refresh()
        want, got, autocast = outputs()
        assert forward._captured  # replayed
        for part in (slice(0, 4), slice(4, None)):  # boxes (pixels), then class scores
            err, amp_err = (got[:, part] - want[:, part]).abs().max(), (autocast[:, part] - want[:, part]).abs().max()
            assert err <= 2 * amp_err + 1e-3, (moved, part, err, amp_err)
            assert want[:, part].abs().max() > 10 * amp_err  # the premise: outputs well above the rounding


def _channels_last_model_and_batch():
    """The equivalence tests' yolov8n with the run's loss, channels_last, in training mode, and its batch, on CUDA."""
    model, batch = make_model_and_batch()
    return with_training_loss(model.cuda().to(memory_format=torch.channels_last)).train(), on_cuda(batch)


def _graphs_grads_and_kernels(parts: tuple[str, ...], whole: bool):
    """The gradients of a yolov8n's fp16 graph (the whole step's, or the network's) replayed with `parts` of
    rank/step/triton_modules.py, flat, and the names of the kernels its replay launched."""
    from torch.profiler import ProfilerActivity, profile

    from launcher.rank.data.pipeline import MAX_TARGETS
    from launcher.rank.step.captured_step import CapturedStep, bucket
    from launcher.rank.step.graphed import GraphedDetector

    model, batch = _channels_last_model_and_batch()
    batch["img"] = batch["img"].half().contiguous(memory_format=torch.channels_last)
    if whole:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        step = CapturedStep(model, optimizer=opt, scaler=torch.amp.GradScaler("cuda", enabled=False), ema=None,
                            loss_scale=1.0, grad_clip=0.0, amp_dtype=torch.float16, batch=len(batch["img"]),
                            imgsz=batch["img"].shape[-1], triton_parts=parts)
        step.capture({**batch, MAX_TARGETS: 3})
        graph = step.graphs[bucket(3)]
        replay = lambda: graph.replay(graph.img, graph.targets)  # noqa: E731
        grads = step.grads
    else:
        net = GraphedDetector(model, len(batch["img"]), batch["img"].shape[-1], torch.float16,
                              input_dtype=torch.float16, channels_last=True, triton_parts=parts)
        params = list(model.parameters())

        def replay():
            for p in params:
                p.grad = None
            with torch.autocast("cuda", dtype=torch.float16):
                loss, _ = model.loss(batch, net(batch["img"]))
            loss.sum().backward()
        grads = None
    replay()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages()}
    taken = grads if whole else [p.grad for p in model.parameters() if p.requires_grad]
    assert not any("forward" in m.__dict__ for m in model.modules())  # PyTorch's again
    return torch.cat([g.detach().float().flatten() for g in taken]), names


@contextmanager
def _cudnn_deterministic():
    deterministic, benchmark = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = deterministic, benchmark


def test_the_training_graphs_run_the_triton_modules_and_take_pytorchs_gradients():
    """triton_parts=COPIES (rank/step/triton_modules.py): the whole step's graph and the network's graph replay the
    Triton upsampling (forward and backward) and the concatenations' copies, as the profiler sees the replay, and
    give the gradients of the graphs without them, bit for bit (cuDNN deterministic); the modules run PyTorch's
    and Ultralytics' forward again after the capture."""
    from launcher.rank.step.triton_modules import COPIES

    with _cudnn_deterministic():
        for whole in (True, False):
            want, pytorch_kernels = _graphs_grads_and_kernels((), whole)
            got, triton_kernels = _graphs_grads_and_kernels(COPIES, whole)
            assert torch.isfinite(want).all() and torch.equal(got, want), whole
            assert any("upsample_nearest2d" in k for k in pytorch_kernels), pytorch_kernels
            assert not any("upsample_nearest2d" in k for k in triton_kernels), triton_kernels
            assert {"_upsample2x", "_upsample2x_backward", "_copy_rows_kernel"} <= triton_kernels, triton_kernels


def _exact_grads(fused: bool = False) -> torch.Tensor:
    """The gradient the fp16 graphs approximate: the same yolov8n and batch in fp32, eager, TF32 off, flat (with
    `fused`, its Conv blocks on the fused kernels in fp32)."""
    from launcher.rank.step.triton_modules import triton_modules

    model, batch = _channels_last_model_and_batch()
    img = batch["img"].half().float().contiguous(memory_format=torch.channels_last)  # the graphs' input, exactly
    conv, matmul = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with triton_modules(model, parts=("bn_act",) if fused else ()):
            loss, _ = model.loss(batch, model(img))
            loss.sum().backward()
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = conv, matmul
    return torch.cat([p.grad.detach().float().flatten() for p in model.parameters() if p.requires_grad])


def _distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_the_fused_bn_act_in_fp32_gives_a_networks_exact_gradients():
    """Every Conv block of a yolov8n on the fused kernels in fp32 (eager): the whole network's gradient within 1e-3
    of PyTorch's fp32 one, where a wrong term of the backward in any block moves it by far more."""
    with _cudnn_deterministic():
        exact, fused = _exact_grads(), _exact_grads(fused=True)
    assert _distance(fused, exact) < 1e-3, _distance(fused, exact)


def test_the_training_graphs_with_the_fused_bn_act_are_as_close_to_the_exact_gradients_as_pytorchs():
    """triton_parts=PARTS (train.fused_bn_act): both graphs replay the fused BatchNorm and SiLU kernels, no cuDNN
    BatchNorm and no SiLU kernel of PyTorch's, and a second capture repeats them bit for bit. Their fp16 gradient is
    as close to the fp32 one as the fp16 graphs' without the fusion (within 1.25x). The two fp16 gradients are not
    compared with each other: a freshly initialised network's fp16 gradients scatter by a tenth of their norm from
    the fp32 one however BatchNorm and SiLU round (docs/benchmarks/README.md section 14)."""
    from launcher.rank.step.triton_modules import COPIES, PARTS

    fused = {"stats_partial", "stats_finish", "act_forward", "grad_partial", "grad_finish", "act_backward"}
    with _cudnn_deterministic():
        exact = _exact_grads()
        for whole in (True, False):
            want, _ = _graphs_grads_and_kernels(COPIES, whole)
            got, names = _graphs_grads_and_kernels(PARTS, whole)
            again, _ = _graphs_grads_and_kernels(PARTS, whole)
            assert torch.isfinite(got).all() and torch.equal(got, again), whole
            print(f"whole={whole}: fp16 to fp32 gradient, fused {_distance(got, exact):.4f}, "
                  f"PyTorch's {_distance(want, exact):.4f}, fused to PyTorch's {_distance(got, want):.4f}")
            assert _distance(got, exact) <= 1.25 * _distance(want, exact) + 1e-3, whole
            assert fused <= names, names
            left = [k for k in names if any(w in k.lower() for w in ("silu", "batch_norm", "bn_fw", "bn_bw"))]
            assert not left, left


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_fused_bn_act_kernels_on_cuda_give_batchnorm_and_silus_values(dtype):
    """rank/kernels/batchnorm_silu.py on CUDA against torch.nn.BatchNorm2d and SiLU in fp32 on the same stored input
    (channel counts that fill no block, a yolov8s P2 layer's shape): output, input and parameter gradients, running
    statistics; a second call repeats the first bit for bit (no atomics)."""
    from launcher.rank.kernels.batchnorm_silu import bn_silu

    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for shape in [(2, 5, 3, 4), (4, 80, 13, 17), (2, 144, 9, 11), (64, 32, 160, 160)]:
        for act in (True, False):
            x = (torch.randn(shape, device="cuda") * 2 + 1).to(dtype).contiguous(memory_format=torch.channels_last)
            grad = torch.randn(shape, device="cuda").to(dtype).contiguous(memory_format=torch.channels_last)
            bn = torch.nn.BatchNorm2d(shape[1], momentum=0.03, eps=1e-3).cuda().train()
            runs = []
            for _ in range(2):
                w, b = bn.weight.detach().clone().requires_grad_(), bn.bias.detach().clone().requires_grad_()
                rm, rv = bn.running_mean.clone(), bn.running_var.clone()
                leaf = x.detach().requires_grad_()
                y = bn_silu(leaf, w, b, rm, rv, bn.momentum, bn.eps, True, act)
                y.backward(grad)
                runs.append([y, leaf.grad, w.grad, b.grad, rm, rv])
            leaf = x.detach().float().requires_grad_()
            ref = bn(leaf)
            ref = torch.nn.functional.silu(ref) if act else ref
            ref.backward(grad.float())
            want = [ref.to(dtype), leaf.grad.to(dtype), bn.weight.grad, bn.bias.grad, bn.running_mean, bn.running_var]
            assert runs[0][0].is_contiguous(memory_format=torch.channels_last)
            for got, again, expected in zip(runs[0], runs[1], want):
                assert torch.equal(got, again)
                scale = max(1.0, float(expected.float().abs().max()))
                torch.testing.assert_close(got.float(), expected.float(), rtol=tol["rtol"], atol=tol["atol"] * scale)

"""The fused training BatchNorm and SiLU (rank/kernels/batchnorm_silu.py) and its swap into Ultralytics' Conv blocks
(rank/ultralytics/blocks.py, part "bn_act" of rank/step/triton_modules.py): PyTorch's values to float rounding, the
running statistics and num_batches_tracked as torch.nn.BatchNorm2d keeps them. The Triton kernels run under Triton's
interpreter in a subprocess (TRITON_INTERPRET=1 before launcher is imported); CUDA: tests/test_cuda_kernels.py's graphs."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from contextlib import nullcontext

import pytest
import torch
from torch import nn

from tests.test_ddp_equivalence import make_model_and_batch, with_training_loss


def _conv(c1: int, c2: int, act=True):
    from ultralytics.nn.modules.conv import Conv

    torch.manual_seed(0)
    m = Conv(c1, c2, 3, act=act).train()
    with torch.no_grad():
        m.bn.weight.uniform_(0.5, 1.5)
        m.bn.bias.uniform_(-0.5, 0.5)
        m.bn.running_var.uniform_(0.5, 2.0)
    return m


def _forward_backward(m, forward, x: torch.Tensor, grad: torch.Tensor):
    """(output, input gradient, parameter gradients, BatchNorm buffers) of one training pass."""
    x = x.detach().clone().requires_grad_()
    m.zero_grad()
    y = forward(m, x)
    y.backward(grad.to(y.dtype))
    return y.detach(), x.grad, [p.grad.clone() for p in m.parameters()], [b.clone() for b in m.bn.buffers()]


def _assert_same(got, want, rtol: float, atol: float) -> None:
    y, dx, grads, buffers = got
    torch.testing.assert_close(y.float(), want[0].float(), rtol=rtol, atol=atol)
    torch.testing.assert_close(dx.float(), want[1].float(), rtol=rtol, atol=atol)
    for a, b in zip(grads, want[2]):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol * max(1.0, float(b.abs().max())))
    for a, b in zip(buffers, want[3]):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


def conv_against_ultralytics(dtype: torch.dtype = torch.float32, triton: bool = False) -> None:
    """blocks.conv_bn_act against Conv.forward on the same module (copies): outputs, the input's, the convolution's
    and BatchNorm's gradients, running statistics and num_batches_tracked, with SiLU and without, over channel counts
    that fill no block and images of odd sizes. fp16: both sides' outputs rounded once to fp16 (the reference
    computes in fp32 from the fp16 convolution output)."""
    from launcher.rank.kernels import batchnorm_silu
    from launcher.rank.ultralytics.blocks import conv_bn_act

    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for c1, c2, n, h, w in [(3, 5, 2, 3, 4), (8, 40, 2, 8, 8), (4, 16, 3, 5, 7), (2, 33, 2, 6, 3)]:
        for act in (True, False):
            m = _conv(c1, c2, act).to(dtype)
            m.bn.float()  # as under AMP: BatchNorm's parameters and statistics stay fp32
            ref = copy.deepcopy(m)
            x = (torch.randn(n, c1, h, w) * 2 + 1).to(dtype).contiguous(memory_format=torch.channels_last)
            grad = torch.randn(n, c2, h, w).contiguous(memory_format=torch.channels_last)

            def reference(module, inp):  # Conv.forward, BatchNorm and SiLU in fp32 on the stored convolution output
                y = module.act(module.bn(module.conv(inp).float()))
                return y.to(inp.dtype)

            want = _forward_backward(ref, reference, x, grad)
            launched = []
            on_triton = batchnorm_silu._on_triton
            batchnorm_silu._on_triton = lambda t: launched.append(on_triton(t)) or launched[-1]
            try:
                got = _forward_backward(m, conv_bn_act, x, grad)
            finally:
                batchnorm_silu._on_triton = on_triton
            assert launched and all(v == triton for v in launched), launched
            _assert_same(got, want, **tol)
            assert int(m.bn.num_batches_tracked) == int(ref.bn.num_batches_tracked) == 1


def test_the_pytorch_twin_gives_convs_values_gradients_and_running_statistics():
    conv_against_ultralytics(torch.float32)


def test_eval_mode_runs_ultralytics_own_forward_on_the_running_statistics():
    from launcher.rank.ultralytics.blocks import conv_bn_act

    m = _conv(4, 16).eval()
    x = torch.randn(2, 4, 5, 5)
    before = [b.clone() for b in m.bn.buffers()]
    assert torch.equal(conv_bn_act(m, x), m(x))
    assert all(torch.equal(a, b) for a, b in zip(m.bn.buffers(), before))


def kernels_against_pytorch() -> None:
    """Under TRITON_INTERPRET=1: the Triton kernels (counted as launched) against Conv's forward in fp32 and fp16,
    with the default blocks and with blocks small enough that a program reduces several row blocks and the finish
    merges several chunks of partials; a channel whose mean is 10^4 times its spread keeps its variance (fp32, against
    float64); the backward keeps x (the convolution's output), not y; and a yolov8n's training pass with every Conv
    swapped gives PyTorch's gradients and statistics to float rounding."""
    from launcher.rank.kernels import batchnorm_silu as bs

    assert bs._on_triton(torch.zeros(2, 3, 4, 4).contiguous(memory_format=torch.channels_last))
    for dtype in (torch.float32, torch.float16):
        conv_against_ultralytics(dtype, triton=True)
    defaults = (bs.STAT_ROWS, bs.PROGRAMS, bs.PARTS, bs.FINISH_CHANNELS, bs.ROWS, bs.CHANNELS)
    # (2, 40, 8, 8): 32 row blocks, 3 programs of 11, one of 10; several row and channel blocks elementwise
    bs.STAT_ROWS, bs.PROGRAMS, bs.PARTS, bs.FINISH_CHANNELS, bs.ROWS, bs.CHANNELS = 4, 6, 2, 16, 16, 16
    try:
        assert bs._split(128, 40) == (11, 3) and bs._split(72, 5) == (3, 6)
        conv_against_ultralytics(torch.float32, triton=True)
    finally:
        bs.STAT_ROWS, bs.PROGRAMS, bs.PARTS, bs.FINISH_CHANNELS, bs.ROWS, bs.CHANNELS = defaults

    x = (torch.randn(4, 3, 16, 16, dtype=torch.float64) + 1e4).float().contiguous(memory_format=torch.channels_last)
    weight, bias = torch.ones(3, requires_grad=True), torch.zeros(3, requires_grad=True)
    rm, rv = torch.zeros(3), torch.ones(3)
    y = bs.bn_silu(x.requires_grad_(), weight, bias, rm, rv, 0.5, 1e-5, True, False)
    var = x.detach().double().var(dim=(0, 2, 3), unbiased=True)
    # fp32 sums of x and x^2 would lose it whole (x^2 ~ 1e8, its rounding ~ 6); what is left is the rounding of the
    # means themselves, stored in fp32 at 1e4 (6e-4 of the spread)
    torch.testing.assert_close(rv.double(), 0.5 + 0.5 * var, rtol=1e-3, atol=0)
    torch.testing.assert_close(y.double().var(dim=(0, 2, 3), unbiased=False), torch.ones(3, dtype=torch.float64),
                               rtol=1e-3, atol=0)
    saved = y.grad_fn.saved_tensors
    assert saved[0] is x or saved[0].data_ptr() == x.data_ptr()
    assert not any(t.data_ptr() == y.data_ptr() for t in saved)
    network_pass_against_pytorch(torch.float32)


def test_the_triton_kernels_through_the_interpreter_give_pytorchs_values():
    code = "from tests.test_fused_bn_act import kernels_against_pytorch; kernels_against_pytorch()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]


def network_pass_against_pytorch(dtype: torch.dtype = torch.float32) -> None:
    """A yolov8n's training pass (channels_last) with its Conv blocks swapped ("bn_act") against Ultralytics':
    outputs, gradients and BatchNorm buffers; every Conv swapped, nothing else. float64 (the twin): equal to 1e-10,
    the maths is PyTorch's; fp32: each parameter's gradient within 1e-3 of PyTorch's as a whole (rounding grows
    through 20 layers whose deepest BatchNorms see 8 values per channel here)."""
    from ultralytics.nn.modules.conv import Conv

    from launcher.rank.step.triton_modules import triton_modules

    model, batch = make_model_and_batch()
    model = model.train().to(dtype).to(memory_format=torch.channels_last)
    x = batch["img"][:2].to(dtype).contiguous(memory_format=torch.channels_last)

    def run(swap: bool):
        m = copy.deepcopy(model)
        with triton_modules(m, parts=("bn_act",)) if swap else nullcontext(0) as swapped:
            assert swapped == (sum(type(c) is Conv for c in m.modules()) if swap else 0)
            leaves = _leaves(m(x))
            sum(o.square().mean() for o in leaves).backward()
        assert not any("forward" in c.__dict__ for c in m.modules())
        return leaves, [p.grad for p in m.parameters() if p.grad is not None], list(m.buffers())

    want, got = run(False), run(True)
    close = 1e-10 if dtype == torch.float64 else 1e-3
    for a, b in zip(got[0] + got[1] + got[2], want[0] + want[1] + want[2]):
        a, b = a.detach().double(), b.detach().double()
        assert float((a - b).norm()) <= close * float(b.norm()) + 1e-12, float((a - b).norm() / b.norm())


def _leaves(out) -> list[torch.Tensor]:
    if torch.is_tensor(out):
        return [out]
    items = out.values() if isinstance(out, dict) else out
    return [t for o in items for t in _leaves(o)]


def _trained(swap: bool, steps: int = 2):
    """A yolov8n trained `steps` steps in float64 (Ultralytics' SGD, the run's loss) with or without the swap: the
    losses and the state (weights, BatchNorm statistics, num_batches_tracked). In fp32 two such runs drift apart
    by float rounding, which a few steps of a tiny batch amplify to 1e-4 (test above)."""
    from launcher.rank.step.train_step import train_step
    from launcher.rank.step.triton_modules import triton_modules

    model, batch = make_model_and_batch()
    model = with_training_loss(model).train().double().to(memory_format=torch.channels_last)
    batch = {**batch, "img": batch["img"].double().contiguous(memory_format=torch.channels_last)}
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    losses = []
    with triton_modules(model, parts=("bn_act",)) if swap else nullcontext():
        for _ in range(steps):
            loss, _ = train_step(model, batch, loss_scale=1.0, optimizer=opt, scaler=scaler, grad_clip=10.0,
                                 amp_dtype=None)
            losses.append(loss.detach().clone())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_network_with_the_swap_computes_its_values_and_gradients():
    network_pass_against_pytorch(torch.float64)  # fp32: on the Triton kernels, in the interpreter's test


def test_a_network_trained_with_the_swap_takes_the_steps_it_takes_without():
    want_losses, want = _trained(False)
    got_losses, got = _trained(True)
    for a, b in zip(got_losses, want_losses):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    start, _ = make_model_and_batch()
    assert any(not torch.equal(want[k], v) for k, v in start.state_dict().items()), "nothing was trained"
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-8, atol=1e-11, msg=k)
    assert int(got["model.0.bn.num_batches_tracked"]) == 2


def test_only_convs_own_forward_with_plain_batchnorm_and_silu_or_nothing_is_swapped():
    """SyncBatchNorm (DDP's dist.sync_bn), a subclass with a forward of its own, another activation and a BatchNorm
    without running statistics keep their forward; a subclass that keeps Conv's (DWConv) is swapped."""
    from ultralytics.nn.modules.conv import Conv, DWConv

    from launcher.rank.step.triton_modules import triton_modules
    from launcher.rank.ultralytics.blocks import conv_forwards

    class OwnForward(Conv):
        def forward(self, x):
            return self.act(self.bn(self.conv(x))) * 2

    synced = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(Conv(3, 16)))[0]
    untracked = Conv(3, 16)
    untracked.bn = nn.BatchNorm2d(16, track_running_stats=False)
    kept = [synced, OwnForward(3, 16), Conv(3, 16, act=nn.ReLU()), untracked]
    swapped = [Conv(3, 16), Conv(3, 16, act=False), DWConv(16, 16)]
    net = nn.Sequential(*kept, *swapped)
    assert [m for m, _ in conv_forwards(net)] == swapped
    with triton_modules(net, parts=("bn_act",)) as n:
        assert n == 3
        assert all("forward" in m.__dict__ for m in swapped) and not any("forward" in m.__dict__ for m in kept)
    assert not any("forward" in m.__dict__ for m in net.modules())


@pytest.mark.parametrize("value, line", [
    ("maybe", "train.fused_bn_act='maybe': expected auto, true or false"),
    (True, "train.fused_bn_act=true runs inside the training CUDA graphs"),
])
def test_a_bad_fused_bn_act_is_refused_in_one_line(value, line):
    from launcher.plan.checks import step_problems

    from tests.test_plan import CPU_BOX

    problems = step_problems({"fused_bn_act": value}, {}, device="cpu", mode="single", hw=CPU_BOX)
    assert [p for p in problems if line in str(p)], problems


def test_the_plan_fuses_where_the_training_graphs_run_on_cuda():
    from launcher.plan.decisions import rank_decisions

    def fused(device: str, mode: str = "ddp", sync_bn: bool = False, **train) -> bool:
        cfg = {"train": train, "optim": {}, "dist": {"sync_bn": sync_bn}}
        return rank_decisions(cfg, device=device, mode=mode)["fused_bn_act"]

    assert fused("cuda", fused_bn_act="auto") and fused("cuda", fused_bn_act=True)
    assert not fused("cuda") and not fused("cuda", fused_bn_act=False)  # off unless asked for (the shipped default)
    on = {"fused_bn_act": "auto"}
    assert not fused("cpu", **on) and not fused("cuda", mode="dp", **on)
    assert not fused("cuda", cuda_graphs=False, **on) and not fused("cuda", compile=True, **on)
    assert not fused("cuda", sync_bn=True, **on)  # SyncBatchNorm keeps its own forward


def test_the_rank_hands_the_graphs_the_part_where_the_plan_fuses_and_the_kernels_compiled():
    from types import SimpleNamespace

    from launcher.rank.components import Rank
    from launcher.rank.step.triton_modules import COPIES, PARTS

    def parts(compiled: bool, fused: bool) -> tuple[str, ...]:
        rank = SimpleNamespace(triton_kernels=lambda: compiled, plan=SimpleNamespace(fused_bn_act=fused))
        return Rank.triton_parts(rank)

    assert parts(True, True) == PARTS and "bn_act" in PARTS
    assert parts(True, False) == COPIES and "bn_act" not in COPIES
    assert parts(False, True) == ()

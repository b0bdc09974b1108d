"""The fast validator's folded copy of the EMA (rank/ultralytics/folded.py) on the CPU, in fp32: it computes the EMA's
eval output, follows the EMA's weights in place, and leaves the EMA as it was. Its Triton kernels are compared with
these PyTorch forms on CUDA (tests/test_cuda_kernels.py)."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn
from ultralytics.nn.modules import Conv
from ultralytics.nn.tasks import DetectionModel

from launcher.rank.ultralytics.folded import FoldedCopy
from launcher.rank.kernels.kernels import bias_act_, upsample_nearest2x


def a_trained_looking_model(seed: int = 0, act: nn.Module | None = None) -> DetectionModel:
    """yolov8n with BatchNorm statistics and affine parameters away from their initial values (folding those is
    almost the identity)."""
    torch.manual_seed(seed)
    model = DetectionModel("yolov8n.yaml", nc=3, verbose=False)
    if act is not None:
        for m in model.modules():
            if type(m) is Conv:
                m.act = act
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.5)
                m.running_var.uniform_(0.2, 3.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.2)
    return model.eval()


def eval_output(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)[0]


def test_the_folded_copy_computes_the_emas_eval_output_and_leaves_the_ema_as_it_was():
    ema = a_trained_looking_model()
    before = {k: v.clone() for k, v in ema.state_dict().items()}
    x = torch.rand(2, 3, 96, 128)
    folded = FoldedCopy(ema, torch.float32)
    want, got = eval_output(ema, x), eval_output(folded.model, x)
    convs = [m for m in ema.modules() if type(m) is Conv]
    assert folded.folded == len(convs) > 50
    assert not any(isinstance(m, nn.BatchNorm2d) for m in folded.model.modules())  # yolov8n's are all in Conv
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-3), (got - want).abs().max()
    assert not torch.allclose(eval_output(DetectionModel("yolov8n.yaml", nc=3, verbose=False).eval(), x), want,
                              rtol=1e-4, atol=1e-3)  # the premise: other weights give another output
    assert all(torch.equal(v, before[k]) for k, v in ema.state_dict().items())
    assert all(hasattr(m, "bn") and "forward" not in vars(m) for m in convs)  # the EMA's modules untouched
    torch.save(ema, io.BytesIO())  # still what a checkpoint saves


def test_a_refresh_takes_the_emas_new_weights_into_the_same_tensors():
    """The EMA moves at every step; the copy's forward is captured as a CUDA graph over the copy's tensors, so a
    refresh must write into those tensors."""
    ema = a_trained_looking_model()
    folded = FoldedCopy(ema, torch.float32)
    tensors = [t.data_ptr() for t in folded.model.state_dict().values()]
    x = torch.rand(2, 3, 64, 96)
    with torch.no_grad():  # one EMA update's worth of change, everywhere: weights, BatchNorm statistics, head biases
        for t in ema.state_dict().values():
            if t.is_floating_point():
                t.mul_(1.05).add_(torch.rand_like(t) * 0.01)
    want = eval_output(ema, x)
    assert not torch.allclose(eval_output(folded.model, x), want, rtol=1e-4, atol=1e-3)  # stale before the refresh
    folded.refresh()
    assert torch.allclose(eval_output(folded.model, x), want, rtol=1e-4, atol=1e-3)
    assert [t.data_ptr() for t in folded.model.state_dict().values()] == tensors


def test_an_activation_the_kernel_does_not_apply_runs_as_ultralytics_fuses_it():
    ema = a_trained_looking_model(act=nn.LeakyReLU(0.1))
    folded = FoldedCopy(ema, torch.float32)
    x = torch.rand(1, 3, 64, 64)
    assert folded.folded > 50
    assert torch.allclose(eval_output(folded.model, x), eval_output(ema, x), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("silu", [True, False])
def test_the_bias_and_activation_pass_adds_each_channels_bias(silu):
    """The PyTorch form (what the CPU runs); the Triton form is compared with it on CUDA."""
    y = torch.randn(2, 5, 3, 4).contiguous(memory_format=torch.channels_last)
    bias = torch.arange(5.0)
    want = y + bias.view(1, 5, 1, 1)
    want = want * torch.sigmoid(want) if silu else want
    got = bias_act_(y, bias, silu)
    assert got is y and torch.allclose(got, want, atol=1e-6)


def test_nearest_upsampling_repeats_each_pixel_into_a_two_by_two_block():
    x = torch.arange(2 * 3 * 2 * 2, dtype=torch.float32).view(2, 3, 2, 2).contiguous(memory_format=torch.channels_last)
    y = upsample_nearest2x(x)
    assert y.shape == (2, 3, 4, 4)
    assert torch.equal(y[:, :, ::2, ::2], x) and torch.equal(y[:, :, 1::2, 1::2], x) and torch.equal(y[:, :, 1::2, ::2], x)

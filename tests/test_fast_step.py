"""The step's speed settings change how it runs, never what it computes: the fused optimizer and torch.compile."""

from __future__ import annotations

import pytest
import torch

from launcher import lr
from launcher.fast_step import fused_optimizer
from tests.test_ddp_equivalence import make_model_and_batch


def _ultralytics_sgd(model: torch.nn.Module) -> torch.optim.SGD:
    """Ultralytics' three parameter groups: BN weights (no decay), other weights (decay), biases (no decay)."""
    bn, weights, biases = [], [], []
    for name, p in model.named_parameters():
        (biases if name.endswith("bias") else bn if p.ndim == 1 else weights).append(p)
    opt = torch.optim.SGD(bn, lr=0.01, momentum=0.937, nesterov=True)
    opt.add_param_group({"params": weights, "weight_decay": 5e-4})
    opt.add_param_group({"params": biases, "weight_decay": 0.0})
    return opt


def _steps(opt, model, losses) -> dict:
    """One GradScaler step per loss factor; inf makes that step overflow (GradScaler skips it)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    x = torch.linspace(-1, 1, 32).view(4, 8)
    for factor in losses:
        loss = (model(x) ** 2).mean() * factor
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.SiLU(), torch.nn.Linear(16, 2))


def test_the_fused_optimizer_keeps_groups_and_hyperparameters():
    model = _mlp()
    plain = _ultralytics_sgd(model)
    fused = fused_optimizer(plain, True, torch.device("cpu"))
    assert type(fused) is torch.optim.SGD and fused.defaults["fused"] is True
    assert len(fused.param_groups) == len(plain.param_groups) == 3
    for a, b in zip(fused.param_groups, plain.param_groups):
        assert a["params"] == b["params"]
        assert {k: a[k] for k in ("lr", "momentum", "nesterov", "weight_decay")} == {
            k: b[k] for k in ("lr", "momentum", "nesterov", "weight_decay")
        }
        assert a["fused"] is True and not a["foreach"]
    assert fused_optimizer(plain, "auto", torch.device("cpu")) is plain, "auto is fused on CUDA only"
    assert fused_optimizer(plain, False, torch.device("cuda")) is plain


@pytest.mark.parametrize("first_step_overflows", [True, False])
def test_fused_sgd_takes_the_same_steps_as_foreach_sgd_also_after_a_skipped_first_step(first_step_overflows):
    """The H200 bug: fp16 AMP's first step overflows; fused SGD skipped it with uninitialised momentum buffers."""
    factors = [float("inf") if first_step_overflows else 1.0, 1.0, 0.5, 2.0, 1.0]
    model = _mlp()
    reference = _steps(_ultralytics_sgd(model), model, factors)
    model = _mlp()
    fused = fused_optimizer(_ultralytics_sgd(model), True, torch.device("cpu"))
    result = _steps(fused, model, factors)
    for k, v in reference.items():
        assert torch.isfinite(result[k]).all(), k
        torch.testing.assert_close(result[k], v, rtol=1e-5, atol=1e-6, msg=k)
    assert any(not torch.equal(v, _mlp().state_dict()[k]) for k, v in result.items()), "nothing was trained"


def test_fused_sgd_state_round_trips_through_a_checkpoint():
    model = _mlp()
    opt = fused_optimizer(_ultralytics_sgd(model), True, torch.device("cpu"))
    _steps(opt, model, [1.0, 1.0])
    again = fused_optimizer(_ultralytics_sgd(model), True, torch.device("cpu"))
    again.load_state_dict(opt.state_dict())  # a resumed run continues with the saved momentum
    for p in model.parameters():
        torch.testing.assert_close(again.state[p]["momentum_buffer"], opt.state[p]["momentum_buffer"])


@pytest.mark.slow
def test_a_compiled_network_takes_the_same_step_as_the_eager_one():
    """train.compile on the CPU (Inductor's C++ backend): the same loss and the same update, up to rounding."""
    from launcher.fast_step import compiled
    from launcher.trainer import prepare_criterion, train_step

    results = []
    for mode in (False, True):
        torch._dynamo.reset()
        model, batch = make_model_and_batch()
        prepare_criterion(model)
        model.train()
        net = compiled(model, mode)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        losses = [
            train_step(net, batch, loss_scale=lr.loss_scale(64, 4), optimizer=opt, scaler=scaler, grad_clip=10.0)[0]
            for _ in range(2)
        ]
        bn = next(m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d))
        results.append((losses, {k: v.detach().clone() for k, v in model.named_parameters()}, bn.running_mean.clone()))
    (eager_losses, eager, eager_bn), (comp_losses, comp, comp_bn) = results
    for a, b in zip(comp_losses, eager_losses):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    for k, v in eager.items():
        torch.testing.assert_close(comp[k], v, rtol=1e-3, atol=1e-4, msg=k)
    torch.testing.assert_close(comp_bn, eager_bn, rtol=1e-4, atol=1e-5)  # BatchNorm statistics move inside the graph

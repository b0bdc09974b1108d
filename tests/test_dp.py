"""DataParallel: only the images are scattered; the loss on the gathered predictions is the single-process loss, for
every task (so ddp-bench's DataParallel cells run segmentation, pose, obb and classification models too).
(On GPUs: tests/test_cuda_step.py; a DataParallel run end to end on the CPU: the dist.fallback=dp test of test_faults.py.)"""

from __future__ import annotations

import pytest
import torch

from launcher.rank.step.train_step import train_step
from launcher.rank.step.wrap import unwrap
from tests.test_ddp_equivalence import make_model_and_batch, with_training_loss


def gather(outputs: list):
    """torch.nn.parallel.gather's rule on the CPU: tensors concatenated along dim 0, dicts and lists element-wise."""
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outputs, 0)
    if isinstance(first, dict):
        return {k: gather([o[k] for o in outputs]) for k in first}
    return type(first)(gather(list(parts)) for parts in zip(*outputs))


class TwoReplicas(torch.nn.Module):
    """What DataParallel does with two GPUs, on the CPU: each replica runs on half the images, outputs gathered."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, img):
        return gather([self.module(half) for half in img.chunk(2)])


def test_the_loss_on_predictions_gathered_from_two_replicas_is_the_whole_batch_loss():
    model, batch = make_model_and_batch()
    with_training_loss(model).train()
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.eval()  # per-replica BatchNorm statistics would differ from the whole batch's
    single, _ = model.loss(batch, model(batch["img"]))
    dp = TwoReplicas(model)
    assert unwrap(torch.nn.DataParallel(model)) is model  # the step computes the loss on the unwrapped network
    split, _ = model.loss(batch, dp(batch["img"]))  # train_step: forward on the images only, loss on the network
    torch.testing.assert_close(split, single, rtol=1e-5, atol=1e-5)
    assert split.sum() > 0


def test_a_step_through_the_replicas_is_the_single_process_step():
    results = []
    for wrap in (lambda m: m, TwoReplicas):
        model, batch = make_model_and_batch()
        with_training_loss(model).train()
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.eval()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        wrapped = wrap(model)
        wrapped.loss = model.loss  # what unwrap finds on DataParallel's .module
        train_step(wrapped, batch, loss_scale=1.0, optimizer=opt, scaler=scaler, grad_clip=10.0)
        results.append({k: v.detach().clone() for k, v in model.named_parameters()})
    for k in results[0]:
        torch.testing.assert_close(results[1][k], results[0][k], rtol=1e-4, atol=1e-6, msg=k)


@pytest.mark.parametrize("task", ["segment", "pose", "obb", "classify"])
def test_a_tasks_loss_on_predictions_gathered_from_two_replicas_is_the_whole_batch_loss(task):
    """The mask coefficients and prototypes, keypoints, angles or class scores gathered along the images as the
    boxes are: the task's loss (normalised over the ranks, here one) on them is its loss on the whole batch."""
    from launcher.rank.ultralytics.task_loss import training_criterion
    from tests.test_classify import _model_and_batch
    from tests.test_tasks import _task_model_and_batch

    model, batch = _model_and_batch() if task == "classify" else _task_model_and_batch(task)
    model.train()
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.eval()
    criterion, _ = training_criterion(model, sync_free=True)
    single, _ = criterion(model(batch["img"]), batch)
    split, _ = criterion(TwoReplicas(model)(batch["img"]), batch)
    torch.testing.assert_close(split, single, rtol=1e-4, atol=1e-5)
    assert split.sum() > 0

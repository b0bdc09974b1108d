"""One optimizer step at world size 2 x batch b equals world size 1 x batch 2b on the same images, and so does one
step of 2 accumulated micro-batches of b (train.accumulate), on one rank or on two.

This is the property that makes the learning-rate contract hold: with the loss scaled by lr.loss_scale, DDP's
gradient average over ranks is the gradient a single process computes on the whole global batch. BatchNorm is
frozen (eval mode) so that per-rank (or per-micro-batch) statistics do not differ from whole-batch ones. The images
hold unequal numbers of boxes, so that a normaliser taken per rank or per micro-batch would give another step.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from launcher.plan import lr
from launcher.rank.data.pipeline import TARGETS_PER_IMAGE

pytestmark = pytest.mark.dist

GLOBAL_BATCH, BASE_BATCH, IMGSZ = 4, 64, 64
BOXES = (3, 1, 2, 1)  # per image


def make_model_and_batch():
    from ultralytics.cfg import get_cfg
    from ultralytics.nn.tasks import DetectionModel

    torch.manual_seed(0)
    model = DetectionModel("yolov8n.yaml", nc=3, verbose=False)
    model.args = get_cfg()  # loss gains (box, cls, dfl)
    g = torch.Generator().manual_seed(1)
    imgs = torch.rand(GLOBAL_BATCH, 3, IMGSZ, IMGSZ, generator=g)
    # 3, 1, 2 and 1 boxes: (image index, class, cx, cy, w, h)
    rows = [(i, (i + k) % 3, 0.2 + 0.3 * k, 0.5, 0.25, 0.4) for i, n in enumerate(BOXES) for k in range(n)]
    t = torch.tensor(rows, dtype=torch.float32)
    batch = {"img": imgs, "batch_idx": t[:, 0], "cls": t[:, 1:2], "bboxes": t[:, 2:],
             TARGETS_PER_IMAGE: list(BOXES)}
    return model, batch


def shard(batch: dict, rank: int, world: int) -> dict:
    per = GLOBAL_BATCH // world
    keep = (batch["batch_idx"] >= rank * per) & (batch["batch_idx"] < (rank + 1) * per)
    return {
        "img": batch["img"][rank * per : (rank + 1) * per],
        "batch_idx": batch["batch_idx"][keep] - rank * per,
        "cls": batch["cls"][keep],
        "bboxes": batch["bboxes"][keep],
        TARGETS_PER_IMAGE: batch[TARGETS_PER_IMAGE][rank * per : (rank + 1) * per],
    }


def with_training_loss(model, sync_free: bool = True):
    """The model with the criterion ddp-launch trains with (the global normaliser, the sync-free parts)."""
    from launcher.rank.step.wrap import unwrap
    from launcher.rank.ultralytics.task_loss import training_criterion

    net = unwrap(model)
    net.criterion, _ = training_criterion(net, sync_free=sync_free)
    return model


def one_step(model, batch, local_batch, accumulate: int = 1, base_batch: int = BASE_BATCH):
    from launcher.rank.step.train_step import train_step

    with_training_loss(model)
    model.train()
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.eval()  # frozen statistics: the same normalisation whatever the split
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    train_step(model, batch, loss_scale=lr.loss_scale(base_batch, local_batch), optimizer=opt, scaler=scaler,
               grad_clip=10.0, accumulate=accumulate)


def parameters(model) -> dict:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def assert_same_step(got: dict, want: dict, before: dict) -> None:
    assert sum((want[k] - before[k]).abs().sum() for k in want) > 0  # the step did something
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-6, msg=f"parameter {k} differs")


def _rank(rank: int, world: int, init_file: str, out: str, accumulate: int = 1):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    model, batch = make_model_and_batch()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    one_step(ddp, shard(batch, rank, world), GLOBAL_BATCH // world, accumulate)
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.named_parameters()}, out)
    dist.barrier()
    dist.destroy_process_group()


def whole_batch_step() -> tuple[dict, dict]:
    """(parameters before, after) one process's step on the whole batch."""
    model, batch = make_model_and_batch()
    before = parameters(model)
    one_step(model, batch, GLOBAL_BATCH)
    return before, parameters(model)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_two_ranks_of_b_take_the_same_step_as_one_process_of_2b(tmp_path, accumulate):
    """accumulate 2: each rank's 2 images as 2 micro-batches of 1, DDP's all-reduce on the second only."""
    before, single = whole_batch_step()
    out = tmp_path / "ddp.pt"
    mp.start_processes(_rank, args=(2, str(tmp_path / "init"), str(out), accumulate), nprocs=2, start_method="spawn")
    assert_same_step(torch.load(out), single, before)


@pytest.mark.parametrize("accumulate", [2, 4])
def test_accumulated_micro_batches_take_the_same_step_as_the_whole_batch(accumulate):
    before, single = whole_batch_step()
    model, batch = make_model_and_batch()
    one_step(model, batch, GLOBAL_BATCH, accumulate)
    assert_same_step(parameters(model), single, before)
    trained = [p for p in model.parameters() if p.requires_grad]
    assert trained and all(p.grad is not None and not p.grad.any() for p in trained)  # zeroed, kept for the next

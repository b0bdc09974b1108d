"""One optimizer step at world size 2 x batch b equals world size 1 x batch 2b on the same images.

This is the property that makes the learning-rate contract hold: with the loss scaled by lr.loss_scale, DDP's
gradient average over ranks is the gradient a single process computes on the whole global batch. BatchNorm is
frozen (eval mode) so that per-rank batch statistics do not differ from whole-batch ones.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from launcher.plan import lr

pytestmark = pytest.mark.dist

GLOBAL_BATCH, BASE_BATCH, IMGSZ = 4, 64, 64


def make_model_and_batch():
    from ultralytics.cfg import get_cfg
    from ultralytics.nn.tasks import DetectionModel

    torch.manual_seed(0)
    model = DetectionModel("yolov8n.yaml", nc=3, verbose=False)
    model.args = get_cfg()  # loss gains (box, cls, dfl)
    g = torch.Generator().manual_seed(1)
    imgs = torch.rand(GLOBAL_BATCH, 3, IMGSZ, IMGSZ, generator=g)
    # two boxes per image: (image index, class, cx, cy, w, h)
    rows = [(i, (i + k) % 3, 0.3 + 0.4 * k, 0.5, 0.3, 0.4) for i in range(GLOBAL_BATCH) for k in range(2)]
    t = torch.tensor(rows, dtype=torch.float32)
    batch = {"img": imgs, "batch_idx": t[:, 0], "cls": t[:, 1:2], "bboxes": t[:, 2:]}
    return model, batch


def shard(batch: dict, rank: int, world: int) -> dict:
    per = GLOBAL_BATCH // world
    keep = (batch["batch_idx"] >= rank * per) & (batch["batch_idx"] < (rank + 1) * per)
    return {
        "img": batch["img"][rank * per : (rank + 1) * per],
        "batch_idx": batch["batch_idx"][keep] - rank * per,
        "cls": batch["cls"][keep],
        "bboxes": batch["bboxes"][keep],
    }


def with_training_loss(model, sync_free: bool = True):
    """The model with the criterion ddp-launch trains with (the global normaliser, the sync-free parts)."""
    from launcher.rank.step.wrap import unwrap
    from launcher.rank.ultralytics.loss import training_criterion

    net = unwrap(model)
    net.criterion, _ = training_criterion(net, sync_free=sync_free)
    return model


def one_step(model, batch, local_batch):
    from launcher.rank.step.train_step import train_step

    with_training_loss(model)
    model.train()
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.eval()  # frozen statistics: the same normalisation whatever the split
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
    scaler = torch.amp.GradScaler("cuda", enabled=False)
    train_step(model, batch, loss_scale=lr.loss_scale(BASE_BATCH, local_batch), optimizer=opt, scaler=scaler, grad_clip=10.0)


def _rank(rank: int, world: int, init_file: str, out: str):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    model, batch = make_model_and_batch()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    one_step(ddp, shard(batch, rank, world), GLOBAL_BATCH // world)
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.named_parameters()}, out)
    dist.barrier()
    dist.destroy_process_group()


def test_two_ranks_of_b_take_the_same_step_as_one_process_of_2b(tmp_path):
    model, batch = make_model_and_batch()
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    one_step(model, batch, GLOBAL_BATCH)
    single = {k: v.detach() for k, v in model.named_parameters()}

    out = tmp_path / "ddp.pt"
    mp.start_processes(_rank, args=(2, str(tmp_path / "init"), str(out)), nprocs=2, start_method="spawn")
    ddp = torch.load(out)

    moved = sum((single[k] - before[k]).abs().sum() for k in single)
    assert moved > 0  # the step did something
    for k in single:
        torch.testing.assert_close(ddp[k], single[k], rtol=1e-4, atol=1e-6, msg=f"parameter {k} differs")

"""train.batch_per_device=auto on a rank: the largest batch whose step fits this GPU, measured on the step as the
run takes it (step/auto_batch.py), then the job's batch, the smallest any rank measured, and the plan for it.

`measure_batch` runs before the process group (ranks measure different sizes, and the loss's normaliser would
all-reduce); `take_batch` after it. Each takes the components.Rank being built and reads its settings and log; the
probe's network, optimizer, EMA, loss and graphs are its own, built by the run's own functions (model_build.py,
step_build.py) and freed before the run's are built.
"""

from __future__ import annotations

import torch
from torch import nn

from launcher.plan.describe import batch_lines
from launcher.plan.plan import LaunchPlan, with_batch
from launcher.rank.step import auto_batch
from launcher.rank.step.train_step import TrainStep
from launcher.rank.build_steps import model_build
from launcher.rank.build_steps.step_build import (capture_network, capture_whole_step, captures_step,
                                                  most_targets_of, synthetic_batch)
from launcher.rank.ultralytics import build
from launcher.rank.ultralytics.fast_validation import VAL_CONF, nms_settings
from launcher.rank.validate.forward import InferenceForward
from launcher.rank.validate.nms import batched_nms


def measure_batch(rank, validation: bool) -> dict:
    """train.batch_per_device=auto: the largest batch whose step fits this GPU (step/auto_batch.py), measured on
    the step as the run takes it, built here from the same parts as the run's own (a network of its own, its
    loss, optimizer, EMA, scaler and CUDA graphs), all freed before the run's are built; then settled with a
    validation batch beside the steps (`validation`: the run validates). The RNG is left as the seed set it."""
    plan, settings = rank.plan, rank.settings
    rank.prewarm.join()  # the probe captures graphs
    memory = auto_batch.CudaMemory(rank.device)
    with torch.random.fork_rng(devices=[rank.device]):
        net, frozen = model_build.network(rank.hyp, rank.data, settings.model.weights, rank.device)
        ema = model_build.ema_and_loss(net, bool(settings.train.sync_free_loss))  # as the run's: the EMA, the loss
        step = TrainStep(net, net, optimizer=model_build.optimizer(net, settings.optim, plan.base_lr,
                                                                   plan.fused_optimizer, rank.device),
                         scaler=model_build.scaler(rank.amp_dtype), ema=ema, loss_scale=1.0,
                         grad_clip=float(settings.optim.grad_clip), amp_dtype=rank.amp_dtype)
        build.train_mode(net, frozen)
        graphs = [plan.cuda_graphs]
        whole = captures_step(rank, net)

        targets = most_targets_of(rank)

        def run_at(batch: int, validate: bool = False) -> None:
            try:
                if whole:  # the step the run takes: every bucket captured, its own gradients and graph pool
                    taken, captured = capture_whole_step(rank, net, optimizer=step.optimizer, scaler=step.scaler,
                                                         ema=step.ema, batch=batch, loss_scale=1.0,
                                                         log=lambda _: None)
                    largest = captured[0]  # the graph with the most target rows, the most crowded batch it replays
                else:
                    step.model, taken, largest = probe_graphs(rank, net, batch, graphs), step, 0
                batches = [synthetic_batch(rank, batch, largest or auto_batch.PROBE_TARGETS)]
                if targets is not None and targets > max(largest, auto_batch.PROBE_TARGETS):
                    batches.append(synthetic_batch(rank, batch, targets))  # the most crowded batch, eager if uncaptured
                for _ in range(auto_batch.STEPS):
                    for one in batches:
                        taken(one)
                if validate:
                    probe_validation(rank, net, frozen, batch)
            finally:
                step.model = taken = net  # the graphs (and their memory pool) go with this size
                for p in net.parameters():
                    p.grad = None

        choice = auto_batch.choose(lambda b: auto_batch.measure(run_at, b, memory), total=memory.total(),
                                   rule=plan.auto_batch)
        if validation:
            choice = auto_batch.settle(choice, lambda b: auto_batch.measure(lambda x: run_at(x, True), b, memory),
                                       rule=plan.auto_batch)
        del step, net, run_at
        memory.release()
    return choice.record(plan.auto_batch["fraction"], f"{rank.device} {torch.cuda.get_device_name(rank.device)}")


def probe_validation(rank, net: nn.Module, frozen, batch: int) -> None:
    """One validation batch as the run's first validation takes it, beside the probe's training graphs: the
    forward at val.batch on square imgsz images (no rectangular batch is larger), CUDA-graphed as the fast
    engine's, and NMS of what an untrained network finds (thousands of candidates per image)."""
    imgsz, rows = int(rank.hyp.imgsz), rank.plan.val_batch_at(batch)
    forward = InferenceForward(net, rank.device, batch=rows, amp_dtype=rank.amp_dtype, log=lambda _: None,
                               graphs=rank.plan.val_engine == "fast" and rank.plan.val_cuda_graphs)
    settings = nms_settings(rank.hyp, end2end=bool(getattr(net, "end2end", False)), conf=VAL_CONF)
    net.eval()
    try:
        with torch.inference_mode():
            img = torch.randint(0, 256, (rows, 3, imgsz, imgsz), dtype=torch.uint8, device=rank.device)
            preds = forward(img)
            batched_nms(preds[0] if isinstance(preds, (list, tuple)) else preds, settings.conf, settings.iou,
                        max_det=settings.max_det, multi_label=settings.multi_label, agnostic=settings.agnostic,
                        nc=int(rank.data["nc"]), end2end=settings.end2end)
    finally:
        build.train_mode(net, frozen)


def probe_graphs(rank, net: nn.Module, batch: int, graphs: list[bool]) -> nn.Module:
    """The probe's network for `batch`: CUDA-graphed as the run's will be; eager after a capture that fails for
    another reason than memory (as the run's own falls back: step_build.graphed_network)."""
    if not graphs[0]:
        return net
    try:
        return capture_network(rank, net, batch)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as e:
        rank.log(f"WARNING: CUDA graph capture failed while measuring the batch ({type(e).__name__}: {e}); "
                 "measuring the eager step")
        graphs[0] = False
        return net


def take_batch(rank, mine: dict) -> LaunchPlan:
    """The job's batch: the smallest any rank measured (a collective), and the plan for it, from the rules
    make_plan follows (plan.with_batch). Rank 0 writes it into plan.json (a restarted rank trains on it without
    measuring again) and prints it, with the lr0 and warmup (and new notes) it gives, before the first step."""
    why = auto_batch.agree(rank.comm.gather(mine))
    planned, rank.plan = rank.plan.notes, with_batch(rank.plan, rank.cfg, why["batch_per_device"], why)
    build.set_batch(rank.hyp, rank.plan)
    if rank.rank == 0:
        rank.folder.write_plan(rank.plan)
        notes = [n for n in rank.plan.notes if n not in planned]  # the launcher printed the others
        for line in [auto_batch.explain(why), *batch_lines(rank.plan), *notes]:
            rank.log(line)
    return rank.plan

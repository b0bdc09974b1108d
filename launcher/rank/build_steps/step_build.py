"""What a rank's step calls (components.Rank's step 6): on one GPU the whole step's forward, loss and backward
captured (step/captured_step.py); elsewhere the network's forward and backward captured as CUDA graphs
(step/graphed.py), then DDP or DataParallel around it, and the TrainStep over that. Each function takes the
components.Rank being built and reads its network, optimizer, scaler, EMA, settings and log."""

from __future__ import annotations

import torch
from torch import nn

from launcher.plan import lr as lrmod
from launcher.plan.task_rules import rules
from launcher.rank.step import auto_batch
from launcher.rank.step.captured_step import CapturedStep, most_targets, uses_captured_step
from launcher.rank.step.graphed import GraphedDetector
from launcher.rank.step.train_step import TrainStep
from launcher.rank.step.wrap import wrap


def build_step(rank) -> tuple:
    """(the loop's step, the module it calls): the whole step captured where it can be, else the network graphed
    (train.cuda_graphs on CUDA) and wrapped for the mode, under a TrainStep."""
    plan, settings = rank.plan, rank.settings
    step = captured_step(rank) if captures_step(rank, rank.net) else None
    if step is not None:
        return step, rank.net
    graphed = graphed_network(rank) if plan.cuda_graphs and rank.device.type == "cuda" else None
    model = wrap(rank.net, mode=plan.mode, device=rank.device, devices_per_rank=plan.devices_per_rank,
                 dist=settings.dist, compile_setting=settings.train.compile, graphed=graphed)
    step = TrainStep(model, rank.net, optimizer=rank.optimizer, scaler=rank.scaler, ema=rank.ema,
                     loss_scale=lrmod.loss_scale(rules(plan.task).loss_base(plan.base_batch), plan.batch_per_rank),
                     grad_clip=float(settings.optim.grad_clip), amp_dtype=rank.amp_dtype,
                     accumulate=plan.accumulate)
    return step, model


def capture_network(rank, net: nn.Module, batch: int) -> GraphedDetector:
    """`net`'s training forward and backward captured for `batch` images of the step's input type and layout;
    raises what the capture raised (out of memory included)."""
    dtype, channels_last = rank.step_input
    return GraphedDetector(net, batch, rank.hyp.imgsz, rank.amp_dtype, input_dtype=dtype,
                           channels_last=channels_last, triton_parts=rank.triton_parts())


def captures_step(rank, net: nn.Module) -> bool:
    """train.graph_scope: the whole step captured where it can be (auto; captured_step.py), else the network."""
    if rank.plan.graph_scope != "step":
        return False
    why_not = uses_captured_step(net, device=rank.device, world_size=rank.world, accumulate=rank.plan.accumulate)
    if why_not is not None and net is rank.net:
        rank.detail(f"CUDA graphs: the network's forward and backward only ({why_not})")
    return why_not is None


def captured_step(rank) -> CapturedStep | None:
    """The whole step captured (captured_step.py), every bucket the data can need, at set-up on synthetic batches;
    None when the capture fails and train.cuda_graphs=auto (the network alone is then graphed)."""
    rank.net.train()
    plan, targets = rank.plan, most_targets_of(rank)
    try:
        step, captured = capture_whole_step(rank, rank.net, optimizer=rank.optimizer, scaler=rank.scaler,
                                            ema=rank.ema, batch=plan.micro_batch,
                                            loss_scale=lrmod.loss_scale(plan.base_batch, plan.batch_per_rank),
                                            log=rank.log)
    except Exception as e:  # noqa: BLE001 - a loss or network that syncs with the host inside the capture
        for p in rank.net.parameters():
            p.grad = None
        failure = f"CUDA graph capture of the whole step failed ({type(e).__name__}: {e})"
        if rank.plan.cuda_graphs_required:
            raise RuntimeError(f"{failure}; capture the network only: train.graph_scope=network") from e
        rank.log(f"WARNING: {failure}; capturing the network only")
        return None
    rank.detail(f"CUDA graphs: the whole step's forward, loss and backward captured for batches of "
                f"{plan.micro_batch}, a graph per padded target count {sorted(captured)} (the data's images carry "
                f"at most {'an unknown number of' if targets is None else targets} targets)")
    return step


def capture_whole_step(rank, net: nn.Module, *, optimizer, scaler, ema, batch: int, loss_scale: float,
                       log) -> tuple[CapturedStep, list[int]]:
    """`net`'s whole step for `batch` images captured in every bucket the data can need, largest first, then the
    capture's side-stream blocks given back; (the step, the buckets captured). The run's set-up and the auto-batch
    probe both call it, so the probe measures the graphs the run will hold. Raises what the capture raised."""
    step = CapturedStep(net, optimizer=optimizer, scaler=scaler, ema=ema, loss_scale=loss_scale,
                        grad_clip=float(rank.settings.optim.grad_clip), amp_dtype=rank.amp_dtype, batch=batch,
                        imgsz=int(rank.hyp.imgsz), triton_parts=rank.triton_parts(), log=log)
    captured = step.capture_all(most_targets_of(rank), lambda n: synthetic_batch(rank, batch, n))
    torch.cuda.empty_cache()  # the warm-ups' side-stream blocks (as graphed_network)
    return step, captured


def synthetic_batch(rank, batch: int, targets: int = auto_batch.PROBE_TARGETS) -> dict:
    """`batch` random images of the step's input type and layout, the fullest carrying `targets` targets."""
    dtype, channels_last = rank.step_input
    return auto_batch.synthetic_batch(batch, int(rank.hyp.imgsz), rank.device, dtype=dtype,
                                      channels_last=channels_last, nc=int(rank.data["nc"]), targets=targets)


def most_targets_of(rank) -> int | None:
    """The most targets one of the rank's training images can carry (captured_step.most_targets), from the plan's
    data check."""
    return most_targets((rank.plan.images.get("train") or {}).get("most_boxes"), rank.hyp)


def graphed_network(rank) -> nn.Module | None:
    """The network with its training forward and backward captured as CUDA graphs (graphed.py), in train mode;
    None when the capture fails and train.cuda_graphs=auto (the network then trains eagerly)."""
    rank.net.train()
    try:
        graphed = capture_network(rank, rank.net, rank.plan.micro_batch)
    except Exception as e:  # a network with host syncs or data-dependent shapes in its forward
        failure = f"CUDA graph capture of the network failed ({type(e).__name__}: {e})"
        if rank.plan.cuda_graphs_required:
            raise RuntimeError(f"{failure}; train without graphs: train.cuda_graphs=false") from e
        rank.log(f"WARNING: {failure}; training eagerly (train.cuda_graphs=auto)")
        return None
    # The capture's eager warm-up left blocks cached for its side stream, which no later step or validation on
    # the training stream can reuse: given back (train.batch_per_device=auto measured the capture's peak).
    torch.cuda.empty_cache()
    filled = rank.sampler.filled
    rank.detail(f"CUDA graphs: forward and backward captured for batches of {rank.plan.micro_batch}"
                + (f"; each epoch's last batch filled with {filled} of the epoch's first images, so that it "
                   "replays them too" if filled else ""))
    return graphed

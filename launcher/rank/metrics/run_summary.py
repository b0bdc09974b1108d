"""The record of a rank (ranks/rank<N>.json) and of the run (summary.json, written by rank 0 from every rank's)."""

from __future__ import annotations

import hashlib
import math
import time

import torch

from launcher.plan.task_rules import rules


def params_digest(net: torch.nn.Module) -> str:
    """SHA-256 of the learnable parameters. BatchNorm running statistics are left out: they are each rank's own after
    its last forward, and only rank 0's are saved."""
    h = hashlib.sha256()
    for k, p in sorted(net.named_parameters()):
        h.update(k.encode())
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def host_cpu_busy(start, end) -> float:
    """Share of all host cores busy between two psutil.cpu_times() readings."""
    total = sum(end) - sum(start)
    idle = (end.idle - start.idle) + (getattr(end, "iowait", 0) - getattr(start, "iowait", 0))
    return 1 - idle / total if total > 0 else 0.0


def torch_memory(device) -> dict:
    """The caching allocator's peaks on a CUDA rank since the run's start (train.batch_per_device=auto: since its
    probe was freed), and the GPU's total: reserved is what the allocator took from the GPU (what an out-of-memory
    error sees; auto fills train.memory_fraction of the total with it), allocated what tensors held; NVML's
    memory_peak_gib adds the CUDA context and other processes."""
    if device.type != "cuda":
        return {"memory_peak_reserved_gib": None, "memory_peak_allocated_gib": None, "memory_total_gib": None,
                "memory_alloc_retries": None}
    gib = 2**30
    return {"memory_peak_reserved_gib": torch.cuda.max_memory_reserved(device) / gib,
            "memory_peak_allocated_gib": torch.cuda.max_memory_allocated(device) / gib,
            "memory_total_gib": torch.cuda.get_device_properties(device).total_memory / gib,
            # the allocator emptied its cache to retry an allocation: memory pressure, and steps stalled by it
            "memory_alloc_retries": torch.cuda.memory_stats(device).get("num_alloc_retries", 0)}


def rank_report(*, rank: int, device, meter, monitor, net, loss_items: dict | None, state, samples=None,
                input_gpu_ms: float | None = None, input_threads: dict | None = None) -> dict:
    m = meter.summary()
    gpus = [vars(g) for g in monitor.stats()] if monitor is not None else []
    return {
        **torch_memory(device),
        "rank": rank,
        "device": str(device),
        "images_per_s": m.images_per_s,
        "data_wait": m.data_wait,  # the GPU idle while the host waited for batches (metrics/meter.py)
        "host_wait": m.host_wait,  # the host's wait for batches in all, the GPU busy or not
        # loader.augment_on=gpu: elapsed on the preparing stream per image, decode to augmented batch (an upper bound
        # of its GPU cost: it includes waits behind the step); None for the CPU input
        "input_gpu_ms_per_image": input_gpu_ms,
        # its threads per batch (rank/run/hooks.py InputTime): waiting for their input, working, blocked ahead of the step
        "input_threads": input_threads or None,
        "steps_measured": m.steps_measured,
        "step_ms": m.step_ms,
        "gpus": gpus,
        "gpu_util": sum(g["util_mean"] for g in gpus) / len(gpus) if gpus else None,
        "memory_peak_gib": max((g["memory_peak_gib"] for g in gpus), default=None),
        "params_sha256": params_digest(net),
        "loss": {k: float(v) for k, v in (loss_items or {}).items()},  # the last step's: a sanity check
        "validated_epochs": list(state.validated_epochs),
        "resumed_from": str(state.resumed_from) if state.resumed_from else None,
        "samples": {str(e): names for e, names in samples.items()} if samples is not None else None,
    }


def task_metrics(task: str, metrics: dict) -> dict:
    """The task's own metrics (TaskRules.own) from Ultralytics' `metrics`, under summary.json's names: a segmentation
    or pose run's mAP beside the boxes' ({"map50_mask": ..., "map50_95_mask": ...}), a classification run's top-1
    and top-5 accuracy ({"top1": ..., "top5": ...}; its mAP fields stay 0)."""
    return {m.key: float(metrics.get(m.source, 0.0)) for m in rules(task).own}


def summary(*, plan, state, epochs: int, reports: list[dict], weights, last, run_dir, started: float) -> dict:
    """summary.json of a finished run: the metrics, the plan's batch and lr, and the ranks' figures combined."""
    metrics = state.metrics or {}
    digests = {r["params_sha256"] for r in reports}
    utils = [r["gpu_util"] for r in reports if r.get("gpu_util") is not None]
    return {
        "status": "finished",
        "map50": float(metrics.get("metrics/mAP50(B)", 0.0)),
        "map50_95": float(metrics.get("metrics/mAP50-95(B)", 0.0)),
        "precision": float(metrics.get("metrics/precision(B)", 0.0)),
        "recall": float(metrics.get("metrics/recall(B)", 0.0)),
        "task": plan.task,
        **task_metrics(plan.task, metrics),
        "headline": rules(plan.task).headline.key,  # the metric the final line leads with (map50; a classifier's top1)
        "epochs_completed": state.epoch + 1,
        "epochs": epochs,
        "validated_epochs": list(state.validated_epochs),
        "best_epoch": state.fitness_epoch,
        "world_size": plan.world_size,
        "mode": plan.mode,
        "backend": plan.backend,
        "device": plan.device,
        "global_batch": plan.global_batch,
        "batch_per_device": plan.batch_per_device,
        "accumulate": plan.accumulate,
        # train.batch_per_device=auto: the rule, the batch the ranks measured and why (rank/step/auto_batch.py)
        "auto_batch": plan.auto_batch or None,
        "lr0": plan.lr0,
        "warmup_iterations": plan.warmup_iterations,
        # ranks run concurrently: their rates add up; None when the run was too short to leave its warm-up steps
        "images_per_s": sum(r["images_per_s"] for r in reports) if all(r["steps_measured"] for r in reports) else None,
        "steps_measured": min(r["steps_measured"] for r in reports),
        "images": plan.images,  # per split: usable and dropped images, and why (the plan's check, inputs/labels.py)
        "data_wait": max(r["data_wait"] for r in reports),  # the worst-fed rank sets the pace
        "host_wait": max((r["host_wait"] for r in reports if r.get("host_wait") is not None), default=None),
        "gpu_util": min(utils) if utils else None,  # the least busy GPU
        **{key: max((r[key] for r in reports if r.get(key) is not None), default=None)  # the fullest GPU
           for key in ("memory_peak_reserved_gib", "memory_peak_allocated_gib", "memory_peak_gib",
                       "memory_alloc_retries")},
        "memory_total_gib": min((r["memory_total_gib"] for r in reports if r.get("memory_total_gib")), default=None),
        "weights": str(weights),
        "last": str(last),
        "run_dir": str(run_dir),
        "resumed": any(r.get("resumed_from") for r in reports),
        "loss_finite": all(math.isfinite(v) for r in reports for v in r["loss"].values()),
        "ranks_params_identical": len(digests) == 1,
        "ranks": [{k: v for k, v in r.items() if k != "samples"} for r in reports],
        "train_minutes": (time.time() - started) / 60,
    }

"""The settings a rank would otherwise work out again from the config, decided once here and carried by LaunchPlan:
the step's precision, the fused optimizer, cuDNN's autotuning, CUDA graphs and what they hold (the fused BatchNorm and
SiLU among it), the validation engine, batch and graphs."""

from __future__ import annotations

from launcher.plan import checks
from launcher.plan.task_rules import rules


def rank_decisions(cfg: dict, *, device: str, mode: str, task: str = "detect") -> dict:
    """LaunchPlan's fields decided from `cfg` for ranks on `device` in `mode` training a `task` model (make_plan's,
    and an older plan.json's missing ones: LaunchPlan.from_dict). The whole step is captured for detection only
    (its loss alone is built sync-free with static shapes: rank/step/captured_step.py)."""
    train, val, fused = cfg["train"], cfg.get("val") or {}, cfg["optim"].get("fused", "auto")
    graphs = checks.uses_cuda_graphs(train, device=device, mode=mode)
    return {
        "amp": train.get("amp", True) if device == "cuda" else False,
        "fused_optimizer": device == "cuda" if fused == "auto" else bool(fused),
        "cudnn_benchmark": device == "cuda" and bool(train.get("cudnn_benchmark", False)),
        "cuda_graphs": graphs,
        "cuda_graphs_required": train.get("cuda_graphs", "auto") is True,
        "graph_scope": "step" if graphs and train.get("graph_scope", "auto") == "auto" and rules(task).fast_paths
        else "network",
        # dist.sync_bn's SyncBatchNorm is never fused: its statistics are the ranks'
        "fused_bn_act": (graphs and device == "cuda" and train.get("fused_bn_act", False) in ("auto", True)
                         and not (cfg.get("dist") or {}).get("sync_bn", False)),
        "val_engine": _val_engine(val, train, task),
        "task": task,
        "val_batch_fixed": _whole(val.get("batch", "auto")),
        "val_cuda_graphs": device == "cuda" and val.get("cuda_graphs", "auto") in ("auto", True),
    }


VAL_BATCH_MOST = 128  # val.batch=auto's ceiling: yolov8s at 640 px fills a large GPU by then; more only costs memory


def val_batch_at(fixed: int | None, micro_batch: int) -> int:
    """val.batch for a training micro-batch: `fixed` (val.batch as a number), or for auto twice the micro-batch
    (Ultralytics' validation batch), at most VAL_BATCH_MOST: with train.batch_per_device=auto the training batch fills
    the memory the fraction allows, and a validation batch twice that (a CUDA graph per image shape, each with its
    memory) would not fit beside it."""
    return fixed if fixed is not None else min(2 * micro_batch, VAL_BATCH_MOST)


def _val_engine(val: dict, train: dict, task: str) -> str:
    """val.engine resolved for the task: `auto` takes the fast engine only where the task's rules measured it ahead
    (TaskRules.auto_fast_validator) and the run's masks overlap, `fast` where the task has it (asked elsewhere, the
    plan refuses it)."""
    r = rules(task)
    asked = (val or {}).get("engine", "auto")
    if r.masks and asked == "auto" and (train.get("extra") or {}).get("overlap_mask") is False:
        return "ultralytics"  # the fast validator keeps overlapping masks only (plan/task_rules.py refuses it asked)
    if r.auto_fast_validator or (r.fast_validator and asked == "fast"):
        return checks.val_engine(val, train)
    return "ultralytics"


def _whole(value) -> int | None:
    """val.batch given as a number; None for auto (and for a value val_problems refuses)."""
    if isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None

"""The plan as a user reads it: one fact per line, printed before anything starts (and by a dry run)."""

from __future__ import annotations

from pathlib import Path

from launcher.inputs import labels
from launcher.inputs.data import DatasetInfo
from launcher.inputs.models import ModelSpec
from launcher.plan import lr
from launcher.plan.batch import AUTO_BATCH_MIN_STEPS, held_fraction
from launcher.plan.plan import LaunchPlan
from launcher.plan.task_rules import rules


def _rendezvous_text(plan: LaunchPlan) -> str:
    rdzv = plan.rendezvous
    if rdzv.kind == "standalone":
        if plan.world_size == 1:
            return "c10d standalone on localhost:0 (one process under torchrun, no process group)"
        return "c10d standalone on localhost:0 (torchrun picks a free port; several jobs per node are fine)"
    if rdzv.kind == "static":
        return f"{rdzv.addr}:{rdzv.port}"
    return (
        "decided in the job: c10d on the allocation's first host, port "
        + (str(rdzv.port) if rdzv.port else "20000 + job id mod 10000")
        + " (one node: localhost:0)"
    )


def describe(plan: LaunchPlan, model: ModelSpec | None, data: DatasetInfo | None, *, cfg: dict | None = None,
             translated: list[str] = ()) -> str:
    """The plan, a fact per line: the Ultralytics keys as they were translated, what trains from what and for how
    long (every time), the topology and batch, the input, the data and the notes."""
    lines = [f"{'translated' if i == 0 else '':<16}{t}" for i, t in enumerate(translated)]
    if model is not None:
        lines.append(f"model           {_model_text(model)}")
    lines.append(f"task            {rules(plan.task).text(plan.task_from, plan.augment_on, plan.val_engine)}")
    if cfg is not None:
        lines.append(f"training        {_training_text(cfg, plan.task)}")
    lines += [
        f"mode            {plan.mode}" + (f" ({plan.backend})" if plan.backend else ""),
        f"topology        {plan.nnodes} node(s) x {plan.nproc_per_node} rank(s) = world size {plan.world_size}"
        + (f", node_rank {plan.node_rank}" if plan.nnodes > 1 else ""),
        "device          "
        + (f"{plan.gpus_per_node} GPU(s) per node, cuda:LOCAL_RANK" if plan.device == "cuda" else "CPU")
        + (f" (CUDA_VISIBLE_DEVICES={plan.env['CUDA_VISIBLE_DEVICES']})" if "CUDA_VISIBLE_DEVICES" in plan.env else ""),
        *batch_lines(plan),
    ]
    lines += [
        f"loader          {plan.workers_per_rank} worker(s) per rank, {plan.threads_per_rank} thread(s) per rank,"
        f" {plan.cpus_per_node} usable core(s)",
        f"input           {_input_text(plan)} (loader.augment_on)",
        f"rendezvous      {_rendezvous_text(plan)}",
        *([f"step            {_step_text(plan)}"] if plan.device == "cuda" else []),
        f"restarts        {plan.max_restarts}; collective timeout {plan.timeout_s} s",
    ]
    if data is not None:
        lines.append(f"data            {data.name}: {data.spec.get('path')} ({_count_text(data)})"
                     + (f" - {data.note}" if data.note else ""))
        lines += [f"data            {line}" for split, check in data.checks.items() for line in labels.describe(split, check)]
    lines += [f"note            {n}" for n in plan.notes]
    return "\n".join(lines)


def _step_text(plan: LaunchPlan) -> str:
    """CUDA graphs, and what they hold where the whole step cannot be captured for the task."""
    if not plan.cuda_graphs:
        return "CUDA graphs off (train.cuda_graphs)"
    fused = "; BatchNorm and SiLU fused in them (train.fused_bn_act)" if plan.fused_bn_act else ""
    if rules(plan.task).fast_paths:
        return f"CUDA graphs on (train.cuda_graphs){fused}"
    return (f"CUDA graphs on, the network's forward and backward only (train.cuda_graphs): the {plan.task} loss runs "
            f"eagerly, its shapes follow the targets{fused}")


def _model_text(model: ModelSpec) -> str:
    arch = Path(model.cfg).name if model.cfg else f"{model.arch or 'the architecture'} (the checkpoint's)"
    return f"{arch}, {model.init_text()}"


def _training_text(cfg: dict, task: str = "detect") -> str:
    train, optim = cfg["train"], cfg["optim"]
    mosaic = ("no mosaic (Ultralytics' classification augmentations)" if not rules(task).mosaic
              else f"mosaic off for the last {train['close_mosaic']}" if train.get("close_mosaic")
              else "mosaic to the end")
    interval = train.get("val_interval", 1)
    val = ("validated every epoch" if interval == 1 else "validated after the last epoch only" if interval == 0
           else f"validated every {interval} epochs")
    return (f"{train['epochs']} epochs at {train['imgsz']} px, {str(optim['name']).upper().replace('ADAMW', 'AdamW')}, "
            f"{mosaic}, {val}")


def lr0_rule(plan: LaunchPlan) -> str:
    """lr0 and the rule that made it: '1.28 = base_lr 0.01 x linear(8192/64)', and the cap when it took over."""
    scaled = f"base_lr {plan.base_lr:g} x {plan.lr_scaling}({plan.global_batch}/{plan.base_batch})"
    uncapped = lr.scaled_lr(plan.base_lr, plan.base_batch, plan.global_batch, plan.lr_scaling)
    if plan.lr0_cap is not None and uncapped > plan.lr0_cap:
        return f"{plan.lr0:.6g} = optim.lr0_cap ({scaled} would be {uncapped:.6g})"
    return f"{plan.lr0:.6g} = {scaled}"


def batch_lines(plan: LaunchPlan) -> list[str]:
    """batch, lr0 and warmup; for train.batch_per_device=auto before the ranks measure it, the rule they follow."""
    devices = plan.devices_per_rank * plan.world_size
    if plan.batch_pending:
        return [f"batch           auto per device x {devices} device(s): {auto_batch_rule(plan.auto_batch)}; chosen on "
                "the GPUs before the first step (train.batch_per_device=auto)",
                f"lr0             base_lr {plan.base_lr:g} x {plan.lr_scaling}(global batch/{plan.base_batch})"
                + (f", at most optim.lr0_cap {plan.lr0_cap:g}" if plan.lr0_cap is not None else "")
                + ", once the batch is chosen",
                "warmup          in steps once the batch is chosen"]
    lines = [
        f"batch           {plan.batch_per_device} per device x {devices} device(s)"
        + (f" x {plan.accumulate} accumulated micro-batches" if plan.accumulate > 1 else "")
        + f" = global batch {plan.global_batch}",
        f"lr0             {lr0_rule(plan)}",
    ]
    if plan.warmup_iterations is not None:
        lines.append(
            f"warmup          {plan.warmup_iterations} steps = {plan.warmup_images} images"
            f" ({plan.warmup_epochs:.3g} epochs of {plan.batches_per_epoch} steps per rank)"
        )
    else:
        lines.append("warmup          in epochs; steps are known once the dataset is counted")
    return lines


def auto_batch_rule(rule: dict) -> str:
    """train.batch_per_device=auto's rule in words (the plan's auto_batch: plan.py, _auto_batch_rule)."""
    text = (f"the largest multiple of {rule['multiple']} whose measured step fits {100 * rule['fraction']:g} % of the "
            "smallest GPU's memory")
    if rule.get("divides"):
        text += f", dividing train.global_batch's {rule['divides']} images per device (accumulate follows)"
    elif rule.get("most"):
        text += (f", at most {rule['most']} (every epoch at least {AUTO_BATCH_MIN_STEPS} steps of a rank's share of the "
                 "training set)")
    if rule.get("eager"):
        text += ", measured on the eager network (train.compile compiles per batch size; its step needs less)"
    return text + f"; the run's memory then held to {100 * held_fraction(rule['fraction']):g} %"


def _count_text(data: DatasetInfo) -> str:
    """'24 train / 8 val images', or with dropped ones '19 of 24 train / 7 of 8 val images usable'."""
    if not data.checks:
        return f"{data.train_images} train / {data.val_images} val images" if data.train_images else "size unknown"
    c = data.checks
    if all(c[s]["usable"] == c[s]["images"] for s in ("train", "val")):
        return f"{c['train']['images']} train / {c['val']['images']} val images"
    return f"{c['train']['usable']} of {c['train']['images']} train / {c['val']['usable']} of {c['val']['images']} val images usable"


def _input_text(plan: LaunchPlan) -> str:
    if plan.augment_on == "cpu":
        return "CPU: Ultralytics' decode and transforms in the workers"
    if plan.device == "cuda" and rules(plan.task).folders:
        return "GPU: the workers read the files, nvJPEG decodes, the device applies the classify transforms"
    if plan.device == "cuda":
        return "GPU: the workers read the files, nvJPEG decodes, one pass augments"
    return "the GPU pipeline's tensor maths, run on the CPU (slow: for tests)"


def input_bound_advice(gpu_input: bool, workers: int | None = None, *, shared_cache: bool = True) -> str:
    """The settings to try when a rank waits for data: one text for the rank's warning and ddp-bench's verdict. The
    GPU input's workers only read file bytes, and train.cache=ram would put a run with loader.augment_on=auto back on
    the CPU pipeline (checks.py), so it gets the node-shared cache of the files' bytes instead, where its task has
    one (`shared_cache`: TaskRules.shared_cache; a classifier's class folders have none)."""
    now = f" (now {workers})" if workers is not None else ""
    if gpu_input and not shared_cache:
        return f"raise loader.workers{now}"
    if gpu_input:
        return (f"set train.cache=shared (the files' bytes mapped once per node) or raise loader.workers{now}; "
                "not train.cache=ram, which needs the CPU pipeline")
    return f"raise loader.workers{now} or set train.cache=ram"


THREAD_WORDS = {"decode": "decode thread (reads the loader's batches, decodes)", "prepare": "augmenting thread"}


def input_thread_bound(threads: dict | None, step_ms: float | None, *, saturated: float = 0.0) -> str | None:
    """Which of the GPU input's threads bounds it, in words, when a rank (or a ddp-bench cell) waits for data: None
    for the loader's workers (input_bound_advice's case), when the decoding thread waits for them longer than it
    works; else the thread that works longest per batch. `threads`: per thread, pipeline.ThreadTime.per_batch_ms.
    `saturated` > 0: only a thread whose work per batch is at least that share of the step (None without a step):
    a loop at less than its data-free ceiling with little data wait is paced by such a thread, not by the CPU."""
    if not threads:
        return None
    first = threads.get("decode") or threads.get("prepare")
    if first["waiting_ms"] is not None and first["waiting_ms"] > (first["working_ms"] or 0.0):
        return None  # the workers: the usual advice
    name, t = max(threads.items(), key=lambda item: item[1]["working_ms"] or 0.0)
    if saturated and (not step_ms or (t["working_ms"] or 0.0) < saturated * step_ms):
        return None
    step = f" against a {step_ms:.0f} ms step" if step_ms else ""
    return (f"the input's {THREAD_WORDS.get(name, name)} bounds it: {t['working_ms']:.0f} ms of work a batch{step}, "
            f"busy {100 * (t['busy'] or 0.0):.0f} % of its time; more loader workers or a cache would not help")

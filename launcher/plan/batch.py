"""The batch a launch trains with, decided once: the per-device batch (a number, `auto` measured on the GPUs, or
Ultralytics' global `batch` split over the devices), the accumulation, the global batch, lr0 and the warmup in steps
(README: "Batch size and learning rate"). make_plan calls these before any rank starts; with_batch on the ranks once
train.batch_per_device=auto is measured."""

from __future__ import annotations

import math

from launcher.plan import checks, lr
from launcher.plan.checks import as_int
from launcher.problems import Problem

AUTO_BATCH_MULTIPLE = 8  # train.batch_per_device=auto chooses a multiple of 8 (Tensor Core tiles, even shards)
AUTO_BATCH_MIN_STEPS = 8  # ... and leaves every epoch this many steps: a batch of most of a small set learns nothing
AUTO_BATCH_ON_CPU = 16  # conf/config.yaml's train.batch_per_device: what auto means without GPU memory to measure
DEFAULT_MEMORY_FRACTION = 0.6  # conf/config.yaml's train.memory_fraction (Ultralytics' batch=-1 fills 60 %)
# of the GPU above train.memory_fraction that a run with the auto batch may reserve (rank/step/auto_batch.py holds
# its allocator there): the validation, the input pipeline and the allocator's fragmentation, which the probe leaves out
AUTO_BATCH_HEADROOM = 0.1


def batch_fields(cfg: dict, batch_per_device: int | None, *, devices_per_rank: int, world_size: int,
                 train_images: int | None, problems: list[Problem], notes: list[str]) -> dict:
    """The plan's fields that follow the per-device batch: accumulate, the batch per rank and the global batch, lr0
    (optim.lr_scaling), and the warmup in steps. make_plan calls it with the configured batch; with_batch on the
    ranks, with the one train.batch_per_device=auto measured (None: every field that needs it is None)."""
    train, optim = cfg["train"], cfg["optim"]
    base_batch = as_int(optim.get("base_batch"), "optim.base_batch", problems, 1) or 1
    base_lr = optim.get("base_lr")
    if not isinstance(base_lr, (int, float)) or isinstance(base_lr, bool) or base_lr <= 0:
        problems.append(Problem(f"optim.base_lr={base_lr!r}: expected a number > 0"))
        base_lr = 0.01
    rule = optim.get("lr_scaling", "linear")
    if not checks.one_of(rule, lr.LR_RULES, "optim.lr_scaling", problems):
        rule = "none"
    cap = optim.get("lr0_cap")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap <= 0):
        problems.append(Problem(f"optim.lr0_cap={cap!r}: expected a number > 0 (the most lr0 may be once scaled), or "
                                "null for no cap"))
        cap = None
    epochs = as_int(train.get("epochs"), "train.epochs", problems, 1) or 1
    per_pass = None if batch_per_device is None else batch_per_device * devices_per_rank * world_size
    accumulate = _accumulate(train, per_pass, problems)
    fields = dict(batch_per_device=batch_per_device, batch_per_rank=None, global_batch=None, base_lr=float(base_lr),
                  base_batch=base_batch, lr_scaling=rule, lr0=None, warmup_epochs=None, warmup_iterations=None,
                  warmup_images=None, batches_per_epoch=None, accumulate=accumulate,
                  lr0_cap=None if cap is None else float(cap))
    if batch_per_device is None:
        return fields
    batch_per_rank = batch_per_device * devices_per_rank * accumulate
    global_batch = batch_per_rank * world_size
    fields.update(accumulate=accumulate, batch_per_rank=batch_per_rank, global_batch=global_batch,
                  lr0=lr.capped(lr.scaled_lr(float(base_lr), base_batch, global_batch, rule), cap))
    if train_images:
        per_rank = math.ceil(train_images / world_size)  # DistributedSampler pads to equal shards
        batches_per_epoch = math.ceil(per_rank / batch_per_rank)
        warmup = lr.warmup_length(
            warmup_epochs=float(optim.get("warmup_epochs", 0.0)),
            warmup_images=optim.get("warmup_images"),
            epochs=epochs,
            batches_per_epoch=batches_per_epoch,
            global_batch=global_batch,
        )
        fields.update(batches_per_epoch=batches_per_epoch, warmup_epochs=warmup.epochs,
                      warmup_iterations=warmup.iterations, warmup_images=warmup.images)
        if train_images < global_batch:
            notes.append(f"the global batch ({global_batch}) is larger than the training set ({train_images} images)")
    return fields


def _auto_batch_rule(train: dict, devices_per_rank: int, world_size: int, train_images: int | None) -> dict:
    """What the ranks measure for train.batch_per_device=auto: the largest multiple of `multiple` whose step fits
    `fraction` of the GPU's memory, dividing `divides` (train.global_batch's share per device: accumulate follows)
    and at most `most` (an AUTO_BATCH_MIN_STEPS-th of a rank's share of the training set, so that each epoch takes
    that many steps: on a small set the largest batch that fits a large GPU would leave the run a step or two per
    epoch, too few to learn anything); None: no bound."""
    fraction = train.get("memory_fraction", DEFAULT_MEMORY_FRACTION)
    wanted, accumulate = train.get("global_batch"), train.get("accumulate", 1)
    divides = wanted // (devices_per_rank * world_size) if _whole(wanted) else None
    most = divides
    if most is None and train_images:
        share = math.ceil(train_images / world_size) // (devices_per_rank * (accumulate if _whole(accumulate) else 1))
        most = max(AUTO_BATCH_MULTIPLE, share // AUTO_BATCH_MIN_STEPS // AUTO_BATCH_MULTIPLE * AUTO_BATCH_MULTIPLE)
    return {"fraction": float(fraction) if checks.is_fraction(fraction) else DEFAULT_MEMORY_FRACTION,
            "multiple": AUTO_BATCH_MULTIPLE, "divides": divides, "most": most,
            "eager": train.get("compile", False) not in (False, None)}  # compiled per shape: measured eagerly


def held_fraction(fraction: float) -> float:
    """The share of the GPU's memory a run with train.batch_per_device=auto is held to once its batch is chosen."""
    return min(1.0, fraction + AUTO_BATCH_HEADROOM)


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _accumulate(train: dict, per_pass: int | None, problems: list[Problem]) -> int | None:
    """Micro-batches per optimizer step: train.accumulate, or train.global_batch / the images of one pass over
    every device (`per_pass`), which must divide it; None while the batch (train.batch_per_device=auto) is not
    measured."""
    accumulate = as_int(train.get("accumulate", 1), "train.accumulate", problems, 1) or 1
    wanted = train.get("global_batch")
    if wanted is None:
        return accumulate
    wanted = as_int(wanted, "train.global_batch", problems, 1)
    if wanted is None:
        return accumulate
    if train.get("accumulate", 1) != 1:
        problems.append(Problem(f"train.global_batch={wanted} and train.accumulate={train['accumulate']}: set one "
                                "(train.global_batch decides accumulate)"))
    elif per_pass is None:
        return None
    elif wanted % per_pass:
        low, high = max(per_pass, wanted // per_pass * per_pass), (wanted // per_pass + 1) * per_pass
        problems.append(Problem(f"train.global_batch={wanted}: not a multiple of the {per_pass} images one pass over "
                                f"every device takes (batch_per_device x devices); use {low} or {high}, or change "
                                "train.batch_per_device"))
    else:
        return wanted // per_pass
    return 1


def per_device_batch(train: dict, *, device: str, devices_per_rank: int, world_size: int,
                     train_images: int | None, problems: list[Problem], notes: list[str]) -> tuple[int | None, dict]:
    """(images per device per pass, or None while train.batch_per_device=auto waits for the GPUs; the auto batch's
    rule, {} for a number). Ultralytics' `batch` (train.batch), when set, decides: the global batch split evenly over
    the devices, or with -1 or a fraction of the GPU's memory, the auto batch."""
    train = ultralytics_batch(train, devices_per_rank * world_size, problems, notes)
    if train.get("batch_per_device") != "auto":
        return as_int(train.get("batch_per_device"), "train.batch_per_device", problems, 1) or 1, {}
    if device == "cpu":  # no GPU memory to measure: the shipped default, said in a note
        notes.append(f"train.batch_per_device=auto measures GPU memory; on the CPU it is {AUTO_BATCH_ON_CPU} (the "
                     "default; set a number to change it)")
        return AUTO_BATCH_ON_CPU, {}
    return None, _auto_batch_rule(train, devices_per_rank, world_size, train_images)


def ultralytics_batch(train: dict, devices: int, problems: list[Problem], notes: list[str]) -> dict:
    """train.* with train.batch (Ultralytics' `batch`) turned into the per-device batch it means: N images per
    optimizer step in all, N / devices on each (Ultralytics' trainer divides it by the world size too); -1: the auto
    batch; a fraction in (0, 1): the auto batch at that share of the GPU's memory. Unchanged when it is null."""
    batch = train.get("batch")
    if batch is None:
        return train
    if train.get("global_batch") is not None or train.get("accumulate", 1) != 1:
        problems.append(Problem(f"train.batch={batch} (Ultralytics' batch: the global batch) with train.global_batch "
                                "or train.accumulate: set one"))
        return train
    if batch == -1:
        return {**train, "batch_per_device": "auto"}
    if isinstance(batch, float) and 0.0 < batch < 1.0:
        return {**train, "batch_per_device": "auto", "memory_fraction": batch}
    if not _whole(batch):
        problems.append(Problem(f"train.batch={batch!r}: expected the global batch (an integer >= 1), -1 for the auto "
                                "batch, or a share of the GPU's memory in (0, 1) for the auto batch at that share"))
        return train
    if batch % devices:
        low, high = batch // devices * devices, (batch // devices + 1) * devices
        problems.append(Problem(f"batch={batch}: the global batch is split evenly over the {devices} device(s); use "
                                + (f"{low} or {high}" if low else f"{high}") + " (or train.batch_per_device=N)"))
        return train
    notes.append(f"batch={batch}: Ultralytics' global batch, {batch // devices} per device on {devices} device(s)")
    return {**train, "batch_per_device": batch // devices}

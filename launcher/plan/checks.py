"""Checks of single config values, each problem worded with the key to change; `check_plan` splits them.

make_plan (plan.py) calls these while it decides; they only read values and return problems, so every problem of a
launch is collected, not just the first.
"""

from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path

from launcher.inputs import ultralytics_files
from launcher.machine.hardware import Hardware
from launcher.plan.environment import BYTECODE_OFF, CUDA_CONNECTIONS, NCCL_DEBUG_LEVELS, TORCH_DEBUG_LEVELS
from launcher.plan.task_rules import rules
from launcher.plan.ultralytics_values import extra_problems
from launcher.problems import Problem

AMP_VALUES = (True, False, "bf16")
CACHE_VALUES = (False, "ram", "disk", "shared")
AUGMENT_ON = ("auto", "cpu", "gpu")
# log.integrations: Ultralytics' settings key -> the package its callbacks need (also its pip name)
INTEGRATIONS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "clearml": "clearml",
                "comet": "comet_ml", "dvc": "dvclive"}
GPU_INPUT_BELOW_CORES = 12  # loader.augment_on=auto: the GPU input for ranks with fewer cores (see augment_on)
GPU_INPUT_FROM_IMGSZ = 512  # ... and at image sizes from this one up, whatever the cores (see augment_on)
GPU_INPUT_UNSUPPORTED = ("copy_paste",)  # Ultralytics strengths the GPU pipeline does not do (it needs polygons)
# (rank/gpu_data/augment_settings.py refuses them too, from this tuple)
OPTIMIZERS = ("sgd", "adamw")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")  # torch.compile's
FUSED_VALUES = ("auto", True, False)
GRAPHS_VALUES = ("auto", True, False)
FALLBACKS = ("none", "dp")  # what mode=auto does when DDP fails to start

def as_int(value, key: str, problems: list[Problem], minimum: int = 0) -> int | None:
    """`value` when it is an integer >= minimum; else None, with the problem added."""
    if isinstance(value, bool) or not isinstance(value, int):
        problems.append(Problem(f"{key}={value!r}: expected an integer >= {minimum}"))
        return None
    if value < minimum:
        problems.append(Problem(f"{key}={value}: must be >= {minimum}"))
        return None
    return value


def one_of(value, allowed: tuple, key: str, problems: list[Problem], what: str | None = None) -> bool:
    if value in allowed:
        return True
    problems.append(Problem(f"{key}={value!r}: expected {what or 'one of ' + ', '.join(map(str, allowed))}"))
    return False


def ultralytics_problems(hw: Hardware, notes: list[str]) -> list[Problem]:
    """The installed Ultralytics must be inside the window the rank side is tested against; outside it, with
    DDP_LAUNCH_ALLOW_ULTRALYTICS=1 (hw.ultralytics_allowed), the refusal becomes a warning among the notes."""
    message = ultralytics_files.version_problem(hw.ultralytics_version)
    if message and hw.ultralytics_allowed and hw.ultralytics_version:
        notes.append("WARNING: " + ultralytics_files.outside_window_warning(hw.ultralytics_version))
        return []
    return [Problem(message, environment=True)] if message else []


def train_problems(train: dict) -> list[Problem]:
    """train.* values other than the batch and the step's speed settings."""
    problems: list[Problem] = []
    one_of(train.get("amp"), AMP_VALUES, "train.amp", problems, "true, false or bf16")
    one_of(train.get("cache"), CACHE_VALUES, "train.cache", problems, "false, ram, disk or shared")
    as_int(train.get("val_interval"), "train.val_interval", problems, 0)  # 0: after the last epoch only
    imgsz = as_int(train.get("imgsz"), "train.imgsz", problems, 32)
    if imgsz and imgsz % 32:
        problems.append(Problem(f"train.imgsz={imgsz}: must be a multiple of 32 (the model's largest stride)"))
    as_int(train.get("close_mosaic"), "train.close_mosaic", problems, 0)
    as_int(train.get("patience"), "train.patience", problems, 1)
    save_period = train.get("save_period", -1)
    if isinstance(save_period, bool) or not isinstance(save_period, int):
        problems.append(Problem(f"train.save_period={save_period!r}: expected an integer (N: keep epochN.pt every N epochs; -1: off)"))
    return problems + extra_problems(train.get("extra") or {})


def unknown_key_problems(cfg: dict, known: dict, prefix: str = "") -> list[Problem]:
    """Keys of `cfg` that no config file of ddp-launch defines (`+train.epoch=3` is accepted by Hydra and would
    silently do nothing), each with the closest known key. `known` is the tree of every key conf/ defines
    (plan/keys.py); below a key whose default is not a mapping with keys (train.extra, bench.variants), anything goes."""
    problems = []
    for key, value in cfg.items():
        name = f"{prefix}{key}"
        if key not in known:
            close = difflib.get_close_matches(name, [f"{prefix}{k}" for k in known], n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}?" if close else f"the keys here are {', '.join(prefix + k for k in known)}"
            problems.append(Problem(f"{name}: not a ddp-launch key; {hint} (ddp-launch --help lists every key)"))
        elif isinstance(value, dict) and isinstance(known[key], dict) and known[key]:
            problems += unknown_key_problems(value, known[key], f"{name}.")
    return problems


def augment_on(loader: dict, train: dict, device: str, cores_per_rank: int, *,
               task: str = "detect") -> tuple[str, str | None]:
    """loader.augment_on resolved to `cpu` (Ultralytics' transforms in the loader's workers) or `gpu` (the workers
    read file bytes, the GPU decodes and augments), and a note when `auto` chose the GPU input or was kept from it.

    `auto` (the default) takes the GPU input on a CUDA rank with fewer than GPU_INPUT_BELOW_CORES cores, or at an
    image size of GPU_INPUT_FROM_IMGSZ or more: with few cores the CPU pipeline starves the GPU, at 640 px the GPU
    input is ahead, at small images the CPU pipeline is (the GPU input's host work shares the training process's
    interpreter); the figures are in docs/benchmarks/README.md, sections 6 and 8. `gpu` on a CPU run runs the same
    tensor maths on the CPU (slow; how CI tests it). Detection follows this rule, measured; a pose, segmentation or
    obb model takes the GPU input when asked (`gpu`), and a classification model its own
    (rank/gpu_data/classify_input.py); `auto` keeps them on the CPU pipeline until the GPU input is measured ahead for
    their task."""
    value = loader.get("augment_on", "auto")
    if value in ("cpu", "gpu"):
        return value, None
    if not rules(task).auto_gpu_input:
        return "cpu", None
    few_cores = cores_per_rank < GPU_INPUT_BELOW_CORES
    large = isinstance(train.get("imgsz"), int) and train["imgsz"] >= GPU_INPUT_FROM_IMGSZ  # a bad one: train_problems
    if value != "auto" or device != "cuda" or not (few_cores or large):  # a wrong value: input_problems
        return "cpu", None
    needs = [setting for setting, _ in cpu_only_settings(train)]
    if needs:
        return "cpu", (f"loader.augment_on=auto: Ultralytics' CPU pipeline, for {', '.join(needs)} (the GPU "
                       f"pipeline does not do it), with {cores_per_rank} core(s) per rank: it may starve the GPU")
    why = (f"{cores_per_rank} core(s) per rank; Ultralytics' CPU pipeline needs about {GPU_INPUT_BELOW_CORES} per GPU "
           "to keep up" if few_cores else f"{train.get('imgsz')} px: at {GPU_INPUT_FROM_IMGSZ} px and more the GPU "
           "decodes and augments faster than the CPU pipeline, whatever the cores")
    return "gpu", f"loader.augment_on=auto: the input on the GPU ({why})"


def cpu_only_settings(train: dict) -> list[tuple[str, str]]:
    """The settings of this run that only Ultralytics' CPU pipeline implements: (setting, what to do instead with
    the input on the GPU)."""
    extra = train.get("extra") or {}
    needs = [(f"train.extra.{key}={extra[key]}", f"the GPU input pipeline does not do {key}; use "
              "loader.augment_on=cpu (Ultralytics' transforms) or set it to 0")
             for key in GPU_INPUT_UNSUPPORTED if extra.get(key)]
    if extra.get("augmentations"):
        needs.append(("train.extra.augmentations", "custom transforms run in Ultralytics' CPU pipeline; use "
                      "loader.augment_on=cpu"))
    if train.get("cache") in ("ram", "disk"):
        needs.append((f"train.cache={train['cache']}", "Ultralytics' caches hold decoded images for its CPU pipeline; "
                      "with the input on the GPU use train.cache=shared (the files' bytes, one copy per node) or "
                      "false, or loader.augment_on=cpu"))
    return needs


def input_problems(loader: dict, train: dict, *, augment_on: str) -> list[Problem]:
    """What the chosen input pipeline cannot do, with the setting that can."""
    problems: list[Problem] = []
    one_of(loader.get("augment_on", "auto"), AUGMENT_ON, "loader.augment_on", problems, "auto, cpu or gpu")
    if augment_on == "gpu":
        problems += [Problem(f"{setting}: {advice}") for setting, advice in cpu_only_settings(train)]
    return problems


VAL_ENGINES = ("auto", "fast", "ultralytics")
FAST_VAL_UNSUPPORTED = ("save_json", "save_txt")  # Ultralytics' validator writes these; the fast engine does not


def val_engine(val: dict, train: dict) -> str:
    """val.engine resolved to `fast` or `ultralytics`: `auto` takes the fast engine unless the run asks Ultralytics'
    validator for files only it writes (train.extra.save_json, save_txt)."""
    value = (val or {}).get("engine", "auto")
    if value == "auto":
        extra = train.get("extra") or {}
        return "ultralytics" if any(extra.get(k) for k in FAST_VAL_UNSUPPORTED) else "fast"
    return value


def val_problems(val: dict, train: dict) -> list[Problem]:
    """val.engine, val.batch, val.cuda_graphs and val.fold_batchnorm; what the fast engine cannot write."""
    problems: list[Problem] = []
    val = val or {}
    if not one_of(val.get("engine", "auto"), VAL_ENGINES, "val.engine", problems, "auto, fast or ultralytics"):
        return problems
    if val.get("batch", "auto") != "auto":
        as_int(val.get("batch"), "val.batch", problems, 1)
    one_of(val.get("cuda_graphs", "auto"), GRAPHS_VALUES, "val.cuda_graphs", problems, "auto, true or false")
    fold = val.get("fold_batchnorm", False)
    if not isinstance(fold, bool):  # 1 == True: one_of would take it
        problems.append(Problem(f"val.fold_batchnorm={fold!r}: expected true or false"))
    extra = train.get("extra") or {}
    if val.get("engine") == "fast":
        problems += [Problem(f"train.extra.{k}=true: the fast validation engine does not write it; use "
                             "val.engine=ultralytics (or auto)") for k in FAST_VAL_UNSUPPORTED if extra.get(k)]
    return problems


def paths_problems(paths: dict) -> list[Problem]:
    """paths.bytecode: auto, null (off) or an absolute folder (the ranks start in the run folder)."""
    setting = paths.get("bytecode", "auto")
    if setting in (*BYTECODE_OFF, "auto") or Path(str(setting)).expanduser().is_absolute():
        return []
    return [Problem(f"paths.bytecode={setting!r}: give auto, null or an absolute folder")]


def integration_problems(log_cfg: dict) -> list[Problem]:
    """log.integrations: known names, each with its package installed on this machine."""
    names = log_cfg.get("integrations") or []
    if isinstance(names, str) or not isinstance(names, (list, tuple)):
        return [Problem(f"log.integrations={names!r}: expected a list, e.g. log.integrations=[tensorboard]")]
    problems = []
    for name in names:
        if name not in INTEGRATIONS:
            problems.append(Problem(f"log.integrations: {name!r} is not one of {', '.join(INTEGRATIONS)}"))
        elif importlib.util.find_spec(INTEGRATIONS[name]) is None:
            package = INTEGRATIONS[name]
            problems.append(Problem(f"log.integrations=[{name}]: the {package} package is not installed: pip install "
                                    f"{package}", environment=True))
    return problems


def uses_cuda_graphs(train: dict, *, device: str, mode: str) -> bool:
    """train.cuda_graphs resolved. `auto` replays the network's step as CUDA graphs wherever it can: a CUDA rank
    driving its own GPU (not DataParallel), the network not compiled (train.compile brings its own graphs)."""
    value = train.get("cuda_graphs", "auto")
    if value == "auto":
        return device == "cuda" and mode != "dp" and train.get("compile", False) in (False, None)
    return value is True


def step_problems(train: dict, optim: dict, *, device: str, mode: str, hw: Hardware) -> list[Problem]:
    """The step's speed settings: train.compile, train.cuda_graphs, train.cudnn_benchmark, train.cuda_connections,
    train.steps_in_flight, optim.fused."""
    problems: list[Problem] = []
    one_of(optim.get("fused", "auto"), FUSED_VALUES, "optim.fused", problems, "auto, true or false")
    in_flight = train.get("steps_in_flight", 1)
    if isinstance(in_flight, bool) or not isinstance(in_flight, int) or in_flight < 0:
        problems.append(Problem(f"train.steps_in_flight={in_flight!r}: expected a whole number >= 0 (0: the host waits "
                                "for the GPU at every step's end; 1: it queues the next step while the GPU runs this one)"))
    one_of(train.get("cuda_graphs", "auto"), GRAPHS_VALUES, "train.cuda_graphs", problems, "auto, true or false")
    one_of(train.get("graph_scope", "auto"), ("auto", "network"), "train.graph_scope", problems, "auto or network")
    if one_of(train.get("fused_bn_act", False), FUSED_VALUES, "train.fused_bn_act", problems, "auto, true or false") \
            and train.get("fused_bn_act") is True and not uses_cuda_graphs(train, device=device, mode=mode):
        problems.append(Problem("train.fused_bn_act=true runs inside the training CUDA graphs, which this run does not "
                                "capture (train.cuda_graphs, the CPU, mode=dp or train.compile): set it to auto or false"))
    if not isinstance(train.get("cudnn_benchmark", False), bool):
        problems.append(Problem(f"train.cudnn_benchmark={train.get('cudnn_benchmark')!r}: expected true or false"))
    connections = train.get("cuda_connections", CUDA_CONNECTIONS)
    if connections is not None and (isinstance(connections, bool) or not isinstance(connections, int)
                                    or not 1 <= connections <= CUDA_CONNECTIONS):
        problems.append(Problem(f"train.cuda_connections={connections!r}: expected a whole number from 1 to "
                                f"{CUDA_CONNECTIONS} (CUDA_DEVICE_MAX_CONNECTIONS), or null for CUDA's default"))
    graphs = train.get("cuda_graphs", "auto") is True  # asked for explicitly; `auto` gives way (uses_cuda_graphs)
    if graphs and mode == "dp":
        problems.append(Problem("train.cuda_graphs=true is not supported with mode=dp; use mode=ddp"))
    value = train.get("compile", False)
    if value is False or value is None:
        return problems
    if value is not True and value not in COMPILE_MODES:
        problems.append(Problem(f"train.compile={value!r}: expected false, true or one of {', '.join(COMPILE_MODES)}"))
        return problems
    if graphs:
        problems.append(
            Problem("train.compile with train.cuda_graphs=true: choose one (train.compile=reduce-overhead compiles the "
                    "network and replays it as CUDA graphs)")
        )
    if mode == "dp":
        problems.append(Problem("train.compile is not supported with mode=dp (DataParallel re-replicates the network "
                                "every step); use mode=ddp"))
    if value in ("reduce-overhead", "max-autotune") and device != "cuda":
        problems.append(Problem(f"train.compile={value} replays CUDA graphs: it needs GPUs; on the CPU use train.compile=default"))
    if device == "cuda" and hw.gpu_count and not hw.triton_available:
        problems.append(
            Problem("train.compile on GPUs needs Triton, which this Python lacks: pip install triton, or train.compile=false",
                    environment=True)
        )
    return problems


def is_fraction(value) -> bool:
    """A number in (0, 1]: train.memory_fraction."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1


def batch_problems(train: dict, *, device: str, mode: str, devices: int, multiple: int) -> list[Problem]:
    """train.memory_fraction, and train.batch_per_device=auto where the ranks cannot measure it (the number itself and
    train.global_batch with a number: plan.py's as_int and _accumulate)."""
    problems: list[Problem] = []
    fraction = train.get("memory_fraction", 0.6)
    if not is_fraction(fraction):
        problems.append(Problem(f"train.memory_fraction={fraction!r}: expected a number in (0, 1], the share of the "
                                "GPU's memory train.batch_per_device=auto fills (0.6: Ultralytics' batch=-1)"))
    if train.get("batch_per_device") != "auto" or device != "cuda":
        return problems  # on the CPU auto is the default batch (a plan note)
    if mode == "dp":
        problems.append(Problem("train.batch_per_device=auto is not supported with mode=dp: DataParallel scatters one "
                                "batch over the node's GPUs and gathers every prediction on the first, so no one GPU's "
                                "step says what fits; use mode=ddp (one rank per GPU), or give train.batch_per_device "
                                "as a number"))
    if (train.get("extra") or {}).get("multi_scale"):
        problems.append(Problem("train.batch_per_device=auto with train.extra.multi_scale: the batch is measured at "
                                "train.imgsz, and multi-scale batches reach 1.5 x that (2.25 x the memory); give "
                                "train.batch_per_device as a number, or leave multi_scale off"))
    wanted = train.get("global_batch")
    if isinstance(wanted, int) and not isinstance(wanted, bool) and wanted > 0 and wanted % (multiple * devices):
        step = multiple * devices
        low, high = max(step, wanted // step * step), (wanted // step + 1) * step
        problems.append(Problem(f"train.global_batch={wanted} with train.batch_per_device=auto: the batch is chosen as a "
                                f"multiple of {multiple} that divides the global batch's share of each of the "
                                f"{devices} device(s), so the global batch must be a multiple of {step}; use {low} or "
                                f"{high}"))
    return problems


def optim_problems(optim: dict) -> list[Problem]:
    problems: list[Problem] = []
    if str(optim.get("name", "")).lower() not in OPTIMIZERS:
        problems.append(
            Problem(
                f"optim.name={optim.get('name')!r}: expected sgd or adamw "
                "(Ultralytics' `auto` picks its own optimizer and ignores lr0)"
            )
        )
    return problems


def dist_problems(dist: dict, *, device: str, mode: str) -> list[Problem]:
    """The NCCL and torch.distributed toggles, the fallback and SyncBatchNorm."""
    problems: list[Problem] = []
    nccl_debug = (dist.get("nccl") or {}).get("debug")
    if nccl_debug is not None:
        one_of(nccl_debug, NCCL_DEBUG_LEVELS, "dist.nccl.debug", problems, "null or one of " + ", ".join(NCCL_DEBUG_LEVELS))
    one_of(str(dist.get("torch_debug", "OFF")), TORCH_DEBUG_LEVELS, "dist.torch_debug", problems)
    one_of(dist.get("fallback", "none"), FALLBACKS, "dist.fallback", problems)
    if dist.get("sync_bn") and device == "cpu" and mode == "ddp":
        problems.append(Problem("dist.sync_bn=true needs GPUs (torch's SyncBatchNorm has no CPU kernel)"))
    return problems


def check_plan(problems: list[Problem], *, dry_run: bool) -> tuple[list[Problem], list[Problem]]:
    """Split problems into (errors, warnings). A dry run shows the plan despite problems about this machine."""
    if dry_run:
        return [p for p in problems if not p.environment], [p for p in problems if p.environment]
    return list(problems), []

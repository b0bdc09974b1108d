"""Ultralytics' training keys as a YOLO user types them, turned into ddp-launch's overrides before Hydra composes.

`yolo detect train data=my.yaml model=yolov8n.pt epochs=100 imgsz=640 batch=64 device=0,1` works as
`ddp-launch data=my.yaml model=yolov8n.pt epochs=100 imgsz=640 batch=64 device=0,1`, with Ultralytics' meaning:
`translate(argv)` rewrites each `key=value` whose key is Ultralytics' (its cfg/default.yaml) into the override(s)
that mean the same here, and returns what it did, for the plan to show (`epochs=3 -> train.epochs=3`). Hydra's own
syntax passes as typed (`train.epochs=3`, `+experiment=coco`, `-m`), and a sweep keeps working because the value's
text is kept (`-m lr0=0.01,0.02` -> `-m optim.base_lr=0.01,0.02`). A key that cannot apply here is refused with the
key to use; a key that is nobody's is refused with the closest one, before Hydra says `+key` would add it.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from launcher.inputs import ultralytics_files
from launcher.inputs.model_task import TRAINED
from launcher.plan.keys import conf_dir, known_keys
from launcher.problems import Problem

# Ultralytics key -> the ddp-launch key with the same meaning; the value passes as typed.
RENAMED = {
    "epochs": "train.epochs",
    "imgsz": "train.imgsz",
    "batch": "train.batch",  # the global batch, split over the devices (plan.py); -1 or a fraction: the auto batch
    "patience": "train.patience",
    "close_mosaic": "train.close_mosaic",
    "save_period": "train.save_period",
    "plots": "train.plots",
    "compile": "train.compile",
    "workers": "loader.workers",
    "lr0": "optim.base_lr",  # lr0 at a global batch of optim.base_batch (64, Ultralytics' nbs), scaled from there
    "lrf": "optim.lrf",
    "momentum": "optim.momentum",
    "weight_decay": "optim.weight_decay",
    "warmup_epochs": "optim.warmup_epochs",
    "warmup_momentum": "optim.warmup_momentum",
    "warmup_bias_lr": "optim.warmup_bias_lr",
    "cos_lr": "optim.cos_lr",
    "verbose": "log.verbose",
}
# Ultralytics keys that have no meaning here, and what to use instead.
REFUSED = {
    "time": "train the number of epochs you want with epochs=N (ddp-launch has no time budget)",
    "rect": "rectangular batches cannot be shuffled across ranks; ddp-launch trains square batches",
    "nbs": "ddp-launch scales lr0 from optim.base_batch instead of accumulating up to nbs (README: batch and "
           "learning rate); set optim.base_batch=N",
    "save_dir": "choose the run folder with project=DIR name=NAME (or hydra.run.dir=PATH)",
    "save": "ddp-launch always writes its checkpoints (weights/last.pt, best.pt)",
    "cfg": "add a recipe with +experiment=NAME, or point Hydra at your own configs with --config-dir DIR",
}
# Ultralytics train arguments ddp-launch sets from its own keys (train.extra may not pass them): the key to use.
# train.extra refuses these, REFUSED's keys, and mode and task (what this launcher does, and the model's task).
OWNED = {**RENAMED, "model": "model=...", "data": "data=...", "device": "device=0,1 (or gpus=N)", "optimizer": "optim.name",
         "amp": "train.amp", "cache": "train.cache", "val": "train.val_interval", "seed": "seed", "resume": "resume",
         "project": "hydra.run.dir (or project=DIR name=NAME)", "name": "hydra.run.dir (or project=DIR name=NAME)",
         "exist_ok": "hydra.run.dir", "pretrained": "model.weights"}
SAME_HERE = ("seed",)  # ddp-launch's own key of the same name and meaning
NOT_TRAINING = ("Predict settings", "Visualize settings", "Export settings", "Tracker settings", "Custom config.yaml")
GROUPS = ("model", "data", "launcher", "bench", "experiment")
MODES = ("val", "predict", "export", "track", "benchmark")  # Ultralytics' other modes (mode=train is what this does)
OPTIMIZERS = {"sgd": "sgd", "adamw": "adamw"}
AMP = {"true": "true", "fp16": "true", "false": "false", "fp32": "false", "bf16": "bf16"}
CACHE = {"true": "ram", "ram": "ram", "false": "false", "disk": "disk", "shared": "shared"}
TRUE, FALSE = ("true", "1", "yes"), ("false", "0", "no")
# Hydra's flags that take the next word as their value
FLAGS_WITH_VALUE = ("--cfg", "-c", "--package", "-p", "--info", "-i", "--config-path", "-cp", "--config-name", "-cn",
                    "--config-dir", "-cd", "--experimental-rerun", "--shell-completion", "-sc")
OVERRIDE = re.compile(r"^(?P<prefix>\+{0,2})(?P<key>[A-Za-z_][\w.]*)(?P<pkg>@[\w.]*)?(?:=(?P<value>.*))?$", re.S)
SWEEP_FUNCTIONS = ("choice(", "range(", "glob(", "interval(", "tag(", "sort(", "shuffle(")


@dataclass
class Translation:
    argv: list[str]  # what Hydra gets
    shown: list[str] = field(default_factory=list)  # "epochs=3 -> train.epochs=3", one per translated key
    problems: list[Problem] = field(default_factory=list)  # keys that cannot apply, each with what to type


def group_options(group: str) -> list[str]:
    """The shipped options of a config group (conf/<group>/*.yaml)."""
    return sorted(p.stem for p in (Path(conf_dir()) / group).glob("*.yaml"))


def ultralytics_training_keys() -> dict[str, bool]:
    """{key: whether it is a training key} for every key of Ultralytics' cfg/default.yaml: predict, visualize, export
    and tracker settings are not."""
    sections = ultralytics_files.default_arg_sections()
    return {key: section not in NOT_TRAINING for key, section in sections.items()}


def translate(argv: list[str], *, multirun: bool | None = None, exists: Callable[[Path], bool] = Path.exists,
              now: Callable[[], str] | None = None) -> Translation:
    """`argv` with Ultralytics' keys in ddp-launch's terms. `exists` decides whether a run folder is taken (project,
    name); `now` is the folder's time stamp when project is given without name (default: Hydra's own)."""
    multirun = any(a in ("-m", "--multirun") for a in argv) if multirun is None else multirun
    out = Translation(argv=[])
    folder: dict[str, str] = {}
    skip_next = False
    for arg in argv:
        match = None if skip_next or arg.startswith("-") else OVERRIDE.match(arg)
        skip_next = arg in FLAGS_WITH_VALUE
        if match is None:
            out.argv.append(arg)
            continue
        prefix, key, value = match["prefix"], match["key"], match["value"]
        if key in ("project", "name", "exist_ok") and value is not None and not match["pkg"]:
            folder[key] = value
            continue
        out.argv += _translate_one(arg, prefix, key, match["pkg"], value, multirun, out)
    if folder:
        out.argv += _run_folder(folder, multirun, exists, now, out)
    return out


def _translate_one(arg: str, prefix: str, key: str, pkg: str | None, value: str | None, multirun: bool,
                   out: Translation) -> list[str]:
    """The overrides for one typed `key=value` (or a bare `resume`)."""
    if value is None:
        if key == "resume":
            return _shown(out, arg, ["resume=true"])
        return [arg]  # Hydra says what is wrong with it
    if pkg or "." in key:
        return _dotted(arg, prefix, key, value, out)
    known = known_keys()
    if key in GROUPS:
        return _group(arg, prefix, key, value, multirun, out)
    if key == "device":
        return _device(arg, value, out)
    if key == "val" and value.strip("'\"").lower() in TRUE + FALSE:  # Ultralytics' switch; val.* are ddp-launch's
        return _ultralytics_key(arg, key, value, out)
    if key in known or key == "hydra":
        if key == "mode" and value.lower() == "train":
            return _shown(out, arg, [], "ddp-launch always trains")
        if key == "mode" and value in MODES:
            out.problems.append(Problem(f"mode={value}: ddp-launch trains; run `yolo {value}` with the weights it "
                                        "writes (mode here picks auto, ddp, dp or single)"))
            return []
        return [arg]
    training = ultralytics_training_keys()
    if key not in training:
        out.problems.append(Problem(_unknown(key, training)))
        return []
    if key in REFUSED:
        out.problems.append(Problem(f"{key}={value}: not used by ddp-launch; {REFUSED[key]}"))
        return []
    if not training[key]:
        out.problems.append(Problem(f"{key}={value}: an Ultralytics predict/export setting, not a training key; "
                                    "use `yolo predict` or `yolo export` with the weights ddp-launch writes"))
        return []
    return _ultralytics_key(arg, key, value, out)


def _ultralytics_key(arg: str, key: str, value: str, out: Translation) -> list[str]:
    low = value.strip().strip("'\"").lower()
    if key in RENAMED:
        return _shown(out, arg, [f"{RENAMED[key]}={value}"])
    if key == "optimizer":
        if low not in OPTIMIZERS:
            why = ("picks AdamW or MuSGD and its own lr0 from the dataset and run length, ignoring lr0" if low == "auto"
                   else "is not one ddp-launch trains with")
            out.problems.append(Problem(f"optimizer={value}: Ultralytics' {value} {why}; use optimizer=SGD or "
                                        "optimizer=AdamW (with lr0=...)"))
            return []
        return _shown(out, arg, [f"optim.name={OPTIMIZERS[low]}"])
    if key == "amp":
        if low not in AMP:
            out.problems.append(Problem(f"amp={value}: expected true (fp16), bf16 or false"))
            return []
        return _shown(out, arg, [f"train.amp={AMP[low]}"])
    if key == "cache":
        if low not in CACHE:
            out.problems.append(Problem(f"cache={value}: expected ram (or true), disk, shared or false"))
            return []
        return _shown(out, arg, [f"train.cache={CACHE[low]}"])
    if key == "val":
        if low in TRUE:
            return _shown(out, arg, [], "validation every epoch is the default (train.val_interval)")
        return _shown(out, arg, ["train.val_interval=0"], "validated after the last epoch only")
    if key == "pretrained":
        if low in TRUE + FALSE:
            return _shown(out, arg, [f"model.pretrained={'true' if low in TRUE else 'false'}"])
        return _shown(out, arg, [f"model.weights={_quoted(value)}"])
    if key == "task":
        if low in TRAINED:
            return _shown(out, arg, [], "the task follows from the model (its YAML's head or its name)")
        out.problems.append(Problem(f"task={value}: ddp-launch trains {', '.join(TRAINED)} models, the task following "
                                    "from the model; drop task="))
        return []
    return _shown(out, arg, [f"++train.extra.{key}={value}"])  # passed to Ultralytics' trainer as typed


def _group(arg: str, prefix: str, key: str, value: str, multirun: bool, out: Translation) -> list[str]:
    """model=, data= as Ultralytics reads them (a .pt, a .yaml, a path); other groups: a shipped option."""
    options = group_options(key)
    choices = _choices(value, multirun)
    if all(c in options for c in choices) or any(value.startswith(f) for f in SWEEP_FUNCTIONS):
        return [arg]
    if key == "model":
        return _model(arg, prefix, choices, options, out)
    if key == "data":
        return _shown(out, arg, [f"{prefix}data=custom", f"data.path={','.join(_quoted(c) for c in choices)}"])
    close = difflib.get_close_matches(value, options, n=1)
    out.problems.append(Problem(f"{key}={value}: no such option; the options are {', '.join(options)}"
                                + (f" (did you mean {key}={close[0]}?)" if close else "")))
    return []


def _model(arg: str, prefix: str, choices: list[str], options: list[str], out: Translation) -> list[str]:
    """A .pt: fine-tune from those weights (the architecture is theirs); a .yaml: that architecture from scratch (a
    shipped family and size is the model group of that name)."""
    kinds = {"weights" if c.endswith(".pt") else "yaml" if c.endswith((".yaml", ".yml")) else "name" for c in choices}
    if kinds == {"weights"}:
        return _shown(out, arg, [f"{prefix}model=checkpoint",
                                 f"model.weights={','.join(_quoted(c) for c in choices)}"])
    if kinds == {"yaml"}:
        stems = [Path(c).stem for c in choices]
        if all("/" not in c and s in options for c, s in zip(choices, stems)):
            return _shown(out, arg, [f"{prefix}model={','.join(stems)}"])
        return _shown(out, arg, [f"{prefix}model=custom", f"model.cfg={','.join(_quoted(c) for c in choices)}"])
    bad = next(c for c in choices if not c.endswith((".pt", ".yaml", ".yml")) or len(kinds) > 1)
    close = difflib.get_close_matches(bad, options, n=1)
    out.problems.append(Problem(
        f"model={bad}: not a model here. Type a name (yolov8n, yolo11s, ...: its architecture, from scratch), "
        f"an architecture YAML (yolov8n.yaml) or weights to fine-tune from (yolov8n.pt)"
        + (f"; did you mean model={close[0]}?" if close else "")))
    return []


def _device(arg: str, value: str, out: Translation) -> list[str]:
    """Ultralytics' device: 0, 0,1, [0,1], cuda:0, cpu. A comma list is one list of GPUs, never a sweep."""
    text = value.strip().strip("'\"").lower().replace("cuda:", "").replace(" ", "")
    if text in ("", "null", "none"):
        return [arg]
    if text == "cpu":
        return _shown(out, arg, ["device=cpu"]) if value != "cpu" else [arg]
    items = text.strip("[]").split(",")
    if not all(i.isdigit() for i in items):
        hint = ("-1 (the idlest GPU) is not supported; name the GPUs, e.g. device=0,1, or their number with gpus=N"
                if "-1" in items else "expected GPU indices (device=0 or device=0,1) or device=cpu")
        out.problems.append(Problem(f"device={value}: {hint}"))
        return []
    became = f"device=[{','.join(str(int(i)) for i in items)}]"
    return [became] if became == arg else _shown(out, arg, [became])


def _dotted(arg: str, prefix: str, key: str, value: str, out: Translation) -> list[str]:
    """A ddp-launch key typed with its dots: passed as typed, except that a key nobody defines is refused here with
    the closest one (Hydra would suggest `+key`, which the plan refuses), and train.extra.K needs no `+`."""
    if key.startswith("hydra."):
        return [arg]
    if key.startswith("train.extra.") and not prefix:
        return _shown(out, arg, [f"++{arg}"])
    node, parts = known_keys(), key.split(".")
    for i, part in enumerate(parts):
        if node is None:
            return [arg]  # below a key of free values (train.extra, bench.variants): Hydra and the plan check it
        if not isinstance(node, dict) or part not in node:
            if prefix:
                return [arg]  # `+key=`: composed, then refused by the plan's unknown-key check with the same advice
            out.problems.append(Problem(_unknown(key, ultralytics_training_keys())))
            return []
        node = node[part]
    return [arg]


def _run_folder(folder: dict[str, str], multirun: bool, exists, now, out: Translation) -> list[str]:
    """project/name/exist_ok as Ultralytics reads them: the run folder is PROJECT/NAME (project: runs), made NAME2,
    NAME3, ... when it exists, unless exist_ok=true. Without name, a time-stamped folder inside PROJECT."""
    typed = " ".join(f"{k}={v}" for k, v in folder.items())
    project = folder.get("project", "runs").strip("'\"") or "runs"
    name = folder.get("name", "").strip("'\"")
    exist_ok = folder.get("exist_ok", "false").strip("'\"").lower() in TRUE
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    if not name:
        stamp = now() if now else "${now:%Y-%m-%d}/${now:%H-%M-%S-%f}"
        return _shown(out, typed, [f"{key}={_quoted(str(Path(project) / stamp))}"])
    path = Path(project) / name
    if not exist_ok:
        n = 2
        while exists(path):
            path, n = Path(project) / f"{name}{n}", n + 1
    return _shown(out, typed, [f"{key}={_quoted(str(path))}"])


def _choices(value: str, multirun: bool) -> list[str]:
    """The values a typed value stands for: in a sweep, each of a comma list (outside brackets and quotes)."""
    if not multirun:
        return [value]
    parts, depth, quote, current = [], 0, "", ""
    for ch in value:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(current)
            current = ""
            continue
        current += ch
    return [p.strip() for p in parts + [current]]


def _quoted(value: str) -> str:
    """`value` as one Hydra string, whatever it holds (spaces, `=`, `:`, non-ASCII letters of a path)."""
    value = value.strip()
    if len(value) > 1 and value[0] == value[-1] and value[0] in "'\"":
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _unknown(key: str, ultralytics: dict[str, bool]) -> str:
    candidates = sorted(set(_dotted_keys(known_keys())) | {k for k, training in ultralytics.items() if training})
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    return (f"{key}: not a ddp-launch key nor an Ultralytics training key"
            + (f"; did you mean {close[0]}?" if close else "") + " (ddp-launch --help lists every key)")


def _dotted_keys(tree: dict | None, prefix: str = "") -> list[str]:
    keys = []
    for k, sub in (tree or {}).items():
        keys.append(prefix + k)
        if isinstance(sub, dict):
            keys += _dotted_keys(sub, f"{prefix}{k}.")
    return keys


def _shown(out: Translation, typed: str, became: list[str], why: str = "") -> list[str]:
    out.shown.append(f"{typed} -> {' '.join(became) if became else '(nothing)'}" + (f" ({why})" if why else ""))
    return became

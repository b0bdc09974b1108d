"""Ultralytics train arguments passed through train.extra, and the optimizer's values the ranks hand Ultralytics,
checked in the plan as Ultralytics' check_cfg would check them in every rank, so that a wrong value is refused before
any process starts."""

from __future__ import annotations

import difflib
import math

from launcher.inputs import ultralytics_files
from launcher.plan.ultralytics_keys import OWNED, REFUSED
from launcher.problems import Problem


def extra_problems(extra: dict) -> list[Problem]:
    """train.extra passes Ultralytics train arguments through, except the ones ddp-launch sets itself; each value
    is checked as Ultralytics' check_cfg would check it in every rank."""
    known = ultralytics_files.default_train_args()
    problems = []
    for key, value in extra.items():
        if key in REFUSED:
            problems.append(Problem(f"train.extra.{key}: {REFUSED[key]}"))
        elif key in ("mode", "task"):
            problems.append(Problem(f"train.extra.{key}: ddp-launch trains, with the task of its model"))
        elif key in OWNED:
            problems.append(Problem(f"train.extra.{key}: ddp-launch sets this itself; use {OWNED[key]}"))
        elif key not in known:
            close = difflib.get_close_matches(key, list(known), n=1)
            problems.append(Problem(f"train.extra.{key}: not an Ultralytics train argument"
                                    + (f"; did you mean train.extra.{close[0]}?" if close else "")))
        else:
            wrong = ultralytics_value_problem(key, value, known[key])
            if wrong:
                problems.append(Problem(f"train.extra.{key}={value!r}: {wrong}"))
    return problems


# optim.* -> the Ultralytics train argument the ranks give it as (rank/ultralytics/build.py, hyperparameters)
OPTIM_ARGUMENTS = {"momentum": "momentum", "weight_decay": "weight_decay", "lrf": "lrf",
                   "warmup_bias_lr": "warmup_bias_lr", "warmup_momentum": "warmup_momentum"}


def optimizer_problems(optim: dict, batch: dict) -> list[Problem]:
    """optim.* values as Ultralytics checks them (momentum, weight_decay, lrf and the warmup's in [0, 1]), and lr0 as
    scaled for the planned global batch (`batch`: plan/batch.py's fields), with the rule that made it."""
    known = ultralytics_files.default_train_args()
    problems = []
    for key, argument in OPTIM_ARGUMENTS.items():
        wrong = ultralytics_value_problem(argument, optim.get(key), known.get(argument))
        if wrong:
            problems.append(Problem(f"optim.{key}={optim.get(key)!r}: {wrong} (Ultralytics refuses it in every rank)"))
    lr0 = batch.get("lr0")
    limit = 1.0  # CFG_FRACTION_KEYS holds lr0: check_cfg refuses it above 1
    if lr0 is not None and lr0 > limit:
        sqrt = batch["base_lr"] * math.sqrt(batch["global_batch"] / batch["base_batch"])
        advice = (f"optim.lr_scaling=sqrt (lr0 {sqrt:.3g} here), " if batch["lr_scaling"] == "linear" and sqrt <= limit
                  else "")
        problems.append(Problem(
            f"lr0 {lr0:.4g} = base_lr {batch['base_lr']:g} x {batch['global_batch']}/{batch['base_batch']} by "
            f"optim.lr_scaling={batch['lr_scaling']}: Ultralytics refuses an lr0 above {limit:g}, and every rank would "
            f"stop at its start; use {advice}a cap such as optim.lr0_cap=0.1, or a smaller optim.base_lr"))
    return problems


def ultralytics_value_problem(key: str, value, default) -> str | None:
    """What Ultralytics' check_cfg (ultralytics/cfg/__init__.py, 8.4.190) raises for `key=value`, in words; its type
    tables are read from that file (inputs/ultralytics_files.py), its rules follow it branch by branch."""
    rules = ultralytics_files.cfg_type_rules()
    number = isinstance(value, (int, float))  # Ultralytics' FLOAT_OR_INT (a bool is an int there too)
    typed = set().union(*(rules[t] for t in ("CFG_FLOAT_KEYS", "CFG_FRACTION_KEYS", "CFG_INT_KEYS", "CFG_BOOL_KEYS",
                                             "CFG_STR_KEYS")), {"scale", "compile"})
    if value is None:
        return "must not be null" if default is not None and key in typed and key != "auto_augment" else None
    if key in rules["CFG_FLOAT_KEYS"]:
        return None if number else "expected a number"
    if key == "scale":
        if isinstance(value, (list, tuple)):
            ok = len(value) == 2 and all(isinstance(x, (int, float)) for x in value)
            return None if ok else "expected a number in [0, 1] or a pair of numbers"
        return None if number and 0.0 <= value <= 1.0 else "expected a number in [0, 1] or a pair of numbers"
    if key == "fraction":
        if isinstance(value, list):
            ok = len(value) in (2, 3) and all(value[:2]) and all(
                (type(x) is int and x >= 0) or (type(x) is float and 0.0 <= x <= 1.0) for x in value)
            return None if ok else "expected [train, val] or [train, val, test] counts or ratios"
        ok = number and not isinstance(value, bool) and (0.0 < value <= 1.0 or (isinstance(value, int) and value > 1))
        return None if ok else "expected a ratio in (0, 1] or a count of images > 1"
    if key in rules["CFG_FRACTION_KEYS"]:
        return None if number and 0.0 <= value <= 1.0 else "expected a number between 0.0 and 1.0"
    if key in rules["CFG_INT_KEYS"]:
        integral = isinstance(value, float) and value.is_integer() and ultralytics_files.integral_floats_are_integers()
        if not isinstance(value, int) and not integral:
            return "expected an integer"
        least = rules["CFG_INT_MIN"].get(key)
        return f"must be >= {least}" if least is not None and value < least else None
    if key in rules["CFG_BOOL_KEYS"]:
        return None if isinstance(value, bool) else "expected true or false"
    if key in rules["CFG_STR_KEYS"]:
        return None if isinstance(value, str) else "expected a string"
    if key == "compile":
        return None if isinstance(value, (bool, str)) else "expected true, false or a torch.compile mode"
    return None

"""`bench.variants` ({NAME: [key=value, ...]}): named sets of config overrides, each run beside the defaults in one
invocation, for either kind of benchmark (a throughput cell per variant, or a time-to-model side per variant).

Everything about a variant is checked before anything runs: its shape here, and its overrides against the launch
config (an unknown key with the closest known one, a bad value), so that a typo in the last variant does not cost the
cells or sides before it.
"""

from __future__ import annotations

import copy
import re

from omegaconf import OmegaConf

from launcher.plan.plan import make_plan
from launcher.problems import PlanError, Problem

NAME = re.compile(r"[A-Za-z0-9_]+")  # it names cells, sides and their folders
EXAMPLE = "'bench.variants={folded:[\"val.fold_batchnorm=true\"]}'"


def shape_problems(variants) -> list[str]:
    """{NAME: [key=value, ...]}, NAME letters, digits and underscores."""
    if not variants:
        return []
    if not isinstance(variants, dict):
        return [f"bench.variants={variants!r}: expected {{name: [key=value, ...]}}, e.g. {EXAMPLE}"]
    out = []
    for name, overrides in variants.items():
        if not NAME.fullmatch(str(name)):
            out.append(f"bench.variants: {name!r}: a variant's name is letters, digits and underscores")
        if not isinstance(overrides, list) or not all(isinstance(o, str) and "=" in o for o in overrides):
            out.append(f"bench.variants.{name}={overrides!r}: expected a list of key=value overrides")
    return out


def plan_problems(cfg: dict, hw, data, on_gpu: bool, task: str = "detect") -> list[Problem]:
    """What each variant adds to a one-device launch's plan problems for a `task` model: a bad value, an unknown key
    with the closest known one, or a path the task lacks. The problems the shared config has already are the
    caller's, and not repeated per variant."""
    side = {**cfg, "gpus": 1 if on_gpu else 0}
    base = {p.message for p in make_plan(side, hw, data, task=task)[1]}
    out = []
    for name, overrides in (cfg["bench"].get("variants") or {}).items():
        try:  # not in struct mode: the plan names an unknown key, with the closest known one
            varied = OmegaConf.merge(OmegaConf.create(copy.deepcopy(side)), OmegaConf.from_dotlist(list(overrides)))
        except Exception as e:  # noqa: BLE001 - an override OmegaConf cannot read
            out.append(Problem(f"bench.variants.{name}: {e}"))
            continue
        out += [Problem(f"bench.variants.{name}: {p.message}")
                for p in make_plan(OmegaConf.to_container(varied, resolve=True), hw, data, task=task)[1]
                if p.message not in base]
    return out


def apply(cfg: dict, overrides: list[str]) -> dict:
    """cfg with a variant's `key=value` overrides (Hydra's syntax for plain values), each replacing the shared value.
    plan_problems has vetted them; struct mode still refuses an unknown key here (train.extra takes any Ultralytics
    argument)."""
    base = OmegaConf.create(copy.deepcopy(cfg))
    OmegaConf.set_struct(base, True)
    OmegaConf.set_struct(base.train.extra, False)
    try:
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist(list(overrides)))
    except Exception as e:  # noqa: BLE001 - reached only if plan_problems was skipped
        raise PlanError([Problem(f"bench.variants {overrides}: {e}")]) from e
    return OmegaConf.to_container(merged, resolve=True)

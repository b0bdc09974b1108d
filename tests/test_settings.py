"""The ranks read typed settings made once from the config (launcher/plan/settings.py): their defaults are the shipped
config's, every key of a group the ranks read is a field, and no module under launcher/rank/ reads the raw config."""

from __future__ import annotations

import ast
import functools
from dataclasses import MISSING, asdict, fields, is_dataclass
from pathlib import Path

import yaml

from launcher.plan import settings as s
from tests.conftest import REPO, compose_config

RANK = REPO / "launcher" / "rank"
GROUPS = {"train": s.TrainSettings, "val": s.ValSettings, "optim": s.OptimSettings, "loader": s.LoaderSettings,
          "dist": s.DistSettings, "log": s.LogSettings, "debug": s.DebugSettings}
# Dicts under launcher/rank/ whose keys happen to share a config key's name: (module file, the dict's name) -> what it
# is (a file name is unique in the package, wherever its folder)
NOT_CONFIG = {
    ("faults.py", "fields"): "a fault of DDP_LAUNCH_FAULTS (rank, kind, step, attempt)",
    ("step_profile.py", "e"): "an event of torch.profiler's trace (name, cat, tid)",
}


def default_of(f):
    value = f.default_factory() if f.default_factory is not MISSING else f.default
    return asdict(value) if is_dataclass(value) else value


def shipped(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def test_the_settings_defaults_are_the_shipped_configs():
    root = shipped(REPO / "conf" / "config.yaml")
    wrong = []
    for group, cls in GROUPS.items():
        yaml_keys, field_names = set(root[group]), {f.name for f in fields(cls)}
        wrong += [f"{group}.{k}: in conf/config.yaml, not in {cls.__name__}" for k in yaml_keys - field_names]
        wrong += [f"{group}.{k}: in {cls.__name__}, not in conf/config.yaml" for k in field_names - yaml_keys]
    checked = [*((g, c, root[g]) for g, c in GROUPS.items()), ("model", s.ModelSettings, root["model"]),
               ("paths", s.PathsSettings, root["paths"]),
               ("bench", s.BenchSettings, shipped(REPO / "conf" / "bench" / "default.yaml"))]
    for group, cls, values in checked:
        for f in fields(cls):
            shown = values.get(f.name, default_of(f))
            if not (isinstance(shown, str) and "${" in shown) and default_of(f) != shown:
                wrong.append(f"{group}.{f.name}: {cls.__name__} says {default_of(f)!r}, the config {shown!r}")
    top = {f.name: default_of(f) for f in fields(s.Settings) if f.name in ("seed", "gpus")}
    wrong += [f"{k}: Settings says {v!r}, conf/config.yaml {root[k]!r}" for k, v in top.items() if root[k] != v]
    assert not wrong, "\n".join(wrong)


def test_the_settings_hold_the_composed_config():
    cfg = compose_config(["train.patience=7", "optim.grad_clip=3.0", "loader.pin_memory=false", "seed=5"])
    settings = s.Settings.of(cfg)
    assert (settings.train.patience, settings.optim.grad_clip, settings.loader.pin_memory, settings.seed) == (
        7, 3.0, False, 5)
    assert (settings.train.epochs, settings.train.imgsz, settings.model.cfg) == (20, 160, "yolov8n.yaml")  # shapes'
    assert settings.bench is None
    cell = s.Settings.of({**cfg, "bench": {"cell": "ddp-2", "steps": 4}})
    assert cell.bench == s.BenchSettings(cell="ddp-2", steps=4)


def raw_reads(source: str, module: str) -> list[str]:
    """`.get("key", default)` of a config key, and indexing or .get on a dict named *cfg, in `source` (the module file
    named `module`)."""
    keys = config_keys()
    found = []
    for node in ast.walk(ast.parse(source)):
        where = f"line {getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Subscript) and _named_cfg(node.value):
            found.append(f"{where}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            receiver = node.func.value
            if _named_cfg(receiver):
                found.append(f"{where}: {ast.unparse(node)}")
            elif (len(node.args) == 2 and isinstance(node.args[0], ast.Constant) and node.args[0].value in keys
                  and (module, ast.unparse(receiver)) not in NOT_CONFIG):
                found.append(f"{where}: {ast.unparse(node)}")
    return found


def _named_cfg(node) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return name == "cfg" or name.endswith("_cfg")


@functools.cache
def config_keys() -> frozenset[str]:
    """Every key of the shipped root and bench configs, at any depth."""
    keys: set[str] = set()

    def walk(d):
        for k, v in d.items():
            keys.add(k)
            if isinstance(v, dict):
                walk(v)

    walk(shipped(REPO / "conf" / "config.yaml"))
    walk(shipped(REPO / "conf" / "bench" / "default.yaml"))
    return frozenset(keys - {"defaults", "hydra"})


def test_no_rank_module_reads_the_raw_config():
    found = [f"{path.relative_to(RANK)}: {line}" for path in sorted(RANK.rglob("*.py"))
             for line in raw_reads(path.read_text(), path.name)]
    assert not found, "read the rank's typed settings (launcher/plan/settings.py) instead:\n" + "\n".join(found)


def test_the_scan_finds_a_raw_read():
    source = 'def f(rank, train, e):\n    return rank.cfg["optim"], train.get("grad_clip", 10.0), e.get("name", "?")\n'
    assert len(raw_reads(source, "step_build.py")) == 3
    assert len(raw_reads(source, "step_profile.py")) == 2  # `e` there is a profiler event

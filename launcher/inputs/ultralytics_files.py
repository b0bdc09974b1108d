"""The Ultralytics release, read from its files without importing it: its version, model YAMLs, dataset YAMLs and
default.yaml.

The launcher process validates the plan before any rank starts; importing `ultralytics` there would cost seconds,
reset torch's thread counts, and run its network probe. Its package metadata and shipped YAMLs are all it needs.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import re
from pathlib import Path

import yaml

# The releases whose internals launcher/rank/ultralytics/ is tested against, oldest and newest (pyproject.toml
# declares the same range; .ci/run tests both ends; scripts/try-ultralytics.sh tries another release).
OLDEST_VERSION = "8.4.158"
NEWEST_VERSION = "8.4.190"
WINDOW = f"{OLDEST_VERSION} to {NEWEST_VERSION}"
PIP_WINDOW = f"pip install 'ultralytics>={OLDEST_VERSION},<={NEWEST_VERSION}'"
# Set to 1 to run an Ultralytics release outside the window: the plan warns instead of refusing.
ALLOW_VARIABLE = "DDP_LAUNCH_ALLOW_ULTRALYTICS"


def installed_version() -> str | None:
    """The installed Ultralytics version from its package metadata; None when it is not installed."""
    try:
        return importlib.metadata.version("ultralytics")
    except importlib.metadata.PackageNotFoundError:
        return None


def release(version: str | None) -> tuple[int, int, int] | None:
    """8.4.190 -> (8, 4, 190); None for no version or one that is not a plain release (8.4.191rc1, 8.4.190.dev0)."""
    match = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)", version or "")
    return tuple(int(x) for x in match.groups()) if match else None


def in_window(version: str | None) -> bool:
    """Whether `version` is one of the releases rank/ultralytics/ is tested against."""
    found = release(version)
    return found is not None and release(OLDEST_VERSION) <= found <= release(NEWEST_VERSION)


def allowed_outside_window(environ=os.environ) -> bool:
    """Whether the user asked to run a release outside the window anyway (DDP_LAUNCH_ALLOW_ULTRALYTICS=1)."""
    return environ.get(ALLOW_VARIABLE, "") not in ("", "0")


def version_problem(installed: str | None) -> str | None:
    """Why this Ultralytics cannot run the ranks, or None when it is inside the tested window."""
    if in_window(installed):
        return None
    found = f"ultralytics {installed} is installed" if installed else "ultralytics is not installed"
    retry = f" (or {ALLOW_VARIABLE}=1 to try it anyway)" if installed else ""
    return (f"{found}; ddp-launch drives Ultralytics' trainer internals and is tested with {WINDOW}: "
            f"{PIP_WINDOW}{retry}")


def window_status(installed: str | None, environ=os.environ) -> str:
    """Where the installed release stands against the window, for `ddp-env`."""
    if in_window(installed):
        return f"inside the tested window {WINDOW}"
    if allowed_outside_window(environ):
        return f"outside the tested window {WINDOW}: tried anyway ({ALLOW_VARIABLE}=1)"
    return f"outside the tested window {WINDOW}: a run is refused ({PIP_WINDOW}, or {ALLOW_VARIABLE}=1 to try it)"


def outside_window_warning(installed: str) -> str:
    """What a run outside the window risks, said when DDP_LAUNCH_ALLOW_ULTRALYTICS=1 lets it start."""
    return (f"ultralytics {installed} is outside the tested window {WINDOW} ({ALLOW_VARIABLE}=1): the internals "
            "rank/ultralytics/ reaches into (its loss, validator, datasets, checkpoint keys, optimizer groups) may "
            "have moved, so the run may fail or train and validate differently from Ultralytics; "
            f"scripts/try-ultralytics.sh {installed} names which reach broke ({PIP_WINDOW}: a tested release)")


@functools.cache
def package_dir() -> Path:
    spec = importlib.util.find_spec("ultralytics")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(version_problem(None))
    return Path(next(iter(spec.submodule_search_locations)))


@functools.cache
def model_yamls() -> dict[str, Path]:
    """Every model YAML Ultralytics ships, by file name (yolov8.yaml, yolo11.yaml, ...)."""
    return {p.name: p for p in sorted((package_dir() / "cfg" / "models").rglob("*.yaml"))}


def unified_model_name(name: str) -> str:
    """yolov8s.yaml -> yolov8.yaml: the scale letter picks a row of the family YAML (Ultralytics' own rule)."""
    return re.sub(r"(\d+)([nslmx])(.+)?$", r"\1\3", name)


def find_model_yaml(name: str) -> Path | None:
    yamls = model_yamls()
    return yamls.get(name) or yamls.get(unified_model_name(name))


def detection_model_names() -> list[str]:
    """Names a user can pass as model.cfg: every scale of every detection family (no -cls, -seg, -pose, ...)."""
    names = []
    for fname, path in model_yamls().items():
        stem = fname[: -len(".yaml")]
        if any(t in stem for t in ("-cls", "-seg", "-pose", "-obb", "-depth", "-sem", "yoloe", "rtdetr", "world")):
            continue
        try:
            scales = (yaml.safe_load(path.read_text()) or {}).get("scales") or {}
        except yaml.YAMLError:
            continue
        base = re.match(r"(.*?\d+)(.*)$", stem)
        if scales and base:
            names.extend(f"{base[1]}{s}{base[2]}.yaml" for s in scales)
        else:
            names.append(fname)
    return sorted(names)


def dataset_yaml(name: str) -> Path | None:
    path = package_dir() / "cfg" / "datasets" / name
    return path if path.is_file() else None


@functools.cache
def default_train_args() -> dict:
    """Ultralytics' default.yaml: every argument its trainer accepts."""
    return yaml.safe_load((package_dir() / "cfg" / "default.yaml").read_text())


# The argument type tables of ultralytics/cfg/__init__.py, which its check_cfg applies to every train argument
CFG_TABLES = ("CFG_FLOAT_KEYS", "CFG_FRACTION_KEYS", "CFG_INT_KEYS", "CFG_INT_MIN", "CFG_BOOL_KEYS", "CFG_STR_KEYS")


@functools.cache
def cfg_type_rules() -> dict:
    """{table name: the set (or for CFG_INT_MIN the mapping) of keys}, read from the module's source as literals."""
    import ast

    tree = ast.parse((package_dir() / "cfg" / "__init__.py").read_text())
    rules = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and getattr(node.targets[0], "id", None) in CFG_TABLES:
            value = node.value
            if isinstance(value, ast.Call):  # frozenset({...})
                value = value.args[0]
            rules[node.targets[0].id] = ast.literal_eval(value)
    missing = set(CFG_TABLES) - set(rules)
    if missing:
        raise RuntimeError(f"ultralytics/cfg/__init__.py no longer defines {', '.join(sorted(missing))}")
    return rules


@functools.cache
def integral_floats_are_integers() -> bool:
    """Whether check_cfg takes an integral float for an integer argument (epochs=1e2): from 8.4.172 it does, before it
    refuses it; read from the module's source, as the tables are."""
    return "is_integer()" in (package_dir() / "cfg" / "__init__.py").read_text()


@functools.cache
def default_arg_sections() -> dict[str, str]:
    """{key: the section of default.yaml it stands in} ("Train settings", "Predict settings", ...): which of
    Ultralytics' arguments are training ones is said by the file's own section headers."""
    sections, section = {}, ""
    for line in (package_dir() / "cfg" / "default.yaml").read_text().splitlines():
        header = re.match(r"#\s*(.+?)\s*-{3,}", line)
        if header:
            section = header[1]
        elif re.match(r"[A-Za-z_]\w*:", line):
            sections[line.split(":", 1)[0]] = section
    return sections


def user_weights_dir() -> Path | None:
    """The weights folder of the user's own Ultralytics settings (settings.json's weights_dir, where `yolo` keeps
    the weights it downloads), read from the file; None where there is none."""
    import json

    home = os.environ.get("YOLO_CONFIG_DIR")
    base = Path(home) if home else Path.home() / ".config" / "Ultralytics"
    try:
        folder = json.loads((base / "settings.json").read_text()).get("weights_dir")
    except (OSError, ValueError, AttributeError):
        return None
    return Path(folder) if folder else None

"""The dataset of a resumed run: still where the run's data.yaml says, or moved, and then named again on the command
line (`resume=RUN_DIR data.path=NEW`, the moved data YAML or the dataset's new folder) and taken only when it checks
out as the one the run trained on: the same class names and, per split, the same images counted and usable."""

from __future__ import annotations

import tempfile
from pathlib import Path

import yaml

from launcher.inputs.data import DatasetInfo, resolve_data
from launcher.plan.plan import LaunchPlan
from launcher.problems import PlanError, Problem
from launcher.run_folder import RunFolder

SPLITS = ("train", "val")
DATA_KEYS = ("data.path", "data.root")  # what names a moved dataset on resume (data.root: its new folder)


def missing_problems(folder: RunFolder) -> list[Problem]:
    """The run's dataset as its data.yaml names it: a split folder or list that is not there any more."""
    spec = folder.dataset()
    entries = [e for split in SPLITS for e in _as_list(spec.get(split))]
    gone = [e for e in entries if not Path(e).exists()]
    if not gone:
        return []
    return [Problem(f"resume={folder.path}: the run's dataset is not where it was ({', '.join(gone)} is missing); "
                    "if it moved, add data.path=ITS_DATA_YAML or data.path=ITS_FOLDER", environment=True)]


def moved_dataset(folder: RunFolder, plan: LaunchPlan, name: str, value, base_dir: Path,
                  cache_dir: Path) -> DatasetInfo:
    """The dataset `data.path=value` names on resume (a data YAML, or the folder the run's dataset moved to),
    checked as a launch checks it and compared with the run's. PlanError, one line, when it is not the same."""
    given = Path(str(value)).expanduser()
    given = given if given.is_absolute() else base_dir / given
    with tempfile.TemporaryDirectory(prefix="ddp-launch-data-") as scratch:
        yaml_path = given
        if given.is_dir():  # the run's data.yaml, its splits under the new folder
            yaml_path = Path(scratch) / "data.yaml"
            yaml_path.write_text(yaml.safe_dump(rebased(folder.dataset(), given), sort_keys=False))
        data, problems = resolve_data({"name": name, "path": str(yaml_path)}, base_dir, cache_dir=cache_dir)
    if problems or data is None:
        raise PlanError([Problem(f"resume={folder.path} data.path={value}: {p.message}") for p in problems])
    differences = dataset_differences(folder.dataset(), plan, data)
    if differences:
        raise PlanError([Problem(f"resume={folder.path} data.path={value}: not the dataset the run trained on "
                                 f"({'; '.join(differences)}); point data.path at that dataset, or start a new run")])
    return data


def rebased(spec: dict, root: Path) -> dict:
    """A data YAML's spec with its folder moved to `root`: the splits under its old `path` follow it."""
    old = Path(str(spec["path"]))

    def moved(entry: str) -> str:
        entry_path = Path(entry)
        return str(root / entry_path.relative_to(old)) if entry_path.is_relative_to(old) else entry

    out = {**spec, "path": str(root)}
    for split in ("train", "val", "test"):
        if spec.get(split):
            entries = [moved(e) for e in _as_list(spec[split])]
            out[split] = entries if isinstance(spec[split], list) else entries[0]
    return out


def dataset_differences(run_spec: dict, plan: LaunchPlan, data: DatasetInfo) -> list[str]:
    """How `data` differs from the dataset the run planned with: class names, and per split the images counted and
    usable (the plan's record of the check; its training image count where the plan holds no record)."""
    differences = []
    theirs, ours = _names(run_spec.get("names")), _names(data.spec.get("names"))
    if theirs != ours:
        differences.append(f"class names {_shown(ours)} here, {_shown(theirs)} in the run")
    for split in SPLITS:
        planned, here = plan.images.get(split) or {}, data.checks.get(split) or {}
        for count, what in (("images", "images"), ("usable", "usable images")):
            if count in planned and planned[count] != here.get(count):
                differences.append(f"{here.get(count)} {split} {what} here, {planned[count]} in the run")
    if not plan.images and plan.train_images is not None and plan.train_images != data.train_images:
        differences.append(f"{data.train_images} train images here, {plan.train_images} in the run")
    return differences


def _names(names) -> list[str]:
    if isinstance(names, dict):
        return [str(names[k]) for k in sorted(names, key=int)]
    return [str(n) for n in names or []]


def _shown(names: list[str]) -> str:
    return f"{len(names)} ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''})"


def _as_list(value) -> list[str]:
    if value is None:
        return []
    return [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]

"""Find the dataset, check it before any rank starts, and describe the data YAML the ranks train on.

Every dataset's `spec` has an absolute `path`, absolute splits, and no `download:` key; the run folder keeps it as
`<run>/data.yaml` (run_folder.py), so Ultralytics has nothing to guess and nothing to fetch. A missing dataset is an error that names the path and the
key to set; a `download:` script runs only when the user sets data.allow_download=true.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from launcher.inputs import class_folders, labels, shapes, ultralytics_files
from launcher.problems import Problem


@dataclass(frozen=True)
class DatasetInfo:
    name: str
    source: str  # the YAML it came from (or the synthetic spec)
    spec: dict  # the data YAML the ranks get
    train_images: int | None  # None when unknown (not generated yet, or missing in a dry run)
    val_images: int | None
    note: str = ""
    # per split, what Ultralytics will use and drop (labels.SplitCheck.to_dict); empty when the data is not there yet
    checks: dict = field(default_factory=dict)


def _as_list(value) -> list[str]:
    return [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]


def _check_yaml(raw, source: str) -> list[str]:
    """Structural checks of a data YAML (what Ultralytics would reject mid-start, said up front)."""
    if not isinstance(raw, dict):
        return [f"{source}: a data YAML must be a mapping with train, val and names"]
    problems = []
    for key in ("train", "val"):
        if not raw.get(key):
            problems.append(f"{source}: '{key}:' is missing; train, val and names are required")
    names, nc = raw.get("names"), raw.get("nc")
    if names is None:
        problems.append(f"{source}: 'names:' is missing (a list or a mapping of class index to name)")
    elif not isinstance(names, (list, dict)) or not names:
        problems.append(f"{source}: 'names:' must be a non-empty list or mapping")
    elif isinstance(names, dict) and sorted(names) != list(range(len(names))):
        problems.append(f"{source}: 'names:' keys must be 0..{len(names) - 1}")
    elif nc is not None and nc != len(names):
        problems.append(f"{source}: 'nc: {nc}' does not match the {len(names)} entries of 'names:'")
    return problems


def _from_yaml(
    name: str, yaml_path: Path, root: str | None, allow_download: bool, scan: dict, *, user_yaml: bool = False
) -> tuple[DatasetInfo | None, list[Problem]]:
    source = str(yaml_path)
    try:
        raw = yaml.safe_load(yaml_path.read_text())
    except yaml.YAMLError as e:
        return None, [Problem(f"{source}: not valid YAML ({e})")]
    if isinstance(raw, dict) and class_folders.is_class_folders(raw):  # a classification run's own data.yaml
        return _from_folders(name, Path(str(raw.get("path") or yaml_path.parent)))
    problems = [Problem(m) for m in _check_yaml(raw, source)]
    if problems:
        return None, problems

    if root:
        base = Path(root).expanduser()
    elif raw.get("path"):
        base = Path(str(raw["path"])).expanduser()
        base = base if base.is_absolute() else yaml_path.parent / base
    else:
        base = yaml_path.parent
    base = base.resolve()

    names = raw["names"]
    names = {i: str(n) for i, n in enumerate(names)} if isinstance(names, list) else {int(k): str(v) for k, v in names.items()}
    spec = {"path": str(base), "names": names}
    missing = []
    for split in ("train", "val", "test"):
        if not raw.get(split):
            continue
        entries = [str((base / e).resolve()) for e in _as_list(raw[split])]
        spec[split] = entries if isinstance(raw[split], (list, tuple)) else entries[0]
        if split != "test":
            missing += [e for e in entries if not Path(e).exists()]
    for key in ("channels", "kpt_shape", "flip_idx"):
        if key in raw:
            spec[key] = raw[key]

    if missing:
        has_script = bool(raw.get("download"))
        if has_script and allow_download:
            spec["download"] = raw["download"]
            return DatasetInfo(name, source, spec, None, None, note="missing; Ultralytics will download it"), []
        where = "data.root=/path/to/" + (base.name or "dataset")
        msg = (
            f"dataset '{name}' not found: {', '.join(missing)} does not exist. "
            f"Put the dataset there, or point to it with {where}"
            + (" (or fix data.path)" if user_yaml else "")
            + ". ddp-launch never downloads datasets"
        )
        if has_script:
            msg += f" ({source} has a download: script; set data.allow_download=true to run it)"
        return None, [Problem(msg, environment=True)]

    kpt_shape = spec.get("kpt_shape")
    checks = {split: labels.check_split(_as_list(spec[split]), len(names), kpt_shape=kpt_shape, **scan)
              for split in ("train", "val")}
    info = DatasetInfo(name, source, spec, checks["train"].usable, checks["val"].usable,
                       checks={split: c.to_dict() for split, c in checks.items()})
    return info, [Problem(m, environment=True) for m in _split_problems(name, spec, checks)]


def _from_folders(name: str, root: Path) -> tuple[DatasetInfo | None, list[Problem]]:
    """A classification dataset: class folders under `root` (class_folders.py)."""
    spec, checks, problems = class_folders.read(name, root)
    if problems:
        return None, [Problem(m, environment=True) for m in problems]
    return DatasetInfo(name, str(root), spec, checks["train"]["usable"], checks["val"]["usable"], checks=checks), []


def _split_problems(name: str, spec: dict, checks: dict[str, labels.SplitCheck]) -> list[str]:
    """A split Ultralytics would stop on: no image at all, none it can use, or (training) no label file at all."""
    problems = []
    for split, check in checks.items():
        where = spec[split]
        if check.images == 0:
            problems.append(f"dataset '{name}': no images under {where} ({split} split); put images there or point "
                            f"'{split}:' of the data YAML at a folder that has some")
        elif check.usable == 0:
            why = "; ".join(f"{len(v)} {reason}" for reason, v in check.dropped.items())
            problems.append(f"dataset '{name}': none of the {check.images} {split} images under {where} can be used "
                            f"({why}); fix or replace them")
        elif split == "train" and check.labels_found == 0:
            first = labels.label_file(labels.list_images(_as_list(where))[0])
            problems.append(f"dataset '{name}': no label file for any of the {check.images} training images "
                            f"(Ultralytics looks for labels/ beside images/, e.g. {first})")
    return problems


def follows_model(data_cfg: dict) -> bool:
    """Whether the data is the built-in synthetic set labelled for the model's task (data.synthetic.task=auto)."""
    return data_cfg.get("kind") == "synthetic" and (data_cfg.get("synthetic") or {}).get("task", "auto") == "auto"


def resolve_data(data_cfg: dict, base_dir: Path, *, generate: bool = True, cache_dir: Path | None = None,
                 datasets_dir: Path | None = None, model_task: str | None = None) -> tuple[DatasetInfo | None, list[Problem]]:
    """Resolve `data.*` to a DatasetInfo, every image and label checked (labels.py). `generate=False` (a dry run)
    never writes the synthetic dataset nor the checks' cache; `cache_dir` (paths.cache) holds that cache. A data
    YAML named without a folder that is not a file here but one Ultralytics ships (data=coco8.yaml) is read from
    Ultralytics, its dataset under `datasets_dir` (paths.datasets) as Ultralytics' datasets_dir would hold it. The
    synthetic dataset's `task: auto` labels it for `model_task` (the model's, inputs/model_task.py). A folder
    (data.path=path/to/folder, as Ultralytics' data=path/to/folder) is a classification dataset (class_folders.py)."""
    scan = {"cache_dir": Path(cache_dir) / "labels" if cache_dir else None, "write_cache": generate}
    name = str(data_cfg.get("name", "data"))
    kind = data_cfg.get("kind", "yaml")
    allow = bool(data_cfg.get("allow_download", False))
    if kind == "synthetic":
        synthetic = dict(data_cfg.get("synthetic") or {})
        if follows_model(data_cfg):
            synthetic["task"] = model_task if model_task in shapes.TASKS else "detect"
        spec = shapes.ShapesSpec.from_config(synthetic)
        bad = spec.problems()
        if bad:
            return None, [Problem(m) for m in bad]
        root = Path(str(data_cfg["root"])).expanduser()
        folder = shapes.dataset_dir(root, spec)
        if generate:
            try:
                yaml_path = shapes.ensure_dataset(root, spec)
            except OSError as e:
                why = e.strerror or e
                return None, [Problem(f"data.root={root}: the synthetic dataset cannot be written there ({why}); set "
                                      "data.root (or paths.cache) to a writable folder", environment=True)]
        elif (folder / shapes.MARKER).is_file():
            yaml_path = folder / shapes.MARKER
        else:
            if spec.task == "classify":
                pending = shapes.class_folders_spec(folder)
                return DatasetInfo(name, f"synthetic {spec}", pending, spec.train_images, spec.val_images,
                                   note="generated at the first real run"), []
            names = dict(enumerate(shapes.CLASSES))
            keypoints = {"kpt_shape": shapes.KPT_SHAPE, "flip_idx": shapes.FLIP_IDX} if spec.task == "pose" else {}
            pending = {"path": str(folder), "train": str(folder / "images/train"), "val": str(folder / "images/val"),
                       "names": names, **keypoints}
            return DatasetInfo(name, f"synthetic {spec}", pending, spec.train_images, spec.val_images, note="generated at the first real run"), []
        return _from_yaml(name, yaml_path, None, allow, scan)

    if kind == "builtin":
        builtin = str(data_cfg.get("builtin"))
        yaml_path = ultralytics_files.dataset_yaml(builtin)
        if yaml_path is None:
            return None, [Problem(f"data.builtin={builtin!r}: Ultralytics ships no dataset YAML of that name")]
        if not data_cfg.get("root"):
            return None, [Problem(f"data '{name}': set data.root to the folder that holds the dataset")]
        return _from_yaml(name, yaml_path, str(data_cfg["root"]), allow, scan)

    path = data_cfg.get("path")
    if path in (None, "", "???"):
        return None, [Problem("data=custom needs data.path=/abs/path/to/data.yaml (an Ultralytics data YAML)")]
    yaml_path = Path(str(path)).expanduser()
    yaml_path = yaml_path if yaml_path.is_absolute() else base_dir / yaml_path
    name = yaml_path.stem if name == "custom" else name  # data=coco8.yaml is "coco8" in every message
    shipped = ultralytics_files.dataset_yaml(str(path)) if "/" not in str(path) else None
    if not yaml_path.is_file() and shipped is not None and datasets_dir is not None:
        raw = yaml.safe_load(shipped.read_text()) or {}
        root = data_cfg.get("root") or str(Path(datasets_dir).expanduser() / str(raw.get("path") or shipped.stem))
        return _from_yaml(name, shipped, root, allow, scan)
    if yaml_path.is_dir():  # Ultralytics' data=path/to/folder: a classification dataset's class folders
        return _from_folders(name, yaml_path)
    if not yaml_path.is_file():
        return None, [Problem(f"data.path={path!r}: no such file or folder ({yaml_path}); a data YAML, or a "
                              f"classification dataset's folder ({class_folders.LAYOUT})", environment=True)]
    return _from_yaml(name, yaml_path, data_cfg.get("root"), allow, scan, user_yaml=True)

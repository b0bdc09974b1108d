"""Which network to train, and from what: resolved to local files before any rank starts.

`model.cfg` is an Ultralytics model YAML (a shipped name such as yolov8s.yaml, or a path to your own YAML), trained
from scratch; `model.weights` a .pt to start from (fine-tuning: the architecture is the checkpoint's unless model.cfg
names one). `model.pretrained=true` starts from the chosen model's published weights (`yolov8n` -> yolov8n.pt). A
weights file named without a folder is looked for in the current folder, then paths.weights, then Ultralytics'
weights folder (its settings.json); one that is nowhere is fetched only with model.allow_download=true, into
paths.weights (launch/starting_weights.py), never otherwise.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

from launcher.inputs import ultralytics_files
from launcher.inputs.model_task import task_problem

MISSING = "???"  # OmegaConf's mandatory value, as a resolved config carries it when nobody set it


@dataclass(frozen=True)
class ModelSpec:
    name: str
    cfg: str | None  # absolute path of a YAML, or a shipped YAML name Ultralytics resolves itself (yolov8s.yaml)
    weights: str | None  # absolute path of a local .pt (where it will be, when `download` fetches it first)
    download: str | None = None  # an Ultralytics release asset to fetch into weights' folder before the ranks start
    transferred: tuple[int, int] | None = None  # (tensors taken from the weights, tensors of the network)
    arch: str | None = None  # the architecture's YAML name, once the weights are opened (launch/starting_weights.py)

    def init_text(self) -> str:
        """How the network starts, in the plan's words."""
        if not self.weights:
            return "from scratch (random init)"
        text = f"from {self.weights}"
        if self.download:
            text += " (Ultralytics' release, downloaded before the ranks start: model.allow_download=true)"
        if self.transferred:
            text += f" ({self.transferred[0]}/{self.transferred[1]} tensors transferred)"
        return text


def _looks_remote(value: str) -> bool:
    return "://" in value


def resolve_model(model_cfg: dict, base_dir: Path, weight_dirs: list[Path] = ()) -> tuple[ModelSpec | None, list[str]]:
    """Return the spec, or problems. Relative paths are read from `base_dir` (the directory ddp-launch ran in); a
    bare weights file name is also looked for in `weight_dirs` (paths.weights first, where a download goes)."""
    name = str(model_cfg.get("name") or "model")
    cfg = model_cfg.get("cfg")
    weights = model_cfg.get("weights")
    pretrained = model_cfg.get("pretrained", False)

    if weights == MISSING:  # model=checkpoint leaves it for the user to fill in
        return None, [f"model={name} starts from a checkpoint: set model.weights=/path/to/best.pt (or type "
                      "model=/path/to/best.pt)"]
    if pretrained not in (True, False, None):
        return None, [f"model.pretrained={pretrained!r}: expected true or false (weights from a file: model.weights=PATH)"]
    if pretrained and weights is None:
        stem = Path(str(cfg)).stem if name == "custom" and cfg else name
        weights = f"{stem}.pt"  # Ultralytics' published weights of this family and size
    if cfg is None and weights is None:
        return None, ["model: set model.cfg (an Ultralytics model YAML) or model.weights (a local .pt)"]

    problems: list[str] = []
    cfg_out = _architecture(str(cfg), base_dir, problems) if cfg is not None else None
    weights_out, download = (_weights(str(weights), base_dir, list(weight_dirs), bool(model_cfg.get("allow_download")),
                                      problems) if weights is not None else (None, None))
    if cfg_out is not None and (other_task := task_problem(cfg_out, f"model.cfg={cfg}")):
        problems.append(other_task)
    if weights_out is not None and cfg_out is None and (other_task := task_problem(weights_out, f"model={weights}")):
        problems.append(other_task)  # by its name here; by the architecture it holds once opened (start.py)
    if problems:
        return None, problems
    return ModelSpec(name=name, cfg=cfg_out, weights=weights_out, download=download), []


def _architecture(cfg: str, base_dir: Path, problems: list[str]) -> str | None:
    """model.cfg as a YAML file's absolute path, or a shipped YAML name Ultralytics resolves itself."""
    if _looks_remote(cfg) or cfg.endswith(".pt"):
        problems.append(f"model.cfg={cfg!r} is weights, not an architecture: type model={cfg} (fine-tuning from it) "
                        "or model.weights=PATH, and an architecture YAML in model.cfg (yolov8n.yaml)")
        return None
    if not cfg.endswith((".yaml", ".yml")):
        problems.append(f"model.cfg={cfg!r} is not a model YAML; use model.cfg={cfg}.yaml or pick a model/ config, "
                        "e.g. model=yolov8n")
        return None
    path = Path(cfg).expanduser()
    path = path if path.is_absolute() else base_dir / path
    if path.is_file():
        return str(path.resolve())
    if "/" not in cfg and ultralytics_files.find_model_yaml(cfg) is not None:
        return cfg  # shipped with Ultralytics: resolved by its own rule (scale letter -> family YAML)
    close = difflib.get_close_matches(cfg, ultralytics_files.detection_model_names(), n=5)
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    problems.append(f"model.cfg={cfg!r}: no such file and no Ultralytics model YAML of that name.{hint}")
    return None


def _weights(weights: str, base_dir: Path, weight_dirs: list[Path], allow_download: bool,
             problems: list[str]) -> tuple[str | None, str | None]:
    """(the weights' absolute path, the release asset to fetch there first or None)."""
    if _looks_remote(weights):
        problems.append(f"model.weights={weights!r} is a URL: ddp-launch reads local files; give the path of a .pt, or "
                        "the name of an Ultralytics release (yolov8n.pt) with model.allow_download=true")
        return None, None
    if not weights.endswith(".pt"):
        problems.append(f"model.weights={weights!r}: expected an Ultralytics .pt checkpoint")
        return None, None
    path = Path(weights).expanduser()
    bare = "/" not in weights
    places = [path] if path.is_absolute() else [base_dir / path] + ([d / path for d in weight_dirs] if bare else [])
    found = next((p for p in places if p.is_file()), None)
    if found is not None:
        return str(found.resolve()), None
    published = bare and ultralytics_files.find_model_yaml(Path(weights).stem + ".yaml") is not None
    if published and allow_download and weight_dirs:
        return str((Path(weight_dirs[0]).expanduser() / weights).resolve()), weights
    where = ", ".join(str(p.parent) for p in places)
    advice = (f"put {weights} in one of them, or set model.allow_download=true to fetch Ultralytics' release into "
              f"{weight_dirs[0]}" if published and weight_dirs else "give the path of a local .pt")
    problems.append(f"model.weights={weights!r}: not found (looked in {where}); {advice}")
    return None, None

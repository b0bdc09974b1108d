"""Which network to train, resolved to local files only.

`model.cfg` is an Ultralytics model YAML (a shipped name such as yolov8s.yaml, or a path to your own YAML);
`model.weights` an optional local .pt to start from. Anything Ultralytics would download instead (a bare
`yolov8n.pt`, a URL) is refused before a rank starts.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

from launcher.inputs import ultralytics_files

MISSING = "???"  # OmegaConf's mandatory value, as a resolved config carries it when nobody set it


@dataclass(frozen=True)
class ModelSpec:
    name: str
    cfg: str | None  # absolute path of a YAML, or a shipped YAML name Ultralytics resolves itself (yolov8s.yaml)
    weights: str | None  # absolute path of a local .pt


def _looks_remote(value: str) -> bool:
    return "://" in value


def resolve_model(model_cfg: dict, base_dir: Path) -> tuple[ModelSpec | None, list[str]]:
    """Return the spec, or problems. Relative paths are read from `base_dir` (the directory ddp-launch ran in)."""
    problems: list[str] = []
    name = str(model_cfg.get("name") or "model")
    cfg = model_cfg.get("cfg")
    weights = model_cfg.get("weights")
    cfg_out: str | None = None
    weights_out: str | None = None

    if weights == MISSING:  # model=checkpoint leaves it for the user to fill in
        return None, [f"model={name} starts from a checkpoint: set model.weights=/path/to/best.pt (a local Ultralytics "
                      ".pt; ddp-launch never downloads one)"]
    if cfg is None and weights is None:
        return None, ["model: set model.cfg (an Ultralytics model YAML) or model.weights (a local .pt)"]

    if cfg is not None:
        cfg = str(cfg)
        if _looks_remote(cfg) or cfg.endswith(".pt"):
            problems.append(
                f"model.cfg={cfg!r} would make Ultralytics download weights. Use an architecture YAML "
                f"(model.cfg=yolov8n.yaml) and put a local checkpoint in model.weights=/path/to/file.pt"
            )
        elif not cfg.endswith((".yaml", ".yml")):
            problems.append(
                f"model.cfg={cfg!r} is not a model YAML; a bare name becomes {cfg}.pt, which Ultralytics downloads. "
                f"Use model.cfg={cfg}.yaml or pick a model/ config, e.g. model=yolov8n"
            )
        else:
            path = Path(cfg).expanduser()
            path = path if path.is_absolute() else base_dir / path
            if path.is_file():
                cfg_out = str(path.resolve())
            elif "/" not in cfg and ultralytics_files.find_model_yaml(cfg) is not None:
                cfg_out = cfg  # shipped with Ultralytics: resolved by its own rule (scale letter -> family YAML)
            else:
                close = difflib.get_close_matches(cfg, ultralytics_files.detection_model_names(), n=5)
                hint = f" Did you mean: {', '.join(close)}?" if close else ""
                problems.append(f"model.cfg={cfg!r}: no such file and no Ultralytics model YAML of that name.{hint}")

    if weights is not None:
        weights = str(weights)
        path = Path(weights).expanduser()
        path = path if path.is_absolute() else base_dir / path
        if _looks_remote(weights):
            problems.append(f"model.weights={weights!r} is a URL: ddp-launch never downloads; give a local .pt path")
        elif not path.is_file():
            problems.append(
                f"model.weights={weights!r}: no such file ({path}). ddp-launch never downloads weights "
                f"(Ultralytics would fetch {Path(weights).name} from the internet); give the path of a local .pt"
            )
        elif path.suffix != ".pt":
            problems.append(f"model.weights={weights!r}: expected an Ultralytics .pt checkpoint")
        else:
            weights_out = str(path.resolve())

    if problems:
        return None, problems
    return ModelSpec(name=name, cfg=cfg_out, weights=weights_out), []

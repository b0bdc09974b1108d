"""Ultralytics' home for the ranks, written once in the launcher process before any rank starts.

settings.json with sync and every integration off, and the two fonts check_font() looks for: ranks importing
Ultralytics together would race to create the settings file, and a missing font makes Ultralytics reach for the
network. The ranks find both through YOLO_CONFIG_DIR (plan/environment.py, offline_environment).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

from launcher.plan.environment import ultralytics_home

ULTRALYTICS_SETTINGS_VERSION = "0.0.8"  # SettingsManager(version=...) in ultralytics 8.4.190


def prepare_ultralytics_home(cache_dir: Path) -> Path:
    """Write settings.json (sync and every integration off) and the two fonts check_font() looks for."""
    home = ultralytics_home(cache_dir)
    target = home / "Ultralytics"  # Ultralytics appends this to YOLO_CONFIG_DIR
    target.mkdir(parents=True, exist_ok=True)
    (home / "matplotlib").mkdir(exist_ok=True)
    settings = {
        "settings_version": ULTRALYTICS_SETTINGS_VERSION,
        "datasets_dir": str(Path(cache_dir) / "datasets"),
        "weights_dir": str(home / "weights"),  # instead of a ./weights folder wherever the user stands
        "runs_dir": str(home / "runs"),
        "uuid": "0" * 64,
        "sync": False,
        "api_key": "",
        "openai_api_key": "",
        "clearml": False,
        "comet": False,
        "dvc": False,
        "mlflow": False,
        "raytune": False,
        "tensorboard": False,
        "wandb": False,
        "vscode_msg": False,
        "openvino_msg": False,
    }
    _write_if_changed(target / "settings.json", json.dumps(settings, indent=2))
    # matplotlib's own font, found without importing matplotlib (half a second the launcher need not spend)
    dejavu = Path(importlib.util.find_spec("matplotlib").origin).parent / "mpl-data" / "fonts" / "ttf" / "DejaVuSans.ttf"
    for name in ("Arial.ttf", "Arial.Unicode.ttf"):  # any TTF under these names stops check_font's download
        if not (target / name).exists():
            tmp = target / f".{name}.{os.getpid()}"
            shutil.copyfile(dejavu, tmp)
            os.replace(tmp, target / name)
    return home


def _write_if_changed(path: Path, text: str) -> None:
    if path.exists() and path.read_text() == text:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)

"""The weights a run starts from, checked before anything is written: fetched where model.allow_download asks for
Ultralytics' release, opened, and matched to the network the ranks will build, so that the plan says how many
tensors they give it and a checkpoint that cannot be read is refused by name instead of failing in every rank.

The work is Ultralytics' (loading a checkpoint, building the network), and the launcher process never imports it:
rank/ultralytics/weights.py does it in a subprocess, with the run's offline Ultralytics home (online only to fetch).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

from launcher.inputs.data import DatasetInfo
from launcher.inputs.models import ModelSpec
from launcher.launch.ultralytics_home import prepare_ultralytics_home
from launcher.plan.environment import offline_environment
from launcher.problems import Problem

MODULE = "launcher.rank.ultralytics.weights"
TIMEOUT_S = 600  # a download of the largest published weights on a slow link


def check(model: ModelSpec, data: DatasetInfo, cache: Path) -> tuple[ModelSpec, list[Problem]]:
    """`model` with the tensors its weights transfer (None without weights), or the problem naming the file."""
    if not model.weights or not data.spec.get("names"):
        return model, []
    home = prepare_ultralytics_home(cache)
    env = {**os.environ, **offline_environment(cache)}
    if model.download:
        env.pop("YOLO_OFFLINE")  # the user allowed this one download (model.allow_download)
    cmd = [sys.executable, "-m", MODULE, "--weights", model.weights, "--names", json.dumps(data.spec["names"]),
           "--channels", str(data.spec.get("channels", 3))]
    cmd += ["--cfg", model.cfg] if model.cfg else []
    cmd += ["--kpt-shape", json.dumps(data.spec["kpt_shape"])] if data.spec.get("kpt_shape") else []
    cmd += ["--download", model.download] if model.download else []
    done = None
    try:
        done = subprocess.run(cmd, env=env, cwd=home, capture_output=True, text=True, timeout=TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
        result = json.loads(done.stdout.strip().splitlines()[-1]) if done.stdout.strip() else {}
    except (subprocess.TimeoutExpired, ValueError) as e:
        result = {"error": f"{type(e).__name__}: {e}"}
    if "transferred" in result:
        return dataclasses.replace(model, transferred=(result["transferred"], result["total"]),
                                   arch=result.get("arch") or None), []
    error = result.get("error") or ((done.stderr.strip().splitlines() if done else []) or ["no answer"])[-1]
    if model.download and not Path(model.weights).is_file():
        return model, [Problem(f"model.weights={Path(model.weights).name}: the download of Ultralytics' release into "
                               f"{Path(model.weights).parent} failed ({error}); put the file there yourself",
                               environment=True)]
    return model, [Problem(f"model.weights={model.weights}: cannot be used to start from ({error}); give an intact "
                           "Ultralytics .pt checkpoint (a best.pt or last.pt, or a published yolov8n.pt)")]

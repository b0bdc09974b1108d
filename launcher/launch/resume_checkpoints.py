"""The checkpoints a resume will read, checked before any rank starts: each one opened and matched to the run's
network (rank/ultralytics/checkpoint_fit.py, in a subprocess: the launcher never imports Ultralytics). A last.pt
that cannot be used, beside an intact last.prev.pt, is said in one line naming both (the ranks then take
last.prev.pt); neither usable is a refusal that names both and points at an intact best.pt.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from launcher.launch.ultralytics_home import prepare_ultralytics_home
from launcher.plan.environment import offline_environment
from launcher.problems import Problem
from launcher.run_folder import RunFolder

MODULE = "launcher.rank.ultralytics.checkpoint_fit"
TIMEOUT_S = 600


def inspect(folder: RunFolder, cache: Path) -> dict:
    """{file name: why it cannot be used, or None} for the run's checkpoints that exist ({} when it cannot tell)."""
    env = {**os.environ, **offline_environment(cache)}
    try:
        done = subprocess.run([sys.executable, "-m", MODULE, str(folder.path)], env=env,
                              cwd=prepare_ultralytics_home(cache), capture_output=True, text=True, timeout=TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
        return json.loads(done.stdout.strip().splitlines()[-1]) if done.stdout.strip() else {}
    except (subprocess.TimeoutExpired, ValueError):
        return {}


def verdict(folder: RunFolder, found: dict) -> tuple[str | None, list[Problem]]:
    """(a line to say, the problems refusing the resume) for what inspect() found. Pure."""
    last, prev, best = (folder.weights / n for n in ("last.pt", "last.prev.pt", "best.pt"))
    bad = {n: why for n, why in found.items() if n != "error" and why}
    if "last.pt" not in found or "last.pt" not in bad:
        return None, []
    if "last.prev.pt" in found and "last.prev.pt" not in bad:
        return (f"WARNING: {last} {bad['last.pt']}; resuming from {prev} instead (the checkpoint before it)"), []
    told = f"{last} {bad['last.pt']}" + (f"; {prev} {bad['last.prev.pt']}" if "last.prev.pt" in bad else
                                         f"; there is no {prev.name}")
    after = (f"; {best} is intact: start a new run from it with model={best}" if "best.pt" in found
             and "best.pt" not in bad else "; start the run again, or a new run from a checkpoint of your own")
    return None, [Problem(f"resume={folder.path}: no checkpoint to resume from: {told}{after}")]

"""The weights a run starts from, opened before any rank starts: `python -m launcher.rank.ultralytics.weights`.

The launcher never imports Ultralytics (seconds, thread counts, a network probe), so it runs this module as a
subprocess (launch/starting_weights.py) with the run's offline Ultralytics home: with `--download`, Ultralytics'
release asset is fetched first (only where the user allowed it); then the checkpoint is loaded and the network the
ranks will train is built from it exactly as they build it (build.network), and the tensors it took are counted
from Ultralytics' own "Transferred N/M items" line. It prints one JSON object on its last line:
{"transferred": N, "total": M, "arch": "yolov8n.yaml"} or {"error": "..."}.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from pathlib import Path

TRANSFERRED = re.compile(r"Transferred (\d+)/(\d+) items")


class _Transferred(logging.Handler):
    """Keeps the counts of Ultralytics' "Transferred N/M items from pretrained weights" line."""

    def __init__(self):
        super().__init__()
        self.counts: tuple[int, int] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        found = TRANSFERRED.search(record.getMessage())
        if found:
            self.counts = int(found[1]), int(found[2])


def fetch(name: str, folder: Path) -> Path:
    """Ultralytics' published weights `name` (yolov8n.pt), downloaded into `folder` unless already there."""
    from ultralytics.utils.downloads import attempt_download_asset

    folder.mkdir(parents=True, exist_ok=True)
    return Path(attempt_download_asset(folder / name))


def transfer(weights: Path, cfg: str | None, names: dict, channels: int,
             kpt_shape: list | None = None) -> tuple[int, int, str]:
    """(tensors the checkpoint gives, tensors of the network, its architecture's YAML name) for the network of its
    task that build.network makes from it (`kpt_shape`: the dataset's, for a pose network)."""
    from ultralytics.cfg import get_cfg
    from ultralytics.utils import LOGGER

    from launcher.rank.ultralytics import build

    from ultralytics.nn.tasks import guess_model_task, load_checkpoint

    from launcher.inputs.model_task import model_task
    from launcher.rank.ultralytics.tasks import TASKS

    # the architecture's task, as the plan reads it (a task outside TASKS is refused there)
    task = model_task(cfg) if cfg else guess_model_task(load_checkpoint(str(weights))[0])
    hyp = get_cfg(overrides={"model": cfg or str(weights), "pretrained": str(weights), "imgsz": 640, "plots": False,
                             "task": task if task in TASKS else "detect"})
    data = {"nc": len(names), "names": names, "channels": channels, **({"kpt_shape": kpt_shape} if kpt_shape else {})}
    counter = _Transferred()
    LOGGER.addHandler(counter)
    try:
        net, _ = build.network(hyp, data, str(weights))
    finally:
        LOGGER.removeHandler(counter)
    done, total = counter.counts or (0, len(net.state_dict()))
    return done, total, Path(str(net.yaml.get("yaml_file") or "")).name


def first_line(error: Exception) -> str:
    """What went wrong, in one line: the exception's first, without Ultralytics' "ERROR" mark or its long detail."""
    line = (str(error).strip().splitlines() or [""])[0]
    line = re.sub(r"^ERROR\W*", "", line).strip()
    if len(line) > 160 and " (" in line:
        line = line.split(" (", 1)[0]
    return f"{type(error).__name__}: {line}" if line else type(error).__name__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", type=Path, required=True)
    parser.add_argument("--cfg", default=None, help="the architecture YAML, when it is not the checkpoint's")
    parser.add_argument("--names", required=True, help="the dataset's class names, a JSON mapping")
    parser.add_argument("--channels", type=int, default=3)
    parser.add_argument("--kpt-shape", default=None, help="the dataset's kpt_shape, a JSON list (pose)")
    parser.add_argument("--download", default=None, help="fetch this Ultralytics release asset into --weights' folder")
    args = parser.parse_args(argv)
    try:
        if args.download:
            fetch(args.download, args.weights.parent)
        names = {int(k): v for k, v in json.loads(args.names).items()}
        kpt_shape = json.loads(args.kpt_shape) if args.kpt_shape else None
        done, total, arch = transfer(args.weights, args.cfg, names, args.channels, kpt_shape)
        result: dict = {"transferred": done, "total": total, "arch": arch}
    except Exception as e:  # the launcher words it with the file's name; the detail is the exception's first line
        result = {"error": first_line(e)}
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

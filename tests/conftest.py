"""Shared fixtures: composing the shipped configs, a private cache, and running the real `ddp-launch`."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from launcher.entry import conf_dir

REPO = Path(__file__).resolve().parent.parent
CONF = Path(conf_dir())

# Small, fast settings for end-to-end runs on two CPU cores (the dataset is generated once per test session): no
# plots (about 4 s of a run here; the tests of plots turn them on), and lr0 scaled linearly with the global batch, as
# on a user's own data (the demo data trains unscaled).
TINY = [
    "data.synthetic.train_images=64",
    "data.synthetic.val_images=16",
    "data.synthetic.width=96",
    "data.synthetic.height=96",
    "train.imgsz=64",
    "train.batch_per_device=8",
    "train.close_mosaic=1",
    "log.interval_steps=2",
    "train.plots=false",
    "optim.lr_scaling=linear",
]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One cache (synthetic datasets, offline Ultralytics settings) for the whole test session, not ~/.cache."""
    path = tmp_path_factory.mktemp("ddp-launch-cache")
    os.environ["DDP_LAUNCH_CACHE"] = str(path)
    return path


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    """A real Ultralytics checkpoint to start from: yolov8n with 80 classes (as published), untrained weights, saved
    in the layout `yolo train` writes (the model in half precision, no EMA)."""
    import torch
    from ultralytics.nn.tasks import DetectionModel

    path = tmp_path_factory.mktemp("weights") / "yolov8n.pt"
    torch.save({"model": DetectionModel("yolov8n.yaml", nc=80, verbose=False).half(), "ema": None, "train_args": {},
                "epoch": -1}, path)
    return path


def compose_config(overrides: list[str] | None = None) -> dict:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=overrides or [])
    return OmegaConf.to_container(cfg, resolve=True)


def ddp_launch(
    args: list[str], cwd: Path, timeout: int = 900, env: dict | None = None, tool: str = "ddp-launch"
) -> subprocess.CompletedProcess:
    """Run an installed console script (ddp-launch, ddp-bench), as a user does; `env` adds variables (None unsets)."""
    exe = str(Path(sys.executable).parent / tool)
    exe = exe if Path(exe).exists() else shutil.which(tool) or tool
    return subprocess.run(
        [exe, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None},  # None: unset it
    )


def run_dir_of(result: subprocess.CompletedProcess) -> Path:
    for line in result.stdout.splitlines():
        if line.startswith("run folder"):
            return Path(line.split(None, 2)[2])
    raise AssertionError(f"no run folder in the output:\n{result.stdout}\n{result.stderr}")


# Ultralytics' validation table as its trainer prints it (DetectionValidator.get_desc, print_results)
def on_cuda(batch: dict) -> dict:
    """A batch's tensors on the (first) CUDA device, its other entries as they are (the GPU tests)."""
    import torch

    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


VALIDATION_HEADER = "                 Class     Images  Instances      Box(P          R      mAP50  mAP50-95)"
TABLE_ROW = re.compile(r"^ *(\S.*?) +(\d+) +(\d+)(?: +[-+.\de]+){4}$")


def validation_tables(console: str) -> list[list[str]]:
    """Each validation table on the console: the class names of the rows under its header, in order."""
    tables, rows = [], None
    for line in console.splitlines():
        if line == VALIDATION_HEADER:
            rows = []
            tables.append(rows)
        elif rows is not None and (m := TABLE_ROW.match(line)):
            rows.append(m[1])
        else:
            rows = None
    return tables

"""Ultralytics' own trainer, as a user runs it, for the quality comparison (quality.sh): offline, no plots.

Usage: python3 ultralytics_train.py DATA_YAML OUT_DIR SEED EPOCHS IMGSZ CLOSE_MOSAIC
Prints one JSON line: {"side": "ultralytics", "seed": ..., "map50": ..., "map50_95": ..., "wall_s": ...}.
"""

import json
import os
import sys
import time
from pathlib import Path

from launcher.launch.ultralytics_home import prepare_ultralytics_home
from launcher.plan.environment import offline_environment

data, out, seed, epochs, imgsz, close = sys.argv[1], Path(sys.argv[2]), *map(int, sys.argv[3:7])
cache = Path(os.environ.get("DDP_LAUNCH_CACHE", "/tmp/ddp-launch-cache"))
prepare_ultralytics_home(cache)  # settings with every integration off, the fonts in place: nothing is downloaded
os.environ.update(offline_environment(cache))
start = time.time()
import ultralytics.engine.trainer as ul_trainer  # noqa: E402
import torch  # noqa: E402
from ultralytics import YOLO  # noqa: E402

from launcher.rank.metrics import results  # noqa: E402

ul_trainer.check_amp = lambda model: True  # it downloads weights; offline it leaves AMP on anyway
ul_trainer.BaseTrainer.read_results_csv = lambda trainer: results.read_columns(trainer.csv)  # no polars there
model = YOLO("yolov8s.yaml")
metrics = model.train(data=data, epochs=epochs, imgsz=imgsz, batch=64, seed=seed, close_mosaic=close, lr0=0.01,
                      optimizer="SGD", plots=False, project=str(out), name=f"seed{seed}", exist_ok=True,
                      device=0 if torch.cuda.is_available() else "cpu")
print(json.dumps({"side": "ultralytics", "seed": seed, "map50": float(metrics.box.map50),
                  "map50_95": float(metrics.box.map), "wall_s": time.time() - start}))

"""The baseline cell: Ultralytics' own trainer as users run it today, measured with ddp-launch's meter.

`YOLO(model, task=TASK).train(...)` (Ultralytics' trainer of the model's task: DetectionTrainer, SegmentationTrainer,
PoseTrainer, OBBTrainer, ClassificationTrainer on the class folders) with Ultralytics' default workers and cache, one
device, the same model, batch, image size, data, optimizer and seed as the other cells. Callbacks stamp its steps
exactly as ddp-launch's loop does (step ends stamped on the GPU, warm-up dropped, epoch-end work such as checkpoint
writing cut out of the window), so the figures compare. Three changes from a user's run, all outside the measured
work: no validation (val=False, as in the other cells), no AMP check (it downloads weights; offline it fails and
leaves AMP on, which is what happens here directly), and results.csv read without polars at epoch ends (the GPU
machines lack polars).

Run by ddp-bench: `python -m launcher.rank.ultralytics.baseline CELL_DIR` (CELL_DIR holds config.yaml).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import psutil
import torch
import ultralytics.engine.trainer as ul_trainer
from ultralytics import YOLO
from ultralytics.utils import YAML

from launcher.plan.settings import Settings
from launcher.plan.task_rules import rules
from launcher.rank.metrics import results
from launcher.rank.metrics.gpu_monitor import GpuMonitor
from launcher.rank.metrics.meter import StepMeter
from launcher.rank.metrics.run_summary import host_cpu_busy
from launcher.run_folder import RunFolder


class _Done(Exception):
    """Raised from a callback once the measured steps are done: the bench does not need the rest of the run."""


def run(cell_dir: Path) -> dict:
    cfg, plan = RunFolder(cell_dir).load()
    settings = Settings.of(cfg)
    bench, train, model = settings.bench, settings.train, settings.model
    warmup, steps = int(bench.warmup_steps), int(bench.steps)

    ul_trainer.check_amp = lambda model: True  # the check downloads weights; see the module docstring
    # Ultralytics reads results.csv with polars at each epoch end (checkpoint metadata, outside the measured window);
    # the GPU machines lack polars, and ddp-launch's own reader gives the same dict.
    ul_trainer.BaseTrainer.read_results_csv = lambda trainer: results.read_columns(trainer.csv)
    on_gpu = torch.cuda.is_available() and settings.gpus != 0
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    monitor = GpuMonitor([0]) if on_gpu else None
    # stamped as ddp-launch's cells are (train.steps_in_flight), so the meter costs both sides the same
    meter = StepMeter(device, skip_steps=warmup, monitor=monitor, in_flight=train.steps_in_flight)
    state = {"n": 0, "cpu": None, "cpu_end": None, "asked": 0.0}

    def ask(trainer):  # the loop asks its loader for the next batch
        meter.begin_step()
        state["asked"] = time.perf_counter()

    def batch_start(trainer):  # the batch is on the host; Ultralytics copies it to the GPU inside its step
        meter.batch_ready(time.perf_counter() - state["asked"])

    def batch_end(trainer):
        meter.end_step(int(trainer.batch_size))
        state["n"] += 1
        if state["n"] == warmup:
            state["cpu"] = psutil.cpu_times()
        if state["n"] >= warmup + steps:
            state["cpu_end"] = psutil.cpu_times()
            raise _Done
        ask(trainer)

    def epoch_end(trainer):
        meter.pause()  # checkpoint writing and scheduler work at the epoch boundary are not training steps

    # the cell's data.yaml; a classifier's class folders it names, as Ultralytics' data=path/to/folder reads them
    data = YAML.load(settings.data.path)["path"] if rules(plan.task).folders else settings.data.path
    yolo = YOLO(model.cfg or model.weights, task=plan.task)
    yolo.add_callback("on_train_epoch_start", ask)
    yolo.add_callback("on_train_batch_start", batch_start)
    yolo.add_callback("on_train_batch_end", batch_end)
    yolo.add_callback("on_train_epoch_end", epoch_end)
    try:
        yolo.train(
            data=str(data),
            epochs=1000,  # never reached: the bench stops after its steps
            imgsz=train.imgsz,
            batch=train.batch_per_device,
            device=0 if on_gpu else "cpu",
            workers=int(bench.baseline_workers),
            cache=False,
            amp=bool(train.amp),
            optimizer="SGD",
            lr0=settings.optim.base_lr,
            seed=settings.seed,
            val=False,
            plots=False,
            project=str(cell_dir),
            name="ultralytics",
            exist_ok=True,
            verbose=False,
        )
    except _Done:
        pass
    m = meter.summary()
    gpus = [vars(g) for g in monitor.stats()] if monitor else []
    if monitor:
        monitor.close()
    rank = {
        "rank": 0,
        "images_per_s": m.images_per_s,
        "data_wait": m.data_wait,
        "host_wait": m.host_wait,
        "steps_measured": m.steps_measured,
        "step_ms": m.step_ms,
        "gpus": gpus,
        "ceiling_images_per_s": None,
        "host_cpu": host_cpu_busy(state["cpu"], state["cpu_end"]) if state["cpu_end"] else 0.0,
    }
    cell = {"mode": "ultralytics", "size": 1, "ranks": [rank]}
    RunFolder(cell_dir).write_json("cell.json", cell)
    return cell


if __name__ == "__main__":
    run(Path(sys.argv[1]).resolve())

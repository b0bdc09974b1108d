"""The baseline cell: Ultralytics' own trainer as users run it today, measured with ddp-launch's meter.

`YOLO(model).train(...)` with Ultralytics' default workers and cache, one device, the same model, batch, image
size, data, optimizer and seed as the other cells. Callbacks stamp its steps exactly as ddp-launch's loop does
(step ends stamped on the GPU, warm-up dropped, epoch-end work such as checkpoint writing cut out of the window), so the
figures compare. Three changes from a user's run, all outside the measured work: no validation (val=False, as in
the other cells), no AMP check (it downloads weights; offline it fails and leaves AMP on, which is what happens
here directly), and results.csv read without polars at epoch ends (the GPU machines lack polars).

Run by ddp-bench: `python -m launcher.bench.baseline CELL_DIR` (CELL_DIR holds config.yaml).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


class _Done(Exception):
    """Raised from a callback once the measured steps are done: the bench does not need the rest of the run."""


def run(cell_dir: Path) -> dict:
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.load(cell_dir / "config.yaml"), resolve=True)
    bench, train, model = cfg["bench"], cfg["train"], cfg["model"]
    warmup, steps = int(bench["warmup_steps"]), int(bench["steps"])

    import psutil
    import torch
    import ultralytics.engine.trainer as ul_trainer
    from ultralytics import YOLO

    from launcher.gpu_monitor import GpuMonitor
    from launcher.meter import StepMeter

    ul_trainer.check_amp = lambda model: True  # the check downloads weights; see the module docstring
    # Ultralytics reads results.csv with polars at each epoch end (checkpoint metadata, outside the measured window);
    # the GPU machines lack polars, and ddp-launch's own reader gives the same dict.
    from launcher.trainer import LaunchTrainer

    ul_trainer.BaseTrainer.read_results_csv = LaunchTrainer.read_results_csv
    on_gpu = torch.cuda.is_available() and cfg["gpus"] != 0
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    monitor = GpuMonitor([0]) if on_gpu else None
    # stamped as ddp-launch's cells are (train.steps_in_flight), so the meter costs both sides the same
    meter = StepMeter(device, skip_steps=warmup, monitor=monitor, in_flight=train.get("steps_in_flight", 1))
    state = {"n": 0, "cpu": None, "cpu_end": None}

    def epoch_start(trainer):
        meter.wait_start()

    def batch_start(trainer):
        meter.batch_ready()  # the batch is on the host; Ultralytics copies it to the GPU inside its step

    def batch_end(trainer):
        meter.step_end(int(trainer.batch_size))
        state["n"] += 1
        if state["n"] == warmup:
            state["cpu"] = psutil.cpu_times()
        if state["n"] >= warmup + steps:
            state["cpu_end"] = psutil.cpu_times()
            raise _Done
        meter.wait_start()

    def epoch_end(trainer):
        meter.pause()  # checkpoint writing and scheduler work at the epoch boundary are not training steps

    yolo = YOLO(model.get("cfg") or model["weights"])
    yolo.add_callback("on_train_epoch_start", epoch_start)
    yolo.add_callback("on_train_batch_start", batch_start)
    yolo.add_callback("on_train_batch_end", batch_end)
    yolo.add_callback("on_train_epoch_end", epoch_end)
    try:
        yolo.train(
            data=str(cfg["data"]["path"]),
            epochs=1000,  # never reached: the bench stops after its steps
            imgsz=train["imgsz"],
            batch=train["batch_per_device"],
            device=0 if on_gpu else "cpu",
            workers=int(bench["baseline_workers"]),
            cache=False,
            amp=bool(train["amp"]),
            optimizer="SGD",
            lr0=cfg["optim"]["base_lr"],
            seed=cfg["seed"],
            val=False,
            plots=False,
            project=str(cell_dir),
            name="ultralytics",
            exist_ok=True,
            verbose=False,
        )
    except _Done:
        pass
    from launcher.trainer import _host_cpu_busy

    m = meter.summary()
    gpus = [vars(g) for g in monitor.stats()] if monitor else []
    if monitor:
        monitor.close()
    rank = {
        "rank": 0,
        "images_per_s": m.images_per_s,
        "data_wait": m.data_wait,
        "steps_measured": m.steps_measured,
        "step_ms": m.step_ms,
        "gpus": gpus,
        "ceiling_images_per_s": None,
        "host_cpu": _host_cpu_busy(state["cpu"], state["cpu_end"]) if state["cpu_end"] else 0.0,
    }
    cell = {"mode": "ultralytics", "size": 1, "ranks": [rank]}
    (cell_dir / "cell.json").write_text(json.dumps(cell, indent=2))
    return cell


if __name__ == "__main__":
    run(Path(sys.argv[1]).resolve())

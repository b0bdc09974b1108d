"""The Ultralytics side of `ddp-bench bench.kind=time_to_model`: `YOLO(model).train(...)` as a user runs it, stamped.

Run by ddp-bench in a fresh process: `python -m launcher.rank.ultralytics.time_to_model_ultralytics SIDE_DIR`.
SIDE_DIR/side.json holds the shared settings (task, data, model, imgsz, epochs, batch, lr0, close_mosaic, seed,
workers, device); the model trains with Ultralytics' trainer of its task (DetectionTrainer, SegmentationTrainer,
PoseTrainer, OBBTrainer, ClassificationTrainer on data=path/to/folder); everything else is Ultralytics' default (no
cache, AMP, validation after every epoch with its rectangular batches, plots where polars is installed: without it
Ultralytics' label and results plots fail, so they are off and the record says so). It writes SIDE_DIR/result.json:
the final box mAP and the task's own (mask or pose mAP, a classifier's top-1 and top-5, under summary.json's names),
the trainer that ran, the data wait of the same run, and a timeline in the schema of ddp-launch's
(rank/metrics/timeline.py).

The stamps, time.time(), from Ultralytics' callbacks (engine/trainer.py, engine/validator.py of 8.4.190):
on_pretrain_routine_start/end, on_train_start, each on_train_epoch_start (the first epoch's training starts at its
first on_train_batch_start: the batch in hand, as ddp-launch's first step), on_train_epoch_end (training end),
on_val_start/on_val_end (each epoch's validation), BaseTrainer.save_model (each epoch's checkpoint write, wrapped only
to stamp its start and end), on_fit_epoch_end (the epoch's end, after its checkpoint). After the
last epoch `final_eval` strips last.pt and best.pt (strip_optimizer, wrapped here only to stamp when it returns),
then validates best.pt and fires on_fit_epoch_end once more: that is the final weights on disk with the final
validation done, the end of the wall clock. plot_metrics then writes results.png and on_train_end follows: timed
separately. The module's first line stamps `module_start`: the package's import of Ultralytics comes before it.

Three changes from a user's run, none inside the stamped work: no AMP check (it downloads weights; offline it fails and
leaves AMP on, which is what happens here directly), results.csv read without polars for the checkpoints' metadata
(as the baseline cell does), and a step meter (metrics/meter.py, as in baseline.py) for the data wait.
"""

import time

MODULE_START = time.time()

import importlib.util
import json
import sys
from pathlib import Path

import torch
import ultralytics.engine.trainer as ul_trainer
from ultralytics import YOLO

from launcher.plan.task_rules import BOX, rules
from launcher.rank.metrics import results
from launcher.rank.metrics.gpu_monitor import GpuMonitor
from launcher.rank.metrics.meter import StepMeter
from launcher.rank.metrics.run_summary import task_metrics

METER_SKIP_STEPS = 10  # as a ddp-launch training run's meter (runs.METER_SKIP_STEPS)


class Stamps:
    """The run's timeline, filled by Ultralytics' callbacks; `meter` measures the data wait as baseline.py does."""

    def __init__(self, meter: StepMeter, clock=time.time):
        self.meter, self.clock = meter, clock
        self.stamps: dict[str, float] = {"module_start": MODULE_START}
        self.epochs: list[dict] = []
        self.stripped = False
        self._asked = 0.0

    def stamp(self, name: str) -> None:
        self.stamps[name] = self.clock()

    def callbacks(self) -> dict:
        return {
            "on_pretrain_routine_start": lambda t: self.stamp("pretrain_start"),
            "on_pretrain_routine_end": lambda t: self.stamp("pretrain_end"),
            "on_train_start": lambda t: self.stamp("loop_start"),
            "on_train_epoch_start": self.epoch_start,
            "on_train_batch_start": self.batch_start,
            "on_train_batch_end": self.batch_end,
            "on_train_epoch_end": self.epoch_end,
            "on_val_start": lambda v: self.validation("start"),
            "on_val_end": lambda v: self.validation("end"),
            "on_fit_epoch_end": self.fit_epoch_end,
            "on_train_end": lambda t: self.stamp("plots_end"),
        }

    def epoch_start(self, trainer) -> None:
        self.epochs.append({"epoch": trainer.epoch + 1, "train_start": self.clock()})
        self._ask()

    def _ask(self) -> None:  # the loop asks its loader for the next batch
        self.meter.begin_step()
        self._asked = time.perf_counter()

    def batch_start(self, trainer) -> None:  # the batch is on the host; Ultralytics copies it inside its step
        self.meter.batch_ready(time.perf_counter() - self._asked)
        self.stamps.setdefault("first_step", self.clock())

    def batch_end(self, trainer) -> None:
        self.meter.end_step(int(trainer.batch_size))
        self._ask()

    def epoch_end(self, trainer) -> None:
        self.epochs[-1]["train_end"] = self.clock()
        self.meter.pause()  # validation and checkpoints are not training steps

    def validation(self, edge: str) -> None:
        if self.stripped:  # final_eval's validation of best.pt: stamped from the stripping on
            return
        self.epochs[-1][f"val_{edge}"] = self.clock()

    def fit_epoch_end(self, trainer) -> None:
        if self.stripped:  # fired by final_eval after validating best.pt
            self.stamps["final_val_start"] = self.stamps["stripped"]
            self.stamp("final_val_end")
            self.stamps["weights_end"] = self.stamps["final_val_end"]
            return
        self.epochs[-1]["end"] = self.clock()
        self.stamp("last_epoch_end")

    def save(self, original):
        def save_model(trainer, *args, **kwargs):
            start = self.clock()
            out = original(trainer, *args, **kwargs)
            if self.epochs:
                self.epochs[-1].update(save_start=start, save_end=self.clock())
            return out

        return save_model

    def strip(self, original):
        def strip_optimizer(*args, **kwargs):
            out = original(*args, **kwargs)
            self.stripped = True
            self.stamp("stripped")
            self.stamps["weights_end"] = self.stamps["stripped"]  # moved on by the final validation, when it runs
            return out

        return strip_optimizer

    def to_dict(self) -> dict:
        return {"clock": "time.time()", "stamps": dict(self.stamps), "epochs": [dict(e) for e in self.epochs]}


def run(side_dir: Path) -> dict:
    side = json.loads((side_dir / "side.json").read_text())
    on_gpu = side["device"] != "cpu" and torch.cuda.is_available()
    device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
    monitor = GpuMonitor([0]) if on_gpu else None
    stamps = Stamps(StepMeter(device, skip_steps=METER_SKIP_STEPS, monitor=monitor, in_flight=1))
    plots = importlib.util.find_spec("polars") is not None

    ul_trainer.check_amp = lambda model: True  # the check downloads weights; see the module docstring
    ul_trainer.BaseTrainer.read_results_csv = lambda trainer: results.read_columns(trainer.csv)
    ul_trainer.strip_optimizer = stamps.strip(ul_trainer.strip_optimizer)
    ul_trainer.BaseTrainer.save_model = stamps.save(ul_trainer.BaseTrainer.save_model)

    task = side.get("task", "detect")
    yolo = YOLO(side["model"], task=task)
    for event, callback in stamps.callbacks().items():
        yolo.add_callback(event, callback)
    metrics = yolo.train(
        data=side["data"],
        epochs=side["epochs"],
        imgsz=side["imgsz"],
        batch=side["batch"],
        device=0 if on_gpu else "cpu",
        workers=side["workers"],
        optimizer="SGD",
        lr0=side["lr0"],
        close_mosaic=side["close_mosaic"],
        seed=side["seed"],
        plots=plots,
        project=str(side_dir),
        name="ultralytics",
        exist_ok=True,
    )
    stamps.stamp("train_returned")
    m = stamps.meter.summary()
    gpus = [vars(g) for g in monitor.stats()] if monitor else []
    if monitor:
        monitor.close()
    record = {
        "task": task,
        "trainer": type(yolo.trainer).__name__,
        # the box mAPs (a classifier's 0, as its summary.json's), then the task's own: mask or keypoint mAP, top-1
        **{m.key: float(metrics.results_dict.get(m.source, 0.0)) for m in BOX},
        **task_metrics(task, metrics.results_dict),
        "data_wait": m.data_wait if m.steps_measured else None,
        "host_wait": m.host_wait if m.steps_measured else None,
        "images_per_s": m.images_per_s if m.steps_measured else None,
        "steps_measured": m.steps_measured,
        "gpu_util": sum(g["util_mean"] for g in gpus) / len(gpus) if gpus else None,
        "plots": plots,
        "weights": str(side_dir / "ultralytics" / "weights" / "best.pt"),
        "timeline": stamps.to_dict(),
    }
    stamps.stamp("end")
    record["timeline"] = stamps.to_dict()
    (side_dir / "result.json").write_text(json.dumps(record, indent=2))
    return record


def scan(data_yaml: str, task: str = "detect") -> None:
    """Ultralytics' labels.cache of each split written for `task`, as its dataset writes it on a first run: both sides
    read it (its hash holds whether keypoints were read), so the benchmark scans once, before the first timed side. A
    classifier's `data_yaml` is its class folders: each split's *.cache, which ClassificationDataset writes."""
    from ultralytics.data import ClassificationDataset, YOLODataset
    from ultralytics.data.utils import check_cls_dataset, check_det_dataset

    if rules(task).folders:
        from ultralytics.cfg import get_cfg

        folders = check_cls_dataset(data_yaml)
        for split in ("train", "val"):
            ClassificationDataset(root=folders[split], args=get_cfg(), augment=False, prefix=split)
        return
    data = check_det_dataset(data_yaml)
    for split in ("train", "val"):
        YOLODataset(img_path=data[split], data=data, task=task, augment=False)


if __name__ == "__main__":
    if sys.argv[1] == "--scan":
        scan(*sys.argv[2:4])
    else:
        run(Path(sys.argv[1]).resolve())

"""The work around a training step, one hook per job (rank/loop/loop.py runs them; rank/run/runs.py orders them).

Hooks share the loop's TrainState (position, loss, metrics, stop) and get everything else at construction. A hook
that talks to the other ranks does so at the same point on every rank, and marks itself "waiting" in the heartbeat
while it does, so that the watchdog can tell a rank waiting for the others from a hung one.
"""

from __future__ import annotations

import gc
import signal
import time
from pathlib import Path

import torch

from launcher.plan.describe import THREAD_WORDS
from launcher.rank.data.pipeline import per_batch_ms
from launcher.rank.group.dist import Comm
from launcher.rank.loop.loop import Hook, TrainLoop
from launcher.rank.metrics import results
from launcher.rank.group.signals import StopSignal


def clear_memory(device: torch.device, threshold: float | None = None) -> None:
    """Ultralytics' _clear_memory: collect garbage and empty the CUDA cache, when more than `threshold` of the
    device's memory is reserved (always without a threshold)."""
    if device.type != "cuda":
        return
    if threshold and torch.cuda.memory_reserved(device) / torch.cuda.get_device_properties(device).total_memory <= threshold:
        return
    gc.collect()
    torch.cuda.empty_cache()


class LRSchedule(Hook):
    """Per-epoch lr (linear or cosine) and Ultralytics' warmup over the plan's `warmup_steps` optimizer steps."""

    def __init__(self, schedule, warmup_steps: int):
        self.schedule, self.warmup_steps = schedule, warmup_steps

    def before_train(self, loop: TrainLoop) -> None:
        self.schedule.start_at(loop.state.epoch)

    def before_epoch(self, loop: TrainLoop) -> None:
        self.schedule.begin_epoch()

    def before_step(self, loop: TrainLoop) -> None:
        if self.warmup_steps and loop.ni <= self.warmup_steps:
            self.schedule.warm_up(loop.ni, loop.state.epoch)


class ModelEpochs(Hook):
    """The network in training mode (frozen BatchNorms kept in eval) each epoch, and Ultralytics' end-of-epoch
    bookkeeping: the loss's per-epoch update (YOLO26's branch weights), the EMA's copied attributes. Mosaic closes
    in the input itself, by the epoch of each batch (rank/components.py): this hook only says so when it happens."""

    def __init__(self, *, train_mode, close_at: int | None, criterion, ema, net, log):
        self.train_mode, self.close_at = train_mode, close_at
        self.criterion, self.ema, self.net, self.log = criterion, ema, net, log

    def before_epoch(self, loop: TrainLoop) -> None:
        self.train_mode()
        if loop.state.epoch == self.close_at:
            self.log(f"mosaic closed for the last {loop.epochs - self.close_at} epoch(s)")

    def after_epoch(self, loop: TrainLoop) -> None:
        if hasattr(self.criterion, "update"):
            self.criterion.update()
        self.ema.update_attr(self.net, include=["yaml", "nc", "args", "names", "stride", "class_weights"])


class Meter(Hook):
    """Steady-state images/s and data wait (metrics/meter.py); validation and checkpoints are cut out."""

    def __init__(self, meter, inputs, monitor=None):
        self.meter, self.inputs, self.monitor = meter, inputs, monitor

    def before_step(self, loop: TrainLoop) -> None:
        self.meter.begin_step()

    def before_launch(self, loop: TrainLoop) -> None:
        self.meter.batch_ready(self.inputs.last_wait)

    def after_launch(self, loop: TrainLoop) -> None:
        self.meter.end_step(len(loop.batch["im_file"]))

    def after_epoch(self, loop: TrainLoop) -> None:
        self.meter.pause()

    def after_train(self, loop: TrainLoop) -> None:
        if self.monitor is not None:
            self.monitor.close()


class Heartbeat(Hook):
    """This rank's progress for the watchdog (heartbeat.py): working at every step."""

    def __init__(self, heartbeat):
        self.heartbeat = heartbeat

    def after_step(self, loop: TrainLoop) -> None:
        self.heartbeat.working(loop.ni)

    def after_train(self, loop: TrainLoop) -> None:
        self.heartbeat.close()


class FaultInjection(Hook):
    """DDP_LAUNCH_FAULT (rank/group/faults.py): the fault-tolerance tests' failures, at a chosen step."""

    def __init__(self, faults):
        self.faults = faults

    def after_step(self, loop: TrainLoop) -> None:
        self.faults.at_step(loop.ni)


class RecordSamples(Hook):
    """debug.record_samples: the images each epoch trained on, in the rank's report."""

    def __init__(self):
        self.seen: dict[int, list[str]] = {}

    def after_step(self, loop: TrainLoop) -> None:
        self.seen.setdefault(loop.state.epoch, []).extend(Path(f).name for f in loop.batch["im_file"])


class StopOnSignal(Hook):
    """SIGTERM/SIGINT (signals.py): every rank stops at the same step, rank 0 saves where the run stands, and the
    ranks exit 128 + signal. `save` is None for a run that keeps no checkpoint (a benchmark cell). Before the first
    step there is nothing to save: a signal then ends the rank at once, also one blocked in the process group's
    start-up (a handler would wait for it to return)."""

    def __init__(self, comm: Comm, heartbeat, inputs, save=None, log=print):
        self.comm, self.heartbeat, self.inputs, self.save, self.log = comm, heartbeat, inputs, save, log
        self.stop_signal = None

    def before_train(self, loop: TrainLoop) -> None:
        self.stop_signal = StopSignal(progress=self.heartbeat.progress)

    def after_step(self, loop: TrainLoop) -> None:
        self.heartbeat.waiting()
        signum = self.comm.max(self.stop_signal.signum)
        self.heartbeat.working()
        if not signum:
            return
        self.stop_signal.decided()  # every rank stops here; rank 0's checkpoint is written however long it takes
        epoch, step = loop.state.position
        told = "this rank" if self.stop_signal.signum else "another rank"  # a log that just ends says nothing
        self.log(f"[signal] stopping after epoch {epoch + 1} step {step}: {signal.Signals(signum).name} reached {told}")
        if self.save is not None and self.comm.rank == 0:
            self.save(loop)
            self.log(f"checkpoint saved at epoch {epoch + 1} step {step + 1}")
        self.inputs.close()
        self.comm.barrier()  # nobody leaves before rank 0's checkpoint is on disk
        raise SystemExit(128 + signum)

    def after_train(self, loop: TrainLoop) -> None:
        if self.stop_signal is not None:
            self.stop_signal.restore()


class ReadAhead(Hook):
    """Once, after this process's first step: `start()`, the validation loader's workers set reading the split, and a
    thread keeping it in host memory, while the epoch trains (FastValidator.read_ahead). After a step rather than
    before the first: the training loader's workers and threads are up by then (Ultralytics, too, forks a loader's
    workers only at its first iteration, not while another loader starts). After every later step: `advance()`, a
    slice of what was read copied to the device (FastValidator.place_ahead), so that the first validation finds the
    split there."""

    def __init__(self, start, advance=None):
        self.start, self.advance = start, advance

    def after_step(self, loop: TrainLoop) -> None:
        if self.start is not None:
            start, self.start = self.start, None
            start()
        elif self.advance is not None:
            self.advance()


class Evaluate(Hook):
    """Validation every `interval` epochs (0: none before the last) and after the last, decided the same way on every
    rank; at the end of a completed run, best.pt validated again when the last epoch was not the best (its metrics
    are the run's), its table with a row per class; else rank 0's `final_table()` writes the last validation's so."""

    def __init__(self, validate, validate_weights, best_weights, *, interval: int, comm: Comm, device, log,
                 final_table=None):
        self.validate, self.validate_weights, self.best_weights = validate, validate_weights, best_weights
        self.interval, self.comm, self.device, self.log = interval, comm, device, log
        self.final_table = final_table

    def after_epoch(self, loop: TrainLoop) -> None:
        state = loop.state
        if loop.final_epoch or (self.interval and (state.epoch + 1) % self.interval == 0):
            clear_memory(self.device, 0.5)
            metrics, fitness = self.validate(loop)
            state.validated_epochs.append(state.epoch + 1)
            if self.comm.rank == 0 and fitness is not None:
                state.metrics, state.fitness = metrics, fitness
                if state.best_fitness is None or state.best_fitness < fitness:
                    state.best_fitness = fitness
                if state.best_fitness == fitness:  # a tie moves best.pt to the later epoch, as in Ultralytics
                    state.fitness_epoch = state.epoch + 1
        clear_memory(self.device, 0.5)

    def after_train(self, loop: TrainLoop) -> None:
        state = loop.state
        if not loop.completed:
            return
        best = None
        if self.comm.rank == 0 and state.fitness_epoch not in (None, state.epoch + 1):
            best = self.best_weights()  # None when best.pt is missing
        if self.comm.rank0_decides(best is not None):
            if self.comm.rank == 0:
                self.log(f"validating best.pt (epoch {state.fitness_epoch})")
            metrics, _ = self.validate_weights(loop, best)
            if self.comm.rank == 0:
                state.metrics = metrics
        elif self.comm.rank == 0 and self.final_table is not None and state.validated_epochs:
            last = state.validated_epochs[-1]
            self.log(f"best.pt is epoch {last}'s, validated above" if state.fitness_epoch == last
                     else f"the last validation, epoch {last}'s")
            self.final_table()
        clear_memory(self.device)


class Plots(Hook):
    """Rank 0: labels.jpg at the start and, after the run's last epoch (the last one, or the early stop's: EarlyStop
    comes before this hook), results.png from results.csv, once, as Ultralytics' plot_metrics after its final_eval
    (drawn after every epoch, it took about a second of the CPU each time, beside the training). The plotter's thread
    draws it with the final validation's plots (runs._validate); the run ends once they are written, after the final
    weights (this hook comes after Checkpoint), or before, when an integration uploads them (Tracking)."""

    def __init__(self, plotter, results_csv: Path, labels: list[dict] | None, names: dict):
        self.plotter, self.results_csv, self.labels, self.names = plotter, results_csv, labels, names

    def before_train(self, loop: TrainLoop) -> None:
        if self.labels is not None:  # a classifier's data has no boxes to plot (None)
            self.plotter.labels(self.labels, self.names)

    def after_epoch(self, loop: TrainLoop) -> None:
        if loop.ending:
            self.plotter.results(self.results_csv)

    def after_train(self, loop: TrainLoop) -> None:
        self.plotter.close()


class ResultsCsv(Hook):
    """Rank 0: results.csv, a row per epoch in Ultralytics' format (metrics `nan` on epochs not validated)."""

    def __init__(self, path: Path, metric_keys: list[str], lrs, label_loss_items):
        self.path, self.metric_keys, self.lrs, self.label_loss_items = path, metric_keys, lrs, label_loss_items
        self.start = time.time()

    def before_train(self, loop: TrainLoop) -> None:
        self.start = time.time()
        results.keep_epochs(self.path, loop.state.epoch)  # a resumed run trains the epochs after its checkpoint

    def after_epoch(self, loop: TrainLoop) -> None:
        state = loop.state
        validated = state.validated
        keys = self.metric_keys + list(self.label_loss_items(state.tloss, "val"))
        shown = {k: (state.metrics.get(k, float("nan")) if validated else float("nan")) for k in keys}
        row = {**self.label_loss_items(state.tloss, "train"), **shown, **self.lrs()}
        results.append_row(self.path, state.epoch + 1, time.time() - self.start, row)


class EarlyStop(Hook):
    """Rank 0's early stop (Ultralytics' EarlyStopping): `patience` validated epochs without a better fitness; the
    last epoch stops too. The ranks agree on it at the epoch's end (AgreeToStop)."""

    def __init__(self, patience: int, log):
        self.patience, self.log = patience, log
        self.best_fitness, self.best_epoch = 0.0, 0

    def after_epoch(self, loop: TrainLoop) -> None:
        state = loop.state
        if state.validated and state.fitness is not None:
            state.stop |= self.stopped(state.epoch + 1, state.fitness)
        state.stop |= loop.final_epoch

    def stopped(self, epoch: int, fitness: float) -> bool:
        if fitness > self.best_fitness or self.best_fitness == 0:
            self.best_epoch, self.best_fitness = epoch, fitness
        if epoch - self.best_epoch >= self.patience:
            self.log(f"early stop: no better fitness for {self.patience} epochs; the best was epoch {self.best_epoch}")
            return True
        return False

    def state_dict(self) -> dict:
        return {"best_fitness": self.best_fitness, "best_epoch": self.best_epoch}

    def load_state_dict(self, state: dict) -> None:
        self.best_fitness, self.best_epoch = state["best_fitness"], state["best_epoch"]


class Checkpoint(Hook):
    """Rank 0: last.pt at every epoch end (best.pt when the epoch is the best, epoch<N>.pt every `save_period`),
    written while the next epoch trains (state.Checkpointer). The last epoch's (the last one, or the early stop's:
    EarlyStop comes before this hook) is written as the final weights at once (`final`). At the end of a run the write
    in flight is waited for and, when the run completed, `strip(written)` turns what is still a resumable checkpoint
    into the final weights (`written`: the files the final save wrote as such)."""

    def __init__(self, checkpointer, save_period: int, strip):
        self.checkpointer, self.save_period, self.strip = checkpointer, save_period, strip
        self.final_written: set[str] = set()

    def after_epoch(self, loop: TrainLoop) -> None:
        state = loop.state
        best = state.validated and state.fitness_epoch == state.epoch + 1
        periodic = self.save_period > 0 and state.epoch % self.save_period == 0
        self.checkpointer.save(best=best, epoch_copy=state.epoch if periodic else None, final=loop.ending)
        if loop.ending:
            self.final_written = {"last.pt", "best.pt"} if best else {"last.pt"}

    def after_train(self, loop: TrainLoop) -> None:
        self.checkpointer.wait()
        if loop.completed:
            self.strip(self.final_written)


class AgreeToStop(Hook):
    """The ranks take rank 0's stop decision at the epoch's end, so that none waits in a collective alone."""

    def __init__(self, comm: Comm, heartbeat):
        self.comm, self.heartbeat = comm, heartbeat

    def after_epoch(self, loop: TrainLoop) -> None:
        self.heartbeat.waiting()
        loop.state.stop = self.comm.rank0_decides(loop.state.stop)
        self.heartbeat.working()


class InputTime(Hook):
    """Where the GPU input pipeline's time went over the steps after the first `skip` (the kernels' compilation and
    the buffer's filling are not the steady state): its GPU time per image (decode, load, augment: gpu_input.GpuInput's
    events), and each of its threads' time per batch (TrainInputs.thread_times: waiting, working, blocked ahead)."""

    def __init__(self, gpu_input, inputs, skip: int):
        self.gpu_input, self.inputs, self.skip = gpu_input, inputs, skip
        self.ms = self.images = 0.0
        self._before: dict = {}
        self.threads: dict[str, dict] = {}  # per thread: pipeline.ThreadTime.per_batch_ms over the measured steps

    def before_step(self, loop) -> None:
        if loop.ni == self.skip:
            self.gpu_input.take_gpu_time()  # dropped: the warm-up's
            self._before = self.inputs.thread_times()

    def after_train(self, loop) -> None:
        self.ms, self.images = self.gpu_input.take_gpu_time()
        self.threads = per_batch_ms({name: t - self._before[name] if name in self._before else t
                                     for name, t in self.inputs.thread_times().items()})

    @property
    def ms_per_image(self) -> float | None:
        return self.ms / self.images if self.images else None

    def line(self) -> str | None:
        """The threads' figures for the rank's log, or None without them."""
        if not self.threads:
            return None
        return "the input's threads, ms per batch: " + "; ".join(
            f"{THREAD_WORDS.get(name, name)} waiting {t['waiting_ms']:.1f}, working {t['working_ms']:.1f}, ahead "
            f"{t['blocked_ms']:.1f}" for name, t in sorted(self.threads.items()))

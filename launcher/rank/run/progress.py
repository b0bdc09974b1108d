"""What a rank says about its training while it runs: the progress line (rank 0's becomes the console's live bar,
launch/logs.py), the time left, and the warning that the input cannot keep up."""

from __future__ import annotations

import math
import time

import torch

from launcher.plan.describe import input_bound_advice, input_thread_bound
from launcher.plan.task_rules import BOX, Metric
from launcher.rank.data.pipeline import per_batch_ms
from launcher.rank.loop.loop import Hook, TrainLoop

INPUT_BOUND = 0.10  # data wait above this share of step time: the GPU is starved
LINE_PERIOD_S = 1.5  # rank 0's progress line at least this often while steps end, so that the live bar moves


class Progress(Hook):
    """A line per rank every `every` steps and at each epoch end, and on rank 0 also after any step that ends
    `period_s` or more after its last line (a short epoch's bar moves too): losses, images/s, data wait, lr (and the
    learning-rate warmup's steps while it lasts), memory, the time left for the epoch and the run, and after a
    validation its `metrics` (the task's first two: mAP50 and mAP50-95, a classifier's top-1 and top-5); GPU
    utilisation at the epoch end. Whether a line is due is read on the host clock alone: a line reads the losses and
    the meter, which wait for the device, so only a due line costs a sync. The launcher shows rank 0's lines as a live
    bar on a terminal (launch/logs.py)."""

    def __init__(self, meter, optimizer, device: torch.device, rank: int, every: int, log, monitor=None, *,
                 warmup_steps: int = 0, period_s: float | None = LINE_PERIOD_S, clock=time.monotonic,
                 metrics: tuple[Metric, ...] = BOX):
        self.meter, self.optimizer, self.device, self.rank = meter, optimizer, device, rank
        self.every, self.log, self.monitor, self.warmup_steps = every, log, monitor, warmup_steps
        self.period_s = period_s if rank == 0 else None
        self.clock, self.metrics = clock, metrics
        self.eta = Eta(clock)
        self._last_line = clock()

    def before_epoch(self, loop: TrainLoop) -> None:
        self.eta.epoch_started()

    def after_step(self, loop: TrainLoop) -> None:
        self.eta.step_done()
        step = loop.state.step
        if step >= loop.steps_per_epoch:
            return  # the epoch's own line follows, after its validation
        by_steps = bool(self.every) and step % self.every == 0
        if by_steps or (self.period_s is not None and self.clock() - self._last_line >= self.period_s):
            self._line(loop)

    def after_epoch(self, loop: TrainLoop) -> None:
        self._line(loop, end_of_epoch=True)
        self.eta.epoch_ended()

    def _line(self, loop: TrainLoop, end_of_epoch: bool = False) -> None:
        self._last_line = self.clock()
        state = loop.state
        ips, wait = self.meter.recent()
        loss = {k: float(v) for k, v in (state.tloss or {}).items()}  # read once: on a GPU, it waits for the step
        losses = " ".join(f"{k.replace('_loss', '')} {v:.4g}" if k != "loss" else f"{v:.4g}"  # a classifier's: one
                          for k, v in loss.items())
        # the meter's rate leaves out the run's first steps (and each epoch's first): until then it has none
        speed = f"{ips:.1f} img/s, data wait {100 * wait:.0f}%" if ips else "img/s measuring..."
        lr = f"lr {self.optimizer.param_groups[0]['lr']:.5g}"
        if loop.ni < self.warmup_steps:
            lr += f" (warmup {loop.ni}/{self.warmup_steps})"
        line = (f"epoch {state.epoch + 1}/{loop.epochs} step {state.step}/{loop.steps_per_epoch} | loss {losses} | "
                f"{speed} | {lr}")
        left = self.eta.left(steps_in_epoch=loop.steps_per_epoch - state.step,
                             steps_after=(loop.epochs - state.epoch - 1) * loop.steps_per_epoch,
                             epochs_after=loop.epochs - state.epoch - 1)
        if left is not None:
            line += f" | eta epoch {clock_text(left[0])}, run {clock_text(left[1])}"
        if self.device.type == "cuda":
            line += f" | mem {torch.cuda.max_memory_allocated(self.device) / 2**30:.2f}G"
        if end_of_epoch and self.monitor is not None and self.monitor.available:
            line += " | GPU busy " + ", ".join(f"{g.util_mean:.0f}%" for g in self.monitor.stats())
        if any(not math.isfinite(v) for v in loss.values()):
            line += " | WARNING: the loss is not finite"
        if end_of_epoch and state.validated and self.rank == 0 and state.metrics:
            m = state.metrics
            line += " | " + " ".join(f"{x.words} {m.get(x.source, 0):.4f}" for x in self.metrics)
        self.log(line)


class Eta:
    """The time left, from what the run took so far: a step's wall time (its mean since the epoch's second step:
    the first one waits for workers and warm-up) and the last epoch boundary (validation, checkpoint, close_mosaic)."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.step_s: float | None = None
        self.boundary_s = 0.0  # the last epoch's end to the next epoch's first step, validation included
        self._epoch_first = self._last = self._ended = None
        self._steps = 0

    def epoch_started(self) -> None:
        self._epoch_first, self._steps = None, 0

    def step_done(self) -> None:
        now = self.clock()
        if self._ended is not None:
            self.boundary_s, self._ended = now - self._ended, None
        if self._epoch_first is None:
            self._epoch_first = now
        else:
            self._steps += 1
            self.step_s = (now - self._epoch_first) / self._steps
        self._last = now

    def epoch_ended(self) -> None:
        self._ended = self._last

    def left(self, *, steps_in_epoch: int, steps_after: int, epochs_after: int) -> tuple[float, float] | None:
        """(seconds left in this epoch, in the run), or None before a step's time is known."""
        if self.step_s is None:
            return None
        epoch = steps_in_epoch * self.step_s
        return epoch, epoch + steps_after * self.step_s + epochs_after * self.boundary_s


def clock_text(seconds: float) -> str:
    """1:02:03, 2:03 or 0:07."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class InputBoundWarning(Hook):
    """One line, once per run, when this rank waits for data more than INPUT_BOUND of its step time."""

    def __init__(self, meter, workers: int, log, monitor=None, *, gpu_input: bool = False, shared_cache: bool = True,
                 inputs=None):
        self.meter, self.workers, self.log, self.monitor = meter, workers, log, monitor
        self.gpu_input = gpu_input  # loader.augment_on=gpu: other settings help (describe.input_bound_advice)
        self.shared_cache = shared_cache  # the task has train.cache=shared (TaskRules.shared_cache)
        self.inputs = inputs  # TrainInputs: with the GPU input, its threads say which of them is the bound
        self.warned = False

    def after_epoch(self, loop: TrainLoop) -> None:
        m = self.meter.summary()
        if self.warned or m.steps_measured < 10 or m.data_wait <= INPUT_BOUND:
            return
        self.warned = True
        busy = ""
        if self.monitor is not None and self.monitor.available:
            busy = f" (GPU {min(g.util_mean for g in self.monitor.stats()):.0f} % busy)"
        threads = per_batch_ms(self.inputs.thread_times()) if self.inputs is not None else None
        bound = input_thread_bound(threads, m.step_ms) if threads else None
        self.log(f"WARNING input-bound: {100 * m.data_wait:.0f} % of step time waiting for data{busy}; "
                 f"{bound or input_bound_advice(self.gpu_input, self.workers, shared_cache=self.shared_cache)}")

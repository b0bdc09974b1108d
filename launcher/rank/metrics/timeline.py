"""Rank 0's timeline of a training run, in summary.json as `timeline`: where the wall clock went, from the command.

Wall-clock stamps (time.time(), rank 0's clock; the launcher and torchrun run on the same node) of: the launcher
command's start and torchrun's start (passed in the environment, plan/environment.py), this process's start and the
end of its imports (worker.py), the components built, the first step (its batch in hand), each epoch's training start
and end, its validation and its checkpoint write, the last epoch's end, the final validation, the final weights on
disk (checkpoints stripped) and the end. `ddp-bench bench.kind=time_to_model` turns it into a breakdown (bench/time_to_model.py).

Three hooks place the stamps (runs.py lists where): `TimelineEdges` first in the list (an epoch's start, the first
step, an epoch's training end, the last epoch's end), and `Timed` around the validation hook and the checkpoint hook
(a validation's start and end, each epoch's checkpoint write, the final validation, the stripped weights).
"""

from __future__ import annotations

import os
import time

from launcher.plan.environment import LAUNCH_STARTED, TORCHRUN_STARTED
from launcher.rank.loop.loop import Hook, TrainLoop


def _env_time(env, key: str) -> float | None:
    try:
        return float(env[key])
    except (KeyError, ValueError):
        return None  # started another way (the Python API, a SLURM job that does not export it)


class Timeline:
    """The stamps; `stamps` holds the process-level ones, `epochs` one dict per epoch trained."""

    def __init__(self, started: dict | None = None, env=os.environ, clock=time.time):
        self.clock = clock
        self.stamps: dict[str, float | None] = {"launcher_start": _env_time(env, LAUNCH_STARTED),
                                                "torchrun_start": _env_time(env, TORCHRUN_STARTED),
                                                **(started or {})}
        self.epochs: list[dict] = []
        self.setup: list[tuple[str, float]] = []  # the rank's set-up, part by part: (part, when it ended)
        self.setup_memory: dict[str, float] = {}  # GiB reserved on the GPU at each part's end

    def stamp(self, name: str, at: float | None = None) -> None:
        self.stamps[name] = self.clock() if at is None else at

    def epoch_stamp(self, name: str, at: float | None = None) -> None:
        self.epochs[-1][name] = self.clock() if at is None else at

    def to_dict(self) -> dict:
        return {"clock": "time.time() on rank 0", "stamps": dict(self.stamps), "epochs": [dict(e) for e in self.epochs],
                "setup": [{"part": part, "end": end, "reserved_gib": self.setup_memory.get(part)}
                          for part, end in self.setup]}


class TimelineEdges(Hook):
    """First in the hook list: an epoch's start before any other hook's work of it (closing mosaic is training),
    its training end before the validation, the last epoch's end before any after_train work; and the first step,
    stamped when its batch was in hand (the loop's wait for it is the start-up's)."""

    def __init__(self, timeline: Timeline, inputs, clock=time.time):
        self.timeline, self.inputs, self.clock = timeline, inputs, clock
        self._step_called: float | None = None

    def before_train(self, loop: TrainLoop) -> None:
        self.timeline.stamp("loop_start")

    def before_epoch(self, loop: TrainLoop) -> None:
        self.timeline.epochs.append({"epoch": loop.state.epoch + 1, "train_start": self.clock()})

    def before_step(self, loop: TrainLoop) -> None:
        if "first_step" not in self.timeline.stamps:
            self._step_called = self.clock()

    def after_step(self, loop: TrainLoop) -> None:
        if self._step_called is not None:
            self.timeline.stamp("first_step", self._step_called + self.inputs.last_wait)
            self._step_called = None

    def after_epoch(self, loop: TrainLoop) -> None:
        self.timeline.epoch_stamp("train_end")

    def after_train(self, loop: TrainLoop) -> None:
        if loop.completed:
            self.timeline.stamp("last_epoch_end")


class Timed(Hook):
    """A hook whose epoch-end and run-end work is stamped: `name` for an epoch's (kept when `keep(loop)`, e.g. the
    epoch was validated), `final` for the run's end (stamped `<final>_start` and `<final>_end`)."""

    def __init__(self, hook: Hook, timeline: Timeline, *, name: str | None, final: str, keep=lambda loop: True):
        self.hook, self.timeline, self.name, self.final, self.keep = hook, timeline, name, final, keep

    def before_train(self, loop: TrainLoop) -> None:
        self.hook.before_train(loop)

    def before_epoch(self, loop: TrainLoop) -> None:
        self.hook.before_epoch(loop)

    def before_step(self, loop: TrainLoop) -> None:
        self.hook.before_step(loop)

    def before_launch(self, loop: TrainLoop) -> None:
        self.hook.before_launch(loop)

    def after_launch(self, loop: TrainLoop) -> None:
        self.hook.after_launch(loop)

    def after_step(self, loop: TrainLoop) -> None:
        self.hook.after_step(loop)

    def after_epoch(self, loop: TrainLoop) -> None:
        start = self.timeline.clock()
        self.hook.after_epoch(loop)
        if self.name and self.keep(loop):
            self.timeline.epoch_stamp(f"{self.name}_start", start)
            self.timeline.epoch_stamp(f"{self.name}_end")

    def after_train(self, loop: TrainLoop) -> None:
        start = self.timeline.clock()
        self.hook.after_train(loop)
        if loop.completed:
            self.timeline.stamp(f"{self.final}_start", start)
            self.timeline.stamp(f"{self.final}_end")

"""The training loop: epochs of steps, and hooks around them.

The loop itself only fetches a batch, takes the step, and fetches the next batch while the GPU works. Everything
else a run does around its steps (the learning-rate schedule, metering, heartbeats, signals, validation,
checkpoints, progress lines, early stop) is a Hook. Hooks run in the order they are given; rank/run/runs.py makes the
list and says why each stands where it does. `after_train` runs in a `finally`, also when a step raised or a
signal stopped the run, so resources are always released; work that only a completed run does checks
`loop.completed`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from launcher.rank.loop.state import TrainState


class Hook:
    """Work around the steps. Every method is optional; `loop` is the TrainLoop running it."""

    def before_train(self, loop: TrainLoop) -> None: ...

    def before_epoch(self, loop: TrainLoop) -> None: ...

    def before_step(self, loop: TrainLoop) -> None: ...

    def before_launch(self, loop: TrainLoop) -> None:
        """The step's batch is in hand (`loop.batch`); its step is not launched yet."""

    def after_launch(self, loop: TrainLoop) -> None:
        """The step is launched (queued on the device); the next batch is not fetched ahead yet. The meter stamps
        the step's end here, so that a wait for the next batch is not counted as this step's work."""

    def after_step(self, loop: TrainLoop) -> None: ...

    def after_epoch(self, loop: TrainLoop) -> None: ...

    def after_train(self, loop: TrainLoop) -> None: ...


class Inputs(Protocol):
    """The training batches (rank/data/pipeline.py): on the device, the loader's delay measured."""

    last_wait: float  # seconds the host waited for the batch next() returned

    def begin_epoch(self, epoch: int, first_step: int, first_ni: int) -> None:
        """Start (or go on with) `epoch`'s batches from its step `first_step`, the run's step `first_ni`."""


    def next(self, ni: int) -> dict: ...

    def prefetch(self, ni: int) -> None: ...

    def close(self) -> None: ...


class Step(Protocol):
    """One optimizer step (rank/step/train_step.py's TrainStep): calling it launches the step on `batch`; then
    `loss_items` holds that step's loss terms by name, still on the device."""

    loss_items: dict | None

    def __call__(self, batch: dict) -> None: ...


class TrainLoop:
    """`steps_per_epoch` steps per epoch, from `state`'s position to `epochs`.

    `step(batch)` takes one optimizer step (rank/step/train_step.py); its `loss_items` are averaged into the state.
    Attributes the hooks read: `state`, `batch` (the last step's), `ni` (steps since the run started), `epochs`,
    `steps_per_epoch`, `completed`, `final_epoch`, `ending`.
    """

    def __init__(self, step: Step, inputs: Inputs, state: TrainState, hooks: Sequence[Hook], *,
                 epochs: int, steps_per_epoch: int):
        self.step, self.inputs, self.state, self.hooks = step, inputs, state, list(hooks)
        self.epochs, self.steps_per_epoch = epochs, steps_per_epoch
        self.batch: dict | None = None
        self.completed = False

    @property
    def ni(self) -> int:
        """The step being taken (or the next one), counted from the start of the run."""
        return self.state.epoch * self.steps_per_epoch + self.state.step

    @property
    def final_epoch(self) -> bool:
        return self.state.epoch + 1 >= self.epochs

    @property
    def ending(self) -> bool:
        """After this epoch the run ends: its last epoch, or an early stop (rank 0's state.stop, which EarlyStop sets in
        after_epoch: read it from a later hook)."""
        return self.final_epoch or self.state.stop

    def run(self) -> None:
        state = self.state
        try:
            self._call("before_train")
            for epoch in range(state.epoch, self.epochs):
                if epoch != state.epoch or state.step == 0:  # resumed mid-epoch: keep the mean of its first steps
                    state.epoch, state.step = epoch, 0
                    state.reset_loss()
                self._call("before_epoch")
                self.inputs.begin_epoch(epoch, state.step, self.ni)
                while state.step < self.steps_per_epoch:
                    self._call("before_step")
                    self._run_step()
                    state.step += 1
                    self._call("after_step")
                state.epoch_ended = True  # a checkpoint from here on continues at the next epoch
                self._call("after_epoch")
                state.epoch_ended = False
                if state.stop:
                    break
            self.completed = True
        finally:
            self._after_train()

    def _run_step(self) -> None:
        self.batch = self.inputs.next(self.ni)
        self._call("before_launch")
        self.step(self.batch)
        self._call("after_launch")
        if self.state.step + 1 < self.steps_per_epoch:
            self.inputs.prefetch(self.ni + 1)  # its copy (and augmentation) overlaps the step just launched
        self.state.add_loss(self.step.loss_items)

    def _call(self, event: str) -> None:
        for hook in self.hooks:
            getattr(hook, event)(self)

    def _after_train(self) -> None:
        """Every hook's after_train, also when one of them raises (the first error is raised after the others ran)."""
        error = None
        for hook in self.hooks:
            try:
                hook.after_train(self)
            except BaseException as e:  # noqa: PERF203 - each hook releases its own resources
                error = error or e
        if error is not None:
            raise error

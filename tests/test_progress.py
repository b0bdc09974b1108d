"""Rank 0's progress line (rank/run/progress.py) on a fake clock: due every log.interval_steps steps and whenever about
1.5 s passed since the last line, so that the console's bar moves on a short epoch; the losses (a host sync on a GPU)
and the meter read only when a line is due; the learning-rate warmup and the meter's own warm-up named apart."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from launcher.rank.loop.loop import TrainLoop
from launcher.rank.run.progress import LINE_PERIOD_S, Progress
from launcher.rank.loop.state import TrainState


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class DeviceValue:
    """A loss item on the device: arithmetic stays there; float() is a read, counted (on a GPU, a host sync)."""

    reads = 0

    def __init__(self, value: float):
        self.value = value

    def __mul__(self, k):
        return DeviceValue(self.value * k)

    def __add__(self, other):
        return DeviceValue(self.value + other.value)

    def __truediv__(self, k):
        return DeviceValue(self.value / k)

    def __float__(self) -> float:
        DeviceValue.reads += 1
        return self.value


class TimedStep:
    """Each step takes `seconds` on the clock."""

    def __init__(self, clock: Clock, seconds: float):
        self.clock, self.seconds, self.loss_items = clock, seconds, None

    def __call__(self, batch: dict) -> None:
        self.clock.now += self.seconds
        self.loss_items = {"box_loss": DeviceValue(1.0)}


class Inputs:
    last_wait = 0.0

    def begin_epoch(self, epoch: int, first_step: int, first_ni: int = 0) -> None: ...

    def next(self, ni: int) -> dict:
        return {"im_file": ["a.jpg"]}

    def prefetch(self, ni: int) -> None: ...

    def close(self) -> None: ...


class Meter:
    """The throughput meter: its rate appears once its warm-up steps are behind it (`measured_from`)."""

    def __init__(self, measured_from: int):
        self.measured_from, self.reads, self.loop = measured_from, 0, None

    def recent(self) -> tuple[float, float]:
        self.reads += 1
        return (40.0, 0.02) if self.loop.ni > self.measured_from else (0.0, 0.0)


def run(*, rank: int, step_s: float, steps: int = 12, every: int = 20, warmup: int = 0, measured_from: int = 0):
    clock, lines, meter = Clock(), [], Meter(measured_from)
    optimizer = SimpleNamespace(param_groups=[{"lr": 0.01}])
    progress = Progress(meter, optimizer, torch.device("cpu"), rank, every, lines.append, warmup_steps=warmup,
                        clock=clock)
    loop = TrainLoop(TimedStep(clock, step_s), Inputs(), TrainState(), [progress], epochs=2, steps_per_epoch=steps)
    meter.loop = loop
    DeviceValue.reads = 0
    loop.run()
    return lines, meter.reads, DeviceValue.reads


def steps_of(lines: list[str]) -> list[str]:
    return [line.split(" | ")[0] for line in lines]


def test_rank_0_writes_a_line_when_the_period_has_passed_even_between_the_interval_steps():
    lines, meter_reads, loss_reads = run(rank=0, step_s=0.4)  # 12 steps of 0.4 s, a line every 20 steps
    # about every 1.5 s: after 4 steps (1.6 s), 8, then the epoch's own line; the next epoch the same
    assert steps_of(lines) == ["epoch 1/2 step 4/12", "epoch 1/2 step 8/12", "epoch 1/2 step 12/12",
                               "epoch 2/2 step 4/12", "epoch 2/2 step 8/12", "epoch 2/2 step 12/12"]
    assert 4 * 0.4 >= LINE_PERIOD_S > 3 * 0.4
    # the losses and the meter are read for the lines alone, never at a step without one
    assert meter_reads == len(lines) and loss_reads == len(lines)


def test_the_interval_steps_still_give_their_lines_and_other_ranks_write_only_those():
    lines, _, _ = run(rank=0, step_s=0.01, every=5)  # fast steps: the interval comes before the period
    assert steps_of(lines)[:3] == ["epoch 1/2 step 5/12", "epoch 1/2 step 10/12", "epoch 1/2 step 12/12"]
    lines, meter_reads, loss_reads = run(rank=1, step_s=0.4, every=5)
    assert steps_of(lines) == ["epoch 1/2 step 5/12", "epoch 1/2 step 10/12", "epoch 1/2 step 12/12",
                               "epoch 2/2 step 5/12", "epoch 2/2 step 10/12", "epoch 2/2 step 12/12"]
    assert meter_reads == loss_reads == len(lines)


def test_the_learning_rate_warmup_is_named_and_told_apart_from_the_meters_warm_up():
    lines, _, _ = run(rank=0, step_s=0.4, warmup=10, measured_from=6)
    first, second, epoch_end = lines[:3]
    assert "lr 0.01 (warmup 4/10)" in first and "img/s measuring..." in first  # both warm-ups, each its own words
    assert "lr 0.01 (warmup 8/10)" in second and "40.0 img/s, data wait 2%" in second
    assert "warmup" not in epoch_end and "warming up" not in " ".join(lines)  # the warmup's 10 steps are done

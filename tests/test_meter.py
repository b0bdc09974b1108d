"""The steady-state window excludes warm-up steps and paused intervals; data wait is a share of step time."""

from __future__ import annotations

import pytest
import torch

from launcher.meter import StepMeter


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def run_steps(meter, clock, n, wait, compute, images=16):
    for _ in range(n):
        meter.wait_start()
        clock.t += wait
        meter.batch_ready()
        clock.t += compute
        meter.step_end(images)


def test_warm_up_steps_are_excluded_from_the_window():
    clock = FakeClock()
    meter = StepMeter(torch.device("cpu"), skip_steps=3, clock=clock)
    run_steps(meter, clock, 3, wait=5.0, compute=5.0)  # slow start: prefetch, autotuning
    run_steps(meter, clock, 10, wait=0.1, compute=0.9)
    s = meter.summary()
    assert s.steps_measured == 10
    assert s.images_per_s == pytest.approx(16.0)  # 16 images per 1 s step, the slow start left out
    assert s.data_wait == pytest.approx(0.1)


def test_pauses_do_not_count_as_training_time():
    clock = FakeClock()
    meter = StepMeter(torch.device("cpu"), skip_steps=0, clock=clock)
    run_steps(meter, clock, 5, wait=0.0, compute=1.0)
    meter.pause()
    clock.t += 100.0  # validation
    run_steps(meter, clock, 5, wait=0.0, compute=1.0)
    s = meter.summary()
    assert s.window_s == pytest.approx(10.0)  # ten 1 s steps; the 100 s pause is not in the window
    assert s.images_per_s == pytest.approx(16.0)

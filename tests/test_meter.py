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


def test_a_loader_delay_while_fetching_ahead_counts_as_the_next_batchs_wait():
    """With the next batch fetched during the current step (loader.fetch_ahead), the host finds it ready at once;
    the time the loader kept it waiting then is that batch's data wait, not lost."""
    clock = FakeClock()
    meter = StepMeter(torch.device("cpu"), skip_steps=1, clock=clock)
    for step in range(4):
        meter.wait_start()
        meter.batch_ready()  # fetched ahead (or, for the first, the skipped step): ready at once
        clock.t += 1.0  # the step, during which the next batch is fetched...
        if step < 3:
            meter.add_wait(0.3)  # ...and the loader made the host wait 0.3 s for it
        meter.step_end(16)
    s = meter.summary()
    assert s.steps_measured == 3
    assert s.data_wait == pytest.approx(0.3)
    assert s.images_per_s == pytest.approx(16.0)

"""The steady-state window excludes warm-up steps and paused intervals; data wait is a share of step time."""

from __future__ import annotations

import pytest
import torch

from launcher.rank.metrics.meter import StepMeter


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def run_steps(meter, clock, n, wait, compute, images=16):
    for _ in range(n):
        meter.begin_step()
        clock.t += wait  # the host waits for the batch...
        clock.t += compute  # ...then the step runs
        meter.end_step(images, wait)


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


class FakeEvent:
    """A CUDA event on a simulated GPU timeline: it completes at the GPU time the test gives when it is recorded."""

    def __init__(self, gpu, log):
        self.gpu, self.log, self.t = gpu, log, None

    def record(self):
        self.t = self.gpu.t
        self.log.append(("record", self))

    def synchronize(self):
        self.log.append(("wait", self))

    def elapsed_time(self, end):
        return (end.t - self.t) * 1000.0  # milliseconds, as torch.cuda.Event's


def test_with_a_step_in_flight_the_host_waits_for_the_previous_step_not_this_one():
    """train.steps_in_flight=1: the host queues step n+1 while the GPU runs step n, so the meter may wait only for
    step n-1's end; waiting for step n's (a synchronize per step) would drain the GPU at every step boundary."""
    gpu, log = FakeClock(), []
    meter = StepMeter(torch.device("cpu"), skip_steps=0, clock=FakeClock(), in_flight=1,
                      event_factory=lambda: FakeEvent(gpu, log))
    for step in range(4):
        meter.begin_step()  # the first call stamps the segment's start
        gpu.t += 0.5
        meter.end_step(16, 0.0)
        *_, previous, this = [e for kind, e in log if kind == "record"]
        waited = [e for kind, e in log if kind == "wait"]
        assert this not in waited  # the step just launched is still running
        assert step == 0 or previous in waited  # the step before has ended: the host is at most one step ahead
    assert meter.summary().steps_measured == 4  # the summary waits for the rest


def test_with_steps_in_flight_the_window_is_the_gpus_time_between_step_ends():
    """The stamps are the GPU's: a host that queues its steps at once does not make the run look faster."""
    gpu, log = FakeClock(), []
    host = FakeClock()
    meter = StepMeter(torch.device("cpu"), skip_steps=2, clock=host, in_flight=2,
                      event_factory=lambda: FakeEvent(gpu, log))
    for step in range(12):
        meter.begin_step()
        wait = 0.01 if step != 5 else 0.11  # the loader kept the host waiting 0.1 s once
        host.t += wait
        gpu.t += 0.5  # each step keeps the GPU busy 0.5 s, whatever the host's clock says
        meter.end_step(16, wait)
    s = meter.summary()
    assert s.steps_measured == 10
    assert s.window_s == pytest.approx(5.0)
    assert s.images_per_s == pytest.approx(32.0)
    assert s.data_wait == pytest.approx((10 * 0.01 + 0.1) / 5.0)
    assert [kind for kind, _ in log].count("wait") == 12  # every step's end accounted once


class QueuedGpu:
    """A GPU's queue on a simulated timeline: work runs in launch order and never before the host launched it; an
    event completes when the queue reaches it (at once on an idle GPU), as torch.cuda.Event's do."""

    def __init__(self, host: FakeClock):
        self.host, self.free_at = host, 0.0

    def launch(self, seconds: float) -> None:
        self.free_at = max(self.free_at, self.host.t) + seconds

    def event(self):
        gpu = self

        class Event:
            t = None

            def record(self):
                self.t = max(gpu.free_at, gpu.host.t)

            def synchronize(self):
                gpu.host.t = max(gpu.host.t, self.t)

            def elapsed_time(self, end):
                return (end.t - self.t) * 1000.0

        return Event()


def queued_steps(wait: float, gpu_s: float, steps: int = 12) -> tuple[float, float]:
    host = FakeClock()
    gpu = QueuedGpu(host)
    meter = StepMeter(torch.device("cpu"), skip_steps=2, clock=host, in_flight=2, event_factory=gpu.event)
    for _ in range(steps):
        meter.begin_step()
        host.t += wait  # the host waits for the batch...
        meter.batch_ready(wait)
        gpu.launch(gpu_s)  # ...then queues the step
        meter.end_step(16)
    s = meter.summary()
    return s.data_wait, s.host_wait


def test_a_wait_for_data_while_the_gpu_still_runs_queued_steps_is_not_data_wait():
    """The whole step captured lets the host queue steps ahead: it then waited for data 25 % of the time with the GPU
    95 % busy, and the meter called that input-bound. Only the wait that leaves the GPU idle counts."""
    data_wait, host_wait = queued_steps(wait=0.3, gpu_s=0.5)  # the host is ahead: the GPU never idles
    assert data_wait == pytest.approx(0.0)
    assert host_wait == pytest.approx(0.3 / 0.5)
    data_wait, host_wait = queued_steps(wait=0.8, gpu_s=0.5)  # the loader is the bound: 0.3 s idle per 0.8 s step
    assert data_wait == pytest.approx(0.3 / 0.8)
    assert host_wait == pytest.approx(1.0)


@pytest.mark.parametrize(("gpu_input", "advice"), [
    (False, "raise loader.workers (now 4) or set train.cache=ram"),
    (True, "set train.cache=shared (the files' bytes mapped once per node) or raise loader.workers (now 4); not "
           "train.cache=ram, which needs the CPU pipeline"),
])
def test_an_input_bound_rank_says_once_which_settings_feed_its_pipeline(gpu_input, advice):
    """train.cache=ram puts a run with loader.augment_on=auto on the CPU pipeline: no advice for the GPU input."""
    from types import SimpleNamespace

    from launcher.rank.run.progress import InputBoundWarning

    lines, wait = [], 0.05
    meter = SimpleNamespace(summary=lambda: SimpleNamespace(steps_measured=20, data_wait=wait))
    hook = InputBoundWarning(meter, 4, lines.append, gpu_input=gpu_input)
    hook.after_epoch(None)  # 5 %: fed
    wait = 0.25
    hook.after_epoch(None)
    hook.after_epoch(None)
    assert lines == [f"WARNING input-bound: 25 % of step time waiting for data; {advice}"]


def test_an_input_bound_rank_names_the_gpu_inputs_thread_that_bounds_it():
    """With the GPU input's thread figures: the decoding thread, busy a whole step per batch, is the bound (no
    worker or cache would help); when it waits for the loader instead, the workers' advice as before."""
    from types import SimpleNamespace

    from launcher.rank.data.pipeline import ThreadTime
    from launcher.rank.run.progress import InputBoundWarning

    meter = SimpleNamespace(summary=lambda: SimpleNamespace(steps_measured=20, data_wait=0.2, step_ms=45.0))
    lines = []
    for decode in (ThreadTime(0.05, 4.4, 0.05, 100), ThreadTime(3.0, 0.5, 0.0, 100)):
        inputs = SimpleNamespace(thread_times=lambda d=decode: {"decode": d, "prepare": ThreadTime(2.5, 1.5, 0.5, 100)})
        InputBoundWarning(meter, 4, lines.append, gpu_input=True, inputs=inputs).after_epoch(None)
    assert lines[0] == ("WARNING input-bound: 20 % of step time waiting for data; the input's decode thread (reads "
                        "the loader's batches, decodes) bounds it: 44 ms of work a batch against a 45 ms step, busy "
                        "98 % of its time; more loader workers or a cache would not help")
    assert lines[1].endswith("; set train.cache=shared (the files' bytes mapped once per node) or raise "
                             "loader.workers (now 4); not train.cache=ram, which needs the CPU pipeline")

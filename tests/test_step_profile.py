"""The step profile's timeline (metrics/step_profile.py): from a Chrome trace to where each step's time went."""

import pytest
import torch

from launcher.rank.loop.loop import TrainLoop
from launcher.rank.metrics.step_profile import ProfileSteps, describe, timeline
from launcher.rank.loop.state import TrainState


def kernel(ts, dur, stream):
    return {"ph": "X", "cat": "kernel", "ts": ts, "dur": dur, "args": {"stream": stream}}


def op(ts, dur, tid, name="aten::copy_"):
    return {"ph": "X", "cat": "cpu_op", "ts": ts, "dur": dur, "tid": tid, "name": name}


def test_idle_shared_and_host_threads_per_step():
    # two steps of 1,000 us on the GPU's timeline: the step's stream 7 busy 0-400 and 500-900 (two kernels overlap
    # at 100-200), the input's stream 20 at 300-450 (100 us beside a step kernel) and a copy at 950-960
    events = [kernel(0, 200, 7), kernel(100, 300, 7), kernel(500, 400, 7), kernel(300, 150, 20),
              {"ph": "X", "cat": "gpu_memcpy", "ts": 950, "dur": 10, "args": {"stream": 20}},
              kernel(990, 10, 7),
              op(0, 500, 1, "Optimizer.step"), op(100, 100, 1), op(600, 100, 1), op(700, 100, 2), {"ph": "i", "cat": "cpu_op", "ts": 5, "tid": 3}]
    t = timeline({"traceEvents": events}, steps=2)
    assert t["window_ms"] == pytest.approx(0.5)  # 1,000 us over 2 steps
    assert t["step_stream_busy_ms"] == pytest.approx((400 + 400 + 10) / 2e3)
    assert t["other_streams_busy_ms"] == pytest.approx(160 / 2e3)
    assert t["shared_ms"] == pytest.approx(100 / 2e3)
    # no stream busy: 450-500, 900-950, 960-990
    assert t["idle_ms"] == pytest.approx(130 / 2e3)
    assert t["host_threads_ms"] == [0.3, 0.05]  # the nested op counts once; the busiest thread first
    assert t["host_threads_top"] == [{"Optimizer.step": 0.25, "aten::copy_": 0.05}, {"aten::copy_": 0.05}]
    assert "no stream busy 0.1 ms (13 %)" in describe(t)


def test_a_trace_without_gpu_work_is_refused():
    with pytest.raises(ValueError, match="no GPU work"):
        timeline({"traceEvents": [op(0, 10, 1)]}, steps=1)


def test_a_cpu_profile_is_the_operators_table_alone(tmp_path):
    """bench.profile on a CPU cell: profile.txt with the host's operators; no timeline (there is no GPU's)."""
    from torch.profiler import ProfilerActivity, profile

    from launcher.rank.metrics.step_profile import write

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        (torch.ones(64, 64) @ torch.ones(64, 64)).sum()
    assert write(prof, tmp_path, "profile", "2 data-free steps", 2) is None
    text = (tmp_path / "profile.txt").read_text()
    assert text.startswith("2 data-free steps") and "aten::mm" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile.txt"]


class _Inputs:
    last_wait = 0.0

    def begin_epoch(self, *args):
        pass

    def next(self, ni):
        return {"im_file": ["a"]}

    def prefetch(self, ni):
        pass

    def close(self):
        pass


def profile_a_loop(folder, device, work) -> list[bool]:
    """An 8-step loop whose steps run `work`, steps 2-4 profiled; which steps ran under the profiler."""
    profiled, paused = [], []

    class Step:
        loss_items: dict = {}

        def __call__(self, batch):
            profiled.append(hook.prof is not None)
            work()

    hook = ProfileSteps(2, 3, folder, device, log=lambda line: None, then=lambda: paused.append(True))
    TrainLoop(Step(), _Inputs(), TrainState(), [hook], epochs=1, steps_per_epoch=8).run()
    assert paused == [True]  # once, after the window: the meter's pause
    return profiled


def test_the_step_profile_covers_exactly_its_steps_and_then_lets_the_meter_pause(tmp_path):
    x = torch.ones(64, 64)
    profiled = profile_a_loop(tmp_path, torch.device("cpu"), lambda: x @ x)
    assert profiled == [False, False, True, True, True, False, False, False]
    text = (tmp_path / "profile-steps.txt").read_text()
    assert text.startswith("3 steps of the loop") and "aten::mm" in text

"""A per-rank throughput meter: steady-state images/s and the share of step time the GPU waited for data.

Method (docs/benchmarks/README.md): stamp the end of every optimizer step when the GPU finished it, not when the
host queued it; drop the first `skip_steps` steps (prefetched batches, cuDNN autotuning, allocator warm-up), and
report images / (t_last - t_skip). Intervals spent elsewhere (validation, checkpoints) are cut out with pause().

    meter.begin_step()                 # before the step's batch is fetched
    meter.batch_ready(wait_s)          # the batch in hand after `wait_s` on the host; the step not yet launched
    meter.end_step(images)             # once the step is launched

Data wait is the host's wait for each step's batch (the input pipeline measures it: rank/data/pipeline.py) counted
only while the GPU had no step left to run: with steps in flight the host waits for the next batch while the GPU
still runs the steps it queued, and that wait costs nothing. So each step's wait is capped by the GPU's idle time
before it, from the previous step's end to the moment its batch was ready (both stamped on the GPU's timeline).
`host_wait` is the host's wait in all (the input pipeline's own margin). Without stamps on the GPU (the CPU, or
in_flight 0, which drains the GPU at every step) the two are the same.

How a step's end is stamped on a GPU (`in_flight`):
- 0: `torch.cuda.synchronize()`, then the host clock. Every step boundary then drains the GPU's queue: the GPU idles
  while the host launches the first kernels of the next step, so the meter itself slows a host-bound step.
- N >= 1 (the trainer's default, `train.steps_in_flight`): a CUDA event (with timing) recorded at the step's end;
  the window is the GPU's own time between those events. The host waits only for the event N steps back, so it queues
  the next step while the GPU still runs this one, and never runs more than N steps ahead (memory, error reporting).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch


@dataclass
class MeterSummary:
    images_per_s: float
    data_wait: float  # fraction of the measured window the GPU idled while the host waited for the next batch
    steps_measured: int
    window_s: float
    step_ms: float  # mean step time (wait included) over the window
    host_wait: float = 0.0  # fraction of the window the host waited for batches, whether or not the GPU was busy


class StepMeter:
    def __init__(
        self,
        device: torch.device,
        skip_steps: int = 10,
        sync: bool = True,
        clock=time.perf_counter,
        monitor=None,
        in_flight: int = 0,
        event_factory=None,
    ):
        self.device = device
        self.monitor = monitor  # a GpuMonitor sampling only while the window is open
        self.skip_steps = skip_steps
        self.sync = sync and device.type == "cuda"
        self.clock = clock
        # stamps are CUDA events when the host may run ahead of the GPU; host clock readings otherwise
        self.in_flight = max(0, int(in_flight)) if self.sync or event_factory else 0
        self._event = event_factory or (lambda: torch.cuda.Event(enable_timing=True))
        self.steps = 0
        self._last_end = None  # stamp at the end of the previous step (None: the next step starts a new segment)
        # steps stamped but not yet accounted: (start stamp, batch-ready stamp, end stamp, images, wait, measured)
        self._pending = deque()
        self._ready: tuple[object, float] | None = None  # this step's batch-ready stamp and the host's wait for it
        self.window_s = 0.0
        self.window_wait_s = 0.0  # the GPU idle for data
        self.window_host_wait_s = 0.0
        self.window_images = 0
        self.window_steps = 0
        # the most recent interval, for progress lines
        self._recent = [0.0, 0.0, 0]  # seconds, wait seconds, images

    def _stamp(self):
        """Now, on the GPU's timeline: an event queued behind the work launched so far, or a synchronised clock."""
        if self.in_flight:
            event = self._event()
            event.record()
            return event
        if self.sync:
            torch.cuda.synchronize(self.device)
        return self.clock()

    def _seconds(self, start, end) -> float:
        if self.in_flight:
            return start.elapsed_time(end) / 1000.0  # both have completed: _settle waited for `end`
        return end - start

    def _settle(self, keep: int) -> None:
        """Account the oldest stamped steps until at most `keep` remain unfinished on the GPU, waiting for each."""
        while len(self._pending) > keep:
            start, ready, end, images, wait, measured = self._pending.popleft()
            if self.in_flight:
                end.synchronize()
            if not measured:
                continue
            dt = self._seconds(start, end)
            idle = wait if ready is None else max(0.0, self._seconds(start, ready))  # the GPU's, before this step
            self.window_s += dt
            self.window_host_wait_s += wait
            wait = min(wait, idle)
            self.window_wait_s += wait
            self.window_images += images
            self.window_steps += 1
            self._recent[0] += dt
            self._recent[1] += wait
            self._recent[2] += images

    def begin_step(self) -> None:
        """Call before fetching the step's batch: the first step of the run, or after a pause, opens a segment."""
        if self._last_end is None:
            self._last_end = self._stamp()
            if self.monitor is not None:
                self.monitor.active = self.steps >= self.skip_steps

    def batch_ready(self, wait_s: float) -> None:
        """Call once the step's batch is in hand, after the host waited `wait_s` for it, before the step is launched:
        with steps in flight, stamps the moment on the GPU's timeline (the GPU's idle time before the step ends
        there)."""
        self._ready = (self._stamp() if self.in_flight and self._last_end is not None else None, wait_s)

    def end_step(self, images: int, wait_s: float | None = None) -> None:
        """Call once the step is launched: stamps the step's end, then lets at most `in_flight` steps run on
        unaccounted. The host's wait for the batch is batch_ready's, or `wait_s` (then all of it counts as data
        wait: nothing says whether the GPU had work)."""
        end = self._stamp()
        ready, wait = self._ready or (None, wait_s or 0.0)
        self._ready = None
        self.steps += 1
        if self._last_end is not None:
            self._pending.append((self._last_end, ready, end, images, wait, self.steps > self.skip_steps))
        if self.monitor is not None:
            self.monitor.active = self.steps >= self.skip_steps  # the next step is measured
        self._last_end = end
        self._settle(self.in_flight)

    def pause(self) -> None:
        """Validation, checkpointing: the time until the next step is not training time."""
        self._settle(0)
        self._last_end = None
        if self.monitor is not None:
            self.monitor.active = False

    def recent(self) -> tuple[float, float]:
        """(images/s, data-wait fraction) since the last call; (0, 0) before the window opens."""
        self._settle(0)
        seconds, wait, images = self._recent
        self._recent = [0.0, 0.0, 0]
        return (images / seconds, wait / seconds) if seconds > 0 else (0.0, 0.0)

    def totals(self) -> tuple[float, float, int]:
        """(seconds, data-wait seconds, images) measured so far: two readings' difference is a part of the run's."""
        self._settle(0)
        return self.window_s, self.window_wait_s, self.window_images

    def summary(self) -> MeterSummary:
        self._settle(0)
        w = self.window_s
        return MeterSummary(
            images_per_s=self.window_images / w if w > 0 else 0.0,
            data_wait=self.window_wait_s / w if w > 0 else 0.0,
            steps_measured=self.window_steps,
            window_s=w,
            step_ms=1000 * w / self.window_steps if self.window_steps else 0.0,
            host_wait=self.window_host_wait_s / w if w > 0 else 0.0,
        )

"""A per-rank throughput meter: steady-state images/s and the share of step time spent waiting for data.

Method (../shared/notes/measurement.md): stamp the end of every optimizer step (after a CUDA synchronize, so the
stamp is when the GPU finished, not when the host queued the work), drop the first `skip_steps` steps (prefetched
batches, cuDNN autotuning, allocator warm-up), and report images / (t_last - t_skip). Data wait is the time from the
end of one step until the next batch is on the device, summed over the same window. Intervals spent elsewhere
(validation, checkpoints) are cut out with pause()/resume().
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class MeterSummary:
    images_per_s: float
    data_wait: float  # fraction of the measured window spent waiting for the next batch
    steps_measured: int
    images_measured: int
    window_s: float
    step_ms: float  # mean step time (wait included) over the window


class StepMeter:
    def __init__(self, device: torch.device, skip_steps: int = 10, sync: bool = True, clock=time.perf_counter, monitor=None):
        self.device = device
        self.monitor = monitor  # a GpuMonitor sampling only while the window is open
        self.skip_steps = skip_steps
        self.sync = sync and device.type == "cuda"
        self.clock = clock
        self.steps = 0
        self._last_end: float | None = None  # end of the previous step (None: the next step starts a new segment)
        self._wait_start = 0.0
        self._wait = 0.0  # this step's wait
        self._ahead_wait = 0.0  # time spent waiting for this step's batch while it was fetched ahead (add_wait)
        self.window_s = 0.0
        self.window_wait_s = 0.0
        self.window_images = 0
        self.window_steps = 0
        # the most recent interval, for progress lines
        self._recent = [0.0, 0.0, 0]  # seconds, wait seconds, images

    def _now(self) -> float:
        if self.sync:
            torch.cuda.synchronize(self.device)
        return self.clock()

    def wait_start(self) -> None:
        """Call before fetching the next batch."""
        if self._last_end is None:  # first step of the run or after a pause: a new segment starts here
            self._last_end = self._now()
            if self.monitor is not None:
                self.monitor.active = self.steps >= self.skip_steps
        self._wait_start = self.clock()

    def batch_ready(self) -> None:
        """Call once the batch's host-to-device copy is issued. Host time: the copy itself overlaps the GPU's queue,
        and a second synchronisation per step would cost more than it tells."""
        self._wait = self.clock() - self._wait_start + self._ahead_wait
        self._ahead_wait = 0.0

    def add_wait(self, seconds: float) -> None:
        """The next batch was fetched ahead, during the previous step, and the loader made the host wait this long:
        counted as that batch's data wait. Conservative: the GPU was still busy with the previous step for part of
        that time, so the real starvation is at most this."""
        self._ahead_wait += seconds

    def step_end(self, images: int) -> None:
        end = self._now()
        self.steps += 1
        if self._last_end is not None and self.steps > self.skip_steps:
            dt = end - self._last_end
            self.window_s += dt
            self.window_wait_s += self._wait
            self.window_images += images
            self.window_steps += 1
            self._recent[0] += dt
            self._recent[1] += self._wait
            self._recent[2] += images
        if self.monitor is not None:
            self.monitor.active = self.steps >= self.skip_steps  # the next step is measured
        self._last_end = end

    def pause(self) -> None:
        """Validation, checkpointing: the time until the next step is not training time."""
        self._last_end = None
        if self.monitor is not None:
            self.monitor.active = False

    def recent(self) -> tuple[float, float]:
        """(images/s, data-wait fraction) since the last call; (0, 0) before the window opens."""
        seconds, wait, images = self._recent
        self._recent = [0.0, 0.0, 0]
        return (images / seconds, wait / seconds) if seconds > 0 else (0.0, 0.0)

    def summary(self) -> MeterSummary:
        w = self.window_s
        return MeterSummary(
            images_per_s=self.window_images / w if w > 0 else 0.0,
            data_wait=self.window_wait_s / w if w > 0 else 0.0,
            steps_measured=self.window_steps,
            images_measured=self.window_images,
            window_s=w,
            step_ms=1000 * w / self.window_steps if self.window_steps else 0.0,
        )

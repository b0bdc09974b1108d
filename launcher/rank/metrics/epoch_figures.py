"""ddp-launch's own figures of each epoch, for the tracking integrations (log.integrations) beside Ultralytics'
metrics: the job's images/s, data wait, GPU utilisation and peak GPU memory, under the names and in the units of
summary.json (metrics/run_summary.py), prefixed "ddp_launch/".

Each rank measures its own epoch (the meter's steady-state steps, the GPU monitor's samples in the epoch); the ranks'
figures are combined as summary.json combines the run's: images/s summed (the ranks run concurrently), the worst data
wait, the least busy GPU, the fullest one. An epoch that measured nothing (the run's first steps are warm-up) has no
images/s or data wait.
"""

from __future__ import annotations

import torch

from launcher.rank.loop.loop import Hook, TrainLoop

PREFIX = "ddp_launch/"


class EpochFigures(Hook):
    """Every rank, after each epoch (after the meter paused): its figures gathered from every rank (a collective, at
    the same point on each), combined into `latest`, which rank 0's tracking reads."""

    def __init__(self, meter, monitor, device: torch.device, comm, heartbeat):
        self.meter, self.monitor, self.device, self.comm, self.heartbeat = meter, monitor, device, comm, heartbeat
        self._meter_before = (0.0, 0.0, 0)
        self._gpus_before: dict[int, tuple[float, int]] = {}
        self.latest: dict[str, float] = {}

    def after_epoch(self, loop: TrainLoop) -> None:
        mine = self._mine()
        self.heartbeat.waiting()
        everyone = self.comm.gather(mine)
        self.heartbeat.working()
        self.latest = combined(everyone)

    def _mine(self) -> dict:
        now = self.meter.totals()
        seconds, wait, images = (a - b for a, b in zip(now, self._meter_before))
        self._meter_before = now
        busy = []
        if self.monitor is not None and self.monitor.available:
            for g in self.monitor.stats():
                total = (g.util_mean * g.samples, g.samples)
                before = self._gpus_before.get(g.index, (0.0, 0))
                self._gpus_before[g.index] = total
                if total[1] > before[1]:
                    busy.append((total[0] - before[0]) / (total[1] - before[1]))
        memory = torch.cuda.max_memory_reserved(self.device) / 2**30 if self.device.type == "cuda" else None
        return {"seconds": seconds, "wait_s": wait, "images": images, "gpu_util": busy, "memory_gib": memory}


def combined(ranks: list[dict]) -> dict[str, float]:
    """The job's figures of an epoch from every rank's, each only where some rank measured it."""
    out = {}
    measured = [r for r in ranks if r["seconds"] > 0 and r["images"] > 0]
    if measured:
        out[f"{PREFIX}images_per_s"] = sum(r["images"] / r["seconds"] for r in measured)
        out[f"{PREFIX}data_wait"] = max(r["wait_s"] / r["seconds"] for r in measured)
    busy = [u for r in ranks for u in r["gpu_util"]]
    if busy:
        out[f"{PREFIX}gpu_util"] = min(busy)
    memory = [r["memory_gib"] for r in ranks if r["memory_gib"] is not None]
    if memory:
        out[f"{PREFIX}memory_peak_reserved_gib"] = max(memory)
    return out

"""Where a training step's time goes with its input pipeline running: torch.profiler over a few of the loop's real
steps (`bench.profile=true`), read as a timeline.

The data-free ceiling's profile (rank/run/runs.py) says what the step's kernels cost. This one says why the loop runs
below that ceiling: whether the GPU idles (no kernel on any stream: the host did not queue the step in time),
whether the input's kernels share the SMs with the step's (two streams busy at once), and which host threads were
busy. `timeline(trace)` is a pure function of a Chrome trace (torch.profiler's export), so it is tested on a
hand-made one.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from launcher.rank.loop.loop import Hook, TrainLoop

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")  # what occupies a stream in torch.profiler's trace
HOST_CATEGORIES = ("cpu_op", "cuda_runtime", "cuda_driver")  # a host thread's operators and their CUDA calls
TOP_OPERATIONS = 8  # per host thread in the summary


def activities(device: torch.device) -> list[ProfilerActivity]:
    """What torch.profiler records on `device`: the host's operators, and on CUDA the GPU's work."""
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Time covered by both of two unions of intervals."""
    total, j = 0.0, 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            total += max(0.0, min(end, b[k][1]) - max(start, b[k][0]))
            k += 1
    return total


def timeline(trace: dict, steps: int) -> dict:
    """The GPU's and the host's time over a profiled window of `steps` steps, in ms per step.

    The step's stream is the one with the most busy time; every other stream is the input's (or a copy's). `idle`:
    no stream busy (the host had not queued work); `shared`: the step's stream busy while another was too (the
    input's kernels take SMs from the step); `host_threads`: each host thread's busy time in profiled operations,
    the busiest first, and its operators that took longest."""
    busy: dict[int, list[tuple[float, float]]] = defaultdict(list)
    threads: dict[int, list[tuple[float, float, str]]] = defaultdict(list)
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or "dur" not in e:
            continue
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        if e.get("cat") in GPU_CATEGORIES:
            busy[int(e.get("args", {}).get("stream", e.get("tid", 0)))].append(span)
        elif e.get("cat") in HOST_CATEGORIES:
            threads[int(e.get("tid", 0))].append((*span, str(e.get("name", "?"))))
    if not busy:
        raise ValueError("the profile holds no GPU work: profile a CUDA run")
    streams = {s: _union(v) for s, v in busy.items()}
    step_stream = max(streams, key=lambda s: _length(streams[s]))
    everything = _union([x for v in streams.values() for x in v])
    start, end = everything[0][0], everything[-1][1]
    window = end - start
    others = _union([x for s, v in streams.items() if s != step_stream for x in v])
    step_busy = streams[step_stream]
    ms = 1e-3 / max(steps, 1)  # trace times are in microseconds
    host = sorted(((_length(_union([x[:2] for x in v])), _outermost(v)) for v in threads.values()),
                  key=lambda x: -x[0])
    return {
        "steps": steps,
        "window_ms": window * ms,
        "step_stream_busy_ms": _length(step_busy) * ms,
        "other_streams_busy_ms": _length(others) * ms,
        "shared_ms": _overlap(step_busy, others) * ms,
        "idle_ms": (window - _length(everything)) * ms,
        "host_threads_ms": [round(busy * ms, 3) for busy, _ in host],
        # each busy thread's outermost operations, the longest first: what its time went to (ms per step)
        "host_threads_top": [{name: round(t * ms, 3) for name, t in top[:TOP_OPERATIONS]} for _, top in host[:4]],
    }


def _outermost(ops: list[tuple[float, float, str]]) -> list[tuple[str, float]]:
    """A thread's time per operation name, counting only operations no other one encloses, the longest first."""
    totals: dict[str, float] = defaultdict(float)
    end = float("-inf")
    for start, stop, name in sorted(ops, key=lambda x: (x[0], -x[1])):
        if start >= end:  # not inside the last outermost one
            totals[name] += stop - start
            end = stop
    return sorted(totals.items(), key=lambda x: -x[1])


def describe(t: dict) -> str:
    w = t["window_ms"]
    pct = lambda v: f"{100 * v / w:.0f} %" if w else "-"  # noqa: E731
    return (f"{t['steps']} steps, {w:.1f} ms per step on the GPU's timeline: the step's stream busy "
            f"{t['step_stream_busy_ms']:.1f} ms ({pct(t['step_stream_busy_ms'])}), the input's streams "
            f"{t['other_streams_busy_ms']:.1f} ms ({pct(t['other_streams_busy_ms'])}, {t['shared_ms']:.1f} ms of it "
            f"beside the step's kernels), no stream busy {t['idle_ms']:.1f} ms ({pct(t['idle_ms'])}); host threads "
            f"busy in profiled operations (ms per step): {', '.join(f'{v:.1f}' for v in t['host_threads_ms'][:6])}"
            + "".join(f"\n  thread {k + 1}: " + ", ".join(f"{name} {v:.2f}" for name, v in top.items())
                      for k, top in enumerate(t["host_threads_top"])))


class ProfileSteps(Hook):
    """torch.profiler over steps [first, first + steps) of the loop, the input's threads included; writes
    `profile-steps.txt` (the timeline in words and the operators' table) and `profile-steps.json` into `folder`,
    then calls `then` (the meter's pause: writing the trace is no step's time). The profiler slows the host, so
    these steps are not measured (rank/run/runs.py measures the steps after them)."""

    def __init__(self, first: int, steps: int, folder: Path, device: torch.device, log=print, then=lambda: None):
        self.first, self.steps, self.folder, self.log, self.then = first, steps, Path(folder), log, then
        self.device, self.cuda = device, device.type == "cuda"
        self.prof = None

    def before_step(self, loop: TrainLoop) -> None:
        if loop.ni == self.first:
            self.prof = profile(activities=activities(self.device))
            self.prof.start()

    def after_step(self, loop: TrainLoop) -> None:
        if self.prof is not None and loop.ni >= self.first + self.steps:  # ni: the next step's, after one
            self._finish()

    def after_train(self, loop: TrainLoop) -> None:
        if self.prof is not None:  # the loop ended inside the window
            self._finish()

    def _finish(self) -> None:
        prof, self.prof = self.prof, None
        if self.cuda:
            torch.cuda.synchronize()
        prof.stop()
        write(prof, self.folder, "profile-steps", f"{self.steps} steps of the loop, its input pipeline running",
              self.steps, self.log)
        self.then()


def write(prof, folder: Path, name: str, title: str, steps: int, log=print) -> dict | None:
    """A stopped profiler's record as `name`.txt: the title, on CUDA the timeline in words (also `name`.json, and
    one log line), the operators by GPU time, then by host time."""
    folder = Path(folder)
    table = prof.key_averages().table
    text, summary = [title], None
    if any(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events()):
        trace = folder / f"{name}.trace.json"
        prof.export_chrome_trace(str(trace))
        summary = timeline(json.loads(trace.read_text()), steps)
        trace.unlink()  # tens of MB; the summary and the tables say what it showed
        text += [describe(summary), table(sort_by="self_device_time_total", row_limit=40)]
        (folder / f"{name}.json").write_text(json.dumps(summary, indent=1))
        log(f"{name}: {text[1]}")
    text.append(table(sort_by="self_cpu_time_total", row_limit=25))
    (folder / f"{name}.txt").write_text("\n\n".join(text))
    return summary

"""A hung rank fails the run within `dist.timeout_s`, by name.

When one rank stops (a deadlock, a stuck file system, an infinite loop), the others wait in their next collective
and, left alone, NCCL or gloo would time out with a message about a collective, not about the rank that caused it
(and Ultralytics waits 3 hours). Here every rank publishes its state to the rendezvous store once a second:
"working" (training, validating) or "waiting" (at a step-boundary agreement), with the time it last changed and a
beat count. Rank 0 watches them all. The hung rank is, first, one whose beats stopped (a frozen process: SIGSTOP, a
stalled node), however the others look: they wait for it inside a collective; else the rank(s) behind in step count;
else a rank still "working" with no change for `timeout_s` while the others wait. Rank 0 writes only the hung ranks'
names into the run folder (the earliest is the run's root cause) and ends the job; torchrun stops the rest.

The process group's own timeout is set longer than this one (rank/group/dist.py), so this diagnosis comes first.
"""

from __future__ import annotations

import json
import os
import threading
import time

from launcher.run_folder import RunFolder

KEY = "ddp_launch/heartbeat/{}"
EXIT_HUNG = 70  # EX_SOFTWARE


class Heartbeat:
    def __init__(self, store, rank: int, world_size: int, timeout_s: float, folder: RunFolder, *,
                 period_s: float = 1.0, clock=time.time, exit=os._exit, thread: bool = True):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout_s, self.folder, self.period_s = timeout_s, folder, period_s
        self.clock, self._exit = clock, exit
        self.state, self.step, self.changed = "starting", 0, clock()
        self.beats = 0
        self._seen: dict[int, tuple[int, float]] = {}  # rank 0: each rank's last beat count, and when it changed
        self._done = threading.Event()
        if thread:
            threading.Thread(target=self._run, daemon=True, name="heartbeat").start()

    def working(self, step: int | None = None) -> None:
        self.state, self.step, self.changed = "working", self.step if step is None else step, self.clock()

    def waiting(self, step: int | None = None) -> None:
        self.state, self.step, self.changed = "waiting", self.step if step is None else step, self.clock()

    def progress(self) -> tuple[str, float]:
        """(state, when it last changed): what a stopping rank watches (signals.StopSignal)."""
        return self.state, self.changed

    def close(self) -> None:
        self._done.set()

    def _run(self) -> None:
        while not self._done.wait(self.period_s):
            try:
                self.publish()
                if self.rank == 0:
                    self.watch()
            except Exception:  # the store is gone: the job is ending; torchrun has the last word
                return

    def publish(self) -> None:
        self.beats += 1
        self.store.set(KEY.format(self.rank), json.dumps([self.state, self.step, self.changed, self.beats]))

    def watch(self) -> list[int]:
        """Rank 0: the ranks hung for longer than the timeout (each recorded as the run's failure, then the job
        ends with EXIT_HUNG); [] while every rank makes progress or some have not published yet."""
        now = self.clock()
        states = {}
        for r in range(self.world_size):
            if not self.store.check([KEY.format(r)]):
                return []  # a rank has not published yet (store.get would block until it does)
            states[r] = json.loads(self.store.get(KEY.format(r)))
        if any(s[0] == "starting" for s in states.values()):
            return []  # not every rank is training yet (dataset scans, the first CUDA graph capture)
        silent = self._silent(states, now)
        stuck = [r for r, (state, _, changed, *_) in states.items()
                 if state == "working" and now - changed > self.timeout_s]
        if not stuck and not silent:
            return []
        hung = silent or self._behind(states, stuck)
        others = [r for r in states if r not in hung]
        for r in hung:
            step, idle = states[r][1], now - states[r][2]
            silence = now - self._seen[r][1]
            why = f"; its process stopped answering: no heartbeat for {silence:.0f} s" if r in silent else ""
            message = (
                f"rank {r} made no progress for {idle:.0f} s (after step {step}{why}); "
                + (f"rank(s) {', '.join(map(str, others))} waited for it. " if others else "")
                + f"Stopping the run (dist.timeout_s={self.timeout_s:g})"
            )
            print(f"[watchdog] {message}", flush=True)
            self.folder.record_failure(r, f"hung: {message}", phase="train", when=states[r][2], step=step)
        self._exit(EXIT_HUNG)
        return hung

    def _silent(self, states: dict[int, list], now: float) -> list[int]:
        """The other ranks whose beat count has not moved for `timeout_s` on this rank's clock: frozen processes
        (a clock of this rank's own, so no two hosts' clocks are compared)."""
        for r, record in states.items():
            beats = record[3] if len(record) > 3 else 0
            if self._seen.get(r, (None,))[0] != beats:
                self._seen[r] = (beats, now)
        return [r for r in states if r != self.rank and now - self._seen[r][1] > self.timeout_s]

    @staticmethod
    def _behind(states: dict[int, list], stuck: list[int]) -> list[int]:
        """Of the stuck ranks, those at the lowest step: a rank a step ahead waits in a collective for them."""
        lowest = min(states[r][1] for r in stuck)
        return [r for r in stuck if states[r][1] == lowest]


class NoHeartbeat:
    """A single process has nobody to watch it."""

    def working(self, step: int | None = None) -> None: ...

    def waiting(self, step: int | None = None) -> None: ...

    def progress(self) -> None:
        return None  # nothing measured: a stopping process counts from the signal

    def close(self) -> None: ...

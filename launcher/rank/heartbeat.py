"""A hung rank fails the run within `dist.timeout_s`, by name.

When one rank stops (a deadlock, a stuck file system, an infinite loop), the others wait in their next collective
and, left alone, NCCL or gloo would time out with a message about a collective, not about the rank that caused it
(and Ultralytics waits 3 hours). Here every rank publishes its state to the rendezvous store once a second:
"working" (training, validating) or "waiting" (at a step-boundary agreement), with the time it last changed. Rank 0
watches them all: a rank still "working" with no change for `timeout_s` while the others wait is the hung one.
Rank 0 writes its name into the run folder and ends the job; torchrun stops the rest.

The process group's own timeout is set longer than this one (rank/dist.py), so this diagnosis comes first.
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
        self._done = threading.Event()
        if thread:
            threading.Thread(target=self._run, daemon=True, name="heartbeat").start()

    def working(self, step: int | None = None) -> None:
        self.state, self.step, self.changed = "working", self.step if step is None else step, self.clock()

    def waiting(self, step: int | None = None) -> None:
        self.state, self.step, self.changed = "waiting", self.step if step is None else step, self.clock()

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
        self.store.set(KEY.format(self.rank), json.dumps([self.state, self.step, self.changed]))

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
        stuck = [r for r, (state, _, changed) in states.items() if state == "working" and now - changed > self.timeout_s]
        if not stuck:
            return []
        waiting = [r for r, s in states.items() if s[0] == "waiting"]
        for r in stuck:
            step, idle = states[r][1], now - states[r][2]
            message = (
                f"rank {r} made no progress for {idle:.0f} s (after step {step}); "
                + (f"rank(s) {', '.join(map(str, waiting))} waited for it. " if waiting else "")
                + f"Stopping the run (dist.timeout_s={self.timeout_s:g})"
            )
            print(f"[watchdog] {message}", flush=True)
            self.folder.record_failure(r, f"hung: {message}", phase="train", when=states[r][2], step=step)
        self._exit(EXIT_HUNG)
        return stuck


class NoHeartbeat:
    """A single process has nobody to watch it."""

    def working(self, step: int | None = None) -> None: ...

    def waiting(self, step: int | None = None) -> None: ...

    def close(self) -> None: ...

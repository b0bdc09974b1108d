"""Stopping on a signal without losing work: finish the step, agree across ranks, checkpoint, exit 128+signal.

torchrun passes SIGTERM to each rank's whole process group (the rank and its DataLoader workers). The rank only
notes the signal; at every step boundary the ranks agree on it (rank/run/hooks.py, StopOnSignal: a one-element
all-reduce), so all take the same decision at the same step and none is left waiting in a collective the others
never join. DataLoader workers ignore the signal: the rank shuts them down itself once its checkpoint is safe.

A rank whose torchrun is gone (killed outright, with or without the launcher) sends itself the same SIGTERM
(`stop_when_orphaned`), so it saves and exits instead of training on with nobody to stop it; its DataLoader workers
exit when the rank does (torch's workers watch their parent).
"""

from __future__ import annotations

import os
import signal
import threading
import time

HANDLED = (signal.SIGTERM, signal.SIGINT)


class StopSignal:
    """Notes SIGTERM or SIGINT in `signum`. A rank that makes no progress for `grace_s` after the signal exits
    128 + signal without a new checkpoint: one hung, or blocked in a collective with a peer that is. Progress is
    `progress()`, (state, time of its last change) as the heartbeat publishes it: a rank still stepping or validating
    (a loaded machine, a long validation) is waited for, and so is one "waiting" at a step-boundary agreement (its
    peers decide: their own grace ends them, and the collective with them). Once the ranks have agreed to stop
    (`decided()`), the checkpoint is written whatever it takes; torchrun's shutdown timeout is the backstop."""

    def __init__(self, grace_s: float = 20.0, exit=os._exit, progress=None, period_s: float = 1.0, clock=time.time):
        self.signum = 0
        self.grace_s, self.period_s = grace_s, period_s
        self._exit, self._progress, self._clock = exit, progress, clock
        self._decided = threading.Event()
        self._since = 0.0
        self._previous = {s: signal.signal(s, self._note) for s in HANDLED}

    def _note(self, signum, _frame) -> None:
        # No output here: the handler runs between two bytecodes of the main thread, which may be inside a print to
        # the same stream (a validation's progress), and a second write would raise there ("reentrant call").
        first, self.signum = not self.signum, signum  # at once: a second signal can interrupt this handler
        if first:
            self._since = self._clock()
            threading.Thread(target=self._watch, args=(signum,), daemon=True, name="stop-grace").start()

    def decided(self) -> None:
        """The ranks agreed to stop at this step boundary: no more giving up, the checkpoint is written."""
        self._decided.set()

    def _watch(self, signum: int) -> None:
        print(f"[signal] {signal.Signals(signum).name}: finishing the step, then saving a checkpoint", flush=True)
        while not self._decided.wait(self.period_s):
            state, changed = (self._progress() if self._progress else None) or ("working", self._since)
            idle = self._clock() - max(self._since, changed)
            if state != "waiting" and idle > self.grace_s:
                print(f"[signal] no progress for {idle:.0f} s since {signal.Signals(signum).name}: exiting without a "
                      "new checkpoint", flush=True)
                self._exit(128 + signum)
                return

    def restore(self) -> None:
        self._decided.set()
        for s, h in self._previous.items():
            signal.signal(s, h)


def ignore_termination_in_worker() -> None:
    """For DataLoader workers: survive the rank's SIGTERM/SIGINT; the rank ends them after checkpointing."""
    for s in HANDLED:
        signal.signal(s, signal.SIG_IGN)


def stop_when_orphaned(period_s: float = 1.0, getppid=os.getppid, kill=os.kill, sleep=time.sleep,
                       thread: bool = True) -> None:
    """Watch this process's parent (torchrun) once every `period_s`: when it dies, the rank is re-parented, its parent
    pid changes, and it sends itself SIGTERM (StopSignal then stops it at the next step, with a checkpoint)."""
    parent = getppid()

    def watch() -> None:
        while getppid() == parent:
            sleep(period_s)
        print(f"[signal] torchrun (pid {parent}) is gone: stopping this rank", flush=True)
        kill(os.getpid(), signal.SIGTERM)

    if thread:
        threading.Thread(target=watch, daemon=True, name="parent-watch").start()
    else:
        watch()

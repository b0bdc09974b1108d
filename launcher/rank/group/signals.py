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
    """Notes SIGTERM or SIGINT in `signum`. A rank that does not reach a step boundary within `grace_s` of the
    signal exits 128 + signal without a new checkpoint."""

    def __init__(self, grace_s: float = 20.0, exit=os._exit):
        self.signum = 0
        self.grace_s = grace_s  # below torchrun's 30 s before it SIGKILLs the ranks
        self._exit = exit
        self._previous = {s: signal.signal(s, self._note) for s in HANDLED}

    def _note(self, signum, _frame) -> None:
        if not self.signum:
            print(f"[signal] {signal.Signals(signum).name}: finishing the step, then saving a checkpoint", flush=True)
            # A rank that cannot reach a step boundary (hung, or deep in a long validation) still ends in time.
            timer = threading.Timer(self.grace_s, self._give_up, args=(signum,))
            timer.daemon = True
            timer.start()
        self.signum = signum

    def _give_up(self, signum: int) -> None:
        print(f"[signal] no step boundary within {self.grace_s:g} s: exiting without a new checkpoint", flush=True)
        self._exit(128 + signum)

    def restore(self) -> None:
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

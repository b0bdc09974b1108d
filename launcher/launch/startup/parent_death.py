"""The parent-death request: a child the launcher starts is sent a signal when the launcher dies, however it dies.

Its own module, with nothing but the standard library beneath it: ddp-launch asks for it first thing, for the
torchrun and the bytecode compilation it starts before it has imported anything else (cli.py).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h

# What torchrun gets when the launcher dies without a word: the SIGTERM of a Ctrl-C, so that it stops the ranks as
# on one (and its rendezvous store lives until they have). The kernel sends it each time the child's parent *thread*
# dies, and a launcher killed outright loses its threads one by one (the child is re-parented to the next): torchrun
# gets it two or three times (seen with perf's signal tracepoints). The second restarts its shutdown once (its
# run()'s finally), which signals every rank again and waits for them; a third ends torchrun without waiting, and a
# rank left alone stops itself on seeing it gone (signals.stop_when_orphaned). Every rank stops at the same step.
PARENT_DEATH_SIGNAL = signal.SIGTERM


def parent_death_signal(signum: int = PARENT_DEATH_SIGNAL):
    """A preexec_fn that has the child sent `signum` when this process dies, however it dies (Linux prctl); None
    where there is no prctl. libc's prctl is looked up here, before the fork: the child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before the request took effect
            os.kill(os.getpid(), signum)

    return preexec

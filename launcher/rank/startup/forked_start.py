"""A rank forked from the warm torchrun (launch/startup/rank_fork.py decides when) is given what a fresh interpreter
started by torchrun would have: the signal dispositions the warm torchrun started with (torchrun's agent installs its
own before it starts the ranks), a session of its own (as torchrun gives each subprocess), none of torchrun's sockets
(its rendezvous store's listening one above all), the rank's command line in sys.argv and sys.path, a process name,
and the plan's thread counts, which a fresh interpreter reads as it loads torch and numpy."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import signal
import stat
import sys
from collections.abc import Mapping

from launcher.machine.libraries import cuda_driver_started, mapped, openblas_setter
from launcher.plan.environment import FORK_RANKS

PR_SET_NAME = 15  # linux/prctl.h: the name ps -o comm and top show (15 bytes)


def become_rank(signals: Mapping[int, object], run_dir: str, rank: int) -> None:
    """First thing in a rank just forked from the warm torchrun."""
    for s, handler in signals.items():
        signal.signal(s, handler if handler is not None else signal.SIG_DFL)
    maps = mapped()
    # torchrun's agent started CUDA after the warm torchrun's last look (rank_fork.py). A fork may not see it (the
    # driver can answer "not initialised" there); torch's own check then stops the rank at its first CUDA call.
    if cuda_driver_started(maps):
        raise SystemExit(f"ddp-launch: this rank was forked after CUDA started in torchrun and cannot use the GPU; "
                         f"run again with {FORK_RANKS}=0 (and report it: launch/startup/rank_fork.py)")
    os.setsid()
    _close_inherited_sockets()
    sys.argv = [importlib.util.find_spec("launcher.rank.worker").origin, run_dir]  # as `python -m` sets them
    if sys.path:
        sys.path[0] = os.getcwd()
    _set_process_name(f"ddp-rank{rank}")
    _apply_thread_counts(os.environ, maps)


def _close_inherited_sockets() -> None:
    """torchrun's sockets are no rank's; the pipes that carry the rank's result back to torchrun are not sockets."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if fd > 2 and stat.S_ISSOCK(os.fstat(fd).st_mode):
                os.close(fd)
        except OSError:
            pass  # the listing's own descriptor, already closed


def _set_process_name(name: str) -> None:
    try:
        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _apply_thread_counts(env: Mapping[str, str], maps: str) -> None:
    """torch.set_num_threads sets OpenMP's and MKL's count, OpenBLAS's setter its own (the warm torchrun refuses
    to fork where numpy's OpenBLAS has none)."""
    import torch

    threads = env.get("OMP_NUM_THREADS") or env.get("MKL_NUM_THREADS")
    if threads and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    blas = env.get("OPENBLAS_NUM_THREADS")
    setter = openblas_setter(maps) if blas and blas.isdigit() and int(blas) > 0 else None
    if setter is not None:
        setter(int(blas))

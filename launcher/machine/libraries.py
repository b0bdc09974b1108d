"""What a process has loaded, read from /proc/self/maps: the CUDA driver (a process forked after it started cannot
use the GPU; one forked while it is only mapped can), and numpy's OpenBLAS (its thread count is read once, as it
loads, and set only through its own call). Used on both sides of a rank forked from the warm torchrun
(launch/startup/rank_fork.py, rank/startup/forked_start.py)."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

CUDA_ERROR_NOT_INITIALIZED = 3  # cuda.h: every driver call's answer before cuInit
OPENBLAS_SETTERS = ("openblas_set_num_threads", "openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
                    "scipy_openblas_set_num_threads64_")  # the names numpy's and scipy's builds export


def mapped() -> str:
    """This process's /proc/self/maps ("" where there is none)."""
    try:
        with open("/proc/self/maps") as f:
            return f.read()
    except OSError:
        return ""


def _paths(maps: str) -> set[str]:
    return {line.split()[-1] for line in maps.splitlines() if "/" in line}


def cuda_driver_started(maps: str) -> bool:
    """Whether this process has started the CUDA driver (cuInit: torch's first CUDA call, or cudaGetDeviceCount
    behind torch.cuda.is_available()). Mapped is not started: importing a CUDA build of torch maps libcuda.so
    (cuBLASLt loads it) and calls nothing in it. Until cuInit, cuDeviceGetCount answers CUDA_ERROR_NOT_INITIALIZED
    and starts nothing; a driver that cannot be asked counts as started."""
    drivers = sorted(p for p in _paths(maps) if os.path.basename(p).startswith("libcuda.so"))
    if not drivers:
        return False
    for name in (*drivers, "libcuda.so.1"):
        try:
            lib = ctypes.CDLL(name, mode=getattr(os, "RTLD_NOLOAD", 0))  # the loaded one, never another
        except OSError:
            continue
        count = ctypes.c_int()
        return lib.cuDeviceGetCount(ctypes.byref(count)) != CUDA_ERROR_NOT_INITIALIZED
    return True


def openblas_loaded(maps: str) -> bool:
    return any("openblas" in os.path.basename(p).lower() for p in _paths(maps))


def openblas_setter(maps: str) -> Callable[[int], None] | None:
    """The thread-count setter of the OpenBLAS this process has loaded (numpy's), or None."""
    for path in sorted(p for p in _paths(maps) if "openblas" in os.path.basename(p).lower()):
        try:
            lib = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0))
        except OSError:
            continue
        for name in OPENBLAS_SETTERS:
            setter = getattr(lib, name, None)
            if setter is not None:
                return lambda n, f=setter: f(ctypes.c_int(n))
    return None

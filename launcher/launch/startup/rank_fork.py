"""Ranks forked from the warm torchrun, which has already imported torch and Dynamo, instead of fresh interpreters.

A rank started by torchrun as `python -m launcher.rank.worker` imports torch again, and its optimizer's first call
imports Dynamo: seconds, on the start-up's critical path (docs/benchmarks/cpu-fresh-start/ has the figures). The
warm torchrun (warm_torchrun.py) has time to spare while the launcher plans: it imports both, and then has
torchrun start the ranks as a function (`--start-method fork`, torch.distributed.elastic's MultiprocessContext)
that runs the same worker.main. Each rank begins with those modules in memory, copy-on-write.

Only where that changes nothing a rank can see (`refusal` says why not, and torchrun then starts fresh interpreters,
as it always did):
- Every environment variable the rank gets, other than those read only after the fork (`AFTER_FORK`), holds the
  value the warm torchrun had when it imported: what torch, numpy or tqdm read as they load cannot be handed over.
  The thread counts are the exception: the rank applies them (torch's intra-op pool, numpy's OpenBLAS).
- The CUDA driver was not started in the warm torchrun, up to the fork: a process forked after cuInit cannot use the
  GPU, and torch refuses CUDA to forks of a process that asked torch.cuda.is_available() by the CUDA runtime. The
  driver is mapped there (a CUDA build of torch maps it as it loads), which is harmless; torchrun's launch config asks
  whether CUDA is there, which the warm torchrun has NVML answer (`cuda_asked_by_nvml`).
- The command is the plain rank entry of torchrun_command: `--module launcher.rank.worker RUN_DIR`.

What a fresh interpreter would have, a forked rank is given first thing (rank/startup/forked_start.py); its
/proc/PID/cmdline stays the warm torchrun's. The warm torchrun reaches the rank's entry (worker.forked) by the module
name torchrun would run, as torchrun does: the launch and rank rooms do not import each other. DDP_LAUNCH_FORK_RANKS=0
turns it off.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
from collections.abc import Mapping

from launcher.machine.libraries import cuda_driver_started, mapped, openblas_loaded, openblas_setter
from launcher.plan.environment import FORK_RANKS

WORKER_MODULE = "launcher.rank.worker"  # the rank's entry: `--module` of torchrun's command line, `forked` in it
# Read after the fork, by torchrun's argument parser, the rank, Ultralytics, matplotlib, gloo or NCCL; or applied
# to the rank's libraries as it starts (the thread counts). Anything else must match the warm torchrun's imports.
AFTER_FORK = frozenset({
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
    "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "MPLCONFIGDIR", "MPLBACKEND", "HF_HUB_OFFLINE",
    # read when a rank first touches CUDA, which the warm torchrun never does (refusal)
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_MAX_CONNECTIONS",
    "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",  # read by torchrun's agent (launch/torchrun.py), never by a rank
})
AFTER_FORK_PREFIXES = ("DDP_LAUNCH_", "PET_", "TORCHELASTIC_", "YOLO_", "NCCL_", "TORCH_NCCL_")
# Dispositions torchrun's agent changes before it starts the ranks (its signals_to_handle, and the launcher's USR1).
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
# The ones torchrun's agent catches before it starts the ranks (PContext.start): exec resets a caught signal to its
# default, so a fresh rank has the default whatever its caller ignored (a background job ignores SIGINT).
AGENT_CAUGHT = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
PRELOADED = ("torch._dynamo", WORKER_MODULE)  # what the warm torchrun imports beyond torchrun, for the ranks
# torch.cuda.is_available() answered by NVML's count: no cuInit, and torch leaves the process's forks able to use CUDA
NVML_CUDA_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


def enabled(env: Mapping[str, str] = os.environ) -> bool:
    return env.get(FORK_RANKS, "1") != "0"


def preload() -> None:
    """In the warm torchrun, after torchrun's own imports: what every rank would import next."""
    for name in PRELOADED:
        importlib.import_module(name)


def rank_entry():
    """The function torchrun calls in each forked rank: worker.forked(run_dir, signals)."""
    return importlib.import_module(WORKER_MODULE).forked


def environment_differences(imported_with: Mapping[str, str], rank_env: Mapping[str, str]) -> list[str]:
    """The variables a forked rank would see with another value than the warm torchrun imported with, which a fresh
    interpreter would read at its start (sorted)."""
    keys = set(imported_with) | set(rank_env)
    return sorted(k for k in keys if imported_with.get(k) != rank_env.get(k)
                  and k not in AFTER_FORK and not k.startswith(AFTER_FORK_PREFIXES))


def refusal(imported_with: Mapping[str, str], rank_env: Mapping[str, str], argv: list[str],
            maps: str | None = None) -> str | None:
    """Why the ranks of torchrun command line `argv` (its arguments) cannot be forked from the warm torchrun that
    imported with `imported_with` (its environment then); None when they can. `maps`: /proc/self/maps' text."""
    if not enabled(rank_env):
        return f"{FORK_RANKS}=0"
    if argv[-3:-1] != ["--module", WORKER_MODULE]:
        return "the command is not the rank entry point"
    differ = environment_differences(imported_with, rank_env)
    if differ:
        return "the ranks' environment differs from the warm torchrun's in " + ", ".join(differ[:5])
    maps = mapped() if maps is None else maps
    if cuda_driver_started(maps):
        return "the CUDA driver was started in the warm torchrun"
    if openblas_loaded(maps) and rank_env.get("OPENBLAS_NUM_THREADS") and openblas_setter(maps) is None:
        return "numpy's OpenBLAS has no thread-count setter to apply OPENBLAS_NUM_THREADS with"
    return None


@contextlib.contextmanager
def cuda_asked_by_nvml():
    """While torchrun builds its launch config: it asks torch.accelerator.is_available(), which otherwise starts the
    CUDA driver (cudaGetDeviceCount), and torch then refuses CUDA to every fork of this process."""
    before = os.environ.get(NVML_CUDA_CHECK)
    os.environ[NVML_CUDA_CHECK] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(NVML_CUDA_CHECK, None)
        else:
            os.environ[NVML_CUDA_CHECK] = before


def cuda_started_since() -> str | None:
    """Why the ranks cannot be forked after all, once torchrun's agent has run up to the fork (NVML missing, say, so
    that torch's check started CUDA): None when they can."""
    return "torchrun started the CUDA driver (no NVML to ask)" if cuda_driver_started(mapped()) else None


def saved_signals() -> dict[int, object]:
    """The dispositions to hand to the ranks, as a fresh interpreter started by torchrun would have them: taken in the
    warm torchrun before torchrun's agent installs its own. An ignored signal stays ignored across exec (the SLURM
    job's USR1) unless the agent catches it; a caught one becomes the default (SIGINT's: Python's KeyboardInterrupt)."""
    return {s: _after_exec(s, signal.SIG_DFL if s in AGENT_CAUGHT else signal.getsignal(s)) for s in SIGNALS}


def _after_exec(signum: int, disposition) -> object:
    if disposition is signal.SIG_IGN:
        return signal.SIG_IGN
    return signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL

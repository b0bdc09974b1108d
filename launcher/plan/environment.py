"""The environment every rank starts with: offline Ultralytics, thread counts, NCCL and torch.distributed toggles.

Pure functions building plain dicts: the plan holds the result (a dry run prints it, torchrun and job.sbatch pass
it on). The files the offline settings point at are written by launch/ultralytics_home.py before any rank starts.
"""

from __future__ import annotations

import os
from pathlib import Path

# NCCL_DEBUG levels users set; VERSION only prints the version line.
NCCL_DEBUG_LEVELS = ("VERSION", "WARN", "INFO", "TRACE")
TORCH_DEBUG_LEVELS = ("OFF", "INFO", "DETAIL")
# When the launcher command and torchrun started (time.time()), for rank 0's timeline (rank/metrics/timeline.py):
# set by the launcher process as it runs, never stored in the plan (a resumed run starts again).
LAUNCH_STARTED = "DDP_LAUNCH_STARTED"
TORCHRUN_STARTED = "DDP_LAUNCH_TORCHRUN_STARTED"
FORK_RANKS = "DDP_LAUNCH_FORK_RANKS"  # 0: torchrun starts fresh interpreters, never forks (launch/startup/rank_fork.py)
# CUDA_DEVICE_MAX_CONNECTIONS' ceiling, and train.cuda_connections' default: as many hardware queues as CUDA gives
CUDA_CONNECTIONS = 32


def ultralytics_home(cache_dir: Path) -> Path:
    return Path(cache_dir) / "ultralytics"


def offline_environment(cache_dir: Path) -> dict[str, str]:
    home = ultralytics_home(cache_dir)
    return {
        "YOLO_OFFLINE": "1",  # no reachability probe, no analytics, no PyPI check, no pip auto-install
        "YOLO_AUTOINSTALL": "0",
        "YOLO_CONFIG_DIR": str(home),  # settings.json and the fonts prepared below
        "MPLCONFIGDIR": str(home / "matplotlib"),
        "MPLBACKEND": "Agg",
        "HF_HUB_OFFLINE": "1",
        "TQDM_MININTERVAL": "5",  # Ultralytics' validation bars: a line every few seconds in the rank logs, not a flood
    }


BYTECODE_OFF = (None, False, "off")  # paths.bytecode values that leave Python's own way


def default_cache() -> Path:
    """paths.cache as conf/config.yaml defaults it: DDP_LAUNCH_CACHE, else ~/.cache/ddp-launch."""
    return Path(os.environ.get("DDP_LAUNCH_CACHE") or Path(os.environ.get("HOME", "/tmp")) / ".cache" / "ddp-launch")


def bytecode_environment(setting, cache_dir: Path, kept: bool) -> dict[str, str]:
    """`paths.bytecode`: where the ranks' interpreters (and torchrun's) keep their compiled bytecode. `auto`: under
    the cache where they would otherwise compile torch from source at every start (Hardware.bytecode_kept False),
    so that every run after the first imports without compiling; a path: there, always; null: Python's own way.
    Kept there even under PYTHONDONTWRITEBYTECODE, which is unset for them: it keeps bytecode out of the install's
    folders (an image's layers), and this writes none there."""
    if setting in BYTECODE_OFF or (setting == "auto" and kept):
        return {}
    folder = Path(cache_dir) / "bytecode" if setting == "auto" else Path(str(setting)).expanduser()
    return {"PYTHONPYCACHEPREFIX": str(folder), "PYTHONDONTWRITEBYTECODE": ""}  # empty: unset, to Python


def interpreter_environment(bytecode: dict[str, str]) -> dict[str, str]:
    """The PYTHON* variables torchrun's and the ranks' interpreters start with (Python reads them only at its start:
    the warm torchrun, started before the plan, guesses them with this too): unbuffered output, `bytecode`'s folder."""
    return {**bytecode, "PYTHONUNBUFFERED": "1"}


def thread_environment(threads_per_rank: int) -> dict[str, str]:
    """One rank's share of the cores for its math libraries; DataLoader workers drop to one thread each."""
    n = str(max(1, threads_per_rank))
    return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "OPENBLAS_NUM_THREADS": n}


def cuda_environment(connections, device: str) -> dict[str, str]:
    """`train.cuda_connections` on CUDA ranks: how many hardware queues the GPU takes their kernels from. With CUDA's
    default of 8, the ranks' streams (the step's, the input's, nvJPEG's inside torchvision, validation's) share
    queues, and a kernel waits behind every kernel queued before it in its queue, whichever stream that came from:
    the decode's small kernels then wait for the step's. Read when a rank first touches CUDA. None: unset here."""
    if device != "cuda" or connections is None:
        return {}
    return {"CUDA_DEVICE_MAX_CONNECTIONS": str(connections)}


def distributed_environment(dist_cfg: dict, single_node: bool = False) -> dict[str, str]:
    """NCCL and torch.distributed toggles from `dist.*`; `dist.debug=true` turns on the useful set at once.

    On a single node the ranks' own sockets (gloo's pairs, NCCL's bootstrap) stay on the loopback interface.
    """
    env: dict[str, str] = {}
    nccl = dist_cfg.get("nccl") or {}
    if single_node and not nccl.get("socket_ifname"):
        env["GLOO_SOCKET_IFNAME"] = "lo"
        env["NCCL_SOCKET_IFNAME"] = "lo"
    debug = bool(dist_cfg.get("debug"))
    level = nccl.get("debug") or ("INFO" if debug else None)
    if level:
        env["NCCL_DEBUG"] = str(level)
    if nccl.get("debug_subsys"):
        env["NCCL_DEBUG_SUBSYS"] = str(nccl["debug_subsys"])
    if nccl.get("p2p_disable"):
        env["NCCL_P2P_DISABLE"] = "1"
    if nccl.get("ib_disable"):
        env["NCCL_IB_DISABLE"] = "1"
    if nccl.get("socket_ifname"):
        env["NCCL_SOCKET_IFNAME"] = str(nccl["socket_ifname"])
    env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1" if nccl.get("async_error_handling", True) else "0"
    torch_debug = str(dist_cfg.get("torch_debug") or "OFF")
    if debug and torch_debug == "OFF":
        torch_debug = "DETAIL"
    if torch_debug != "OFF":
        env["TORCH_DISTRIBUTED_DEBUG"] = torch_debug
    if debug:
        env["TORCH_SHOW_CPP_STACKTRACES"] = "1"
        env["TORCH_CPP_LOG_LEVEL"] = "INFO"
    return env

"""The environment every rank starts with: offline Ultralytics, thread counts, NCCL and torch.distributed toggles.

Built as a plain dict by pure functions (printed by a dry run, passed to torchrun by the launcher). The one side
effect, `prepare_ultralytics_home`, writes Ultralytics' settings file and fonts once in the launcher process, before
any rank imports Ultralytics: ranks importing it together would race to create the file, and a missing font or
weight file makes Ultralytics reach for the network (../shared/notes/ultralytics-8.4.md lists every place).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

ULTRALYTICS_SETTINGS_VERSION = "0.0.8"  # SettingsManager(version=...) in ultralytics 8.4.190

# NCCL_DEBUG levels users set; VERSION only prints the version line.
NCCL_DEBUG_LEVELS = ("VERSION", "WARN", "INFO", "TRACE")
TORCH_DEBUG_LEVELS = ("OFF", "INFO", "DETAIL")


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


def prepare_ultralytics_home(cache_dir: Path) -> Path:
    """Write settings.json (sync and every integration off) and the two fonts check_font() looks for."""
    home = ultralytics_home(cache_dir)
    target = home / "Ultralytics"  # Ultralytics appends this to YOLO_CONFIG_DIR
    target.mkdir(parents=True, exist_ok=True)
    (home / "matplotlib").mkdir(exist_ok=True)
    settings = {
        "settings_version": ULTRALYTICS_SETTINGS_VERSION,
        "datasets_dir": str(Path(cache_dir) / "datasets"),
        "weights_dir": str(home / "weights"),  # instead of a ./weights folder wherever the user stands
        "runs_dir": str(home / "runs"),
        "uuid": "0" * 64,
        "sync": False,
        "api_key": "",
        "openai_api_key": "",
        "clearml": False,
        "comet": False,
        "dvc": False,
        "mlflow": False,
        "raytune": False,
        "tensorboard": False,
        "wandb": False,
        "vscode_msg": False,
        "openvino_msg": False,
    }
    _write_if_changed(target / "settings.json", json.dumps(settings, indent=2))
    import matplotlib

    dejavu = Path(matplotlib.get_data_path()) / "fonts" / "ttf" / "DejaVuSans.ttf"
    for name in ("Arial.ttf", "Arial.Unicode.ttf"):  # any TTF under these names stops check_font's download
        if not (target / name).exists():
            tmp = target / f".{name}.{os.getpid()}"
            shutil.copyfile(dejavu, tmp)
            os.replace(tmp, target / name)
    return home


def _write_if_changed(path: Path, text: str) -> None:
    if path.exists() and path.read_text() == text:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def thread_environment(threads_per_rank: int) -> dict[str, str]:
    """One rank's share of the cores for its math libraries; DataLoader workers drop to one thread each."""
    n = str(max(1, threads_per_rank))
    return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "OPENBLAS_NUM_THREADS": n}


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

"""What this node has: visible GPUs (through NVML), CPU cores, the process-group backends torch offers, and the
installed Ultralytics release.

Discovery happens once, in the launcher process, before any rank starts; the plan is a pure function of the
result, so tests build `Hardware(...)` by hand instead of patching NVML.
"""

from __future__ import annotations

import ctypes.util
import importlib.util
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from launcher.inputs.ultralytics_files import NEWEST_VERSION, allowed_outside_window, installed_version


@dataclass(frozen=True)
class Gpu:
    index: int  # CUDA index as the ranks will see it (after CUDA_VISIBLE_DEVICES)
    name: str
    memory_gib: float
    uuid: str = ""


@dataclass(frozen=True)
class Hardware:
    gpus: tuple[Gpu, ...] = ()
    cpu_count: int = 1
    nccl_available: bool = False
    triton_available: bool = False  # torch.compile's GPU code generator (train.compile on CUDA)
    driver: str = ""
    notes: tuple[str, ...] = field(default=())  # why GPU discovery found nothing (NVML, torch.cuda)
    ultralytics_version: str | None = NEWEST_VERSION  # the installed release (its package metadata)
    ultralytics_allowed: bool = False  # DDP_LAUNCH_ALLOW_ULTRALYTICS=1: a release outside the window is tried
    bytecode_kept: bool = True  # whether a fresh interpreter reads torch's compiled modules (bytecode_kept())
    cuda_visible: str | None = None  # the launcher's CUDA_VISIBLE_DEVICES, which `device=` indices count within

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)

    def describe_gpus(self) -> str:
        if not self.gpus:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            hints = ([f"CUDA_VISIBLE_DEVICES={visible!r}"] if visible is not None else []) + list(self.notes)
            return "no GPU is visible" + (f" ({'; '.join(hints)})" if hints else "")
        return ", ".join(f"cuda:{g.index} {g.name} ({g.memory_gib:.0f} GiB)" for g in self.gpus)


def usable_cpu_count() -> int:
    """Cores this process may run on: the affinity mask (what taskset, cgroups and SLURM grant), not the machine."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _visible_selection(total: int) -> list[int | str] | None:
    """Parse CUDA_VISIBLE_DEVICES into NVML indices or UUID prefixes; None means every device is visible."""
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    chosen: list[int | str] = []
    for item in (x.strip() for x in raw.split(",")):
        if not item:
            continue
        if item.isdigit():
            if int(item) >= total:
                break  # CUDA stops at the first invalid entry
            chosen.append(int(item))
        elif item.startswith(("GPU-", "MIG-")):
            chosen.append(item)
        else:
            break  # "-1", "none" and other invalid entries hide everything after them
    return chosen


def _gpus_from_nvml() -> tuple[tuple[Gpu, ...], str]:
    import pynvml  # nvidia-ml-py

    pynvml.nvmlInit()
    try:
        total = pynvml.nvmlDeviceGetCount()
        driver = pynvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else driver
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(total)]
        uuids = []
        for h in handles:
            u = pynvml.nvmlDeviceGetUUID(h)
            uuids.append(u.decode() if isinstance(u, bytes) else u)
        selection = _visible_selection(total)
        if selection is None:
            order = list(range(total))
        else:
            order = []
            for item in selection:
                if isinstance(item, int):
                    order.append(item)
                else:
                    match = [i for i, u in enumerate(uuids) if u.startswith(item)]
                    if len(match) != 1:
                        break
                    order.append(match[0])
        gpus = []
        for cuda_index, nvml_index in enumerate(order):
            h = handles[nvml_index]
            name = pynvml.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else name
            mem = pynvml.nvmlDeviceGetMemoryInfo(h).total / 2**30
            gpus.append(Gpu(cuda_index, name, mem, uuids[nvml_index]))
        return tuple(gpus), driver
    finally:
        pynvml.nvmlShutdown()


def _cuda_driver_present() -> bool:
    """Whether a CUDA driver library could be loaded here (without loading it, or torch)."""
    return ctypes.util.find_library("cuda") is not None or any(Path("/dev").glob("nvidia[0-9]*"))


def detect() -> Hardware:
    """Look at this node. NVML first (it needs no CUDA context); torch's count if NVML is absent but a CUDA driver is
    there. A machine with neither never imports torch here: planning stays fast (a dry run, a refusal)."""
    notes: list[str] = []
    gpus: tuple[Gpu, ...] = ()
    driver = ""
    try:
        gpus, driver = _gpus_from_nvml()
    except Exception as e:  # no driver, no library: a CPU machine, or a container without the NVIDIA runtime
        notes.append(f"NVML unavailable ({type(e).__name__}: {e})")
        if not _cuda_driver_present():
            notes.append("no CUDA driver library")
        else:
            try:
                import torch

                if torch.cuda.is_available():
                    gpus = tuple(
                        Gpu(i, torch.cuda.get_device_name(i), torch.cuda.get_device_properties(i).total_memory / 2**30)
                        for i in range(torch.cuda.device_count())
                    )
                else:
                    notes.append("torch.cuda.is_available() is False")
            except Exception as e2:
                notes.append(f"torch.cuda unavailable ({type(e2).__name__}: {e2})")
    return Hardware(
        gpus=gpus,
        cpu_count=usable_cpu_count(),
        nccl_available=bool(gpus) and _nccl_available(),
        triton_available=importlib.util.find_spec("triton") is not None,
        driver=driver,
        notes=tuple(notes) if not gpus else (),
        ultralytics_version=installed_version(),
        ultralytics_allowed=allowed_outside_window(),
        bytecode_kept=bytecode_kept(),
        cuda_visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
    )


def bytecode_kept(module: str = "torch", writable=os.access) -> bool:
    """Whether a fresh interpreter that imports `module` reads its compiled bytecode, or will from the next one on:
    False where the install holds none for this Python and none will be written next to it (PYTHONDONTWRITEBYTECODE
    or -B, or folders that cannot be written: a read-only image, an environment built without bytecode), so that
    every process compiles thousands of modules from source again (seconds for torch, Dynamo and Ultralytics).
    True where the user keeps bytecode elsewhere already (PYTHONPYCACHEPREFIX) and where the
    module is not installed. Looks at the files only: no import."""
    if sys.pycache_prefix or os.environ.get("PYTHONPYCACHEPREFIX"):
        return True
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return True
    cached = Path(importlib.util.cache_from_source(spec.origin))
    if cached.exists():
        return True
    if sys.flags.dont_write_bytecode or os.environ.get("PYTHONDONTWRITEBYTECODE"):
        return False
    folder = cached.parent if cached.parent.exists() else cached.parent.parent  # __pycache__, or where it would go
    return writable(folder, os.W_OK)


def _nccl_available() -> bool:
    """Whether torch here can use NCCL, read off torch/version.py, not by importing torch (seconds at every launch,
    on the planning's critical path): torch's Linux CUDA and ROCm builds include NCCL (RCCL), its wheels and conda's
    alike. A source build without NCCL is told so by its ranks' process group instead, before any step."""
    return sys.platform.startswith("linux") and bool(torch_builds())


def torch_builds() -> dict[str, str]:
    """{"cuda" or "hip": the release} torch was built for, read off torch/version.py (cuda: Optional[str] = '13.0');
    empty for a CPU build or no torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return {}
    try:
        text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
    except OSError:
        return {}
    return dict(re.findall(r"^(cuda|hip)\b[^=\n]*=\s*['\"]([^'\"]+)['\"]", text, flags=re.M))

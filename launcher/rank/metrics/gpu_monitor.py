"""GPU utilisation and memory from NVML, sampled in a background thread while the meter's window is open.

What `nvidia-smi` in another terminal would show, measured over the steady-state window only (warm-up, validation
and checkpoints excluded): mean utilisation per GPU (the share of time a kernel was running) and peak memory used.
On a machine without NVML it reports nothing, and the run carries on.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass
class GpuStats:
    index: int  # CUDA index as the rank sees it
    name: str
    util_mean: float  # percent, over the active window
    samples: int
    memory_peak_gib: float  # NVML "used" (all processes on the GPU, like nvidia-smi)


def _nvml_handle(pynvml, cuda_index: int):
    """The NVML device behind a CUDA index (NVML ignores CUDA_VISIBLE_DEVICES; the UUID links the two)."""
    import torch

    uuid = getattr(torch.cuda.get_device_properties(cuda_index), "uuid", None)
    if uuid is not None:
        text = str(uuid)
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(text if text.startswith("GPU-") else f"GPU-{text}")
        except pynvml.NVMLError:
            pass  # MIG or an older driver: fall back to the index, right when CUDA_VISIBLE_DEVICES is unset
    return pynvml.nvmlDeviceGetHandleByIndex(cuda_index)


class GpuMonitor:
    def __init__(self, cuda_indices: list[int], period_s: float = 0.1):
        self.period_s = period_s
        self.active = False
        self._stop = threading.Event()
        self._sums: dict[int, list[float]] = {}
        self._peaks: dict[int, float] = {}
        self._names: dict[int, str] = {}
        self._handles = {}
        self._pynvml = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._pynvml = pynvml
            for i in cuda_indices:
                h = _nvml_handle(pynvml, i)
                self._handles[i] = h
                name = pynvml.nvmlDeviceGetName(h)
                self._names[i] = name.decode() if isinstance(name, bytes) else name
                self._sums[i] = [0.0, 0]
                self._peaks[i] = 0.0
        except Exception as e:  # no driver or library: report nothing, keep training
            self.error = f"{type(e).__name__}: {e}"
            self._handles = {}
        else:
            self.error = ""
        self._thread = threading.Thread(target=self._run, daemon=True, name="gpu-monitor")
        if self._handles:
            self._thread.start()

    @property
    def available(self) -> bool:
        return bool(self._handles)

    def _run(self) -> None:
        nv = self._pynvml
        while not self._stop.wait(self.period_s):
            if not self.active:
                continue
            for i, h in self._handles.items():
                try:
                    util = nv.nvmlDeviceGetUtilizationRates(h).gpu
                    used = nv.nvmlDeviceGetMemoryInfo(h).used / 2**30
                except Exception:
                    continue
                s = self._sums[i]
                s[0] += util
                s[1] += 1
                self._peaks[i] = max(self._peaks[i], used)

    def stats(self) -> list[GpuStats]:
        return [
            GpuStats(i, self._names[i], self._sums[i][0] / self._sums[i][1] if self._sums[i][1] else 0.0, int(self._sums[i][1]), self._peaks[i])
            for i in self._handles
        ]

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        if self._pynvml is not None:
            try:
                self._pynvml.nvmlShutdown()
            except Exception:
                pass

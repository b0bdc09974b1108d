"""Which benchmark cells to run on this machine: a pure function of the bench config and the hardware."""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("single", "dp", "ddp")
BASELINES = (None, "ultralytics")


@dataclass(frozen=True)
class Cell:
    mode: str  # single | dp | ddp | ultralytics
    size: int  # devices: GPUs, or CPU ranks when gpus=0
    skip: str = ""  # why it is not run here (empty: it runs)
    variant: str = ""  # a named set of config overrides (bench.variants), to measure one lever at a time
    overrides_: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.mode}-{self.size}" + (f"-{self.variant}" if self.variant else "")

    def overrides(self, on_gpu: bool) -> dict:
        """The launch config keys that make this cell (the rest of the config is shared by every cell)."""
        if self.mode == "single":
            return {"mode": "single", "gpus": 1 if on_gpu else 0, "nproc": None}
        if self.mode == "dp":
            return {"mode": "dp", "gpus": self.size if on_gpu else 0, "nproc": None}
        return {"mode": "ddp", "gpus": self.size if on_gpu else 0, "nproc": None if on_gpu else self.size}


def plan_cells(
    sizes: list[int],
    modes: list[str],
    baseline: str | None,
    gpu_count: int,
    cpu_count: int,
    on_gpu: bool,
    variants: dict[str, list[str]] | None = None,
) -> tuple[list[Cell], list[str]]:
    """Cells in run order (smallest first, so a slow machine shows results early), and problems with the request.

    With `variants` ({name: [key=value, ...]}), every (mode, size) cell runs once per variant, after the same cell with
    the defaults (variant ""): the levers of a configuration measured side by side, one change at a time. A variant
    with no overrides (e.g. base:[]) is the defaults under that name, and no unnamed cell is added.
    """
    problems = [f"bench.modes: unknown mode {m!r} (expected {', '.join(MODES)})" for m in modes if m not in MODES]
    problems += [f"bench.sizes: {s!r} is not a positive integer" for s in sizes if not isinstance(s, int) or s < 1]
    if baseline not in BASELINES:
        problems.append(f"bench.baseline={baseline!r}: expected null or ultralytics")
    if problems:
        return [], problems
    available = gpu_count if on_gpu else cpu_count
    unit = "GPU(s)" if on_gpu else "CPU core(s) for CPU ranks"
    named = dict(variants or {})
    runs = named if any(not overrides for overrides in named.values()) else {"": [], **named}
    cells = []
    for size in sorted(set(sizes)):
        for mode in (m for m in MODES if m in modes):
            if mode == "single" and size != 1:
                continue  # a single process is size 1 by definition
            skip = ""
            if size > available:
                skip = f"needs {size} {unit}; this machine has {available}"
            elif mode == "dp" and not on_gpu and size > 1:
                skip = "DataParallel over several devices needs GPUs (on the CPU it is one device)"
            for name, overrides in runs.items():
                cells.append(Cell(mode, size, skip, name, tuple(overrides or ())))
    if baseline == "ultralytics":
        cells.insert(0, Cell("ultralytics", 1, "" if (on_gpu or cpu_count >= 1) else "no device"))
    return cells, []

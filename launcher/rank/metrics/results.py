"""results.csv in Ultralytics' format (BaseTrainer.save_metrics): one row per epoch, `epoch, time, <metric>...`, each
value as %.6g, so Ultralytics' own plotting (plot_results) and every tool that reads its runs read ddp-launch's."""

from __future__ import annotations

import csv
from pathlib import Path


def append_row(path: Path, epoch: int, seconds: float, values: dict) -> None:
    """The row of `epoch` (1-based); the header first when the file is new."""
    keys, vals = list(values), list(values.values())
    n = len(values) + 2
    header = "" if path.exists() else ("%s," * n % ("epoch", "time", *keys)).rstrip(",") + "\n"
    with open(path, "a", encoding="utf-8") as f:
        f.write(header + ("%.6g," * n % (epoch, seconds, *vals)).rstrip(",") + "\n")


def read_columns(path: Path) -> dict[str, list[float]]:
    """results.csv as {column: values}: what Ultralytics stores in a checkpoint's train_results (read without
    polars, which Ultralytics uses and the GPU machines lack)."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError:
        return {}
    return {k: [float(r[k]) for r in rows] for k in (rows[0] if rows else {})}


def keep_epochs(path: Path, last_epoch: int) -> None:
    """Drop the rows after `last_epoch` (1-based): written before a save that failed, they are trained again."""
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    kept = lines[:1] + [row for row in lines[1:] if int(float(row.split(",")[0])) <= last_epoch]
    path.write_text("\n".join(kept) + "\n")

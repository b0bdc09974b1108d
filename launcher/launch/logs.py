"""What reaches the console while a run goes on: the launcher's own lines, and the rank logs as they grow.

Ranks write their logs to files (rank/worker.py points their stdout and stderr there, so nothing is lost when one
crashes); the launcher follows those files and copies what they gain to its own stdout.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path


def say(msg: str = "", prefix: str = "") -> None:
    print(f"{prefix}{msg}", flush=True)


class LogStreamer(threading.Thread):
    """Copies what rank log files gain to the console while the job runs (rank 0 only, or every rank).

    `keep` filters lines; with `prefix` each line is shown as "[rank1] ...". A line still being written (no newline
    yet) is held back until it ends, or until stop().
    """

    def __init__(self, files: list[Path], prefix: bool, out=None, period: float = 0.2, keep=None):
        super().__init__(daemon=True)
        self.files, self.prefix, self.period = files, prefix, period
        self.keep = keep or (lambda line: True)
        self.out = out or sys.stdout
        self.offsets = {f: (f.stat().st_size if f.exists() else 0) for f in files}  # only what the run adds
        self._done = threading.Event()
        self._partial: dict[Path, str] = {}

    def _show(self, f: Path, line: str) -> None:
        self.out.write(f"[{f.stem}] {line}\n" if self.prefix else f"{line}\n")

    def pump(self) -> None:
        """Copy what the files gained since the last call."""
        for f in self.files:
            try:
                with open(f, "rb") as fh:
                    fh.seek(self.offsets[f])
                    chunk = fh.read()
            except FileNotFoundError:
                continue
            if not chunk:
                continue
            self.offsets[f] += len(chunk)
            lines = (self._partial.pop(f, "") + chunk.decode(errors="replace")).split("\n")
            if lines[-1]:
                self._partial[f] = lines[-1]
            for line in filter(self.keep, lines[:-1]):
                self._show(f, line)
            self.out.flush()

    def run(self) -> None:
        while not self._done.is_set():
            self.pump()
            self._done.wait(self.period)
        self.pump()
        for f, rest in self._partial.items():
            self._show(f, rest)
        self.out.flush()

    def stop(self) -> None:
        self._done.set()
        self.join()

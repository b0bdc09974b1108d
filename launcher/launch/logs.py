"""What reaches the console while a run goes on: the launcher's own lines, and the rank logs as they grow.

Ranks write their logs to files (rank/worker.py points their stdout and stderr there, so nothing is lost when one
crashes); the launcher follows those files and copies what they gain to its own stdout, less their diagnostics
(lines tagged run_folder.DETAIL) unless log.verbose asks for them: the console reads like Ultralytics' trainer, with
ddp-launch's plan and result; the log files keep every line.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from pathlib import Path

from launcher.run_folder import is_detail

# rank 0's progress line (rank/run/hooks.py, Progress): what the live bar is drawn from
PROGRESS_LINE = re.compile(r"^(?:\[rank 0\] )?epoch (\d+)/(\d+) step (\d+)/(\d+) \| (.*)$")


def say(msg: str = "", prefix: str = "") -> None:
    try:
        print(f"{prefix}{msg}", flush=True)
    except OSError:
        console_gone(sys.stdout)


def verbose_console(cfg: dict) -> bool:
    """log.verbose: the diagnostics on the console too; dist.debug shows everything."""
    return bool((cfg.get("log") or {}).get("verbose")) or bool((cfg.get("dist") or {}).get("debug"))


def note(msg: str, log_file: Path, verbose: bool) -> None:
    """A launcher's diagnostic: appended to `log_file` (the run's logs/launcher.log), and on the console with
    `verbose` (log.verbose)."""
    if verbose:
        say(msg)
    try:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(log_file, "a") as f:
            f.write(msg + "\n")
    except OSError:
        pass  # a diagnostic never stops a launch


def console_gone(stream) -> None:
    """The terminal closed (or the pipe we print to): the rest goes to /dev/null, so that the launcher still stops
    the ranks and writes summary.json instead of dying on its next line. The run folder keeps every record."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, stream.fileno())  # what is still buffered is flushed there too, not into an error at exit
        os.close(null)
    except (OSError, ValueError, AttributeError):
        pass


class QuietStop:
    """torchrun's stderr, copied line by line, less the traceback of the SignalException it raises when it is told to
    stop (with every traceback chained to it: a second signal, SLURM's to every process, interrupts torchrun's own
    shutdown): the launcher asked for that stop and says so itself, and 30 lines of traceback read like a crash. With
    `rendezvous_refusal`, the traceback of a rendezvous that timed out (a node that never joined, a node 0 that never
    answered) becomes that one line, and `refused` is set. Every other line and traceback (a real failure) passes
    unchanged."""

    RENDEZVOUS_ERRORS = ("DistStoreError", "DistNetworkError", "RendezvousTimeoutError", "RendezvousConnectionError")
    # where in torchrun a rendezvous fails: the nodes' meeting, or a node's first reach for node 0's store
    RENDEZVOUS_STAGES = ("next_rendezvous", "_create_tcp_store")
    TRACEBACK = "Traceback (most recent call last):"
    CHAINED = ("During handling of the above exception, another exception occurred:",
               "The above exception was the direct cause of the following exception:")

    def __init__(self, out, rendezvous_refusal: str | None = None):
        self.out, self.rendezvous_refusal = out, rendezvous_refusal
        self.held: list[str] = []  # a traceback (and those chained to it), until the chain ends
        self.ended = False  # the held traceback's exception line came: a chained one may follow
        self.refused = False
        self._in_retry = False

    def feed(self, line: str) -> None:
        if self.rendezvous_refusal and self._connection_retry(line):
            return
        chained = any(h.strip() in self.CHAINED for h in self.held[-2:])  # a traceback now continues the chain
        if self.ended and (not line.strip() or line.strip() in self.CHAINED
                           or chained and line.startswith(self.TRACEBACK)):
            self.held.append(line)  # the chain goes on
            self.ended = not line.startswith(self.TRACEBACK)
            return
        if self.ended:
            self._release()
        if not self.held and not line.startswith(self.TRACEBACK):
            self._write(line)
            return
        self.held.append(line)
        if len(self.held) > 1 and line[:1] not in (" ", "\t"):  # the exception's own line ends the traceback
            self.ended = True

    def _release(self) -> None:
        """The held chain of tracebacks, shown whole unless a stop or a refused rendezvous explains it."""
        block, self.held, self.ended = self.held, [], False
        exceptions = [line for i, line in enumerate(block) if i and line[:1] not in (" ", "\t", "\n")
                      and line.strip() not in self.CHAINED and not line.startswith(self.TRACEBACK)]
        if self.rendezvous_refusal and any(e in line for line in exceptions for e in self.RENDEZVOUS_ERRORS) and any(
                at in line for line in block for at in self.RENDEZVOUS_STAGES):
            if not self.refused:
                # the chain's last message that says something (c10d's RendezvousTimeoutError has none, and its
                # RendezvousConnectionError points at the inner exception, which this line replaces)
                said = [e.strip().rsplit("Error: ", 1)[-1] for e in exceptions
                        if "Error: " in e and "inner exception" not in e]
                detail = f" ({said[-1]})" if said else ""
                self._write(f"\n{self.rendezvous_refusal}{detail}\n")
            self.refused = True
        elif not any("SignalException" in line for line in exceptions):
            self._write("".join(block))

    def _connection_retry(self, line: str) -> bool:
        """c10d's own log of a node that cannot reach the rendezvous yet (a line per try, then a C++ backtrace):
        what the waiting line and the refusal say already."""
        if "[c10d]" in line and "connect" in line:
            self._in_retry = True
        elif not (self._in_retry and line.startswith(("Exception raised from", "frame #", "<omitting", "\n"))):
            self._in_retry = False
        return self._in_retry

    def copy(self, pipe) -> None:
        """Copy `pipe` (torchrun's stderr, bytes) to the console until it closes."""
        for raw in pipe:
            self.feed(raw.decode(errors="replace"))
        if self.ended:
            self._release()
        elif self.held:  # cut off mid-traceback: show what there is
            self._write("".join(self.held))
            self.held = []

    def _write(self, text: str) -> None:
        try:
            self.out.write(text)
            self.out.flush()
        except OSError:
            console_gone(self.out)  # keep reading: torchrun must never block on a full pipe


class LogStreamer(threading.Thread):
    """Copies what rank log files gain to the console while the job runs (rank 0 only, or every rank).

    `keep` filters lines; diagnostics (run_folder.DETAIL) are left out unless `verbose`; with `prefix` each line is
    shown as "[rank1] ...". A line still being written (no newline yet) is held back until it ends, or until stop().
    With `bar` (default: rank 0 alone, on a terminal, outside a SLURM job) rank 0's progress lines become a live bar
    per epoch, the other lines printed above it; the log files keep every line.
    """

    def __init__(self, files: list[Path], prefix: bool, out=None, period: float = 0.2, keep=None,
                 bar: bool | None = None, verbose: bool = False):
        super().__init__(daemon=True)
        self.files, self.prefix, self.period = files, prefix, period
        wanted = keep or (lambda line: True)
        self.keep = wanted if verbose else (lambda line: wanted(line) and not is_detail(line))
        self.out = out or sys.stdout
        if bar is None:
            bar = not prefix and _is_terminal(self.out) and "SLURM_JOB_ID" not in os.environ
        self.bar = ProgressBar(self.out) if bar else None
        self.offsets = {f: (f.stat().st_size if f.exists() else 0) for f in files}  # only what the run adds
        self._done = threading.Event()
        self._partial: dict[Path, str] = {}

    def _show(self, f: Path, line: str) -> None:
        if self.bar is not None:
            self.bar.line(line)
            return
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
            try:
                for line in filter(self.keep, lines[:-1]):
                    self._show(f, line)
                self.out.flush()
            except OSError:
                console_gone(self.out)

    def run(self) -> None:
        while not self._done.is_set():
            self.pump()
            self._done.wait(self.period)
        self.pump()
        try:
            for f, rest in self._partial.items():
                self._show(f, rest)
            if self.bar is not None:
                self.bar.close()
            self.out.flush()
        except OSError:
            console_gone(self.out)

    def stop(self) -> None:
        self._done.set()
        self.join()


def _is_terminal(out) -> bool:
    try:
        return out.isatty()
    except (AttributeError, ValueError):
        return False


class ProgressBar:
    """Progress lines drawn as one tqdm bar per epoch (steps done, rate, and the line's losses, speed and time left);
    any other line is printed above the bar. The bar of a finished epoch stays, with its last line."""

    def __init__(self, out):
        from tqdm import tqdm

        self.tqdm, self.out = tqdm, out
        self.current = None  # (epoch, the bar)

    def line(self, text: str) -> None:
        m = PROGRESS_LINE.match(text)
        if m is None:
            if self.current is not None:
                self.tqdm.write(text, file=self.out)
            else:
                self.out.write(text + "\n")
            return
        epoch, epochs, step, steps, rest = int(m[1]), int(m[2]), int(m[3]), int(m[4]), m[5]
        if self.current is None or self.current[0] != epoch:
            self.close()
            bar = self.tqdm(total=steps, desc=f"epoch {epoch}/{epochs}", file=self.out, leave=True,
                            dynamic_ncols=True, bar_format="{desc} {bar} {n_fmt}/{total_fmt}{postfix}")
            self.current = (epoch, bar)
        bar = self.current[1]
        bar.n = step
        bar.set_postfix_str(rest, refresh=False)
        bar.refresh()
        if step >= steps:
            self.close()

    def close(self) -> None:
        if self.current is not None:
            self.current[1].close()
            self.current = None

"""Fault injection for the fault-tolerance tests: `DDP_LAUNCH_FAULT` makes one rank fail in a chosen way.

    DDP_LAUNCH_FAULT="rank=1,step=5,kind=sigkill"          # one fault
    DDP_LAUNCH_FAULT="rank=0,step=3,kind=raise;rank=1,..." # several, separated by ';'

kinds: raise (an exception), sigkill (the rank is killed), sigterm (the rank is asked to stop, as torchrun would ask
it), hang (stops making progress), exit (exits with code 3),
init_fail (the process group cannot start), kill_in_save (killed halfway through writing a checkpoint),
disk_full (the checkpoint write fails with ENOSPC). `step` counts optimizer steps from the start of the run
(1-based); `attempt` (default 0) is the torchrun restart it fires in, so a restarted group runs clean.
Without the variable nothing here runs.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

ENV = "DDP_LAUNCH_FAULT"
KINDS = ("raise", "sigkill", "sigterm", "hang", "exit", "init_fail", "kill_in_save", "disk_full")


class InjectedFault(RuntimeError):
    pass


@dataclass(frozen=True)
class Fault:
    rank: int
    kind: str
    step: int = 0
    attempt: int = 0


def parse(text: str) -> list[Fault]:
    faults = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        fields = dict(kv.split("=", 1) for kv in part.split(","))
        kind = fields.get("kind", "")
        if kind not in KINDS:
            raise ValueError(f"{ENV}: kind={kind!r}, expected one of {', '.join(KINDS)}")
        faults.append(Fault(int(fields["rank"]), kind, int(fields.get("step", 0)), int(fields.get("attempt", 0))))
    return faults


class FaultInjector:
    def __init__(self, faults: list[Fault], rank: int, attempt: int):
        self.faults = [f for f in faults if f.rank == rank and f.attempt == attempt]
        self.rank = rank
        self.step = 0
        self.saving: Fault | None = None  # the write fault of the checkpoint in flight (at_save)

    @classmethod
    def from_env(cls, rank: int) -> FaultInjector:
        return cls(parse(os.environ.get(ENV, "")), rank, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))

    def _due(self, *kinds: str) -> Fault | None:
        return next((f for f in self.faults if f.kind in kinds and self.step >= f.step), None)

    def at_init(self) -> None:
        if self._due("init_fail"):
            raise InjectedFault(f"injected fault: rank {self.rank} cannot start its process group")

    def at_step(self, step: int) -> None:
        self.step = step
        fault = self._due("raise", "sigkill", "sigterm", "hang", "exit")
        if fault is None or fault.step != step:
            return
        print(f"[fault] rank {self.rank}: injected '{fault.kind}' at step {step}", flush=True)
        if fault.kind == "raise":
            raise InjectedFault(f"injected fault: rank {self.rank} raised at step {step}")
        if fault.kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.kind == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)  # the handler notes it; the step-boundary agreement follows
        if fault.kind == "exit":
            os._exit(3)
        if fault.kind == "hang":
            while True:  # no more steps, no more heartbeats: what a deadlock looks like from outside
                time.sleep(1)

    def at_save(self) -> None:
        """A checkpoint is taken now (the training thread): the write fault due at this step, if any, is the one its
        writer meets."""
        self.saving = self._due("kill_in_save", "disk_full")

    def at_checkpoint_write(self, path: Path) -> None:
        """In the checkpoint's writer, before it writes `path`: the fault `at_save` found due."""
        fault = self.saving
        if fault is None:
            return
        print(f"[fault] rank {self.rank}: injected '{fault.kind}' while writing {path}", flush=True)
        if fault.kind == "disk_full":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        # half a checkpoint in the temporary file, then death: what a power cut or the OOM killer leaves
        partial = Path(path).with_name(f".{Path(path).name}.tmp-{os.getpid()}")
        partial.write_bytes(b"PK\x03\x04 half a checkpoint")
        os.kill(os.getpid(), signal.SIGKILL)

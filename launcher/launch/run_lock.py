"""One trainer per run folder: RUN_DIR/run.lock, held by the launcher (on a SLURM job, by node 0's job task) for the
run's life.

The lock file names its holder: host, pid, the process's start (so that a reused pid is not taken for the holder),
when it was taken, and the SLURM job it belongs to. Another launch or resume into the folder is refused with one line
naming the holder. The holder is gone (a crash, SIGKILL, a reboot) when it was on this host and its process is not
alive: the lock is then taken over, with a line saying so. A requeued SLURM job has the job id of the one that took
the lock, and takes over that lock only. The lock is created by linking a complete file into place (atomic, on NFS
too), and released on every exit the launcher sees: a normal end, an error, Ctrl-C, SIGTERM and SIGHUP.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from launcher.launch.logs import say
from launcher.problems import PlanError, Problem

LOCK_NAME = "run.lock"
RELEASED_ON = (signal.SIGTERM, signal.SIGHUP)  # their default ends the process without a word: made an exit here


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    started: str | None  # the process's start time in clock ticks since boot (/proc/PID/stat), None where unknown
    since: float  # when the lock was taken
    slurm_job_id: str | None = None

    @classmethod
    def me(cls) -> Holder:
        return cls(socket.gethostname(), os.getpid(), process_start(os.getpid()), time.time(),
                   os.environ.get("SLURM_JOB_ID"))

    def describe(self) -> str:
        job = f", SLURM job {self.slurm_job_id}" if self.slurm_job_id else ""
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"pid {self.pid} on {self.host}{job}, since {since}"

    def gone(self) -> bool:
        """Whether this holder certainly holds nothing any more: a process of this host that is not alive (or whose
        pid now belongs to another process); for a SLURM job's lock, an earlier run of this very job (requeued) or a
        job SLURM no longer lists."""
        if self.slurm_job_id:
            if os.environ.get("SLURM_JOB_ID") == self.slurm_job_id:
                return (self.host, self.pid) != (socket.gethostname(), os.getpid())  # requeued: its last run ended
            return slurm_job_ended(self.slurm_job_id)
        if self.host != socket.gethostname():
            return False  # another node's process cannot be asked
        if self.pid == os.getpid():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass  # alive, another user's
        return self.started is not None and process_start(self.pid) not in (None, self.started)


def slurm_job_ended(job_id: str) -> bool:
    """Whether SLURM says the job is no longer pending or running; False where it cannot be asked."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%T"], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    if out.returncode != 0:
        return "invalid job id" in out.stderr.lower()
    return not out.stdout.strip()


def process_start(pid: int) -> str | None:
    """A process's start time (field 22 of /proc/PID/stat), which tells a reused pid from the process itself."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


class RunLock:
    """The lock of one run folder. `held()` takes it (or raises PlanError naming the holder) and releases it on exit."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_NAME

    def holder(self) -> Holder | None:
        """Who holds the lock (None: nobody); a lock file that cannot be read names no one that can be asked."""
        try:
            return Holder(**json.loads(self.path.read_text()))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError):
            return Holder("an unknown host", 0, None, self._mtime())

    def acquire(self, wait_s: float = 0.0) -> Holder:
        """Take the lock for this process, waiting up to `wait_s` for a live holder to let go; a gone holder's lock is
        taken over with a line. PlanError naming the holder otherwise."""
        me = Holder.me()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + wait_s
        for _ in range(max(3, int(wait_s) + 3)):  # a gone holder's lock moved aside, then taken; a race tries again
            if self._create(me):
                return me
            other = self.holder()
            if other is None:
                continue  # released meanwhile
            if not other.pid or not other.gone():
                if time.monotonic() < deadline:
                    time.sleep(1.0)
                    continue
                raise PlanError([self._refusal(other)])
            if self._remove_if(other):
                say(f"ddp-launch: taking over the lock of {self.path.parent} from the launch that held it "
                    f"({other.describe()}), which has ended")
        raise PlanError([self._refusal(self.holder() or me)])

    def release(self, me: Holder) -> None:
        """Remove the lock if this process still holds it."""
        if self.holder() == me:
            self.path.unlink(missing_ok=True)

    @contextlib.contextmanager
    def held(self, wait_s: float = 0.0):
        """The lock, for the body's life: released on its end, an exception, Ctrl-C, SIGTERM or SIGHUP (made a
        SystemExit of 128 + the signal while no other handler is set; torchrun's forwarding installs its own)."""
        me = self.acquire(wait_s)
        main = threading.current_thread() is threading.main_thread()  # only there can a handler be installed
        previous = {s: signal.getsignal(s) for s in RELEASED_ON} if main else {}
        for s, handler in previous.items():
            if handler in (signal.SIG_DFL, None):
                signal.signal(s, _exit_on)
        try:
            yield me
        finally:
            for s, handler in previous.items():
                if signal.getsignal(s) is _exit_on:
                    signal.signal(s, handler if handler is not None else signal.SIG_DFL)
            self.release(me)

    def hand_to_job(self, job_id: str) -> None:
        """A submitted SLURM run: the lock this process holds passes to the job, whose node 0 takes it as its own
        when it starts (the same job id) and until then refuses any other launch while SLURM lists the job."""
        me = self.holder()
        if me is not None and (me.host, me.pid) == (socket.gethostname(), os.getpid()):
            tmp = self.path.with_name(f".{LOCK_NAME}.{os.getpid()}")
            self._write(tmp, Holder(me.host, me.pid, me.started, time.time(), str(job_id)))
            os.replace(tmp, self.path)

    # --- files ----------------------------------------------------------------------------------------------------
    def _create(self, me: Holder) -> bool:
        tmp = self.path.with_name(f".{LOCK_NAME}.{os.getpid()}")
        self._write(tmp, me)
        try:
            os.link(tmp, self.path)  # fails if a lock is there; atomic on NFS, unlike O_EXCL on old clients
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def _remove_if(self, gone: Holder) -> bool:
        """Remove the lock if it still names `gone`. NOTE: moved aside first, so that a lock another taker wrote
        meanwhile is put back rather than removed."""
        aside = self.path.with_name(f".{LOCK_NAME}.gone.{os.getpid()}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        try:
            moved = Holder(**json.loads(aside.read_text()))
        except (OSError, ValueError, TypeError):
            moved = None
        if moved != gone:
            with contextlib.suppress(OSError):
                os.link(aside, self.path)
        aside.unlink(missing_ok=True)
        return moved == gone

    @staticmethod
    def _write(path: Path, holder: Holder) -> None:
        path.write_text(json.dumps(asdict(holder)) + "\n")

    def _mtime(self) -> float:
        try:
            return self.path.stat().st_mtime
        except OSError:
            return 0.0

    def _refusal(self, other: Holder) -> Problem:
        if not other.pid:
            return Problem(f"{self.path.parent} is locked by {self.path}, which cannot be read; if no ddp-launch runs "
                           "in that folder, delete it and run this again", environment=True)
        stop = f"scancel {other.slurm_job_id}" if other.slurm_job_id else f"stop it (kill {other.pid} on {other.host})"
        return Problem(f"{self.path.parent} is in use by another ddp-launch ({other.describe()}); wait for it to end "
                       f"or {stop}, then run this again; if that process is gone, delete {self.path}", environment=True)


def _exit_on(signum, _frame):
    raise SystemExit(128 + signum)

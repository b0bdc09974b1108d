"""A run folder: every file a run writes or reads, in one place.

    config.yaml        the resolved config the ranks run (they never run Hydra); its data.path is data.yaml, relative
                       to the folder, so that a moved or copied folder reads its own
    plan.json          the plan (launcher/plan)
    data.yaml          the dataset as the ranks see it (data.prev.yaml: before a resume moved the dataset)
    run.lock           who runs in the folder now (launch/run_lock.py)
    torchrun.sh        a local run's exact command; job.sbatch for a SLURM run
    logs/rank<N>.log   each rank's stdout and stderr; its diagnostics tagged DETAIL (on the console with log.verbose)
    logs/launcher.log  the launcher's diagnostics (on the console with log.verbose)
    ranks/rank<N>.json each rank's figures; ranks/rank<N>.failed.json the error of a rank that failed
    weights/           checkpoints
    summary.json       the outcome: "finished" (written by rank 0), "failed" or "stopped" (by the launcher)
    cell.json          a ddp-bench cell's figures, in place of summary.json

The launcher, the SLURM job on every node and the ranks all read and write these through RunFolder, so "has this
run finished?" and "which rank failed first?" have one answer.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
import traceback
from pathlib import Path

from launcher.inputs.data import DatasetInfo
from launcher.inputs.models import ModelSpec
from launcher.plan.plan import LaunchPlan
from launcher.problems import PlanError, Problem, plain_text

FINISHED = "finished"
TMP_MARK = ".tmp-"  # in the name of a file being written (a writer killed mid-write leaves it behind)
# A diagnostic line of a log (after a rank's own tag): what ddp-launch measured or chose inside, for whoever looks into
# the log; the console shows it only with log.verbose
DETAIL = "[detail]"
_DETAIL_LINE = re.compile(r"^(?:\[rank \d+\] )?\[detail\] ")


def is_detail(line: str) -> bool:
    """Whether a log line is a diagnostic (DETAIL)."""
    return _DETAIL_LINE.match(line) is not None


def atomic_write_bytes(path: Path, data: bytes, keep_previous: bool = False) -> None:
    """Write `path` so that it is always either the old file or the complete new one: a temporary file beside it,
    flushed to disk, renamed over it (atomic on POSIX). A kill or a full disk leaves the old file intact.

    With `keep_previous`, the file it replaces becomes `<stem>.prev<suffix>`: the new file is complete before the
    current one becomes the previous one, so each moment leaves at least one complete file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if keep_previous and path.exists():
            os.replace(path, previous_of(path))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def previous_of(path: Path) -> Path:
    return Path(path).with_name(Path(path).stem + ".prev" + Path(path).suffix)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def nearest_folder(path: Path) -> Path:
    """`path` itself when it is a folder, else the closest folder above it (what creating it would write into)."""
    path = Path(path).resolve()
    while not path.is_dir() and path != path.parent:
        path = path.parent
    return path


def writable(path: Path) -> bool:
    """Whether a run can write `path`, or create it: its nearest folder takes a new file. Tried with a probe file,
    created and removed, because permission bits do not say it (root ignores them; a read-only file system does not)."""
    folder = nearest_folder(path)
    if not os.access(folder, os.W_OK | os.X_OK):
        return False
    try:
        fd, probe = tempfile.mkstemp(prefix=".ddp-launch-probe-", dir=folder)
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


class RunFolder:
    def __init__(self, path: str | Path):
        self.path = Path(path)

    def __str__(self) -> str:
        return str(self.path)

    # --- paths ------------------------------------------------------------------------------------------------
    @property
    def config_file(self) -> Path:
        return self.path / "config.yaml"

    @property
    def plan_file(self) -> Path:
        return self.path / "plan.json"

    @property
    def data_file(self) -> Path:
        return self.path / "data.yaml"

    @property
    def summary_file(self) -> Path:
        return self.path / "summary.json"

    @property
    def env_file(self) -> Path:
        return self.path / "env.txt"  # the environment report (ddp-env) of rank 0's node

    @property
    def weights(self) -> Path:
        return self.path / "weights"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def ranks(self) -> Path:
        return self.path / "ranks"

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank{rank}.log"

    @property
    def launcher_log(self) -> Path:
        return self.logs / "launcher.log"

    # --- what the ranks run -------------------------------------------------------------------------------------
    def is_run(self) -> bool:
        return self.config_file.is_file() and self.plan_file.is_file()

    def new_run_problems(self) -> list[Problem]:
        """Why a new run cannot go here: the folder holds a run already (its records stay as they are), or it cannot
        be written. About this machine's files, so a dry run warns (environment=True) and a launch refuses."""
        if self.plan_file.exists():
            return [Problem(f"{self.path} already holds a run; choose another hydra.run.dir=PATH, or continue that "
                            f"one with resume={self.path}", environment=True)]
        if not writable(self.path):
            return [Problem(f"the run folder {self.path} cannot be written here (a read-only file system, or no "
                            f"permission); choose a writable place with hydra.run.dir=PATH", environment=True)]
        return []

    def create(self, cfg: dict, plan: LaunchPlan, model: ModelSpec, data: DatasetInfo) -> None:
        """Write what the ranks read: data.yaml, the config with the model and data resolved to files, the plan."""
        import yaml
        from omegaconf import OmegaConf

        self.path.mkdir(parents=True, exist_ok=True)
        if self.plan_file.exists():
            raise PlanError([Problem(f"{self.path} already holds a run; choose another hydra.run.dir")])
        self.data_file.write_text(yaml.safe_dump(data.spec, sort_keys=False))
        self._save_config({**cfg, "model": {**cfg["model"], "cfg": model.cfg, "weights": model.weights}})
        self.write_plan(plan)

    def _save_config(self, cfg: dict) -> None:
        """config.yaml, its data.path the folder's own data.yaml, named relative to the folder (load resolves it)."""
        from omegaconf import OmegaConf

        OmegaConf.save(OmegaConf.create({**cfg, "data": {**cfg["data"], "path": self.data_file.name}}),
                       self.config_file)

    def move_data(self, spec: dict) -> None:
        """A resume on a dataset that moved: its new data.yaml; the one it replaces kept as data.prev.yaml."""
        import yaml

        os.replace(self.data_file, self.path / "data.prev.yaml")
        atomic_write_bytes(self.data_file, yaml.safe_dump(spec, sort_keys=False).encode())

    def write_plan(self, plan: LaunchPlan, keep_as: str | None = None) -> None:
        """The plan the ranks run; the one it replaces is kept as `keep_as` (a re-planned resume, a fallback)."""
        if keep_as and self.plan_file.exists():
            os.replace(self.plan_file, self.path / keep_as)
        atomic_write_bytes(self.plan_file, json.dumps(plan.to_dict(), indent=2).encode())

    def replan(self, cfg: dict, plan: LaunchPlan) -> None:
        """A resume on another topology: the new config and plan; the ones they replace kept as config.prev.yaml and
        plan.prev.json."""
        os.replace(self.config_file, self.path / "config.prev.yaml")
        self._save_config(cfg)
        self.write_plan(plan, keep_as="plan.prev.json")

    def load(self) -> tuple[dict, LaunchPlan]:
        """(resolved config, plan) as the launcher wrote them; data.path is this folder's data.yaml, wherever the
        folder was when it was written (a folder moved or copied reads its own)."""
        from omegaconf import OmegaConf

        if not self.is_run():
            raise PlanError([Problem(f"{self.path}: not a ddp-launch run folder (no config.yaml and plan.json)")])
        cfg = OmegaConf.to_container(OmegaConf.load(self.config_file), resolve=True)
        cfg["data"] = {**cfg["data"], "path": str(self.data_file)}
        return cfg, LaunchPlan.from_dict(json.loads(self.plan_file.read_text()), cfg)

    def dataset(self) -> dict:
        """data.yaml as the ranks read it."""
        import yaml

        return yaml.safe_load(self.data_file.read_text())

    # --- the outcome ----------------------------------------------------------------------------------------------
    def read_json(self, name: str) -> dict | None:
        """A record of the run; None when it is missing or unreadable."""
        try:
            return json.loads((self.path / name).read_text())
        except (OSError, ValueError):
            return None

    def summary(self) -> dict | None:
        return self.read_json("summary.json")

    def finished(self) -> bool:
        return (self.summary() or {}).get("status") == FINISHED

    def write_json(self, name: str, record: dict) -> Path:
        """A record of the run (summary.json, cell.json, ranks/rank<N>.json), written atomically."""
        path = self.path / name
        atomic_write_bytes(path, json.dumps(record, indent=2).encode())
        return path

    def record_failure(self, rank: int, error: str, *, phase: str, detail: str = "", when: float | None = None,
                       **extra) -> None:
        """ranks/rank<N>.failed.json: what made rank N fail. The earliest is the run's root cause."""
        record = {
            "rank": rank,
            "error": plain_text(error),
            "traceback": plain_text(detail)[-8000:],
            "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "phase": phase,  # init: the process group never came up (dist.fallback=dp retries) | train
            "time": time.time() if when is None else when,
            **extra,
        }
        self.write_json(f"ranks/rank{rank}.failed.json", record)

    def record_exception(self, rank: int, error: BaseException, *, phase: str) -> None:
        text = "".join(traceback.format_exception(error))
        self.record_failure(rank, f"{type(error).__name__}: {error}", phase=phase, detail=text)

    def failures(self) -> list[dict]:
        """Every rank's failure record, earliest first."""
        records = []
        for f in self.ranks.glob("rank*.failed.json"):
            try:
                records.append(json.loads(f.read_text()))
            except (OSError, ValueError):
                continue
        return sorted(records, key=lambda r: r.get("time", 0.0))

    def write_outcome(self, status: str, exit_code: int, detail: str) -> list[dict]:
        """A failed or stopped run still gets a summary: what happened, and which rank failed first, with what."""
        failures = self.failures()
        self.write_json(
            "summary.json",
            {
                "status": status,
                "exit_code": exit_code,
                "detail": detail,
                "root_cause": failures[0] if failures else None,
                "failures": failures,
                "run_dir": str(self.path),
            },
        )
        return failures

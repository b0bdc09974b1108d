"""The Python API: what `ddp-launch` and `ddp-bench` do, called from a script or a notebook.

    from launcher import train
    summary = train(["model=yolov8s", "train.epochs=10"])   # the overrides you would type; returns summary.json
    plan = train(["dry_run=true"])                          # a dry run returns the plan

Overrides are composed by Hydra exactly as on the command line; the run goes through torchrun as it does from the
shell, into `run_dir` (default: Hydra's `runs/<date>/<time>`, relative to the current directory).
"""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import OmegaConf, open_dict

from launcher.entry import conf_dir


class RunFailed(RuntimeError):
    """The run started and did not finish; `code` is what `ddp-launch` would have exited with."""

    def __init__(self, code: int, run_dir: Path):
        super().__init__(f"the run in {run_dir} ended with exit code {code}: see {run_dir / 'logs'}")
        self.code, self.run_dir = code, run_dir


def _compose(config_name: str, overrides: list[str], run_dir) -> tuple[dict, Path]:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
        cfg = compose(config_name, overrides=list(overrides), return_hydra_config=True)
    default_dir = OmegaConf.select(cfg, "hydra.run.dir")  # resolved here: ${now:...}
    with open_dict(cfg):
        del cfg["hydra"]  # what the command's task function gets: the config without Hydra's own node
    return OmegaConf.to_container(cfg, resolve=True), Path(run_dir or default_dir).resolve()


def train(overrides: list[str] | None = None, *, run_dir: str | Path | None = None) -> dict:
    """Plan and run one training, as `ddp-launch OVERRIDES` does. Returns the run's summary.json as a dict, or with
    `dry_run=true` the plan. Raises launcher.problems.PlanError when the plan is refused (its message says what to
    change) and RunFailed when the run ends without finishing."""
    from launcher.cli import start_ahead
    from launcher.launch import start
    from launcher.launch.warm_torchrun import warm

    start_ahead(list(overrides or []))  # torchrun's imports overlap the composing and planning, as in ddp-launch
    try:
        cfg, folder = _compose("config", overrides or [], run_dir)
        planned = {}
        if cfg.get("resume"):
            raise ValueError("resume= is a command-line action: run `ddp-launch resume=RUN_DIR`")
        code = start.start(cfg, folder, Path(os.getcwd()), on_plan=lambda plan: planned.update(plan.to_dict()))
    finally:
        warm.discard()  # not taken: a refused plan, a dry run
    if cfg.get("dry_run"):
        return planned
    if code != 0:
        raise RunFailed(code, folder)
    from launcher.run_folder import RunFolder

    return RunFolder(folder).read_json("summary.json")


def bench(overrides: list[str] | None = None, *, run_dir: str | Path | None = None) -> dict | None:
    """Run ddp-bench's cells, as `ddp-bench OVERRIDES` does. Returns bench.json as a dict (None for a dry run)."""
    from launcher.bench.cli import run_bench
    from launcher.run_folder import RunFolder

    overrides = list(overrides or [])
    cfg, folder = _compose("bench", overrides, run_dir)
    code = run_bench(cfg, folder, Path(os.getcwd()), "ddp-bench " + " ".join(overrides))
    if cfg.get("dry_run"):
        return None
    if code != 0:
        raise RunFailed(code, folder)
    return RunFolder(folder).read_json("bench.json")

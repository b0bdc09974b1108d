"""The Python API: what `ddp-launch` and `ddp-bench` do, called from a script or a notebook.

    from launcher import train, resume
    summary = train(model="yolov8n.pt", data="my.yaml", epochs=3, imgsz=640, device=[0, 1])  # Ultralytics' keywords
    summary = train(["model=yolov8s", "train.epochs=10"])   # or the overrides you would type
    plan = train(dry_run=True)                              # a dry run returns the plan
    summary = resume("runs/RUN_DIR")                        # continue a stopped run

Keywords and override strings go through the same translation and composition as the command line, and the run
goes through torchrun as it does from the shell, into `run_dir` (default: Hydra's `runs/<date>/<time>`, relative to
the current directory, or PROJECT/NAME). Every error is a launcher.problems.LaunchError: PlanError when the plan is
refused, RunFailed when the run ends without finishing, each with the message the command prints.
"""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import OmegaConf, open_dict

from launcher.entry import conf_dir
from launcher.problems import LaunchError, PlanError, RunFailed

__all__ = ["LaunchError", "PlanError", "RunFailed", "bench", "resume", "train"]


def as_override(key: str, value) -> str:
    """`key=value` as it would be typed: Python's True, None, lists and paths in Hydra's syntax."""
    return f"{key}={_hydra_value(value)}"


def _hydra_value(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_hydra_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_hydra_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if text and all(ch.isalnum() or ch in "._-/:~+" for ch in text):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _overrides(overrides: list[str] | None, keywords: dict) -> list[str]:
    return [*(overrides or []), *(as_override(k, v) for k, v in keywords.items())]


def _compose(config_name: str, overrides: list[str], run_dir) -> tuple[dict, Path, list[str]]:
    """(the composed config, its run folder, the Ultralytics keys as they were translated)."""
    from hydra import compose, initialize_config_dir

    from launcher.plan.ultralytics_keys import translate

    translation = translate(overrides, multirun=False)
    if translation.problems:
        raise PlanError(translation.problems)
    with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
        cfg = compose(config_name, overrides=translation.argv, return_hydra_config=True)
    default_dir = OmegaConf.select(cfg, "hydra.run.dir")  # resolved here: ${now:...}
    with open_dict(cfg):
        del cfg["hydra"]  # what the command's task function gets: the config without Hydra's own node
    return OmegaConf.to_container(cfg, resolve=True), Path(run_dir or default_dir).resolve(), translation.shown


def train(overrides: list[str] | None = None, *, run_dir: str | Path | None = None, **keywords) -> dict:
    """Plan and run one training, as `ddp-launch` does with the same keys: Ultralytics' keywords (epochs=3,
    device=[0, 1], model="yolov8n.pt") and/or the override strings you would type. Returns the run's summary.json as
    a dict, or with dry_run=True the plan. `resume=` continues a run instead (see resume())."""
    from launcher.cli import start_ahead
    from launcher.launch import start
    from launcher.launch.startup.warm_torchrun import warm

    overrides = _overrides(overrides, keywords)
    start_ahead(overrides)  # torchrun's imports overlap the composing and planning, as in ddp-launch
    try:
        cfg, folder, translated = _compose("config", overrides, run_dir)
        if cfg.get("resume"):
            warm.discard()
            return resume(cfg["resume"])
        planned = {}
        code = start.start(cfg, folder, Path(os.getcwd()), on_plan=lambda plan: planned.update(plan.to_dict()),
                           translated=translated)
    finally:
        warm.discard()  # not taken: a refused plan, a dry run
    if cfg.get("dry_run"):
        return planned
    return _summary(code, folder)


def resume(run: str | Path | bool = True, **where) -> dict:
    """Continue a stopped run to its end, as `ddp-launch resume=RUN` does: a run folder, a weights/last.pt inside one,
    or True for the newest unfinished run under ./runs. `where` may move it (gpus=, nproc=, nnodes=, ...: the keys
    `ddp-launch resume=` accepts). Returns its summary.json as a dict."""
    from launcher.launch import start

    folder = start.resume_target(run, Path(os.getcwd()))
    code = start.resume(folder, dict(where))
    return _summary(code, folder)


def _summary(code: int, folder: Path) -> dict:
    from launcher.run_folder import RunFolder

    if code != 0:
        raise RunFailed(code, folder)
    return RunFolder(folder).read_json("summary.json")


def bench(overrides: list[str] | None = None, *, run_dir: str | Path | None = None, **keywords) -> dict | None:
    """Run ddp-bench's cells, as `ddp-bench OVERRIDES` does. Returns bench.json as a dict (None for a dry run)."""
    from launcher.bench.ddp_bench import run_bench

    overrides = _overrides(overrides, keywords)
    cfg, folder, _ = _compose("bench", overrides, run_dir)
    code = run_bench(cfg, folder, Path(os.getcwd()), "ddp-bench " + " ".join(overrides), overrides)
    if cfg.get("dry_run"):
        return None
    if code != 0:
        raise RunFailed(code, folder)
    from launcher.run_folder import RunFolder

    return RunFolder(folder).read_json("bench.json")

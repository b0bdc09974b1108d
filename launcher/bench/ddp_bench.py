"""`ddp-bench`: run every cell (mode x size) of the benchmark with the same model, per-device batch, data and seed,
one after another in this invocation, and write bench.json, bench.md and bench.png into the run folder
(`bench.kind=throughput`, the default; `bench.kind=time_to_model` is the command-to-weights race, time_to_model.py).

Each cell is a real launch (torchrun, the ranks, ddp-launch's trainer) that trains `bench.warmup_steps + bench.steps`
steps and then times the same step on batches already on the device (the data-free ceiling). The model is of any task
bench_tasks.py lets in (detect, segment, pose, obb, classify): its task is decided, and checked against the data and
the settings, as ddp-launch decides it, before any cell runs; the step and the ceiling's batches are the task's.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NamedTuple

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from launcher.bench import bench_tasks, report, time_to_model, trust, variants
from launcher.bench.cells import Cell, plan_cells
from launcher.bench.side_process import run_side_process
from launcher.entry import (GROUPS, Jobs, RunFolderGuard, conf_dir, interrupted, print_help_if_asked,
                            translated_or_exit)
from launcher.inputs.data import resolve_data
from launcher.inputs.model_task import model_task, run_task, task_source
from launcher.inputs.models import resolve_model
from launcher.launch import torchrun
from launcher.launch.start import weight_dirs
from launcher.launch.logs import LogStreamer, say
from launcher.launch.ultralytics_home import prepare_ultralytics_home
from launcher.machine import hardware
from launcher.plan.checks import check_plan
from launcher.plan.describe import describe
from launcher.plan.environment import offline_environment
from launcher.plan.plan import make_plan
from launcher.plan.task_rules import task_problems
from launcher.problems import PlanError, Problem, config_problems
from launcher.run_folder import RunFolder

BASELINE_MODULE = "launcher.rank.ultralytics.baseline"


class Task(NamedTuple):
    """The task the cells train, and the file it was read from (the plan's task line)."""

    name: str
    source: str | None


def progress_line(line: str) -> bool:
    """What of a cell's rank-0 log the console shows while it runs."""
    return line.startswith("[rank 0]") or "Error" in line or line.startswith("Traceback")


def run_bench(cfg: dict, run_dir: Path, base_dir: Path, command: str, given: list[str] = ()) -> int:
    """The benchmark `cfg` asks for; `given`: the command line's overrides (time_to_model's sides take its launch
    settings)."""
    hw = hardware.detect()
    gpus = cfg["gpus"]
    on_gpu = hw.gpu_count > 0 if gpus == "auto" else int(gpus) > 0
    if on_gpu and hw.gpu_count == 0:
        raise PlanError([Problem(f"gpus={gpus} but {hw.describe_gpus()}; benchmark CPU ranks with gpus=0")])
    if earlier_benchmark(run_dir):  # its cells or sides would refuse their folders one by one, after the first ran
        raise PlanError([Problem(f"{run_dir} already holds a benchmark; choose another hydra.run.dir=PATH (each "
                                 "ddp-bench invocation writes its cells or sides into a folder of its own)")])
    b = cfg["bench"]
    kind = b.get("kind") or "throughput"
    if kind == "throughput":
        problems = variants.shape_problems(b.get("variants"))
        if b.get("earlier") is not None:
            problems.append("bench.earlier is for bench.kind=time_to_model (a throughput cell is measured in one "
                            "invocation); leave it out")
        if not isinstance(b.get("repeats", 1), int) or b.get("repeats", 1) < 1:
            problems.append(f"bench.repeats={b.get('repeats')!r}: expected a whole number of runs per cell, 1 or more")
        if cfg["train"].get("batch") is not None and max(b["sizes"], default=1) > 1:
            problems.append(f"batch={cfg['train']['batch']}: ddp-bench compares its cells at one batch per device; set "
                            "train.batch_per_device=N (batch is Ultralytics' global batch, split differently in each "
                            "cell)")
        cells, cell_problems = plan_cells(list(b["sizes"]), list(b["modes"]), b["baseline"], hw.gpu_count,
                                          hw.cpu_count, on_gpu, None if problems else b.get("variants") or None)
        problems += cell_problems
    elif kind == "time_to_model":
        cells, problems = [], time_to_model.problems(b, cfg["train"])
    else:
        cells, problems = [], [f"bench.kind={kind!r}: expected throughput or time_to_model"]
    refused = bench_tasks.refusal(bench_tasks.arch_of(cfg["model"]))  # a task ddp-bench does not measure
    model, model_msgs = (None, [refused]) if refused else resolve_model(cfg["model"], base_dir, weight_dirs(cfg))
    if problems or model_msgs:
        raise PlanError(config_problems(problems + model_msgs))
    dry_run = bool(cfg.get("dry_run"))
    arch = model.cfg or model.weights
    data, data_problems = resolve_data(cfg["data"], base_dir, generate=not dry_run,
                                      cache_dir=Path(cfg["paths"]["cache"]).expanduser(),
                                      datasets_dir=Path(cfg["paths"]["datasets"]), model_task=model_task(arch))
    task = Task("detect", None)
    if data is not None:  # the model's task, refused where the data does not fit it (as ddp-launch refuses it)
        name, mismatch = run_task(arch, data.spec, f"model={Path(str(arch)).name}", data.checks)
        task = Task(name, task_source(arch))
        data_problems += [Problem(m) for m in mismatch]
    # a path the task lacks (detection's fast paths), and a bad variant: refused before any cell or side runs
    data_problems += task_problems(cfg, task.name, device="cuda" if on_gpu else "cpu")
    errors, warnings = check_plan(data_problems, dry_run=dry_run)
    errors += variants.plan_problems(cfg, hw, data, on_gpu, task.name)
    if errors:
        raise PlanError(errors)
    if kind == "time_to_model":
        for w in warnings if dry_run else []:
            say(f"WARNING: {w.message} (a real run would refuse)")
        return time_to_model.run(cfg, run_dir, model, data, on_gpu, command, dry_run, base_dir, task.name, given)

    to_run = [c for c in cells if not c.skip]
    say(f"ddp-bench: {len(to_run)} cell(s), task {task.name}, on "
        f"{hw.describe_gpus() if on_gpu else f'{hw.cpu_count} CPU core(s)'}")
    for c in cells:
        say(f"  {c.name:<14} {'skipped: ' + c.skip if c.skip else 'to run'}")
    say(f"run folder      {run_dir}\n")
    if dry_run:
        for w in warnings:
            say(f"WARNING: {w.message} (a real run would refuse)")
        for cell in to_run:
            plan, plan_problems = make_plan(variants.apply({**cfg, **cell.overrides(on_gpu)}, list(cell.overrides_)), hw,
                                            data, task=task.name, task_from=task.source)
            say(f"--- cell {cell.name} ---\n{describe(plan, model, data)}")
            for p in plan_problems:
                say(f"WARNING: {p.message}")
        say("\ndry run: nothing started")
        return 0

    repeats = int(b.get("repeats", 1))
    load_before, cores = os.getloadavg(), len(os.sched_getaffinity(0))
    runs: dict[str, list[dict]] = {c.name: [] for c in to_run}
    for repeat in range(repeats):  # the cells interleaved: a busy spell of the host falls on several, not one
        for cell in to_run:
            say(f"--- cell {cell.name}" + (f", run {repeat + 1} of {repeats}" if repeats > 1 else "") + " ---")
            name = cell.name + (f".repeat{repeat + 1}" if repeat else "")
            outcome = run_cell(cell, cfg, run_dir / "cells" / name, hw, model, data, on_gpu, task)
            if isinstance(outcome, int):
                return outcome  # stopped by a signal: keep what was measured so far in the cell folders
            runs[cell.name].append(outcome)
            if "error" in outcome:
                say(f"    {cell.name}: failed ({outcome['error']})")
            else:
                say(f"    {cell.name}: {outcome['images_per_s']:.1f} images/s, data wait "
                    f"{100 * outcome['data_wait']:.1f} %")
    host = trust.host_load(load_before, os.getloadavg(), cores)
    results = []
    for cell in cells:
        if cell.skip:
            results.append({"mode": cell.mode, "size": cell.size, "variant": cell.variant, "skip": cell.skip})
            continue
        results.append({**trust.combine(runs[cell.name]), "variant": cell.variant, "overrides": list(cell.overrides_)})

    report.add_speedups(results)
    trust.flags(results, host)
    for c in results:
        c["verdict"] = report.verdict(c)
    out = {
        "command": command,
        "settings": {
            **{k: b.get(k) for k in ("sizes", "modes", "warmup_steps", "steps", "ceiling_batches", "baseline", "variants",
                                    "profile", "repeats")},
            "steps_in_flight": cfg["train"].get("steps_in_flight", 1),
        },
        "model": model.cfg or model.weights,
        "task": task.name,
        "data": {"name": data.name, "train_images": data.train_images, "path": data.spec["path"]},
        "imgsz": cfg["train"]["imgsz"],
        "batch_per_device": cfg["train"]["batch_per_device"],
        "amp": cfg["train"]["amp"],
        "cells": results,
        "notes": [f"{c.name} skipped: {c.skip}" for c in cells if c.skip],
        "environment": report.environment(),
        "host": host,
    }
    report.write(out, run_dir)
    say("\n" + report.markdown(out))
    for line in trust.warnings(results):
        say(f"WARNING: {line}")
    say(f"report: {run_dir / 'bench.md'}, {run_dir / 'bench.json'}, {run_dir / 'bench.png'}")
    return 0 if all("error" not in c for c in results) else 1


def earlier_benchmark(run_dir: Path) -> bool:
    """Whether an earlier ddp-bench wrote into `run_dir`: its report, its cells' or its sides' folders."""
    return (run_dir / "bench.json").exists() or (run_dir / "cells").is_dir() or any(run_dir.glob("*-seed*/"))


def run_cell(cell: Cell, cfg: dict, cell_dir: Path, hw, model, data, on_gpu: bool,
             task: Task = Task("detect", None)) -> dict | int:
    ccfg = variants.apply(cfg, list(cell.overrides_))
    ccfg.update(cell.overrides(on_gpu))
    ccfg["bench"]["cell"] = cell.name
    if cell.mode == "ultralytics":
        ccfg.update(Cell("single", 1).overrides(on_gpu))
    plan, problems = make_plan(ccfg, hw, data, task=task.name, task_from=task.source)
    errors, _ = check_plan(problems, dry_run=False)
    if errors:
        return {"mode": cell.mode, "size": cell.size, "error": "; ".join(p.message for p in errors)}
    folder = RunFolder(cell_dir)
    folder.create(ccfg, plan, model, data)
    cache = Path(cfg["paths"]["cache"]).expanduser()
    prepare_ultralytics_home(cache)
    if cell.mode == "ultralytics":
        code, signum = run_baseline(cell_dir, offline_environment(cache))
    else:
        cmd = torchrun.local_command(plan, cell_dir)
        code, signum = torchrun.run_torchrun(cmd, plan.env, [folder.rank_log(0)], prefix=False, keep=progress_line)
    if signum is not None:
        say(f"ddp-bench: stopped by signal {signum}; cells so far are in {cell_dir.parent}")
        return 128 + signum
    measured = folder.read_json("cell.json")
    if code != 0 or measured is None:
        return {"mode": cell.mode, "size": cell.size, "error": f"exit code {code}; see {folder.logs}"}
    return report.aggregate(cell.mode, cell.size, measured["ranks"])


def run_baseline(cell_dir: Path, env: dict) -> tuple[int, int | None]:
    """Ultralytics' own trainer in a fresh process (it must import Ultralytics with its own view of the world)."""
    log = cell_dir / "logs" / "rank0.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    streamer = LogStreamer([log], prefix=False, keep=progress_line)
    streamer.start()
    with open(log, "ab") as out:
        code, signum = run_side_process([sys.executable, "-m", BASELINE_MODULE, str(cell_dir)],
                                        env={**os.environ, **env, "PYTHONUNBUFFERED": "1"}, log=out)
    streamer.stop()
    return code, signum


jobs = Jobs()


@hydra.main(version_base="1.3", config_path=conf_dir(), config_name="bench")
def _hydra_entry(cfg: DictConfig) -> int:
    run_dir = RunFolderGuard.meant(Path(HydraConfig.get().runtime.output_dir))
    resolved = OmegaConf.to_container(cfg, resolve=True)
    given = list(HydraConfig.get().overrides.task)
    command = "ddp-bench " + " ".join(given)
    return jobs.run(lambda: run_bench(resolved, run_dir, Path(os.getcwd()), command.strip(), given))


def main() -> None:
    conf = Path(conf_dir())
    if print_help_if_asked(sys.argv[1:], "ddp-bench", "single vs DataParallel vs DDP throughput and where the time goes; or the time to a trained model against Ultralytics' trainer (bench.kind=time_to_model)",
                           groups={g: GROUPS[g] for g in ("model", "data", "bench")}, files=[(conf / "bench" / "default.yaml", "bench.")]):
        print("Every ddp-launch key works here too: ddp-launch --help lists them.")
        return
    try:
        sys.argv = [sys.argv[0], *translated_or_exit(sys.argv[1:]).argv]  # Ultralytics' keys, as in ddp-launch
        _hydra_entry()
    except KeyboardInterrupt:
        interrupted()
    jobs.exit()


if __name__ == "__main__":
    main()

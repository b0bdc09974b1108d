"""`ddp-bench bench.kind=time_to_model`: the wall clock from the command to the trained weights, Ultralytics' own
trainer against ddp-launch's defaults, and where each side's time went.

Both sides run one after the other in this invocation, per seed of `bench.seeds` (the side that goes first alternates
from seed to seed), on the same data (a data YAML written for them; a classifier's class folders as given, Ultralytics'
data=path/to/folder), model, image size, epochs, batch, optimizer (SGD), lr0 (optim.base_lr), close_mosaic and seed,
validating after every epoch; every other setting is each side's own default, but for the launch settings given on
ddp-bench's command line (launch_overrides), which the ddp_launch sides take too:
- ultralytics: `YOLO(model, task=TASK).train(...)` in a fresh process (rank/ultralytics/time_to_model_ultralytics.py):
  Ultralytics' trainer of the model's task (bench_tasks.TRAINERS), bench.baseline_workers workers, no cache, AMP, its
  rectangular validation;
- ddp_launch: the `ddp-launch` command itself, on one GPU (or one CPU process with gpus=0), train.val_interval=1;
- ddp_launch-NAME, for each of `bench.variants` ({NAME: [key=value, ...]}): the same command with those overrides
  (a lever's gain, or train.val_interval's, measured beside the defaults and reported apart from the verdict, which
  is the defaults' against Ultralytics).

Each side's wall clock starts here, just before its process is started, and ends when the final weights are on disk
with the final validation done (plots written after that, and the process's exit, are timed separately). Its
breakdown, from the side's timeline (rank 0's summary.json `timeline`; the Ultralytics side's callbacks):
- startup: the command to the first training step (its batch in hand);
- training: each epoch's training, from its start (the first epoch's: the first step) to its last step's end;
- validation: the validation after each epoch;
- boundaries: the rest between the first step and the last epoch's end (checkpoints, the EMA's attributes, the
  loader between epochs), listed apart from training; its checkpoint writes (each epoch's save_start..save_end)
  are counted apart, in `boundary_parts`;
- end: the last epoch's end to the final weights (the final validation, stripping the checkpoints);
- other: the wall clock the stamps do not attribute (zero when the timeline is complete and in order).
Each side's quality is the box mAP50-95 and the task's own (mask or pose mAP50-95; the box one for detection and obb;
a classifier's top-1 accuracy, and no box mAP). Before the first timed side, the dataset's labels are scanned once
(Ultralytics' labels.cache, or a classifier's split caches, which both sides read), so that no side pays the first scan
of a dataset. The means, the ratio, the verdict and the report's files are time_to_model_report.py's; the sides of
earlier invocations on this machine join them with `bench.earlier` (time_to_model_earlier.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from launcher.bench import report, time_to_model_earlier
from launcher.bench.bench_tasks import quality, trainer
from launcher.bench.side_process import run_side_process
from launcher.bench.time_to_model_report import (PARTS, SIDES, maps_text, markdown, own_metric, side_names,
                                                 summarize, write)
from launcher.bench.variants import shape_problems
from launcher.entry import override_key
from launcher.inputs.labels import list_images
from launcher.launch.logs import say
from launcher.launch.ultralytics_home import prepare_ultralytics_home
from launcher.plan.environment import offline_environment
from launcher.plan.task_rules import BOX, rules
from launcher.problems import PlanError, config_problems

ULTRALYTICS_MODULE = "launcher.rank.ultralytics.time_to_model_ultralytics"

# What each side's start-up is made of: the stamps from the command to the first step, in order, and what lies
# between the one before and each (a missing stamp merges into the next).
STARTUP = {
    "ddp_launch": [
        ("launcher_start", "the launcher's interpreter start"),
        ("torchrun_start", "composing, planning, checking the data, writing the run folder"),
        ("rank_start", "torchrun's start and the rank's interpreter"),
        ("imports_done", "the rank's imports (torch, Ultralytics)"),
        ("components_built", "the process group, the network, the loaders, the validator"),
        ("loop_start", "the resume state and the hooks"),
        ("first_step", "the first batch"),
    ],
    "ultralytics": [
        ("module_start", "the interpreter and Ultralytics' import"),
        ("pretrain_start", "YOLO(model) and the trainer's init"),
        ("pretrain_end", "the trainer's set-up: the dataset's check, the network, the loaders, the optimizer"),
        ("loop_start", "the set-up's last steps"),
        ("first_step", "the first batch"),
    ],
}


def problems(bench: dict, train: dict | None = None) -> list[str]:
    if (train or {}).get("batch_per_device") == "auto":
        return ["bench.kind=time_to_model with train.batch_per_device=auto: both sides train at the same batch, and "
                "Ultralytics' batch=-1 chooses its own; give train.batch_per_device as a number"]
    out = shape_problems(bench.get("variants")) + time_to_model_earlier.shape_problems(bench.get("earlier"))
    seeds = bench.get("seeds")
    if seeds is None:
        return out
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) and not isinstance(s, bool)
                                                           for s in seeds):
        return out + [f"bench.seeds={seeds!r}: expected a list of integer seeds, e.g. bench.seeds=[0,1]"]
    if len(set(seeds)) != len(seeds):
        return out + [f"bench.seeds={seeds!r}: each seed once"]
    return out


def run_order(seeds: list[int], sides: tuple[str, ...] | list[str] = SIDES, first: int = 0) -> list[tuple[str, int]]:
    """(side, seed) in run order: the sides interleaved seed by seed, their order reversed every other seed (counted
    from `first`: the seeds run before, in earlier invocations)."""
    order = []
    for i, seed in enumerate(seeds, start=first):
        order += [(side, seed) for side in (sides if i % 2 == 0 else sides[::-1])]
    return order


# --- the breakdown ---------------------------------------------------------------------------------------------------
def breakdown(command: float, timeline: dict) -> dict:
    """Where a side's wall clock went: the parts (seconds, adding up to wall_s), the start-up's and the end's own
    parts, and each epoch's training and validation. `command`: when the side's command was started."""
    s, epochs = timeline["stamps"], timeline["epochs"]
    first, last, done = s["first_step"], s["last_epoch_end"], s["weights_end"]
    parts = dict.fromkeys(PARTS, 0.0)
    parts["startup"] = first - command
    per_epoch, edge = [], first  # edge: where the last attributed interval ended

    def gap(until: float) -> None:
        nonlocal edge
        parts["boundaries"] += max(until - edge, 0.0)
        edge = max(edge, until)

    for i, e in enumerate(epochs):
        start = first if i == 0 else e["train_start"]
        gap(start)
        training = e["train_end"] - start
        parts["training"] += training
        edge = e["train_end"]
        validation = None
        if "val_start" in e:
            gap(e["val_start"])
            validation = e["val_end"] - e["val_start"]
            parts["validation"] += validation
            edge = e["val_end"]
        per_epoch.append({"epoch": e["epoch"], "training_s": training, "validation_s": validation})
    gap(last)
    parts["end"] = done - last
    wall = done - command
    parts["other"] = wall - sum(v for k, v in parts.items() if k != "other")
    final = s["final_val_end"] - s["final_val_start"] if "final_val_start" in s and "final_val_end" in s else 0.0
    saves = sum(e["save_end"] - e["save_start"] for e in epochs if "save_start" in e and "save_end" in e)
    return {
        "wall_s": wall,
        "breakdown": parts,
        "startup_parts": _startup_parts(command, s, STARTUP["ddp_launch" if "rank_start" in s else "ultralytics"]),
        "end_parts": {"final_validation": final, "checkpoints": parts["end"] - final},
        "boundary_parts": {"checkpoints": saves, "other": parts["boundaries"] - saves},
        "setup_parts": _setup_parts(s.get("imports_done"), timeline.get("setup") or []),
        "epochs": per_epoch,
    }


def _setup_parts(start: float | None, setup: list[dict]) -> list[dict]:
    """The rank's set-up (its components, part by part: components.Rank), from the end of its imports."""
    out, previous = [], start
    for p in setup if start is not None else []:
        out.append({"part": p["part"], "s": p["end"] - previous})
        previous = p["end"]
    return out


def _startup_parts(command: float, stamps: dict, steps: list[tuple[str, str]]) -> list[dict]:
    out, previous = [], command
    for key, what in steps:
        if stamps.get(key) is None:
            continue
        out.append({"until": key, "what": what, "s": stamps[key] - previous})
        previous = stamps[key]
    return out


def timeline_in_order(command: float, timeline: dict) -> list[str]:
    """What is out of order in a side's timeline (empty: every stamp follows the one before)."""
    s = timeline["stamps"]
    seq = [("command", command)]
    for i, e in enumerate(timeline["epochs"]):
        seq += [(f"epoch {e['epoch']} train_start", e["train_start"])]
        seq += [("first_step", s["first_step"])] if i == 0 else []
        seq += [(f"epoch {e['epoch']} {k}", e[k]) for k in ("train_end", "val_start", "val_end", "save_start",
                                                             "save_end") if k in e]
    seq += [(k, s[k]) for k in ("last_epoch_end", "final_val_start", "final_val_end", "weights_end") if k in s]
    return [f"{b} ({tb:.3f}) before {a} ({ta:.3f})" for (a, ta), (b, tb) in zip(seq, seq[1:]) if tb < ta]


# --- running the sides -----------------------------------------------------------------------------------------------
# the launch settings both sides share (ddp_launch_command, ultralytics_settings), and the groups ddp-bench reads itself
SHARED = ("gpus", "seed", "train.imgsz", "train.epochs", "train.batch_per_device", "train.close_mosaic", "optim.base_lr")
OWN = ("bench", "hydra", "data", "model", "paths", "experiment", "dry_run")


def launch_overrides(overrides) -> list[str]:
    """Of ddp-bench's command line, the launch settings the ddp_launch sides take as given (loader.augment_on=gpu):
    all but the shared ones and those of ddp-bench's own groups, which reach both sides otherwise."""
    return [o for o in overrides
            if "=" in o and override_key(o) not in SHARED and override_key(o).split(".")[0] not in OWN]


def ddp_launch_command(cfg: dict, data_path: Path, seed: int, on_gpu: bool, run_dir: Path,
                       overrides: list[str] = ()) -> list[str]:
    """The ddp-launch command of the comparison: its defaults, plus the shared settings; `overrides` (the command
    line's launch settings, then a variant's) replace a shared setting of the same key, or are added."""
    exe = Path(sys.executable).parent / "ddp-launch"
    head = [str(exe)] if exe.exists() else [sys.executable, "-m", "launcher.cli"]
    t, m = cfg["train"], cfg["model"]
    replaced = {override_key(o) for o in overrides}
    shared = [
        f"gpus={1 if on_gpu else 0}",
        f"model={m['name']}",
        f"model.cfg={_value(m.get('cfg'))}",
        f"model.weights={_value(m.get('weights'))}",
        "data=custom",
        f"data.path={data_path}",
        f"train.imgsz={t['imgsz']}",
        f"train.epochs={t['epochs']}",
        f"train.batch_per_device={t['batch_per_device']}",
        f"train.close_mosaic={t['close_mosaic']}",
        "train.val_interval=1",
        "optim.name=sgd",
        f"optim.base_lr={cfg['optim']['base_lr']}",
        f"seed={seed}",
        f"paths.cache={cfg['paths']['cache']}",
        f"hydra.run.dir={run_dir}",
    ]
    return head + [a for a in shared if override_key(a) not in replaced] + list(overrides)


def _value(v) -> str:
    return "null" if v is None else str(v)


def ultralytics_settings(cfg: dict, model, data_path: Path, seed: int, on_gpu: bool, task: str = "detect") -> dict:
    t = cfg["train"]
    return {"task": task, "model": model.cfg or model.weights, "data": str(data_path), "imgsz": t["imgsz"],
            "epochs": t["epochs"], "batch": t["batch_per_device"], "lr0": cfg["optim"]["base_lr"],
            "close_mosaic": t["close_mosaic"], "seed": seed, "workers": int(cfg["bench"]["baseline_workers"]), "device": 0 if on_gpu else "cpu"}


def run(cfg: dict, run_dir: Path, model, data, on_gpu: bool, command: str, dry_run: bool, base_dir: Path,
        task: str = "detect", given: list[str] = ()) -> int:
    """The sides, seed by seed, then the report; `given`: ddp-bench's command line (launch_overrides)."""
    seeds = list(cfg["bench"].get("seeds") or [cfg["seed"]])
    variants = dict(cfg["bench"].get("variants") or {})
    settings, environment = _settings(cfg, model, data, seeds, on_gpu, variants, task), report.environment()
    earlier, problems = time_to_model_earlier.read(cfg["bench"].get("earlier"), base_dir, run_dir)
    problems += time_to_model_earlier.problems(earlier, settings, environment)
    if problems:
        raise PlanError(config_problems(problems))
    # the sides' order goes on alternating from the earlier invocations' seeds
    order = run_order(seeds, side_names(variants), first=sum(len(r["settings"]["seeds"]) for r in earlier))
    cache = Path(cfg["paths"]["cache"]).expanduser()
    # both sides' data=: the data YAML written here, or a classifier's class folders as they are (Ultralytics reads
    # data=path/to/folder, and ddp-launch's data.path takes it as Ultralytics does)
    folders = rules(task).folders
    data_path = Path(str(data.spec["path"])) if folders else run_dir / "data.yaml"
    say(f"ddp-bench time_to_model: {len(order)} run(s), task {task}, on {'one GPU' if on_gpu else 'the CPU'}, "
        f"seeds {seeds}; Ultralytics' side is its {trainer(task)}, each side's quality its {quality(task)[1]}")
    for r in earlier:
        say(f"reported with the sides of seeds {r['settings']['seeds']} from {r['path']}")
    say(f"run folder      {run_dir}\n")
    if dry_run:
        for side, seed in order:
            if side != "ultralytics":
                command_line = ddp_launch_command(cfg, data_path, seed, on_gpu, run_dir / f"{side}-seed{seed}" / "run",
                                                  _overrides(side, variants, given))
                say(f"  {side} seed {seed}: {' '.join(command_line)}")
            else:
                shared = ultralytics_settings(cfg, model, data_path, seed, on_gpu, task)
                say(f"  {side} seed {seed}: Ultralytics' {trainer(task)}: YOLO({shared['model']!r}, task={task!r})"
                    f".train(**{shared})")
        say("\ndry run: nothing started")
        return 0
    run_dir.mkdir(parents=True, exist_ok=True)
    if not folders:
        data_path.write_text(yaml.safe_dump(data.spec, sort_keys=False))
    prepare_ultralytics_home(cache)
    env = {**os.environ, **offline_environment(cache), "PYTHONUNBUFFERED": "1"}
    scan = subprocess.run([sys.executable, "-m", ULTRALYTICS_MODULE, "--scan", str(data_path), task], env=env,
                          capture_output=True, text=True)
    if scan.returncode != 0:
        say(f"ddp-bench: scanning the dataset's labels failed:\n{scan.stdout[-2000:]}{scan.stderr[-2000:]}")
        return 1
    sides, stopped = [], None
    for i, (side, seed) in enumerate(order):
        side_dir = run_dir / f"{side}-seed{seed}"
        say(f"--- {side} seed {seed} ---")
        record = run_side(side, seed, side_dir, cfg, model, data_path, on_gpu, env, _overrides(side, variants, given),
                          task)
        record["order"] = i
        sides.append(record)
        if "signal" in record:  # the report holds the sides run so far, this one failed
            stopped = record["signal"]
            say(f"ddp-bench: stopped by {signal.Signals(stopped).name}; the report holds the sides run so far")
            break
        if "error" in record:
            say(f"    {side} seed {seed}: failed ({record['error']}), its log ending:")
            say("\n".join(f"      {line}" for line in last_lines(Path(record["log"]))))
        else:
            say(f"    {side} seed {seed}: {record['wall_s']:.1f} s to the weights, "
                f"{maps_text(record, own_metric(task), '.4f')}, "
                + ", ".join(f"{k} {v:.1f} s" for k, v in record["breakdown"].items() if k != "other"))
    sides, settings, sources = time_to_model_earlier.combined(earlier, sides, settings)
    out = summarize(sides, settings["variants"], task)
    out.update(kind="time_to_model", command=command, settings=settings, environment=environment, earlier=sources)
    write(out, run_dir)
    say("\n" + markdown(out))
    say(f"report: {run_dir / 'bench.md'}, {run_dir / 'bench.json'}, {run_dir / 'bench.png'}")
    if stopped is not None:
        return 128 + stopped
    return 0 if all("error" not in s for s in sides) else 1


def last_lines(log: Path, count: int = 4) -> list[str]:
    """The last `count` non-blank lines of a side's console log: why it failed, where it says so."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return [f"({log} could not be read)"]
    return [line for line in lines if line.strip()][-count:]


def _overrides(side: str, variants: dict, given: list[str] = ()) -> list[str]:
    """A side's overrides: the command line's launch settings, then its variant's, which replace them key by key."""
    variant = list(variants[side.removeprefix("ddp_launch-")]) if side.startswith("ddp_launch-") else []
    keys = {override_key(o) for o in variant}
    return [o for o in launch_overrides(given) if override_key(o) not in keys] + variant


def run_side(side: str, seed: int, side_dir: Path, cfg: dict, model, data_path: Path, on_gpu: bool, env: dict,
             overrides: list[str] = (), task: str = "detect") -> dict:
    side_dir.mkdir(parents=True, exist_ok=True)
    if side == "ultralytics":
        (side_dir / "side.json").write_text(json.dumps(ultralytics_settings(cfg, model, data_path, seed, on_gpu, task)))
        cmd = [sys.executable, "-m", ULTRALYTICS_MODULE, str(side_dir)]
    else:
        cmd = ddp_launch_command(cfg, data_path, seed, on_gpu, side_dir / "run", overrides)
    log = side_dir / "console.log"
    with open(log, "wb") as out:
        started = time.time()  # the wall clock starts here: the command, as a user types it
        code, signum = run_side_process(cmd, env=env, cwd=side_dir, log=out)
        exited = time.time()
    record = {"name": side, "seed": seed, "command_line": cmd, "log": str(log), "exit_code": code}
    if signum is not None:
        return {**record, "error": f"stopped by {signal.Signals(signum).name}", "signal": signum}
    result = side_dir / ("result.json" if side == "ultralytics" else "run/summary.json")
    if code != 0 or not result.is_file():
        return {**record, "error": f"exit code {code}; see {log}"}
    measured = json.loads(result.read_text())
    timeline = measured["timeline"]
    stamps = timeline["stamps"]
    boxes = rules(task).boxes  # a classifier's sides have no box mAP (summary.json's stays 0): None, left out
    record.update(
        **{m.key: measured[m.key] if boxes else None for m in BOX}, quality=measured.get(quality(task)[0]),
        trainer=measured.get("trainer"), data_wait=measured.get("data_wait"),
        host_wait=measured.get("host_wait"), gpu_util=measured.get("gpu_util"),
        images_per_s=measured.get("images_per_s"),
        input_threads=(measured.get("ranks") or [{}])[0].get("input_threads"),  # ddp-launch's GPU input, rank 0
        run_dir=str(side_dir / ("ultralytics" if side == "ultralytics" else "run")),
        **breakdown(started, timeline),
        process_s=exited - started,
        # after the weights: Ultralytics' plots (results.png), then each process's exit
        after_weights={"plots_s": stamps["plots_end"] - stamps["weights_end"] if "plots_end" in stamps else 0.0,
                       "exit_s": exited - max(stamps["weights_end"], stamps.get("plots_end", 0.0))},
        process_start={"parent": started, "child": stamps.get("launcher_start") or stamps.get("module_start")},
        timeline_problems=timeline_in_order(started, timeline),
        timeline=timeline,
        started=started,
    )
    if side == "ultralytics":
        record["plots"] = measured.get("plots")
    return record


def _settings(cfg: dict, model, data, seeds: list[int], on_gpu: bool, variants: dict | None = None,
              task: str = "detect") -> dict:
    spec = data.spec
    root = Path(str(spec.get("path") or "."))
    train = spec["train"] if isinstance(spec["train"], list) else [spec["train"]]
    files = list_images([str(root / str(e)) for e in train])
    sizes = [os.path.getsize(f) for f in files]
    t = cfg["train"]
    return {
        "model": model.cfg or model.weights,
        "task": task,
        "data": {"name": data.name, "path": str(spec.get("path")), "train_images": data.train_images,
                 "val_images": data.val_images, "mean_train_file_kb": sum(sizes) / len(sizes) / 1000 if sizes else None},
        "imgsz": t["imgsz"], "epochs": t["epochs"], "batch": t["batch_per_device"], "optimizer": "SGD",
        "lr0": cfg["optim"]["base_lr"], "close_mosaic": t["close_mosaic"], "seeds": seeds, "val_interval": 1,
        "device": "one GPU" if on_gpu else "CPU", "ultralytics_workers": int(cfg["bench"]["baseline_workers"]),
        "variants": dict(variants or {}),
    }

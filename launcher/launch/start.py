"""From a composed config to running ranks: plan, validate, print, write the run folder, start; and resume.

Nothing starts before the whole plan is valid: config problems first (no dataset is generated for a plan that
cannot run), then the dataset, then the full plan. A dry run prints the plan and what would run, and writes nothing.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

from launcher.inputs import ultralytics_files
from launcher.inputs.data import DatasetInfo, follows_model, resolve_data
from launcher.inputs.model_task import model_task, run_task, task_problem, task_source
from launcher.inputs.models import resolve_model
from launcher.launch import environments, resume_checkpoints, starting_weights
from launcher.launch.logs import say
from launcher.launch.outcome import say_finished
from launcher.launch.resumed_data import DATA_KEYS, missing_problems, moved_dataset
from launcher.launch.run_lock import RunLock
from launcher.launch.ultralytics_home import prepare_ultralytics_home
from launcher.machine.ports import port_is_free
from launcher.plan.checks import check_plan
from launcher.plan.describe import describe
from launcher.plan.plan import make_plan
from launcher.problems import PlanError, Problem, config_problems
from launcher.run_folder import RunFolder, writable

# What `ddp-launch resume=RUN_DIR` may change: where and on how many ranks the run continues, and where its cache
# is. Everything else is the run's own config (a different epoch count or learning rate is another run).
RESUME_KEYS = ("gpus", "nproc", "nnodes", "node_rank", "mode", "dist.master_addr", "dist.master_port",
               "dist.timeout_s", "dist.max_restarts", "paths.cache")


def start(cfg: dict, run_dir: Path, base_dir: Path, on_plan=None, translated: list[str] = ()) -> int:
    """Plan the composed config, then start it (or print it: dry_run=true). Returns the exit code; PlanError when
    the plan cannot run, before anything is written. `on_plan(plan)` sees the plan once it is checked (the API);
    `translated`, the Ultralytics keys typed and what they became (plan/ultralytics_keys.py), is shown with it."""
    dry_run = bool(cfg.get("dry_run"))
    env = environments.get(cfg["launcher"]["name"])
    cfg = env.planning_config(cfg)
    # Where it runs first: the cluster's tools, the run folder (one that holds a run keeps its records as they are).
    errors, env_warnings = check_plan(env.problems(cfg, run_dir) + RunFolder(run_dir).new_run_problems()
                                      + cache_problems(_cache(cfg)), dry_run=dry_run)
    if errors:
        raise PlanError(errors)
    hw = env.hardware(cfg)

    # Config problems first: no point generating a dataset for a plan that cannot run.
    model, model_msgs = resolve_model(cfg["model"], base_dir, weight_dirs(cfg))
    _, early = make_plan(cfg, hw)
    errors, _ = check_plan(early + config_problems(model_msgs), dry_run=True)
    if errors:
        raise PlanError(errors + [p for p in early if p.environment and not dry_run])

    named_task = model_task(model.cfg or model.weights) if model else None

    def data_for(task: str | None):
        return resolve_data(cfg["data"], base_dir, generate=not dry_run, cache_dir=_cache(cfg),
                            datasets_dir=Path(cfg["paths"]["datasets"]), model_task=task)

    data, data_problems = data_for(named_task)
    if model is not None and data is not None:
        model, weights_problems = starting_weights.check(model, data, _cache(cfg))
        read_task = model_task(model.arch) if model.arch and not model.cfg else None
        if read_task not in (None, named_task) and follows_model(cfg["data"]):
            # a checkpoint whose name does not tell its task (a renamed classifier): the built-in data labelled for
            # the task its network has, and its weights checked against that
            data, data_problems = data_for(read_task)
            if data is not None:
                model, weights_problems = starting_weights.check(model, data, _cache(cfg))
    task, task_from = "detect", None
    if model is not None and data is not None:
        data_problems += weights_problems
        other_task = task_problem(model.arch, f"model.weights={model.weights}") if not model.cfg else None
        data_problems += [Problem(other_task)] if other_task else []
        arch = model.cfg or model.arch or model.weights
        task, mismatch = run_task(arch, data.spec, f"model={Path(str(model.cfg or model.weights)).name}", data.checks)
        task_from = task_source(arch)
        data_problems += [Problem(m) for m in mismatch]
    plan, problems = make_plan(cfg, hw, data, port_is_free=port_is_free, task=task, task_from=task_from)
    errors, warnings = check_plan(problems + config_problems(model_msgs) + data_problems, dry_run=dry_run)

    say("ddp-launch plan")
    say(describe(plan, model, data, translated=translated, cfg=cfg))
    say(f"run folder      {run_dir}")
    for w in env_warnings + warnings:
        say(f"WARNING: {w.message} (a real run would refuse)")
    if errors:
        raise PlanError(errors)
    if on_plan is not None:
        on_plan(plan)
    if dry_run:
        say("\n" + env.dry_run_text(cfg, plan, run_dir))
        say("\ndry run: nothing started")
        return 0

    assert data is not None and model is not None
    prepare_ultralytics_home(_cache(cfg))  # before the run folder: a failure here leaves nothing behind
    folder = RunFolder(run_dir)
    with RunLock(run_dir).held():  # the first file of the run: one trainer per folder, for the run's life
        folder.create(cfg, plan, model, data)
        return env.start(cfg, plan, folder)


def resume(run_dir: Path, overrides: dict, fresh_dir: Path | None = None) -> int:
    """`ddp-launch resume=RUN_DIR`: continue a stopped run with its own config and plan, in its own folder.

    `overrides` ({key: value} as given on the command line) may only move the run (RESUME_KEYS): the plan is then
    made again for the new topology (global batch, lr0 and warmup follow the plan's rules) and the ranks restart
    the interrupted epoch; or name where its dataset moved (data.path: resumed_data.py). The folder may have moved
    too: everything in it is found from where it is now. `fresh_dir`, the folder Hydra made for this invocation, is
    removed when it is empty."""
    folder = RunFolder(Path(run_dir).expanduser().resolve())
    if fresh_dir is not None and fresh_dir != folder.path and fresh_dir.is_dir():
        if not any(p for p in fresh_dir.iterdir() if p.name != ".hydra"):
            shutil.rmtree(fresh_dir)
    cfg, plan = folder.load()
    overrides = {k: v for k, v in overrides.items() if _select(cfg, k) != v}  # what really changes
    refused = sorted(k for k in overrides if k not in RESUME_KEYS + DATA_KEYS)
    if refused:
        raise PlanError([
            Problem(f"resume={folder.path} continues the run with its own config; {', '.join(refused)} cannot change. "
                    f"Only where it runs may: {', '.join(RESUME_KEYS)}, and data.path where its dataset moved. Start a "
                    "new run to change the rest")
        ])
    moved_to = overrides.pop("data.path", overrides.pop("data.root", None))
    if folder.finished():
        say_finished(folder)
        return 0
    if not writable(folder.path):
        raise PlanError([Problem(f"resume={folder.path}: the run folder cannot be written (a read-only file system, or "
                                 "no permission), and a resume writes its checkpoints and logs there; copy it somewhere "
                                 "writable and pass resume=THE_COPY")])
    env = environments.get(cfg["launcher"]["name"])
    if overrides and env.name == "slurm":
        raise PlanError([Problem(f"resume={folder.path} resubmits the run's own job.sbatch; {', '.join(overrides)} "
                                 "cannot change a SLURM run's allocation")])
    cache = Path(str(overrides.get("paths.cache", cfg["paths"]["cache"]))).expanduser()
    if cache_problems(cache):
        raise PlanError(cache_problems(cache))
    with RunLock(folder.path).held():  # before anything is written into the folder, until the run ends
        data = None if moved_to is None else moved_dataset(folder, plan, cfg["data"]["name"], moved_to, Path.cwd(),
                                                             cache)
        if data is None and missing_problems(folder):
            raise PlanError(missing_problems(folder))
        if overrides:
            cfg, plan = _replan(cfg, overrides, env, folder, data, plan)
        line, problems = resume_checkpoints.verdict(folder, resume_checkpoints.inspect(folder, _cache(cfg)))
        if problems:
            raise PlanError(problems)
        if data is not None:
            folder.move_data(data.spec)
            say(f"the run's dataset is now {data.spec['path']} (the one before: {folder.path / 'data.prev.yaml'})")
        if overrides:
            folder.replan(cfg, plan)
        prepare_ultralytics_home(cache)
        if line:
            say(line)
        batch = "chosen on the GPUs" if plan.batch_pending else plan.global_batch  # auto: measured again
        say(f"resuming {folder.path} with its own config (world size {plan.world_size}, global batch {batch})")
        return env.resume(cfg, plan, folder)


def resume_target(value, base_dir: Path) -> Path:
    """The run folder `resume=VALUE` names, as Ultralytics reads resume: a run folder, a checkpoint inside one
    (RUN/weights/last.pt), or true: the newest run under ./runs that has not finished."""
    if value is True or str(value).lower() == "true":
        runs = sorted((f.parent for f in (base_dir / "runs").glob("**/plan.json") if RunFolder(f.parent).is_run()),
                      key=lambda folder: folder.stat().st_mtime)
        unfinished = [f for f in runs if not RunFolder(f).finished()]
        if not unfinished:
            raise PlanError([Problem(f"resume=true: no unfinished run under {base_dir / 'runs'}; name the run folder: "
                                     "resume=RUN_DIR")])
        return unfinished[-1]
    path = Path(str(value)).expanduser()
    path = path if path.is_absolute() else base_dir / path
    if path.suffix == ".pt":
        folder = path.parent.parent if path.parent.name == "weights" else path.parent
        if not RunFolder(folder).is_run():
            raise PlanError([Problem(f"resume={value}: not inside a ddp-launch run folder (RUN/weights/last.pt); to "
                                     f"start a new run from these weights use model={value}")])
        return folder
    return path


def _cache(cfg: dict) -> Path:
    return Path(cfg["paths"]["cache"]).expanduser()


def cache_problems(cache: Path) -> list[Problem]:
    """paths.cache must take files before any rank starts: Ultralytics' offline settings, the synthetic data and the
    data checks' verdicts are written there (its default lies under the home folder)."""
    if writable(cache):
        return []
    return [Problem(f"paths.cache={cache} cannot be created or written (a missing or read-only home folder, or no "
                    "permission), and ddp-launch keeps Ultralytics' offline settings and the data checks there; set "
                    "paths.cache=A_WRITABLE_FOLDER (or DDP_LAUNCH_CACHE)", environment=True)]


def weight_dirs(cfg: dict) -> list[Path]:
    """Where a weights file named without a folder is looked for after the current one: paths.weights (where
    model.allow_download puts it), then the weights folder of the user's own Ultralytics settings."""
    own = ultralytics_files.user_weights_dir()
    return [Path(cfg["paths"]["weights"]).expanduser()] + ([own] if own else [])


def _select(cfg: dict, key: str):
    node = cfg
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _replan(cfg: dict, overrides: dict, env, folder: RunFolder, data: DatasetInfo | None, before):
    """The run's config with the topology overrides, planned for this machine on its dataset (`data`, where it
    moved; else the folder's data.yaml) for the task of its plan `before`: PlanError before anything is written."""
    moved = copy.deepcopy(cfg)
    for key, value in overrides.items():
        node = moved
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    moved = env.planning_config(moved)
    data_problems = []
    if data is None:
        data, data_problems = resolve_data({"name": moved["data"]["name"], "path": str(folder.data_file)}, folder.path,
                                           cache_dir=_cache(moved))
    plan, problems = make_plan(moved, env.hardware(moved), data, port_is_free=port_is_free, task=before.task,
                               task_from=before.task_from)
    errors, _ = check_plan(problems + data_problems, dry_run=False)
    if errors:
        raise PlanError(errors)
    say(describe(plan, None, data))
    return moved, plan


"""`ddp-launch`: compose the config (Hydra), plan and validate, then run torchrun; or print the plan (dry_run=true).

Hydra composes once, here. The ranks read the resolved config from the run folder and never run Hydra.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from launcher import data as datamod
from launcher import hardware, ports, runenv, torchrun
from launcher.models import resolve_model
from launcher.plan import check_plan, describe, make_plan
from launcher.problems import PlanError, Problem, config_problems

EXIT_PLAN_ERROR = 2


def conf_dir() -> str:
    """The Hydra configs: `launcher/conf` in an installed wheel, the repository's `conf/` in a checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return str(candidate)
    raise FileNotFoundError(f"ddp-launch's Hydra configs are missing (looked in {here / 'conf'} and {here.parent / 'conf'})")


def say(msg: str = "") -> None:
    print(msg, flush=True)


def launch(cfg: dict, run_dir: Path, base_dir: Path) -> int:
    """Everything after composition. Returns the process exit code."""
    dry_run = bool(cfg.get("dry_run"))
    on_slurm = cfg["launcher"]["name"] == "slurm"
    if on_slurm:
        from launcher import slurm

        # nnodes and GPUs per node come from slurm.*, written into the config the plan and the ranks read
        cfg = slurm.planning_config(cfg)
        errors, _ = check_plan(slurm.submission_problems(cfg, run_dir), dry_run=dry_run)
        if errors:
            raise PlanError(errors)
        hw = slurm.allocation_hardware(cfg)  # the plan is for the nodes SLURM will give, not this login node
    else:
        hw = hardware.detect()

    # Config problems first: no point generating a dataset for a plan that cannot run.
    model, model_msgs = resolve_model(cfg["model"], base_dir)
    _, early = make_plan(cfg, hw)
    errors, _ = check_plan(early + config_problems(model_msgs), dry_run=True)
    if errors:
        raise PlanError(errors + [p for p in early if p.environment and not dry_run])

    data, data_problems = datamod.resolve_data(cfg["data"], base_dir, generate=not dry_run)
    plan, problems = make_plan(cfg, hw, data, port_is_free=ports.port_is_free)
    errors, warnings = check_plan(problems + config_problems(model_msgs) + data_problems, dry_run=dry_run)

    cache = Path(cfg["paths"]["cache"]).expanduser()
    env = {**runenv.offline_environment(cache), **plan.env}
    cmd = [] if on_slurm else torchrun.torchrun_command(plan, run_dir)  # a SLURM job builds one per node

    say("ddp-launch plan")
    say(describe(plan, model, data))
    say(f"run folder      {run_dir}")
    for w in warnings:
        say(f"WARNING: {w.message} (a real run would refuse)")
    if errors:
        raise PlanError(errors)
    if dry_run and on_slurm:
        say("\n" + slurm.dry_run_text(cfg, plan, run_dir, env))
        say("\ndry run: nothing started")
        return 0
    if dry_run:
        say("\ntorchrun command (with this environment on top of yours):")
        say(torchrun.format_command(cmd, env))
        say("\ndry run: nothing started")
        return 0

    assert data is not None and model is not None
    write_run_folder(run_dir, cfg, plan, model, data, env, cmd)

    if on_slurm:
        return slurm.submit_job(cfg, plan, run_dir, env)

    code = run_plan(cfg, plan, run_dir, env, cmd)
    if code != 0 and ddp_failed_to_start(cfg, plan, run_dir):
        dp_plan, dp_problems = make_plan({**cfg, "mode": "dp", "nproc": None}, hw, data)
        if not check_plan(dp_problems, dry_run=False)[0]:
            say(
                f"\nWARNING: DDP could not start ({plan.backend} process group, see above); dist.fallback=dp: "
                f"retrying with DataParallel on {dp_plan.devices_per_rank} device(s) in one process"
            )
            os.replace(run_dir / "plan.json", run_dir / "plan.ddp-failed.json")
            (run_dir / "plan.json").write_text(json.dumps(dp_plan.to_dict(), indent=2))
            dp_env = {**runenv.offline_environment(cache), **dp_plan.env}
            code = run_plan(cfg, dp_plan, run_dir, dp_env, torchrun.torchrun_command(dp_plan, run_dir))
    return code


def ddp_failed_to_start(cfg: dict, plan, run_dir: Path) -> bool:
    """mode=auto with dist.fallback=dp, and a rank reported that its process group never came up."""
    if cfg["mode"] != "auto" or cfg["dist"].get("fallback") != "dp" or plan.mode != "ddp":
        return False
    records = [json.loads(f.read_text()) for f in (run_dir / "ranks").glob("rank*.failed.json")]
    return any(r.get("phase") == "init" for r in records)


def write_run_folder(run_dir: Path, cfg: dict, plan, model, data, env: dict, cmd: list[str]) -> None:
    """What the ranks read: the resolved config (with resolved model and data paths) and the plan."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if (run_dir / "plan.json").exists():
        raise PlanError([Problem(f"{run_dir} already holds a run; choose another hydra.run.dir")])
    data_yaml = datamod.write_data_yaml(data, run_dir / "data.yaml")
    resolved = dict(cfg)
    resolved["model"] = {**cfg["model"], "cfg": model.cfg, "weights": model.weights}
    resolved["data"] = {**cfg["data"], "path": str(data_yaml)}
    OmegaConf.save(OmegaConf.create(resolved), run_dir / "config.yaml")
    (run_dir / "plan.json").write_text(json.dumps(plan.to_dict(), indent=2))
    if cfg["launcher"]["name"] != "slurm":  # a SLURM job's command is in job.sbatch; each node builds its own
        (run_dir / "torchrun.sh").write_text("#!/bin/sh\n# what ddp-launch ran\nexec " + torchrun.format_command(cmd, env) + "\n")
    runenv.prepare_ultralytics_home(Path(cfg["paths"]["cache"]).expanduser())


def run_plan(cfg: dict, plan, run_dir: Path, env: dict, cmd: list[str]) -> int:
    """Start torchrun for a prepared run folder, stream rank 0, and report the outcome."""
    first_rank = plan.node_rank * plan.nproc_per_node
    show = range(first_rank, first_rank + plan.nproc_per_node) if cfg["dist"]["debug"] else [first_rank]
    logs = [run_dir / "logs" / f"rank{r}.log" for r in show]
    say(f"\nstarting {plan.nproc_per_node} rank(s); logs in {run_dir / 'logs'}\n")
    code, signum = torchrun.run_torchrun(cmd, env, logs, prefix=len(logs) > 1)
    return report(run_dir, code, signum, plan.node_rank)


def resume(run_dir: Path, fresh_dir: Path) -> int:
    """`ddp-launch resume=RUN_DIR`: continue a stopped run with its own resolved config and plan."""
    from launcher.plan import LaunchPlan

    run_dir = run_dir.expanduser().resolve()
    if fresh_dir != run_dir and fresh_dir.is_dir() and not any(p for p in fresh_dir.iterdir() if p.name != ".hydra"):
        shutil.rmtree(fresh_dir)  # the folder Hydra made for this invocation: the run continues in its own
    if not (run_dir / "config.yaml").is_file() or not (run_dir / "plan.json").is_file():
        raise PlanError([Problem(f"resume={run_dir}: not a ddp-launch run folder (no config.yaml and plan.json)")])
    summary = run_dir / "summary.json"
    if summary.exists() and json.loads(summary.read_text()).get("status") == "finished":
        s = json.loads(summary.read_text())
        say(f"{run_dir} already finished: {s['epochs_completed']} epoch(s), mAP50 {s['map50']:.4f}; nothing to resume")
        say(f"weights     {s['weights']}")
        return 0
    cfg = OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"), resolve=True)
    plan = LaunchPlan.from_dict(json.loads((run_dir / "plan.json").read_text()))
    cache = Path(cfg["paths"]["cache"]).expanduser()
    runenv.prepare_ultralytics_home(cache)
    env = {**runenv.offline_environment(cache), **plan.env}
    say(f"resuming {run_dir} with its own config (world size {plan.world_size}, global batch {plan.global_batch})")
    if plan.rendezvous.kind == "slurm":
        from launcher import slurm

        return slurm.sbatch(cfg, plan, run_dir)
    return run_plan(cfg, plan, run_dir, env, torchrun.torchrun_command(plan, run_dir))


def write_outcome(run_dir: Path, status: str, exit_code: int, detail: str) -> None:
    """A failed or stopped run still gets a summary: what happened, and which rank failed first, with what."""
    failures = sorted(
        (json.loads(f.read_text()) for f in (run_dir / "ranks").glob("rank*.failed.json")),
        key=lambda r: r.get("time", 0.0),
    )
    outcome = {
        "status": status,
        "exit_code": exit_code,
        "detail": detail,
        "root_cause": failures[0] if failures else None,
        "failures": failures,
        "run_dir": str(run_dir),
    }
    (run_dir / "summary.json").write_text(json.dumps(outcome, indent=2))
    for i, fail in enumerate(failures):
        say(f"  {'root cause' if i == 0 else 'then'}: rank {fail['rank']}: {fail['error']}")


def report(run_dir: Path, code: int, signum: int | None, node_rank: int) -> int:
    summary_file = run_dir / "summary.json"
    finished = summary_file.exists() and json.loads(summary_file.read_text()).get("status") == "finished"
    if signum is not None and not finished:
        detail = f"stopped by {signal.Signals(signum).name}; the last checkpoint is in {run_dir / 'weights'}"
        say(f"\nddp-launch: {detail}. Continue with: ddp-launch resume={run_dir}")
        write_outcome(run_dir, "stopped", 128 + signum, detail)
        return 128 + signum
    if code != 0 and not finished:
        detail = f"training failed (torchrun exit code {code}); rank logs in {run_dir / 'logs'}"
        say(f"\nddp-launch: {detail}")
        write_outcome(run_dir, "failed", code, detail)
        return code
    if not finished:
        if node_rank != 0:
            say("\nddp-launch: this node's ranks finished; rank 0 writes the summary on node 0")
            return 0
        say(f"\nddp-launch: the ranks exited without writing {summary_file}")
        return 1
    s = json.loads(summary_file.read_text())
    say(
        f"\ndone: {s['epochs_completed']} epoch(s) on {s['world_size']} rank(s), global batch {s['global_batch']}, "
        f"lr0 {s['lr0']:.6g}, {s['images_per_s']:.1f} images/s (steady state)"
    )
    say(f"mAP50 {s['map50']:.4f}  mAP50-95 {s['map50_95']:.4f}")
    say(f"weights     {s['weights']}")
    say(f"run folder  {run_dir}")
    return 0


@hydra.main(version_base="1.3", config_path=conf_dir(), config_name="config")
def _hydra_entry(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir).resolve()
    resolved = OmegaConf.to_container(cfg, resolve=True)
    if resolved.get("resume"):
        exit_with(lambda: resume(Path(str(resolved["resume"])), run_dir))
    exit_with(lambda: launch(resolved, run_dir, Path(os.getcwd())))


def exit_with(action) -> None:
    """Exit with `action()`'s code; a PlanError is the user's to fix: its message, no traceback, exit code 2."""
    try:
        code = action()
    except PlanError as e:
        print(f"ERROR: {e}", file=sys.stderr, flush=True)
        code = EXIT_PLAN_ERROR
    sys.exit(code)


def main() -> None:
    _hydra_entry()


if __name__ == "__main__":
    main()

"""`ddp-launch`: compose the config (Hydra), plan and validate, then run torchrun; or print the plan (dry_run=true).

Hydra composes once, here. The ranks read the resolved config from the run folder and never run Hydra.
"""

from __future__ import annotations

import json
import os
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
    cmd = torchrun.torchrun_command(plan, run_dir)

    say("ddp-launch plan")
    say(describe(plan, model, data))
    say(f"run folder      {run_dir}")
    for w in warnings:
        say(f"WARNING: {w.message} (a real run would refuse)")
    if errors:
        raise PlanError(errors)
    if dry_run:
        say("\ntorchrun command (with this environment on top of yours):")
        say(torchrun.format_command(cmd, env))
        say("\ndry run: nothing started")
        return 0

    # What the ranks read: the resolved config (with resolved model and data paths) and the plan.
    assert data is not None
    run_dir.mkdir(parents=True, exist_ok=True)
    if (run_dir / "plan.json").exists():
        raise PlanError([Problem(f"{run_dir} already holds a run; choose another hydra.run.dir")])
    data_yaml = datamod.write_data_yaml(data, run_dir / "data.yaml")
    resolved = dict(cfg)
    resolved["model"] = {**cfg["model"], "cfg": model.cfg, "weights": model.weights}
    resolved["data"] = {**cfg["data"], "path": str(data_yaml)}
    OmegaConf.save(OmegaConf.create(resolved), run_dir / "config.yaml")
    (run_dir / "plan.json").write_text(json.dumps(plan.to_dict(), indent=2))
    (run_dir / "torchrun.sh").write_text("#!/bin/sh\n# what ddp-launch ran\nexec " + torchrun.format_command(cmd, env) + "\n")
    runenv.prepare_ultralytics_home(cache)

    first_rank = plan.node_rank * plan.nproc_per_node
    show = range(first_rank, first_rank + plan.nproc_per_node) if cfg["dist"]["debug"] else [first_rank]
    logs = [run_dir / "logs" / f"rank{r}.log" for r in show]
    say(f"\nstarting {plan.nproc_per_node} rank(s); logs in {run_dir / 'logs'}\n")
    code, signum = torchrun.run_torchrun(cmd, env, logs, prefix=len(logs) > 1)
    return report(run_dir, code, signum, plan.node_rank)


def report(run_dir: Path, code: int, signum: int | None, node_rank: int) -> int:
    summary_file = run_dir / "summary.json"
    if signum is not None:
        say(f"\nddp-launch: stopped by signal {signum}; run folder {run_dir}")
        return 128 + signum
    if code != 0:
        say(f"\nddp-launch: training failed (torchrun exit code {code}); rank logs in {run_dir / 'logs'}")
        return code
    if not summary_file.exists():
        if node_rank != 0:
            say(f"\nddp-launch: this node's ranks finished; rank 0 writes the summary on node 0")
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
    try:
        code = launch(resolved, run_dir, Path(os.getcwd()))
    except PlanError as e:
        print(f"ERROR: {e}", file=sys.stderr, flush=True)
        code = EXIT_PLAN_ERROR
    sys.exit(code)


def main() -> None:
    _hydra_entry()


if __name__ == "__main__":
    main()

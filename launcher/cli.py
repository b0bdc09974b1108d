"""`ddp-launch`: compose the config with Hydra, then hand it to the launch side (launch/start.py).

Hydra composes once, here. The ranks read the resolved config from the run folder and never run Hydra.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

STARTED = time.time()  # the command's start, before Hydra's imports: where rank 0's timeline begins

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from launcher.entry import EXIT_PLAN_ERROR, GROUPS, Jobs, RunFolderGuard, conf_dir, print_help_if_asked
from launcher.launch import torchrun, warm_torchrun
from launcher.plan.environment import LAUNCH_STARTED

jobs = Jobs()


def command_line_overrides(cfg: DictConfig) -> dict:
    """{key: value} of what the command line set (Hydra's task overrides), as composed."""
    keys = [o.split("=", 1)[0].lstrip("+~") for o in HydraConfig.get().overrides.task]
    return {k: OmegaConf.select(cfg, k) for k in keys}


@hydra.main(version_base="1.3", config_path=conf_dir(), config_name="config")
def _hydra_entry(cfg: DictConfig) -> int:
    from launcher.launch import start

    run_dir = RunFolderGuard.meant(Path(HydraConfig.get().runtime.output_dir)).resolve()
    resolved = OmegaConf.to_container(cfg, resolve=True)
    if resolved.get("resume"):
        overrides = {k: v for k, v in command_line_overrides(cfg).items() if k != "resume"}
        code = jobs.run(lambda: start.resume(Path(str(resolved["resume"])), overrides, run_dir))
    else:
        code = jobs.run(lambda: start.start(resolved, run_dir, Path(os.getcwd())))
    if code == EXIT_PLAN_ERROR:
        RunFolderGuard.remove_if_refused(run_dir)
    return code


def main() -> None:
    os.environ[LAUNCH_STARTED] = repr(STARTED)  # torchrun and the ranks inherit it
    conf = Path(conf_dir())
    if print_help_if_asked(sys.argv[1:], "ddp-launch", "train Ultralytics YOLO on every GPU and node, through torchrun",
                           groups={g: GROUPS[g] for g in ("model", "data", "launcher", "experiment")}, files=[(conf / "config.yaml", "")]):
        return
    if warm_torchrun.enabled() and warm_torchrun.wanted(sys.argv[1:]):  # torchrun's imports overlap the planning
        warm_torchrun.warm.start(warm_torchrun.startup_environment(sys.argv[1:]), torchrun.parent_death_signal())
    try:
        _hydra_entry()
    finally:
        warm_torchrun.warm.discard()  # not taken: a refused plan, a dry run, a SLURM submission
    jobs.exit()


if __name__ == "__main__":
    main()

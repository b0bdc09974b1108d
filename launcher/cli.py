"""`ddp-launch`: start what can overlap the planning, put Ultralytics' keys in ddp-launch's terms
(plan/ultralytics_keys.py), compose the config with Hydra, then hand it to the launch side (launch/start.py).

First thing, before Hydra's imports (tenths of a second, more where imports are slow), the warm torchrun and the
compilation of the ranks' bytecode start (launch/startup/warm_torchrun.py, launch/startup/bytecode.py): only the
standard library and a few small modules of the launcher lie beneath them. Hydra composes once, here; the ranks read the
resolved config from the run folder and never run Hydra.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

STARTED = time.time()  # the command's start, before the imports: where rank 0's timeline begins

from launcher.launch.startup import bytecode, warm_torchrun
from launcher.launch.startup.parent_death import parent_death_signal
from launcher.machine.hardware import usable_cpu_count
from launcher.plan.environment import LAUNCH_STARTED


def start_ahead(argv: list[str]) -> None:
    """Where this launch will likely start torchrun on this machine: the warm torchrun, and the ranks' bytecode
    compiled into the folder it starts with (where it is still to compile; the launch says so once planned)."""
    if not (warm_torchrun.enabled() and warm_torchrun.wanted(argv)):
        return
    startup = warm_torchrun.startup_environment(argv)
    warm_torchrun.warm.start(startup, parent_death_signal())
    bytecode.start_for(startup, usable_cpu_count(), parent_death_signal())


def command_line_overrides(cfg) -> dict:
    """{key: value} of what the command line set (Hydra's task overrides), as composed."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from launcher.entry import override_key

    keys = [override_key(o) for o in HydraConfig.get().overrides.task]
    return {k: OmegaConf.select(cfg, k) for k in keys}


def compose_and_launch(translated: list[str]) -> None:
    """Hydra's app: compose the config (once per job of a sweep), launch each job; exits with the worst code."""
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import DictConfig, OmegaConf

    from launcher.entry import EXIT_PLAN_ERROR, Jobs, RunFolderGuard, conf_dir
    from launcher.launch import start

    jobs = Jobs()

    @hydra.main(version_base="1.3", config_path=conf_dir(), config_name="config")
    def launch(cfg: DictConfig) -> int:
        run_dir = RunFolderGuard.meant(Path(HydraConfig.get().runtime.output_dir)).resolve()
        resolved = OmegaConf.to_container(cfg, resolve=True)
        jobs.announce(HydraConfig.get(), run_dir)
        if resolved.get("resume"):
            overrides = {k: v for k, v in command_line_overrides(cfg).items() if k != "resume"}
            code = jobs.run(lambda: start.resume(start.resume_target(resolved["resume"], Path(os.getcwd())),
                                                 overrides, run_dir), run_dir)
        else:
            code = jobs.run(lambda: start.start(resolved, run_dir, Path(os.getcwd()), translated=translated), run_dir)
        if code == EXIT_PLAN_ERROR:
            RunFolderGuard.remove_if_refused(run_dir)
        return code

    try:
        launch()
    finally:
        warm_torchrun.warm.discard()  # not taken: a refused plan, a dry run, a SLURM submission
    jobs.exit()


def main() -> None:
    os.environ[LAUNCH_STARTED] = repr(STARTED)  # torchrun and the ranks inherit it
    argv = sys.argv[1:]
    if "--version" in argv:
        from launcher.machine.environment_report import version_lines

        print("\n".join(version_lines()))
        return
    start_ahead(argv)  # nothing for --help and the other information flags (warm_torchrun.wanted)
    from launcher.entry import GROUPS, conf_dir, interrupted, print_help_if_asked, translated_or_exit

    conf = Path(conf_dir())
    if print_help_if_asked(argv, "ddp-launch", "train Ultralytics YOLO on every GPU and node, through torchrun",
                           groups={g: GROUPS[g] for g in ("model", "data", "launcher", "experiment")},
                           files=[(conf / "config.yaml", "")]):
        return
    try:
        translation = translated_or_exit(argv)  # Ultralytics' keys as typed (epochs=3, batch=64, device=0,1, ...)
        sys.argv = [sys.argv[0], *translation.argv]  # what Hydra's app reads
        compose_and_launch(translation.shown)
    except KeyboardInterrupt:
        interrupted()


if __name__ == "__main__":
    main()

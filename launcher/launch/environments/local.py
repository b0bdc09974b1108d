"""launcher=local: torchrun on this machine (one node, or one node of a multi-node job started by hand on each).

The launcher writes RUN_DIR/torchrun.sh (the exact command), runs it with rank 0's log on the console (every rank's
with dist.debug=true), and reports the outcome. Where the ranks keep their bytecode in the cache and this machine has
not compiled it yet, its compilation starts beside torchrun (launch/startup/bytecode.py). With mode=auto and
dist.fallback=dp, a DDP run whose process group never came up is started again as one DataParallel process.
"""

from __future__ import annotations

import sys
from pathlib import Path

from launcher.inputs.data import resolve_data
from launcher.launch import torchrun
from launcher.launch.startup import bytecode
from launcher.launch.logs import QuietStop, note, say, verbose_console
from launcher.launch.outcome import report
from launcher.launch.startup.parent_death import parent_death_signal
from launcher.machine import hardware
from launcher.plan.checks import check_plan
from launcher.plan.plan import LaunchPlan, make_plan
from launcher.problems import Problem
from launcher.run_folder import RunFolder


class LocalEnvironment:
    name = "local"

    def __init__(self) -> None:
        self._compiling = None  # the bytecode's compilation started by this launch, until it ends

    def planning_config(self, cfg: dict) -> dict:
        return cfg

    def hardware(self, cfg: dict) -> hardware.Hardware:
        return hardware.detect()

    def problems(self, cfg: dict, run_dir: Path) -> list[Problem]:
        return []

    def dry_run_text(self, cfg: dict, plan: LaunchPlan, run_dir: Path) -> str:
        cmd = torchrun.local_command(plan, run_dir)
        return "torchrun command (with this environment on top of yours):\n" + torchrun.format_command(cmd, plan.env)

    def start(self, cfg: dict, plan: LaunchPlan, folder: RunFolder) -> int:
        cmd = torchrun.local_command(plan, folder.path)
        (folder.path / "torchrun.sh").write_text(
            "#!/bin/sh\n# what ddp-launch ran\nexec " + torchrun.format_command(cmd, plan.env) + "\n"
        )
        code = self.run(cfg, plan, folder)
        fallback = self._dp_fallback(cfg, plan, folder) if code != 0 else None
        if fallback is not None:
            say(
                f"\nWARNING: DDP could not start ({plan.backend} process group, see above); dist.fallback=dp: "
                f"retrying with DataParallel on {fallback.devices_per_rank} device(s) in one process"
            )
            folder.write_plan(fallback, keep_as="plan.ddp-failed.json")
            code = self.run(cfg, fallback, folder)
        return code

    def resume(self, cfg: dict, plan: LaunchPlan, folder: RunFolder) -> int:
        return self.run(cfg, plan, folder)

    def run(self, cfg: dict, plan: LaunchPlan, folder: RunFolder) -> int:
        """Start torchrun for a planned run folder, stream rank 0 (or every rank), and report the outcome."""
        first_rank = plan.node_rank * plan.nproc_per_node
        shown = range(first_rank, first_rank + plan.nproc_per_node) if cfg["dist"]["debug"] else [first_rank]
        verbose = verbose_console(cfg)
        compiling = self._compile_bytecode(plan)
        if compiling:
            note(compiling, folder.launcher_log, verbose)
        say(f"\nstarting {plan.nproc_per_node} rank(s); logs in {folder.logs}\n")
        waiting, refusal = torchrun.rendezvous_wait(plan) or (None, None)
        if waiting:
            say(waiting)
        stderr = QuietStop(sys.stderr, rendezvous_refusal=refusal)
        cmd = torchrun.local_command(plan, folder.path)
        code, signum = torchrun.run_torchrun(cmd, plan.env, [folder.rank_log(r) for r in shown], prefix=len(shown) > 1,
                                             verbose=verbose, stderr_filter=stderr)
        if stderr.refused and signum is None:
            folder.write_outcome("refused", torchrun.EXIT_NOT_JOINED, refusal)
            return torchrun.EXIT_NOT_JOINED
        return report(folder, code, signum, plan.node_rank)

    def _compile_bytecode(self, plan: LaunchPlan) -> str | None:
        """The ranks' bytecode folder (paths.bytecode), compiled beside torchrun's start where it is still empty or
        stale; once per machine. A folder the user set through PYTHONPYCACHEPREFIX is theirs: not touched. Returns
        the line that says a compilation started (a diagnostic), or None."""
        if self._compiling is not None and self._compiling.poll() is None:
            return None  # still compiling for the launch before (the DataParallel fallback)
        started = bytecode.start_for(plan.env, plan.cpus_per_node, parent_death_signal())
        self._compiling, line = started or (None, None)
        return line

    def _dp_fallback(self, cfg: dict, plan: LaunchPlan, folder: RunFolder) -> LaunchPlan | None:
        """The DataParallel plan to retry with: mode=auto, dist.fallback=dp, and a rank reported that its process
        group never came up. None otherwise, or when DataParallel cannot run here either."""
        if cfg["mode"] != "auto" or cfg["dist"].get("fallback") != "dp" or plan.mode != "ddp":
            return None
        if not any(r.get("phase") == "init" for r in folder.failures()):
            return None
        data, _ = resolve_data({"name": cfg["data"]["name"], "path": str(folder.data_file)}, folder.path,
                               cache_dir=Path(cfg["paths"]["cache"]).expanduser())
        dp_plan, problems = make_plan({**cfg, "mode": "dp", "nproc": None}, self.hardware(cfg), data)
        return None if check_plan(problems, dry_run=False)[0] else dp_plan

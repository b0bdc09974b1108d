"""Where the ranks run: one small interface, one file per kind of cluster (`launcher=local|slurm`).

An environment says which config and which node the plan is made for, what it needs before anything is written,
what a dry run shows, and how a planned run folder is started and resumed. Everything else (planning, the run
folder, the ranks) is the same everywhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from launcher.machine.hardware import Hardware
from launcher.plan.plan import LaunchPlan
from launcher.problems import Problem
from launcher.run_folder import RunFolder


class Environment(Protocol):
    name: str

    def planning_config(self, cfg: dict) -> dict:
        """The config the plan is made from (under SLURM the topology comes from slurm.*). Raises PlanError."""

    def hardware(self, cfg: dict) -> Hardware:
        """The node the plan is for: this machine, or one node of the allocation SLURM will give."""

    def problems(self, cfg: dict, run_dir: Path) -> list[Problem]:
        """What this environment needs before anything is written (sbatch on PATH, ...)."""

    def dry_run_text(self, cfg: dict, plan: LaunchPlan, run_dir: Path) -> str:
        """What a dry run prints after the plan: the exact command or job script."""

    def start(self, cfg: dict, plan: LaunchPlan, folder: RunFolder) -> int:
        """Start (or submit) the planned run folder. Returns the launcher's exit code."""

    def resume(self, cfg: dict, plan: LaunchPlan, folder: RunFolder) -> int:
        """Continue a stopped run from its checkpoint."""


def get(name: str) -> Environment:
    if name == "slurm":
        from launcher.launch.environments.slurm import SlurmEnvironment

        return SlurmEnvironment()
    from launcher.launch.environments.local import LocalEnvironment

    return LocalEnvironment()

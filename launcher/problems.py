"""What is wrong with a launch, said so the user can act on it."""

from __future__ import annotations

import re
from dataclasses import dataclass

# Terminal escape sequences (colours, cursor moves): Ultralytics colours its messages (colorstr) even into files
ANSI_ESCAPE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")


def plain_text(text: str) -> str:
    """`text` without terminal escape sequences: what a record or a log file keeps of a coloured message."""
    return ANSI_ESCAPE.sub("", text)


@dataclass(frozen=True)
class Problem:
    message: str
    # True when the problem is about this machine rather than the config (GPUs, files, ports): a dry run shows the
    # plan anyway, with the problem as a warning, because the plan may be meant for another machine.
    environment: bool = False


class LaunchError(Exception):
    """What ddp-launch raises for a user to act on (from Python; the command prints the same message)."""


class PlanError(LaunchError):
    """Raised before any process starts; the message lists every problem found, not just the first."""

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p.message}" for p in self.problems)
        super().__init__(f"ddp-launch cannot start: {len(self.problems)} problem(s)\n{lines}")


def config_problems(messages: list[str]) -> list[Problem]:
    return [Problem(m) for m in messages]



class RunFailed(LaunchError):
    """The run started and did not finish; `code` is what `ddp-launch` would have exited with."""

    def __init__(self, code: int, run_dir):
        super().__init__(f"the run in {run_dir} ended with exit code {code}: see {run_dir}/logs")
        self.code, self.run_dir = code, run_dir

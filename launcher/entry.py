"""What both console scripts (`ddp-launch`, `ddp-bench`) share: where the Hydra configs are, how a task's outcome
becomes an exit code, and that only `main()` exits, so that a Hydra sweep runs every one of its jobs."""

from __future__ import annotations

import sys
from pathlib import Path

from launcher.problems import PlanError

EXIT_PLAN_ERROR = 2


def conf_dir() -> str:
    """The Hydra configs: `launcher/conf` in an installed wheel, the repository's `conf/` in a checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return str(candidate)
    raise FileNotFoundError(f"ddp-launch's Hydra configs are missing (looked in {here / 'conf'} and {here.parent / 'conf'})")


class Jobs:
    """The exit codes of one invocation's jobs (a Hydra sweep runs several); the worst is the invocation's."""

    def __init__(self):
        self.codes: list[int] = []

    def run(self, action) -> int:
        """`action()`'s exit code; a PlanError is the user's to fix: its message, no traceback, exit code 2."""
        try:
            code = action()
        except PlanError as e:
            print(f"ERROR: {e}", file=sys.stderr, flush=True)
            code = EXIT_PLAN_ERROR
        self.codes.append(code)
        return code

    def exit(self) -> None:
        sys.exit(max(self.codes, default=0))  # --help, --cfg: no job ran

"""A process ddp-bench starts and waits for (a time-to-model side, Ultralytics' baseline cell), stopped with ddp-bench.

It runs in a session of its own, so a terminal's Ctrl-C reaches ddp-bench alone, which forwards it once as SIGTERM
(ddp-launch then stops its ranks as on any SIGTERM, each saving its checkpoint) and waits for it to end. If ddp-bench
dies without a word (SIGKILL, the OOM killer) the kernel sends the process the same SIGTERM (parent_death), so
nothing ddp-bench started outlives it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from launcher.launch.startup.parent_death import parent_death_signal
from launcher.launch.torchrun import signals_forwarded


def run_side_process(cmd: list[str], *, env: dict, cwd: Path | None = None, log) -> tuple[int, int | None]:
    """Run `cmd` to its end, its output into the open file `log`. Returns (exit code, the signal that stopped
    ddp-bench meanwhile, or None)."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=parent_death_signal())
    with signals_forwarded(proc, "ddp-bench: got {signal}, stopping the run in progress") as received:
        code = proc.wait()
    return code, (received[0] if received else None)

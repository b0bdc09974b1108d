"""torchrun started before the plan is made, so that its imports overlap the launcher's own work.

`python -m torch.distributed.run` spends seconds importing torch before it starts a rank (4.4 s on a machine whose
file system makes imports slow), and until now it started only after the launcher had composed the config and made
the plan (seconds too). `ddp-launch` now starts this module first thing: it imports torchrun, then waits on its stdin
for the command line and environment that run_torchrun would have given a fresh torchrun, and runs exactly that. A
launch that needs no torchrun (a dry run, a refused plan, a SLURM submission) closes its stdin, and it exits without
a word; a launcher that dies takes it along (the parent-death signal, as for any torchrun it starts). In a SLURM job
each node's task (environments/slurm_job.py) starts it the same way, with the job's environment, before it reads the
plan.

While it waits, it also imports what the ranks would import first, and has torchrun fork them from it rather than
start fresh interpreters, where nothing a rank can see differs (rank_fork.py; otherwise it says why, on stderr).

One difference from a torchrun started afresh: the ranks' stdin is /dev/null, not the launcher's terminal (so a
`breakpoint()` in a rank cannot be typed into). What Python reads from the environment as it starts (PYTHON*: the
bytecode folder above all, without which torch's import compiles it again, seconds) cannot be handed over later, so
the warm torchrun starts with the values the plan will likely set (`startup_environment`), and where the plan's
differ a fresh torchrun is started instead.

On by default; DDP_LAUNCH_WARM_START=0 starts torchrun once the plan is made, as a plain subprocess.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

TORCHRUN = ["-m", "torch.distributed.run"]
SWITCH = "DDP_LAUNCH_WARM_START"


INFO_FLAGS = ("--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i", "--shell-completion", "-sc")


def startup_environment(argv: list[str]) -> dict[str, str]:
    """The PYTHON* variables the plan's environment will set (environment.interpreter_environment), and its offline
    settings (TQDM_MININTERVAL is read as tqdm loads, which torchrun imports: rank_fork.py), guessed before Hydra
    composes, from conf/config.yaml's defaults and the command line's `paths.cache=` and `paths.bytecode=` (an
    experiment that sets them makes the guess wrong, and take() start a fresh torchrun)."""
    from launcher.machine.hardware import bytecode_kept  # the launcher's modules: not in the warm torchrun's own start
    from launcher.plan.environment import (bytecode_environment, default_cache, interpreter_environment,
                                           offline_environment)

    given = dict(a.split("=", 1) for a in argv if a.startswith(("paths.cache=", "paths.bytecode=")))
    cache = Path(given.get("paths.cache") or default_cache()).expanduser()
    setting = given.get("paths.bytecode", "auto")
    setting = {"null": None, "false": False}.get(setting.lower(), setting)  # as Hydra reads them
    return {**offline_environment(cache), **interpreter_environment(bytecode_environment(setting, cache,
                                                                                          bytecode_kept()))}


def _python_startup(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith("PYTHON") and v}  # empty: unset, to Python


def enabled() -> bool:
    """On unless DDP_LAUNCH_WARM_START=0."""
    return os.environ.get(SWITCH, "1") != "0"


def wanted(argv: list[str]) -> bool:
    """Whether a launch with these arguments will likely start torchrun here (a wrong guess costs one idle process):
    not an information flag, a dry run, or a SLURM submission (its torchrun runs in the job, on the nodes)."""
    return not any(a in INFO_FLAGS or a.lower() in ("dry_run=true", "dry_run=1", "launcher=slurm") for a in argv)


class WarmTorchrun:
    """`start()` it before planning; `take(cmd, env)` hands a torchrun command line to it (None: start one afresh)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self._startup: dict[str, str] = {}  # the PYTHON* variables it started with

    def start(self, startup: dict[str, str] | None = None, preexec_fn=None) -> None:
        """`startup`: the variables Python reads as it starts, over the launcher's (startup_environment)."""
        if self.proc is not None:
            return
        env = {**os.environ, **(startup or {})}
        self._startup = _python_startup(env)
        self.proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stderr=subprocess.PIPE,
                                     start_new_session=True, preexec_fn=preexec_fn, env=env)

    def take(self, cmd: list[str], env: dict[str, str]) -> subprocess.Popen | None:
        """The started torchrun, running `cmd` (`python -m torch.distributed.run ...`) with exactly `env` as its
        environment; None when there is none, `cmd` is not a torchrun of this Python, or `env`'s PYTHON* variables
        are not those it started with."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if cmd[:3] != [sys.executable, *TORCHRUN] or proc.poll() is not None or _python_startup(env) != self._startup:
            _discard(proc)
            return None
        try:
            proc.stdin.write((json.dumps({"argv": cmd[3:], "env": env, "cwd": os.getcwd()}) + "\n").encode())
            proc.stdin.close()
        except (BrokenPipeError, OSError):  # it died while the plan was made: start a fresh one
            _discard(proc)
            return None
        return proc

    def discard(self) -> None:
        """No torchrun is needed after all: it exits once its imports are done (or at once, if they are)."""
        proc, self.proc = self.proc, None
        if proc is not None:
            _discard(proc)


def _discard(proc: subprocess.Popen) -> None:
    try:
        proc.stdin.close()
    except OSError:
        pass
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # nothing of a run has started in it: stopping it costs nothing
    proc.wait()
    proc.stderr.close()


warm = WarmTorchrun()  # the launcher's one warm torchrun (cli.main starts it; run_torchrun takes it)


def _agent() -> None:
    imported_with = dict(os.environ)  # what torch, numpy and tqdm read as they load (rank_fork.refusal)
    import torch.distributed.run as torchrun  # the slow part, while the launcher plans

    from launcher.launch.startup import rank_fork

    if rank_fork.enabled():
        rank_fork.preload()  # what each rank would import next: they are forked with it (rank_fork.py)
    signals = rank_fork.saved_signals()  # before torchrun installs its handlers: the ranks get these back
    line = sys.stdin.readline()
    if not line:
        return  # the launcher needed no torchrun
    job = json.loads(line)
    null = os.open(os.devnull, os.O_RDONLY)  # the ranks inherit this stdin, not the terminal (see the docstring)
    os.dup2(null, 0)
    os.close(null)
    os.chdir(job["cwd"])  # where the launcher is now (hydra.job.chdir=true moves it after this process started)
    os.environ.clear()
    os.environ.update(job["env"])  # before torchrun parses its arguments: PET_* variables are its defaults
    sys.argv = ["torchrun", *job["argv"]]
    why_not = rank_fork.refusal(imported_with, job["env"], job["argv"])
    if why_not is None:
        _fork_ranks(torchrun, rank_fork.rank_entry(), signals)
    elif rank_fork.enabled(job["env"]):
        _fresh_interpreters(why_not)
    torchrun.main(job["argv"])


def _fork_ranks(torchrun, forked, signals: dict) -> None:
    """Have torchrun start the ranks as a function, forked from this process, rather than as `python -m
    launcher.rank.worker RUN_DIR`: torchrun's config_from_args (which turns its arguments into the agent's config
    and the rank command) is wrapped here, in this process only, so that the rest of its run() stays its own.
    `forked`: the rank's entry, worker.forked."""
    from launcher.launch.startup import rank_fork

    make_config = torchrun.config_from_args

    def rank(run_dir: str) -> None:  # a named function: torchrun reports a failed rank by its qualified name
        forked(run_dir, signals)

    def config_from_args(args):
        with rank_fork.cuda_asked_by_nvml():  # the config asks whether CUDA is there, without starting it
            config, cmd, cmd_args = make_config(args)
        why_not = rank_fork.cuda_started_since()
        if why_not:
            _fresh_interpreters(why_not)
            return config, cmd, cmd_args
        config.start_method = "fork"
        return config, rank, list(args.training_script_args)

    torchrun.config_from_args = config_from_args


def _fresh_interpreters(why: str) -> None:
    print(f"ddp-launch: the ranks start as fresh interpreters: {why}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    _agent()

"""Ranks forked from the warm torchrun (launch/startup/rank_fork.py): only where a fresh interpreter would see the same thing,
and then with what a fresh interpreter started by torchrun has."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from unittest import mock

import pytest

from launcher.launch.startup.rank_fork import environment_differences, refusal
from launcher.launch.torchrun import local_command
from launcher.launch.startup.warm_torchrun import startup_environment
from launcher.plan.plan import make_plan
from tests.conftest import compose_config
from tests.test_plan import GPU_BOX

CPU_MAPS = "7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n"


def _imported_and_rank_environments(overrides: list[str], hw, tmp_path: Path):
    """The warm torchrun's environment as it imported (the launcher's, with the guess cli.start_ahead makes) and the
    environment run_torchrun hands it for the plan's ranks, with the plan's torchrun arguments."""
    with mock.patch("launcher.machine.hardware.bytecode_kept", return_value=hw.bytecode_kept):
        imported = {**os.environ, **startup_environment(overrides)}
    plan, problems = make_plan(compose_config(overrides), hw, None)
    assert not problems, problems
    rank_env = {**os.environ, **plan.env, "DDP_LAUNCH_STARTED": "1.0", "DDP_LAUNCH_TORCHRUN_STARTED": "2.0",
                "PET_LOG_DIR": str(tmp_path)}
    return imported, rank_env, local_command(plan, tmp_path / "run")[3:]


@pytest.mark.parametrize("overrides", [["gpus=1"], ["gpus=1", "paths.cache=/data/cache"], ["gpus=1", "nproc=1"],
                                       ["gpus=1", "dist.nccl.debug=WARN", "dist.nccl.p2p_disable=true"]],
                         ids=["defaults", "cache", "one-rank", "nccl-toggles"])
def test_a_plans_ranks_are_forked_when_only_what_is_read_after_the_fork_differs(overrides, tmp_path):
    """The default launch gets the forked ranks: the plan's environment (offline settings, thread counts, gloo and
    NCCL toggles, the bytecode folder, CUDA's queue count) differs from the warm torchrun's only where nothing
    imported has read it."""
    imported, rank_env, argv = _imported_and_rank_environments(overrides, replace(GPU_BOX, bytecode_kept=False),
                                                               tmp_path)
    assert refusal(imported, rank_env, argv, maps=CPU_MAPS) is None


def test_toggles_read_as_torch_loads_make_the_ranks_fresh_interpreters(tmp_path):
    """dist.debug=true sets TORCH_CPP_LOG_LEVEL and TORCH_SHOW_CPP_STACKTRACES, which torch reads as it loads: the
    warm torchrun loaded torch without them, so its forks would not log as asked."""
    imported, rank_env, argv = _imported_and_rank_environments(["gpus=1", "dist.debug=true"], GPU_BOX, tmp_path)
    why = refusal(imported, rank_env, argv, maps=CPU_MAPS)
    assert why and "TORCH_CPP_LOG_LEVEL" in why and "TORCH_SHOW_CPP_STACKTRACES" in why
    # a variable the user sets for the launch is in both: it changes nothing
    assert environment_differences({**imported, "MY_FLAG": "1"}, {**rank_env, "MY_FLAG": "1"}) == sorted(
        environment_differences(imported, rank_env))
    assert environment_differences({"TQDM_MININTERVAL": "1"}, {"TQDM_MININTERVAL": "5"}) == ["TQDM_MININTERVAL"]


def test_no_fork_after_the_cuda_driver_started_or_for_another_command_or_when_switched_off(tmp_path):
    imported, rank_env, argv = _imported_and_rank_environments(["gpus=1"], GPU_BOX, tmp_path)
    nvml = CPU_MAPS + "7f02-7f03 r-xp 0 08:01 2 /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.550.54.15\n"
    assert refusal(imported, rank_env, argv, maps=nvml) is None  # device_count()'s NVML query leaves CUDA alone
    driver = nvml + "7f04-7f05 r-xp 0 08:01 3 /usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15\n"
    assert "CUDA driver" in refusal(imported, rank_env, argv, maps=driver)  # here no libcuda.so answers: started
    assert "rank entry" in refusal(imported, rank_env, [*argv[:-3], "--no-python", "sh", "-c", "true"], maps=CPU_MAPS)
    assert "=0" in refusal(imported, {**rank_env, "DDP_LAUNCH_FORK_RANKS": "0"}, argv, maps=CPU_MAPS)


BECOME_RANK = r"""
import json, os, signal, socket, sys
from launcher.launch.startup import rank_fork
from launcher.rank.startup import forked_start
saved = rank_fork.saved_signals()
signal.signal(signal.SIGTERM, lambda *a: None)  # as torchrun's agent does before it starts the ranks
listening = socket.socket(); listening.bind(("127.0.0.1", 0)); listening.listen()  # its rendezvous store's
import numpy, torch
pid = os.fork()
if pid == 0:
    os.environ.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")  # the rank's, as torchrun sets them
    forked_start.become_rank(saved, "/runs/x", 3)
    maps = open("/proc/self/maps").read()
    path = next(l.split()[-1] for l in maps.splitlines() if "openblas" in l.split()[-1].lower())
    import ctypes
    lib = ctypes.CDLL(path)
    getter = next(getattr(lib, n) for n in ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads")
                  if hasattr(lib, n))
    try:
        os.fstat(listening.fileno()); socket_open = True
    except OSError:
        socket_open = False
    print(json.dumps({"sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
                      "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
                      "sigquit_default": signal.getsignal(signal.SIGQUIT) == signal.SIG_DFL,
                      "sigusr1_ignored": signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN,
                      "own_session": os.getsid(0) == os.getpid(), "socket_open": socket_open, "argv": sys.argv,
                      "name": open("/proc/self/comm").read().strip(), "torch_threads": torch.get_num_threads(),
                      "openblas_threads": getter()}), flush=True)
    os._exit(0)
os.waitpid(pid, 0)
"""


def _started_with(ignored: tuple[int, ...]):
    """The dispositions the caller hands the test's interpreter: these ignored (SIG_IGN survives exec), the others
    default, whatever the dispositions of whoever runs pytest."""
    def preexec():
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(s, signal.SIG_IGN if s in ignored else signal.SIG_DFL)
    return preexec


@pytest.mark.parametrize("ignored", [(signal.SIGUSR1,), (signal.SIGINT, signal.SIGQUIT, signal.SIGUSR1)],
                         ids=["terminal", "background-job"])
def test_a_forked_rank_gets_what_a_fresh_interpreter_would_have(ignored, tmp_path):
    """Signal dispositions a fresh interpreter started by torchrun would have (the ones torchrun's agent catches at
    their defaults, SIGINT raising KeyboardInterrupt, though the caller ignored them as a background job does; the
    SLURM job's ignored USR1 kept), its own session, none of torchrun's sockets, the rank's command line and name, and
    the plan's thread counts applied to torch and to numpy's OpenBLAS (both loaded before the fork with other counts)."""
    env = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", BECOME_RANK], env=env, capture_output=True, text=True, timeout=120,
                         preexec_fn=_started_with(ignored))
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["sigterm_default"] and seen["sigint"] and seen["own_session"] and not seen["socket_open"], seen
    assert seen["sigquit_default"] and seen["sigusr1_ignored"], seen
    assert seen["argv"][0].endswith(os.path.join("launcher", "rank", "worker.py")) and seen["argv"][1:] == ["/runs/x"]
    assert seen["name"] == "ddp-rank3"
    assert seen["torch_threads"] == 1 and seen["openblas_threads"] == 1, seen


@pytest.mark.parametrize("status", [0, 3])
def test_a_forked_rank_ends_with_its_status_though_a_thread_of_it_runs_on(status, tmp_path, monkeypatch):
    """torchrun's function path (its fork start method) waits for a rank's return value, then the rank's process
    would wait for every non-daemon thread: a forked rank leaves as a `python -m launcher.rank.worker` one does, with
    its status, whatever threads remain (a fresh rank's os._exit, worker.leave)."""
    import threading
    import time

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    from launcher.rank import worker
    from launcher.rank.startup import forked_start

    def run(argv, started, how=""):
        assert argv == [str(tmp_path)] and how
        threading.Thread(target=time.sleep, args=(3600,), name="left-running").start()  # not a daemon
        return status

    monkeypatch.setattr(worker, "run", run)
    monkeypatch.setattr(forked_start, "become_rank", lambda *a: None)
    ctx = start_processes("forked", entrypoint=worker.forked, args={0: (str(tmp_path), {})}, envs={0: {}},
                          logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "logs")), start_method="fork")
    try:
        result = ctx.wait(timeout=60)
    finally:
        ctx.close()
    assert result is not None, "the rank did not end"
    assert result.is_failed() == bool(status)
    if status:
        assert result.failures[0].exitcode == status


class _FakeDriver:
    """A libcuda.so as ctypes sees it: cuDeviceGetCount's answer (3 before cuInit) is all the probe asks."""

    def __init__(self, answer):
        self.answer = answer

    def cuDeviceGetCount(self, count):
        return self.answer


def test_a_driver_mapped_but_never_started_lets_the_ranks_fork_and_one_started_or_unreadable_does_not(
        tmp_path, monkeypatch):
    """Importing torch (a CUDA build) maps libcuda.so without starting it: forks of that use the GPU (checked on the
    H200 machine, tests/test_cuda_runs.py). Only a driver that answers as started, or cannot be asked, refuses."""
    from launcher.machine import libraries

    imported, rank_env, argv = _imported_and_rank_environments(["gpus=1"], GPU_BOX, tmp_path)
    driver = CPU_MAPS + "7f04-7f05 r-xp 0 08:01 3 /usr/local/nvidia/lib64/libcuda.so.580.159.04\n"
    asked = []

    def loaded(answer):
        def cdll(name, mode=0):
            asked.append((name, mode))
            return _FakeDriver(answer)
        return cdll

    monkeypatch.setattr(libraries.ctypes, "CDLL", loaded(libraries.CUDA_ERROR_NOT_INITIALIZED))
    assert refusal(imported, rank_env, argv, maps=driver) is None
    assert asked[0] == ("/usr/local/nvidia/lib64/libcuda.so.580.159.04", os.RTLD_NOLOAD)  # never loads another
    monkeypatch.setattr(libraries.ctypes, "CDLL", loaded(0))
    assert "CUDA driver was started" in refusal(imported, rank_env, argv, maps=driver)

    def unreadable(name, mode=0):
        raise OSError(name)

    monkeypatch.setattr(libraries.ctypes, "CDLL", unreadable)
    assert "CUDA driver was started" in refusal(imported, rank_env, argv, maps=driver)
    assert not libraries.cuda_driver_started(CPU_MAPS)


def test_torchruns_config_asks_for_cuda_through_nvml_and_a_driver_started_anyway_keeps_fresh_interpreters(
        monkeypatch, capsys):
    """torchrun's LaunchConfig asks torch.accelerator.is_available(): by cudaGetDeviceCount that starts CUDA, and
    torch then refuses CUDA to every fork ("Cannot re-initialize CUDA in forked subprocess", seen on the H200)."""
    from types import SimpleNamespace

    from launcher.launch.startup import rank_fork, warm_torchrun

    seen = []

    def make_config(args):
        seen.append(os.environ.get(rank_fork.NVML_CUDA_CHECK))
        return SimpleNamespace(start_method="spawn"), "python", ["-m", "launcher.rank.worker", "/runs/x"]

    torchrun = SimpleNamespace(config_from_args=make_config)
    monkeypatch.delenv(rank_fork.NVML_CUDA_CHECK, raising=False)
    warm_torchrun._fork_ranks(torchrun, lambda run_dir, signals: None, {})
    args = SimpleNamespace(training_script_args=["/runs/x"])
    config, entry, entry_args = torchrun.config_from_args(args)
    assert seen == ["1"] and rank_fork.NVML_CUDA_CHECK not in os.environ  # set only while the config is built
    assert config.start_method == "fork" and entry.__name__ == "rank" and entry_args == ["/runs/x"]

    monkeypatch.setattr(rank_fork, "cuda_driver_started", lambda maps: True)  # no NVML: torch's check started CUDA
    config, entry, _ = torchrun.config_from_args(args)
    assert config.start_method == "spawn" and entry == "python"
    assert "fresh interpreters: torchrun started the CUDA driver" in capsys.readouterr().err

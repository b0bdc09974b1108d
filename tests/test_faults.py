"""Fault injection: what a user finds after a rank dies, a disk fills, DDP cannot start, or the job is stopped.

Two gloo ranks on the CPU, a small model, faults injected through DDP_LAUNCH_FAULT (launcher/rank/group/faults.py) or by
signalling the launcher. Each test checks what a user would look at afterwards: exit code, files, epochs,
leftover processes. A hung rank is tested with a fake store and clock (tests/test_heartbeat.py).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from tests.conftest import TINY, ddp_launch

pytestmark = [pytest.mark.slow, pytest.mark.dist]

EPOCHS = 3  # 64 images, 2 ranks x 8: 4 steps per epoch
BASE = ["gpus=0", "nproc=2", f"train.epochs={EPOCHS}", "loader.mosaic_buffer=false", *TINY]


def launch(run_dir: Path, *args: str, fault: str | None = None, timeout: int = 600):
    env = {"DDP_LAUNCH_FAULT": fault} if fault else {}
    return ddp_launch([*BASE, f"hydra.run.dir={run_dir}", *args], cwd=run_dir.parent, timeout=timeout, env=env)


# The launcher's descendants once its run trains (start_and_wait_for): the warm torchrun's command line does not hold
# the run folder (it started before the plan), so leftovers() finds it through this.
FAMILIES: dict[Path, list[psutil.Process]] = {}


def leftovers(run_dir: Path) -> list[str]:
    """Processes still running for this run (ranks, torchrun, DataLoader workers all carry the run folder, and those
    start_and_wait_for saw under the launcher), other than this one. (Not "any command line without 'pytest'": the
    run folders are under pytest's own temporary folder, so that filter found nothing, and a test read the logs
    before the ranks had written them.)"""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if str(run_dir) in cmd and p.pid != os.getpid() and p.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(cmd)
    for p in FAMILIES.get(run_dir, []):
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE and str(run_dir) not in " ".join(p.cmdline()):
                found.append(" ".join(p.cmdline()))
        except psutil.Error:  # gone meanwhile
            pass
    return found


def gone_within(run_dir: Path, seconds: float) -> list[str]:
    """What is left of the run's processes after waiting up to `seconds` for them to end."""
    deadline = time.monotonic() + seconds
    while leftovers(run_dir) and time.monotonic() < deadline:
        time.sleep(0.5)
    return leftovers(run_dir)


def start_and_wait_for(run_dir: Path, epochs: int, line: str, env: dict | None = None,
                       resume: bool = False) -> subprocess.Popen:
    """The real `ddp-launch` in the background (`resume`: `resume=RUN_DIR`), once rank 0 has logged `line` after
    what its log held at the launch (the run is mid-epoch)."""
    exe = Path(sys.executable).parent / "ddp-launch"  # this environment's, as conftest.ddp_launch runs it
    args = [f"resume={run_dir}"] if resume else [*BASE, f"train.epochs={epochs}", f"hydra.run.dir={run_dir}"]
    log = run_dir / "logs" / "rank0.log"
    before = len(log.read_text()) if log.exists() else 0
    proc = subprocess.Popen(
        [str(exe) if exe.exists() else "ddp-launch", *args], cwd=run_dir.parent, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})},
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (log.exists() and line in log.read_text()[before:]):
        time.sleep(0.1)
    assert log.exists(), "the run did not start"
    FAMILIES[run_dir] = psutil.Process(proc.pid).children(recursive=True)
    return proc


def what_happened(run_dir: Path, out: str = "") -> str:
    """For a failed assertion: the launcher's last lines, each rank log's, summary.json, and what is still running
    (a launcher-signal test that fails now and then must leave what it saw)."""
    parts = [f"launcher:\n{out[-2500:]}"] if out else []
    for log in sorted((run_dir / "logs").glob("rank*.log")):
        parts.append(f"{log.name}:\n{log.read_text(errors='replace')[-2500:]}")
    summary_file = run_dir / "summary.json"
    parts.append(f"summary.json: {summary_file.read_text()[:1500] if summary_file.exists() else 'none'}")
    parts.append(f"still running: {leftovers(run_dir)}")
    return "\n\n".join(parts)


def temporaries(run_dir: Path) -> list[Path]:
    return list((run_dir / "weights").glob(".*tmp-*"))


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_a_rank_that_raises_fails_the_run_by_name(tmp_path, cache_dir):
    run = tmp_path / "run"
    r = launch(run, fault="rank=1,step=3,kind=raise")
    assert r.returncode != 0
    s = summary(run)
    assert s["status"] == "failed"
    assert s["root_cause"]["rank"] == 1  # rank 0 may fail after it (its peer vanished): not the cause
    assert "InjectedFault: injected fault: rank 1 raised at step 3" in s["root_cause"]["error"]
    assert "root cause: rank 1: InjectedFault" in r.stdout
    assert not leftovers(run)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, cache_dir) -> dict:
    """The summary of the run the faulted ones are compared with: the same config, nothing injected."""
    clean = tmp_path_factory.mktemp("uninterrupted") / "run"
    r = launch(clean)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return summary(clean)


def same_weights(run_dir: Path, reference: dict) -> bool:
    """Resumed from a checkpoint with full-precision state and per-sample seeded augmentation (mosaic_buffer=false),
    a run repeats the uninterrupted one exactly on the CPU: the same parameters at the end."""
    return summary(run_dir)["ranks"][0]["params_sha256"] == reference["ranks"][0]["params_sha256"]


def test_a_finished_rank_ends_with_its_own_status_and_output_whatever_the_teardown_would_do():
    """Gloo's worker threads release a finished collective's tensors lazily, and one that does so while the
    interpreter finalizes aborts the process: 2 runs in 8 of a 2-rank bench cell ended in SIGABRT after its
    figures were written, and torchrun failed the run. The rank leaves without the teardown (an atexit abort stands for it)."""
    script = ("import atexit, os, signal\n"
              "from launcher.rank import worker\n"
              "atexit.register(lambda: os.kill(os.getpid(), signal.SIGABRT))\n"
              "print('summary written', end='')\n"
              "worker.leave(worker.exit_code(SystemExit(143)))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout) == (143, "summary written"), result.stderr
    assert [worker_exit(c) for c in (None, 0, 3, "a message")] == [0, 0, 3, 1]


def worker_exit(code) -> int:
    from launcher.rank.worker import exit_code

    return exit_code(SystemExit(code))


def test_a_killed_rank_restarts_and_ends_with_the_weights_of_an_uninterrupted_run(tmp_path, uninterrupted):
    killed = tmp_path / "killed"
    r = launch(killed, "dist.max_restarts=1", fault="rank=1,step=6,kind=sigkill")  # in epoch 2
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = summary(killed)
    assert s["epochs_completed"] == EPOCHS and s["resumed"] is True
    rows = (killed / "results.csv").read_text().strip().splitlines()[1:]
    assert [int(float(row.split(",")[0])) for row in rows] == [1, 2, 3]  # each epoch counted once
    assert same_weights(killed, uninterrupted)  # resumed from the epoch-1 checkpoint
    assert not leftovers(killed)


def test_a_kill_during_the_checkpoint_write_leaves_the_previous_one_to_resume_from(tmp_path, uninterrupted):
    run = tmp_path / "run"
    r = launch(run, "dist.max_restarts=1", fault="rank=0,step=5,kind=kill_in_save")  # the epoch-2 save
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    log = (run / "logs" / "rank0.log").read_text()
    assert "injected 'kill_in_save'" in log
    assert f"resuming from {run / 'weights' / 'last.pt'} at epoch 2, step 1" in log
    assert summary(run)["epochs_completed"] == EPOCHS and same_weights(run, uninterrupted)
    assert not temporaries(run)


def test_a_write_fault_is_met_by_the_checkpoint_of_its_step_however_far_training_ran_meanwhile(tmp_path):
    """A checkpoint is written in the background while training goes on: its writer meets the fault due at the
    step it saved, not at the step training has reached by then (else the epoch before would die instead)."""
    from launcher.rank.group.faults import FaultInjector, parse

    faults = FaultInjector(parse("rank=0,step=5,kind=disk_full"), rank=0, attempt=0)
    faults.at_step(3)
    faults.at_save()  # epoch 1's checkpoint, taken at step 3
    faults.at_step(5)  # training reaches the fault's step before the writer writes
    faults.at_checkpoint_write(tmp_path / "last.pt")  # written whole
    faults.at_step(7)
    faults.at_save()
    with pytest.raises(OSError, match="No space left"):
        faults.at_checkpoint_write(tmp_path / "last.pt")


def test_a_truncated_last_checkpoint_is_reported_and_the_previous_one_used(tmp_path, uninterrupted):
    run = tmp_path / "run"
    r = launch(run, fault="rank=0,step=10,kind=exit")  # dies in epoch 3: last.pt = epoch 2, last.prev.pt = epoch 1
    assert r.returncode != 0
    last = run / "weights" / "last.pt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    r = ddp_launch([f"resume={run}"], cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    log = (run / "logs" / "rank0.log").read_text()
    assert f"checkpoint {last} is unreadable" in log and "trying the previous checkpoint" in log
    assert f"resuming from {run / 'weights' / 'last.prev.pt'} at epoch 2, step 1" in log
    assert summary(run)["epochs_completed"] == EPOCHS and same_weights(run, uninterrupted)


def stopped_by(signum: int, proc: subprocess.Popen, out: str, run: Path, tmp: Path) -> tuple[int, int]:
    """What a stop by `signum` leaves, checked: exit 128 + it, the folder's lock let go, one line saying how to go
    on and no traceback, torchrun's scratch folders gone, summary.json "stopped", no process left, and last.pt saved
    after the step rank 0 logged; its (epoch, step)."""
    assert proc.returncode == 128 + signum, what_happened(run, out)
    assert not (run / "run.lock").exists()  # the stop lets the folder go
    assert f"got {signal.Signals(signum).name}" in out and f"Continue with: ddp-launch resume={run}" in out, out[-3000:]
    assert "Traceback" not in out and "SignalException" not in out, out[-3000:]
    assert "Received 15 death signal, shutting down workers" in out, out[-3000:]  # torchrun's own lines still pass
    assert not list(tmp.glob("torchelastic_*")) and not list(tmp.glob("ddp-launch-torchrun-*"))
    assert summary(run)["status"] == "stopped", what_happened(run, out)
    assert not leftovers(run) and not temporaries(run), what_happened(run, out)
    state = torch.load(run / "weights" / "last.pt", map_location="cpu", weights_only=False)["ddp_launch_state"]
    epoch, step = state["train"]["position"]  # after the step that was logged (or, past the epoch's end, in the next)
    assert step >= 1  # a stop is agreed after a step, never at an epoch's end
    assert f"checkpoint saved at epoch {epoch + 1} step {step + 1}" in (run / "logs" / "rank0.log").read_text()
    return epoch, step


def test_sigterm_sighup_and_sigint_each_checkpoint_exit_128_plus_it_and_the_run_resumes_to_its_end(tmp_path, cache_dir):
    """SIGTERM (a scheduler, kill), SIGHUP (the terminal closes, nothing left to print to) and SIGINT (Ctrl-C) take
    the same path, one after another on one run: every rank finishes its step, rank 0 saves where the run stands,
    ddp-launch exits 128 + the signal, no process is left, the stop reads as one (no torchrun traceback; torchrun's
    scratch folders, an empty /tmp/torchelastic_* per launch by default, gone), and the run resumes: on the same
    ranks after SIGTERM and SIGHUP, on one rank after SIGINT (`resume=RUN_DIR nproc=1`: the plan made again, the
    interrupted epoch started again), each epoch counted once."""
    run, epochs, tmp = tmp_path / "run", 4, tmp_path / "tmp"
    tmp.mkdir()
    env = {"TMPDIR": str(tmp)}
    proc = start_and_wait_for(run, epochs, f"epoch 2/{epochs} step 2/4", env=env)
    assert (run / "run.lock").is_file()  # one trainer in the folder, while it trains
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert stopped_by(signal.SIGTERM, proc, out, run, tmp) > (1, 2)

    proc = start_and_wait_for(run, epochs, f"epoch 3/{epochs} step 2/4", env=env, resume=True)
    proc.send_signal(signal.SIGHUP)
    proc.stdout.close()  # the terminal is gone: every later line the launcher and torchrun print fails
    assert proc.wait(timeout=120) == 129, what_happened(run)
    s = summary(run)
    assert s["status"] == "stopped" and "stopped by SIGHUP" in s["detail"], what_happened(run)
    assert not gone_within(run, 30), what_happened(run)

    proc = start_and_wait_for(run, epochs, f"epoch 4/{epochs} step 2/4", env=env, resume=True)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    epoch, step = stopped_by(signal.SIGINT, proc, out, run, tmp)
    assert (epoch, step) > (3, 2)

    r = ddp_launch([f"resume={run}", "nproc=1"], cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "world size 1, global batch 8" in r.stdout
    log = (run / "logs" / "rank0.log").read_text()
    assert f"world size changed (2 -> 1): restarting epoch {epoch + 1}" in log and f"at epoch {epoch + 1}, step 1" in log
    s = summary(run)
    assert (s["world_size"], s["global_batch"], s["epochs_completed"]) == (1, 8, epochs)
    assert json.loads((run / "plan.prev.json").read_text())["world_size"] == 2
    rows = (run / "results.csv").read_text().strip().splitlines()[1:]
    assert [int(float(row.split(",")[0])) for row in rows] == list(range(1, epochs + 1))
    refused = ddp_launch([f"resume={run}", "train.epochs=9"], cwd=tmp_path, timeout=120)
    assert refused.returncode == 2 and "train.epochs cannot change" in refused.stderr


def test_a_launcher_killed_outright_stops_the_ranks_together_with_a_checkpoint(tmp_path, cache_dir):
    """SIGKILL (the OOM killer) gives the launcher no chance to forward anything: the kernel tells torchrun (a
    parent-death signal, launch/torchrun.py), which stops the ranks as on a Ctrl-C: at the same step, rank 0 saving
    where the run stands, and nothing of the run is left."""
    run = tmp_path / "run"
    proc = start_and_wait_for(run, 3, "epoch 1/3 step 2/4")
    proc.kill()
    proc.wait(timeout=30)
    assert not gone_within(run, 30), what_happened(run)
    logs = [(run / "logs" / f"rank{rank}.log").read_text() for rank in (0, 1)]
    context = "\n\n".join(text[-2500:] for text in logs)
    stops = [re.findall(r"\[signal\] stopping after (epoch \d+ step \d+): SIGTERM reached", log) for log in logs]
    assert len(stops[0]) == 1 and stops[0] == stops[1], context  # every rank, at the same step
    assert "checkpoint saved at epoch" in logs[0], context
    epoch, step = torch.load(run / "weights" / "last.pt", map_location="cpu", weights_only=False)[
        "ddp_launch_state"]["train"]["position"]
    assert (epoch, step) >= (0, 3) and step >= 1  # after the step rank 0 had logged, mid-epoch


def test_a_stop_on_an_epochs_last_step_still_ends_that_epoch_after_resume(tmp_path, uninterrupted):
    run = tmp_path / "run"
    r = launch(run, fault="rank=0,step=4,kind=sigterm")  # step 4 is epoch 1's last
    assert r.returncode != 0
    ckpt = torch.load(run / "weights" / "last.pt", map_location="cpu", weights_only=False)
    assert ckpt["ddp_launch_state"]["train"]["position"] == (0, 4)  # every step of epoch 1 done, its end not yet
    r = ddp_launch([f"resume={run}"], cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:]
    s = summary(run)
    assert s["validated_epochs"] == [1, 2, 3] and s["epochs_completed"] == EPOCHS
    rows = (run / "results.csv").read_text().strip().splitlines()[1:]
    assert [int(float(row.split(",")[0])) for row in rows] == [1, 2, 3]
    assert same_weights(run, uninterrupted)  # the epoch's end ran once, as it would have


def test_two_launches_at_once_get_their_own_ports_and_run_folders(tmp_path, cache_dir):
    procs = []
    for name in ("a", "b"):
        exe = Path(sys.executable).parent / "ddp-launch"  # this environment's, as conftest.ddp_launch runs it
        exe = str(exe) if exe.exists() else "ddp-launch"
        procs.append(subprocess.Popen([exe, *BASE, "train.epochs=1"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    folders = [next(line.split(None, 2)[2] for line in out.splitlines() if line.startswith("run folder")) for out in outs]
    assert folders[0] != folders[1]
    ports = []
    for folder in folders:
        header = (Path(folder) / "logs" / "rank0.log").read_text().splitlines()[0]
        host, port = header.split("rendezvous ")[1].split()[0].rsplit(":", 1)
        assert port.isdigit() and int(port) > 0, header  # the port the kernel gave torchrun's store
        ports.append(int(port))
    assert ports[0] != ports[1]


def test_a_full_disk_while_saving_is_a_clear_error_and_keeps_the_previous_checkpoint(tmp_path, cache_dir):
    run = tmp_path / "run"
    r = launch(run, fault="rank=0,step=5,kind=disk_full")  # the epoch-2 save fails
    assert r.returncode != 0
    error = summary(run)["root_cause"]["error"]
    assert "could not write a checkpoint" in error and "No space left on device" in error
    assert "the previous checkpoint" in error and "is intact" in error
    ckpt = torch.load(run / "weights" / "last.pt", map_location="cpu", weights_only=False)
    assert ckpt["ddp_launch_state"]["train"]["position"] == (1, 0)  # epoch 1's, untouched
    assert not temporaries(run) and not leftovers(run)


def test_with_dist_fallback_dp_a_process_group_that_cannot_start_falls_back_to_dataparallel(tmp_path, cache_dir):
    run = tmp_path / "run"
    r = launch(run, "train.epochs=1", "dist.fallback=dp", fault="rank=0,kind=init_fail")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "DDP could not start (gloo process group, see above); dist.fallback=dp" in r.stdout
    s = summary(run)
    assert (s["status"], s["mode"], s["world_size"], s["epochs_completed"]) == ("finished", "dp", 1, 1)
    assert json.loads((run / "plan.ddp-failed.json").read_text())["mode"] == "ddp"
    assert not leftovers(run)

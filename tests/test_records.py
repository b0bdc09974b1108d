"""Nothing already written is lost, and a place that cannot be written is a sentence, not a traceback: a refused
launch or a dry run into a folder holding a run changes nothing there; a refused launch leaves no folder of its
own; a read-only run folder (or current directory) is named with the key to change before any process starts; a
SLURM dry run warns about what this machine lacks. The real `ddp-launch` where Hydra is involved (it writes .hydra/
before the task runs), start() itself otherwise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.launch import start
from launcher.launch.environments import local, slurm
from launcher.problems import PlanError
from launcher.run_folder import RunFolder, writable
from tests.conftest import REPO, TINY, compose_config, ddp_launch


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture()
def finished_run(tmp_path) -> Path:
    """A run folder as a finished run leaves it, with Hydra's records of the command that made it."""
    run = tmp_path / "r1"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text("- seed=1\n")
    (run / ".hydra" / "config.yaml").write_text("seed: 1\n")
    (run / "config.yaml").write_text("seed: 1\n")
    (run / "plan.json").write_text("{}")
    (run / "summary.json").write_text('{"status": "finished"}')
    return run


def test_a_refused_launch_or_a_dry_run_into_a_run_folder_changes_nothing_there(finished_run, tmp_path, cache_dir):
    before = snapshot(finished_run)
    r = ddp_launch([f"hydra.run.dir={finished_run}", "seed=7", "optim.base_lr=0.05", "gpus=0"], cwd=tmp_path)
    assert r.returncode == 2 and f"{finished_run} already holds a run" in r.stderr, r.stdout + r.stderr
    assert "hydra.run.dir=" in r.stderr and "Traceback" not in r.stderr
    assert snapshot(finished_run) == before
    r = ddp_launch([f"hydra.run.dir={finished_run}", "seed=7", "gpus=0", "dry_run=true", *TINY], cwd=tmp_path)
    assert r.returncode == 0 and "dry run: nothing started" in r.stdout, r.stdout + r.stderr
    assert f"WARNING: {finished_run} already holds a run" in r.stdout and "(a real run would refuse)" in r.stdout
    assert snapshot(finished_run) == before


def test_a_refused_launch_leaves_no_folder_of_its_own_and_keeps_one_that_was_there(tmp_path, cache_dir):
    r = ddp_launch(["train.imgsz=65"], cwd=tmp_path)  # Hydra's default folder, runs/<date>/<time>
    assert r.returncode == 2 and "train.imgsz=65" in r.stderr, r.stdout + r.stderr
    assert not (tmp_path / "runs").exists()  # nor the runs/<date>/ made on the way
    mine = tmp_path / "mine"
    mine.mkdir()
    r = ddp_launch([f"hydra.run.dir={mine}", "train.imgsz=65"], cwd=tmp_path)
    assert r.returncode == 2 and mine.is_dir()


READ_ONLY_LAUNCH = """
import os, sys
from pathlib import Path

READ_ONLY = Path(sys.argv[1]).resolve()
real_access = os.access

def access(path, mode, *args, **kwargs):  # what the kernel answers for a read-only file system
    p = Path(path).resolve()
    if mode & os.W_OK and (p == READ_ONLY or READ_ONLY in p.parents):
        return False
    return real_access(path, mode, *args, **kwargs)

if os.geteuid() == 0:  # root ignores permission bits: the read-only answer is faked at the probe's first question
    os.access = access
from launcher.cli import main
sys.argv = ["ddp-launch", *sys.argv[2:]]
main()
"""


def launch_in_read_only(folder: Path, *args: str) -> subprocess.CompletedProcess:
    """ddp-launch from `folder`, made read-only (chmod 0555; as root, os.access answers as a read-only mount)."""
    folder.chmod(0o555)
    try:
        return subprocess.run([sys.executable, "-c", READ_ONLY_LAUNCH, str(folder), *args], cwd=folder, text=True,
                              capture_output=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    finally:
        folder.chmod(0o755)


def test_a_read_only_current_directory_is_a_warning_for_a_dry_run_and_a_refusal_for_a_launch(tmp_path, cache_dir):
    here = tmp_path / "read-only"
    here.mkdir()
    r = launch_in_read_only(here, "dry_run=true", "gpus=0", *TINY)
    assert r.returncode == 0 and "dry run: nothing started" in r.stdout, r.stdout + r.stderr
    warning = next(line for line in r.stdout.splitlines() if "cannot be written" in line)
    assert f"the run folder {here}/runs/" in warning and "hydra.run.dir=PATH" in warning
    r = launch_in_read_only(here, "gpus=0", *TINY)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith("ERROR: ddp-launch cannot start: 1 problem(s)\n  - the run folder ")
    assert "hydra.run.dir=PATH" in r.stderr and "Traceback" not in r.stdout + r.stderr
    assert not list(here.iterdir())  # nothing written, nothing started


def test_writable_asks_the_file_system_not_the_permission_bits(tmp_path, monkeypatch):
    assert writable(tmp_path / "not" / "yet" / "made")  # what creating it would write into: tmp_path
    assert not list(tmp_path.iterdir())  # the probe is gone
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    if os.geteuid() == 0:  # root writes through 0555 (and the probe says so); a read-only mount is faked
        assert writable(locked)
        monkeypatch.setattr(os, "access", lambda path, mode, **kw: False)
    assert not writable(locked / "run")


def test_resume_of_a_run_that_cannot_be_written_is_refused_before_anything_starts(tmp_path, cache_dir, monkeypatch):
    monkeypatch.setattr(local.LocalEnvironment, "start", lambda self, cfg, plan, folder: 0)  # the folder, no ranks
    assert start.start(compose_config(["gpus=0", *TINY]), tmp_path / "run", tmp_path) == 0
    assert RunFolder(tmp_path / "run").is_run()
    monkeypatch.setattr(start, "writable", lambda path: False)  # the file system went read-only
    monkeypatch.setattr(local.LocalEnvironment, "resume", lambda *a: pytest.fail("the ranks were started"))
    with pytest.raises(PlanError) as e:
        start.resume(tmp_path / "run", {})
    assert f"resume={tmp_path / 'run'}: the run folder cannot be written" in str(e.value)
    assert "copy it somewhere writable and pass resume=THE_COPY" in str(e.value)


def test_a_slurm_dry_run_without_sbatch_warns_that_it_is_missing(tmp_path, cache_dir, monkeypatch, capsys):
    monkeypatch.setattr(slurm.shutil, "which", lambda name: None)
    assert start.start(compose_config(["launcher=slurm", "dry_run=true", *TINY]), tmp_path / "run", tmp_path) == 0
    out = capsys.readouterr().out
    assert "WARNING: launcher=slurm: sbatch is not on PATH here" in out and "(a real run would refuse)" in out
    assert "dry run: nothing started" in out


UNWRITABLE_CACHE = "/proc/no-home/.cache/ddp-launch"  # /proc takes no new folder, whoever asks (root included)


def test_an_unwritable_cache_is_refused_before_the_run_folder_is_written_and_a_resume_may_move_it(
        tmp_path, cache_dir, monkeypatch, capsys):
    """A home folder that cannot be written (the default paths.cache lies under it): one line naming the folder and
    the key, before the run folder is written (a dry run warns). A run whose stored cache went bad resumes with
    paths.cache=ANOTHER, planned again for it."""
    with pytest.raises(PlanError) as e:
        start.start(compose_config(["gpus=0", f"paths.cache={UNWRITABLE_CACHE}", *TINY]), tmp_path / "run", tmp_path)
    assert f"paths.cache={UNWRITABLE_CACHE} cannot be created or written" in str(e.value)
    assert "set paths.cache=A_WRITABLE_FOLDER" in str(e.value) and not (tmp_path / "run").exists()
    dry = compose_config(["gpus=0", f"paths.cache={UNWRITABLE_CACHE}", "dry_run=true", *TINY])
    assert start.start(dry, tmp_path / "run", tmp_path) == 0 and not (tmp_path / "run").exists()
    assert f"WARNING: paths.cache={UNWRITABLE_CACHE} cannot" in capsys.readouterr().out

    monkeypatch.setattr(local.LocalEnvironment, "start", lambda self, cfg, plan, folder: 0)  # the folder, no ranks
    assert start.start(compose_config(["gpus=0", *TINY]), tmp_path / "run", tmp_path) == 0
    config = (tmp_path / "run" / "config.yaml").read_text()
    (tmp_path / "run" / "config.yaml").write_text(config.replace(str(cache_dir), UNWRITABLE_CACHE))
    resumed = []
    monkeypatch.setattr(local.LocalEnvironment, "resume", lambda self, cfg, plan, folder: resumed.append(plan) or 0)
    with pytest.raises(PlanError) as e:
        start.resume(tmp_path / "run", {})
    assert f"paths.cache={UNWRITABLE_CACHE} cannot be created or written" in str(e.value) and not resumed
    good = tmp_path / "new-cache"
    assert start.resume(tmp_path / "run", {"paths.cache": str(good)}) == 0
    assert resumed[0].env["YOLO_CONFIG_DIR"].startswith(str(good)) and (good / "ultralytics").is_dir()
    assert RunFolder(tmp_path / "run").load()[0]["paths"]["cache"] == str(good)

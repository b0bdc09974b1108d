"""Ctrl-C while the plan checks a large dataset, and a command line Hydra cannot read: one line each, never a
traceback, and nothing left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

from launcher.entry import unreadable_overrides
from tests.conftest import ddp_launch

# Loaded by every Python the launch starts (it is on PYTHONPATH): the launcher's check of each image is made slow, and
# the first one marks that the check has begun. Nothing in the launcher knows of it.
SLOW_CHECK = """
import os, time
if os.environ.get("SLOW_CHECK_MARK"):
    import launcher.inputs.labels as labels
    real = labels.check_pair
    def slow(*args, **kwargs):
        open(os.environ["SLOW_CHECK_MARK"], "a").close()
        time.sleep(0.5)
        return real(*args, **kwargs)
    labels.check_pair = slow
"""


def dataset(root: Path, images: int) -> Path:
    for split in ("train", "val"):
        (root / "images" / split).mkdir(parents=True)
        (root / "labels" / split).mkdir(parents=True)
        for i in range(images if split == "train" else 2):
            Image.new("RGB", (32, 32), (i % 255, 0, 0)).save(root / "images" / split / f"{i}.jpg")
            (root / "labels" / split / f"{i}.txt").write_text("0 0.5 0.5 0.2 0.2\n")
    (root / "data.yaml").write_text(f"path: {root}\ntrain: images/train\nval: images/val\nnames:\n  0: thing\n")
    return root / "data.yaml"


def test_ctrl_c_during_the_data_check_is_one_line_and_exit_130(tmp_path, cache_dir):
    data = dataset(tmp_path / "data", 200)  # 100 s of checking at 0.5 s an image, 4 threads: far from done
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SLOW_CHECK)
    mark, work = tmp_path / "checking", tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "SLOW_CHECK_MARK": str(mark),
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])}
    exe = Path(sys.executable).parent / "ddp-launch"
    proc = subprocess.Popen(
        [str(exe) if exe.exists() else "ddp-launch", "gpus=0", "nproc=1", "data=custom", f"data.path={data}",
         "train.imgsz=64"], cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as a terminal has it, whatever ours is
    try:
        deadline = time.monotonic() + 120
        while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert mark.exists(), proc.communicate(timeout=60)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, out + err
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err, out + err
    assert err.strip().splitlines()[-1] == "ddp-launch: stopped by Ctrl-C (SIGINT) before any rank started"
    assert not any(p.name == "plan.json" for p in work.rglob("*")) and not list(work.rglob(".hydra"))


def test_an_unquoted_path_hydra_cannot_read_is_one_line_with_the_quoting_that_works(tmp_path):
    (line,) = unreadable_overrides(["gpus=0", "model.weights=/tmp/données/é.pt", "-m", "--cfg"])
    assert line.startswith("'model.weights=/tmp/données/é.pt' cannot be read (")
    assert line.endswith("""the quotes kept from the shell: 'model.weights="/tmp/données/é.pt"'""")
    assert unreadable_overrides(['model.weights="/tmp/données/é.pt"', "data.path=/a/b.yaml"]) == []
    r = ddp_launch(["gpus=0", "model.weights=/tmp/é.pt", "dry_run=true"], cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "LexerNoViableAlt" not in r.stderr, r.stderr
    assert [x for x in r.stderr.splitlines() if x.strip()] == [
        "ERROR: " + unreadable_overrides(["model.weights=/tmp/é.pt"])[0]]
    assert not (tmp_path / "runs").exists()

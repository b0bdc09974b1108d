"""Runs that move: a run folder moved or copied resumes from where it is, reading and writing only its own files
(its config names data.yaml relative to it); a dataset that moved is named again with `resume=RUN data.path=NEW`,
taken when it checks out as the run's (class names, images per split) and refused in one line otherwise."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from launcher.launch import start
from launcher.launch.environments import local
from launcher.problems import PlanError
from launcher.run_folder import RunFolder
from tests.conftest import TINY, compose_config, ddp_launch
from tests.test_data_check import GOOD, NAMES, _jpeg, _write
from tests.test_records import snapshot


TINY_CUSTOM = [o for o in TINY if not o.startswith("data.synthetic")]


def planned(cfg_overrides: list[str], run_dir: Path, base: Path, monkeypatch) -> Path:
    """A run folder as a launch writes it, stopped before its first step (no ranks started)."""
    with monkeypatch.context() as m:
        m.setattr(local.LocalEnvironment, "start", lambda self, cfg, plan, folder: 0)
        assert start.start(compose_config(cfg_overrides), run_dir, base) == 0
    return run_dir


def test_a_moved_run_folder_resumes_to_its_end_and_a_copy_reads_its_own_files(tmp_path, cache_dir, monkeypatch):
    first = planned(["gpus=0", "train.epochs=1", *TINY], tmp_path / "runs" / "A", tmp_path, monkeypatch)
    assert yaml.safe_load((first / "config.yaml").read_text())["data"]["path"] == "data.yaml"  # relative to it
    copy = tmp_path / "runs" / "C"
    shutil.copytree(first, copy)
    moved = tmp_path / "runs" / "B"
    first.rename(moved)
    assert RunFolder(copy).load()[0]["data"]["path"] == str(copy / "data.yaml")
    before = snapshot(copy)

    r = ddp_launch(["resume=runs/B"], cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert json.loads((moved / "summary.json").read_text())["status"] == "finished"
    assert (moved / "weights" / "best.pt").is_file() and not first.exists()
    assert snapshot(copy) == before  # the copy's files: not read for the run, not written


@pytest.fixture()
def dataset(tmp_path) -> Path:
    """A small dataset whose data YAML names its splits relative to itself (it moves with its folder)."""
    root = tmp_path / "ds"
    for i in range(6):
        _write(root, "train", f"t{i}.jpg", _jpeg(), GOOD)
    for i in range(2):
        _write(root, "val", f"v{i}.jpg", _jpeg(), GOOD)
    (root / "data.yaml").write_text(yaml.safe_dump({"train": "images/train", "val": "images/val", "names": NAMES}))
    return root


def test_a_moved_dataset_is_named_again_on_resume_and_checked_to_be_the_runs(tmp_path, cache_dir, dataset,
                                                                           monkeypatch):
    run = planned(["gpus=0", "data=custom", f"data.path={dataset / 'data.yaml'}", *TINY_CUSTOM], tmp_path / "run",
                  tmp_path, monkeypatch)
    resumed = []
    monkeypatch.setattr(local.LocalEnvironment, "resume", lambda self, cfg, plan, folder: resumed.append(cfg) or 0)
    monkeypatch.chdir(tmp_path)
    elsewhere = tmp_path / "moved" / "ds"
    elsewhere.parent.mkdir()
    dataset.rename(elsewhere)

    with pytest.raises(PlanError) as e:  # moved, and not said where: before any rank starts
        start.resume(run, {})
    assert f"the run's dataset is not where it was ({dataset}/images/train" in str(e.value)
    assert "add data.path=ITS_DATA_YAML or data.path=ITS_FOLDER" in str(e.value) and not resumed

    before = snapshot(run)
    (elsewhere / "images" / "train" / "t0.jpg").rename(tmp_path / "t0.jpg")  # not the same dataset any more
    with pytest.raises(PlanError) as e:
        start.resume(run, {"data.path": "moved/ds/data.yaml"})
    assert (f"resume={run} data.path=moved/ds/data.yaml: not the dataset the run trained on (5 train images here, 6 in "
            "the run; 5 train usable images here, 6 in the run)") in str(e.value)
    assert snapshot(run) == before and not resumed
    (tmp_path / "t0.jpg").rename(elsewhere / "images" / "train" / "t0.jpg")

    for named in ("moved/ds/data.yaml", str(elsewhere)):  # its data YAML, or its folder
        assert start.resume(run, {"data.path": named}) == 0
        spec = RunFolder(run).dataset()
        assert spec["path"] == str(elsewhere) and spec["train"] == str(elsewhere / "images" / "train"), spec
        assert resumed[-1]["data"]["path"] == str(run / "data.yaml")
    assert yaml.safe_load((run / "data.prev.yaml").read_text())["path"] == str(elsewhere)
    assert start.resume(run, {}) == 0  # found where it is now


def test_another_dataset_with_other_classes_is_refused_in_one_line(tmp_path, cache_dir, dataset, monkeypatch):
    run = planned(["gpus=0", "data=custom", f"data.path={dataset / 'data.yaml'}", *TINY_CUSTOM], tmp_path / "run",
                  tmp_path, monkeypatch)
    other = tmp_path / "other"
    shutil.copytree(dataset, other)
    (other / "data.yaml").write_text(yaml.safe_dump({"train": "images/train", "val": "images/val",
                                                     "names": ["cat", "dog", "car"]}))
    with pytest.raises(PlanError) as e:
        start.resume(run, {"data.path": str(other / "data.yaml")})
    assert "class names 3 (cat, dog, car) here, 3 (a, b, c) in the run" in str(e.value)
    assert len(e.value.problems) == 1

"""Hydra sweeps (`ddp-launch -m`): every job runs, each in its own run folder; a refused job does not stop the sweep;
the invocation exits with the worst job's code. The README's two sweep commands run here, as written first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.conftest import ddp_launch

PLOTS = ("labels.jpg", "results.png", "BoxPR_curve.png", "BoxF1_curve.png", "confusion_matrix.png",
         "val_batch0_pred.jpg")
TINY_RUN = ["train.imgsz=64", "data.synthetic.train_images=32", "data.synthetic.val_images=8",
            "train.batch_per_device=8", "train.close_mosaic=0"]


def job_folders(cwd: Path) -> list[Path]:
    """The sweep's job folders, in job order (multirun/<date>/<time>/<job number>)."""
    return sorted((p for p in cwd.glob("multirun/*/*/*") if p.is_dir()), key=lambda p: int(p.name))


def job_overrides(folder: Path) -> list[str]:
    return yaml.safe_load((folder / ".hydra" / "overrides.yaml").read_text())


def test_a_dry_run_sweep_plans_every_job_in_its_own_folder(tmp_path, cache_dir):
    r = ddp_launch(["-m", "dry_run=true", "seed=1,2,3"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stdout.count("dry run: nothing started") == 3
    folders = job_folders(tmp_path)
    assert [f.name for f in folders] == ["0", "1", "2"]
    assert [[o for o in job_overrides(f) if o.startswith("seed=")] for f in folders] == [["seed=1"], ["seed=2"], ["seed=3"]]


def test_a_refused_job_is_reported_and_the_sweep_goes_on_to_exit_with_the_worst_code(tmp_path, cache_dir):
    r = ddp_launch(["-m", "dry_run=true", "train.imgsz=65,64"], cwd=tmp_path)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "train.imgsz=65: must be a multiple of 32" in r.stderr
    assert r.stdout.count("dry run: nothing started") == 1  # the job after the refused one ran


def test_a_sweep_names_each_job_as_it_starts_and_ends_with_a_table_of_outcomes(tmp_path, cache_dir):
    r = ddp_launch(["-m", "dry_run=true", "train.imgsz=65,64"], cwd=tmp_path)
    (planned,) = job_folders(tmp_path)  # the refused job's folder is never written
    assert f"==== sweep job 1 of 2: dry_run=True train.imgsz=65 -> {planned.parent}/0 ====" in r.stdout
    assert f"==== sweep job 2 of 2: dry_run=True train.imgsz=64 -> {planned} ====" in r.stdout
    table = r.stdout[r.stdout.index("sweep: 2 job(s)"):].splitlines()
    assert table[1].split() == ["job", "outcome", "result", "run", "folder", "overrides"]
    assert table[2].split()[:4] == ["1", "refused", "(2)", "-"] and table[3].split()[:4] == ["2", "planned", "(0)", "-"]


@pytest.mark.slow
def test_a_sweep_trains_every_job_into_its_own_run_folder(tmp_path, cache_dir):
    r = ddp_launch(["-m", "train.epochs=1", "seed=1,2", *TINY_RUN], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    folders = job_folders(tmp_path)
    assert len(folders) == 2
    for folder, seed in zip(folders, (1, 2)):
        summary = json.loads((folder / "summary.json").read_text())
        assert summary["status"] == "finished" and summary["epochs_completed"] == 1
        assert yaml.safe_load((folder / "config.yaml").read_text())["seed"] == seed
        assert (folder / "env.txt").read_text().startswith("ddp-env: the environment of this node")
        assert f"box mAP50-95 {summary['map50_95']:.4f}" in r.stdout  # the table's result column
        for plot in PLOTS:  # train.plots is on by default
            assert (folder / plot).stat().st_size > 0, plot


def test_on_slurm_each_job_of_a_sweep_is_its_own_batch_job(tmp_path, cache_dir):
    """launcher=slurm: every job of the sweep writes its own job script into its own run folder (a dry run prints
    them; tests/test_slurm_cluster.py submits a job for real)."""
    r = ddp_launch(["-m", "launcher=slurm", "dry_run=true", "seed=1,2"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    folders = job_folders(tmp_path)
    assert len(folders) == 2 and r.stdout.count("dry run: nothing started") == 2
    for folder in folders:
        assert f"sbatch script ({folder}/job.sbatch)" in r.stdout

"""log.integrations: Ultralytics' TensorBoard callbacks on rank 0 write an event file into the run folder that
TensorBoard's own reader parses, with the losses results.csv holds and ddp-launch's images/s and data wait; unknown or
missing integrations are refused."""

from __future__ import annotations

import csv

import pytest

from tests.conftest import TINY, ddp_launch, run_dir_of

# Ultralytics turns its integrations off when it sees a test runner or a GitHub Actions job: this run is a user's
NOT_A_TEST = {"PYTEST_CURRENT_TEST": None, "GITHUB_ACTIONS": None}


@pytest.mark.slow
def test_tensorboard_writes_the_epochs_losses_and_metrics_into_the_run_folder(tmp_path, cache_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    r = ddp_launch(["log.integrations=[tensorboard]", "train.epochs=2", "train.plots=false", *TINY], cwd=tmp_path,
                   env=NOT_A_TEST)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run_dir = run_dir_of(r)
    assert list(run_dir.glob("events.out.tfevents.*")), sorted(p.name for p in run_dir.iterdir())
    events = EventAccumulator(str(run_dir))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/box_loss", "train/cls_loss", "lr/pg0", "metrics/mAP50(B)"} <= tags, tags
    # ddp-launch's own figures beside them, as summary.json names them; the first epoch is the meter's warm-up
    images_per_s = events.Scalars("ddp_launch/images_per_s")
    assert [e.step for e in images_per_s] == [2] and images_per_s[0].value > 0
    assert [e.step for e in events.Scalars("ddp_launch/data_wait")] == [2]
    rows = list(csv.DictReader(open(run_dir / "results.csv")))
    logged = [(e.step, e.value) for e in events.Scalars("train/box_loss")]
    assert logged == [(i + 1, pytest.approx(float(row["train/box_loss"]), abs=1e-5)) for i, row in enumerate(rows)]


def test_an_unknown_integration_is_refused_and_a_missing_package_named_with_its_install(tmp_path, cache_dir):
    r = ddp_launch(["dry_run=true", "log.integrations=[neptune]"], cwd=tmp_path)
    assert r.returncode == 2 and "'neptune' is not one of tensorboard, wandb" in r.stderr, r.stdout + r.stderr
    r = ddp_launch(["dry_run=true", "log.integrations=[dvc]"], cwd=tmp_path)  # dvclive: not installed here
    assert r.returncode == 0, r.stdout + r.stderr
    assert "log.integrations=[dvc]: the dvclive package is not installed: pip install dvclive" in r.stdout

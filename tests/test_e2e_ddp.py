"""Two DDP ranks on the CPU (gloo), end to end through the real `ddp-launch` and torchrun: the README's command for
it, with more epochs; then a run that starts from its weights, with AdamW and the cosine schedule."""

from __future__ import annotations

import csv
import json
import math
import re
import shlex

import pytest
import torch

from tests.conftest import TINY, ddp_launch, run_dir_of, validation_tables
from tests.test_readme import readme_commands

pytestmark = [pytest.mark.slow, pytest.mark.dist]

EPOCHS, VAL_INTERVAL, SAVE_PERIOD = 4, 3, 2
README_COMMAND = next(c for c in readme_commands("ddp-launch")
                      if "nproc=2" in c and "launcher=" not in c and "model=" not in c)


@pytest.fixture(scope="module")
def run(tmp_path_factory, cache_dir):
    cwd = tmp_path_factory.mktemp("e2e")
    args = [f"train.epochs={EPOCHS}", f"train.val_interval={VAL_INTERVAL}", f"train.save_period={SAVE_PERIOD}",
            "debug.record_samples=true"]
    # a short run that still learns: a brisk lr, one epoch of warmup, mosaic throughout (no distribution change)
    learn = ["optim.base_lr=0.04", "optim.warmup_epochs=1", "train.close_mosaic=0", "train.plots=true"]
    result = ddp_launch([*shlex.split(README_COMMAND)[1:], *args, *TINY, *learn], cwd=cwd)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result, run_dir_of(result)


def test_both_ranks_finish_with_identical_weights(run):
    _, run_dir = run
    reports = [json.loads((run_dir / "ranks" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert reports[0]["params_sha256"] == reports[1]["params_sha256"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ranks_params_identical"] is True


def test_each_epoch_the_ranks_train_on_disjoint_shards_covering_the_data(run):
    _, run_dir = run
    samples = [json.loads((run_dir / "ranks" / f"rank{r}.json").read_text())["samples"] for r in (0, 1)]
    train_images = {p.name for p in _train_dir(run_dir).iterdir()}
    orders = []
    for epoch in map(str, range(EPOCHS)):
        a, b = samples[0][epoch], samples[1][epoch]
        assert not set(a) & set(b)
        assert set(a) | set(b) == train_images
        orders.append(tuple(a))
    assert len(set(orders)) == EPOCHS  # a new order every epoch, the second one included


def _train_dir(run_dir):
    import yaml

    return __import__("pathlib").Path(yaml.safe_load((run_dir / "data.yaml").read_text())["train"])


def test_the_loss_falls(run):
    _, run_dir = run
    rows = list(csv.DictReader(open(run_dir / "results.csv")))
    total = [sum(float(r[k]) for k in ("train/box_loss", "train/cls_loss", "train/dfl_loss")) for r in rows]
    assert len(total) == EPOCHS
    assert total[-1] < total[0]


def test_validation_ran_at_the_interval_and_after_the_last_epoch(run):
    _, run_dir = run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["validated_epochs"] == [3, 4]
    rows = list(csv.DictReader(open(run_dir / "results.csv")))
    measured = [r["metrics/mAP50(B)"] != "nan" for r in rows]
    assert measured == [False, False, True, True]


def test_save_period_keeps_a_checkpoint_every_n_epochs(run):
    _, run_dir = run
    kept = sorted(p.name for p in (run_dir / "weights").glob("epoch*.pt"))
    assert kept == ["epoch0.pt", "epoch2.pt"]  # Ultralytics' numbering: the 0-based epoch, every SAVE_PERIOD
    ckpt = torch.load(run_dir / "weights" / "epoch2.pt", map_location="cpu", weights_only=False)
    assert ckpt["epoch"] == 2 and ckpt["ddp_launch_state"]["train"]["position"] == (3, 0)


def test_the_run_folder_holds_config_plan_logs_weights_and_summary(run):
    result, run_dir = run
    for name in ("config.yaml", "plan.json", "data.yaml", "args.yaml", "logs/rank0.log", "logs/rank1.log",
                 "weights/best.pt", "weights/last.pt"):
        assert (run_dir / name).is_file(), name
    assert not (run_dir / "weights" / "last.prev.pt").exists()  # removed once the run finished
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("map50", "map50_95", "epochs_completed", "world_size", "global_batch", "lr0", "images_per_s", "weights"):
        assert key in summary
    assert summary["world_size"] == 2 and summary["epochs_completed"] == EPOCHS
    assert summary["global_batch"] == 16 and summary["images_per_s"] > 0 and summary["loss_finite"] is True
    assert "[rank 0] epoch 4/4" in result.stdout  # rank 0 on the console
    assert "[rank 1]" not in result.stdout and "[rank 1] epoch 4/4" in (run_dir / "logs/rank1.log").read_text()
    from ultralytics import YOLO

    final = torch.load(summary["weights"], map_location="cpu", weights_only=False)
    assert final["optimizer"] is None and final.get("ddp_launch_state") is None  # the final weights only
    YOLO(summary["weights"])  # the weights load with Ultralytics as they are


def test_a_run_from_model_weights_with_adamw_follows_the_cosine_schedule(run, tmp_path):
    """model=checkpoint starts from the weights (Ultralytics' transfer), not from scratch; AdamW trains; with
    optim.cos_lr and no warmup every epoch's lr is lr0 x the cosine factor of Ultralytics' one-cycle schedule. Its
    validations run on the EMA's folded copy (val.fold_batchnorm), made once; log.verbose shows the diagnostics."""
    _, first = run
    weights = json.loads((first / "summary.json").read_text())["weights"]
    args = ["model=checkpoint", f"model.weights={weights}", "optim.name=adamw", "optim.cos_lr=true",
            "optim.warmup_epochs=0", "optim.base_lr=0.002", "train.epochs=3", "train.plots=false",
            "val.fold_batchnorm=true", "log.verbose=true", *TINY]
    r = ddp_launch(args, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run_dir = run_dir_of(r)
    log = (run_dir / "logs" / "rank0.log").read_text()
    transferred = re.search(r"Transferred (\d+)/(\d+) items from pretrained weights", log)
    assert transferred and transferred[1] == transferred[2], log[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["loss_finite"] and summary["epochs_completed"] == 3
    assert len(re.findall(r"the EMA copied with \d+ BatchNorms folded", log)) == 1 and summary["map50_95"] >= 0
    assert "[rank 0] [detail] validation: the EMA copied with " in r.stdout  # log.verbose: the diagnostics shown
    assert "optimizer: AdamW" in (run_dir / "args.yaml").read_text()
    rows = list(csv.DictReader(open(run_dir / "results.csv")))
    lrf = 0.01
    cosine = [((1 - math.cos(e * math.pi / 3)) / 2) * (lrf - 1) + 1 for e in range(3)]
    assert [float(r["lr/pg0"]) for r in rows] == pytest.approx([summary["lr0"] * f for f in cosine], rel=1e-4)
    scratch = list(csv.DictReader(open(first / "results.csv")))
    assert float(rows[0]["train/box_loss"]) < float(scratch[0]["train/box_loss"])  # it did not start from scratch
    assert not list(run_dir.glob("*.png")) and not list(run_dir.glob("*.jpg"))  # train.plots=false


def test_rank_0_writes_the_plots_of_a_two_rank_run(run):
    _, run_dir = run
    for plot in ("labels.jpg", "results.png", "BoxPR_curve.png", "confusion_matrix_normalized.png",
                 "train_batch0.jpg", "train_batch1.jpg", "train_batch2.jpg"):  # the first three training batches
        assert (run_dir / plot).stat().st_size > 0, plot
    assert not (run_dir / "train_batch3.jpg").exists()


def test_the_console_reads_like_ultralytics_with_its_tables_and_without_diagnostics(run):
    """Each validation prints Ultralytics' header and `all` row; after the last, best.pt's table has a row per
    class. ddp-launch's diagnostics (the attempt's header, the validation's timings) are in rank 0's log only."""
    result, run_dir = run
    import yaml

    names = list(yaml.safe_load((run_dir / "data.yaml").read_text())["names"].values())
    tables = validation_tables(result.stdout)
    assert tables[:2] == [["all"], ["all"]], result.stdout[-3000:]  # epochs 3 and 4
    assert tables[-1] == ["all", *names] and len(tables) == 3, tables  # best.pt's, validated again or not
    log = (run_dir / "logs" / "rank0.log").read_text()
    assert "[rank 0] [detail] validation: " in log and "[detail] ==== rank 0/2 " in log
    assert "[detail]" not in result.stdout and "validation: " not in result.stdout and "====" not in result.stdout

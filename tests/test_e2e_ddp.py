"""Two DDP ranks on the CPU (gloo), end to end through the real `ddp-launch` and torchrun."""

from __future__ import annotations

import csv
import json

import pytest

from tests.conftest import TINY, ddp_launch, run_dir_of

pytestmark = [pytest.mark.slow, pytest.mark.dist]

EPOCHS, VAL_INTERVAL = 4, 3


@pytest.fixture(scope="module")
def run(tmp_path_factory, cache_dir):
    cwd = tmp_path_factory.mktemp("e2e")
    args = ["gpus=0", "nproc=2", f"train.epochs={EPOCHS}", f"train.val_interval={VAL_INTERVAL}", "debug.record_samples=true"]
    # a short run that still learns: a brisk lr, one epoch of warmup, mosaic throughout (no distribution change)
    learn = ["optim.base_lr=0.04", "optim.warmup_epochs=1", "train.close_mosaic=0"]
    result = ddp_launch([*args, *TINY, *learn], cwd=cwd)
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
    train_images = {p.name for p in (json.loads((run_dir / "summary.json").read_text()) and _train_dir(run_dir)).iterdir()}
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


def test_the_run_folder_holds_config_plan_logs_weights_and_summary(run):
    result, run_dir = run
    for name in ("config.yaml", "plan.json", "data.yaml", "logs/rank0.log", "logs/rank1.log", "weights/best.pt", "weights/last.pt"):
        assert (run_dir / name).is_file(), name
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("map50", "map50_95", "epochs_completed", "world_size", "global_batch", "lr0", "images_per_s", "weights"):
        assert key in summary
    assert summary["world_size"] == 2 and summary["epochs_completed"] == EPOCHS
    assert summary["global_batch"] == 16 and summary["images_per_s"] > 0 and summary["loss_finite"] is True
    assert "[rank 0] epoch 4/4" in result.stdout  # rank 0 on the console
    assert "[rank 1]" not in result.stdout and "[rank 1] epoch 4/4" in (run_dir / "logs/rank1.log").read_text()
    from ultralytics import YOLO

    YOLO(summary["weights"])  # the weights load with Ultralytics as they are


def test_a_rank_other_than_0_leaves_the_runs_results_to_rank_0(run):
    """Ultralytics' trainer deletes results.csv when it is constructed; on a resume every rank doing so raced the
    others (one failed with FileNotFoundError, and rank 0 could lose the rows it restores). Rank 1 must not touch it
    and must still use the run folder's paths."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from launcher import runenv

    _, run_dir = run
    before = (run_dir / "results.csv").read_text()
    code = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from omegaconf import OmegaConf\n"
        "from launcher.plan import LaunchPlan\n"
        "run_dir = Path(sys.argv[1])\n"
        "cfg = OmegaConf.to_container(OmegaConf.load(run_dir / 'config.yaml'), resolve=True)\n"
        "plan = LaunchPlan.from_dict(json.loads((run_dir / 'plan.json').read_text()))\n"
        "from launcher.trainer import LaunchTrainer\n"
        "t = LaunchTrainer(cfg, plan, run_dir)\n"
        "print(json.dumps([str(t.save_dir), t.args.save_dir, str(t.last), str(t.best), str(t.csv)]))\n"
    )
    from omegaconf import OmegaConf

    cache = Path(OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"), resolve=True)["paths"]["cache"])
    env = {**os.environ, **runenv.offline_environment(cache), "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}
    r = subprocess.run([sys.executable, "-c", code, str(run_dir)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    paths = json.loads(r.stdout.strip().splitlines()[-1])
    w = run_dir / "weights"
    assert paths == [str(run_dir), str(run_dir), str(w / "last.pt"), str(w / "best.pt"), str(run_dir / "results.csv")]
    assert (run_dir / "results.csv").read_text() == before
    assert not (run_dir / "ranks" / "construct-rank1").exists()

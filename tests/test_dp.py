"""DataParallel: only the images are scattered; the loss on the gathered predictions is the single-process loss."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import TINY, ddp_launch, run_dir_of
from tests.test_ddp_equivalence import make_model_and_batch


def test_the_dp_loss_equals_the_single_process_loss_on_the_same_batch():
    from ultralytics.utils.torch_utils import unwrap_model

    from launcher.trainer import prepare_criterion

    model, batch = make_model_and_batch()
    prepare_criterion(model)
    model.train()
    single, _ = model.loss(batch, model(batch["img"]))
    dp = torch.nn.DataParallel(model)  # no GPU here: one device; with GPUs the images are split across them
    gathered = dp(batch["img"])  # what launcher.trainer.train_step does: forward on the images only
    dp_loss, _ = unwrap_model(dp).loss(batch, gathered)
    torch.testing.assert_close(dp_loss, single)


@pytest.mark.slow
def test_dataparallel_over_one_device_trains_end_to_end(tmp_path, cache_dir):
    r = ddp_launch(["gpus=0", "mode=dp", "train.epochs=2", *TINY], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((run_dir_of(r) / "summary.json").read_text())
    assert summary["mode"] == "dp" and summary["epochs_completed"] == 2 and summary["world_size"] == 1
    assert "DataParallel over one device" in r.stdout

"""The final validation's plots through Ultralytics' own validators (segmentation, pose and classification here; obb's
batches and plots are laid out as segmentation's), drawn after the weights: with `draw` (the run's plotter) the validation writes no file and computes the metrics it computes
when it draws at once, and what it handed over draws the same files, whatever the validator did in between."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import yaml
from ultralytics.cfg import get_cfg

from launcher.inputs import shapes
from launcher.rank.group.dist import Comm
from launcher.rank.ultralytics import datasets
from launcher.rank.ultralytics.tasks import task_of
from launcher.rank.ultralytics.validation import Validator

MODELS = {"segment": "yolov8n-seg.yaml", "pose": "yolov8n-pose.yaml", "classify": "yolov8n-cls.yaml"}


def _loss_items(model, loader) -> dict:
    """The loss items the task's criterion gives (what a run's step hands the validator), as zeros."""
    batch = next(iter(loader))
    batch["img"] = batch["img"].float() / 255
    model.train()
    with torch.no_grad():
        items = model.loss(batch, model(batch["img"]))[1]
    model.eval()
    return {k: torch.zeros(()) for k in items}


def _data(task: str, root) -> dict:
    spec = shapes.ShapesSpec(train_images=2, val_images=6, width=96, height=80, max_objects=3, seed=4, task=task)
    found = shapes.ensure_dataset(root, spec, workers=1, log=lambda _: None)
    if task == "classify":
        folder = found.parent if found.is_file() else found
        names = sorted(p.name for p in (folder / "val").iterdir())
        return {"train": str(folder / "train"), "val": str(folder / "val"), "names": dict(enumerate(names)),
                "nc": len(names), "channels": 3}
    data = yaml.safe_load(found.read_text())
    data["val"] = str(found.parent / data["val"])
    data["names"] = dict(enumerate(data["names"])) if isinstance(data["names"], list) else data["names"]
    return {**data, "nc": len(data["names"]), "channels": 3}


@pytest.mark.parametrize("task", list(MODELS))
def test_the_final_validations_plots_are_drawn_later_from_what_that_validation_saw(task, tmp_path):
    data = _data(task, tmp_path / "data")
    torch.manual_seed(0)
    model = task_of(task).network(MODELS[task], data)
    model.names = data["names"]
    hyp = get_cfg(overrides={"task": task, "imgsz": 64, "plots": False})
    model.args = hyp
    ema = SimpleNamespace(ema=model)
    loaders = [datasets.val_loader(hyp, data, 4, 32, 0, torch.device("cpu")) for _ in range(2)]
    kwargs = dict(device=torch.device("cpu"), data=data, amp=False, epoch=0, epochs=1, plots=True,
                  loss_items=_loss_items(model, loaders[0]))
    now, later = (Validator(loader, hyp, tmp_path / name) for loader, name in zip(loaders, ("now", "later")))
    queued = []
    want = now.validate(ema, Comm(), **kwargs)
    got = later.validate(ema, Comm(), **kwargs, draw=lambda what, fn, *args: queued.append((fn, args)))
    assert got == want and queued and not list((tmp_path / "later").glob("*.*"))
    with torch.no_grad():  # other weights validated before the drawing runs: it must not draw those
        for p in model.parameters():
            p.mul_(0.5)
    later.validate(ema, Comm(), **{**kwargs, "plots": False})
    for fn, args in queued:
        fn(*args)
    drawn = sorted(p.name for p in (tmp_path / "later").iterdir())
    assert drawn == sorted(p.name for p in (tmp_path / "now").iterdir())
    assert {"confusion_matrix.png", "val_batch0_labels.jpg", "val_batch0_pred.jpg"} <= set(drawn), drawn
    if task != "classify":
        assert {"BoxPR_curve.png", {"segment": "MaskPR_curve.png", "pose": "PosePR_curve.png"}[task]} <= set(drawn)
    matrix = "confusion_matrix.png"
    assert (tmp_path / "later" / matrix).read_bytes() == (tmp_path / "now" / matrix).read_bytes()

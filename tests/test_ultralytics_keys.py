"""A YOLO user's command works as typed: Ultralytics' training keys mean here what they mean in `yolo train`
(epochs, imgsz, batch as the global batch, device=0,1, model=X.pt fine-tuned, data=PATH, project/name, lr0...),
every translation is shown in the plan, and a key that cannot apply is refused with the key to type instead."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from launcher.machine.hardware import Gpu, Hardware
from launcher.plan.plan import make_plan
from launcher.plan.ultralytics_keys import translate
from tests.conftest import TINY, compose_config, ddp_launch, run_dir_of


def translated(*argv: str, taken=()) -> list[str]:
    t = translate(list(argv), exists=lambda p: str(p) in taken, now=lambda: "T")
    assert not t.problems, [p.message for p in t.problems]
    return t.argv


def refusal(*argv: str) -> str:
    t = translate(list(argv), exists=lambda p: False)
    assert t.problems, t.argv
    return "\n".join(p.message for p in t.problems)


@pytest.mark.parametrize("typed, became", [
    (["epochs=3", "imgsz=640", "batch=16"], ["train.epochs=3", "train.imgsz=640", "train.batch=16"]),
    (["lr0=0.02", "workers=4", "cos_lr=True"], ["optim.base_lr=0.02", "loader.workers=4", "optim.cos_lr=True"]),
    (["device=0,1"], ["device=[0,1]"]),
    (["device=cuda:2"], ["device=[2]"]),
    (["model=yolov8n.pt"], ["model=checkpoint", "model.weights='yolov8n.pt'"]),
    (["model=yolo11s.yaml"], ["model=yolo11s"]),
    (["model=nets/my-net.yaml"], ["model=custom", "model.cfg='nets/my-net.yaml'"]),
    (["data=/data/my.yaml"], ["data=custom", "data.path='/data/my.yaml'"]),
    (["data=coco8.yaml"], ["data=custom", "data.path='coco8.yaml'"]),
    (["optimizer=AdamW", "amp=False", "cache=True"], ["optim.name=adamw", "train.amp=false", "train.cache=ram"]),
    (["val=False"], ["train.val_interval=0"]),
    (["mosaic=0.5", "fliplr=0"], ["++train.extra.mosaic=0.5", "++train.extra.fliplr=0"]),
    (["resume"], ["resume=true"]),
    (["project=work", "name=exp"], ["hydra.run.dir='work/exp'"]),
    (["seed=3", "train.epochs=2", "+experiment=coco"], ["seed=3", "train.epochs=2", "+experiment=coco"]),
])
def test_ultralytics_keys_become_the_overrides_with_the_same_meaning(typed, became):
    assert translated(*typed) == became


def test_a_taken_run_name_is_incremented_as_ultralytics_does_unless_exist_ok():
    assert translated("project=work", "name=exp", taken=("work/exp",)) == ["hydra.run.dir='work/exp2'"]
    assert translated("project=work", "name=exp", "exist_ok=True", taken=("work/exp",)) == ["hydra.run.dir='work/exp'"]


def test_a_sweep_keeps_its_values():
    assert translated("-m", "lr0=0.01,0.02", "epochs=1") == ["-m", "optim.base_lr=0.01,0.02", "train.epochs=1"]


@pytest.mark.parametrize("typed, says", [
    (["epoch=3"], "did you mean epochs?"),
    (["train.epoch=3"], "did you mean train.epochs?"),
    (["time=2"], "epochs=N"),
    (["optimizer=auto"], "use optimizer=SGD or optimizer=AdamW"),
    (["mode=predict"], "run `yolo predict`"),
    (["format=onnx"], "format"),
])
def test_a_key_that_cannot_apply_is_refused_with_what_to_type(typed, says):
    assert says in refusal(*typed)


def test_train_extra_refuses_the_keys_ddp_launch_sets_naming_its_own():
    from launcher.plan.ultralytics_values import extra_problems

    said = [p.message for p in extra_problems({"epochs": 3, "batch": 8, "time": 1})]
    assert said == ["train.extra.epochs: ddp-launch sets this itself; use train.epochs",
                    "train.extra.batch: ddp-launch sets this itself; use train.batch",
                    "train.extra.time: train the number of epochs you want with epochs=N (ddp-launch has no time "
                    "budget)"]


def test_device_picks_those_gpus_through_cuda_visible_devices():
    hw = Hardware(gpus=tuple(Gpu(i, "NVIDIA H100", 80.0) for i in range(4)), cpu_count=32, nccl_available=True)
    plan, problems = make_plan(compose_config(["device=[1,3]", "train.batch=32"]), hw, None)
    assert not problems, problems
    assert plan.nproc_per_node == 2 and plan.world_size == 2
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "1,3"
    assert plan.batch_per_device == 16  # Ultralytics' batch is the global one
    _, problems = make_plan(compose_config(["device=[0,5]"]), hw, None)
    assert problems[0].message.startswith("device=0,5: this node has 4 visible GPU(s)")
    assert problems[0].message.endswith("GPU 5 is not one of them")


def test_the_global_batch_is_split_and_the_plan_shows_each_translation(tmp_path, cache_dir):
    r = ddp_launch(["epochs=3", "imgsz=320", "batch=32", "lr0=0.02", "workers=0", "gpus=0", "nproc=2",
                    "dry_run=true"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    out = r.stdout
    assert "epochs=3 -> train.epochs=3" in out and "lr0=0.02 -> optim.base_lr=0.02" in out
    assert "16 per device x 2 device(s) = global batch 32" in out
    assert "3 epochs at 320 px" in out


def test_a_checkpoint_fine_tunes_and_the_plan_counts_what_it_transfers(tmp_path, cache_dir, checkpoint):
    shutil.copy(checkpoint, tmp_path / "yolov8n.pt")
    r = ddp_launch(["model=yolov8n.pt", "gpus=0", "dry_run=true"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    model_line = next(line for line in r.stdout.splitlines() if line.startswith("model "))
    assert "yolov8n.yaml (the checkpoint's)" in model_line and f"{tmp_path}/yolov8n.pt" in model_line
    assert "tensors transferred" in model_line  # 80 classes to the shapes data's: the head's last layers differ


def test_a_missing_checkpoint_says_where_it_looked_and_never_downloads_unasked(tmp_path, cache_dir):
    r = ddp_launch(["model=yolov8n.pt", "gpus=0", "dry_run=true"], cwd=tmp_path)
    assert r.returncode != 0
    assert "model.weights='yolov8n.pt': not found" in r.stderr and "model.allow_download=true" in r.stderr


def test_the_ultralytics_first_command_plans_as_typed(tmp_path, cache_dir, checkpoint):
    """`yolo detect train data=coco8.yaml model=yolov8n.pt epochs=3 imgsz=640 batch=16 device=0,1`, the dataset
    where Ultralytics keeps its datasets (paths.datasets), the weights here."""
    shutil.copy(checkpoint, tmp_path / "yolov8n.pt")
    datasets = tmp_path / "datasets"
    for split in ("train", "val"):
        (datasets / "coco8" / "images" / split).mkdir(parents=True)
        (datasets / "coco8" / "labels" / split).mkdir(parents=True)
    r = ddp_launch(["data=coco8.yaml", "model=yolov8n.pt", "epochs=3", "imgsz=640", "batch=16", "device=0,1",
                    "dry_run=true", f"paths.datasets={datasets}"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "device=0,1 -> device=[0,1]" in r.stdout and "CUDA_VISIBLE_DEVICES=0,1" in r.stdout
    assert "8 per device x 2 device(s) = global batch 16" in r.stdout
    assert "3 epochs at 640 px" in r.stdout
    assert f"{datasets}/coco8" in r.stdout + r.stderr


def test_version_names_ddp_launch_and_its_libraries(tmp_path):
    r = ddp_launch(["--version"], cwd=tmp_path)
    assert r.returncode == 0
    first = r.stdout.splitlines()[0]
    assert first.startswith("ddp-launch ") and "Hydra" not in first
    assert "ultralytics" in r.stdout and "torch" in r.stdout


def test_python_takes_ultralytics_keywords(tmp_path, cache_dir, monkeypatch, capsys):
    from launcher import train

    monkeypatch.chdir(tmp_path)
    plan = train(epochs=2, imgsz=320, batch=8, device="cpu", dry_run=True)
    out = capsys.readouterr().out
    assert "epochs=2 -> train.epochs=2" in out and "2 epochs at 320 px" in out
    assert plan["world_size"] == 1


@pytest.mark.slow
def test_a_run_typed_with_ultralytics_keys_trains_into_project_name(tmp_path, cache_dir):
    """Ultralytics' keys as typed, val=False among them: validated after the last epoch only."""
    tiny = [o for o in TINY if not o.startswith(("train.imgsz", "train.batch_per_device", "train.close_mosaic"))]
    r = ddp_launch(["epochs=2", "imgsz=64", "batch=16", "close_mosaic=1", "lr0=0.02", "workers=0", "mosaic=0.5",
                    "val=False", "gpus=0", "nproc=2", "project=work", "name=exp", *tiny], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    run = run_dir_of(r)
    assert run == tmp_path / "work" / "exp"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["epochs_completed"] == 2 and summary["validated_epochs"] == [2]
    assert "validated after the last epoch only" in r.stdout
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert (cfg["train"]["epochs"], cfg["train"]["imgsz"], cfg["optim"]["base_lr"]) == (2, 64, 0.02)
    assert cfg["train"]["extra"]["mosaic"] == 0.5
    assert (run / "weights" / "best.pt").is_file()


def test_data_takes_an_absolute_path_as_ultralytics_does(tmp_path, cache_dir):
    root = tmp_path / "elsewhere" / "ds"
    for split in ("train", "val"):
        (root / "images" / split).mkdir(parents=True)
        (root / "images" / split / "a.jpg").write_bytes(b"")
    (root / "data.yaml").write_text("path: .\ntrain: images/train\nval: images/val\nnames: [thing]\n")
    r = ddp_launch([f"data={root / 'data.yaml'}", "gpus=0", "dry_run=true"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"data={root / 'data.yaml'} -> data=custom data.path='{root / 'data.yaml'}'" in r.stdout
    assert f"data            data: {root}" in r.stdout


def test_ddp_bench_refuses_a_global_batch_its_cells_would_split_differently(tmp_path, cache_dir):
    r = ddp_launch(["batch=64", "gpus=0", "bench.sizes=[1,2]", "bench.modes=[ddp]", "dry_run=true"], cwd=tmp_path,
                   tool="ddp-bench")
    assert r.returncode == 2
    assert "batch=64: ddp-bench compares its cells at one batch per device; set train.batch_per_device=N" in r.stderr

"""Every bad input is refused before any rank starts, with a message that says what to do, and a non-zero exit."""

from __future__ import annotations

import socket

import pytest
import yaml

from launcher.launch.start import start as launch
from launcher.problems import PlanError
from tests.conftest import compose_config, ddp_launch


def refused(overrides: list[str], tmp_path) -> str:
    cfg = compose_config(overrides)
    with pytest.raises(PlanError) as e:
        launch(cfg, tmp_path / "run", tmp_path)
    assert not (tmp_path / "run" / "plan.json").exists()
    return str(e.value)


@pytest.fixture()
def data_yaml(tmp_path):
    root = tmp_path / "ds"
    for split in ("train", "val"):
        (root / "images" / split).mkdir(parents=True)
        (root / "images" / split / "x.jpg").write_bytes(b"")

    def write(content: dict) -> str:
        f = root / "data.yaml"
        f.write_text(yaml.safe_dump(content))
        return str(f)

    return write


def test_batch_below_one(tmp_path, cache_dir):
    assert "train.batch_per_device=0: must be >= 1" in refused(["train.batch_per_device=0"], tmp_path)


def test_nccl_on_the_cpu(tmp_path, cache_dir):
    msg = refused(["gpus=0", "nproc=2", "dist.backend=nccl"], tmp_path)
    assert "dist.backend=nccl needs GPUs; on the CPU use dist.backend=gloo" in msg


def test_busy_explicit_master_port_names_the_port(tmp_path, cache_dir):
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        msg = refused(["gpus=0", "nproc=2", f"dist.master_port={port}"], tmp_path)
    assert f"dist.master_port={port} is already in use" in msg


def test_missing_dataset_names_the_path_and_the_key(tmp_path, cache_dir):
    msg = refused(["data=coco", f"data.root={tmp_path}/nowhere"], tmp_path)
    assert f"{tmp_path}/nowhere" in msg
    assert "data.root=" in msg and "never downloads" in msg
    assert "data.allow_download=true" in msg  # coco.yaml has a download script, which is not run


def test_data_yaml_without_train(tmp_path, data_yaml, cache_dir):
    path = data_yaml({"val": "images/val", "names": ["a"]})
    assert "'train:' is missing" in refused(["data=custom", f"data.path={path}"], tmp_path)


def test_data_yaml_with_nc_mismatch(tmp_path, data_yaml, cache_dir):
    path = data_yaml({"train": "images/train", "val": "images/val", "names": ["a", "b"], "nc": 3})
    assert "'nc: 3' does not match the 2 entries of 'names:'" in refused(["data=custom", f"data.path={path}"], tmp_path)


def test_data_yaml_that_is_not_yaml(tmp_path, cache_dir):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    assert "not valid YAML" in refused(["data=custom", f"data.path={bad}"], tmp_path)


def test_custom_data_without_a_path(tmp_path, cache_dir):
    assert "data=custom needs data.path=" in refused(["data=custom"], tmp_path)


def test_weights_that_are_not_here_are_never_downloaded_unasked(tmp_path, cache_dir):
    assert "is weights, not an architecture: type model=yolov8n.pt" in refused(["model.cfg=yolov8n.pt"], tmp_path)
    msg = refused(["model=checkpoint", "model.weights=yolo11n.pt"], tmp_path)
    assert f"not found (looked in {tmp_path}, " in msg
    assert "put yolo11n.pt in one of them, or set model.allow_download=true" in msg
    assert "give the path of a local .pt" in refused(["model=checkpoint", "model.weights=mine.pt"], tmp_path)


def test_an_unknown_model_yaml_suggests_close_names(tmp_path, cache_dir):
    assert "Did you mean: yolov8n.yaml" in refused(["model.cfg=yolov8nn.yaml"], tmp_path)


@pytest.mark.parametrize(
    "args,expected",
    [
        (["model=yolov99"], "model=yolov99: not a model here. Type a name (yolov8n, yolo11s, ...: its architecture"),
        (["+experiment=nope"], "experiment=nope: no such option; the options are coco, shapes_cpu, time_to_model"),
        (["gpus=2"], "train on the CPU with gpus=0"),
        (["not_a_key=1"], "not_a_key: not a ddp-launch key nor an Ultralytics training key"),
        (["epoch=3"], "epoch: not a ddp-launch key nor an Ultralytics training key; did you mean epochs?"),
        (["train.epoch=3"], "train.epoch: not a ddp-launch key nor an Ultralytics training key; did you mean "
                            "train.epochs?"),
    ],
)
def test_the_command_line_exits_non_zero_with_the_message(args, expected, tmp_path, cache_dir):
    r = ddp_launch(args, cwd=tmp_path, timeout=120)
    assert r.returncode != 0
    assert expected in r.stderr + r.stdout
    assert "Traceback" not in r.stderr and "+epoch" not in r.stderr  # one line, and never Hydra's `+key` advice


@pytest.mark.parametrize("override,expected", [
    ("+train.epoch=3", "train.epoch: not a ddp-launch key; did you mean train.epochs?"),
    ("+optim.base_lrr=0.1", "optim.base_lrr: not a ddp-launch key; did you mean optim.base_lr?"),
    ("+dist.nccl.debugg=INFO", "dist.nccl.debugg: not a ddp-launch key; did you mean dist.nccl.debug?"),
    ("+seeds=1", "seeds: not a ddp-launch key; did you mean seed?"),
    ("+train.extra.fliplrr=0.5", "train.extra.fliplrr: not an Ultralytics train argument; did you mean train.extra.fliplr?"),
])
def test_an_unknown_key_is_refused_naming_the_closest_one(override, expected, tmp_path, cache_dir):
    assert expected in refused([override], tmp_path)


def test_free_keys_and_every_shipped_group_option_are_known(tmp_path, cache_dir):
    from launcher.plan import checks, keys

    for overrides in (["+train.extra.mosaic=0.5"], ["launcher=slurm"], ["model=checkpoint"], ["data=coco"],
                      ["+experiment=coco"], ["data=custom"]):
        assert checks.unknown_key_problems(compose_config(overrides), keys.known_keys()) == [], overrides


# (key, value) pairs of train.extra, each refused or passed exactly as Ultralytics' own check_cfg does
EXTRA_VALUES = [("fliplr", 7), ("fliplr", 0.5), ("mosaic", -0.1), ("hsv_h", "x"), ("mixup", True), ("degrees", "9"),
                ("degrees", 45), ("max_det", 0), ("max_det", 2.0), ("single_cls", 1), ("single_cls", True),
                ("fraction", 0), ("fraction", 50), ("fraction", [0.5, 1.0]), ("scale", 1.5), ("scale", [0.5, 2.0]),
                ("copy_paste_mode", 3), ("dropout", None), ("cls", None)]


def ultralytics_refuses(key: str, value) -> bool:
    """Whether Ultralytics' own check_cfg refuses `key=value`."""
    from ultralytics.cfg import check_cfg

    try:
        check_cfg({key: value})
    except (TypeError, ValueError):
        return True
    return False


@pytest.mark.parametrize("key,value", EXTRA_VALUES)
def test_train_extra_values_are_checked_as_ultralytics_checks_them(key, value):
    from ultralytics.cfg import DEFAULT_CFG_DICT

    from launcher.plan.ultralytics_values import extra_problems

    ours = extra_problems({key: value})
    assert bool(ours) == ultralytics_refuses(key, value), (ours, DEFAULT_CFG_DICT.get(key))
    if ours:
        assert ours[0].message.startswith(f"train.extra.{key}={value!r}: ")


def test_extra_fliplr_out_of_range_is_refused_before_any_rank(tmp_path, cache_dir):
    assert "train.extra.fliplr=7: expected a number between 0.0 and 1.0" in refused(["+train.extra.fliplr=7"], tmp_path)


def test_a_checkpoint_model_without_weights_names_the_key_to_set(tmp_path, cache_dir):
    msg = refused(["model=checkpoint"], tmp_path)
    assert "model=checkpoint starts from a checkpoint: set model.weights=/path/to/best.pt" in msg and "???" not in msg


# --- the optimizer's values, as Ultralytics checks them in every rank ----------------------------------------------
@pytest.mark.parametrize("key,value", [("momentum", 2), ("momentum", 0.9), ("weight_decay", -0.1), ("lrf", 1.5),
                                       ("warmup_momentum", 0.8), ("warmup_bias_lr", 3)])
def test_optimizer_values_are_checked_as_ultralytics_checks_them(key, value):
    from launcher.plan.ultralytics_values import optimizer_problems

    ours = optimizer_problems({**compose_config()["optim"], key: value}, {"lr0": None})
    assert bool(ours) == ultralytics_refuses(key, value), ours
    if ours:
        assert ours[0].message.startswith(f"optim.{key}={value!r}: ")


def test_momentum_above_one_is_refused_before_any_folder_is_written(tmp_path, cache_dir):
    msg = refused(["optim.momentum=2"], tmp_path)
    assert "optim.momentum=2: expected a number between 0.0 and 1.0" in msg
    assert not (tmp_path / "run").exists()


def test_lr0_scaled_above_ultralytics_limit_at_a_large_planned_batch_is_refused_with_its_rule():
    """128 GPUs x 64 images: linear scaling makes lr0 1.28, which every rank's Ultralytics would refuse at its start.
    The plan says which rule made it and what to use; sqrt scaling or a cap plans it."""
    from tests.test_plan import messages, plan_for

    world = ["gpus=8", "nnodes=16", "dist.master_addr=10.0.0.1", "dist.master_port=29400", "train.batch_per_device=64",
             "optim.lr_scaling=linear"]  # the shipped rule (the demo data trains unscaled)
    plan, problems = plan_for(world)
    assert plan.global_batch == 8192 and plan.lr0 == pytest.approx(1.28)
    assert ("lr0 1.28 = base_lr 0.01 x 8192/64 by optim.lr_scaling=linear: Ultralytics refuses an lr0 above 1"
            in messages(problems))
    assert "optim.lr_scaling=sqrt (lr0 0.113 here)" in messages(problems) and "optim.lr0_cap=" in messages(problems)
    plan, problems = plan_for([*world, "optim.lr_scaling=sqrt"])
    assert not problems and plan.lr0 == pytest.approx(0.01 * 128 ** 0.5)
    plan, problems = plan_for([*world, "optim.lr0_cap=0.1"])
    assert not problems and plan.lr0 == pytest.approx(0.1)
    from launcher.plan.describe import lr0_rule

    assert lr0_rule(plan) == "0.1 = optim.lr0_cap (base_lr 0.01 x linear(8192/64) would be 1.28)"


def test_ultralytics_lr0_above_one_is_refused_on_the_command_line(tmp_path, cache_dir):
    r = ddp_launch(["lr0=5", "batch=64", "gpus=0", "optim.lr_scaling=linear"], cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and "lr0 5 = base_lr 5 x 64/64 by optim.lr_scaling=linear" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "runs").exists()

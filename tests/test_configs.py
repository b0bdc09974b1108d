"""Every shipped config composes and dry-runs: each experiment, and each option of each group."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from launcher.bench.ddp_bench import run_bench
from launcher.launch.start import start as launch
from launcher.problems import PlanError
from tests.conftest import CONF, compose_config

GROUPS = ["model", "data", "launcher"]
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.fixture()
def custom_data(tmp_path) -> Path:
    root = tmp_path / "mydata"
    for split in ("train", "val"):
        (root / "images" / split).mkdir(parents=True)
        (root / "images" / split / "a.jpg").write_bytes(b"")
    f = root / "data.yaml"
    f.write_text(yaml.safe_dump({"path": ".", "train": "images/train", "val": "images/val", "names": ["thing"]}))
    return f


def required_values(group: str, option: str, checkpoint: Path, custom_data: Path) -> list[str]:
    """Options that need a value from the user (??? in the YAML) get one that exists."""
    if (group, option) == ("model", "checkpoint"):
        return [f"model.weights={checkpoint}"]
    if (group, option) == ("model", "custom"):
        return ["model.cfg=yolo11n.yaml"]
    if (group, option) == ("data", "custom"):
        return [f"data.path={custom_data}"]
    return []


def dry_run(overrides: list[str], tmp_path: Path, capsys) -> str:
    cfg = compose_config(overrides + ["dry_run=true"])
    assert launch(cfg, tmp_path / "run", tmp_path) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_group_option_composes_and_dry_runs(group, option, tmp_path, custom_data, checkpoint, capsys, cache_dir):
    out = dry_run([f"{group}={option}", *required_values(group, option, checkpoint, custom_data)], tmp_path, capsys)
    assert "torchrun command" in out and "dry run: nothing started" in out


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_dry_runs_and_names_its_command(experiment, tmp_path, capsys, cache_dir):
    text = (CONF / "experiment" / f"{experiment}.yaml").read_text()
    assert text.startswith("# @package _global_")
    run_lines = [line for line in text.splitlines() if line.startswith(("# Run: ddp-launch ", "# Run: ddp-bench "))]
    assert run_lines, f"experiment/{experiment}.yaml does not name the command that runs it"
    assert f"+experiment={experiment}" in run_lines[0]
    if run_lines[0].startswith("# Run: ddp-bench "):  # a benchmark's experiment: its command as written, dry-run
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose("bench", overrides=[*shlex.split(run_lines[0].split(None, 3)[3]), "dry_run=true"])
        assert run_bench(OmegaConf.to_container(cfg, resolve=True), tmp_path / "run", tmp_path, run_lines[0]) == 0
        out = capsys.readouterr().out
    else:
        out = dry_run([f"+experiment={experiment}"], tmp_path, capsys)
    assert "dry run: nothing started" in out


def test_coco_on_four_gpus_dry_runs_with_four_processes_and_warns_here(tmp_path, capsys, cache_dir):
    out = dry_run(["+experiment=coco", "gpus=4"], tmp_path, capsys)
    assert "--nproc-per-node 4" in out
    assert "WARNING: gpus=4 but" in out  # this machine has no GPU: the plan is shown anyway


def test_coco_on_four_gpus_refuses_to_run_here(tmp_path, cache_dir):
    cfg = compose_config(["+experiment=coco", "gpus=4"])
    with pytest.raises(PlanError) as e:
        launch(cfg, tmp_path / "run", tmp_path)
    assert "gpus=4 but" in str(e.value)
    assert not (tmp_path / "run").exists()  # nothing was started or written

"""`--help`: the app's own help, generated from conf/: every key with its default and its comment, the groups a
user picks from (ddp-bench's group only under ddp-bench), nothing of Hydra's."""

from __future__ import annotations

import pytest

from launcher.entry import config_keys
from tests.conftest import REPO, ddp_launch

CONF = REPO / "conf"


def test_every_key_of_the_config_is_documented_by_its_comment():
    for path in (CONF / "config.yaml", CONF / "bench" / "default.yaml"):
        keys = config_keys(path)
        assert len(keys) >= 10 and not [k for k, _, comment in keys if not comment], path


def test_ddp_launch_help_lists_every_key_with_its_comment_and_only_its_groups(tmp_path):
    r = ddp_launch(["--help"], cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ddp-launch: ") and "Powered by Hydra" not in r.stdout
    for key, default, comment in config_keys(CONF / "config.yaml"):
        assert f"  {key} = {default or '...'}\n      {comment}" in r.stdout, key
    for group in ("model", "data", "launcher", "experiment"):
        assert f"\n  {group} " in r.stdout, group
    assert "yolov8s" in r.stdout and "shapes_bench" in r.stdout and "\n  bench " not in r.stdout
    assert not list(tmp_path.iterdir())  # no run folder: --help starts nothing


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_ddp_bench_help_lists_the_bench_keys(flag, tmp_path):
    r = ddp_launch([flag], cwd=tmp_path, timeout=120, tool="ddp-bench")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ddp-bench: ") and "\n  bench " in r.stdout
    assert "  bench.sizes = [1, 2, 4, 8]" in r.stdout and "ddp-launch --help lists them" in r.stdout

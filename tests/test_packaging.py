"""The configs and every module travel with the package: a non-editable wheel holds every YAML of conf/ and every
.py file of launcher/ (a package missing from pyproject.toml's list works in a checkout and fails when installed)."""

from __future__ import annotations

import subprocess
import sys
import zipfile

from tests.conftest import CONF, REPO


def test_the_wheel_ships_every_config(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(REPO)],
        check=True,
    )
    (wheel,) = tmp_path.glob("ddp_launch-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"launcher/conf/{p.relative_to(CONF).as_posix()}" for p in CONF.rglob("*.yaml")}
    assert expected and expected <= names, sorted(expected - names)
    modules = {p.relative_to(REPO).as_posix() for p in (REPO / "launcher").rglob("*.py")}
    assert modules <= names, sorted(modules - names)

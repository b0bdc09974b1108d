"""The Ultralytics releases ddp-launch runs with: the tested window is accepted at both ends, a release outside it is
refused when the plan is made with the window and the pip command, DDP_LAUNCH_ALLOW_ULTRALYTICS=1 turns that
refusal into a warning, and `ddp-env` says where the installed release stands. The installed release is faked
through the package metadata the launcher reads."""

from __future__ import annotations

import importlib.metadata
import tomllib

import pytest

from launcher.inputs import ultralytics_files
from launcher.inputs.ultralytics_files import ALLOW_VARIABLE, NEWEST_VERSION, OLDEST_VERSION, PIP_WINDOW, WINDOW
from launcher.machine.hardware import detect
from launcher.machine.environment_report import report
from tests.conftest import REPO
from tests.test_plan import GPU_BOX, plan_for

OLDEST = ultralytics_files.release(OLDEST_VERSION)
NEWEST = ultralytics_files.release(NEWEST_VERSION)
BEFORE = ".".join(map(str, (*OLDEST[:2], OLDEST[2] - 1)))  # the release before the window
AFTER = ".".join(map(str, (*NEWEST[:2], NEWEST[2] + 1)))  # the release after it


@pytest.fixture
def installed(monkeypatch):
    """installed(version): Ultralytics' package metadata says `version` (None: not installed); the switch unset."""
    monkeypatch.delenv(ALLOW_VARIABLE, raising=False)
    real = importlib.metadata.version

    def fake(version):
        def lookup(name):
            if name != "ultralytics":
                return real(name)
            if version is None:
                raise importlib.metadata.PackageNotFoundError(name)
            return version
        monkeypatch.setattr(importlib.metadata, "version", lookup)

    return fake


def ultralytics_problems(hw) -> list[str]:
    _, problems = plan_for(["gpus=1"], hw=hw)
    return [p.message for p in problems if "ultralytics" in p.message]


@pytest.mark.parametrize("version", [OLDEST_VERSION, NEWEST_VERSION])
def test_the_plan_accepts_each_end_of_the_window(installed, version):
    installed(version)
    hw = detect()
    assert hw.ultralytics_version == version and not hw.ultralytics_allowed
    assert ultralytics_problems(hw) == []


@pytest.mark.parametrize("version", [BEFORE, AFTER, "8.5.0", "8.3.253", "9.0.0", f"{AFTER}rc1", None])
def test_a_release_outside_the_window_is_refused_with_the_window_and_the_pip_command(installed, version):
    installed(version)
    (message,) = ultralytics_problems(detect())
    found = f"ultralytics {version} is installed" if version else "ultralytics is not installed"
    assert message.startswith(found) and f"is tested with {WINDOW}" in message and PIP_WINDOW in message
    assert "\n" not in message
    assert (f"{ALLOW_VARIABLE}=1" in message) == (version is not None)  # nothing to try where none is installed
    assert PIP_WINDOW == f"pip install 'ultralytics>={OLDEST_VERSION},<={NEWEST_VERSION}'"


def test_the_switch_turns_the_refusal_into_a_warning_and_reaches_the_ranks(installed, monkeypatch):
    installed(AFTER)
    monkeypatch.setenv(ALLOW_VARIABLE, "1")
    hw = detect()
    plan, problems = plan_for(["gpus=1"], hw=hw)
    assert hw.ultralytics_allowed and not [p for p in problems if "ultralytics" in p.message]
    (warning,) = [n for n in plan.notes if "ultralytics" in n]
    assert warning.startswith(f"WARNING: ultralytics {AFTER} is outside the tested window {WINDOW}")
    assert "may have moved" in warning and f"scripts/try-ultralytics.sh {AFTER}" in warning
    assert plan.env[ALLOW_VARIABLE] == "1"  # the ranks' own check of the release lets it through too
    monkeypatch.setenv(ALLOW_VARIABLE, "0")  # 0 is off
    assert ultralytics_problems(detect())


def test_a_release_inside_the_window_gets_no_warning_with_the_switch_set(monkeypatch):
    monkeypatch.setenv(ALLOW_VARIABLE, "1")
    plan, _ = plan_for(["gpus=1"], hw=GPU_BOX)
    assert not [n for n in plan.notes if "ultralytics" in n]


@pytest.mark.parametrize("version,switch,expected", [
    (NEWEST_VERSION, None, f"inside the tested window {WINDOW}"),
    (AFTER, None, f"outside the tested window {WINDOW}: a run is refused ({PIP_WINDOW}, or {ALLOW_VARIABLE}=1"),
    (AFTER, "1", f"outside the tested window {WINDOW}: tried anyway ({ALLOW_VARIABLE}=1)"),
])
def test_ddp_env_shows_the_release_and_whether_it_is_inside_the_window(installed, monkeypatch, version, switch,
                                                                       expected):
    installed(version)
    if switch:
        monkeypatch.setenv(ALLOW_VARIABLE, switch)
    line = next(x for x in report(GPU_BOX, with_torch=False).splitlines() if x.strip().startswith("ultralytics "))
    assert line.split()[1] == version and expected in line


def test_pyproject_declares_the_window_the_launcher_checks():
    """`pip install .` keeps a release of the window that the environment already holds."""
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"ultralytics>={OLDEST_VERSION},<={NEWEST_VERSION}" in deps


def test_ci_tries_the_ends_of_the_window_after_the_suite():
    ci = (REPO / ".ci" / "run").read_text()
    tail = ci[ci.index("&& pytest\n"):]
    assert "OLDEST_VERSION" in tail and "NEWEST_VERSION" in tail
    assert 'DDP_LAUNCH_ALLOW_ULTRALYTICS=0 scripts/try-ultralytics.sh "$end" --train' in tail


def test_a_broken_reach_is_named_by_the_test_that_failed():
    from tests.ultralytics_release_check import broken_reaches

    said = broken_reaches([
        "tests/test_ultralytics_reaches.py::test_each_reach_is_in_the_installed_release[loss.py: "
        "ultralytics.utils.loss.BboxLoss.forward]",
        "tests/test_checkpointer.py::test_ultralytics_layout_saves_the_ema_in_fp16_as_it_was_at_each_save",
        "tests/test_ultralytics_reaches.py::test_a_loader_forks_its_workers_at_its_first_iteration",
    ])
    assert list(said) == ["launcher/rank/ultralytics/loss.py", "launcher/rank/ultralytics/checkpoint.py",
                          "launcher/rank/ultralytics/datasets.py"]

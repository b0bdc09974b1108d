"""`python -m tests.ultralytics_release_check [pytest args]`: the reach tests and each reach's behaviour tests against
the Ultralytics on the path, then one line per reach that broke (scripts/try-ultralytics.sh, .ci/run).

Exit status: pytest's (0 when every test passed).
"""

from __future__ import annotations

import importlib.metadata
import sys

import pytest

from tests.test_ultralytics_reaches import BEHAVIOUR, REACHES

REACH_TESTS = "tests/test_ultralytics_reaches.py"
SELECTION = "not slow and not dist and not gpu"  # the unit tiers: a minute or two on two cores


class Failures:
    """A pytest plugin that keeps the node ids of the tests that failed."""

    def __init__(self) -> None:
        self.nodeids: list[str] = []

    def pytest_runtest_logreport(self, report) -> None:
        if report.failed and report.nodeid not in self.nodeids:
            self.nodeids.append(report.nodeid)


def where(reach: str) -> str:
    return f"launcher/rank/ultralytics/{reach}" if reach in REACHES else f"launcher/{reach}"


def broken_reaches(nodeids: list[str]) -> dict[str, list[str]]:
    """{the reaches a failed test checks, in words: its failed tests}. A reach test names its reach in its id; another
    test names the reaches whose BEHAVIOUR entry holds it (a test file shared by several reaches names each)."""
    broken: dict[str, list[str]] = {}
    for nodeid in nodeids:
        path, _, name = nodeid.partition("::")
        if path == REACH_TESTS and name.startswith("test_each_reach_is_in_the_installed_release["):
            reaches = [name.split("[", 1)[1].split(":", 1)[0]]
        else:
            reaches = [r for r, tests in BEHAVIOUR.items() if any(nodeid.startswith(t) for t in tests)]
        key = " or ".join(map(where, reaches)) or f"{nodeid} (a test no reach claims)"
        broken.setdefault(key, []).append(nodeid)
    return broken


def main(argv: list[str]) -> int:
    tests = sorted({REACH_TESTS, *(t for group in BEHAVIOUR.values() for t in group if not t.startswith(REACH_TESTS))})
    failures = Failures()
    code = int(pytest.main(["-q", "-p", "no:cacheprovider", "-m", SELECTION, *tests, *argv], plugins=[failures]))
    version = importlib.metadata.version("ultralytics")
    if code == 0:
        print(f"ultralytics {version}: every reach of rank/ultralytics/ behaves as the adapter expects")
    for reaches, nodeids in broken_reaches(failures.nodeids).items():
        print(f"ultralytics {version}: broke {reaches}: {len(nodeids)} test(s) failed, first {nodeids[0]}")
    if code and not failures.nodeids:
        print(f"ultralytics {version}: the tests did not run (pytest exit status {code}): see above")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

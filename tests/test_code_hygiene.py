"""The code speaks of itself: no dates, issue numbers, card figures or accounts of past work in launcher/'s comments
and docstrings (history lives in commit messages, measured figures in docs/benchmarks/); no module past 400 lines;
no two modules with the same file name, so a name found in a traceback or a grep is one file."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections import defaultdict
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "launcher"
MODULES = sorted(PACKAGE.rglob("*.py"))
MOST_LINES = 400

MONTH = (r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?|Sep(?:t(?:ember)?)?|"
         r"Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)")
# A date, except as the day folder of a run's path (runs/2026-12-01/09-47-14-...): that is the layout a user sees.
DATE = re.compile(rf"\b20\d\d-\d\d-\d\d\b(?!/)|\b{MONTH}\.? (?:\d{{1,2}}, )?20\d\d\b|\b\d{{1,2}} {MONTH} 20\d\d\b")
ISSUE = re.compile(r"\b(?:issues?|PR|pull request)\s*#?\d+|(?<![\w&/])#\d+\b", re.IGNORECASE)
CARD = re.compile(r"\b(?:[AHB]100|[GH]?H200|B200|A10G|L40S?|V100)\b")
# Words that tell the code's past rather than what it does; "earlier"/"later" for an order at run time are fine.
HISTORY = re.compile(
    r"\b(?:(?<!is )(?<!are )(?<!be )(?<!been )(?<!being )(?<!gets )(?<!get )used to"
    r"|previously|formerly|no longer (?:does|do|needs?|is|are|has|have|reads?|writes?|uses?|calls?)"
    r"|rounds? of work|\d+ rounds? of|(?:\w+th|first|second|third|\d+(?:st|nd|rd|th)?|earlier|previous|last) "
    r"sessions?|sessions? \d+|(?:earlier|previous|last|first|second|third) round"
    r"|earlier (?:version|commit|change|design|code|rounds?|fix|profile|release of ddp-launch)"
    r"|(?:was|were|has been|have been) (?:renamed|moved|removed|rewritten|replaced|fixed|changed)"
    r"|(?:fixed|changed|added|removed) (?:on|in) (?:commit|20\d\d)|as of (?:commit|20\d\d))",
    re.IGNORECASE)


def prose(path: Path) -> list[tuple[int, str]]:
    """Each comment and each docstring of `path`, with the line it starts on."""
    text = path.read_text()
    found = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(text).readline)
             if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                found.append((body[0].lineno, body[0].value.value))
    return found


def offences(pattern: re.Pattern, whole_text: bool = False) -> list[str]:
    out = []
    for path in MODULES:
        where = path.relative_to(REPO)
        chunks = list(enumerate(path.read_text().splitlines(), 1)) if whole_text else prose(path)
        for line, chunk in chunks:
            # one reading of a comment: a docstring's line breaks join its sentences
            for m in pattern.finditer(" ".join(chunk.split())):
                out.append(f"{where}:{line}: {m.group(0)!r}")
    return out


def test_no_dates_in_the_code():
    found = offences(DATE, whole_text=True)
    assert not found, "dates belong in commit messages and docs/benchmarks/:\n" + "\n".join(found)


def test_no_issue_numbers_in_the_code():
    found = offences(ISSUE)
    assert not found, "say what the code does, not which issue asked for it:\n" + "\n".join(found)


def test_no_graphics_cards_named_in_the_code():
    found = offences(CARD, whole_text=True)
    assert not found, ("measured figures belong in docs/benchmarks/ (link a section from the code):\n"
                       + "\n".join(found))


def test_no_account_of_past_work_in_comments():
    found = offences(HISTORY)
    assert not found, "comments say what the code does and why, not what it used to do:\n" + "\n".join(found)


def test_no_module_past_the_line_limit():
    long = {str(p.relative_to(REPO)): n for p in MODULES if (n := len(p.read_text().splitlines())) > MOST_LINES}
    assert not long, f"split these by job (at most {MOST_LINES} lines a module): {long}"


def test_no_two_modules_share_a_file_name():
    where = defaultdict(list)
    for path in MODULES:
        if path.name != "__init__.py":
            where[path.name].append(str(path.relative_to(REPO)))
    shared = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not shared, f"give each a name that says what it holds: {shared}"


def test_the_scans_find_what_they_look_for():
    """Each pattern catches the kind of line it is for, and passes a neighbour that is not one."""
    assert DATE.search("fixed 2026-12-01") and DATE.search("in December 2026") and DATE.search("on 3 Dec 2026")
    assert not DATE.search("runs/2026-12-01/09-47-14-448583")
    assert ISSUE.search("issue 14's fast start") and ISSUE.search("see #12") and ISSUE.search("Issue #7")
    assert not ISSUE.search('"#1f77b4"') and not ISSUE.search("&#39;")
    assert CARD.search("on the H200") and CARD.search("an H100's") and not CARD.search("H2000")
    for past in ("the host used to go through it", "the seventh session's profile", "6 rounds of the four",
                 "previously read twice", "an earlier round of work", "was renamed to"):
        assert HISTORY.search(past), past
    for present in ("the value is used to pick a batch", "the earlier tiles' survivors",
                    "builders that are no longer running", "cannot be used to start from", "a session of its own",
                    "the ssh session", "this round's matches"):
        assert not HISTORY.search(present), present

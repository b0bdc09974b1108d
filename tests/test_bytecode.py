"""The ranks' bytecode compiled ahead, beside torchrun's start (launch/startup/bytecode.py): what an import then reads, once
per machine, and for the packages a rank really imports."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from launcher.launch.startup import bytecode
from launcher.launch.environments.local import LocalEnvironment
from launcher.launch.startup.warm_torchrun import startup_environment
from launcher.machine.hardware import Hardware
from launcher.plan.plan import make_plan
from tests.conftest import compose_config


def _write_keeping_time(path: Path, text: str) -> None:
    """New contents of the same size, with the old modification time: an import that reads the compiled file
    cannot tell, and runs the old code; one that compiles the source runs the new."""
    st = path.stat()
    assert len(text) == st.st_size
    path.write_text(text)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _cached(source: Path, folder: Path, monkeypatch) -> Path:
    with monkeypatch.context() as m:
        m.setattr(sys, "pycache_prefix", str(folder))
        return Path(importlib.util.cache_from_source(str(source)))


def test_bytecode_compiled_ahead_is_what_a_fresh_interpreter_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "src" / "aheadpkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("VALUE = 1\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "mod.py").write_text("VALUE = 'a'\n")
    (pkg / "broken.py").write_text("def (:\n")  # a template, another Python's syntax: counted, not fatal
    folder = tmp_path / "bytecode"
    monkeypatch.setattr(sys, "pycache_prefix", str(folder))
    assert bytecode.compile_ahead(folder, workers=1, roots=[pkg]) == 1
    monkeypatch.undo()
    assert not bytecode.pending(folder, [pkg])

    _write_keeping_time(pkg / "__init__.py", "VALUE = 2\n")
    _write_keeping_time(pkg / "sub" / "mod.py", "VALUE = 'b'\n")
    env = {**os.environ, "PYTHONPYCACHEPREFIX": str(folder), "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONPATH": str(tmp_path / "src")}
    code = "import aheadpkg, aheadpkg.sub.mod as m; print(aheadpkg.VALUE, m.VALUE)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["1", "a"]  # the compiled files, not the sources

    (pkg / "__init__.py").write_text("VALUE = 3\n")  # the package installed again: compiled again at the next launch
    assert bytecode.pending(folder, [pkg])


def test_the_imports_are_compiled_in_the_order_an_interpreter_reaches_them_and_then_everything_else(tmp_path):
    files = {
        "lib/json/__init__.py": "",  # a standard library of its own
        "lib/json/decoder.py": "",
        "lib/textwrap.py": "",
        "app/__init__.py": "import app.core\nfrom . import util, missing_attr\nfrom .sub.leaf import thing  # a note\n",
        "app/core.py": "import json, textwrap as tw\n\ndef later():\n    import app.late\n",
        "app/util.py": "from .sub import (\n    leaf2,\n)\n",
        "app/sub/__init__.py": "from .. import core\n",
        "app/sub/leaf.py": "",
        "app/sub/leaf2.py": "",
        "app/late.py": "",
        "app/unused.py": "",
        "other.py": "import app.unused\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    roots = [tmp_path / "lib", tmp_path / "app", tmp_path / "other.py"]
    order = [str(p.relative_to(tmp_path)) for p in bytecode.import_order(("app",), roots, stdlib=tmp_path / "lib")]
    assert order[:7] == ["app/__init__.py", "app/core.py", "lib/json/__init__.py", "lib/textwrap.py", "app/util.py",
                         "app/sub/__init__.py", "app/sub/leaf.py"]
    # then the rest, each once: what only a function, or a line the statement continues on, imports; what nothing does
    assert sorted(order[7:]) == sorted(["lib/json/decoder.py", "app/late.py", "app/unused.py", "app/sub/leaf2.py",
                                        "other.py"])


def test_compiling_ahead_refuses_a_folder_the_interpreter_would_not_read(tmp_path):
    out = subprocess.run([sys.executable, "-m", "launcher.launch.startup.bytecode", str(tmp_path / "x")],
                         env={**os.environ, "PYTHONPYCACHEPREFIX": str(tmp_path / "y")}, capture_output=True, text=True)
    assert out.returncode != 0 and "PYTHONPYCACHEPREFIX=" in out.stderr
    assert not (tmp_path / "x" / bytecode.STAMP).exists() and not (tmp_path / "y" / bytecode.STAMP).exists()


def test_a_launch_compiles_the_ranks_bytecode_in_the_cache_once_per_machine(tmp_path, monkeypatch):
    bare = Hardware(gpus=(), cpu_count=3, bytecode_kept=False)  # an install without bytecode, as on the H200 machine
    plan, problems = make_plan(compose_config(["gpus=0", f"paths.cache={tmp_path}"]), bare)
    assert not problems
    folder = Path(plan.env["PYTHONPYCACHEPREFIX"])
    first = LocalEnvironment()
    first._compile_bytecode(plan)
    assert first._compiling is not None and first._compiling.wait(timeout=300) == 0
    for module in ("torch", "ultralytics", "launcher.rank.run.runs", "json"):
        assert _cached(Path(importlib.util.find_spec(module).origin), folder, monkeypatch).is_file(), module
    again = LocalEnvironment()
    again._compile_bytecode(plan)
    assert again._compiling is None  # compiled already, for this interpreter and these installs

    kept, _ = make_plan(compose_config(["gpus=0", f"paths.cache={tmp_path / 'other'}"]), Hardware(cpu_count=3))
    assert "PYTHONPYCACHEPREFIX" not in kept.env
    untouched = LocalEnvironment()
    untouched._compile_bytecode(kept)
    assert untouched._compiling is None and not (tmp_path / "other" / "bytecode").exists()


def test_the_compilation_started_beside_the_warm_torchrun_is_the_one_the_launch_reports(tmp_path, monkeypatch):
    """ddp-launch starts compiling before Hydra composes, into the folder it guesses (as for the warm torchrun's
    PYTHON* variables); once the plan names the same folder, the launch reports that compilation and starts none."""
    monkeypatch.setattr("launcher.machine.hardware.bytecode_kept", lambda: False)  # the H200 machine's install
    guessed = startup_environment([f"paths.cache={tmp_path}"])
    plan, _ = make_plan(compose_config(["gpus=0", f"paths.cache={tmp_path}"]),
                        Hardware(gpus=(), cpu_count=3, bytecode_kept=False))
    assert guessed["PYTHONPYCACHEPREFIX"] == plan.env["PYTHONPYCACHEPREFIX"]
    early, line = bytecode.start_for(guessed, 3)
    try:
        launch = LocalEnvironment()
        launch._compile_bytecode(plan)
        assert launch._compiling is early and "compiling the ranks' bytecode" in line
        # a plan that names another folder (the guess was wrong): the early compilation stops, the plan's starts
        other, _ = bytecode.start_for({"PYTHONPYCACHEPREFIX": str(tmp_path / "planned")}, 3)
        assert early.wait(timeout=30) == -signal.SIGTERM and other.poll() is None
    finally:
        for proc in bytecode._compiling.values():
            proc.kill()
            proc.wait()


def test_the_packages_compiled_ahead_hold_what_torchrun_and_a_rank_import():
    listing = subprocess.run(
        [sys.executable, "-c",
         "import json, sys, torch.distributed.run, launcher.rank.worker, launcher.rank.run.runs, torch._dynamo\n"
         "import omegaconf, matplotlib.pyplot  # the rank's config read (RunFolder.load), the plots\n"
         "print(json.dumps(sorted({m.__file__ for m in list(sys.modules.values())\n"
         "                         if (getattr(m, '__file__', None) or '').endswith('.py')})))"],
        capture_output=True, text=True, check=True).stdout
    imported = [Path(f) for f in json.loads(listing)]
    roots = [r.resolve() for r in bytecode.source_roots()]
    left_out = [f for f in imported if not any(f.resolve().is_relative_to(r) for r in roots)]
    assert len(imported) > 1000
    assert len(left_out) <= 0.01 * len(imported), left_out

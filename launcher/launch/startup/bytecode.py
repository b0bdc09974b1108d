"""The ranks' bytecode compiled ahead of them, in parallel, while torchrun starts (paths.bytecode).

Where torch's install holds no compiled bytecode and none is written beside it (a read-only image, an environment
built without it), the ranks and torchrun keep theirs in a folder of the cache (plan/environment.py). The first run on
a machine still compiles from source every module they import, one after the other on the start-up's critical path:
torch and the standard library in torchrun's interpreter, then Ultralytics in the rank's, then torch._dynamo, which
the optimizer's first call imports. Thousands of modules, seconds each time.

`start_ahead` starts a process that compiles, in a pool of niced workers, the packages those interpreters import
(RANK_PACKAGES, and the standard library) into that folder, right before torchrun starts: their imports then find
bytecode already there. The files go in the order the imports reach them (import_order: a crawl of the modules'
top-level import statements from ENTRIES), then the rest: where cores are few, the pool keeps ahead of the imports
only that way. A module an import reaches first is compiled by the importer, as Python does; both write the file
atomically, so either copy is whole. Once every package is compiled, a stamp records them (where each is installed,
when), and the launches after it start nothing. docs/benchmarks/cpu-fresh-start/ has what it saves.

`PYTHONPYCACHEPREFIX=FOLDER python -m launcher.launch.startup.bytecode FOLDER [WORKERS]` runs the compilation in the
foreground.
"""

from __future__ import annotations

import compileall
import importlib.util
import json
import multiprocessing
import os
import py_compile
import re
import signal
import subprocess
import sys
import sysconfig
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Iterator

from launcher.launch.startup.parent_death import parent_death_signal

# The top-level packages whose modules torchrun and a rank import (what the crawl does not reach follows in this
# order). tests/test_bytecode.py checks that, with the standard library, they hold nearly all of them.
# The rank reads its config with omegaconf (antlr4); Ultralytics imports matplotlib (pyparsing, dateutil, ...), and
# its plots at a run's end polars; torchvision's code runs on the CPU only (rank/data/torchvision_ops.py).
RANK_PACKAGES = ("torch", "numpy", "typing_extensions", "sympy", "mpmath", "launcher", "omegaconf", "antlr4", "yaml",
                 "ultralytics", "triton", "cuda", "PIL", "cv2", "tqdm", "psutil", "pynvml", "torchgen", "torchvision",
                 "matplotlib", "pyparsing", "dateutil", "kiwisolver", "cycler", "packaging", "fontTools",
                 "mpl_toolkits", "polars")
# Standard-library folders no rank imports (tests, GUIs, tools); their files would only cost time.
STDLIB_SKIPPED = {"site-packages", "dist-packages", "test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3",
                  "ensurepip", "__pycache__", "__phello__"}
# What torchrun and a rank import, in that order (the warm torchrun: torchrun, then Dynamo and the rank's module for
# the ranks it forks, rank_fork.py; the rank: omegaconf to read its config, its run): their imports are compiled
# first, in the order they are reached.
ENTRIES = ("torch.distributed.run", "torch._dynamo", "launcher.rank.worker", "omegaconf", "launcher.rank.run.runs")
STDLIB = Path(sysconfig.get_paths()["stdlib"])
STAMP = "compiled-ahead.json"
NICE = 10  # below torchrun's and the ranks' own imports, which are on the critical path


def source_roots(packages: tuple[str, ...] = RANK_PACKAGES) -> list[Path]:
    """Where each installed package's source lies (a package's folders, or a module's file), found without importing
    it; the standard library first. Packages that are not installed are left out."""
    roots = [STDLIB]
    for name in packages:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is None:
            continue
        if spec.submodule_search_locations:
            roots += [Path(p) for p in spec.submodule_search_locations]
        elif spec.origin and spec.origin.endswith(".py"):
            roots.append(Path(spec.origin))
    return roots


def sources(root: Path) -> list[Path]:
    """The .py files under `root` (the standard library's without its tests and GUIs), shallow ones first."""
    if root.is_file():
        return [root]
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in STDLIB_SKIPPED and not d.startswith("."))
        found += [Path(folder) / f for f in files if f.endswith(".py")]
    return sorted(found, key=lambda p: (len(p.parts), str(p)))


def import_order(entries: tuple[str, ...], roots: list[Path], stdlib: Path | None = STDLIB) -> Iterator[Path]:
    """The sources that importing `entries` runs, in the order an interpreter first reaches them, as far as their
    modules' top-level import statements tell (absolute, relative, `from package import submodule`; not those inside
    a function, a try or an if), then every other source of `roots`, each once. Only the order is a guess: every
    source is in it. `roots` as source_roots() gives them; modules found elsewhere are left out."""
    packages = {r.stem if r.is_file() else r.name: r for r in roots if r != stdlib}
    seen_modules: set[str] = set()
    seen: set[Path] = set()

    def file_of(module: str) -> Path | None:
        top, *rest = module.split(".")
        base = packages.get(top)
        if base is None and stdlib is not None and stdlib in roots:
            base = stdlib / top if rest or not (stdlib / f"{top}.py").is_file() else stdlib / f"{top}.py"
        if base is None or (base.is_file() and rest):
            return None
        if base.is_file():
            return base
        path = base.joinpath(*rest)
        for candidate in ((path.parent / f"{path.name}.py") if rest else None, path / "__init__.py"):
            if candidate is not None and candidate.is_file():
                return candidate
        return None

    def visit(module: str) -> Iterator[Path]:
        parts = module.split(".")
        for i in range(1, len(parts) + 1):  # `import a.b.c` runs a, then a.b, then a.b.c
            name = ".".join(parts[:i])
            if name in seen_modules:
                continue
            seen_modules.add(name)
            path = file_of(name)
            if path is None:
                return
            seen.add(path)
            yield path
            for imported in _imports(path, name):
                yield from visit(imported)

    for entry in entries:
        yield from visit(entry)
    for root in roots:
        yield from (f for f in sources(root) if f not in seen)


_FROM = re.compile(r"from\s+(\.*)([\w.]*)\s+import\s+\(?([^#\\]*)")


def _imports(path: Path, module: str) -> list[str]:
    """The modules named by `path`'s import statements at its top level (module `module`), in their order."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[str] = []
    for line in text.splitlines():
        if line.startswith("import "):
            found += [part.split()[0] for part in line[7:].split("#")[0].split(",") if part.split()]
        elif line.startswith("from "):
            m = _FROM.match(line)
            if m is None:
                continue
            dots, name, names = m.groups()
            if dots:  # relative: one dot is this package, each further dot one package up
                base = package.split(".")[: len(package.split(".")) - (len(dots) - 1)] if package else []
                if not base:
                    continue
                name = ".".join(base + ([name] if name else []))
            if name:
                found.append(name)
                found += [f"{name}.{n.split()[0]}" for n in names.split(",")  # a submodule, if it is one
                          if n.split() and n.split()[0].isidentifier()]
    return found


def stamp_of(roots: list[Path]) -> dict:
    """What the compiled bytecode was compiled from: this interpreter's version, and each root with its modification
    time (a package installed again, or upgraded, has another)."""
    def mtime(p: Path) -> int:
        marker = p if p.is_file() else p / "__init__.py"
        try:
            return (marker if marker.exists() else p).stat().st_mtime_ns
        except OSError:
            return 0

    return {"python": sys.version, "roots": {str(p): mtime(p) for p in roots}}


def pending(folder: Path, roots: list[Path] | None = None) -> bool:
    """Whether `folder` lacks the bytecode of these roots, as compiled by this interpreter (the stamp is missing or
    names something else)."""
    try:
        stamp = json.loads((Path(folder) / STAMP).read_text())
    except (OSError, ValueError):
        return True
    return stamp != stamp_of(source_roots() if roots is None else roots)


def workers_for(cpus: int) -> int:
    """Every core but one: the one torchrun's import runs on (the pool is niced below it anyway)."""
    return max(1, min(cpus - 1, 32))


_compiling: dict[Path, subprocess.Popen] = {}  # this launcher's compilations, by folder


def start_ahead(folder: Path, cpus: int, preexec_fn=None) -> subprocess.Popen | None:
    """Start compiling into `folder` (PYTHONPYCACHEPREFIX) in the background; the compilation this launcher started
    earlier into the same folder while it still runs (ddp-launch starts it beside the warm torchrun, before the plan;
    one into another folder is stopped); None when the folder's bytecode is there already. Nothing waits for it: the
    imports use what is there."""
    folder = Path(folder).absolute()
    running = _compiling.get(folder)
    if running is not None and running.poll() is None:
        return running
    for other, proc in _compiling.items():
        if other != folder and proc.poll() is None:
            proc.terminate()  # into a folder the plan did not confirm (cli.start_ahead's guess): its cores go here
    if not pending(folder):
        return None
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPYCACHEPREFIX": str(folder)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    _compiling[folder] = subprocess.Popen(
        [sys.executable, "-m", __name__, str(folder), str(workers_for(cpus))], env=env, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, preexec_fn=preexec_fn)
    return _compiling[folder]


def start_for(env: dict[str, str], cpus: int, preexec_fn=None) -> tuple[subprocess.Popen, str] | None:
    """start_ahead into the folder a plan's environment gives the ranks (PYTHONPYCACHEPREFIX, paths.bytecode), with
    the line that says so; None where it gives none or the folder is compiled already. On each node that starts
    torchrun: a local launch, each node of a SLURM job."""
    folder = env.get("PYTHONPYCACHEPREFIX")
    proc = start_ahead(Path(folder), cpus, preexec_fn) if folder else None
    if proc is None:
        return None
    return proc, (f"compiling the ranks' bytecode into {folder} beside their start, in {workers_for(cpus)} "
                  "process(es): once per machine")


def _compile(path: str) -> bool:
    # timestamp-checked, as an import writes it; an up-to-date file is left as it is
    return bool(compileall.compile_file(path, quiet=2, invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP))


def compile_ahead(folder: Path, workers: int, roots: list[Path] | None = None,
                  entries: tuple[str, ...] = ENTRIES) -> int:
    """Compile every source of `roots` (source_roots()) into `folder`, which must be this interpreter's
    PYTHONPYCACHEPREFIX, those `entries` import first (import_order); stamp it when done. Returns how many sources
    failed (files no interpreter can import: templates, other Pythons' syntax)."""
    if sys.pycache_prefix is None or Path(sys.pycache_prefix).resolve() != Path(folder).resolve():
        raise SystemExit(f"{__name__}: start it with PYTHONPYCACHEPREFIX={folder}, where the ranks will look")
    roots = source_roots() if roots is None else roots
    ordered = (str(f) for f in import_order(entries, roots))
    if workers > 1:  # each file handed out as the crawl reaches it: the workers start at once, in import order
        # a worker stops when this process does, however it stops (the launcher's own parent-death request)
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                                 initializer=parent_death_signal(signal.SIGKILL)) as pool:
            failed = sum(not f.result() for f in [pool.submit(_compile, f) for f in ordered])
    else:
        failed = sum(not _compile(f) for f in ordered)
    stamp = Path(folder) / STAMP
    partial = stamp.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(stamp_of(roots), indent=1))
    partial.replace(stamp)
    return failed


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        print("usage: PYTHONPYCACHEPREFIX=FOLDER python -m launcher.launch.startup.bytecode FOLDER [WORKERS]",
              file=sys.stderr)
        return 2
    try:
        os.nice(NICE)
    except OSError:
        pass
    workers = int(argv[1]) if len(argv) == 2 else workers_for(len(os.sched_getaffinity(0)))
    compile_ahead(Path(argv[0]), workers)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

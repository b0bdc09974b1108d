"""The ranks' bytecode compiled ahead of them, in parallel, while torchrun starts (paths.bytecode).

Where torch's install holds no compiled bytecode and none is written beside it (a read-only image, an environment
built without it), the ranks and torchrun keep theirs in a folder of the cache (plan/environment.py). The first run on
a machine still compiles from source every module they import, one after the other on the start-up's critical path:
torch and the standard library in torchrun's interpreter, then Ultralytics in the rank's, then torch._dynamo, which
the optimizer's first call imports. Thousands of modules, seconds each time.

`start_ahead` starts a process that compiles, in a pool of niced workers, the packages those interpreters import
(RANK_PACKAGES, and the standard library) into that folder, right before torchrun starts: their imports then find
bytecode already there. A module an import reaches first is compiled by the importer, as before; both write the
file atomically, so either copy is whole. Once every package is compiled, a stamp records them (where each is
installed, when), and the launches after it start nothing.

`python -m launcher.launch.bytecode FOLDER [WORKERS]` runs the compilation in the foreground (an image's build step).
"""

from __future__ import annotations

import compileall
import ctypes
import importlib.util
import json
import multiprocessing
import os
import signal
import py_compile
import subprocess
import sys
import sysconfig
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

# The top-level packages whose modules torchrun and a rank import, in the order they first need them (torch's at
# torchrun's start). tests/test_bytecode.py checks that, with the standard library, they hold nearly all of them.
# The plots at a run's end import matplotlib; torchvision's code runs on the CPU only (rank/data/torchvision_ops.py).
RANK_PACKAGES = ("torch", "numpy", "typing_extensions", "sympy", "mpmath", "launcher", "ultralytics", "triton",
                 "cuda", "yaml", "PIL", "cv2", "tqdm", "psutil", "pynvml", "torchgen", "torchvision", "matplotlib")
# Standard-library folders no rank imports (tests, GUIs, tools); their files would only cost time.
STDLIB_SKIPPED = {"site-packages", "dist-packages", "test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3",
                  "ensurepip", "__pycache__", "__phello__"}
STAMP = "compiled-ahead.json"
NICE = 10  # below torchrun's and the ranks' own imports, which are on the critical path


def source_roots(packages: tuple[str, ...] = RANK_PACKAGES) -> list[Path]:
    """Where each installed package's source lies (a package's folders, or a module's file), found without importing
    it; the standard library first. Packages that are not installed are left out."""
    roots = [Path(sysconfig.get_paths()["stdlib"])]
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
    """The .py files under `root`, shallow ones first (a package's first imports are mostly near its top)."""
    if root.is_file():
        return [root]
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in STDLIB_SKIPPED and not d.startswith("."))
        found += [Path(folder) / f for f in files if f.endswith(".py")]
    return sorted(found, key=lambda p: (len(p.parts), str(p)))


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


def start_ahead(folder: Path, cpus: int, preexec_fn=None) -> subprocess.Popen | None:
    """Start compiling into `folder` (PYTHONPYCACHEPREFIX) in the background; None when its bytecode is there
    already. The launcher does not wait for it: the imports use whatever is compiled when they get there."""
    folder = Path(folder)
    if not pending(folder):
        return None
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPYCACHEPREFIX": str(folder)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return subprocess.Popen([sys.executable, "-m", __name__, str(folder), str(workers_for(cpus))], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, preexec_fn=preexec_fn)


def _die_with_parent() -> None:
    """A pool worker stops when the compiling process does, however it stops (Linux prctl; elsewhere it finishes)."""
    try:
        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _compile(path: str) -> bool:
    # timestamp-checked, as an import writes it; an up-to-date file is left as it is
    return bool(compileall.compile_file(path, quiet=2, invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP))


def compile_ahead(folder: Path, workers: int, roots: list[Path] | None = None) -> int:
    """Compile every source of `roots` (source_roots()) into `folder`, which must be this interpreter's
    PYTHONPYCACHEPREFIX; stamp it when done. Returns how many sources failed (files no interpreter can import:
    templates, other Pythons' syntax)."""
    if sys.pycache_prefix is None or Path(sys.pycache_prefix).resolve() != Path(folder).resolve():
        raise SystemExit(f"{__name__}: start it with PYTHONPYCACHEPREFIX={folder}, where the ranks will look")
    roots = source_roots() if roots is None else roots
    files = [str(f) for root in roots for f in sources(root)]
    if workers > 1:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                                 initializer=_die_with_parent) as pool:
            failed = sum(not ok for ok in pool.map(_compile, files, chunksize=16))
    else:
        failed = sum(not _compile(f) for f in files)
    stamp = Path(folder) / STAMP
    partial = stamp.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps(stamp_of(roots), indent=1))
    partial.replace(stamp)
    return failed


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        print("usage: PYTHONPYCACHEPREFIX=FOLDER python -m launcher.launch.bytecode FOLDER [WORKERS]", file=sys.stderr)
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

"""The tree is the architecture (docs/how-it-works.md, "Architecture"): each room imports only what lies beneath it,
there is no import cycle, one package talks to Ultralytics, and the launcher process never loads it."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.inputs.ultralytics_files import ALLOW_VARIABLE, WINDOW
from tests.conftest import REPO

PACKAGE = REPO / "launcher"
# Rooms by layer, bottom first. A module may import its own room and the rooms of lower layers; rooms of one layer
# (launch and rank, cli and bench) never import each other.
LAYERS = [
    {"problems"},
    {"inputs"},
    {"machine"},  # it reads the installed Ultralytics release through inputs/
    {"plan"},
    {"run_folder"},
    {"launch", "rank"},
    {"entry"},
    {"cli", "bench", "env"},
    {"api"},  # the Python API calls what both console scripts do
]
LAYER = {room: i for i, rooms in enumerate(LAYERS) for room in rooms}
NO_TORCH = {"problems", "inputs", "plan"}  # pure: planning runs before anything heavy is imported
# The floors inside rank/, bottom first, checked as the layers are: a room imports its own floor's modules only from
# itself, and the rooms of lower floors.
RANK_FLOORS = [
    {"kernels"},  # Triton kernels and their PyTorch twins: nothing else of the rank
    {"group", "loop"},  # this rank among the others; the loop, its hook protocol, its state and checkpoint files
    {"data", "validate", "metrics"},  # the host's input pipeline, validation at inference speed, what a rank measures
    {"gpu_data"},  # the GPU input: the loader's batches decoded and augmented on the device
    {"ultralytics"},  # the one package that talks to Ultralytics (its hooks and validators stand on the loop)
    {"step"},  # the training step, over Ultralytics' network and loss
    {"build_steps", "startup"},  # the composition's build steps; the rank's side of the start-up overlap
    {"components"},  # what a rank builds, in order
    {"run"},  # a training run or a bench cell: the hook lists over the components
    {"worker"},  # the entry
]
RANK_FLOOR = {room: i for i, rooms in enumerate(RANK_FLOORS) for room in rooms}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolve(module: str) -> str:
    """The launcher module an import names: a submodule when it is one, else the package."""
    path = REPO.joinpath(*module.split("."))
    return module if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file() else module.rsplit(".", 1)[0]


def imports(path: Path) -> list[str]:
    """Every module `path` imports, at the top or inside functions (a lazy import is still a dependency)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [resolve(f"{node.module}.{a.name}") if node.module.startswith("launcher") else node.module
                      for a in node.names]
    return found


MODULES = {module_name(p): imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def room(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "launcher"


def test_each_room_imports_only_what_lies_beneath_it():
    wrong = []
    for module, deps in MODULES.items():
        if module == "launcher":
            continue
        for dep in (d for d in deps if d.startswith("launcher.")):
            mine, theirs = room(module), room(dep)
            if mine == theirs:
                continue
            if LAYER[theirs] >= LAYER[mine]:
                wrong.append(f"{module} imports {dep} ({theirs} is not beneath {mine})")
    assert not wrong, "\n".join(wrong)


def rank_room(module: str) -> str | None:
    """launcher.rank.<room>...: the folder or top module of rank/ that `module` lies in (None outside rank/)."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "rank" else None


def test_rank_has_nothing_loose_but_its_entry_and_its_composition():
    loose = {p.stem for p in (PACKAGE / "rank").glob("*.py")} - {"__init__", "worker", "components"}
    assert not loose, f"rank/ modules outside a folder: {sorted(loose)}"
    folders = {p.parent.name for p in (PACKAGE / "rank").glob("*/__init__.py")}
    assert folders | {"worker", "components"} == set(RANK_FLOOR), "each folder of rank/ stands on a floor"


def test_each_rank_floor_imports_only_what_lies_beneath_it():
    wrong = []
    for module, deps in MODULES.items():
        mine = rank_room(module)
        if mine is None:
            continue
        for dep in deps:
            theirs = rank_room(dep)
            if theirs is None or theirs == mine:
                continue
            if RANK_FLOOR[theirs] >= RANK_FLOOR[mine]:
                wrong.append(f"{module} imports {dep} (rank/{theirs} is not beneath rank/{mine})")
    assert not wrong, "\n".join(wrong)


def test_exactly_one_package_imports_ultralytics():
    users = {m for m, deps in MODULES.items() if any(d.split(".")[0] == "ultralytics" for d in deps)}
    assert users and all(m.startswith("launcher.rank.ultralytics") for m in users), sorted(users)


def test_planning_imports_no_torch():
    heavy = [f"{m} imports {d}" for m, deps in MODULES.items() if room(m) in NO_TORCH
             for d in deps if d.split(".")[0] in ("torch", "ultralytics")]
    assert not heavy, heavy


def test_there_is_no_import_cycle():
    graph = {m: {d for d in deps if d in MODULES and d != m} for m, deps in MODULES.items()}
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_the_launcher_process_never_imports_ultralytics(tmp_path, cache_dir):
    """Planning and a dry run read Ultralytics' files, never import it: importing it costs seconds, changes torch's
    thread counts and probes the network."""
    code = (
        "import sys\n"
        "from launcher.cli import main\n"
        f"sys.argv = ['ddp-launch', 'dry_run=true', 'hydra.run.dir={tmp_path}/run']\n"
        "try:\n"
        "    main()\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "print('LOADED', sorted(m for m in sys.modules if m.split('.')[0] == 'ultralytics'))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "dry run: nothing started" in r.stdout
    assert "LOADED []" in r.stdout, r.stdout.splitlines()[-1]


@pytest.mark.parametrize("allowed", [False, True], ids=["refused", "tried"])
def test_the_rank_side_refuses_a_release_outside_the_window_unless_the_switch_asks_to_try_it(allowed):
    code = (
        "import ultralytics\n"
        "ultralytics.__version__ = '8.3.0'\n"
        "import launcher.rank.ultralytics\n"
    )
    env = {k: v for k, v in os.environ.items() if k != ALLOW_VARIABLE} | ({ALLOW_VARIABLE: "1"} if allowed else {})
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    if allowed:
        assert r.returncode == 0, r.stderr[-2000:]
    else:
        assert r.returncode != 0
        assert "ultralytics 8.3.0 is installed" in r.stderr and f"is tested with {WINDOW}" in r.stderr


def test_no_module_points_outside_the_repository():
    outside = [str(p.relative_to(REPO)) for p in PACKAGE.rglob("*.py") if "../shared" in p.read_text()]
    assert not outside, f"these refer to notes outside the repository: {outside}"


def test_the_architecture_section_names_every_folder():
    """docs/how-it-works.md's tree is the map a newcomer reads first: every package of launcher/ stands in it."""
    text = (REPO / "docs" / "how-it-works.md").read_text()
    tree = text[text.index("## Architecture"):text.index("## How ranks are started")]
    folders = sorted(p.parent.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("__init__.py")
                     if p.parent != PACKAGE)
    missing = [f for f in folders if f"{f.rsplit('/', 1)[-1]}/" not in tree]
    assert not missing, f"docs/how-it-works.md's Architecture section does not name {missing}"

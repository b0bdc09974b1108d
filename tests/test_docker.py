"""docker/Dockerfile, read without Docker (these machines cannot build images): a CUDA runtime base, the package
installed from everything it is built from, and `ddp-launch` as the entry point."""

from __future__ import annotations

import fnmatch
import json
import re
import tomllib

from tests.conftest import REPO

DOCKERFILE = REPO / "docker" / "Dockerfile"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: comments dropped, continuation lines joined."""
    joined, current = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        joined.append(current.strip())
        current = ""
    return [(i.split(None, 1)[0].upper(), i.split(None, 1)[1]) for i in joined]


def args_of(name: str) -> list[str]:
    return [a for i, a in instructions() if i == name]


def copied_sources() -> list[str]:
    return [src for a in args_of("COPY") for src in a.split()[:-1]]


def test_the_base_is_a_cuda_runtime_image():
    (base,) = args_of("FROM")
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+(\.\d+)?-(cudnn-)?runtime-ubuntu\d+\.\d+", base), base


def test_every_file_the_package_is_built_from_is_copied():
    needed = {"pyproject.toml", PYPROJECT["project"]["readme"], *PYPROJECT["tool"]["setuptools"]["package-dir"].values()}
    assert needed <= set(copied_sources()), needed - set(copied_sources())
    for src in copied_sources():
        assert (REPO / src).exists(), f"COPY {src}: not in the repository"


def test_the_build_context_filter_lets_every_copied_path_through():
    rules = [r for r in (REPO / "docker" / "Dockerfile.dockerignore").read_text().splitlines() if r and not r.startswith("#")]

    def included(path: str) -> bool:
        keep = True
        for rule in rules:  # the last matching rule wins, as in Docker
            negated, pattern = rule.startswith("!"), rule.lstrip("!").rstrip("/")
            if fnmatch.fnmatch(path, pattern):
                keep = negated
        return keep

    assert all(included(src) for src in copied_sources())
    assert not included(".venv") and not included("runs")


def test_the_project_is_installed_into_the_environment_on_path():
    env = " ".join(args_of("ENV"))
    venv = re.search(r"VIRTUAL_ENV=(\S+)", env).group(1)
    assert re.search(rf"PATH={re.escape(venv)}/bin:\$PATH", env)
    installs = [a for a in args_of("RUN") if "pip install" in a]
    assert installs and any(f"python3 -m venv {venv}" in a and "pip install /src" in a for a in installs)


def test_the_entry_point_is_ddp_launch():
    (entry,) = args_of("ENTRYPOINT")
    assert json.loads(entry) == ["ddp-launch"]  # exec form: signals reach ddp-launch, not a shell
    assert "ddp-launch" in PYPROJECT["project"]["scripts"]


def test_the_readme_says_the_image_is_not_built_here():
    readme = (REPO / "README.md").read_text()
    docker = readme[readme.index("## Docker") :]
    assert "docker build -f docker/Dockerfile" in docker and "not built" in docker

"""Every key ddp-launch's own config files define: what the unknown-key check (checks.unknown_key_problems) holds
a composed config against. Hydra accepts any key added with `+` (`+train.epoch=3`, its own hint for a typo) and
the run would ignore it; the plan refuses it instead, naming the closest known key.

The tree is the union of conf/config.yaml, conf/bench.yaml and every option of every group (a group's option sits
under the group's name unless it is `# @package _global_`). A key that some file sets to anything but a mapping
with keys (train.extra: {}, bench.variants: null, data.path) holds free values: nothing below it is checked here.
"""

from __future__ import annotations

import functools
from pathlib import Path

import yaml

SKIPPED = ("defaults", "hydra")  # composition and Hydra's own settings


def conf_dir() -> str:
    """The Hydra configs: `launcher/conf` in an installed wheel, the repository's `conf/` in a checkout."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "conf", package.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return str(candidate)
    raise FileNotFoundError(f"ddp-launch's Hydra configs are missing (looked in {package / 'conf'} and "
                            f"{package.parent / 'conf'})")


@functools.cache
def known_keys() -> dict:
    """{key: subtree, or None for free values} of everything conf/ defines."""
    conf = Path(conf_dir())
    tree: dict = {}
    for path in (conf / "config.yaml", conf / "bench.yaml"):
        tree = _merge(tree, _read(path))
    for group in sorted(p for p in conf.iterdir() if p.is_dir()):
        for path in sorted(group.glob("*.yaml")):
            body = _read(path)
            is_global = "@package _global_" in path.read_text().split("\n\n", 1)[0]
            tree = _merge(tree, body if is_global else {group.name: body})
    return tree


def _read(path: Path) -> dict:
    body = yaml.safe_load(path.read_text()) or {}
    return {k: v for k, v in body.items() if k not in SKIPPED}


def _merge(a: dict, b: dict) -> dict:
    """The union of two key trees; a key is a mapping with checked keys only where both sides say so."""
    out = dict(a)
    for key, value in b.items():
        if key not in out:
            out[key] = value if isinstance(value, dict) and value else None
            if out[key] is not None:
                out[key] = _merge({}, value)
        elif isinstance(out[key], dict) and isinstance(value, dict) and value:
            out[key] = _merge(out[key], value)
        else:
            out[key] = None
    return out

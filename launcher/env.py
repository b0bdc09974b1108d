"""`ddp-env`: print the environment report (machine/environment_report.py), the same one every run writes as env.txt.

Paste it into a bug report: library versions, GPUs and their links, cores, memory, /dev/shm, SLURM.
`ddp-env --clear-cache` deletes this user's shared image caches (train.cache=shared) that no run is using.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from launcher.machine.environment_report import report
from launcher.plan.environment import default_cache


def clear_cache(cache: Path) -> list[str]:
    """Delete the shared image caches in /dev/shm/ddp-launch-<uid> and <paths.cache>/images that no run maps;
    the lines to print."""
    from launcher.rank.data import image_cache_folders

    lines = []
    for folder in image_cache_folders.default_dirs(Path(cache).expanduser() / "images"):
        sizes = {p: p.stat().st_size for p in image_cache_folders.cache_files(folder)}
        removed = image_cache_folders.remove_unused(folder)
        in_use = image_cache_folders.cache_files(folder)
        freed = sum(sizes.get(p, 0) for p in removed)
        lines.append(f"{folder}: removed {len(removed)} cache file(s), {freed / 2**20:.1f} MiB"
                     + (f"; {len(in_use)} in use by a running job, kept" if in_use else ""))
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ddp-env", description=__doc__.splitlines()[0])
    parser.add_argument("--clear-cache", action="store_true",
                        help="delete this user's shared image caches (train.cache=shared: /dev/shm/ddp-launch-<uid> "
                             "and <paths.cache>/images) that no running job maps, then exit")
    parser.add_argument("--cache", type=Path, default=None,
                        help="the paths.cache of the runs whose caches to clear (default: $DDP_LAUNCH_CACHE or "
                             "~/.cache/ddp-launch)")
    args = parser.parse_args(argv)
    if args.clear_cache:
        print("\n".join(clear_cache(args.cache or default_cache())))
        return
    print(report(), end="")


if __name__ == "__main__":
    main()

"""`ddp-env`: print the environment report (machine/report.py), the same one every run writes as env.txt.

Paste it into a bug report: library versions, GPUs and their links, cores, memory, /dev/shm, SLURM.
"""

from __future__ import annotations

import argparse

from launcher.machine.report import report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ddp-env", description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    print(report(), end="")


if __name__ == "__main__":
    main()

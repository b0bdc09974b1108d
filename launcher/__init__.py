"""ddp-launch: train Ultralytics YOLO detectors on many GPUs and nodes through torchrun, and show the GPUs are fed.

`from launcher import train, resume, bench` is the Python API (api.py), imported on first use: the ranks, which
import launcher's modules, never load Hydra for it. Its errors are launcher.problems.LaunchError (PlanError,
RunFailed), also importable from here.
"""

__version__ = "0.1.0"
__all__ = ["LaunchError", "PlanError", "RunFailed", "bench", "resume", "train"]


def __getattr__(name: str):
    if name in ("LaunchError", "PlanError", "RunFailed"):
        from launcher import problems

        return getattr(problems, name)
    if name in __all__:
        from launcher import api

        return getattr(api, name)
    raise AttributeError(f"module 'launcher' has no attribute {name!r}")

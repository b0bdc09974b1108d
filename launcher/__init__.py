"""ddp-launch: train Ultralytics YOLO detectors on many GPUs and nodes through torchrun, and show the GPUs are fed.

`from launcher import train, bench` is the Python API (api.py), imported on first use: the ranks, which import
launcher's modules, never load Hydra for it.
"""

__version__ = "0.1.0"
__all__ = ["bench", "train"]


def __getattr__(name: str):
    if name in __all__:
        from launcher import api

        return getattr(api, name)
    raise AttributeError(f"module 'launcher' has no attribute {name!r}")

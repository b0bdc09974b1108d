"""ddp-launch: train Ultralytics YOLO detectors on many GPUs and nodes through torchrun, and show the GPUs are fed."""

__version__ = "0.1.0"

"""Where the rank's Triton kernels run (kernels.py's, gpu_data/warp.py's and validate/scans.py's, one rule for all): on
CUDA tensors, or on any device under Triton's interpreter (TRITON_INTERPRET=1 set before launcher is imported: how
the CPU tests check the kernels). Elsewhere, or where Triton is not installed, their PyTorch twins run."""

from __future__ import annotations

import os

import torch


def runs_on(device: torch.device) -> bool:
    """Whether a Triton kernel runs on `device`'s tensors, given Triton (each caller knows whether it imported)."""
    return device.type == "cuda" or bool(os.environ.get("TRITON_INTERPRET"))

"""What runs inside a rank: worker.py (the entry point), components.py (what it builds; training_input.py, what it
trains on), runs.py (training and benchmark loops), loop.py and hooks.py, state.py (TrainState, checkpoints),
kernels.py (Triton kernels with PyTorch twins), and the rooms data/, step/, metrics/, validate/ and ultralytics/ (the
only package that imports Ultralytics)."""

"""What runs inside a rank: worker.py (the entry point), components.py (what it builds; training_input.py, what it
trains on), runs.py (training and benchmark loops), loop.py and its hooks (hooks.py; progress.py, the progress line;
train_batches.py, train_batch<N>.jpg), lines.py (its own lines, diagnostics tagged), state.py (TrainState,
checkpoints), kernels.py (Triton kernels with PyTorch twins), and the rooms data/, step/, metrics/, validate/ and
ultralytics/ (the only package that imports Ultralytics)."""

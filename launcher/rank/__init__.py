"""What runs inside a rank: worker.py (the entry point), components.py (what it builds), runs.py (training and
benchmark loops), loop.py and hooks.py, state.py (TrainState, checkpoints), and the rooms data/, step/, metrics/
and ultralytics/ (the only package that imports Ultralytics)."""

"""What runs inside a rank, bottom floor first (tests/test_architecture.py checks the floors): kernels/ (Triton kernels
with PyTorch twins); group/ (this rank among the others) and loop/ (the loop, its state, checkpoints); data/, validate/
and metrics/; gpu_data/ (the GPU input); ultralytics/ (the only package that imports Ultralytics); step/; build_steps/
and startup/; components.py (what a rank builds, in order); run/ (the runs and their hooks); worker.py (the entry)."""

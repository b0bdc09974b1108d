"""The GPU input: the loader's file bytes decoded on the device (gpu_input.py), the batch's warp and mixes per task
(gpu_augment.py, augment_*.py, segment_masks.py; the kernels: warp.py), and a classifier's own (classify_*.py)."""

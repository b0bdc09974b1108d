"""Validation at inference speed: the split preloaded on the device once per run (store.py), a static-shape fp16
forward that can be replayed as a CUDA graph (forward.py), NMS and the matching of predictions to targets batched
over the whole batch (nms.py, matching.py: by IoU, and by OKS for a pose model's keypoints), and the pass that ties them together, post-processing each batch on a
second CUDA stream while the next batch's forward runs (engine.py). The optional folded forward
(rank/ultralytics/folded.py) runs Triton kernels of rank/kernels/kernels.py. Ultralytics' own functions compute the metrics
from what this yields (rank/ultralytics/fast_validation.py)."""

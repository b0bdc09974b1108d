"""On CUDA: batched NMS with its greedy pass as Triton scans (rank/kernels/scans.py, what ships) against the same
NMS with torchvision's, image by image (the CPU's form, Ultralytics' own call), on crowded fp16 predictions of weak
and stronger heads: the kept boxes must be the same. (The ninth session ran this file's earlier form, which compared
the fixed-point NMS's constants: results-2026-12-04/nms-constants-check.txt.)
Run from the repository root: PYTHONPATH=. python3 docs/benchmarks/h200-validation/nms_constants_check.py"""
import torch

from launcher.rank.kernels import scans
from launcher.rank.validate.nms import batched_nms
from tests.test_fast_validation import head_output, rows

differ = images = 0
shipped = scans.usable
for seed in range(12):
    pred = head_output(64, 2, 8400, seed=300 + seed, size=640.0).cuda()
    pred[:, 4:] = pred[:, 4:] ** (1 + seed % 3)  # weaker and stronger heads
    pred = pred.half()
    outs = []
    for usable in (shipped, lambda t: False):
        scans.usable = usable
        outs.append(batched_nms(pred, 0.001, 0.7, max_det=300))
    scans.usable = shipped
    for i in range(64):
        images += 1
        if not torch.equal(rows(outs[0], i), rows(outs[1], i)):
            differ += 1
            a, b = rows(outs[0], i), rows(outs[1], i)
            print("forms differ", seed, i, len(a), len(b))
print(f"images {images}: the scans' NMS and torchvision's differ on {differ}")

"""On CUDA: the NMS with the shipped constants (8 fixed-point rounds per host read, 16 images at a time) against
the previous ones (1 and 8), on the same crowded fp16 predictions: the kept boxes must be the same.
Run from the repository root: PYTHONPATH=. python3 docs/benchmarks/h200-validation/nms_constants_check.py"""
import torch
from launcher.rank.validate import nms
from launcher.rank.validate.nms import batched_nms
from tests.test_fast_validation import head_output, rows

differ = images = 0
for seed in range(12):
    pred = head_output(64, 2, 8400, seed=300 + seed, size=640.0).cuda()
    pred[:, 4:] = pred[:, 4:] ** (1 + seed % 3)  # weaker and stronger heads
    pred = pred.half()
    outs = []
    for rpc, me in [(8, 2**26), (1, 2**25)]:
        nms.ROUNDS_PER_CHECK, nms.MATRIX_ELEMENTS = rpc, me
        outs.append(batched_nms(pred, 0.001, 0.7, max_det=300))
    for i in range(64):
        images += 1
        if not torch.equal(rows(outs[0], i), rows(outs[1], i)):
            differ += 1
            a, b = rows(outs[0], i), rows(outs[1], i)
            print("variants differ", seed, i, len(a), len(b))
print(f"images {images}: shipped vs previous constants differ on {differ}")

"""Validation's batched NMS on a weak model's head output, timed: a batch of 128 images at 512x672 (7,056 anchors
x 3 classes), nearly every (anchor, class) pair scoring above conf 0.001, boxes random or clustered around 12
objects an image (a weak model's crowded boxes, most of them suppressed). The build on PYTHONPATH; the detections
saved to OUT-*.pt so that two builds can be compared. On the H200 machine
(h200-time-to-model/results-2026-12-04-nms/nms/):
    PYTHONPATH=BUILD python3 nms_probe.py OUT
"""
import sys, time, torch
from launcher.rank.validate.nms import batched_nms
out = sys.argv[1]
g = torch.Generator(device="cuda").manual_seed(0)
b, nc, h, w = 128, 3, 512, 672
anchors = (h // 8) * (w // 8) + (h // 16) * (w // 16) + (h // 32) * (w // 32)
xy = torch.rand(b, 2, anchors, device="cuda", generator=g) * torch.tensor([w, h], device="cuda")[None, :, None]
wh = 8 + torch.rand(b, 2, anchors, device="cuda", generator=g) * 150
# clustered: every anchor's box near one of 12 objects an image (a weak model's crowded, mostly suppressed boxes)
centres = torch.rand(b, 2, 12, device="cuda", generator=g) * torch.tensor([w, h], device="cuda")[None, :, None]
size = 40 + torch.rand(b, 2, 12, device="cuda", generator=g) * 120
pick = torch.randint(0, 12, (b, 1, anchors), device="cuda", generator=g).expand(b, 2, anchors)
cxy = centres.gather(2, pick) + torch.randn(b, 2, anchors, device="cuda", generator=g) * 3
cwh = size.gather(2, pick) * (1 + 0.05 * torch.randn(b, 2, anchors, device="cuda", generator=g))
for name, lo, hi, boxes in (("weak-random", 0.0, 0.03, (xy, wh)), ("weak-clustered", 0.0, 0.03, (cxy, cwh))):
    scores = lo + torch.rand(b, nc, anchors, device="cuda", generator=g) * (hi - lo)
    pred = torch.cat([*boxes, scores], 1).half()
    det = batched_nms(pred, 0.001, 0.7, max_det=300, nc=nc)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        t = time.perf_counter(); det = batched_nms(pred, 0.001, 0.7, max_det=300, nc=nc); torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    times.sort()
    print(f"{name}: {b} images x {anchors * nc} pairs, kept {int(det.count.sum())}: median {1e3 * times[5]:.1f} ms, "
          f"min {1e3 * times[0]:.1f} ms per batch", flush=True)
    torch.save({k: v.cpu() for k, v in det._asdict().items()}, f"{out}-{name}.pt")

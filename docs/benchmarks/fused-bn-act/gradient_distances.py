"""How far the fused BatchNorm+SiLU's gradients lie from the exact ones (docs/benchmarks/README.md section 14).

One eager training pass (forward, Ultralytics' detection loss, backward) of a freshly initialised network on one
batch, four ways: fp32 with TF32 off (the exact gradient), fp32 with every Conv block on the fused function, and
under autocast (fp16 on CUDA, bf16 on the CPU) without and with it. Prints each gradient's distance to the exact one
(|g - g_exact| / |g_exact| over all parameters) and the layers that depart most.

    python docs/benchmarks/fused-bn-act/gradient_distances.py [DEVICE] [MODEL] [BATCH] [IMGSZ]
    python docs/benchmarks/fused-bn-act/gradient_distances.py cpu yolov8n.yaml 4 256
"""

from __future__ import annotations

import copy
import sys
from contextlib import nullcontext

import torch
from ultralytics.cfg import get_cfg
from ultralytics.nn.tasks import DetectionModel

from launcher.rank.step.triton_modules import triton_modules


def batch_of(images: int, imgsz: int, device: str) -> dict:
    """Random images with 1 to 7 boxes each of 12 classes, channels_last."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(images):
        for k in range(1 + i % 7):
            cx, cy, w, h = torch.rand(4, generator=g).tolist()
            rows.append((i, k % 12, 0.2 + 0.6 * cx, 0.2 + 0.6 * cy, 0.05 + 0.3 * w, 0.05 + 0.3 * h))
    t = torch.tensor(rows)
    img = torch.rand(images, 3, imgsz, imgsz, generator=g)
    return {"img": img.to(device).contiguous(memory_format=torch.channels_last), "batch_idx": t[:, 0].to(device),
            "cls": t[:, 1:2].to(device), "bboxes": t[:, 2:].to(device)}


def one_pass(base, batch: dict, device: str, fused: bool, low: torch.dtype | None):
    """(loss, {parameter: gradient}, {Conv block: output}) of one pass of a copy of `base`."""
    m = copy.deepcopy(base)
    outputs = {}
    hooks = [mod.register_forward_hook(lambda mod, i, o, n=n: outputs.__setitem__(n, o.detach().float()))
             for n, mod in m.named_modules() if type(mod).__name__ == "Conv"]
    amp = torch.autocast(device.split(":")[0], dtype=low) if low else nullcontext()
    with triton_modules(m, parts=("bn_act",) if fused else ()), amp:
        loss, _ = m.loss(batch, m(batch["img"]))
    loss.sum().backward()
    for h in hooks:
        h.remove()
    grads = {n: p.grad.detach().float() for n, p in m.named_parameters() if p.grad is not None}
    return float(loss.detach().sum()), grads, outputs


def distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main(device: str = "cpu", model: str = "yolov8n.yaml", images: int = 4, imgsz: int = 256) -> None:
    low = torch.float16 if device.startswith("cuda") else torch.bfloat16
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    base = DetectionModel(model, nc=12, verbose=False)
    base.args = get_cfg()
    base = base.to(device).train().to(memory_format=torch.channels_last)
    batch = batch_of(images, imgsz, device)
    exact = one_pass(base, batch, device, False, None)
    forms = {"fp32 fused": (True, None), f"{low} unfused": (False, low), f"{low} fused": (True, low)}
    got = {name: one_pass(base, batch, device, *form) for name, form in forms.items()}
    flat = lambda grads: torch.cat([g.flatten() for g in grads.values()])  # noqa: E731
    print(f"{device} {model} batch {images} {imgsz} px; loss fp32 {exact[0]:.4f}, "
          + ", ".join(f"{name} {v[0]:.4f}" for name, v in got.items()))
    for name, (_, grads, outputs) in got.items():
        worst = max((distance(outputs[n], exact[2][n]), n) for n in exact[2])
        print(f"{name:>16}: gradient {distance(flat(grads), flat(exact[1])):.4g} from the exact one; "
              f"the farthest Conv output {worst[1]} {worst[0]:.3g}")
    print(f"{low} fused to {low} unfused: {distance(flat(got[f'{low} fused'][1]), flat(got[f'{low} unfused'][1])):.4g}")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(*args[:2], *map(int, args[2:4]))

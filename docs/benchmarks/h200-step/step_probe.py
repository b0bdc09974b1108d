"""Issues 13 and 14: what the training step's own kernels cost, and what three changes to them gain; on an H200.

The data-free ceiling of the issue-13 cell is the GPU's own step (yolov8s, batch 64, 640 px, AMP fp16, channels_last,
forward + sync-free loss + backward replayed as one CUDA graph: rank/step/captured_step.py's body). This probe
captures that body once per form below, in one process, and replays the forms interleaved (ms per step, medians of
rounds); then it profiles the shipped form eagerly (each kernel under the operator that launched it, with shapes) and
two forms' replays (the kernels alone).

Forms: a "+"-joined list, the first part the deterministic switches, then changes to the step.
- det: Ultralytics' deterministic switches, as its trainer's default and rank/ultralytics/build.seed set them (torch's
  deterministic algorithms, warn only; cuDNN's deterministic algorithms; no fill of uninitialised memory);
- nodet: both off; tdet: torch's alone; cdet: cuDNN's alone;
- gather-dfl: the DFL term as Ultralytics' DFLoss computes it, with two gathers (their backward is a scatter, which
  deterministic mode runs as a sort and an index_put): the loss before 2026-12-04's second session; without it the
  shipped dense form (rank/ultralytics/loss.py's dfl_loss);
- upsample: the neck's nearest 2x upsampling on the Triton kernels, as the shipped graphs capture it
  (rank/step/triton_modules.py);
- concat: the channel concatenations of C2f, SPPF and Concat and C2f's split as Triton copies, the backward handing
  out packed gradients (rank/ultralytics/blocks.py, swapped in by rank/step/triton_modules.py);
- bn_act: each Conv block's training BatchNorm and SiLU as one Triton function (rank/kernels/batchnorm_silu.py,
  swapped in by rank/step/triton_modules.py; train.fused_bn_act): its gradients are PyTorch's to float rounding, not
  bit for bit, so the comparison with the first form reads as a relative difference;
- pool-nchw: SPPF's max pools on a contiguous copy (PyTorch's channels_last max-pool backward).
So det+upsample+concat is what ddp-launch trains with, det+upsample what it trained with before the thirteenth
session, det+gather-dfl before the eleventh.
Each form's gradients are compared with the first form's, and with its own on a second replay of the same batch
(deterministic: bit for bit).

Usage (the H200 machine, ddp-launch and Ultralytics installed): python3 step_probe.py OUT_DIR [--rounds 5 --steps 20]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from contextlib import ExitStack, contextmanager
from pathlib import Path

os.environ.setdefault("YOLO_OFFLINE", "1")
os.environ.setdefault("YOLO_CONFIG_DIR", "/tmp/yolo")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402


def build(batch: int, imgsz: int, nc: int, seed: int = 0):
    from ultralytics.cfg import get_cfg
    from ultralytics.nn.tasks import DetectionModel

    from launcher.rank.data.pipeline import MAX_TARGETS
    from launcher.rank.ultralytics.loss import DetectionLoss

    torch.manual_seed(seed)
    model = DetectionModel("yolov8s.yaml", nc=nc, verbose=False)
    model.args = get_cfg()
    model = model.cuda().train().to(memory_format=torch.channels_last)
    model.criterion = DetectionLoss(model)
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(batch):  # 1-7 boxes per image, as the benchmark data has
        for _ in range(int(torch.randint(1, 8, (1,), generator=g))):
            wh = torch.rand(2, generator=g) * 0.4 + 0.05
            cxy = wh / 2 + torch.rand(2, generator=g) * (1 - wh)
            rows.append([i, float(torch.randint(0, nc, (1,), generator=g)), *cxy.tolist(), *wh.tolist()])
    t = torch.tensor(rows)
    img = torch.rand(batch, 3, imgsz, imgsz, generator=g).half().cuda().contiguous(memory_format=torch.channels_last)
    cpu_batch = {"img": img, "batch_idx": t[:, 0], "cls": t[:, 1:2], "bboxes": t[:, 2:]}
    targets = model.criterion.padded_targets(cpu_batch, 8)
    return model, img, targets, MAX_TARGETS


def body(model, img, targets, max_targets_key, params):
    """captured_step.CapturedStep._body, less the GradScaler (a constant scale here: 256; the run of 2026-12-04 had
    65,536, at which some fp16 gradients overflowed, so its gradient comparisons were void: README.md)."""
    from launcher.rank.ultralytics.loss import PADDED_TARGETS

    with torch.autocast("cuda", dtype=torch.float16, cache_enabled=False):
        preds = model(img)
        loss, _ = model.loss({"img": img, PADDED_TARGETS: targets, max_targets_key: 8}, preds)
        loss = loss.sum() * 64
    return torch.autograd.grad(loss * 4.0, params, allow_unused=True, materialize_grads=True)


# ---- the forms' patches ---------------------------------------------------------------------------------------------
@contextmanager
def patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


@contextmanager
def switches(torch_det: bool, cudnn_det: bool):
    """build.seed's switches: torch's deterministic algorithms (warn only), cuDNN's, and no fill of new tensors."""
    import torch.utils.deterministic as tud

    was = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
           torch.backends.cudnn.deterministic, tud.fill_uninitialized_memory)
    torch._C._set_deterministic_algorithms(torch_det, warn_only=torch_det)
    torch.backends.cudnn.deterministic = cudnn_det
    tud.fill_uninitialized_memory = not torch_det  # as build.seed: Ultralytics skips the fill
    try:
        yield
    finally:
        torch._C._set_deterministic_algorithms(was[0], warn_only=was[1])
        torch.backends.cudnn.deterministic = was[2]
        tud.fill_uninitialized_memory = was[3]


SWITCHES = {"det": (True, True), "nodet": (False, False), "tdet": (True, False), "cdet": (False, True)}


def pool_nchw(module: nn.MaxPool2d):
    def forward(x):
        y = F.max_pool2d(x.contiguous(), module.kernel_size, module.stride, module.padding, module.dilation,
                         ceil_mode=module.ceil_mode)
        return y.contiguous(memory_format=torch.channels_last)
    return forward


def form_patches(model, form: str) -> ExitStack:
    from ultralytics.utils.loss import DFLoss

    import launcher.rank.ultralytics.loss as loss_module
    from launcher.rank.step.triton_modules import triton_modules

    stack = ExitStack()
    parts = form.split("+")
    stack.enter_context(switches(*SWITCHES[parts[0]]))
    if "gather-dfl" in parts:
        stack.enter_context(patched(loss_module, "dfl_loss", lambda pred, target, reg_max: DFLoss(reg_max)(pred, target)))
    if "upsample" in parts:
        stack.enter_context(triton_modules(model, parts=("upsample",)))
    if "concat" in parts:
        stack.enter_context(triton_modules(model, parts=("concat",)))
    if "bn_act" in parts:
        stack.enter_context(triton_modules(model, parts=("bn_act",)))
    if "pool-nchw" in parts:
        for m in model.modules():
            if isinstance(m, nn.MaxPool2d):
                stack.enter_context(patched(m, "forward", pool_nchw(m)))
    return stack


def capture(model, img, targets, key, params, pool):
    saved = {k: v.detach().clone() for k, v in model.named_buffers()}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            body(model, img, targets, key, params)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = body(model, img, targets, key, params)
    with torch.no_grad():
        for k, v in model.named_buffers():
            v.copy_(saved[k])
    return graph, out


def time_replays(graph, steps: int) -> float:
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    s.record()
    for _ in range(steps):
        graph.replay()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / steps


def kernels_by_operator(fn, rows: int = 45) -> str:
    """Each CUDA kernel's time under the chain of operators that launched it (op <- parent <- grandparent), for one
    call of `fn` run eagerly."""
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    by_chain, total = defaultdict(lambda: [0.0, 0]), 0.0
    for evt in prof.events():
        kernels = getattr(evt, "kernels", None) or []
        if not kernels:
            continue
        chain, parent = [evt.name], evt.cpu_parent
        while parent is not None and len(chain) < 4:
            chain.append(parent.name)
            parent = parent.cpu_parent
        for k in kernels:
            us = k.duration if hasattr(k, "duration") else (k.end_us() - k.start_us())
            entry = by_chain[" <- ".join(chain) + "  [" + k.name[:60] + "]"]
            entry[0] += us
            entry[1] += 1
            total += us
    lines = [f"{total / 1e3:.2f} ms of kernels in one eager step; the largest, by launching operators:"]
    for key, (us, n) in sorted(by_chain.items(), key=lambda kv: -kv[1][0])[:rows]:
        lines.append(f"{us / 1e3:8.3f} ms {n:5d}x  {key}")
    return "\n".join(lines)


def kernels_of(fn) -> str:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    for key in ("self_cuda_time_total", "self_device_time_total"):
        try:
            return averages.table(sort_by=key, row_limit=45, max_name_column_width=90)
        except (AttributeError, KeyError, ValueError):
            continue
    return averages.table(row_limit=45)


def flat(grads) -> torch.Tensor:
    return torch.cat([g.detach().float().flatten() for g in grads])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--imgsz", type=int, default=640)
    ap.add_argument("--nc", type=int, default=80)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--forms", default="det+upsample,det+upsample+concat,det+concat,nodet+upsample+concat")
    ap.add_argument("--profile", default="det+upsample+concat",
                    help="forms profiled eagerly, kernels by launching operator")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cudnn.benchmark = True
    model, img, targets, key = build(args.batch, args.imgsz, args.nc)
    params = [p for p in model.parameters() if p.requires_grad]
    pool = torch.cuda.graph_pool_handle()
    graphs, report = {}, {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "batch": args.batch,
                          "imgsz": args.imgsz, "forms": {}}
    forms = args.forms.split(",")
    for form in forms:
        started = time.perf_counter()
        try:
            with form_patches(model, form):
                graphs[form] = capture(model, img, targets, key, params, pool)
            print(f"captured {form} in {time.perf_counter() - started:.1f} s", flush=True)
        except Exception:  # noqa: BLE001 - one form's failure must not cost the others' figures
            report["forms"][form] = {"error": traceback.format_exc(limit=4)}
            print(f"FAILED {form}:\n{traceback.format_exc(limit=4)}", flush=True)
    times: dict[str, list[float]] = {f: [] for f in graphs}
    for _ in range(args.rounds):  # interleaved: drift in the clocks or the host reaches every form alike
        for form, (graph, _) in graphs.items():
            times[form].append(time_replays(graph, args.steps))
    reference = None
    if forms[0] in graphs:
        graphs[forms[0]][0].replay()
        torch.cuda.synchronize()
        reference = flat(graphs[forms[0]][1])
    for form, (graph, grads) in graphs.items():
        graph.replay()
        torch.cuda.synchronize()
        first = flat(grads)
        graph.replay()
        torch.cuda.synchronize()
        second = flat(grads)
        entry = {"ms_per_step": statistics.median(times[form]), "rounds": times[form],
                 "repeats_bit_for_bit": bool(torch.equal(first, second)),
                 "max_abs_diff_between_replays": float((first - second).abs().max())}
        if reference is not None:
            entry[f"grad_rel_diff_vs_{forms[0]}"] = float((first - reference).norm() / reference.norm())
        report["forms"][form] = entry
        print(f"{form:40s} {entry['ms_per_step']:7.2f} ms/step  rounds {[round(t, 2) for t in times[form]]}  "
              f"repeats {entry['repeats_bit_for_bit']}  vs {forms[0]} {entry.get(f'grad_rel_diff_vs_{forms[0]}', 0):.2e}",
              flush=True)
    (out / "step_probe.json").write_text(json.dumps(report, indent=1))

    for form in filter(None, args.profile.split(",")):
        with form_patches(model, form):
            for _ in range(2):
                body(model, img, targets, key, params)
            text = kernels_by_operator(lambda: body(model, img, targets, key, params))
        (out / f"kernels-by-operator-{form.replace('+', '_')}.txt").write_text(f"{form}, eager\n{text}\n")
        print(f"--- {form}\n" + "\n".join(text.splitlines()[:25]), flush=True)
    for form in (forms[0], forms[-1]):
        if form in graphs:
            graph = graphs[form][0]
            (out / f"kernels-replay-{form.replace('+', '_')}.txt").write_text(
                f"5 replays of {form}\n{kernels_of(lambda: [graph.replay() for _ in range(5)])}")
    print("done", flush=True)


if __name__ == "__main__":
    sys.exit(main())

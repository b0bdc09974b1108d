"""Issue 14: what the validation forward of yolov8s loses on an H200, and what a folded fp16 forward gains; the
forward alone, replayed as CUDA graphs (rank/ultralytics/folded.py and rank/kernels/kernels.py are the shipped forms
of what this probe inlines).
1. Nearest 2x upsampling of channels_last fp16 tensors: F.interpolate against an expand + reshape copy and a Triton
   kernel (forward; forward and backward for the PyTorch forms).
2. The validation forward at batch 128 x 512x672 (a 640x480 split's rectangular batch): the fp32 model under fp16
   autocast (what the fast validator runs), the .half() model (what Ultralytics' validator runs), BatchNorm folded
   with the bias and SiLU in one Triton pass, and that with the faster upsampling.
Usage (the H200 machine, ddp-launch and Ultralytics installed): python3 forward_probe.py [OUT_DIR]
"""
import copy, os, sys, types
os.environ.setdefault("YOLO_OFFLINE", "1"); os.environ.setdefault("YOLO_CONFIG_DIR", "/tmp/yolo")
import torch, torch.nn as nn, torch.nn.functional as F
import triton, triton.language as tl

dev = torch.device("cuda")
torch.backends.cudnn.benchmark = True


def timeit(fn, n=20, warm=5):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / n


def up_expand(x):
    n, c, h, w = x.shape
    y = x.permute(0, 2, 3, 1)[:, :, None, :, None, :].expand(n, h, 2, w, 2, c).reshape(n, 2 * h, 2 * w, c)
    return y.permute(0, 3, 1, 2)


@triton.jit
def _up2_kernel(x_ptr, y_ptr, rows_out, H, W, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # output pixel index n*(2H*2W) + oh*2W + ow
    ow = r % (2 * W)
    t = r // (2 * W)
    oh = t % (2 * H)
    n = t // (2 * H)
    src = (n * H + oh // 2) * W + ow // 2
    for c0 in range(0, C, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        m = (r[:, None] < rows_out) & (c[None, :] < C)
        v = tl.load(x_ptr + src[:, None].to(tl.int64) * C + c[None, :], mask=m)
        tl.store(y_ptr + r[:, None].to(tl.int64) * C + c[None, :], v, mask=m)


def up_triton(x):
    n, c, h, w = x.shape
    y = torch.empty((n, c, 2 * h, 2 * w), dtype=x.dtype, device=x.device, memory_format=torch.channels_last)
    rows = n * 4 * h * w
    bc = min(triton.next_power_of_2(c), 128)
    br = max(4096 // bc, 1)
    _up2_kernel[(triton.cdiv(rows, br),)](x, y, rows, h, w, c, BLOCK_R=br, BLOCK_C=bc)
    return y


@triton.jit
def _bias_act_kernel(y_ptr, b_ptr, rows, C, SILU: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = (r[:, None] < rows) & (c[None, :] < C)
    off = r[:, None].to(tl.int64) * C + c[None, :]
    x = tl.load(y_ptr + off, mask=m).to(tl.float32) + tl.load(b_ptr + c, mask=c < C).to(tl.float32)[None, :]
    if SILU:
        x = x * tl.sigmoid(x)
    tl.store(y_ptr + off, x.to(y_ptr.dtype.element_ty), mask=m)


def bias_act_(y, b, silu):
    n, c, h, w = y.shape
    assert y.is_contiguous(memory_format=torch.channels_last)
    rows = n * h * w
    bc = min(triton.next_power_of_2(c), 128)
    br = max(8192 // bc, 1)
    _bias_act_kernel[(triton.cdiv(rows, br), triton.cdiv(c, bc))](y, b, rows, c, SILU=silu, BLOCK_R=br, BLOCK_C=bc)
    return y


def fold(model):
    """A .half() copy with each Conv's BN folded and bias+SiLU in one Triton pass."""
    from ultralytics.nn.modules import Conv, DWConv
    m2 = copy.deepcopy(model).float().eval()
    for m in m2.modules():
        if type(m) in (Conv, DWConv) and hasattr(m, "bn"):
            conv, bn = m.conv, m.bn
            scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
            w = conv.weight * scale[:, None, None, None]
            b = bn.bias - bn.running_mean * scale
            m.w, m.b = nn.Parameter(w.detach()), nn.Parameter(b.detach())
            silu = isinstance(m.act, nn.SiLU)
            ident = isinstance(m.act, nn.Identity)
            assert silu or ident, m.act
            st, pad, dil, g = conv.stride, conv.padding, conv.dilation, conv.groups
            del m.bn, m.conv

            def fwd(self, x, st=st, pad=pad, dil=dil, g=g, silu=silu):
                return bias_act_(F.conv2d(x, self.w, None, st, pad, dil, g), self.b, silu)
            m.forward = types.MethodType(fwd, m)
    return m2.half()


def main():
    from ultralytics.nn.tasks import DetectionModel
    out = []
    p = lambda *a: (print(*a, flush=True), out.append(" ".join(map(str, a))))
    # 1. upsample
    for shape in [(64, 512, 20, 20), (64, 256, 40, 40), (128, 512, 16, 21), (128, 256, 32, 42)]:
        x = torch.randn(shape, device=dev, dtype=torch.half).contiguous(memory_format=torch.channels_last)
        ref = F.interpolate(x, scale_factor=2, mode="nearest")
        assert torch.equal(up_expand(x), ref) and torch.equal(up_triton(x), ref)
        t_i = timeit(lambda: F.interpolate(x, scale_factor=2, mode="nearest"))
        t_e = timeit(lambda: up_expand(x))
        t_t = timeit(lambda: up_triton(x))
        xg = x.clone().requires_grad_()
        g = torch.randn_like(ref)
        t_ib = timeit(lambda: torch.autograd.grad(F.interpolate(xg, scale_factor=2, mode="nearest"), xg, g))
        t_eb = timeit(lambda: torch.autograd.grad(up_expand(xg), xg, g))
        ga = torch.autograd.grad(F.interpolate(xg, scale_factor=2, mode="nearest"), xg, g)[0]
        gb = torch.autograd.grad(up_expand(xg), xg, g)[0]
        p(f"upsample {shape}: fwd interpolate {t_i:.3f} ms, expand {t_e:.3f}, triton {t_t:.3f}; fwd+bwd interpolate "
          f"{t_ib:.3f}, expand {t_eb:.3f}; grad max diff {(ga.float() - gb.float()).abs().max().item():.3g}")

    # 2. validation forward variants
    torch.manual_seed(0)
    model = DetectionModel("yolov8s.yaml", nc=2, verbose=False).to(dev)
    # make BN stats non-trivial
    model.train()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
        for _ in range(3):
            model(torch.rand(8, 3, 640, 640, device=dev))
    model.eval()
    B, H, W = 128, 512, 672
    img = torch.randint(0, 255, (B, 3, H, W), device=dev, dtype=torch.uint8)

    def graphed(fn, x_static):
        s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                fn(x_static)
        torch.cuda.current_stream().wait_stream(s)
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            o = fn(x_static)
        return gr, o

    def amp_fwd(x):
        with torch.autocast("cuda", dtype=torch.float16, cache_enabled=False):
            return model(x)[0]
    half = copy.deepcopy(model).half()
    folded = fold(model)
    folded_up = fold(model)
    for name, m in folded_up.named_modules():
        if isinstance(m, nn.Upsample):
            m.forward = types.MethodType(lambda self, x: up_expand(x), m)
    folded_upt = fold(model)
    for name, m in folded_upt.named_modules():
        if isinstance(m, nn.Upsample):
            m.forward = types.MethodType(lambda self, x: up_triton(x), m)
    x16 = (img.half() / 255).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        for name, fn in [("autocast fp32 model (shipped)", amp_fwd), ("half model", lambda x: half(x)[0]),
                         ("folded half + bias-SiLU", lambda x: folded(x)[0]),
                         ("folded + expand upsample", lambda x: folded_up(x)[0]),
                         ("folded + triton upsample", lambda x: folded_upt(x)[0])]:
            xs = x16.clone()
            gr, o = graphed(fn, xs)
            t = timeit(gr.replay, n=20)
            p(f"val forward {name}: {t:.2f} ms per batch of {B} at {H}x{W} = {B / t * 1e3:.0f} images/s")

    if len(sys.argv) > 1:
        with open(os.path.join(sys.argv[1], "probe.txt"), "w") as f:
            f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()

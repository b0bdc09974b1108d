"""The two passes of the GPU input pipeline, each as a Triton kernel and as its PyTorch twin (the same maths).

`load_into_slots` puts decoded images into the image buffer: Ultralytics' `load_image` resize (long side to imgsz,
cv2.INTER_LINEAR's half-pixel bilinear) from the decoder's planar RGB into interleaved RGB slots, every image of a
batch in one launch.

`render` makes the network's input from the slots in one pass over the output: for each output pixel the inverse of
the sample's composed matrix (mosaic placement, RandomPerspective, the flips) gives a position on the mosaic canvas;
each of the 4 canvas pixels the bilinear filter reads is looked up in the tile that covers it (114 where none does),
exactly as warpAffine reads a built canvas; the result is rounded like warpAffine's uint8 output, RandomHSV is applied
in float (OpenCV's hue units), and the value is written scaled, in the output tensor's dtype and memory layout (the
fp16 channels_last input of an AMP step, or uint8 in Ultralytics' batch format). `shade` is that last step alone, on
planes: what a sample mixed by MixUp or CutMix gets after its mix (rendered without HSV first; gpu_augment.py).

The Triton kernels run on CUDA tensors; the twins on any device (the CPU machines, and the tests that compare the
two on the same draws). With TRITON_INTERPRET=1 set before launcher is imported, the Triton kernels run on CPU
tensors too, which is how the CPU test suite checks them.
"""

from __future__ import annotations

import torch

from launcher.rank.kernels.triton_use import runs_on

BORDER = 114.0  # Ultralytics' pad value: the mosaic canvas and the warp's border
BLOCK = 512  # output pixels per Triton program
COORD_LIMIT = 1.0e6  # canvas coordinates are clamped here first: a near-singular perspective gives no int overflow


def triton_usable(device: torch.device) -> bool:
    """Whether `render` and `load_into_slots` run as Triton kernels on tensors of `device` (triton_use.py)."""
    return _kernels() is not None and runs_on(device)


# --- the shared maths, on tensors -----------------------------------------------------------------------------------
def hsv_shift(r: torch.Tensor, g: torch.Tensor, b: torch.Tensor, gains: torch.Tensor):
    """RandomHSV in float on values in 0..255: hue + 180 gain_h (OpenCV's 0..180 hue, modulo 180), saturation and
    value times (1 + gain), clipped. `gains` (n, 3) broadcast against (n, P) channels. Ultralytics does the same
    through uint8 lookup tables (a grey level or two of rounding apart)."""
    mx = torch.maximum(torch.maximum(r, g), b)
    d = mx - torch.minimum(torch.minimum(r, g), b)
    safe = torch.where(d > 0, d, torch.ones_like(d))
    hue = torch.where(mx == r, (g - b) / safe, torch.where(mx == g, (b - r) / safe + 2, (r - g) / safe + 4))
    hue = torch.where(d > 0, hue, torch.zeros_like(hue)) + 6 * gains[:, 0:1]  # in sextants: 180 OpenCV units = 6
    hue = hue - 6 * torch.floor(hue / 6)
    sat = torch.where(mx > 0, d / torch.where(mx > 0, mx, torch.ones_like(mx)), torch.zeros_like(mx))
    sat = (sat * (1 + gains[:, 1:2])).clamp(0, 1)
    val = (mx * (1 + gains[:, 2:3])).clamp(0, 255)

    def channel(n: float) -> torch.Tensor:  # HSV -> RGB without branches: n = 5 red, 3 green, 1 blue
        k = n + hue
        k = k - 6 * torch.floor(k / 6)
        return val - val * sat * torch.minimum(k, 4 - k).clamp(0, 1)

    return channel(5.0), channel(3.0), channel(1.0)


def shade(red: torch.Tensor, green: torch.Tensor, blue: torch.Tensor, gains: torch.Tensor | None, swap: torch.Tensor,
          scale: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The end of the render pass on planes (n, P) of 0..255 values: RandomHSV (`gains` (n, 3), or None), the channel
    order (`swap` (n,) bool: BGR), the scale to the output's range and its dtype (uint8: rounded, clipped). Also what
    a mixed sample gets after its mix (gpu_augment: HSV comes after MixUp and CutMix)."""
    if gains is not None:
        red, green, blue = hsv_shift(red, green, blue, gains.float())
    flip = swap[:, None]
    planes = []
    for plane in (torch.where(flip, blue, red), green, torch.where(flip, red, blue)):
        plane = plane * scale
        if not dtype.is_floating_point:
            plane = torch.round(plane).clamp(0, 255)
        planes.append(plane.to(dtype))
    return planes[0], planes[1], planes[2]


# --- load: decoded images into slots --------------------------------------------------------------------------------
def load_into_slots(flat: torch.Tensor, meta: torch.Tensor, slots: torch.Tensor) -> None:
    """Resize each decoded image into its slot. `flat`: the decoded (3, h0, w0) RGB images back to back, uint8;
    `meta` (n, 6) int64 rows (offset in `flat`, h0, w0, slot, h, w); `slots` (cap, S, S, 3) uint8, written in place
    at [slot, :h, :w]."""
    if len(meta) == 0:
        return
    if triton_usable(slots.device):
        s = slots.shape[1]
        grid = (-(-s * s // BLOCK), len(meta))
        _kernels().load[grid](flat, meta, slots, s, BLOCK=BLOCK)
        return
    _load_torch(flat, meta, slots)


def _load_torch(flat: torch.Tensor, meta: torch.Tensor, slots: torch.Tensor) -> None:
    for offset, h0, w0, slot, h, w in meta.tolist():
        img = flat[offset : offset + 3 * h0 * w0].view(1, 3, h0, w0).float()
        if (h, w) != (h0, w0):  # cv2.INTER_LINEAR's taps: (i + 0.5) n0 / n - 0.5, clamped at the edges
            img = torch.nn.functional.interpolate(img, size=(h, w), mode="bilinear", align_corners=False)
        slots[slot, :h, :w] = torch.round(img[0]).clamp(0, 255).to(torch.uint8).permute(1, 2, 0)


# --- render: slots to the network's input ---------------------------------------------------------------------------
def render(slots: torch.Tensor, tiles: torch.Tensor, centre: torch.Tensor, inverse: torch.Tensor,
           gains: torch.Tensor | None, swap: torch.Tensor, out: torch.Tensor, *, scale: float, bgr_slots: bool) -> None:
    """Write `out` (B, 3, S, S), any dtype and strides, in place.

    slots    (cap, S, S, 3) uint8, RGB (or BGR with bgr_slots)
    tiles    (B, 5, 4) int32: per sample and mosaic quadrant (top left, top right, bottom left, bottom right) the
             canvas rectangle its tile covers (x_lo, x_hi, y_lo, y_hi) and `base`, the flat pixel index in `slots`
             of canvas pixel (0, 0) seen through that tile
    centre   (B, 2) int32: the quadrants' boundary (xc, yc) on the canvas
    inverse  (B, 3, 3) float32: output pixel -> canvas pixel
    gains    (B, 3) float32 RandomHSV gains, or None for no colour change
    swap     (B,) bool: write this sample's channels BGR instead of RGB (Ultralytics' `bgr` probability)
    scale    the factor from 0..255 to `out`'s range (1/255 for the network's input)
    """
    if triton_usable(out.device):
        b, _, s, _ = out.shape
        k = _kernels()
        grid = (-(-s * s // BLOCK), b)
        hsv = gains is not None
        k.render[grid](
            slots, tiles.contiguous(), centre.contiguous(), inverse.reshape(b, 9).contiguous(),
            gains.contiguous() if hsv else inverse, swap.to(torch.int32).contiguous(), out,
            s, *out.stride(), float(scale),
            HSV=hsv, BGR_SLOTS=bgr_slots, ROUND_OUT=not out.dtype.is_floating_point, BLOCK=BLOCK,
        )
        return
    _render_torch(slots, tiles, centre, inverse, gains, swap, out, scale=scale, bgr_slots=bgr_slots)


def warm_up(device: torch.device, side: int, out_dtype: torch.dtype, *, channels_last: bool, hsv: bool,
            mixes: bool) -> None:
    """The kernels a training batch launches, compiled (or loaded from Triton's cache) without a launch: the load into
    slots of `side` pixels, and the render into (B, 3, side, side) `out_dtype` images (channels_last or not; with
    `hsv`), plus, with `mixes`, the uint8 render without HSV that mixed samples get. Triton specialises the integer
    arguments (a multiple of 16, or 1) and not the batch size, so the strides of one image stand for any batch.
    For a thread beside the set-up (rank/kernels/kernels.py's WarmUp); a kernel it misses compiles at its first
    launch."""
    if not triton_usable(device) or device.type != "cuda":
        return
    torch.cuda.set_device(device)  # Triton compiles for the thread's current device
    k = _kernels()
    k.load.warmup(torch.uint8, torch.int64, torch.uint8, side, BLOCK=BLOCK, grid=(1,))
    image, planar = 3 * side * side, (3 * side * side, side * side, side, 1)
    variants = [(out_dtype, (image, 1, 3 * side, 3) if channels_last else planar, hsv)]
    if mixes:
        variants.append((torch.uint8, planar, False))
    for dtype, strides, with_hsv in variants:
        k.render.warmup(torch.uint8, torch.int32, torch.int32, torch.float32, torch.float32, torch.int32, dtype, side,
                        *strides, 1.0, HSV=with_hsv, BGR_SLOTS=False, ROUND_OUT=not dtype.is_floating_point,
                        BLOCK=BLOCK, grid=(1,))


PIXELS_PER_PASS = 2**22  # the twin's output pixels per pass: bounds its temporaries (~100 bytes per pixel)


def _render_torch(slots, tiles, centre, inverse, gains, swap, out, *, scale, bgr_slots):
    b, _, s, _ = out.shape
    dev = out.device
    axis = torch.arange(s, device=dev, dtype=torch.float32)
    v, u = torch.meshgrid(axis, axis, indexing="ij")  # cv2's convention: pixel centres at integer coordinates
    grid = torch.stack((u.reshape(-1), v.reshape(-1), torch.ones(s * s, device=dev)))
    pixels = slots.view(-1, 3)
    step = max(1, PIXELS_PER_PASS // (s * s))
    for first in range(0, b, step):
        rows = slice(first, first + step)
        m = inverse[rows].reshape(-1, 3, 3)
        src = m @ grid  # (n, 3, S*S)
        x = (src[:, 0] / src[:, 2]).clamp(-COORD_LIMIT, COORD_LIMIT)
        y = (src[:, 1] / src[:, 2]).clamp(-COORD_LIMIT, COORD_LIMIT)
        x0, y0 = x.floor(), y.floor()
        fx, fy = x - x0, y - y0
        x0, y0 = x0.int(), y0.int()
        acc = torch.zeros((*fx.shape, 3), device=dev)
        for dx, dy in ((0, 0), (1, 0), (0, 1), (1, 1)):
            weight = (fx if dx else 1 - fx) * (fy if dy else 1 - fy)
            index, inside = _lookup(tiles[rows], centre[rows], x0 + dx, y0 + dy, s)
            tap = pixels.index_select(0, index.view(-1)).view(*index.shape, 3).float()
            tap = torch.where(inside[..., None], tap, torch.full_like(tap, BORDER))
            acc += weight[..., None] * tap
        acc = torch.round(acc)  # half to even, as warpAffine's saturate_cast
        c0, c1, c2 = acc.unbind(-1)
        rgb = (c2, c1, c0) if bgr_slots else (c0, c1, c2)
        for c, plane in enumerate(shade(*rgb, None if gains is None else gains[rows], swap[rows], scale, out.dtype)):
            out[rows, c] = plane.view(-1, s, s)


def _lookup(tiles, centre, x, y, s):
    """For integer canvas pixels (x, y) (n, P): their flat index in `slots`, and whether a tile covers them."""
    right, bottom = x >= centre[:, 0:1], y >= centre[:, 1:2]

    def quadrant(table):  # (n, 4) -> (n, P): the entry of the quadrant each pixel lies in
        return torch.where(
            bottom, torch.where(right, table[:, 3:], table[:, 2:3]), torch.where(right, table[:, 1:2], table[:, :1])
        )

    x_lo, x_hi, y_lo, y_hi, base = tiles.unbind(1)
    inside = (x >= quadrant(x_lo)) & (x < quadrant(x_hi)) & (y >= quadrant(y_lo)) & (y < quadrant(y_hi))
    return torch.where(inside, quadrant(base) + y * s + x, 0), inside


# --- the Triton kernels ---------------------------------------------------------------------------------------------
try:  # the kernels are compiled on first launch; without Triton only the twins run
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - every torch build this project supports ships Triton on Linux
    triton = None


def _kernels():
    """The module's Triton kernels, or None where Triton is not installed."""
    return _KERNELS


if triton is None:
    _KERNELS = None
else:
    @triton.jit
    def _load(flat, meta, slots, S, BLOCK: tl.constexpr):
        i = tl.program_id(1)
        offset = tl.load(meta + i * 6)
        h0 = tl.load(meta + i * 6 + 1).to(tl.int32)
        w0 = tl.load(meta + i * 6 + 2).to(tl.int32)
        slot = tl.load(meta + i * 6 + 3)
        h = tl.load(meta + i * 6 + 4).to(tl.int32)
        w = tl.load(meta + i * 6 + 5).to(tl.int32)
        p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        valid = p < h * w
        y = p // w
        x = p % w
        sx = tl.maximum((x.to(tl.float32) + 0.5) * (w0.to(tl.float32) / w.to(tl.float32)) - 0.5, 0.0)
        sy = tl.maximum((y.to(tl.float32) + 0.5) * (h0.to(tl.float32) / h.to(tl.float32)) - 0.5, 0.0)
        fx0 = tl.floor(sx)
        fy0 = tl.floor(sy)
        fx = sx - fx0
        fy = sy - fy0
        x0 = tl.minimum(fx0.to(tl.int32), w0 - 1)
        y0 = tl.minimum(fy0.to(tl.int32), h0 - 1)
        x1 = tl.minimum(x0 + 1, w0 - 1)
        y1 = tl.minimum(y0 + 1, h0 - 1)
        plane = h0.to(tl.int64) * w0
        dst = slots + (slot * S * S + y.to(tl.int64) * S + x) * 3
        for c in tl.static_range(3):
            src = flat + offset + c * plane
            a = tl.load(src + y0 * w0 + x0, mask=valid, other=0).to(tl.float32)
            b = tl.load(src + y0 * w0 + x1, mask=valid, other=0).to(tl.float32)
            cc = tl.load(src + y1 * w0 + x0, mask=valid, other=0).to(tl.float32)
            d = tl.load(src + y1 * w0 + x1, mask=valid, other=0).to(tl.float32)
            top = a * (1 - fx) + b * fx
            bottom = cc * (1 - fx) + d * fx
            value = _rint(top * (1 - fy) + bottom * fy)
            tl.store(dst + c, tl.minimum(tl.maximum(value, 0.0), 255.0).to(tl.uint8), mask=valid)

    @triton.jit
    def _rint(x):
        """Round half to even (cvRound, torch.round)."""
        r = tl.floor(x + 0.5)
        tie = (r - x) == 0.5
        odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
        return tl.where(tie & odd, r - 1.0, r)

    @triton.jit
    def _channel(n: tl.constexpr, hue, sat, val):
        k = n + hue
        k = k - 6.0 * tl.floor(k / 6.0)
        return val - val * sat * tl.minimum(tl.maximum(tl.minimum(k, 4.0 - k), 0.0), 1.0)

    @triton.jit
    def _tap(slots, tiles, x, y, xc, yc, valid, S):
        q = (x >= xc).to(tl.int32) + 2 * (y >= yc).to(tl.int32)
        x_lo = tl.load(tiles + q)
        x_hi = tl.load(tiles + 4 + q)
        y_lo = tl.load(tiles + 8 + q)
        y_hi = tl.load(tiles + 12 + q)
        base = tl.load(tiles + 16 + q)
        inside = valid & (x >= x_lo) & (x < x_hi) & (y >= y_lo) & (y < y_hi)
        index = (base + y * S + x).to(tl.int64) * 3
        c0 = tl.load(slots + index, mask=inside, other=114).to(tl.float32)
        c1 = tl.load(slots + index + 1, mask=inside, other=114).to(tl.float32)
        c2 = tl.load(slots + index + 2, mask=inside, other=114).to(tl.float32)
        return c0, c1, c2

    @triton.jit
    def _render(slots, tiles, centre, inverse, gains, swap, out, S, so_b, so_c, so_y, so_x, scale,
               HSV: tl.constexpr, BGR_SLOTS: tl.constexpr, ROUND_OUT: tl.constexpr, BLOCK: tl.constexpr):
        b = tl.program_id(1)
        p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        valid = p < S * S
        v = p // S
        u = p % S
        uf = u.to(tl.float32)
        vf = v.to(tl.float32)
        m = inverse + b * 9
        den = tl.load(m + 6) * uf + tl.load(m + 7) * vf + tl.load(m + 8)
        x = (tl.load(m + 0) * uf + tl.load(m + 1) * vf + tl.load(m + 2)) / den
        y = (tl.load(m + 3) * uf + tl.load(m + 4) * vf + tl.load(m + 5)) / den
        x = tl.minimum(tl.maximum(x, -1.0e6), 1.0e6)
        y = tl.minimum(tl.maximum(y, -1.0e6), 1.0e6)
        fx0 = tl.floor(x)
        fy0 = tl.floor(y)
        fx = x - fx0
        fy = y - fy0
        x0 = fx0.to(tl.int32)
        y0 = fy0.to(tl.int32)
        xc = tl.load(centre + b * 2)
        yc = tl.load(centre + b * 2 + 1)
        t = tiles + b * 20
        a0, a1, a2 = _tap(slots, t, x0, y0, xc, yc, valid, S)
        b0, b1, b2 = _tap(slots, t, x0 + 1, y0, xc, yc, valid, S)
        c0, c1, c2 = _tap(slots, t, x0, y0 + 1, xc, yc, valid, S)
        d0, d1, d2 = _tap(slots, t, x0 + 1, y0 + 1, xc, yc, valid, S)
        w00 = (1 - fx) * (1 - fy)
        w10 = fx * (1 - fy)
        w01 = (1 - fx) * fy
        w11 = fx * fy
        ch0 = _rint(w00 * a0 + w10 * b0 + w01 * c0 + w11 * d0)
        ch1 = _rint(w00 * a1 + w10 * b1 + w01 * c1 + w11 * d1)
        ch2 = _rint(w00 * a2 + w10 * b2 + w01 * c2 + w11 * d2)
        if BGR_SLOTS:
            red = ch2
            blue = ch0
        else:
            red = ch0
            blue = ch2
        green = ch1
        if HSV:
            gh = tl.load(gains + b * 3)
            gs = tl.load(gains + b * 3 + 1)
            gv = tl.load(gains + b * 3 + 2)
            mx = tl.maximum(tl.maximum(red, green), blue)
            d = mx - tl.minimum(tl.minimum(red, green), blue)
            safe = tl.where(d > 0, d, 1.0)
            hue = tl.where(mx == red, (green - blue) / safe,
                           tl.where(mx == green, (blue - red) / safe + 2.0, (red - green) / safe + 4.0))
            hue = tl.where(d > 0, hue, 0.0) + 6.0 * gh
            hue = hue - 6.0 * tl.floor(hue / 6.0)
            sat = tl.where(mx > 0, d / tl.where(mx > 0, mx, 1.0), 0.0)
            sat = tl.minimum(tl.maximum(sat * (1 + gs), 0.0), 1.0)
            val = tl.minimum(tl.maximum(mx * (1 + gv), 0.0), 255.0)
            red = _channel(5.0, hue, sat, val)
            green = _channel(3.0, hue, sat, val)
            blue = _channel(1.0, hue, sat, val)
        flip = tl.load(swap + b) != 0
        first = tl.where(flip, blue, red) * scale
        third = tl.where(flip, red, blue) * scale
        green = green * scale
        if ROUND_OUT:
            first = tl.minimum(tl.maximum(_rint(first), 0.0), 255.0)
            green = tl.minimum(tl.maximum(_rint(green), 0.0), 255.0)
            third = tl.minimum(tl.maximum(_rint(third), 0.0), 255.0)
        dst = out + b.to(tl.int64) * so_b + v.to(tl.int64) * so_y + u.to(tl.int64) * so_x
        kind = out.dtype.element_ty
        tl.store(dst, first.to(kind), mask=valid)
        tl.store(dst + so_c, green.to(kind), mask=valid)
        tl.store(dst + 2 * so_c, third.to(kind), mask=valid)

    class _Kernels:
        load = _load
        render = _render

    _KERNELS = _Kernels()

"""The Triton kernels of batchnorm_silu.py's fused training BatchNorm and SiLU, over the [M, C] view of a channels_last
tensor (M = N*H*W rows of C channels); per-channel vectors and partials in fp32. `triton` is None without Triton.

- stats_partial: each program's (mean, M2) per channel over its PER blocks of ROWS rows (Chan's pairwise merge);
- stats_finish: the partials merged the same way: mean, rstd, weight * rstd, and the running statistics updated;
- act_forward: y = act((x - mean) * weight * rstd + bias), rounded once;
- grad_partial / grad_finish: sum(dz) and sum(dz * xhat) per channel, dz = dy * act'(z), z recomputed from x;
- act_backward: dx = weight * rstd * (dz - sum(dz) / M - xhat * sum(dz * xhat) / M).
A program's rows start at pid * PER * ROWS; every block before the last row is full, so the counts merged follow
from M alone.
"""

from __future__ import annotations

try:  # compiled at the first launch; without Triton only the PyTorch twin runs
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - every torch build this project supports ships Triton on Linux
    triton = None


if triton is not None:
    @triton.jit
    def _dz(v, g, mean, rstd, w, b, ACT: tl.constexpr):
        """(dz, xhat) for a block: the gradient through the activation at z = xhat * w + b."""
        xhat = (v - mean[None, :]) * rstd[None, :]
        if ACT:
            z = xhat * w[None, :] + b[None, :]
            s = tl.sigmoid(z)
            dz = g * (s * (1.0 + z * (1.0 - s)))
        else:
            dz = g
        return dz, xhat

    @triton.jit
    def _channels(mean, rstd, weight, bias, c, cmask):
        """The backward's per-channel vectors of the channels `c`, in fp32."""
        mu = tl.load(mean + c, mask=cmask, other=0.0)
        rs = tl.load(rstd + c, mask=cmask, other=0.0)
        w = tl.load(weight + c, mask=cmask, other=0.0).to(tl.float32)
        b = tl.load(bias + c, mask=cmask, other=0.0).to(tl.float32)
        return mu, rs, w, b

    @triton.jit(do_not_specialize=["M", "PER"])
    def stats_partial(x, part_mean, part_m2, M, C, PER, ROWS: tl.constexpr, CHANNELS: tl.constexpr):
        pid = tl.program_id(0)
        c = tl.program_id(1) * CHANNELS + tl.arange(0, CHANNELS)
        cmask = c < C
        mean = tl.zeros([CHANNELS], tl.float32)
        m2 = tl.zeros([CHANNELS], tl.float32)
        start = pid * PER * ROWS
        for t in range(0, PER):
            r0 = start + t * ROWS
            r = r0 + tl.arange(0, ROWS)
            mask = (r < M)[:, None] & cmask[None, :]
            v = tl.load(x + r[:, None].to(tl.int64) * C + c[None, :], mask=mask, other=0.0).to(tl.float32)
            nb = tl.minimum(tl.maximum(M - r0, 0), ROWS).to(tl.float32)  # this block's rows
            na = tl.minimum(tl.maximum(M - start, 0), t * ROWS).to(tl.float32)  # the rows merged before it
            block_mean = tl.sum(v, axis=0) / tl.maximum(nb, 1.0)
            d = tl.where(mask, v - block_mean[None, :], 0.0)
            block_m2 = tl.sum(d * d, axis=0)
            delta = block_mean - mean
            frac = nb / tl.maximum(na + nb, 1.0)
            mean = mean + delta * frac
            m2 = m2 + block_m2 + delta * delta * na * frac
        tl.store(part_mean + pid * C + c, mean, mask=cmask)
        tl.store(part_m2 + pid * C + c, m2, mask=cmask)

    @triton.jit(do_not_specialize=["M", "P", "SPAN"])
    def stats_finish(part_mean, part_m2, mean_out, rstd_out, scale_out, weight, running_mean, running_var, M, C, P,
                     SPAN, momentum, eps, UPDATE: tl.constexpr, PARTS: tl.constexpr, CHANNELS: tl.constexpr):
        c = tl.program_id(0) * CHANNELS + tl.arange(0, CHANNELS)
        cmask = c < C
        mean = tl.zeros([CHANNELS], tl.float32)
        m2 = tl.zeros([CHANNELS], tl.float32)
        for p0 in range(0, P, PARTS):
            p = p0 + tl.arange(0, PARTS)
            pmask = p < P
            count = tl.where(pmask, tl.minimum(tl.maximum(M - p * SPAN, 0), SPAN), 0).to(tl.float32)
            mask = pmask[:, None] & cmask[None, :]
            pm = tl.load(part_mean + p[:, None] * C + c[None, :], mask=mask, other=0.0)
            pm2 = tl.load(part_m2 + p[:, None] * C + c[None, :], mask=mask, other=0.0)
            nb = tl.sum(count, axis=0)
            block_mean = tl.sum(pm * count[:, None], axis=0) / tl.maximum(nb, 1.0)
            d = pm - block_mean[None, :]
            block_m2 = tl.sum(pm2 + count[:, None] * d * d, axis=0)
            na = tl.minimum(M, p0 * SPAN).to(tl.float32)
            delta = block_mean - mean
            frac = nb / tl.maximum(na + nb, 1.0)
            mean = mean + delta * frac
            m2 = m2 + block_m2 + delta * delta * na * frac
        n = M.to(tl.float32)
        var = m2 / n
        rstd = 1.0 / tl.sqrt(var + eps)
        w = tl.load(weight + c, mask=cmask, other=0.0).to(tl.float32)
        tl.store(mean_out + c, mean, mask=cmask)
        tl.store(rstd_out + c, rstd, mask=cmask)
        tl.store(scale_out + c, w * rstd, mask=cmask)
        if UPDATE:  # torch.nn.BatchNorm2d's update: the unbiased variance
            rm = tl.load(running_mean + c, mask=cmask, other=0.0).to(tl.float32)
            rv = tl.load(running_var + c, mask=cmask, other=0.0).to(tl.float32)
            rm = momentum * mean + (1.0 - momentum) * rm
            rv = momentum * (var * (n / (n - 1.0))) + (1.0 - momentum) * rv
            tl.store(running_mean + c, rm.to(running_mean.dtype.element_ty), mask=cmask)
            tl.store(running_var + c, rv.to(running_var.dtype.element_ty), mask=cmask)

    @triton.jit(do_not_specialize=["M"])
    def act_forward(x, y, mean, scale, bias, M, C, ACT: tl.constexpr, ROWS: tl.constexpr, CHANNELS: tl.constexpr):
        r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        c = tl.program_id(1) * CHANNELS + tl.arange(0, CHANNELS)
        cmask = c < C
        mask = (r < M)[:, None] & cmask[None, :]
        mu = tl.load(mean + c, mask=cmask, other=0.0)
        sc = tl.load(scale + c, mask=cmask, other=0.0)
        b = tl.load(bias + c, mask=cmask, other=0.0).to(tl.float32)
        v = tl.load(x + r[:, None] * C + c[None, :], mask=mask, other=0.0).to(tl.float32)
        z = (v - mu[None, :]) * sc[None, :] + b[None, :]
        if ACT:
            z = z * tl.sigmoid(z)
        tl.store(y + r[:, None] * C + c[None, :], z.to(y.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["M", "PER"])
    def grad_partial(x, dy, mean, rstd, weight, bias, part_dz, part_dzx, M, C, PER, ACT: tl.constexpr,
                     ROWS: tl.constexpr, CHANNELS: tl.constexpr):
        pid = tl.program_id(0)
        c = tl.program_id(1) * CHANNELS + tl.arange(0, CHANNELS)
        cmask = c < C
        mu, rs, w, b = _channels(mean, rstd, weight, bias, c, cmask)
        sum_dz = tl.zeros([CHANNELS], tl.float32)
        sum_dzx = tl.zeros([CHANNELS], tl.float32)
        start = pid * PER * ROWS
        for t in range(0, PER):
            r = start + t * ROWS + tl.arange(0, ROWS)
            mask = (r < M)[:, None] & cmask[None, :]
            at = r[:, None].to(tl.int64) * C + c[None, :]
            v = tl.load(x + at, mask=mask, other=0.0).to(tl.float32)
            g = tl.load(dy + at, mask=mask, other=0.0).to(tl.float32)
            dz, xhat = _dz(v, g, mu, rs, w, b, ACT)
            dz = tl.where(mask, dz, 0.0)
            sum_dz += tl.sum(dz, axis=0)
            sum_dzx += tl.sum(dz * xhat, axis=0)
        tl.store(part_dz + pid * C + c, sum_dz, mask=cmask)
        tl.store(part_dzx + pid * C + c, sum_dzx, mask=cmask)

    @triton.jit(do_not_specialize=["P"])
    def grad_finish(part_dz, part_dzx, dweight, dbias, C, P, PARTS: tl.constexpr, CHANNELS: tl.constexpr):
        c = tl.program_id(0) * CHANNELS + tl.arange(0, CHANNELS)
        cmask = c < C
        sum_dz = tl.zeros([CHANNELS], tl.float32)
        sum_dzx = tl.zeros([CHANNELS], tl.float32)
        for p0 in range(0, P, PARTS):
            p = p0 + tl.arange(0, PARTS)
            mask = (p < P)[:, None] & cmask[None, :]
            sum_dz += tl.sum(tl.load(part_dz + p[:, None] * C + c[None, :], mask=mask, other=0.0), axis=0)
            sum_dzx += tl.sum(tl.load(part_dzx + p[:, None] * C + c[None, :], mask=mask, other=0.0), axis=0)
        tl.store(dbias + c, sum_dz, mask=cmask)
        tl.store(dweight + c, sum_dzx, mask=cmask)

    @triton.jit(do_not_specialize=["M"])
    def act_backward(x, dy, dx, mean, rstd, weight, bias, dweight, dbias, M, C, ACT: tl.constexpr,
                     ROWS: tl.constexpr, CHANNELS: tl.constexpr):
        r = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        c = tl.program_id(1) * CHANNELS + tl.arange(0, CHANNELS)
        cmask = c < C
        mask = (r < M)[:, None] & cmask[None, :]
        mu, rs, w, b = _channels(mean, rstd, weight, bias, c, cmask)
        n = M.to(tl.float32)
        mean_dz = tl.load(dbias + c, mask=cmask, other=0.0) / n
        mean_dzx = tl.load(dweight + c, mask=cmask, other=0.0) / n
        at = r[:, None] * C + c[None, :]
        v = tl.load(x + at, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(dy + at, mask=mask, other=0.0).to(tl.float32)
        dz, xhat = _dz(v, g, mu, rs, w, b, ACT)
        out = (w * rs)[None, :] * (dz - mean_dz[None, :] - xhat * mean_dzx[None, :])
        tl.store(dx + at, out.to(dx.dtype.element_ty), mask=mask)

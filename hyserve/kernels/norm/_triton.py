"""Triton kernels for :mod:`hyserve.kernels.norm` (imported lazily: only the CUDA path and interpreter tests need them).

One program normalises ``ROWS`` rows of ``D`` elements in float32 and stores them in the output's dtype, repeating
the roundings of the torch reference so that bf16 results agree with it to within the reduction order. ``SCALED``
(a constexpr) picks the weight's form: ``1 + w`` in float32 (Qwen's), or ``w`` times the norm already rounded to the
input's dtype (Nemotron-H's, Granite's and Falcon-H1's ``ScaledRMSNorm``), the product rounded to the output's dtype
(``w``'s and ``x``'s promoted dtype, as torch multiplies them).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["_add_rms_norm_kernel", "_gated_rms_norm_kernel", "_gated_sum_squares_kernel",
           "_grouped_gated_rms_norm_kernel", "_l2_norm_heads_kernel", "_rms_norm_kernel", "_silu_mul_kernel",
           "_silu_mul_quant_kernel"]


@triton.jit
def _rows_rstd(x_ptr, N, D, sx, eps, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's rows of ``x`` in float32 and their ``rsqrt(mean(x^2) + eps)``, with the index masks."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = tl.arange(0, BLOCK_D)
    dmask = offs < D
    mask = (rows < N)[:, None] & dmask[None, :]
    x = tl.load(x_ptr + rows[:, None] * sx + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    return rows, offs, dmask, mask, x, rstd


@triton.jit
def _weighted(x, rstd, w, dt, SCALED: tl.constexpr):
    """The normalised rows ``x * rstd`` under the weight ``w`` (float32): ``* (1 + w)``, or with ``SCALED`` rounded to
    the input's dtype ``dt`` first, then ``* w`` (a product of two 16-bit values is exact in float32, so rounding it
    once to the output's dtype is torch's product)."""
    if SCALED:
        y = w[None, :] * (x * rstd[:, None]).to(dt).to(tl.float32)
    else:
        y = (x * rstd[:, None]) * (1.0 + w)[None, :]
    return y


@triton.jit
def _store_rows(y, rows, offs, mask, N, out_ptr, so, q_ptr, sq, s_ptr, fp8_max, amax_eps,
                QUANT: tl.constexpr, KEEP: tl.constexpr, dt: tl.constexpr):
    """Store the rows ``y`` (float32) rounded to ``dt`` in ``out``, or (``QUANT``) quantized per token: the rounded
    rows' ``scale = max(amax, amax_eps) / fp8_max`` to ``s_ptr`` (one a row) and ``fp8(clamp(y / scale))`` to ``q``,
    the arithmetic of ``hyserve.kernels.fp8.quantize_per_token`` on the rounded output (``KEEP``: ``out`` too)."""
    yr = y.to(dt)
    if (not QUANT) or KEEP:
        tl.store(out_ptr + rows[:, None] * so + offs[None, :], yr, mask=mask)
    if QUANT:
        yf = yr.to(tl.float32)
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.where(mask, tl.abs(yf), 0.0), axis=1), amax_eps), fp8_max)
        q = tl.clamp(tl.math.div_rn(yf, scale[:, None]), -fp8_max, fp8_max)
        tl.store(q_ptr + rows[:, None] * sq + offs[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + rows, scale, mask=rows < N)


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, N, D, sx, so, eps, q_ptr, sq, s_ptr, fp8_max, amax_eps,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr, SCALED: tl.constexpr, QUANT: tl.constexpr = False,
    KEEP: tl.constexpr = False,
):  # fmt: skip
    """``out = x * rsqrt(mean(x^2) + eps) * (1 + w)`` (zero-centred weight), float32 inside; ``SCALED``:
    ``out = w * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``. ``QUANT``: the rows quantized per token for an FP8 GEMM
    (:func:`_store_rows`)."""
    rows, offs, dmask, mask, x, rstd = _rows_rstd(x_ptr, N, D, sx, eps, ROWS, BLOCK_D)
    w = tl.load(w_ptr + offs, mask=dmask, other=0.0).to(tl.float32)
    y = _weighted(x, rstd, w, x_ptr.dtype.element_ty, SCALED)
    _store_rows(y, rows, offs, mask, N, out_ptr, so, q_ptr, sq, s_ptr, fp8_max, amax_eps, QUANT, KEEP,
                out_ptr.dtype.element_ty)


@triton.jit
def _gated_rms_norm_kernel(
    x_ptr, g_ptr, w_ptr, out_ptr, N, D, sx, sg, so, eps, GH, sg_h,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """``out = (w * norm(x).to(dtype)).to(dtype) * silu(gate)``, as the reference (and transformers) round. The gate's
    row ``n`` is head ``n % GH`` of token ``n // GH`` (strides ``sg``, ``sg_h``): a gate that is a strided view of
    ``(T, GH, D)`` heads (GDN's z, a slice of the input projection's output) is read where it lies."""
    rows, offs, dmask, mask, x, rstd = _rows_rstd(x_ptr, N, D, sx, eps, ROWS, BLOCK_D)
    dt = out_ptr.dtype.element_ty
    n = (x * rstd[:, None]).to(dt).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=dmask, other=0.0).to(tl.float32)
    o = (w[None, :] * n).to(dt).to(tl.float32)
    g_row = (rows // GH).to(tl.int64) * sg + (rows % GH).to(tl.int64) * sg_h
    g = tl.load(g_ptr + g_row[:, None] + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    y = o * (g * tl.sigmoid(g))
    tl.store(out_ptr + rows[:, None] * so + offs[None, :], y.to(dt), mask=mask)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, d_ptr, w_ptr, res_ptr, out_ptr, N, D, sx, sd, sr, so, eps, scale, q_ptr, sq, s_ptr, fp8_max, amax_eps,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr, SCALED: tl.constexpr, HAS_SCALE: tl.constexpr,
    QUANT: tl.constexpr = False, KEEP: tl.constexpr = False,
):  # fmt: skip
    """``res = x + d`` (rounded to the dtype, as a torch add is) and ``out = rms_norm(res)`` under the weight
    (``SCALED`` as :func:`_rms_norm_kernel`). ``HAS_SCALE``: ``res = x + d * scale``, the product rounded to
    ``d``'s dtype first (torch's ``x + d * scale`` with a Python float ``scale``)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = tl.arange(0, BLOCK_D)
    dmask = offs < D
    mask = (rows < N)[:, None] & dmask[None, :]
    dt = res_ptr.dtype.element_ty
    x = tl.load(x_ptr + rows[:, None] * sx + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    d = tl.load(d_ptr + rows[:, None] * sd + offs[None, :], mask=mask, other=0.0)
    if HAS_SCALE:
        d = (d.to(tl.float32) * scale).to(d_ptr.dtype.element_ty)
    r = (x + d.to(tl.float32)).to(dt)
    tl.store(res_ptr + rows[:, None] * sr + offs[None, :], r, mask=mask)
    rf = r.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(rf * rf, axis=1) / D + eps)
    w = tl.load(w_ptr + offs, mask=dmask, other=0.0).to(tl.float32)
    y = _weighted(rf, rstd, w, dt, SCALED)
    _store_rows(y, rows, offs, mask, N, out_ptr, so, q_ptr, sq, s_ptr, fp8_max, amax_eps, QUANT, KEEP,
                out_ptr.dtype.element_ty)


@triton.jit
def _gated_rows(
    y_ptr, z_ptr, N, G, W, sy, sz,
    NORM_BEFORE_GATE: tl.constexpr, ROWS: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    """This program's ``ROWS`` (token, group) pairs of ``N * G`` (the group of ``W`` channels at ``g * W`` of token
    ``t``'s row): ``h`` (``y`` float32, times ``silu(z)`` unless ``NORM_BEFORE_GATE``), ``silu(z)``, the token of
    each pair, its first channel and the masks."""
    pairs = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = tl.arange(0, BLOCK_W)
    tok = (pairs // G).to(tl.int64)
    col = (pairs % G) * W
    mask = (pairs < N * G)[:, None] & (offs < W)[None, :]
    y = tl.load(y_ptr + (tok * sy + col)[:, None] + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + (tok * sz + col)[:, None] + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    gate = z / (1.0 + tl.exp(-z))  # torch's silu
    if NORM_BEFORE_GATE:
        h = y
    else:
        h = y * gate
    return pairs, offs, tok, col, mask, h, gate


@triton.jit
def _grouped_gated_rms_norm_kernel(
    y_ptr, z_ptr, w_ptr, ss_ptr, out_ptr, N, G, W, sy, sz, so, divisor, eps,
    NORM_BEFORE_GATE: tl.constexpr, NORM: tl.constexpr, GIVEN_SUM: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    """Mamba2's gated norm over a float32 ``y`` (the scan's output) in groups of ``W`` channels, float32 throughout,
    one rounding to the output's dtype: ``w * norm(y * silu(z))``, or with ``NORM_BEFORE_GATE``
    ``(w * norm(y)) * silu(z)``, where ``norm(h) = h * rsqrt(sum(h^2) / divisor + eps)`` over the group (``divisor``
    is ``W``, or with ``GIVEN_SUM`` the width of a group spanning ranks whose sums of squares ``ss`` (one per token)
    were all-reduced). Without ``NORM``: ``y * silu(z)``, ``silu(z)`` rounded to ``z``'s dtype (torch's
    ``y * silu(z)``)."""
    pairs, offs, tok, col, mask, h, gate = _gated_rows(y_ptr, z_ptr, N, G, W, sy, sz, NORM_BEFORE_GATE, ROWS,
                                                       BLOCK_W)
    if NORM:
        if GIVEN_SUM:
            ss = tl.load(ss_ptr + tok, mask=pairs < N * G, other=0.0)
        else:
            ss = tl.sum(h * h, axis=1)
        rstd = 1.0 / tl.sqrt(ss / divisor + eps)
        w = tl.load(w_ptr + col[:, None] + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        o = w * (h * rstd[:, None])
        if NORM_BEFORE_GATE:
            o = o * gate
    else:
        o = h * gate.to(z_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + (tok * so + col)[:, None] + offs[None, :], o.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_sum_squares_kernel(
    y_ptr, z_ptr, ss_ptr, N, W, sy, sz,
    NORM_BEFORE_GATE: tl.constexpr, ROWS: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    """``ss[t] = sum(h^2)`` over token ``t``'s ``W`` channels (``h`` as :func:`_gated_rows`, one group a row): this
    rank's part of a gated-norm group that spans ranks, all-reduced before :func:`_grouped_gated_rms_norm_kernel`."""
    pairs, _, tok, _, _, h, _ = _gated_rows(y_ptr, z_ptr, N, 1, W, sy, sz, NORM_BEFORE_GATE, ROWS, BLOCK_W)
    tl.store(ss_ptr + tok, tl.sum(h * h, axis=1), mask=pairs < N)


@triton.jit
def _gate_act(g, SIGMOID: tl.constexpr):
    """``silu(g)`` or (``SIGMOID``) ``sigmoid(g)`` in float32."""
    if SIGMOID:
        return 1.0 / (1.0 + tl.exp(-g))
    return g / (1.0 + tl.exp(-g))


@triton.jit
def _gate_cols(cols, sgh, HD, PER_HEAD: tl.constexpr):
    """Where column ``cols`` of the gate lies in its row: ``(c // HD) * sgh + c % HD`` for a per-head slice of a
    wider projection output (``PER_HEAD``), ``c`` for plain rows (no integer division a column)."""
    if PER_HEAD:
        return (cols // HD) * sgh + cols % HD
    return cols


@triton.jit
def _silu_mul_kernel(
    g_ptr, u_ptr, out_ptr, N, F, sg, su, so, sgh, HD,
    BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr, SIGMOID: tl.constexpr = False, PER_HEAD: tl.constexpr = False,
):  # fmt: skip
    """``out = silu(g) * u`` (``SIGMOID``: ``sigmoid(g) * u``, the attention output's gate), each op rounded to the
    dtype as in torch (``F.silu(g) * u``). With ``PER_HEAD`` column ``c`` of ``g`` is at ``(c // HD) * sgh + c % HD``
    in its row (a per-head slice of a wider projection output); else at ``c`` (plain rows)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows < N)[:, None] & (cols < F)[None, :]
    dt = out_ptr.dtype.element_ty
    gcols = _gate_cols(cols, sgh, HD, PER_HEAD)
    g = tl.load(g_ptr + rows[:, None] * sg + gcols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rows[:, None] * su + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    s = _gate_act(g, SIGMOID).to(dt).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * so + cols[None, :], (s * u).to(dt), mask=mask)


@triton.jit
def _silu_mul_quant_kernel(
    g_ptr, u_ptr, out_ptr, q_ptr, s_ptr, F, sg, su, so, sq, fp8_max, amax_eps, sgh, HD,
    BLOCK_F: tl.constexpr, KEEP: tl.constexpr, SIGMOID: tl.constexpr = False, PER_HEAD: tl.constexpr = False,
):  # fmt: skip
    """Row ``program_id(0)`` of ``silu(g) * u`` (rounded as :func:`_silu_mul_kernel` rounds it) quantized per token
    for an FP8 GEMM: a first pass over the row for its amax, a second for the values (``KEEP``: the rounded row to
    ``out`` too). The arithmetic of ``hyserve.kernels.fp8.quantize_per_token`` on :func:`_silu_mul_kernel`'s output."""
    row = tl.program_id(0).to(tl.int64)
    dt = g_ptr.dtype.element_ty
    amax = tl.zeros([BLOCK_F], dtype=tl.float32)
    for lo in range(0, F, BLOCK_F):
        cols = lo + tl.arange(0, BLOCK_F)
        m = cols < F
        g = tl.load(g_ptr + row * sg + _gate_cols(cols, sgh, HD, PER_HEAD), mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * su + cols, mask=m, other=0.0).to(tl.float32)
        y = (_gate_act(g, SIGMOID).to(dt).to(tl.float32) * u).to(dt).to(tl.float32)
        amax = tl.maximum(amax, tl.where(m, tl.abs(y), 0.0))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), amax_eps), fp8_max)
    tl.store(s_ptr + row, scale)
    for lo in range(0, F, BLOCK_F):
        cols = lo + tl.arange(0, BLOCK_F)
        m = cols < F
        g = tl.load(g_ptr + row * sg + _gate_cols(cols, sgh, HD, PER_HEAD), mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * su + cols, mask=m, other=0.0).to(tl.float32)
        yr = (_gate_act(g, SIGMOID).to(dt).to(tl.float32) * u).to(dt)
        if KEEP:
            tl.store(out_ptr + row * so + cols, yr, mask=m)
        q = tl.clamp(tl.math.div_rn(yr.to(tl.float32), scale), -fp8_max, fp8_max)
        tl.store(q_ptr + row * sq + cols, q.to(q_ptr.dtype.element_ty), mask=m)


@triton.jit
def _l2_norm_heads_kernel(
    x_ptr, out_ptr, N, H, D, st, sh, eps,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Rows (t, h) of a strided ``(T, H, D)`` ``x`` (unit last stride): ``out = x * rsqrt(sum(x^2) + eps)`` into a
    contiguous ``(T, H, D)`` output, float32 inside."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs = tl.arange(0, BLOCK_D)
    mask = (rows < N)[:, None] & (offs < D)[None, :]
    src = (rows // H).to(tl.int64) * st + (rows % H).to(tl.int64) * sh
    x = tl.load(x_ptr + src[:, None] + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) + eps)
    y = x * rstd[:, None]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * D + offs[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)

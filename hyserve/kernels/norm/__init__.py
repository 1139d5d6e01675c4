"""RMSNorm over the last dimension: the zero-centred form (scale ``1 + w``), the GDN output's gated form, the scaled
form of the Mamba2 families (scale ``w``) and Mamba2's grouped gated norm.

Entry points :func:`rms_norm`, :func:`add_rms_norm` (the residual add fused in) and :func:`gated_rms_norm`, the
MLP's :func:`silu_mul` and the gated attention's output gate :func:`sigmoid_mul` (the same kernel): on CUDA one
Triton launch each (the torch formulation takes two to twelve launches per call, which a host-bound decode step pays
dozens of times per layer); elsewhere
the plain-torch references of ``reference.py``, which define the semantics: normalise in float32 and cast back to the
input dtype; the gated form rounds to the input dtype before its weight and after it, as transformers does. The Triton
kernels are in ``_triton.py``.

The Mamba2 families' entry points, :func:`scaled_rms_norm`, :func:`add_scaled_rms_norm` (the residual add, optionally
scaled, fused in), :func:`grouped_gated_rms_norm` and :func:`silu_gate` (Mamba2's gate without a norm), take the
kernels where :func:`hyserve.kernels.moe.uses_triton` (CUDA, or the Triton interpreter in tests), one launch each
(two and an all-reduce for a gated-norm group spanning tensor-parallel ranks: :func:`gated_sum_squares` first), and
the references elsewhere or past the kernels' widest row (:data:`MAX_WIDTH`).
"""

from __future__ import annotations

from typing import Any

import torch

from hyserve.kernels.fp8.reference import AMAX_EPS, FP8_DTYPE, FP8_MAX, Fp8Activation, quantize_activation_ref
from hyserve.kernels.moe import uses_triton
from hyserve.kernels.norm.reference import (
    add_rms_norm_ref,
    add_scaled_rms_norm_ref,
    gated_rms_norm_ref,
    gated_sum_squares_ref,
    grouped_gated_rms_norm_ref,
    l2_norm_heads_ref,
    rms_norm_ref,
    scaled_rms_norm_ref,
    sigmoid_mul_ref,
    silu_gate_ref,
    silu_mul_ref,
)
from hyserve.utils import next_pow2

__all__ = ["MAX_WIDTH", "QUANT_MODES", "add_rms_norm", "add_rms_norm_ref", "add_scaled_rms_norm",
           "add_scaled_rms_norm_ref", "gated_quant_launch", "gated_rms_norm", "gated_rms_norm_ref", "gated_sum_squares",
           "gated_sum_squares_ref", "grouped_gated_rms_norm", "grouped_gated_rms_norm_ref", "rms_norm", "rms_norm_ref",
           "scaled_rms_norm", "scaled_rms_norm_ref", "sigmoid_mul", "sigmoid_mul_ref", "sigmoid_mul_triton",
           "silu_gate", "silu_gate_ref", "silu_mul", "silu_mul_ref"]

_MAX_BLOCK_D = 16384
MAX_WIDTH = _MAX_BLOCK_D  # the widest row (or gated-norm group) one program normalises


# What a producer hands an FP8 GEMM (``quant``): None, the plain activation; ``"fp8"``, the activation quantized per
# token as an :class:`Fp8Activation` (the GEMM skips its quantization launch); ``"fp8+plain"``, both (a merged
# projection with unquantized parts reads the plain one).
QUANT_MODES = (None, "fp8", "fp8+plain")


def _as_activation(y: torch.Tensor, quant: str | None) -> torch.Tensor | Fp8Activation:
    """The reference path's output in the form ``quant`` asks for."""
    assert quant in QUANT_MODES, quant
    return y if quant is None else quantize_activation_ref(y, keep_plain=quant == "fp8+plain")


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 quant: str | None = None) -> tuple[torch.Tensor, torch.Tensor | Fp8Activation]:
    """``(x + delta, rms_norm(x + delta))``: the residual stream and its norm, the add rounded to ``x.dtype``; the
    norm quantized per token for the next FP8 GEMM as ``quant`` says (:data:`QUANT_MODES`), in the same launch."""
    if not x.is_cuda:
        res, y = add_rms_norm_ref(x, delta, weight, eps)
        return res, _as_activation(y, quant)
    return add_rms_norm_triton(x, delta, weight, eps, quant)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, quant: str | None = None) -> torch.Tensor | Fp8Activation:
    """``silu(gate) * up`` (SwiGLU), in ``gate.dtype``; quantized per token for the next FP8 GEMM as ``quant``
    says (:data:`QUANT_MODES`), in the same launch."""
    if not gate.is_cuda:
        return _as_activation(silu_mul_ref(gate, up), quant)
    return silu_mul_triton(gate, up, quant)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             quant: str | None = None) -> torch.Tensor | Fp8Activation:
    """``x * rsqrt(mean(x^2) + eps) * (1 + weight)`` over the last dim, in float32, returned in ``x.dtype``; quantized
    per token for the next FP8 GEMM as ``quant`` says (:data:`QUANT_MODES`), in the same launch."""
    if not x.is_cuda:
        return _as_activation(rms_norm_ref(x, weight, eps), quant)
    return rms_norm_triton(x, weight, eps, quant)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """``weight * norm(x) * silu(gate)`` over the last dim (weight not zero-centred), returned in ``x.dtype``;
    written into ``out`` (contiguous, ``x``'s number of elements and dtype) where given, and that returned in ``x``'s
    shape."""
    if out is not None:
        assert out.is_contiguous() and out.numel() == x.numel() and out.dtype == x.dtype, \
            "out must be contiguous, with x's size and dtype"
    if not x.is_cuda:
        ref = gated_rms_norm_ref(x, gate, weight, eps)
        return ref if out is None else out.view(x.shape).copy_(ref)
    return gated_rms_norm_triton(x, gate, weight, eps, out)


def l2_norm_heads(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum(x^2) + eps)`` over the last dim of a ``(T, H, D)`` tensor (any strides but a unit last one),
    in float32, returned contiguous in ``x.dtype`` (the q/k norm of the gated delta rule)."""
    if not x.is_cuda:
        return l2_norm_heads_ref(x, eps)
    return l2_norm_heads_triton(x, eps)


def l2_norm_heads_triton(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    from hyserve.kernels.norm._triton import _l2_norm_heads_kernel

    t, h, d = x.shape
    if x.stride(2) != 1:
        x = x.contiguous()
    out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    n = t * h
    if n:
        block_d, rows, warps = _launch(d)
        _l2_norm_heads_kernel[(-(-n // rows),)](x, out, n, h, d, x.stride(0), x.stride(1), float(eps),
                                                ROWS=rows, BLOCK_D=block_d, num_warps=warps)
    return out


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``(N, D)`` rows with a unit last stride (a view when possible)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(d: int) -> tuple[int, int, int]:
    """(BLOCK_D, ROWS per program, num_warps): several rows per program when rows are short (q/k norms)."""
    block_d = max(16, 1 << (d - 1).bit_length())
    if block_d > _MAX_BLOCK_D:
        raise ValueError(f"rms_norm supports a last dim of at most {_MAX_BLOCK_D} (got {d})")
    rows = max(1, min(16, 2048 // block_d))
    warps = 4 if block_d * rows <= 4096 else 8
    return block_d, rows, warps


def _quant_buffers(n: int, d: int, like: torch.Tensor, quant: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 values and per-token scales a producer writes (``quant``), or stand-ins it never touches."""
    assert quant in QUANT_MODES, quant
    if quant is None:
        return like, like
    return (torch.empty((n, d), dtype=FP8_DTYPE, device=like.device),
            torch.empty((n, 1), dtype=torch.float32, device=like.device))


def _produced(out: torch.Tensor, q: torch.Tensor, s: torch.Tensor, shape: torch.Size,
              quant: str | None) -> torch.Tensor | Fp8Activation:
    if quant is None:
        return out.view(shape)
    return Fp8Activation(q, s, out.dtype, out if quant == "fp8+plain" else None)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    quant: str | None = None) -> torch.Tensor | Fp8Activation:
    from hyserve.kernels.norm._triton import _rms_norm_kernel

    d = x.shape[-1]
    assert weight.shape == (d,), "weight must be (D,)"
    x2 = _rows(x)
    n = x2.shape[0]
    out = torch.empty((n, d), dtype=x.dtype, device=x.device)
    q, s = _quant_buffers(n, d, out, quant)
    if n:
        block_d, rows, warps = _launch(d)
        _rms_norm_kernel[(-(-n // rows),)](x2, weight, out, n, d, x2.stride(0), out.stride(0), float(eps),
                                            q, q.stride(0), s, FP8_MAX, AMAX_EPS,
                                            ROWS=rows, BLOCK_D=block_d, SCALED=False, QUANT=quant is not None,
                                            KEEP=quant == "fp8+plain", num_warps=warps)
    return _produced(out, q, s, x.shape, quant)


def gated_rms_norm_triton(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    from hyserve.kernels.norm._triton import _gated_rms_norm_kernel

    d = x.shape[-1]
    assert weight.shape == (d,) and gate.shape == x.shape, "weight must be (D,) and gate shaped like x"
    x2 = _rows(x)
    g2, heads, s_head = _head_rows(gate)
    n = x2.shape[0]
    out = torch.empty((n, d), dtype=x.dtype, device=x.device) if out is None else out.view(n, d)
    if n:
        block_d, rows, warps = _launch(d)
        _gated_rms_norm_kernel[(-(-n // rows),)](x2, g2, weight, out, n, d, x2.stride(0), g2.stride(0),
                                                  out.stride(0), float(eps), heads, s_head,
                                                  ROWS=rows, BLOCK_D=block_d, num_warps=warps)
    return out.view(x.shape)


def _head_rows(t: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``t``'s rows for a kernel that reads row ``n`` at ``(n // heads) * t2.stride(0) + (n % heads) * s_head``:
    ``(t2, heads, s_head)``. Rows that are one stride apart come as ``(N, D)`` rows (``heads`` 1); a ``(T, H, D)``
    whose heads are not (a strided view, as GDN's z is of the input projection's output) as its tokens, with the
    heads' stride, so that nothing is copied."""
    if t.dim() == 3 and t.stride(-1) == 1 and t.shape[1] > 1 and t.stride(0) != t.shape[1] * t.stride(1):
        return t, t.shape[1], t.stride(1)
    return _rows(t), 1, 0


def add_rms_norm_triton(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                        quant: str | None = None) -> tuple[torch.Tensor, torch.Tensor | Fp8Activation]:
    from hyserve.kernels.norm._triton import _add_rms_norm_kernel

    d = x.shape[-1]
    assert weight.shape == (d,) and delta.shape == x.shape, "weight must be (D,) and delta shaped like x"
    x2, d2 = _rows(x), _rows(delta)
    n = x2.shape[0]
    res = torch.empty((n, d), dtype=x.dtype, device=x.device)
    out = torch.empty((n, d), dtype=x.dtype, device=x.device)
    q, s = _quant_buffers(n, d, out, quant)
    if n:
        block_d, rows, warps = _launch(d)
        _add_rms_norm_kernel[(-(-n // rows),)](x2, d2, weight, res, out, n, d, x2.stride(0), d2.stride(0),
                                                res.stride(0), out.stride(0), float(eps), 1.0,
                                                q, q.stride(0), s, FP8_MAX, AMAX_EPS,
                                                ROWS=rows, BLOCK_D=block_d, SCALED=False, HAS_SCALE=False,
                                                QUANT=quant is not None, KEEP=quant == "fp8+plain",
                                                num_warps=warps)
    return res.view(x.shape), _produced(out, q, s, x.shape, quant)


# Columns a program of the quantizing SwiGLU takes at a time (one program a row, two passes over it).
_SILU_QUANT_BLOCK = 2048


def gated_quant_launch(width: int) -> tuple[int, int]:
    """``(BLOCK_F, num_warps)`` of the quantizing SwiGLU / sigmoid gate over ``width``-wide rows (one program a row,
    two passes of ``BLOCK_F`` columns at a time; ``benchmarks/fp8_quant_bench.py`` sweeps other choices). From that
    sweep on an H100 (2026-12-05, batch 1-64): the 27B's 17,408 columns took 11.0-11.4 us at (8192, 16) against
    16.9-17.2 at (2048, 4)."""
    if width > 8192:
        return 8192, 16
    return min(_SILU_QUANT_BLOCK, next_pow2(width)), 4


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor, quant: str | None = None,
                    launch: tuple[int, int] | None = None) -> torch.Tensor | Fp8Activation:
    """``launch``: the quantizing pass's ``(BLOCK_F, num_warps)`` instead of :func:`gated_quant_launch`'s."""
    assert gate.shape == up.shape, "gate and up must have one shape"
    g2, u2 = _rows(gate), _rows(up)
    out = _gated_product(g2, g2.stride(0), 0, g2.shape[1], u2, quant, sigmoid=False, launch=launch)
    return out if isinstance(out, Fp8Activation) else out.view(gate.shape)


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor, quant: str | None = None) -> torch.Tensor | Fp8Activation:
    """``x * sigmoid(gate)`` (the gated attention's output, ``(T, W)`` rows), in ``x.dtype``, each op rounded as
    torch rounds it; ``gate`` ``(T, W)`` or per head ``(T, H, D)`` with ``H * D = W`` at any head and row strides
    (the chunk of ``q_proj``'s output: no copy). Quantized per token for the next FP8 GEMM as ``quant`` says
    (:data:`QUANT_MODES`), in the same launch."""
    if not x.is_cuda:
        return _as_activation(sigmoid_mul_ref(gate.reshape(x.shape), x), quant)
    return sigmoid_mul_triton(x, gate, quant)


def sigmoid_mul_triton(x: torch.Tensor, gate: torch.Tensor,
                       quant: str | None = None) -> torch.Tensor | Fp8Activation:
    w = x.shape[1]
    assert x.stride(1) == 1 and gate.stride(-1) == 1 and gate.numel() == x.numel(), (x.shape, gate.shape)
    if gate.dim() == 3:
        g, sgh, hd = gate, gate.stride(1), gate.shape[2]
    else:
        g, sgh, hd = gate, 0, w
    return _gated_product(g, g.stride(0), sgh, hd, x, quant, sigmoid=True)


def _gated_product(g: torch.Tensor, sg: int, sgh: int, hd: int, u: torch.Tensor, quant: str | None,
                   sigmoid: bool, launch: tuple[int, int] | None = None) -> torch.Tensor | Fp8Activation:
    """``act(g) * u`` over ``u``'s ``(N, F)`` rows (``g``'s column ``c`` at ``(c // hd) * sgh + c % hd`` where
    ``sgh`` is not 0, a gate read per head; at ``c`` otherwise, with no integer division a column)."""
    from hyserve.kernels.norm._triton import _silu_mul_kernel, _silu_mul_quant_kernel

    n, f = u.shape
    out = torch.empty((n, f), dtype=u.dtype, device=u.device)
    if quant is not None:
        q, s = _quant_buffers(n, f, out, quant)
        if n and f:
            block_f, warps = launch or gated_quant_launch(f)
            assert block_f == next_pow2(block_f), "BLOCK_F must be a power of two"
            _silu_mul_quant_kernel[(n,)](g, u, out, q, s, f, sg, u.stride(0), out.stride(0),
                                         q.stride(0), FP8_MAX, AMAX_EPS, sgh, hd, BLOCK_F=block_f,
                                         KEEP=quant == "fp8+plain", SIGMOID=sigmoid, PER_HEAD=sgh != 0,
                                         num_warps=warps)
        return _produced(out, q, s, out.shape, quant)
    if n and f:
        block_f = min(1024, max(16, 1 << (f - 1).bit_length()))
        block_t = 4096 // block_f  # 4096 elements a program: 4 rows of 1024 (SwiGLU), 16 heads of 256 (the gate)
        _silu_mul_kernel[(-(-n // block_t), -(-f // block_f))](g, u, out, n, f, sg, u.stride(0), out.stride(0),
                                                                 sgh, hd, BLOCK_T=block_t, BLOCK_F=block_f,
                                                                 SIGMOID=sigmoid, PER_HEAD=sgh != 0, num_warps=4)
    return out


def scaled_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` over the last dim (normalised in float32, rounded to
    ``x.dtype``, then weighted in the promoted dtype: transformers' ``NemotronHRMSNorm``)."""
    if not (uses_triton(x) and x.shape[-1] <= MAX_WIDTH):
        return scaled_rms_norm_ref(x, weight, eps)
    return scaled_rms_norm_triton(x, weight, eps)


def add_scaled_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                        scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(r, scaled_rms_norm(r))`` for the residual stream ``r = x + delta * scale`` (``delta * scale`` rounded to
    ``delta``'s dtype, then the add to ``x``'s, as torch computes it; no product when ``scale`` is 1)."""
    if not (uses_triton(x) and x.shape[-1] <= MAX_WIDTH and delta.dtype == x.dtype):
        return add_scaled_rms_norm_ref(x, delta, weight, eps, scale)
    return add_scaled_rms_norm_triton(x, delta, weight, eps, scale)


def grouped_gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float,
                           norm_before_gate: bool, out_dtype: torch.dtype,
                           sum_squares: torch.Tensor | None = None) -> torch.Tensor:
    """Mamba2's gated norm of the scan's output ``y`` (T, W) under the gate ``z`` (T, W), in groups of ``group_size``
    channels: ``w * norm(y * silu(z))``, or ``(w * norm(y)) * silu(z)`` with ``norm_before_gate``; returned in
    ``out_dtype`` (the output projection's input). ``sum_squares`` (T,): a group wider than ``W`` that spans ranks
    (``group_size`` its full width), its per-token sums of squares (:func:`gated_sum_squares`) all-reduced.
    The kernel takes a float32 ``y`` (what the scan returns); the reference takes any."""
    width = y.shape[-1] if sum_squares is not None else group_size
    if not (uses_triton(y) and y.dtype == torch.float32 and y.dim() == 2 and width <= MAX_WIDTH):
        return grouped_gated_rms_norm_ref(y, z, weight, group_size, eps, norm_before_gate, out_dtype, sum_squares)
    return grouped_gated_rms_norm_triton(y, z, weight, group_size, eps, norm_before_gate, out_dtype, sum_squares)


def gated_sum_squares(y: torch.Tensor, z: torch.Tensor, norm_before_gate: bool) -> torch.Tensor:
    """Per token of ``y`` (T, W), float32 (T,): ``sum(h^2)``, ``h = y`` or ``y * silu(z)`` (this rank's part of a
    gated-norm group that spans ranks)."""
    if not (uses_triton(y) and y.dtype == torch.float32 and y.dim() == 2 and y.shape[-1] <= MAX_WIDTH):
        return gated_sum_squares_ref(y, z, norm_before_gate)
    return gated_sum_squares_triton(y, z, norm_before_gate)


def silu_gate(y: torch.Tensor, z: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``(y * silu(z)).to(out_dtype)``, ``silu`` in ``z``'s dtype: Mamba2's gate where it has no norm."""
    if not (uses_triton(y) and y.dtype == torch.float32 and y.dim() == 2 and y.shape[-1] <= MAX_WIDTH):
        return silu_gate_ref(y, z, out_dtype)
    return silu_gate_triton(y, z, out_dtype)


def scaled_rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from hyserve.kernels.norm._triton import _rms_norm_kernel

    d = x.shape[-1]
    assert weight.shape == (d,), "weight must be (D,)"
    x2 = _rows(x)
    n = x2.shape[0]
    out = torch.empty((n, d), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if n:
        block_d, rows, warps = _launch(d)
        _rms_norm_kernel[(-(-n // rows),)](x2, weight, out, n, d, x2.stride(0), out.stride(0), float(eps),
                                            out, 0, out, FP8_MAX, AMAX_EPS,
                                            ROWS=rows, BLOCK_D=block_d, SCALED=True, num_warps=warps)
    return out.view(x.shape)


def add_scaled_rms_norm_triton(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                               scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    from hyserve.kernels.norm._triton import _add_rms_norm_kernel

    d = x.shape[-1]
    assert weight.shape == (d,) and delta.shape == x.shape and delta.dtype == x.dtype, \
        "weight must be (D,) and delta shaped and typed like x"
    x2, d2 = _rows(x), _rows(delta)
    n = x2.shape[0]
    res = torch.empty((n, d), dtype=x.dtype, device=x.device)
    out = torch.empty((n, d), dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if n:
        block_d, rows, warps = _launch(d)
        _add_rms_norm_kernel[(-(-n // rows),)](x2, d2, weight, res, out, n, d, x2.stride(0), d2.stride(0),
                                                res.stride(0), out.stride(0), float(eps), float(scale),
                                                out, 0, out, FP8_MAX, AMAX_EPS,
                                                ROWS=rows, BLOCK_D=block_d, SCALED=True, HAS_SCALE=scale != 1.0,
                                                num_warps=warps)
    return res.view(x.shape), out.view(x.shape)


def _gate_operands(y: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``y`` and ``z`` (T, W) with unit last strides (``z`` is a split of the input projection's output: a view)."""
    assert y.dim() == 2 and z.shape == y.shape, "y and z must be (T, W)"
    return (y if y.stride(-1) == 1 else y.contiguous()), (z if z.stride(-1) == 1 else z.contiguous())


def grouped_gated_rms_norm_triton(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int,
                                  eps: float, norm_before_gate: bool, out_dtype: torch.dtype,
                                  sum_squares: torch.Tensor | None = None) -> torch.Tensor:
    from hyserve.kernels.norm._triton import _grouped_gated_rms_norm_kernel

    y, z = _gate_operands(y, z)
    t, width = y.shape
    assert weight.shape == (width,), "weight must be (W,)"
    if sum_squares is None:
        assert width % group_size == 0, f"group size {group_size} does not divide the width {width}"
        groups, local = width // group_size, group_size
    else:
        assert sum_squares.shape == (t,) and sum_squares.dtype == torch.float32, "sum_squares must be float32 (T,)"
        groups, local = 1, width
    out = torch.empty((t, width), dtype=out_dtype, device=y.device)
    if t:
        block_w, rows, warps = _launch(local)
        _grouped_gated_rms_norm_kernel[(-(-t * groups // rows),)](
            y, z, weight, y if sum_squares is None else sum_squares, out, t, groups, local, y.stride(0),
            z.stride(0), out.stride(0), float(group_size), float(eps), NORM_BEFORE_GATE=norm_before_gate,
            NORM=True, GIVEN_SUM=sum_squares is not None, ROWS=rows, BLOCK_W=block_w, num_warps=warps)
    return out


def gated_sum_squares_triton(y: torch.Tensor, z: torch.Tensor, norm_before_gate: bool) -> torch.Tensor:
    from hyserve.kernels.norm._triton import _gated_sum_squares_kernel

    y, z = _gate_operands(y, z)
    t, width = y.shape
    out = torch.empty((t,), dtype=torch.float32, device=y.device)
    if t:
        block_w, rows, warps = _launch(width)
        _gated_sum_squares_kernel[(-(-t // rows),)](y, z, out, t, width, y.stride(0), z.stride(0),
                                                     NORM_BEFORE_GATE=norm_before_gate, ROWS=rows, BLOCK_W=block_w,
                                                     num_warps=warps)
    return out


def silu_gate_triton(y: torch.Tensor, z: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    from hyserve.kernels.norm._triton import _grouped_gated_rms_norm_kernel

    y, z = _gate_operands(y, z)
    t, width = y.shape
    out = torch.empty((t, width), dtype=out_dtype, device=y.device)
    if t:
        block_w, rows, warps = _launch(width)
        # NORM=False reads neither the weight nor the sums (y passed in their place); h = y (NORM_BEFORE_GATE).
        _grouped_gated_rms_norm_kernel[(-(-t // rows),)](
            y, z, y, y, out, t, 1, width, y.stride(0), z.stride(0), out.stride(0), 1.0, 0.0,
            NORM_BEFORE_GATE=True, NORM=False, GIVEN_SUM=False, ROWS=rows, BLOCK_W=block_w, num_warps=warps)
    return out


def compile_variants() -> list[tuple[str, Any, dict[str, str], dict[str, Any]]]:
    """The variants of the RMSNorm kernels the Mamba2 families' launchers make at Nemotron-H-8B's shapes (hidden
    4096, gated-norm groups of 1024; a group spanning two ranks' 4096 channels as Granite's under TP 2), bf16, fp16
    and float32 models, and the zero-centred forms of the same two kernels, as ``(name, jit function, argument
    types, constexprs)``, for a compile check without a GPU (``tests/kernels/test_norm_kernels_compile.py``)."""
    from hyserve.kernels.norm._triton import (
        _add_rms_norm_kernel,
        _gated_sum_squares_kernel,
        _grouped_gated_rms_norm_kernel,
        _rms_norm_kernel,
        _silu_mul_kernel,
        _silu_mul_quant_kernel,
    )

    out: list[tuple[str, Any, dict[str, str], dict[str, Any]]] = []
    i32, f32 = "i32", "fp32"
    block_d, rows, _ = _launch(4096)
    norm = dict(N=i32, D=i32, sx=i32, so=i32, eps=f32, sq=i32, fp8_max=f32, amax_eps=f32)
    for act, scaled_forms in (("bf16", (True, False)), ("fp16", (True,)), ("fp32", (True,))):
        for scaled in scaled_forms:
            kind = "scaled" if scaled else "zero_centred"
            consts: dict[str, Any] = dict(ROWS=rows, BLOCK_D=block_d, SCALED=scaled, QUANT=False, KEEP=False)
            plain = dict(q_ptr=f"*{act}", s_ptr=f"*{act}")
            out.append((f"rms_norm_{kind}_{act}", _rms_norm_kernel,
                        dict(norm, x_ptr=f"*{act}", w_ptr=f"*{act}", out_ptr=f"*{act}", **plain), consts))
            for has_scale in ((True, False) if scaled else (False,)):
                sig = dict(norm, x_ptr=f"*{act}", d_ptr=f"*{act}", w_ptr=f"*{act}", res_ptr=f"*{act}",
                           out_ptr=f"*{act}", sd=i32, sr=i32, scale=f32, **plain)
                out.append((f"add_rms_norm_{kind}{'_multiplied' if has_scale else ''}_{act}", _add_rms_norm_kernel,
                            sig, dict(consts, HAS_SCALE=has_scale)))
    out.append(("rms_norm_scaled_fp32_weight_bf16", _rms_norm_kernel,
                dict(norm, x_ptr="*bf16", w_ptr="*fp32", out_ptr="*fp32", q_ptr="*fp32", s_ptr="*fp32"),
                dict(ROWS=rows, BLOCK_D=block_d, SCALED=True, QUANT=False, KEEP=False)))
    # The zero-centred norms quantizing for an FP8 GEMM (Qwen3.5's hidden 5120 at 27B: one row a program), with the
    # plain output kept or not, and the quantizing SwiGLU (intermediate 17408).
    block_q, rows_q, _ = _launch(5120)
    fp8 = dict(q_ptr="*fp8e4nv", s_ptr="*fp32")
    for act in ("bf16", "fp16", "fp32"):
        for keep in (False, True):
            tag = "_keep" if keep else ""
            consts = dict(ROWS=rows_q, BLOCK_D=block_q, SCALED=False, QUANT=True, KEEP=keep)
            out.append((f"rms_norm_fp8{tag}_{act}", _rms_norm_kernel,
                        dict(norm, x_ptr=f"*{act}", w_ptr=f"*{act}", out_ptr=f"*{act}", **fp8), consts))
            out.append((f"add_rms_norm_fp8{tag}_{act}", _add_rms_norm_kernel,
                        dict(norm, x_ptr=f"*{act}", d_ptr=f"*{act}", w_ptr=f"*{act}", res_ptr=f"*{act}",
                             out_ptr=f"*{act}", sd=i32, sr=i32, scale=f32, **fp8), dict(consts, HAS_SCALE=False)))
            for gate_act, width in (("silu", 17408), ("sigmoid", 6144)):
                out.append((f"{gate_act}_mul_fp8{tag}_{act}", _silu_mul_quant_kernel,
                            dict(g_ptr=f"*{act}", u_ptr=f"*{act}", out_ptr=f"*{act}", F=i32, sg=i32, su=i32, so=i32,
                                 sq=i32, fp8_max=f32, amax_eps=f32, sgh=i32, HD=i32, **fp8),
                            dict(BLOCK_F=gated_quant_launch(width)[0], KEEP=keep,
                                 SIGMOID=gate_act == "sigmoid", PER_HEAD=gate_act == "sigmoid")))
        for gate_act in ("silu", "sigmoid"):
            out.append((f"{gate_act}_mul_{act}", _silu_mul_kernel,
                        dict(g_ptr=f"*{act}", u_ptr=f"*{act}", out_ptr=f"*{act}", N=i32, F=i32, sg=i32, su=i32,
                             so=i32, sgh=i32, HD=i32),
                        dict(BLOCK_T=4, BLOCK_F=1024, SIGMOID=gate_act == "sigmoid",
                             PER_HEAD=gate_act == "sigmoid")))
    gate = dict(N=i32, W=i32, sy=i32, sz=i32)
    # bf16: every form; fp16 and float32 models: the two orders of the norm and the gate alone.
    spans: tuple[tuple[bool, bool, int], ...] = ((False, False, 1024), (True, False, 1024), (False, True, 4096),
                                                 (True, True, 4096))
    for act, forms, sums in (("bf16", spans, (False, True)), ("fp16", spans[:2], ()), ("fp32", spans[:1], ())):
        sig = dict(gate, y_ptr="*fp32", z_ptr=f"*{act}", w_ptr=f"*{act}", ss_ptr="*fp32", out_ptr=f"*{act}", G=i32,
                   so=i32, divisor=f32, eps=f32)
        for nbg, given, width in forms:
            block_w, rows_g, _ = _launch(width)
            order = "norm_first" if nbg else "gate_first"
            out.append((f"grouped_gated_rms_norm_{order}{'_given_sum' if given else ''}_{act}",
                        _grouped_gated_rms_norm_kernel, sig,
                        dict(NORM_BEFORE_GATE=nbg, NORM=True, GIVEN_SUM=given, ROWS=rows_g, BLOCK_W=block_w)))
        block_w, rows_g, _ = _launch(8192)
        out.append((f"silu_gate_{act}", _grouped_gated_rms_norm_kernel, sig,
                    dict(NORM_BEFORE_GATE=True, NORM=False, GIVEN_SUM=False, ROWS=rows_g, BLOCK_W=block_w)))
        block_w, rows_g, _ = _launch(4096)
        for nbg in sums:
            out.append((f"gated_sum_squares_{'norm_first' if nbg else 'gate_first'}_{act}",
                        _gated_sum_squares_kernel, dict(gate, y_ptr="*fp32", z_ptr=f"*{act}", ss_ptr="*fp32"),
                        dict(NORM_BEFORE_GATE=nbg, ROWS=rows_g, BLOCK_W=block_w)))
    return out

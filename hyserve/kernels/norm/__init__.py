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

__all__ = ["MAX_WIDTH", "add_rms_norm", "add_rms_norm_ref", "add_scaled_rms_norm", "add_scaled_rms_norm_ref",
           "gated_rms_norm", "gated_rms_norm_ref", "gated_sum_squares", "gated_sum_squares_ref",
           "grouped_gated_rms_norm", "grouped_gated_rms_norm_ref", "rms_norm", "rms_norm_ref", "scaled_rms_norm",
           "scaled_rms_norm_ref", "sigmoid_mul", "sigmoid_mul_ref", "silu_gate", "silu_gate_ref", "silu_mul",
           "silu_mul_ref"]

_MAX_BLOCK_D = 16384
MAX_WIDTH = _MAX_BLOCK_D  # the widest row (or gated-norm group) one program normalises


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + delta, rms_norm(x + delta))``: the residual stream and its norm, the add rounded to ``x.dtype``."""
    if not x.is_cuda:
        return add_rms_norm_ref(x, delta, weight, eps)
    return add_rms_norm_triton(x, delta, weight, eps)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (SwiGLU), in ``gate.dtype``."""
    if not gate.is_cuda:
        return silu_mul_ref(gate, up)
    return silu_mul_triton(gate, up)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * (1 + weight)`` over the last dim, in float32, returned in ``x.dtype``."""
    if not x.is_cuda:
        return rms_norm_ref(x, weight, eps)
    return rms_norm_triton(x, weight, eps)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * norm(x) * silu(gate)`` over the last dim (weight not zero-centred), returned in ``x.dtype``."""
    if not x.is_cuda:
        return gated_rms_norm_ref(x, gate, weight, eps)
    return gated_rms_norm_triton(x, gate, weight, eps)


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


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from hyserve.kernels.norm._triton import _rms_norm_kernel

    d = x.shape[-1]
    assert weight.shape == (d,), "weight must be (D,)"
    x2 = _rows(x)
    n = x2.shape[0]
    out = torch.empty((n, d), dtype=x.dtype, device=x.device)
    if n:
        block_d, rows, warps = _launch(d)
        _rms_norm_kernel[(-(-n // rows),)](x2, weight, out, n, d, x2.stride(0), out.stride(0), float(eps),
                                            ROWS=rows, BLOCK_D=block_d, SCALED=False, num_warps=warps)
    return out.view(x.shape)


def gated_rms_norm_triton(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from hyserve.kernels.norm._triton import _gated_rms_norm_kernel

    d = x.shape[-1]
    assert weight.shape == (d,) and gate.shape == x.shape, "weight must be (D,) and gate shaped like x"
    x2, g2 = _rows(x), _rows(gate)
    n = x2.shape[0]
    out = torch.empty((n, d), dtype=x.dtype, device=x.device)
    if n:
        block_d, rows, warps = _launch(d)
        _gated_rms_norm_kernel[(-(-n // rows),)](x2, g2, weight, out, n, d, x2.stride(0), g2.stride(0),
                                                  out.stride(0), float(eps),
                                                  ROWS=rows, BLOCK_D=block_d, num_warps=warps)
    return out.view(x.shape)


def add_rms_norm_triton(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    from hyserve.kernels.norm._triton import _add_rms_norm_kernel

    d = x.shape[-1]
    assert weight.shape == (d,) and delta.shape == x.shape, "weight must be (D,) and delta shaped like x"
    x2, d2 = _rows(x), _rows(delta)
    n = x2.shape[0]
    res = torch.empty((n, d), dtype=x.dtype, device=x.device)
    out = torch.empty((n, d), dtype=x.dtype, device=x.device)
    if n:
        block_d, rows, warps = _launch(d)
        _add_rms_norm_kernel[(-(-n // rows),)](x2, d2, weight, res, out, n, d, x2.stride(0), d2.stride(0),
                                                res.stride(0), out.stride(0), float(eps), 1.0,
                                                ROWS=rows, BLOCK_D=block_d, SCALED=False, HAS_SCALE=False,
                                                num_warps=warps)
    return res.view(x.shape), out.view(x.shape)


def sigmoid_mul(gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(gate)`` in ``gate.dtype`` (the sigmoid rounded first, as torch computes it): the gated
    attention's output gate, one launch on CUDA instead of two. Either operand may be a strided view of rows with a
    unit last stride (``(T, H, D)`` heads as well as ``(T, W)``)."""
    if not gate.is_cuda:
        return sigmoid_mul_ref(gate, x)
    return silu_mul_triton(gate, x, sigmoid=True)


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor, *, sigmoid: bool = False) -> torch.Tensor:
    """``silu(gate) * up``; with ``sigmoid``, ``sigmoid(gate) * up``."""
    from hyserve.kernels.norm._triton import _silu_mul_kernel

    assert gate.shape == up.shape, "gate and up must have one shape"
    g2, u2 = _rows(gate), _rows(up)
    n, f = g2.shape
    out = torch.empty((n, f), dtype=gate.dtype, device=gate.device)
    if n and f:
        block_f = min(1024, max(16, 1 << (f - 1).bit_length()))
        block_t = 4096 // block_f  # 4096 elements a program: 4 rows of 1024 (SwiGLU), 16 heads of 256 (the gate)
        _silu_mul_kernel[(-(-n // block_t), -(-f // block_f))](g2, u2, out, n, f, g2.stride(0), u2.stride(0),
                                                                 out.stride(0), BLOCK_T=block_t, BLOCK_F=block_f,
                                                                 SIGMOID=sigmoid, num_warps=4)
    return out.view(gate.shape)


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
    )

    out: list[tuple[str, Any, dict[str, str], dict[str, Any]]] = []
    i32, f32 = "i32", "fp32"
    block_d, rows, _ = _launch(4096)
    norm = dict(N=i32, D=i32, sx=i32, so=i32, eps=f32)
    for act, scaled_forms in (("bf16", (True, False)), ("fp16", (True,)), ("fp32", (True,))):
        for scaled in scaled_forms:
            kind = "scaled" if scaled else "zero_centred"
            consts: dict[str, Any] = dict(ROWS=rows, BLOCK_D=block_d, SCALED=scaled)
            out.append((f"rms_norm_{kind}_{act}", _rms_norm_kernel,
                        dict(norm, x_ptr=f"*{act}", w_ptr=f"*{act}", out_ptr=f"*{act}"), consts))
            for has_scale in ((True, False) if scaled else (False,)):
                sig = dict(norm, x_ptr=f"*{act}", d_ptr=f"*{act}", w_ptr=f"*{act}", res_ptr=f"*{act}",
                           out_ptr=f"*{act}", sd=i32, sr=i32, scale=f32)
                out.append((f"add_rms_norm_{kind}{'_multiplied' if has_scale else ''}_{act}", _add_rms_norm_kernel,
                            sig, dict(consts, HAS_SCALE=has_scale)))
    out.append(("rms_norm_scaled_fp32_weight_bf16", _rms_norm_kernel,
                dict(norm, x_ptr="*bf16", w_ptr="*fp32", out_ptr="*fp32"),
                dict(ROWS=rows, BLOCK_D=block_d, SCALED=True)))
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
    for act in ("bf16", "fp32"):  # SwiGLU (wide rows) and the gated attention's output gate (heads of 256)
        for sig_gate, block_t, block_f in ((False, 4, 1024), (True, 16, 256)):
            out.append((f"{'sigmoid' if sig_gate else 'silu'}_mul_{act}", _silu_mul_kernel,
                        dict(g_ptr=f"*{act}", u_ptr=f"*{act}", out_ptr=f"*{act}", N=i32, F=i32, sg=i32, su=i32,
                             so=i32), dict(BLOCK_T=block_t, BLOCK_F=block_f, SIGMOID=sig_gate)))
    return out

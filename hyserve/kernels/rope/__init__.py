"""Partial NeoX rotary embedding applied to ``(T, H, D)`` queries or keys with per-token float32 ``cos``/``sin``.

Entry point :func:`apply_rope`: on CUDA one Triton launch per tensor (``_triton.py``; the torch formulation takes
about ten); elsewhere the plain-torch reference of ``reference.py``, which defines the semantics: ``cos``/``sin`` are
cast to the tensor's dtype and ``x_rot * [cos, cos] + rotate_half(x_rot) * [sin, sin]`` is computed in that dtype (as
transformers does); channels past ``2 * R2`` pass through.

:func:`rms_norm_rope`: the gated attention's per-head q / k RMSNorms (zero-centred, ``hyserve.kernels.norm.rms_norm``)
and the rotation of both, one launch on CUDA instead of four; the same as :func:`rms_norm` then :func:`apply_rope` on
each (rounded to the dtype after the norm, as those round), but for the norm's sum of squares, added up in three
pieces (the two rotated halves and the rest): one unit in the last place at most.
"""

from __future__ import annotations

from typing import Any

import torch

from hyserve.kernels.norm.reference import rms_norm_ref
from hyserve.kernels.rope.reference import apply_rope_ref

__all__ = ["apply_rope", "apply_rope_ref", "compile_variants", "rms_norm_rope", "rms_norm_rope_ref",
           "rms_norm_rope_triton"]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if not x.is_cuda:
        return apply_rope_ref(x, cos, sin)
    return apply_rope_triton(x, cos, sin)


def apply_rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    from hyserve.kernels.rope._triton import _rope_kernel

    t, h, d = x.shape
    r2 = cos.shape[-1]
    assert cos.shape == sin.shape == (t, r2) and 2 * r2 <= d, "cos, sin must be (T, R2) with 2 * R2 <= D"
    assert x.stride(-1) == 1 and cos.stride() == sin.stride() and cos.stride(-1) == 1, "unit last strides"
    out = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    if t and h:
        block_r = max(16, 1 << (r2 - 1).bit_length())
        block_d = max(16, 1 << (max(d - 2 * r2, 1) - 1).bit_length())
        block_t = 16
        _rope_kernel[(-(-t // block_t), h)](x, cos, sin, out, t, h, d, r2, x.stride(0), x.stride(1),
                                            out.stride(0), out.stride(1), cos.stride(0),
                                            BLOCK_T=block_t, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4)
    return out


def rms_norm_rope(q: torch.Tensor, q_weight: torch.Tensor, k: torch.Tensor, k_weight: torch.Tensor, eps: float,
                  cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rope(rms_norm(q, q_weight)), rope(rms_norm(k, k_weight)))`` for ``(T, H, D)`` heads (any strides but a unit
    last one), ``cos``/``sin`` ``(T, R2)`` float32; new contiguous tensors in the inputs' dtype."""
    if not q.is_cuda:
        return rms_norm_rope_ref(q, q_weight, k, k_weight, eps, cos, sin)
    return rms_norm_rope_triton(q, q_weight, k, k_weight, eps, cos, sin)


def rms_norm_rope_ref(q: torch.Tensor, q_weight: torch.Tensor, k: torch.Tensor, k_weight: torch.Tensor, eps: float,
                      cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (apply_rope_ref(rms_norm_ref(q, q_weight, eps), cos, sin),
            apply_rope_ref(rms_norm_ref(k, k_weight, eps), cos, sin))


def _launch(d: int, r2: int) -> dict[str, int]:
    return {"BLOCK_T": 16, "BLOCK_R": max(16, 1 << (r2 - 1).bit_length()),
            "BLOCK_D": max(16, 1 << (max(d - 2 * r2, 1) - 1).bit_length())}


def rms_norm_rope_triton(q: torch.Tensor, q_weight: torch.Tensor, k: torch.Tensor, k_weight: torch.Tensor,
                         eps: float, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from hyserve.kernels.rope._triton import _norm_rope_kernel

    t, hq, d = q.shape
    hk = k.shape[1]
    r2 = cos.shape[-1]
    assert k.shape == (t, hk, d) and q.dtype == k.dtype, "q (T, Hq, D) and k (T, Hk, D) of one dtype"
    assert q_weight.shape == k_weight.shape == (d,), "weights must be (D,)"
    assert cos.shape == sin.shape == (t, r2) and 0 < 2 * r2 <= d, "cos, sin must be (T, R2) with 2 * R2 <= D"
    assert q.stride(-1) == k.stride(-1) == 1 and cos.stride() == sin.stride() and cos.stride(-1) == 1, \
        "unit last strides"
    qo = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    ko = torch.empty((t, hk, d), dtype=k.dtype, device=k.device)
    if t and hq + hk:
        cfg = _launch(d, r2)
        _norm_rope_kernel[(-(-t // cfg["BLOCK_T"]), hq + hk)](
            q, k, q_weight, k_weight, cos, sin, qo, ko, t, hq, d, r2, q.stride(0), q.stride(1), k.stride(0),
            k.stride(1), qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1), cos.stride(0), float(eps),
            **cfg, num_warps=4)
    return qo, ko


def compile_variants() -> list[tuple[str, Any, dict[str, str], dict[str, Any]]]:
    """The fused norm + rotation's variants for the Qwen3.5 attention (head 256, rotary 64: ``partial_rotary_factor``
    0.25), bf16 and float32, as ``(name, jit function, argument types, constexprs)`` for a compile check without a
    GPU (``tests/kernels/test_gdn_decode_fused.py``)."""
    from hyserve.kernels.rope._triton import _norm_rope_kernel

    i32 = "i32"
    out: list[tuple[str, Any, dict[str, str], dict[str, Any]]] = []
    for act in ("bf16", "fp32"):
        sig = dict(q_ptr=f"*{act}", k_ptr=f"*{act}", qw_ptr=f"*{act}", kw_ptr=f"*{act}", cos_ptr="*fp32",
                   sin_ptr="*fp32", qo_ptr=f"*{act}", ko_ptr=f"*{act}", eps="fp32",
                   **{n: i32 for n in ("T", "HQ", "D", "R2", "sq_t", "sq_h", "sk_t", "sk_h", "sqo_t", "sqo_h",
                                       "sko_t", "sko_h", "sc_t")})
        out.append((f"rms_norm_rope_{act}", _norm_rope_kernel, sig, _launch(256, 32)))
    return out

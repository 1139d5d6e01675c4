"""Qwen4-Exp's Per-Layer Embedding n-grams on CUDA (:class:`hyserve.layers.ple.PerLayerEmbedding`'s ``_embed``):
the segment rule, the XOR hash of every order, and the gather of every head's table row, in one launch instead of
about twenty; and the gate (``ple_gate``: the key-query product per stream, its signed root, the sigmoid times the
value) in one instead of about ten. The layer's torch formulation is the reference; the layer calls them where
:func:`hyserve.kernels.moe.uses_triton` (CUDA, or the Triton interpreter in tests; :func:`ngram_embed` where the
table is on the tokens' device too).
"""

from __future__ import annotations

from typing import Any

import torch

from hyserve.utils import next_pow2

__all__ = ["compile_variants", "ngram_embed", "ple_gate"]


def ngram_embed(tokens: torch.Tensor, multipliers: torch.Tensor, sizes: torch.Tensor, offsets: torch.Tensor,
                table: torch.Tensor, eos: int, heads_per_ngram: int) -> torch.Tensor:
    """``tokens`` (T, n) each position's ``t_0 .. t_{n-1}`` (before the segment rule); ``multipliers`` (n,),
    ``sizes`` / ``offsets`` ((n - 1) * heads_per_ngram,) int64; ``table`` (rows, d). Returns (T, G * d) in the
    table's dtype, head ``g = (order - 2) * heads_per_ngram + i`` in columns ``[g * d, (g + 1) * d)``."""
    from hyserve.kernels.ple._triton import _ngram_embed_kernel

    t, n = tokens.shape
    g = (n - 1) * heads_per_ngram
    d = table.shape[1]
    out = torch.empty((t, g * d), dtype=table.dtype, device=table.device)
    if t == 0:
        return out
    tokens = tokens.contiguous()
    assert table.stride(1) == 1, "the table's rows must be contiguous"
    _ngram_embed_kernel[(t,)](
        tokens, multipliers.contiguous(), sizes.contiguous(), offsets.contiguous(), table, out,
        tokens.stride(0), table.stride(0), out.stride(0), eos,
        N=n, HPN=heads_per_ngram, D=d, BLOCK_D=max(16, next_pow2(d)), num_warps=4,
    )  # fmt: skip
    return out


def ple_gate(kn: torch.Tensor, qn: torch.Tensor, v: torch.Tensor, streams: int, clamp: float) -> torch.Tensor:
    """``kn``, ``qn`` (T, S * H) the normed key and query, ``v`` (T, H) -> (T, S * H): per stream ``s``,
    ``sigmoid(signed_sqrt(sum_H(kn_s * qn_s) / sqrt(H))) * v`` (``|g|`` floored at ``clamp``)."""
    from hyserve.kernels.ple._triton import _ple_gate_kernel

    t, width = kn.shape
    h = width // streams
    kn, qn, v = kn.contiguous(), qn.contiguous(), v.contiguous()
    out = torch.empty_like(kn)
    if t:
        _ple_gate_kernel[(t, streams)](
            kn, qn, v, out, kn.stride(0), qn.stride(0), v.stride(0), out.stride(0), float(h) ** 0.5, clamp,
            H=h, BLOCK_H=next_pow2(h), num_warps=8 if h >= 2048 else 4,
        )  # fmt: skip
    return out


def compile_variants() -> list[tuple[str, Any, dict[str, str], dict[str, Any]]]:
    """The variants of this package's Triton kernels that the PLE launcher makes for a bf16 Qwen4-Exp model, as
    ``(name, jit function, argument types, constexprs)``, for a compile check without a GPU
    (``tests/kernels/test_qwen4_exp_kernels_compile.py``)."""
    from hyserve.kernels.ple._triton import _ngram_embed_kernel, _ple_gate_kernel

    out: list[tuple[str, Any, dict[str, str], dict[str, Any]]] = []
    bf, i32 = "*bf16", "i32"
    out.append(("ngram_embed", _ngram_embed_kernel,
                dict(tok_ptr="*i64", mult_ptr="*i64", size_ptr="*i64", off_ptr="*i64", table_ptr=bf, out_ptr=bf,
                     stok_t=i32, stab_r=i32, sout_t=i32, eos=i32),
                dict(N=3, HPN=4, D=256, BLOCK_D=256)))
    out.append(("ple_gate", _ple_gate_kernel,
                dict(k_ptr=bf, q_ptr=bf, v_ptr=bf, out_ptr=bf, sk_t=i32, sq_t=i32, sv_t=i32, so_t=i32, sqrt_h="fp32",
                     clamp="fp32"),
                dict(H=2048, BLOCK_H=2048)))
    return out

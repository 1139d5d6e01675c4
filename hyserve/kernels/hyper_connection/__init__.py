"""Qwen4-Exp's hyper-connections (:class:`hyserve.layers.hyper_connection.GatedResidual`) fused on CUDA: what the
torch formulation spends about twenty launches on per block (the grouped norm, the gates, the mix, the injection),
in three small kernels around the block's three projections; the injection of one block is fused with the next
block's norm (``hc_inject_norm``).

* :func:`hc_inject_norm`: ``x' = x + out * w[s]`` into each stream ``s`` (when ``out`` is given), then each stream's
  zero-centred RMSNorm ``x'_s / rms(x'_s) * (1 + weight_s)`` (float32 inside). Returns ``(x', normed)``.
* :func:`hc_gates`: ``silu(down / S)`` and ``2 sigmoid(inject / S)``.
* :func:`hc_mix`: ``mean_s(sigmoid(up_s) * normed_s)``.
* :func:`hc_inject`: ``x + out * w[s]`` alone (the layer's last injection).

The layer calls them where :func:`hyserve.kernels.moe.uses_triton` (CUDA, or the Triton interpreter in tests);
elsewhere it runs its torch formulation, which defines the semantics.
"""

from __future__ import annotations

from typing import Any

import torch

from hyserve.utils import next_pow2

__all__ = ["compile_variants", "hc_gates", "hc_inject", "hc_inject_norm", "hc_mix"]


def hc_inject_norm(x: torch.Tensor, out: torch.Tensor | None, w: torch.Tensor | None, weight: torch.Tensor | None,
                   streams: int, eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` (T, S * H); ``out`` (T, H) and ``w`` (T, S), or None (no injection); ``weight`` (S * H,), or None (no
    norm). Returns ``(x after the injection, its per-stream norm or None)``, both ``x.dtype``."""
    from hyserve.kernels.hyper_connection._triton import _hc_inject_norm_kernel

    t, width = x.shape
    h = width // streams
    x = x.contiguous()
    inject = out is not None and w is not None
    norm = weight is not None
    y = torch.empty_like(x) if norm else None
    xo = torch.empty_like(x) if inject else x
    if t and (inject or norm):
        o = out.contiguous() if out is not None and inject else x
        ww = w.contiguous() if w is not None and inject else x
        y_arg = y if y is not None else x
        _hc_inject_norm_kernel[(t, streams)](
            x, o, ww, xo, y_arg, weight if weight is not None else x,
            x.stride(0), o.stride(0), ww.stride(0), xo.stride(0), y_arg.stride(0), eps,
            H=h, BLOCK_H=next_pow2(h), INJECT=inject, NORM=norm, num_warps=8 if h >= 2048 else 4,
        )  # fmt: skip
    return xo, y


def hc_inject(x: torch.Tensor, out: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x + out * w[s]`` into each of the ``w.shape[1]`` streams of ``x`` (T, S * H)."""
    return hc_inject_norm(x, out, w, None, w.shape[1], 0.0)[0]


def hc_gates(down: torch.Tensor, inject: torch.Tensor | None, streams: int
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``down`` (T, R), ``inject`` (T, S) or None -> ``(silu(down / S), 2 sigmoid(inject / S) or None)``."""
    from hyserve.kernels.hyper_connection._triton import _hc_gates_kernel

    t, r = down.shape
    down = down.contiguous()
    g = torch.empty_like(down)
    iw = None
    if inject is not None:
        inject = inject.contiguous()
        iw = torch.empty_like(inject)
    if t:
        i_arg = inject if inject is not None else down
        iw_arg = iw if iw is not None else g
        _hc_gates_kernel[(t,)](
            down, i_arg, g, iw_arg,
            down.stride(0), i_arg.stride(0), g.stride(0), iw_arg.stride(0), float(streams),
            R=r, BLOCK_R=next_pow2(r), NS=streams, BLOCK_S=max(2, next_pow2(streams)),
            HAS_INJECT=inject is not None, num_warps=4,
        )  # fmt: skip
    return g, iw


def hc_mix(up: torch.Tensor, normed: torch.Tensor, streams: int) -> torch.Tensor:
    """``up``, ``normed`` (T, S * H) -> ``mean_s(sigmoid(up_s) * normed_s)`` (T, H)."""
    from hyserve.kernels.hyper_connection._triton import _hc_mix_kernel

    t, width = up.shape
    h = width // streams
    up, normed = up.contiguous(), normed.contiguous()
    mixed = torch.empty((t, h), dtype=up.dtype, device=up.device)
    if t:
        block = min(1024, next_pow2(h))
        _hc_mix_kernel[(t, -(-h // block))](
            up, normed, mixed, up.stride(0), normed.stride(0), mixed.stride(0),
            NS=streams, H=h, BLOCK=block, num_warps=4,
        )  # fmt: skip
    return mixed


def compile_variants() -> list[tuple[str, Any, dict[str, str], dict[str, Any]]]:
    """The variants of this package's Triton kernels that its launchers make for a bf16 Qwen4-Exp model, as
    ``(name, jit function, argument types, constexprs)``, for a compile check without a GPU
    (``tests/kernels/test_qwen4_exp_kernels_compile.py``)."""
    from hyserve.kernels.hyper_connection._triton import _hc_gates_kernel, _hc_inject_norm_kernel, _hc_mix_kernel

    out: list[tuple[str, Any, dict[str, str], dict[str, Any]]] = []
    bf, i32 = "*bf16", "i32"
    for inject, norm in ((True, True), (False, True), (True, False)):
        out.append((f"hc_inject_norm_{inject}_{norm}", _hc_inject_norm_kernel,
                    dict(x_ptr=bf, o_ptr=bf, w_ptr=bf, xo_ptr=bf, y_ptr=bf, nw_ptr=bf, sx_t=i32, so_t=i32, sw_t=i32,
                         sxo_t=i32, sy_t=i32, eps="fp32"),
                    dict(H=2048, BLOCK_H=2048, INJECT=inject, NORM=norm)))
    for has in (True, False):
        out.append((f"hc_gates_{has}", _hc_gates_kernel,
                    dict(d_ptr=bf, i_ptr=bf, g_ptr=bf, iw_ptr=bf, sd_t=i32, si_t=i32, sg_t=i32, siw_t=i32, S="fp32"),
                    dict(R=128, BLOCK_R=128, NS=4, BLOCK_S=4, HAS_INJECT=has)))
    out.append(("hc_mix", _hc_mix_kernel, dict(u_ptr=bf, n_ptr=bf, m_ptr=bf, su_t=i32, sn_t=i32, sm_t=i32),
                dict(NS=4, H=2048, BLOCK=1024)))
    return out

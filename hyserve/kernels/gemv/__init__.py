"""The decode GEMM for bf16 / fp16 weights with the previous op in its prologue: the zero-centred RMSNorm (with its
residual add) before a projection, and the SwiGLU before ``down_proj``, so that a decode step's norm and SwiGLU
launches go.

Entry point :func:`decode_linear` (``a W^T`` for an input :class:`NormedInput` / :class:`SwigluInput` / tensor of at
most :data:`DECODE_GEMM_MAX_ROWS` rows): on CUDA (and under the Triton interpreter, in tests) one Triton launch
(``_triton.py``: K split over programs, the last program of a tile adding the partials in split order); elsewhere
the reference (``reference.py``: the input materialized by the norm / SwiGLU entry points, then a float32 matmul).

Whether the layers take it is :func:`decode_gemm_enabled` (``HYSERVE_DECODE_GEMM``): ``off`` (the default: cuBLAS
after the norm's own launch, as measured so far) or ``on`` (this kernel for every decode step of at most
:data:`DECODE_GEMM_MAX_ROWS` rows whose consumer is one unquantized GEMM). The default follows the H200 measurement
of both (``benchmarks/device_plan.md``).
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch

from hyserve.kernels.gemv.reference import DeferredInput, NormedInput, SwigluInput, decode_linear_ref
from hyserve.kernels.moe import uses_triton

__all__ = ["DECODE_GEMM_MAX_ROWS", "DeferredInput", "NormedInput", "SwigluInput", "compile_variants",
           "decode_gemm_config", "decode_gemm_enabled", "decode_linear", "decode_linear_ref", "decode_linear_triton",
           "deferrable"]

DECODE_GEMM_MAX_ROWS = 16  # one BLOCK_M: a decode step's rows (a verify step's k + 1 a row count too)
PROLOGUE_NONE, PROLOGUE_NORM, PROLOGUE_ADD_NORM, PROLOGUE_SWIGLU = 0, 1, 2, 3


def deferrable(x: torch.Tensor) -> bool:
    """Whether a step's activation ``x`` (``(T, K)``) can go to the decode GEMM with its producer deferred into the
    prologue: few enough rows, a 16-bit dtype, and where the Triton kernels run. (Whether the switch is on the layers
    read once, when they are built: ``LinearBase.takes_deferred``.)"""
    return (x.dim() == 2 and x.shape[0] <= DECODE_GEMM_MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16)
            and uses_triton(x))


def decode_gemm_enabled() -> bool:
    """``HYSERVE_DECODE_GEMM``: ``off`` (default) or ``on``; another value is refused."""
    value = os.environ.get("HYSERVE_DECODE_GEMM", "off")
    if value not in ("on", "off"):
        raise ValueError(f"HYSERVE_DECODE_GEMM={value!r}: on or off (the default)")
    return value == "on"


class DecodeGemmConfig(NamedTuple):
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


def decode_gemm_config(n: int, k: int, num_sms: int = 132) -> DecodeGemmConfig:
    """Columns of 64 a program, K in 128-wide tiles, split until the card has about two programs per SM."""
    bn, bk = 64, 128
    tiles = -(-n // bn)
    k_tiles = -(-k // bk)
    split = max(1, min(k_tiles // 2, -(-2 * num_sms // tiles)))
    return DecodeGemmConfig(bn, bk, split, 4, 4)


def decode_linear(a: DeferredInput | torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``a W^T`` for ``a``'s ``(M, K)`` rows (``M <= DECODE_GEMM_MAX_ROWS``) and an ``(N, K)`` weight of ``a``'s
    dtype, the deferred input computed in the GEMM's prologue (a :class:`NormedInput` with ``delta`` writes its
    ``residual``). Output ``(M, N)`` in ``a``'s dtype."""
    x = a if isinstance(a, torch.Tensor) else (a.x if isinstance(a, NormedInput) else a.gate)
    if not uses_triton(x):
        return decode_linear_ref(a, weight)
    return decode_linear_triton(a, weight)


def _operands(a: DeferredInput | torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor, Any, Any, float]:
    """(prologue, A, D, norm weight, residual, eps) of the launch (unused operands: A itself)."""
    if isinstance(a, torch.Tensor):
        return PROLOGUE_NONE, a, a, a, a, 0.0
    if isinstance(a, SwigluInput):
        assert a.gate.shape == a.up.shape and a.gate.stride(-1) == 1 and a.up.stride(-1) == 1
        return PROLOGUE_SWIGLU, a.gate, a.up, a.gate, a.gate, 0.0
    if a.delta is None:
        return PROLOGUE_NORM, a.x, a.x, a.weight, a.x, a.eps
    assert a.residual is not None and a.delta.shape == a.x.shape and a.residual.shape == a.x.shape
    return PROLOGUE_ADD_NORM, a.x, a.delta, a.weight, a.residual, a.eps


def decode_linear_triton(a: DeferredInput | torch.Tensor, weight: torch.Tensor,
                         config: DecodeGemmConfig | None = None) -> torch.Tensor:
    from hyserve.kernels.fp8 import SPLIT_LOCKS, split_locks
    from hyserve.kernels.gemv._triton import _decode_gemm_kernel

    prologue, x, d, nw, res, eps = _operands(a)
    m, k = x.shape
    n = weight.shape[0]
    assert m <= DECODE_GEMM_MAX_ROWS, f"the decode GEMM takes at most {DECODE_GEMM_MAX_ROWS} rows (got {m})"
    assert weight.shape == (n, k) and weight.dtype == x.dtype and weight.stride(1) == 1, (weight.shape, x.shape)
    assert x.stride(-1) == 1 and d.stride(-1) == 1
    cfg = config or decode_gemm_config(
        n, k, torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 132)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    tiles = -(-n // cfg.block_n)
    split = cfg.split_k if tiles <= SPLIT_LOCKS else 1
    if m == 0:
        return out
    ws = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    locks = split_locks(x.device) if split > 1 else out
    _decode_gemm_kernel[(tiles, split)](
        x, d, nw, res, weight, out, ws, locks, m, n, k, x.stride(0), d.stride(0), res.stride(0), weight.stride(0),
        out.stride(0), float(eps), PROLOGUE=prologue, BLOCK_M=16, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SPLIT_K=split, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


def compile_variants() -> list[tuple[str, Any, dict[str, str], dict[str, Any]]]:
    """The decode GEMM's variants at Qwen3.5-9B's projections (bf16 and fp16; each prologue), as ``(name, jit
    function, argument types, constexprs)`` for a compile check without a GPU."""
    from hyserve.kernels.gemv._triton import _decode_gemm_kernel

    out: list[tuple[str, Any, dict[str, str], dict[str, Any]]] = []
    i32 = "i32"
    for act in ("bf16", "fp16"):
        for name, prologue in (("plain", PROLOGUE_NONE), ("norm", PROLOGUE_NORM), ("add_norm", PROLOGUE_ADD_NORM),
                               ("swiglu", PROLOGUE_SWIGLU)):
            swiglu = prologue == PROLOGUE_SWIGLU  # down_proj (12288 -> 4096), else gate_up (4096 -> 24576)
            cfg = decode_gemm_config(4096 if swiglu else 24576, 12288 if swiglu else 4096)
            sig = dict(a_ptr=f"*{act}", d_ptr=f"*{act}", nw_ptr=f"*{act}", r_ptr=f"*{act}", b_ptr=f"*{act}",
                       c_ptr=f"*{act}", ws_ptr="*fp32", lock_ptr="*i32", M=i32, N=i32, K=i32, sa=i32, sd=i32,
                       sr=i32, sb=i32, sc=i32, eps="fp32")
            out.append((f"decode_gemm_{name}_{act}", _decode_gemm_kernel, sig,
                        dict(PROLOGUE=prologue, BLOCK_M=16, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                             SPLIT_K=cfg.split_k)))
    return out

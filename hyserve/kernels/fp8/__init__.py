"""FP8 (e4m3) linear layers: activation quantization and ``x W^T`` with float8 weights and float32 scales.

Semantics (the plain-torch references of ``reference.py`` define them; the CPU runs them, and tests hold the CUDA
paths to them):

* A scale multiplies on dequantization: ``w = w_fp8 * scale`` (compressed-tensors' ``weight_scale`` and Qwen's
  ``weight_scale_inv`` alike, docs/fp8_facts.md sections 4 and 6).
* Weight scales are per output channel ``(N, 1)`` (a per-tensor scale is expanded to its rows at load) or per
  ``(bn, bk)`` block ``(ceil(N / bn), ceil(K / bk))``; the last block of a dimension that ``bn``/``bk`` does not
  divide is partial.
* Activations are quantized per token (dynamic), per token and ``bk``-wide group of K (dynamic, with block
  weights), or with one static scale: ``s = max(amax, 1e-10) / 448`` over the token (or group),
  ``q = fp8(clamp(x / s, -448, 448))`` (round to nearest even), ``x ~ q * s``. A static scale is used as given.

Entry points: :func:`fp8_linear` (channel-scaled weights) and :func:`fp8_block_linear` (block-scaled weights). On
CUDA the activation is quantized in one Triton launch; then, up to ``AUTO_TRITON_MAX_ROWS`` rows (decode), channel
weights take the Triton GEMM (``_triton.py``: split K, the partials added by the last program of each tile, one
launch), above, ``torch._scaled_mm`` (cuBLASLt; rowwise scales: the token's times the channel's). Block weights
always take the Triton GEMM, which applies the scales per ``bk``-wide slice of K (measured choices:
benchmarks/results/h200/fp8_2026-12-01/README.md, fp8_2026-12-02/README.md). Channel shapes ``_scaled_mm`` refuses
(K or N not a multiple of 16) take the Triton GEMM. On the CPU the references run: the weight dequantized, the
activation quantization emulated exactly, one float32 matmul.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch

from hyserve.kernels.fp8.reference import (
    AMAX_EPS,
    FP8_DTYPE,
    FP8_MAX,
    Fp8Activation,
    dequantize_block_weight,
    fp8_block_linear_dequant,
    fp8_block_linear_ref,
    fp8_linear_ref,
    quantize_activation_ref,
    quantize_fp8,
    quantize_per_token,
    quantize_per_token_group,
)
from hyserve.utils import next_pow2

__all__ = ["FP8_DTYPE", "FP8_MAX", "GEMM_BACKENDS", "Fp8Activation", "GemmConfig", "blockwise_scaled_mm",
           "blockwise_scaled_mm_fits", "check_fp8_device", "dequantize_block_weight", "fp8_block_linear",
           "fp8_block_linear_dequant", "fp8_block_linear_ref", "fp8_linear", "fp8_linear_ref", "gemm_backend",
           "gemm_config", "prepare_device", "quantize_activation_ref", "quantize_fp8",
           "quantize_per_token", "quantize_per_token_group", "quantize_rows", "split_locks", "token_quant_launch",
           "triton_fp8_gemm"]

# The first CUDA compute capability with FP8 tensor cores (Ada; Hopper is 9.0), which ``torch._scaled_mm`` needs.
MIN_FP8_CAPABILITY = (8, 9)


def check_fp8_device(device: torch.device) -> None:
    """Refuse a CUDA device without FP8 support (compute capability < 8.9), naming it."""
    if device.type != "cuda":
        return
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_FP8_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"FP8 weights need a GPU with FP8 support (compute capability 8.9 or newer: Ada, Hopper or "
                         f"later); {name} has {cap[0]}.{cap[1]}. Run a bf16 checkpoint without --quantization, or "
                         "use device='cpu' (which emulates FP8)")


# The CUDA GEMM for channel-scaled weights: ``scaled_mm`` (cuBLASLt through torch._scaled_mm) or ``triton``
# (_triton.py); block-scaled weights take the Triton kernel, and with ``scaled_mm`` cuBLASLt's block-scaled GEMM
# where it takes the shape (:func:`blockwise_scaled_mm_fits`; not measured yet, so not in ``auto``).
# HYSERVE_FP8_GEMM picks one for benchmarks
# (benchmarks/fp8_gemm_bench.py measures both at the decode and prefill shapes).
GEMM_BACKENDS = ("auto", "scaled_mm", "triton", "triton-fused")
# auto: the Triton GEMM up to this many rows (decode: it reads the weights at the copy bandwidth, cuBLASLt at ~70 %
# of it), cuBLASLt above (prefill: 1.5x the Triton kernel); benchmarks/results/h200/fp8_gemm.md. The activation is
# quantized by its own launch first: ``triton-fused`` (the Triton GEMM quantizing it inside its loop, one launch per
# projection) measured 0.48x the separate launch end to end at batch-1 decode (fp8_2026-12-02), and is kept to
# measure.
AUTO_TRITON_MAX_ROWS = 64
_QUANT_BLOCK = 1024  # columns a per-token quantization program reads at a time
_QUANT_GROUP_ROWS = 16  # rows a per-group quantization program takes (one 128-wide group each: a 16 x 128 tile)


def gemm_backend() -> str:
    """The channel-scaled CUDA GEMM in use (``HYSERVE_FP8_GEMM``, default ``auto``); a bad value is refused."""
    name = os.environ.get("HYSERVE_FP8_GEMM", "auto")
    if name not in GEMM_BACKENDS:
        raise ValueError(f"HYSERVE_FP8_GEMM={name!r}: the FP8 GEMMs are {', '.join(GEMM_BACKENDS)}")
    return name


def token_quant_launch(k: int) -> tuple[int, int]:
    """``(BLOCK, num_warps)`` of the per-token quantization over ``k``-wide rows (one program a row, two passes of
    ``BLOCK`` columns at a time; ``benchmarks/fp8_quant_bench.py`` sweeps other choices). From that sweep on an
    H100 (2026-12-05, batch 1-64): K = 6144 took 2.9-3.1 us at (2048, 8) against 4.0-4.2 at (1024, 4), K = 17408
    5.5-5.6 us at (4096, 16) against 8.9-9.0; K = 5120 the same within 0.1 us either way."""
    if k > 8192:
        return 4096, 16
    if k > 4096:
        return 2048, 8
    return min(_QUANT_BLOCK, next_pow2(k)), 4


def quantize_rows(x: torch.Tensor, group: int | None = None, static_scale: torch.Tensor | None = None,
                  token_major_scales: bool = False,
                  launch: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of a contiguous ``(M, K)`` CUDA activation in one Triton launch: per token (``(M, 1)``
    scales), per token and ``group`` (``(M, ceil(K / group))``), or with the one ``static_scale`` (returned as
    given). The arithmetic of :func:`quantize_per_token` / :func:`quantize_per_token_group` / :func:`quantize_fp8`.
    ``token_major_scales`` (groups): the ``(M, G)`` scales laid out token-fastest (strides ``(1, M)``), as
    ``torch._scaled_mm``'s 1x128 block scaling takes them (its check wants the stride M exactly: a column padded
    to a multiple of 4 was refused on the card for M = 1, 33, 2049). ``launch``: per token (or static), the
    ``(BLOCK, num_warps)`` instead of :func:`token_quant_launch`'s."""
    from hyserve.kernels.fp8._triton import _quant_rows_kernel

    m, k = x.shape
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    if static_scale is not None:
        scale = static_scale.float().reshape(1)
        block, warps = launch or (_QUANT_BLOCK, 4)
        grid, g, rows = (m, 1), 0, 1
    elif group is not None:
        groups = -(-k // group)
        if token_major_scales:
            scale = torch.empty(groups, m, dtype=torch.float32, device=x.device).t()
        else:
            scale = torch.empty(m, groups, dtype=torch.float32, device=x.device)
        assert launch is None, "the per-group quantization's tiles are the groups'"
        grid, g, block, rows = (-(-m // _QUANT_GROUP_ROWS), groups), group, next_pow2(group), _QUANT_GROUP_ROWS
        warps = 4
    else:
        scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
        block, warps = launch or token_quant_launch(k)
        grid, g, rows = (m, 1), 0, 1
    assert block == next_pow2(block), "BLOCK must be a power of two"
    if m:
        two_d = scale.dim() > 1
        _quant_rows_kernel[grid](x, q, scale, m, k, x.stride(0), q.stride(0), scale.stride(0) if two_d else 0,
                                 scale.stride(1) if two_d else 0, FP8_MAX, AMAX_EPS, GROUP=g,
                                 STATIC=static_scale is not None, BLOCK=block, ROWS=rows, num_warps=warps)
    return q, (static_scale.float().reshape(1, 1) if static_scale is not None else scale)


def compile_variants() -> list[tuple[str, Any, dict[str, str], dict[str, Any]]]:
    """The variants of :func:`quantize_rows`' kernel that block and channel FP8 models launch from bf16 activations,
    as ``(name, jit function, argument types, constexprs)``, for a compile check without a GPU
    (``tests/kernels/test_qwen4_exp_kernels_compile.py``)."""
    from hyserve.kernels.fp8._triton import _quant_rows_kernel

    sig = dict(x_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32", M="i32", K="i32", sx="i32", sq="i32", ss="i32",
               ssg="i32", fp8_max="fp32", eps="fp32")
    return [("quant_rows_group", _quant_rows_kernel, sig,
             dict(GROUP=128, STATIC=False, BLOCK=128, ROWS=_QUANT_GROUP_ROWS)),
            ("quant_rows_token", _quant_rows_kernel, sig, dict(GROUP=0, STATIC=False, BLOCK=_QUANT_BLOCK, ROWS=1))]


# Output tiles a split-K launch can have (one int32 lock each); a launch with more tiles fills the card unsplit.
SPLIT_LOCKS = 1 << 16
_locks: dict[torch.device, torch.Tensor] = {}


def split_locks(device: torch.device) -> torch.Tensor:
    """The device's zeroed split-K locks, made on first use. Not inside a CUDA graph capture: the zeros would be
    written only when the graph replays (the FP8 layers make them at load, :func:`prepare_device`)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    locks = _locks.get(device)
    if locks is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"the FP8 GEMM's split-K locks on {device} are made before a CUDA graph is captured "
                               "(fp8.prepare_device)")
        locks = _locks[device] = torch.zeros(SPLIT_LOCKS, dtype=torch.int32, device=device)
    return locks


def prepare_device(device: torch.device) -> None:
    """Make what the FP8 GEMMs keep on ``device`` (the split-K locks) before any graph capture."""
    if torch.device(device).type == "cuda":
        split_locks(device)


class GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    group_m: int
    num_warps: int
    num_stages: int


def gemm_config(m: int, n: int, k: int, block_k: int | None = None, num_sms: int = 132) -> GemmConfig:
    """Tile sizes for ``(M, N, K)``; ``block_k`` fixed for block-scaled weights (the scale block). Decode shapes
    (few rows) split K until the card has about two programs per SM; prefill shapes take large tiles."""
    bk = block_k or 128
    if m <= 64:
        bm = 16 if m <= 16 else (32 if m <= 32 else 64)
        bn = 64
        tiles = -(-m // bm) * -(-n // bn)
        k_tiles = -(-k // bk)
        split = max(1, min(k_tiles // 2, -(-2 * num_sms // tiles)))
        return GemmConfig(bm, bn, bk, split, 1, 4, 4)
    bm = 64 if m <= 128 else 128
    return GemmConfig(bm, 128, bk, 1, 8, 8 if bm == 128 else 4, 3)


def triton_fp8_gemm(q: torch.Tensor, q_scale: torch.Tensor | None, weight: torch.Tensor, weight_scale: torch.Tensor,
                    block: tuple[int, int] | None, out_dtype: torch.dtype, config: GemmConfig | None = None,
                    quantize: str | None = None) -> torch.Tensor:
    """``(q * q_scale) (weight * weight_scale)^T`` with the Triton kernel; ``weight (N, K)`` FP8 with ``(N, 1)``
    scales (``block`` None) or block scales.

    ``quantize`` None: ``q (M, K)`` is FP8 with ``(M, 1)`` or ``(M, ceil(K / block_k))`` scales ``q_scale``. Else
    ``q`` is the unquantized activation and the GEMM quantizes it as it reads it: ``"token"``, ``"group"``
    (``block_k``-wide, block weights only) or ``"static"`` (``q_scale``: the one scale), the values of
    :func:`quantize_per_token` / :func:`quantize_per_token_group` / :func:`quantize_fp8` exactly."""
    from hyserve.kernels.fp8._triton import (
        A_DYNAMIC_GROUP,
        A_DYNAMIC_TOKEN,
        A_PRECOMPUTED,
        A_STATIC,
        _fp8_gemm_kernel,
    )

    m, k = q.shape
    n = weight.shape[0]
    cfg = config or gemm_config(m, n, k, block[1] if block else None,
                                torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 132)
    if block is not None:
        assert cfg.block_k == block[1], (cfg, block)
    mode = {None: A_PRECOMPUTED, "token": A_DYNAMIC_TOKEN, "group": A_DYNAMIC_GROUP, "static": A_STATIC}[quantize]
    assert mode != A_DYNAMIC_GROUP or block is not None, "group quantization goes with block weights"
    scale = q_scale if q_scale is not None else weight_scale  # unread by the dynamic modes
    per_k = mode == A_PRECOMPUTED and scale.shape[1] > 1
    per_m = mode == A_PRECOMPUTED and scale.shape[0] > 1  # a static scale is one element for every row
    split = cfg.split_k
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    if split > 1 and tiles > SPLIT_LOCKS:
        split = 1
    out = torch.empty(m, n, dtype=out_dtype, device=q.device)
    # split K: the programs' float32 partials, and the tiles' locks (zero between launches; the last program of a
    # tile sets its lock back)
    ws = torch.empty(split, m, n, dtype=torch.float32, device=q.device) if split > 1 else out
    locks = split_locks(q.device) if split > 1 else out
    grid = (tiles, split)
    _fp8_gemm_kernel[grid](
        q, scale, weight, weight_scale, out, ws, locks, m, n, k,
        q.stride(0), weight.stride(0), out.stride(0), scale.stride(0) if per_m else 0,
        scale.stride(1) if per_k else 0,
        weight_scale.stride(0), weight_scale.stride(1) if block is not None else 0, FP8_MAX, AMAX_EPS,
        BLOCKWISE=block is not None, SCALE_N=block[0] if block is not None else 1, UPCAST=not q.is_cuda,
        A_MODE=mode, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=split,
        GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out


def _gemm_out_dtype(x: torch.Tensor) -> torch.dtype:
    """The GEMMs write bf16 or fp16 (a float32 model's output is cast back after)."""
    return x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


def fp8_linear(x: torch.Tensor | Fp8Activation, weight: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T`` over the last dimension of ``x`` (any leading shape) for a per-channel FP8 weight (see
    :func:`fp8_linear_ref`); output in ``x.dtype``. ``x`` may come quantized per token already
    (:class:`Fp8Activation`, ``(M, K)`` rows): then no quantization launch."""
    n, k = weight.shape
    if isinstance(x, Fp8Activation):
        assert input_scale is None, "an activation quantized per token meets a static input scale"
        if not x.q.is_cuda or x.q.shape[0] == 0:
            return fp8_linear_ref(x, weight, weight_scale)
        m = x.q.shape[0]
        out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        q, s = x.q, x.scale
        lead: tuple[int, ...] = (m,)
    else:
        lead = tuple(x.shape[:-1])
        x2 = x.reshape(-1, x.shape[-1])
        m = x2.shape[0]
        if not x.is_cuda or m == 0:
            return fp8_linear_ref(x2, weight, weight_scale, input_scale).view(*lead, n)
        out_dtype = _gemm_out_dtype(x)
    backend = gemm_backend()
    if backend == "auto":
        backend = "triton" if m <= AUTO_TRITON_MAX_ROWS else "scaled_mm"
    if backend == "triton-fused" and not isinstance(x, Fp8Activation):
        # the activation quantized inside the GEMM: one launch per projection
        y = triton_fp8_gemm(x2.contiguous(), input_scale, weight, weight_scale.view(n, 1), None, out_dtype,
                            quantize="token" if input_scale is None else "static")
    elif backend in ("triton", "triton-fused") or k % 16 or n % 16:
        if not isinstance(x, Fp8Activation):
            q, s = quantize_rows(x2.contiguous(), static_scale=input_scale)
        y = triton_fp8_gemm(q, s, weight, weight_scale.view(n, 1), None, out_dtype)
    else:
        if not isinstance(x, Fp8Activation):
            q, s = quantize_rows(x2.contiguous(), static_scale=input_scale)
        # cuBLASLt takes the second operand column-major: the contiguous (N, K) weight's transpose is; rowwise
        # scaling is a (M, 1) scale for the tokens and a (1, N) one for the channels.
        if s.shape[0] != q.shape[0]:
            s = s.expand(q.shape[0], 1).contiguous()
        y = torch._scaled_mm(q, weight.t(), scale_a=s, scale_b=weight_scale.view(1, n), out_dtype=out_dtype)
    return y.to(x.dtype).view(*lead, n)


def blockwise_scaled_mm_fits(weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int]) -> bool:
    """Whether cuBLASLt's block-scaled FP8 GEMM (``torch._scaled_mm`` with 1x128 activation and 128x128 weight
    scales) takes this weight: 128 x 128 blocks, K and N multiples of 16, and whole groups of four K blocks (its
    scales' rows 16-byte aligned)."""
    n, k = weight.shape
    return tuple(block) == (128, 128) and k % 16 == 0 and n % 16 == 0 and weight_scale.shape[1] % 4 == 0


def blockwise_scaled_mm(x2: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                        out_dtype: torch.dtype) -> torch.Tensor:
    """``x2 W^T`` through cuBLASLt's block-scaled FP8 GEMM: ``x2`` quantized per token and 128-wide group in one
    launch, its scales laid token-fastest as cuBLASLt reads them; the weight's transpose is column-major and its
    ``(N / 128, K / 128)`` scales' transpose ``(K / 128, N / 128)``. For ``HYSERVE_FP8_GEMM=scaled_mm`` (measured
    against the Triton kernel by ``benchmarks/fp8_gemm_bench.py``). The token count is padded with zero rows to a
    multiple of 4: torch's check wants the scales' columns exactly M apart, and cuBLASLt refuses columns that are not
    16-byte aligned (``CUBLAS_STATUS_NOT_SUPPORTED`` for M = 1, 33, 2049 on an H100 with CUDA 13)."""
    m = x2.shape[0]
    if m % 4:
        x2 = torch.cat([x2, x2.new_zeros(4 - m % 4, x2.shape[1])])
    q, s = quantize_rows(x2, group=128, token_major_scales=True)
    return torch._scaled_mm(q, weight.t(), scale_a=s, scale_b=weight_scale.t(), out_dtype=out_dtype)[:m]


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int],
                     group: int | None) -> torch.Tensor:
    """``x W^T`` over the last dimension of ``x`` for a block-scaled FP8 weight (see :func:`fp8_block_linear_ref`);
    output in ``x.dtype``. On CUDA: the activations quantized in one launch, then the block-scaled Triton GEMM (the
    scales applied per 128-wide slice of K inside its loop)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    n = weight.shape[0]
    if not x.is_cuda or x2.shape[0] == 0:
        return fp8_block_linear_ref(x2, weight, weight_scale, block, group).view(*lead, n)
    if group is not None and group != block[1]:
        raise ValueError(f"block FP8: activation groups of {group} with {block[0]}x{block[1]} weight blocks; the "
                         "kernel takes groups as wide as the blocks")
    out_dtype = _gemm_out_dtype(x)
    backend = gemm_backend()
    if backend == "triton-fused":  # the GEMM quantizes the activation as it reads it
        y = triton_fp8_gemm(x2.contiguous(), None, weight, weight_scale, block, out_dtype,
                            quantize="group" if group is not None else "token")
    elif backend == "scaled_mm" and group is not None and blockwise_scaled_mm_fits(weight, weight_scale, block):
        y = blockwise_scaled_mm(x2.contiguous(), weight, weight_scale, out_dtype)
    else:
        q, s = quantize_rows(x2.contiguous(), group=group)
        y = triton_fp8_gemm(q, s, weight, weight_scale, block, out_dtype)
    return y.to(x.dtype).view(*lead, n)


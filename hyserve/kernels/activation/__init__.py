"""The feed-forward blocks' ungated activation: ``relu_squared(x) = square(relu(x))`` in ``x``'s dtype (Nemotron-H's
``relu2``, transformers' ``ReLUSquaredActivation``: ``torch.square(F.relu(x))``).

Where the Triton kernels run (``hyserve.kernels.moe.uses_triton``: CUDA, or the interpreter in tests) one launch,
which loads ``x``, squares its positive part in float32 and rounds once to ``x``'s dtype: the torch formulation's
rounding exactly (the square of a bf16 / fp16 value is exact in float32, so both round the same real number; float32
rounds ``x * x`` once in both), NaN kept as torch's ``relu`` keeps it. Elsewhere the plain-torch reference
(``reference.py``), which also spends a second launch and a temporary on the ``relu``.
"""

from __future__ import annotations

from typing import Any

import torch

from hyserve.kernels.activation.reference import relu_squared_ref
from hyserve.kernels.moe import uses_triton
from hyserve.utils import next_pow2

__all__ = ["compile_variants", "relu_squared", "relu_squared_ref", "relu_squared_triton"]

MAX_BLOCK = 1024


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    """``square(relu(x))`` in ``x``'s dtype: the Triton kernel where it runs, the torch reference elsewhere."""
    return relu_squared_triton(x) if uses_triton(x) else relu_squared_ref(x)


def relu_squared_triton(x: torch.Tensor) -> torch.Tensor:
    """One launch over ``x`` viewed as rows of its last dimension (the last dim contiguous, rows at any stride), in
    tiles of up to ``MAX_BLOCK`` columns (and of several rows where rows are narrower); the output is a new
    contiguous tensor of ``x``'s shape and dtype."""
    from hyserve.kernels.activation._triton import _relu_squared_kernel

    width = x.shape[-1]
    rows = x.reshape(-1, width) if x.dim() != 2 else x
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if out.numel():
        block = min(next_pow2(width), MAX_BLOCK)
        tile_rows = max(1, min(16, MAX_BLOCK // block))  # narrow rows: several a program
        n = rows.shape[0]
        _relu_squared_kernel[(-(-n // tile_rows), -(-width // block))](rows, out, n, width, rows.stride(0),
                                                                       ROWS=tile_rows, BLOCK=block, num_warps=4)
    return out.view(x.shape)


def compile_variants() -> list[tuple[str, Any, dict[str, str], dict[str, Any]]]:
    """The kernel's variants for float32, bf16 and fp16 models, one row of the widest block and a tile of narrow
    rows, as ``(name, jit function, argument types, constexprs)``, for a compile check without a GPU."""
    from hyserve.kernels.activation._triton import _relu_squared_kernel

    return [(f"relu_squared_{dt}_{rows}x{block}", _relu_squared_kernel,
             dict(x_ptr=f"*{dt}", out_ptr=f"*{dt}", n_rows="i32", n_cols="i32", sx_row="i32"),
             dict(ROWS=rows, BLOCK=block))
            for dt in ("fp32", "bf16", "fp16") for rows, block in ((1, MAX_BLOCK), (16, 64))]

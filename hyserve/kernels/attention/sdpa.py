"""Long prefill rows through torch's scaled-dot-product attention (FlashAttention on CUDA), the other rows through
the paged kernel: :func:`paged_attention_rows`.

Why: the Triton paged prefill kernel reaches about 210 TFLOP/s at head dim 256 on an H200, torch's SDPA 490 on the
same problem (``benchmarks/results/h200/attention_prefill.json``). A row of many queries is one SDPA call: its keys
and values are this step's own (a fresh prompt: ``is_causal``, the upper-left causal mask is the row's) or, where
the row continues a context (a prefix-cache hit, a later chunk), read back from the paged cache for the row's
blocks and attended with the lower-right causal mask (query ``i`` sees keys ``[0, ctx + i]``). GQA is SDPA's own
(``enable_gqa``), no key or value repeated. Rows below the threshold take the paged kernels, their outputs put back
in place: decode and verify rows (short enough for the split-context kernel's lanes) as one sub-batch, short prompt
chunks as another (the prefill kernel's).

The semantics are :func:`hyserve.kernels.attention.paged_attention`'s (the module's invariants); the softmax is
SDPA's (float32 inside FlashAttention), so outputs agree to the dtype's rounding, not bit for bit. On CUDA the
choice is made only where FlashAttention takes the shapes (``torch.backends.cuda.can_use_flash_attention``), and the
calls are held to it (:func:`flash_only`): SDPA neither falls back to its math path nor picks cuDNN's attention,
whose host-side plan for each new length left the device idle 40-60 ms a time. The host's copies of the row offsets
and lengths drive the split (an eager step's; a captured graph has none and runs the paged kernel).
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from hyserve.utils import device_tensor

__all__ = ["PREFILL_ATTENTION_MODES", "SDPA_MIN_QUERIES", "RowPlan", "SubBatch", "flash_only", "paged_attention_rows",
           "prefill_attention_mode", "preload", "sdpa_takes"]

# Rows of at least this many queries go to SDPA (below it the paged kernel's launch is as good, and a step's decode
# and verify rows stay in one launch).
SDPA_MIN_QUERIES = 128
PREFILL_ATTENTION_MODES = ("auto", "triton", "sdpa")


def prefill_attention_mode() -> str:
    """``HYSERVE_PREFILL_ATTENTION``: ``auto`` (default: long rows through SDPA where FlashAttention runs them, on
    CUDA in bf16 / fp16 with a cache of the model's dtype), ``triton`` (every row through the paged kernel) or
    ``sdpa`` (long rows through SDPA on any device and dtype, whatever backend it picks, the cache in q's dtype: for
    tests)."""
    value = os.environ.get("HYSERVE_PREFILL_ATTENTION", "auto")
    if value not in PREFILL_ATTENTION_MODES:
        raise ValueError(f"HYSERVE_PREFILL_ATTENTION={value!r}: one of {', '.join(PREFILL_ATTENTION_MODES)}")
    return value


def sdpa_takes(mode: str, q: torch.Tensor, k_cache: torch.Tensor, fp8_cache: bool) -> bool:
    """Whether a step's long rows go to SDPA under ``mode``: never with an FP8 cache (its scales are the paged
    kernel's) or a cache in another dtype than q's (the keys read back are attended as they are); ``auto``: on
    CUDA, q in bf16 / fp16, FlashAttention taking the head size and heads (checked once per shape on a one-token
    problem)."""
    if fp8_cache or mode == "triton" or k_cache.dtype != q.dtype:
        return False
    if mode == "sdpa":
        return True
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    return _flash_takes(q.device, q.dtype, q.shape[1], k_cache.shape[2], q.shape[2])


def flash_only(q: torch.Tensor, hkv: int) -> bool:
    """Whether the long rows' SDPA calls are held to FlashAttention: on CUDA, in bf16 / fp16, where it takes the
    heads. Left to itself, torch may pick cuDNN's attention for a fresh row (``is_causal``), and cuDNN builds an
    execution plan on the host for every new (query, key) length: 40-60 ms of idle device for each new prompt
    length on an H100 (the seed's opening burst, 2026-12-07: 8 such builds in 12 prompt steps)."""
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and _flash_takes(q.device, q.dtype, q.shape[1], hkv, q.shape[2]))


def causal_lower_right(n: int, ctx_len: int) -> torch.Tensor:
    """torch's lower-right causal mask of ``n`` queries over ``ctx_len`` keys. Imported here, not at the top:
    ``torch.nn.attention.bias`` imports torch._dynamo, about 2 s of CPU on a CI core in every process that builds a
    model (each worker process, each server, each interpreter subprocess), where only a row continuing its context
    needs it. A CUDA worker imports it as it starts (``preload``), so no step pays it."""
    from torch.nn.attention.bias import causal_lower_right as mask

    return mask(n, ctx_len)  # type: ignore[no-any-return]


def preload() -> None:
    """Import what :func:`paged_attention_rows` imports on its first row after a context (a CUDA worker calls it as
    it starts: no step waits for the import)."""
    import torch.nn.attention.bias  # noqa: F401


@functools.lru_cache(maxsize=64)
def _flash_takes(device: torch.device, dtype: torch.dtype, hq: int, hkv: int, d: int) -> bool:
    probe_q = torch.empty((1, hq, 1, d), dtype=dtype, device=device)
    probe_kv = torch.empty((1, hkv, 1, d), dtype=dtype, device=device)
    params = torch.backends.cuda.SDPAParams(probe_q, probe_kv, probe_kv, None, 0.0, True, hkv != hq)
    return bool(torch.backends.cuda.can_use_flash_attention(params, False))


@dataclass(slots=True)
class SubBatch:
    """Rows below SDPA's threshold that one paged launch takes: their tokens, their rows, their offsets renumbered
    (on the device) and their longest query and context (host ints)."""

    tokens: torch.Tensor  # (n,) int64 the rows' tokens among the step's
    rows: torch.Tensor  # (r,) int64 the rows among the step's
    query_start_loc: torch.Tensor  # (r + 1,) int32
    max_query_len: int
    max_seq_len: int


@dataclass(slots=True)
class RowPlan:
    """How :func:`paged_attention_rows` takes a step's rows, worked out once a step and taken by every attention
    layer of it (``StepMetadata.attention_plans``): before, each layer rebuilt the sub-batches' index vectors and
    copied them to the device (a 27B prompt step: about 30 host operations and three copies in each of its 16
    attention layers). ``sdpa_rows``: (row, first token, queries, context length) of each row SDPA takes;
    ``sub_batches``: the others, the split-context kernel's rows first, then the prefill kernel's."""

    num_rows: int
    sdpa_rows: list[tuple[int, int, int, int]]
    sub_batches: list[SubBatch]

    @staticmethod
    def of(query_start_loc_cpu: list[int], seq_lens_cpu: list[int], group: int, min_queries: int,
           device: torch.device | str) -> RowPlan:
        """The plan of rows with host offsets ``query_start_loc_cpu`` ``(R + 1)`` and context lengths
        ``seq_lens_cpu`` ``(R)``, for query heads ``group`` to a KV head: rows of at least ``min_queries`` queries
        to SDPA, the other non-empty rows to the paged kernels, those short enough for the split-context kernel's
        lanes (decode and verify rows) in one sub-batch, the others (short prompt chunks) in the prefill
        kernel's."""
        from hyserve.kernels.attention import short_row_lanes

        rows = len(seq_lens_cpu)
        sdpa_rows: list[tuple[int, int, int, int]] = []
        short: list[int] = []
        longer: list[int] = []
        for i in range(rows):
            s, n = query_start_loc_cpu[i], query_start_loc_cpu[i + 1] - query_start_loc_cpu[i]
            if n >= min_queries:
                sdpa_rows.append((i, s, n, seq_lens_cpu[i]))
            elif n > 0:
                (short if short_row_lanes(n, group) is not None else longer).append(i)
        subs = []
        for sub_rows in (short, longer):
            if not sub_rows:
                continue
            lens = [query_start_loc_cpu[i + 1] - query_start_loc_cpu[i] for i in sub_rows]
            tokens = [t for i in sub_rows for t in range(query_start_loc_cpu[i], query_start_loc_cpu[i + 1])]
            offsets = [0]
            for n in lens:
                offsets.append(offsets[-1] + n)
            subs.append(SubBatch(device_tensor(tokens, device, torch.long), device_tensor(sub_rows, device, torch.long),
                                 device_tensor(offsets, device, torch.int32), max(lens),
                                 max(seq_lens_cpu[i] for i in sub_rows)))
        return RowPlan(rows, sdpa_rows, subs)


def paged_attention_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    plan: RowPlan,
) -> torch.Tensor:
    """Causal attention of the varlen queries ``q`` ``(T, Hq, D)`` as ``paged_attention`` computes it (the caches
    already hold this step's ``k`` / ``v``, ``(T, Hkv, D)``), the rows taken as the step's ``plan`` says: rows of at
    least its threshold of queries one SDPA call each, the others in the paged kernels' sub-batches (``seq_lens``
    on the device, for them)."""
    from hyserve.kernels.attention import paged_attention

    t, hq, d = q.shape
    hkv, bs = k_cache.shape[2], k_cache.shape[1]
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    backends = sdpa_kernel([SDPBackend.FLASH_ATTENTION]) if flash_only(q, hkv) else contextlib.nullcontext()
    with backends:
        for i, s, n, ctx_len in plan.sdpa_rows:
            if ctx_len == n:  # a fresh row: its own keys, the upper-left causal mask is the row's
                ki, vi, mask = k[s : s + n], v[s : s + n], None
            else:  # after a context: the row's whole context read back from its blocks, lower-right causal
                blocks = block_tables[i, : -(-ctx_len // bs)]
                ki = k_cache.index_select(0, blocks).reshape(-1, hkv, d)[:ctx_len]
                vi = v_cache.index_select(0, blocks).reshape(-1, hkv, d)[:ctx_len]
                mask = causal_lower_right(n, ctx_len)
            o = F.scaled_dot_product_attention(
                q[s : s + n].transpose(0, 1).unsqueeze(0), ki.transpose(0, 1).unsqueeze(0),
                vi.transpose(0, 1).unsqueeze(0), attn_mask=mask, is_causal=mask is None, scale=scale,
                enable_gqa=hkv != hq)
            out[s : s + n] = o[0].transpose(0, 1)
    for sub in plan.sub_batches:
        got = paged_attention(q.index_select(0, sub.tokens).contiguous(), k_cache, v_cache,
                              block_tables.index_select(0, sub.rows), sub.query_start_loc,
                              seq_lens.index_select(0, sub.rows), scale, sub.max_query_len, sub.max_seq_len)
        out.index_copy_(0, sub.tokens, got)
    return out

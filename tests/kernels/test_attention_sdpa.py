"""Long prefill rows through SDPA, the others through the paged kernel (``hyserve.kernels.attention.sdpa``), on the
CPU (SDPA's own CPU path; FlashAttention's dispatch is the card's): against the naive per-token yardstick of
``test_kernels`` on a mixed step (a fresh prompt, a chunk after a cached context, decode rows, a short chunk and an
empty row) over a shuffled block table with GQA; each sabotaged variant (the upper-left mask after a context, the
row's own keys in place of its context, the short rows' outputs put back in the wrong places) must disagree. The
engine's use of it (``HYSERVE_PREFILL_ATTENTION``) is checked in ``tests/model/test_prefill_attention.py``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_kernels import attn_problem, attn_yardstick

from hyserve.kernels.attention import sdpa
from hyserve.testing.triton_interpreter import mutated_module

# (queries, context before the step) per row: a fresh 40-token prompt, a decode row, 20 queries after 13 cached
# tokens (a block boundary inside), an empty row, a 3-token chunk after 6, a fresh 17-token prompt.
LENS, CTXS = [40, 1, 20, 0, 3, 17], [0, 24, 13, 9, 6, 0]
MIN_QUERIES = 16  # rows 0, 2 and 5 go to SDPA


def problem(dtype: torch.dtype) -> dict[str, Any]:
    """``attn_problem``'s step with this step's keys and values read out of the cache (where store_kv put them)."""
    p = attn_problem(LENS, CTXS, Hq=4, Hkv=2, D=16, block_size=4, dtype=dtype, seed=31)
    bt, bs = p["block_tables"], p["k_cache"].shape[1]
    ks, vs = [], []
    for r, (n, c) in enumerate(zip(LENS, CTXS, strict=True)):
        for pos in range(c, c + n):
            blk = int(bt[r, pos // bs])
            ks.append(p["k_cache"][blk, pos % bs])
            vs.append(p["v_cache"][blk, pos % bs])
    p["k"], p["v"] = torch.stack(ks), torch.stack(vs)
    return p


def plan_of(p: dict[str, Any], min_queries: int = MIN_QUERIES, module: Any = sdpa) -> sdpa.RowPlan:
    """The step's row plan, as the attention layer works it out from the host's offsets and context lengths."""
    plan: sdpa.RowPlan = module.RowPlan.of(p["query_start_loc"].tolist(), p["seq_lens"].tolist(),
                           p["q"].shape[1] // p["k_cache"].shape[2], min_queries, p["q"].device)
    return plan


def run(p: dict[str, Any], module: Any = sdpa) -> torch.Tensor:
    out: torch.Tensor = module.paged_attention_rows(
        p["q"], p["k"], p["v"], p["k_cache"], p["v_cache"], p["block_tables"], p["seq_lens"], p["scale"],
        plan_of(p, module=module))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_split_between_sdpa_and_the_paged_kernel_match_the_yardstick(dtype: torch.dtype) -> None:
    p = problem(dtype)
    got = run(p)
    assert got.dtype == dtype and got.shape == p["q"].shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), attn_yardstick(p), atol=tol, rtol=tol)


def test_every_row_below_the_threshold_is_the_paged_kernel_alone() -> None:
    """No row long enough: the output is the paged kernels' over the whole step, bit for bit (the 40-token row in
    the prefill kernel's sub-batch, the others in the split-context kernel's)."""
    from hyserve.kernels.attention import paged_attention

    p = problem(torch.float32)
    got = sdpa.paged_attention_rows(p["q"], p["k"], p["v"], p["k_cache"], p["v_cache"], p["block_tables"],
                                    p["seq_lens"], p["scale"], plan_of(p, min_queries=100))
    want = paged_attention(p["q"], p["k_cache"], p["v_cache"], p["block_tables"], p["query_start_loc"],
                           p["seq_lens"], p["scale"], p["max_query_len"], p["max_seq_len"])
    assert torch.equal(got, want)


SABOTAGES = {
    # after a context, the mask aligned top-left (query i sees keys [0, i]) instead of bottom-right
    "upper_left_after_a_context": [("mask = causal_lower_right(n, ctx_len)", "mask = None")],
    # a row after a context attends to its own keys alone
    "own_keys_after_a_context": [("if ctx_len == n:  # a fresh row", "if True:  # a fresh row")],
    # the short rows' outputs put back in reverse order
    "short_rows_misplaced": [("out.index_copy_(0, sub.tokens, got)", "out.index_copy_(0, sub.tokens.flip(0), got)")],
    # the plan: each short row's tokens counted from the row's second token (its last token from the next row)
    "plan_tokens_shifted": [("for t in range(query_start_loc_cpu[i], query_start_loc_cpu[i + 1])]",
                             "for t in range(query_start_loc_cpu[i] + 1, query_start_loc_cpu[i + 1] + 1)]")],
    # the plan: a sub-batch's longest context taken as its shortest (the launch covers too little of the others)
    "plan_context_too_short": [("max(seq_lens_cpu[i] for i in sub_rows)", "min(seq_lens_cpu[i] for i in sub_rows)")],
}


@pytest.mark.parametrize("what", sorted(SABOTAGES))
def test_sabotaged_splits_are_caught(what: str) -> None:
    p = problem(torch.float32)
    mutated = mutated_module(sdpa.__name__, SABOTAGES[what])
    got = run(p, mutated)
    assert not torch.allclose(got, attn_yardstick(p), atol=1e-3, rtol=1e-3), f"{what} went unseen"


def test_flash_is_imposed_on_cuda_half_precision_alone() -> None:
    """On the CPU (and in float32) SDPA keeps its own choice: the tests' mode ``sdpa`` runs its CPU path."""
    assert not sdpa.flash_only(torch.zeros(1, 4, 16, dtype=torch.bfloat16), 2)
    assert not sdpa.flash_only(torch.zeros(1, 4, 16), 2)


def test_the_mode_is_read_and_refused_when_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    q, cache = torch.zeros(1, 4, 16), torch.zeros(2, 4, 2, 16)
    monkeypatch.delenv("HYSERVE_PREFILL_ATTENTION", raising=False)
    assert sdpa.prefill_attention_mode() == "auto"
    assert not sdpa.sdpa_takes("auto", q, cache, fp8_cache=False)  # auto: CUDA only
    assert sdpa.sdpa_takes("sdpa", q, cache, fp8_cache=False)
    assert not sdpa.sdpa_takes("sdpa", q, cache, fp8_cache=True)  # an FP8 cache's scales are the paged kernel's
    assert not sdpa.sdpa_takes("triton", q, cache, fp8_cache=False)
    monkeypatch.setenv("HYSERVE_PREFILL_ATTENTION", "flash")
    with pytest.raises(ValueError, match="HYSERVE_PREFILL_ATTENTION"):
        sdpa.prefill_attention_mode()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_rows_through_flash_match_the_paged_kernel() -> None:
    """On the card, bf16 at head dim 256 (Qwen3.5's): FlashAttention takes the shapes and runs every long row, and
    the split step's output is the paged kernel's within bf16's rounding."""
    from hyserve.kernels.attention import paged_attention

    lens, ctxs = [300, 1, 200, 0, 5, 130], [0, 40, 150, 9, 60, 0]
    p = attn_problem(lens, ctxs, Hq=8, Hkv=2, D=256, block_size=16, dtype=torch.bfloat16, seed=32)
    p = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in p.items()}
    assert sdpa.sdpa_takes("auto", p["q"], p["k_cache"], fp8_cache=False)
    bt, bs = p["block_tables"].long(), 16
    rows = [(r, pos) for r, (n, c) in enumerate(zip(lens, ctxs, strict=True)) for pos in range(c, c + n)]
    blk = torch.tensor([int(bt[r, pos // bs]) for r, pos in rows], device="cuda")
    off = torch.tensor([pos % bs for _, pos in rows], device="cuda")
    k, v = p["k_cache"][blk, off], p["v_cache"][blk, off]
    assert sdpa.flash_only(p["q"], 2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        got = sdpa.paged_attention_rows(p["q"], k, v, p["k_cache"], p["v_cache"], p["block_tables"], p["seq_lens"],
                                        p["scale"], plan_of(p, sdpa.SDPA_MIN_QUERIES))
        torch.cuda.synchronize()
    want = paged_attention(p["q"], p["k_cache"], p["v_cache"], p["block_tables"], p["query_start_loc"],
                           p["seq_lens"], p["scale"], p["max_query_len"], p["max_seq_len"])
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    # The fresh rows (0 and 5) and the row after a context (2) all in FlashAttention's kernel, none in cuDNN's
    # (whose host-side plan for each new length left the device idle 40-60 ms a time on an H100).
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert sum("flash" in n for n in names) >= 3 and not any("cudnn" in n for n in names), names

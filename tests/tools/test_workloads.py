"""The prefix-caching benchmark's pieces that need no engine: the multi-turn workload generator (deterministic,
growing prompts, one shared system prefix) and the two pure hit simulations, on hand-made traces whose answers are
worked out by hand in each test."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

from prefix_cache_bench import (
    QWEN35_2B_STATE_SHAPE,
    SnapshotPolicy,
    StateShape,
    TraceRequest,
    ideal_hits,
    percentile,
    prefill_tokens_computed,
    sequential_trace,
    simulate_hits,
    vllm_style_block_size,
    vllm_style_hits,
)

from hyserve.tools.workload import FULL, SCALES, AgentTraceSpec, make_conversations


def toks(start: int, n: int) -> list[int]:
    """``n`` distinct token ids from ``start`` (disjoint ranges never share a block)."""
    return list(range(start, start + n))


# ------------------------------------------------------------------------------------------------------ workloads


def test_workload_is_deterministic_and_seeded():
    a = make_conversations("cpu", seed=0, vocab_size=448)
    b = make_conversations("cpu", seed=0, vocab_size=448)
    c = make_conversations("cpu", seed=1, vocab_size=448)
    assert a == b
    assert a != c
    assert len(a) == SCALES["cpu"].num_conversations


def test_conversation_does_not_depend_on_how_many_there_are():
    spec = SCALES["cpu"]
    fewer = AgentTraceSpec(**{**{k: getattr(spec, k) for k in spec.__dataclass_fields__}, "num_conversations": 3})
    assert make_conversations(fewer, 0, 448) == make_conversations(spec, 0, 448)[:3]


@pytest.mark.parametrize("scale", ["cpu", "full"])
def test_shared_prefix_and_growth(scale):
    spec = SCALES[scale]
    vocab = 448 if scale == "cpu" else 248320
    convs = make_conversations(scale, seed=3, vocab_size=vocab)
    prefix = convs[0].system_prefix
    assert len(prefix) == spec.system_prefix_len
    firsts = set()
    for conv in convs:
        assert conv.system_prefix == prefix
        assert spec.turns[0] >= 1 and 1 <= conv.num_turns <= spec.turns[1]
        assert len(conv.output_lens) == conv.num_turns
        assert all(spec.output_len[0] <= n <= spec.output_len[1] for n in conv.output_lens)
        lens = [conv.prompt_len(t) for t in range(conv.num_turns)]
        assert lens == sorted(set(lens)), "prompts must grow strictly turn by turn"
        assert lens[-1] <= spec.max_prompt_len
        assert lens[0] == spec.system_prefix_len + len(conv.messages[0])
        assert all(0 <= t < vocab for m in conv.messages for t in m)
        firsts.add(conv.messages[0])
    assert len(firsts) == len(convs), "conversations diverge right after the shared prefix"
    all_lens = [c.prompt_len(t) for c in convs for t in range(c.num_turns)]
    if scale == "cpu":
        assert 250 <= min(all_lens) and max(all_lens) <= 750
    else:
        assert 4000 <= min(all_lens) and max(all_lens) <= 12288
        assert spec.concurrency == 32 and spec.system_prefix_len == FULL.system_prefix_len == 1700
        assert sum(c.num_turns > 1 for c in convs) == len(convs)


def test_prompts_extend_previous_prompt_and_actual_output():
    conv = make_conversations("cpu", seed=0, vocab_size=448)[0]
    outputs = [[1000 + 10 * t + j for j in range(n)] for t, n in enumerate(conv.output_lens)]
    prompt = conv.first_prompt()
    assert prompt[: len(conv.system_prefix)] == list(conv.system_prefix)
    for t in range(1, conv.num_turns):
        nxt = conv.next_prompt(t, prompt, outputs[t - 1])
        assert nxt[: len(prompt)] == prompt
        assert nxt[len(prompt): len(prompt) + len(outputs[t - 1])] == outputs[t - 1]
        assert len(nxt) == conv.prompt_len(t)
        assert nxt == conv.prompt(t, outputs)
        prompt = nxt
    with pytest.raises(IndexError):
        conv.next_prompt(0, prompt, [])


# --------------------------------------------------------------------------------------------------- simulations


def test_multi_turn_continuation_hits_end_of_request_snapshot():
    # r0: 40-token prompt, 12 outputs. Computed tokens 40 + 12 - 1 = 51: KV blocks [0, 48), snapshots at 32 (end of
    # prompt) and 48 (end of request). r1 = r0's prompt + output + 30 new = 82 tokens: KV matches 3 blocks, hit 48.
    p0, o0 = toks(0, 40), toks(100, 12)
    p1 = p0 + o0 + toks(200, 30)
    trace = sequential_trace([(p0, o0), (p1, [1])])
    assert ideal_hits(trace) == [0, 48]
    # Without the end-of-request snapshot only the end-of-prompt one (32) is there.
    assert simulate_hits(trace, SnapshotPolicy(end_of_request=False)) == [0, 32]
    # vLLM-style, 32-token blocks: checkpoint at floor(40/32)*32 = 32; at request end floor(51/32)*32 = 32 too.
    assert vllm_style_hits(trace, 32) == [0, 32]
    assert vllm_style_hits(trace, 32, checkpoint_at_finish=True) == [0, 32]
    # 64-token blocks: r0's prompt has no full block, so no checkpoint at all.
    assert vllm_style_hits(trace, 64) == [0, 0]


def test_branch_point_snapshot_serves_the_shared_prefix():
    # Shared 40-token prefix S; three requests S + own 30 tokens (70 tokens each).
    # r0 snapshots at 64 (its own path). r1 matches r0's KV for 2 blocks (32 tokens; block 3 mixes S's tail with its
    # own tokens), no snapshot there: hit 0, and it snapshots the branch point 32. r2 then hits 32.
    s = toks(0, 40)
    trace = sequential_trace([(s + toks(100, 30), [1, 2]), (s + toks(200, 30), [1, 2]), (s + toks(300, 30), [1, 2])])
    assert ideal_hits(trace) == [0, 0, 32]
    assert simulate_hits(trace, SnapshotPolicy(branch_points=False)) == [0, 0, 0]
    # vLLM-style checkpoints are at 64 on each request's own path: nothing is shared.
    assert vllm_style_hits(trace, 32) == [0, 0, 0]
    assert vllm_style_hits(trace, 16) == [0, 0, 0]


def test_last_prompt_token_is_always_computed():
    # r0 publishes a snapshot at 48 (end of its 50-token prompt). r1's prompt is r0's first 48 tokens: a hit must
    # be <= 47, and there is no snapshot at 32 or 16, so it gets 0 (and snapshots its branch point, 32). r2 = r1's
    # prompt again: hits 32.
    p0 = toks(0, 50)
    trace = sequential_trace([(p0, [1]), (p0[:48], [1]), (p0[:48], [1])])
    assert ideal_hits(trace) == [0, 0, 32]
    # A 49-token prompt may use the snapshot at 48.
    assert ideal_hits(sequential_trace([(p0, [1]), (p0[:49], [1])])) == [0, 48]


def test_visibility_follows_steps():
    p0, o0 = toks(0, 50), toks(100, 20)
    p1 = p0 + o0 + toks(200, 10)
    same = [
        # r0 and r1 (same prompt) submitted together: neither sees the other.
        TraceRequest(p0, o0, submit_order=0, finish_order=0, submit_step=0, prefill_step=1, finish_step=20),
        TraceRequest(list(p0), [7], submit_order=1, finish_order=1, submit_step=0, prefill_step=1, finish_step=1),
        # r2 is submitted after r0's prefill but before r0 finished: only the end-of-prompt snapshot (48) counts.
        TraceRequest(p1, [1], submit_order=2, finish_order=2, submit_step=5, prefill_step=6, finish_step=6),
        # r3 (same prompt as r2) is submitted after r0 finished: end of request = floor(69/16)*16 = 64.
        TraceRequest(list(p1), [1], submit_order=3, finish_order=3, submit_step=20, prefill_step=21, finish_step=21),
    ]
    # r2's own end-of-prompt snapshot is at 80, but r3's prompt is 80 tokens long, so its hit is at most 79: the
    # deepest usable snapshot is r0's end-of-request one at 64.
    assert ideal_hits(same) == [0, 0, 48, 64]


def test_interval_snapshots():
    p0 = toks(0, 100)
    trace = sequential_trace([(p0, [1]), (p0[:70] + toks(500, 20), [1])])
    # Interval 32: r0 snapshots at 32, 64 and 96 (end of prompt); r1 shares 70 tokens -> KV match 64, hit 64.
    assert simulate_hits(trace, SnapshotPolicy(interval=32)) == [0, 64]
    # Without it the match at 64 has no snapshot (r1 snapshots its branch point instead).
    assert ideal_hits(trace) == [0, 0]
    with pytest.raises(ValueError):
        SnapshotPolicy(interval=24)


def test_interval_snapshots_in_the_output():
    # r0: 20-token prompt, 60 outputs: computed 79 tokens; interval 32 -> snapshots at 32 and 64 from the decode.
    p0, o0 = toks(0, 20), toks(100, 60)
    trace = sequential_trace([(p0, o0), (p0 + o0[:40] + toks(300, 5), [1])])
    assert simulate_hits(trace, SnapshotPolicy(interval=32, end_of_request=False)) == [0, 32]
    assert simulate_hits(trace, SnapshotPolicy(end_of_request=False)) == [0, 16]


def test_invalid_trace_rejected():
    bad = TraceRequest([1, 2], [3], submit_order=0, finish_order=0, submit_step=1, prefill_step=1, finish_step=2)
    with pytest.raises(ValueError):
        ideal_hits([bad])


def test_vllm_style_block_size():
    # Qwen3.5-2B: conv_dim = 2*16*128 + 16*128 = 6144; state per GDN layer = 6144*3*2 (bf16 conv window)
    # + 16*128*128*4 (fp32 SSM) = 1,085,440 B; KV per token per layer = 2*2*256*2 = 2048 B -> 530 -> 544.
    assert QWEN35_2B_STATE_SHAPE.conv_dim == 6144
    assert QWEN35_2B_STATE_SHAPE.state_bytes_per_layer(2) == 1_085_440
    assert QWEN35_2B_STATE_SHAPE.kv_bytes_per_token_per_layer(2) == 2048
    assert vllm_style_block_size(QWEN35_2B_STATE_SHAPE, kv_bytes=2) == 544
    # The tiny test model in float32: conv_dim 2*2*16 + 4*16 = 128; state 128*3*4 + 4*16*16*4 = 5632 B;
    # KV 2*2*16*4 = 256 B/token -> 22 -> 32.
    tiny = StateShape(num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                      linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)
    assert vllm_style_block_size(tiny, kv_bytes=4) == 32


def test_report_helpers():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 90) == 5.0
    # 3 requests, prompts 100 tokens in all, outputs 4 each: scheduled = 100 + 3 * (4 - 1).
    m = {"hyserve:scheduled_tokens": 109.0, "hyserve:generation_tokens": 12.0, "hyserve:num_requests": 3.0}
    assert prefill_tokens_computed(m) == 100.0

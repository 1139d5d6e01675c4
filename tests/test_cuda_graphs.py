"""CUDA graphs for decode steps (``hyserve.engine.cuda_graphs``).

On the CPU the graphs are emulated: the same padded static forward (pad rows on the pad slot, full-width block
tables, ``max_seq_len = max_model_len``, logits for every padded row) runs eagerly in place of a replay, so these
tests check everything but capture and replay themselves against transformers; the CUDA test checks those.
"""

from __future__ import annotations

import pytest
import torch
from conftest import CheckpointCache
from test_engine import assert_matches_reference, drive, make_llm, random_prompts

from hyserve import SamplingParams
from hyserve.cli import build_parser
from hyserve.engine import cuda_graphs
from hyserve.engine.cuda_graphs import DEFAULT_CAPTURE_SIZES, capture_sizes


@pytest.fixture
def emulate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_graphs, "EMULATE", True)


class RunRecorder:
    """Wraps the graph runner: (real rows, padded size) of every graph step."""

    def __init__(self, runner: object) -> None:
        self.steps: list[tuple[int, int]] = []
        graphs = runner.graphs  # type: ignore[attr-defined]
        assert graphs is not None, "graphs were not set up"
        original_prepare = runner.prepare  # type: ignore[attr-defined]

        def prepare(rows, pad_to=None):  # type: ignore[no-untyped-def]
            if pad_to is not None:
                self.steps.append((len(rows), pad_to))
            return original_prepare(rows, pad_to=pad_to)

        runner.prepare = prepare  # type: ignore[attr-defined]

    @property
    def padded_steps(self) -> int:
        return sum(1 for r, s in self.steps if s > r)


def test_capture_sizes() -> None:
    assert capture_sizes(256, None) == list(DEFAULT_CAPTURE_SIZES)
    assert capture_sizes(5, None) == [1, 2, 4, 5]
    assert capture_sizes(1000, None)[-1] == 256
    assert capture_sizes(6, [8, 1, 3, 3]) == [1, 3]
    with pytest.raises(ValueError, match="cuda_graph_sizes must be positive"):
        capture_sizes(8, [0, 2])


@pytest.mark.parametrize("pattern", ["gdn3_attn1", "attn_first"])
def test_emulated_graphs_match_transformers_with_chunking_caching_aborts(
        ckpts: CheckpointCache, emulate: None, pattern: str) -> None:
    path = ckpts.get("causal", pattern)
    ref = ckpts.reference(path)
    # 5 sequences: sizes 1, 2, 4, 5; a 20-token budget chunks the prompts and mixes prefill with decode (eager).
    llm = make_llm(path, max_num_batched_tokens=20, max_num_seqs=5, num_state_slots=7)
    eng = llm.llm_engine
    assert eng.runner.graphs is not None and eng.runner.graphs.sizes == [1, 2, 4, 5]
    rec = RunRecorder(eng.runner)
    prompts = random_prompts(7, [9, 30, 3, 17, 25, 5, 12], seed=61)
    shared = prompts[1][:24]  # later requests resume a cached prefix (KV blocks and a recurrent snapshot)
    prompts[5] = shared + prompts[5]
    prompts[6] = shared + prompts[6]
    greedy = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, logprobs=1)
    arrivals = {0: [("r0", prompts[0], greedy), ("r1", prompts[1], greedy)], 2: [("r2", prompts[2], greedy)],
                5: [("r3", prompts[3], greedy), ("x", prompts[4], greedy)], 9: [("r4", prompts[4], greedy)],
                30: [("r5", prompts[5], greedy), ("r6", prompts[6], greedy)]}
    final = drive(eng, arrivals, aborts={12: ["x"]})
    assert "x" not in final
    for i in range(7):
        assert_matches_reference(ref, prompts[i], final[f"r{i}"])
    assert rec.padded_steps > 0, "no step ran with pad rows"
    assert {s for _, s in rec.steps} >= {1, 4}, f"graph sizes used: {rec.steps}"
    assert final["r5"].num_cached_tokens > 0 and final["r6"].num_cached_tokens > 0, "prefix cache not hit"
    eng.assert_no_leaks()


def test_emulated_graphs_equal_eager_under_preemption_and_sampling(ckpts: CheckpointCache,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = ckpts.get("causal", "attn_both_ends")
    prompts = random_prompts(6, [14, 20, 9, 17, 11, 19], seed=21)
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(temperature=1.0, seed=7 * i, max_tokens=20, ignore_eos=True) for i in range(6)]
    kw = dict(block_size=4, num_kv_blocks=15, num_state_slots=6, max_model_len=56, max_num_batched_tokens=16,
              max_num_seqs=6)
    eager = make_llm(path, **kw)
    assert eager.llm_engine.runner.graphs is None
    expected = eager.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    monkeypatch.setattr(cuda_graphs, "EMULATE", True)
    graphed = make_llm(path, **kw)
    rec = RunRecorder(graphed.llm_engine.runner)
    outs = graphed.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert graphed.get_metrics()["hyserve:num_preemptions"] > 0
    assert rec.padded_steps > 0
    for i, (e, o) in enumerate(zip(expected, outs, strict=True)):
        assert o.outputs[0].token_ids == e.outputs[0].token_ids, f"request {i} differs with graphs"
    graphed.llm_engine.assert_no_leaks()
    # enforce_eager turns the graphs off.
    assert make_llm(path, enforce_eager=True, **kw).llm_engine.runner.graphs is None


def test_pad_rows_touch_only_the_pad_slot(ckpts: CheckpointCache, emulate: None) -> None:
    path = ckpts.get("causal", "gdn3_attn1")
    llm = make_llm(path, max_num_seqs=4, num_state_slots=6, block_size=4, num_kv_blocks=64)
    eng = llm.llm_engine
    runner = eng.runner
    rec = RunRecorder(runner)
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    for i, p in enumerate(random_prompts(3, [6, 11, 8], seed=71)):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    eng.step()  # prefill (eager)
    eng.step()  # first decode step (graph, 3 rows padded to 4)
    pool = runner.state_pool
    slots = sorted(r.state_slot for r in eng.scheduler.running)
    assert len(slots) == 3 and pool.pad_slot not in slots
    blocks = {b for r in eng.scheduler.running for b in r.block_table}
    convs = [c.clone() for c in pool.conv_states]
    ssms = [s.clone() for s in pool.ssm_states]
    kvs = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    rec.steps.clear()
    eng.step()
    assert rec.steps == [(3, 4)]
    for before, after in zip(ssms + convs, pool.ssm_states + pool.conv_states, strict=True):
        # Request slots and the pad slot (snapshot entries after it are filled by copies, not by the forward).
        changed = {i for i in range(pool.pad_slot + 1) if not torch.equal(before[i], after[i])}
        assert changed == set(slots) | {pool.pad_slot}, f"slots changed: {changed}, step slots {slots}"
    for (k0, v0), (k1, v1) in zip(kvs, runner.kv_caches, strict=True):
        changed = {b for b in range(k0.shape[0]) if not (torch.equal(k0[b], k1[b]) and torch.equal(v0[b], v1[b]))}
        assert changed and changed <= blocks, f"KV blocks changed outside the step's requests: {changed - blocks}"
        assert 0 not in changed, "the null block was written"
    eng.abort_request(["r0", "r1", "r2"])
    eng.assert_no_leaks()


def test_speculative_decoding_runs_without_graphs(ckpts: CheckpointCache, emulate: None) -> None:
    llm = make_llm(ckpts.get(), speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                   "prompt_lookup_max": 3})
    assert llm.llm_engine.runner.graphs is None


def test_cli_graph_flags() -> None:
    args = build_parser().parse_args(["generate", "m", "--enforce-eager", "--cuda-graph-sizes", "1,2,8"])
    assert args.enforce_eager is True and args.cuda_graph_sizes == [1, 2, 8]
    args = build_parser().parse_args(["serve"])
    assert args.enforce_eager is False and args.cuda_graph_sizes is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_match_eager_on_gpu(ckpts: CheckpointCache) -> None:
    path = ckpts.get("causal", "gdn3_attn1")
    ref = ckpts.reference(path)
    prompts = random_prompts(7, [9, 30, 3, 17, 25, 5, 12], seed=81)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    kw = dict(device="cuda", max_num_batched_tokens=20, max_num_seqs=6, num_state_slots=6, num_kv_blocks=128)
    eager = make_llm(path, enforce_eager=True, **kw)
    graphed = make_llm(path, **kw)
    assert graphed.llm_engine.runner.graphs is not None and graphed.llm_engine.runner.graphs.graphs
    arrivals = {3 * i: [(f"r{i}", p, params)] for i, p in enumerate(prompts)}
    want = drive(eager.llm_engine, arrivals)
    got = drive(graphed.llm_engine, arrivals)
    assert graphed.llm_engine.runner.graphs.num_replays > 0
    for i, p in enumerate(prompts):
        assert got[f"r{i}"].outputs[0].token_ids == want[f"r{i}"].outputs[0].token_ids
        assert_matches_reference(ref, p, got[f"r{i}"])
    graphed.llm_engine.assert_no_leaks()

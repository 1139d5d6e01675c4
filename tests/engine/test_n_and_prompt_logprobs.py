"""Prompt logprobs against transformers (whole, chunked, beside a cached prefix, with MTP) and ``n`` > 1: n child
requests with their own seeds, aggregated into the parent's outputs; aborting the parent; preemption and staggered
arrivals without leaks."""

from __future__ import annotations

import pytest
import torch

from hyserve import SamplingParams
from hyserve.engine.parallel_sampling import child_params
from hyserve.outputs import RequestOutput
from hyserve.sampling_params import RequestOutputKind
from hyserve.testing import reference_logits
from hyserve.testing.engine import LOGPROB_TOL, drive, make_llm, toks
from hyserve.testing.families import CheckpointCache

PROMPT = toks(40, seed=3)


def check_prompt_logprobs(ref: object, prompt: list[int], out: RequestOutput, top_n: int) -> None:
    """Entry p (p >= 1) holds prompt token p's logprob given tokens < p and the top-N, as transformers' logits say."""
    got = out.prompt_logprobs
    assert got is not None and len(got) == len(prompt) and got[0] is None
    logp = torch.log_softmax(reference_logits(ref, prompt).double(), dim=-1)  # type: ignore[arg-type]
    for p in range(1, len(prompt)):
        entry = got[p]
        assert entry is not None and prompt[p] in entry, p
        want = float(logp[p - 1, prompt[p]])
        assert abs(entry[prompt[p]].logprob - want) <= LOGPROB_TOL, (p, entry[prompt[p]].logprob, want)
        assert entry[prompt[p]].rank == 1 + int((logp[p - 1] > logp[p - 1, prompt[p]] + 1e-6).sum()) or \
            abs(float(logp[p - 1].sort(descending=True).values[entry[prompt[p]].rank - 1]) - want) <= LOGPROB_TOL
        top = torch.topk(logp[p - 1], top_n)
        for tid, lp in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            if tid in entry:
                assert abs(entry[tid].logprob - lp) <= LOGPROB_TOL
        assert len(entry) >= top_n


@pytest.mark.parametrize("chunk", [2048, 16], ids=["whole", "chunked"])
def test_prompt_logprobs_match_transformers(ckpts: CheckpointCache, chunk: int) -> None:
    path = ckpts.get()
    ref = ckpts.reference(path)
    llm = make_llm(path, max_num_batched_tokens=chunk)
    # Another request computes the prompt's prefix first: the prefix cache holds it, and the asking request must
    # compute it again (a cached prefix has no logits).
    llm.generate({"prompt_token_ids": PROMPT[:32]}, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2),
                       use_tqdm=False)[0]
    check_prompt_logprobs(ref, PROMPT, out, 2)
    assert out.num_cached_tokens == 0
    llm.llm_engine.assert_no_leaks()


def test_prompt_logprobs_with_mtp_and_delta(ckpts: CheckpointCache) -> None:
    """Prefill rows beside verify rows (the speculative forward), and DELTA outputs carrying them once."""
    path = ckpts.get(with_mtp=True)
    ref = ckpts.reference(path)
    llm = make_llm(path, speculative_config={"method": "mtp", "num_speculative_tokens": 2},
                   max_num_batched_tokens=24)
    eng = llm.llm_engine
    eng.add_request("other", {"prompt_token_ids": toks(10, seed=9)},
                    SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    eng.step()
    eng.add_request("a", {"prompt_token_ids": PROMPT}, SamplingParams(
        temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=0, output_kind=RequestOutputKind.DELTA))
    carried = []
    while eng.has_unfinished_requests():
        carried += [o for o in eng.step() if o.request_id == "a" and o.prompt_logprobs is not None]
    assert len(carried) == 1
    check_prompt_logprobs(ref, PROMPT, carried[0], 0)
    eng.assert_no_leaks()


def test_n_children_seeds_and_greedy(ckpts: CheckpointCache) -> None:
    llm = make_llm(ckpts.get())
    hot = SamplingParams(n=3, temperature=2.0, seed=11, max_tokens=8, ignore_eos=True, logprobs=0)
    a, = llm.generate({"prompt_token_ids": PROMPT}, hot, use_tqdm=False)
    b, = llm.generate({"prompt_token_ids": PROMPT}, hot, use_tqdm=False)
    assert [c.index for c in a.outputs] == [0, 1, 2] and a.finished
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs], "seeded n > 1 is not reproducible"
    assert len({tuple(c.token_ids) for c in a.outputs}) == 3, "children drew alike (one seed shared?)"
    # Child i draws as a single request with seed + i.
    for i in range(3):
        one, = llm.generate({"prompt_token_ids": PROMPT}, child_params(hot, i), use_tqdm=False)
        assert one.outputs[0].token_ids == a.outputs[i].token_ids
    greedy, = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(n=4, temperature=0.0, max_tokens=6),
                           use_tqdm=False)
    assert len(greedy.outputs) == 4 and len({tuple(c.token_ids) for c in greedy.outputs}) == 1
    # The children share the prompt through the prefix cache.
    assert llm.get_metrics()["hyserve:prefix_cache_hits"] > 0
    llm.llm_engine.assert_no_leaks()


def test_n_abort_staggered_and_preemption(ckpts: CheckpointCache) -> None:
    # Few KV blocks: the children and the other requests preempt each other.
    llm = make_llm(ckpts.get(), num_kv_blocks=12, max_num_batched_tokens=32)
    eng = llm.llm_engine
    p = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=40, ignore_eos=True)
    one = SamplingParams(temperature=1.0, seed=5, max_tokens=40, ignore_eos=True)
    final = drive(eng, {0: [("p", PROMPT, p)], 2: [("q", toks(30, seed=4), one), ("gone", PROMPT, p)]},
                  aborts={5: ["gone"]})
    assert eng.metrics.num_preemptions > 0, "no preemption happened"
    assert "gone" not in final and not eng.parents.parents
    assert sorted(final) == ["p", "q"]
    out = final["p"]
    assert [c.index for c in out.outputs] == [0, 1, 2] and all(len(c.token_ids) == 40 for c in out.outputs)
    eng.assert_no_leaks()
    # Alone and unpreempted, the children draw the same tokens.
    alone, = make_llm(ckpts.get()).generate({"prompt_token_ids": PROMPT}, p, use_tqdm=False)
    assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in out.outputs]


def test_n_delta_outputs_add_up(ckpts: CheckpointCache) -> None:
    eng = make_llm(ckpts.get()).llm_engine
    p = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=5, ignore_eos=True,
                       output_kind=RequestOutputKind.DELTA)
    eng.add_request("d", {"prompt_token_ids": PROMPT}, p)
    got: dict[int, list[int]] = {0: [], 1: []}
    finished = False
    while eng.has_unfinished_requests():
        for o in eng.step():
            assert o.request_id == "d"
            for c in o.outputs:
                got[c.index] += c.token_ids
            finished = o.finished
    assert finished and all(len(v) == 5 for v in got.values())

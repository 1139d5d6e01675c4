"""Penalties, logit_bias, allowed_token_ids, bad words and min_tokens, end to end on the CPU.

Outputs are checked against transformers' logits with the same adjustments written here independently (plain
Python over the reference's teacher-forced logits: counts from the token history, bias, masks, vLLM's order), and
the same requests run with MTP and n-gram speculation, prefix caching, staggered arrivals, preemption, async
scheduling, CUDA graphs (emulated; real ones on a GPU), tensor and pipeline parallelism must give exactly the plain
engine's tokens. Sabotaged variants of the
implementation (frequency counting prompt tokens, verify positions not seeing the drafts before them, the bias after
the penalties) fail these checks.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import pytest
import torch

from hyserve import SamplingParams
from hyserve.engine.llm_engine import LLMEngine
from hyserve.layers import logits_processors
from hyserve.request import Request
from hyserve.speculative.proposer import Proposer
from hyserve.testing.engine import GREEDY_TOL, LOGPROB_TOL, SlotRecorder, drive, make_llm, toks
from hyserve.testing.families import CheckpointCache
from hyserve.testing.qwen3_5 import reference_logits
from hyserve.testing.sampling import reference_adjust
from hyserve.worker import cuda_graphs, sampling_state
from hyserve.worker.sampling_state import SamplingState

N_OUT = 14


def check_reference(ref: object, prompt: list[int], tokens: list[int], p: SamplingParams, eos: set[int],
                    logprobs: list | None = None) -> None:
    """Teacher-forced: every token is the argmax of the adjusted reference logits; logprobs are the raw ones."""
    logits = reference_logits(ref, prompt + tokens)  # type: ignore[arg-type]
    raw_logp = torch.log_softmax(logits.double(), dim=-1)
    for i, tok in enumerate(tokens):
        row = logits[len(prompt) - 1 + i]
        x = reference_adjust(row, prompt, tokens[:i], p, eos)
        gap = float(x.max() - x[tok])
        assert gap <= GREEDY_TOL, f"token {i}: chose {tok}, adjusted reference argmax {int(x.argmax())} (gap {gap})"
        if logprobs is not None:
            got, want = logprobs[i][tok].logprob, float(raw_logp[len(prompt) - 1 + i, tok])
            assert abs(got - want) <= LOGPROB_TOL, f"token {i}: logprob {got} vs raw reference {want}"


def greedy(**kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=N_OUT, ignore_eos=True, logprobs=1, **kw)  # type: ignore[arg-type]


def prompts() -> dict[str, list[int]]:
    base = toks(9, 3)
    return {f"r{i}": (base * 4)[: 18 + 5 * i] + toks(2, 40 + i) for i in range(7)}


def request_mix(plain_out: dict[str, list[int]]) -> dict[str, SamplingParams]:
    """One request per field (and combinations), built from the unadjusted outputs so that each one bites."""
    o = plain_out
    return {
        "r0": greedy(repetition_penalty=0.4),
        "r1": greedy(frequency_penalty=1.5, presence_penalty=0.5),
        "r2": greedy(presence_penalty=-2.0, frequency_penalty=-0.5, repetition_penalty=1.3),
        "r3": greedy(logit_bias={o["r3"][1]: -100.0, o["r3"][0]: 3.0, 7: 8.0}, repetition_penalty=0.7),
        "r4": greedy(allowed_token_ids=sorted(set(o["r4"][:4]) | set(range(30, 60))), frequency_penalty=1.0),
        "r5": greedy(bad_words_token_ids=[[o["r5"][0], o["r5"][1]], [o["r5"][4]], [o["r5"][2], o["r5"][3], 9]],
                     frequency_penalty=0.3),
        "r6": SamplingParams(temperature=0.0, max_tokens=N_OUT, logprobs=1, min_tokens=10,
                             stop_token_ids=[o["r6"][2], o["r6"][5]], presence_penalty=0.4),
    }


_PLAIN: dict[str, dict[str, list[int]]] = {}


def unadjusted(path: str) -> dict[str, list[int]]:
    if path not in _PLAIN:
        llm = make_llm(path, enable_prefix_caching=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts().values()], greedy())
        _PLAIN[path] = {rid: o.outputs[0].token_ids for rid, o in zip(prompts(), outs, strict=True)}
    return _PLAIN[path]


def run(engine: LLMEngine, mix: dict[str, SamplingParams], stagger: int = 2) -> dict[str, list[int]]:
    arrivals: dict[int, list] = {}
    for i, (rid, p) in enumerate((rid, p) for rid, p in prompts().items() if rid in mix):
        arrivals.setdefault(stagger * (i // 2), []).append((rid, p, mix[rid]))
    final = drive(engine, arrivals)
    return {rid: final[rid].outputs[0].token_ids for rid in mix}


_ADJUSTED: dict[str, dict[str, list[int]]] = {}


def plain_adjusted(path: str) -> dict[str, list[int]]:
    if path not in _ADJUSTED:
        _ADJUSTED[path] = run(make_llm(path, enable_prefix_caching=False).llm_engine, request_mix(unadjusted(path)))
    return _ADJUSTED[path]


def test_every_field_matches_the_adjusted_reference(ckpts: CheckpointCache) -> None:
    path = ckpts.get()
    ref = ckpts.reference(path)
    base = unadjusted(path)
    mix = request_mix(base)
    llm = make_llm(path, enable_prefix_caching=True, max_num_batched_tokens=40, max_num_seqs=4)
    rec = SlotRecorder(llm.llm_engine)
    arrivals = {2 * i: [(rid, p, mix[rid])] for i, (rid, p) in enumerate(prompts().items())}
    final = drive(llm.llm_engine, arrivals)
    assert rec.saw_non_identity()
    eos = llm.llm_engine.output_processor.eos_token_ids
    changed = []
    for rid, prompt in prompts().items():
        out = final[rid].outputs[0]
        check_reference(ref, prompt, out.token_ids, mix[rid], eos, out.logprobs)
        changed.append(out.token_ids != base[rid][: len(out.token_ids)])
    assert sum(changed) >= 6, changed  # every field but the negative presence (r2) bites on these prompts
    r6 = final["r6"].outputs[0].token_ids
    assert (len(r6) >= 10 and r6[-1] in mix["r6"].stop_token_ids) or len(r6) == N_OUT
    assert llm.get_metrics()["hyserve:prefix_cache_hits"] > 0
    llm.llm_engine.assert_no_leaks()


def test_bad_words_as_text_follow_the_reference(ckpts: CheckpointCache) -> None:
    """``bad_words`` strings go through the tokenizer (as written and after a space) and then mask as their ids."""
    path = ckpts.get()
    llm = make_llm(path, enable_prefix_caching=False)
    engine = llm.llm_engine
    tok = llm.get_tokenizer()
    prompt = prompts()["r2"]
    base = unadjusted(path)["r2"]
    words = [tok.decode(base[1:3]), tok.decode(base[4:5]).strip() or "x"]
    p = greedy(bad_words=words)
    resolved = engine.with_bad_words_token_ids(p)
    assert resolved.bad_words_token_ids and len(resolved.bad_words_token_ids) >= len(words)
    out = llm.generate([{"prompt_token_ids": prompt}], p)[0].outputs[0]
    check_reference(ckpts.reference(path), prompt, out.token_ids, resolved, set(), out.logprobs)
    assert out.token_ids != base
    for word in resolved.bad_words_token_ids:
        assert all(out.token_ids[i : i + len(word)] != word for i in range(len(out.token_ids)))


def test_frequency_counting_the_prompt_is_caught(ckpts: CheckpointCache, monkeypatch: pytest.MonkeyPatch) -> None:
    path = ckpts.get()
    real = logits_processors.apply_penalties

    def counts_prompt(x, prompt_mask, output_counts, presence, frequency, repetition):  # type: ignore[no-untyped-def]
        real(x, prompt_mask, output_counts + prompt_mask, presence, frequency, repetition)

    monkeypatch.setattr(sampling_state, "apply_penalties", counts_prompt)
    mix = {"r1": request_mix(unadjusted(path))["r1"]}
    llm = make_llm(path, enable_prefix_caching=False)
    got = run(llm.llm_engine, mix)
    with pytest.raises(AssertionError, match="adjusted reference"):
        check_reference(ckpts.reference(path), prompts()["r1"], got["r1"], mix["r1"], set())


def test_bias_after_penalties_is_caught(ckpts: CheckpointCache, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bias must come before the repetition penalty (a biased logit's sign decides its scaling)."""
    path = ckpts.get()
    ref = ckpts.reference(path)
    prompt = prompts()["r0"]
    logits = reference_logits(ref, prompt)[-1]  # type: ignore[arg-type]
    # A prompt token with a negative logit, biased so that (logit + bias) / 0.5 beats every other token by 1;
    # scaled before the bias (logit * 0.5 + bias) it would lose by far.
    tok = min(set(prompt), key=lambda t: float(logits[t]))
    assert logits[tok] < -1.0, "test design"
    others = reference_adjust(logits, prompt, [], greedy(repetition_penalty=0.5), set())
    others[tok] = -math.inf
    bias = (float(others.max()) + 1.0) * 0.5 - float(logits[tok])
    p = dataclasses.replace(greedy(logit_bias={tok: bias}, repetition_penalty=0.5), max_tokens=1)
    want = int(reference_adjust(logits, prompt, [], p, set()).argmax())
    assert want == tok, "test design: the biased token must win when the bias comes first"
    llm = make_llm(path, enable_prefix_caching=False)
    assert llm.generate([{"prompt_token_ids": prompt}], p)[0].outputs[0].token_ids == [want]

    real = SamplingState._allowed_and_bias

    def bias_last(self, x, params):  # type: ignore[no-untyped-def]
        self.pending_bias = params

    def history_then_bias(self, x, req, positions, upper):  # type: ignore[no-untyped-def]
        original_history(self, x, req, positions, upper)
        real(self, x, self.pending_bias)

    original_history = SamplingState._history_adjust
    monkeypatch.setattr(SamplingState, "_allowed_and_bias", bias_last)
    monkeypatch.setattr(SamplingState, "_history_adjust", history_then_bias)
    llm = make_llm(path, enable_prefix_caching=False)
    assert llm.generate([{"prompt_token_ids": prompt}], p)[0].outputs[0].token_ids != [want]


def spec_kwargs(method: str) -> dict[str, object]:
    if method == "mtp":
        return {"speculative_config": {"method": "mtp", "num_speculative_tokens": 2}}
    return {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                   "prompt_lookup_max": 3}}


@pytest.mark.parametrize("mode", ["eager", "async_graphs"])
@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_speculation_gives_the_plain_tokens(plant_drafts: Callable, ckpts: CheckpointCache,
                                            monkeypatch: pytest.MonkeyPatch, method: str, mode: str) -> None:
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    want = plain_adjusted(path)
    monkeypatch.setattr(cuda_graphs, "EMULATE", mode == "async_graphs")
    llm = make_llm(path, enable_prefix_caching=True, max_num_batched_tokens=40, max_num_seqs=4,
                   async_scheduling=mode == "async_graphs", **spec_kwargs(method))
    rec = SlotRecorder(llm.llm_engine)
    if method == "mtp":
        plant_drafts(llm.llm_engine, want)
    mix = request_mix(unadjusted(path))
    if mode == "async_graphs":  # without logprobs: verify rows go behind rows in flight, whole steps on the device
        mix = {rid: dataclasses.replace(p, logprobs=None) for rid, p in mix.items()}
    got = run(llm.llm_engine, mix)
    assert got == want
    assert rec.saw_non_identity()
    m = llm.get_metrics()
    assert m["hyserve:spec_decode_num_accepted_tokens"] > 0
    if method == "mtp" and mode == "async_graphs":
        assert llm.llm_engine.scheduler.num_rows_behind > 0
    llm.llm_engine.assert_no_leaks()


def test_speculation_with_preemption_gives_the_plain_tokens(plant_drafts: Callable, ckpts: CheckpointCache) -> None:
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    want = plain_adjusted(path)
    llm = make_llm(path, block_size=16, num_kv_blocks=9, max_model_len=128, max_num_batched_tokens=32,
                   max_num_seqs=4, enable_prefix_caching=True, **spec_kwargs("mtp"))
    plant_drafts(llm.llm_engine, want)
    got = run(llm.llm_engine, request_mix(unadjusted(path)), stagger=0)
    assert llm.get_metrics()["hyserve:num_preemptions"] > 0
    assert got == want
    llm.llm_engine.assert_no_leaks()


def drafts_unseen(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage: verify rows write only their first token into the history, not their drafts."""
    real = SamplingState.record_inputs

    def first_tokens_only(self, rows, input_ids, query_start_loc, verify_starts):  # type: ignore[no-untyped-def]
        rows = [dataclasses.replace(r, token_ids=r.token_ids[:1]) if r.is_verify else r for r in rows]
        real(self, rows, input_ids, query_start_loc, verify_starts)

    monkeypatch.setattr(SamplingState, "record_inputs", first_tokens_only)


@pytest.mark.parametrize("layout", [pytest.param("tp2", marks=pytest.mark.slow), "pp2_ngram"])  # tp2: the budget
def test_parallel_ranks_give_the_plain_tokens(ckpts: CheckpointCache, layout: str) -> None:
    """Every tensor-parallel rank adjusts alike; on a pipeline only the last stage does (worker processes, gloo)."""
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    want = plain_adjusted(path)
    kw: dict[str, object] = {"tensor_parallel_size": 2} if layout == "tp2" else \
        {"pipeline_parallel_size": 2, **spec_kwargs("ngram")}
    llm = make_llm(path, enable_prefix_caching=True, max_num_batched_tokens=40, max_num_seqs=4, **kw)
    try:
        assert run(llm.llm_engine, request_mix(unadjusted(path))) == want
    finally:
        llm.shutdown()


def test_verify_positions_not_seeing_their_drafts_is_caught(plant_drafts: Callable, ckpts: CheckpointCache,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    want = plain_adjusted(path)
    drafts_unseen(monkeypatch)
    llm = make_llm(path, enable_prefix_caching=False, **spec_kwargs("mtp"))
    plant_drafts(llm.llm_engine, want)
    assert run(llm.llm_engine, request_mix(unadjusted(path))) != want


class RepeatProposer(Proposer):
    """Drafts the request's last tokens again (the output's last token twice first): tokens the penalties count."""

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        return [[r.output_token_ids[-1], *r.output_token_ids[::-1]][:k] if r.output_token_ids else []
                for r, k in zip(requests, num_tokens, strict=True)]


@pytest.mark.parametrize("sabotage", [False, True], ids=["sound", "drafts_unseen"])
def test_sampled_rows_judge_drafts_by_the_penalties_of_the_tokens_before_them(
        ckpts: CheckpointCache, monkeypatch: pytest.MonkeyPatch, sabotage: bool) -> None:
    """Seeded sampled rows with drafts: the target logits the rejection sampler judges each verify position by are
    the engine's raw logits adjusted for the known tokens and the drafts before that position (the rejection
    sampler's own tests show it then samples that distribution). Not writing the drafts into the history fails."""
    if sabotage:
        drafts_unseen(monkeypatch)
    path = ckpts.get()
    llm = make_llm(path, enable_prefix_caching=True, **spec_kwargs("ngram"))
    engine = llm.llm_engine
    runner = engine.runner
    adjust = runner._adjust_logits
    seen: list[tuple[str, list[int], list[int], torch.Tensor, torch.Tensor]] = []

    def capture(rows, verify, plain, logits, n_verify):  # type: ignore[no-untyped-def]
        adjusted_v, adjusted = adjust(rows, verify, plain, logits, n_verify)
        at = 0
        for i in verify:
            r, n = rows[i], rows[i].num_new_tokens
            req = engine.requests[r.req_id]
            known = req.prompt_token_ids + req.output_token_ids
            assert r.start == len(known) - 1
            if adjusted_v is not None and req.sampling_params.adjusts_logits and n > 1:
                seen.append((r.req_id, known, list(r.token_ids[1:]), logits[at : at + n].clone(),
                             adjusted_v[at : at + n].clone()))
            at += n
        return adjusted_v, adjusted

    monkeypatch.setattr(runner, "_adjust_logits", capture)
    engine.proposer = RepeatProposer()
    mix = {rid: SamplingParams(temperature=0.8, seed=i, max_tokens=N_OUT, ignore_eos=True, frequency_penalty=1.2,
                               presence_penalty=-0.5, repetition_penalty=1.3, logit_bias={5: 2.0})
           for i, rid in enumerate(prompts())}
    run(engine, mix)
    assert len(seen) >= 20, "test design: verify rows of sampled requests"
    bad = 0
    for rid, known, drafts, raw, adjusted in seen:
        prompt = prompts()[rid]
        for j in range(len(drafts) + 1):
            want = reference_adjust(raw[j], prompt, known[len(prompt):] + drafts[:j], mix[rid], set())
            bad += not torch.allclose(adjusted[j].double(), want, rtol=1e-5, atol=1e-4)
    assert (bad > 0) == sabotage, bad


def test_sampling_params_validation() -> None:
    for kw, field in [({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
                      ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"allowed_token_ids": []},
                                                                              "allowed_token_ids"),
                      ({"allowed_token_ids": [-1]}, "allowed_token_ids"), ({"logit_bias": {"x": 1}}, "logit_bias"),
                      ({"logit_bias": {1: math.nan}}, "logit_bias"), ({"bad_words": [""]}, "bad_words")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)  # type: ignore[arg-type]
    p = SamplingParams(logit_bias={"5": 300, 6: -250.5, 7: 1.5})
    assert p.logit_bias == {5: 100.0, 6: -100.0, 7: 1.5}
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert not SamplingParams().adjusts_logits and SamplingParams(logit_bias={1: 1}).adjusts_logits
    assert SamplingParams(repetition_penalty=1.1).needs_history


def test_out_of_vocab_ids_are_refused(ckpts: CheckpointCache) -> None:
    llm = make_llm(ckpts.get())
    vocab = llm.llm_engine.model_config.vocab_size
    for kw, field in [({"logit_bias": {vocab: 1.0}}, "logit_bias"), ({"allowed_token_ids": [1, vocab]},
                                                                      "allowed_token_ids"),
                      ({"bad_words_token_ids": [[vocab + 3]]}, "bad_words")]:
        with pytest.raises(ValueError, match=field):
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(**kw))  # type: ignore[arg-type]


def test_bad_words_are_tokenized_with_and_without_a_leading_space() -> None:
    vocab = {"hello": [10], " hello": [11], "big cat": [20, 21], " big cat": [22, 21], "ab": [30, 31],
             " ab": [32, 33, 34]}
    p = SamplingParams(bad_words=["hello", " big cat", "ab"]).with_bad_words_token_ids(lambda s: vocab[s])
    # " ab" is another number of tokens than "ab": vLLM keeps only the plain form.
    assert p.bad_words_token_ids == [[10], [11], [20, 21], [22, 21], [30, 31]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_mtp_with_graphs_and_async_scheduling(plant_drafts: Callable, ckpts: CheckpointCache) -> None:
    """On CUDA: MTP under async scheduling with captured graphs (rows behind rows in flight, whole verify steps on
    the device, pinned copies) gives the eager engine's tokens, and both are the adjusted reference's."""
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    ref = ckpts.reference(path)
    mix = {rid: dataclasses.replace(p, logprobs=None) for rid, p in request_mix(unadjusted(path)).items()}
    kw: dict[str, object] = dict(device="cuda", max_num_batched_tokens=40, max_num_seqs=4, num_state_slots=6,
                                 num_kv_blocks=128, enable_prefix_caching=True, **spec_kwargs("mtp"))
    eager = make_llm(path, enforce_eager=True, **kw)
    want = run(eager.llm_engine, mix)
    graphed = make_llm(path, async_scheduling=True, **kw)
    plant_drafts(graphed.llm_engine, want)
    got = run(graphed.llm_engine, mix)
    assert got == want
    assert graphed.llm_engine.scheduler.num_rows_behind > 0
    assert graphed.get_metrics()["hyserve:spec_decode_num_accepted_tokens"] > 0
    eos = graphed.llm_engine.output_processor.eos_token_ids
    for rid, prompt in prompts().items():
        check_reference(ref, prompt, got[rid], mix[rid], eos)
    graphed.llm_engine.assert_no_leaks()

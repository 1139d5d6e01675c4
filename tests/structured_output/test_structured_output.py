"""Structured output end to end, against an independent reference.

The reference knows each test language by hand (a choice of words, and ``[0-9]{3}-[a-z]{2,4}``): a token is allowed
after the text so far iff the text with the token's string appended is still a prefix of a word of the language, and
EOS iff the text is a whole word. At every output position, teacher-forced, hyserve's greedy token must be the argmax
of transformers' logits over that allowed set, and the finished text a word of the language. The same requests run
with MTP and n-gram speculation, prefix caching, async scheduling and emulated CUDA graphs, staggered and with an
abort, and give the same tokens; sabotaged variants (masks not advanced through a verify row's drafts, the verify
ignoring the masks) are caught.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

from hyserve import SamplingParams
from hyserve.engine.llm_engine import LLMEngine
from hyserve.outputs import RequestOutput
from hyserve.structured_output.params import StructuredOutputsParams
from hyserve.testing.engine import GREEDY_TOL, drive, make_llm, random_prompts
from hyserve.testing.families import CheckpointCache
from hyserve.testing.qwen3_5 import reference_logits
from hyserve.testing.speculative import OracleProposer
from hyserve.worker import cuda_graphs

CHOICES = ["yes", "no", "maybe", "yellow"]
REGEX = "[0-9]{3}-[a-z]{2,4}"


def choice_viable(text: str) -> tuple[bool, bool]:
    """(text is a prefix of a choice, text is a choice)."""
    return any(c.startswith(text) for c in CHOICES), text in CHOICES


def regex_viable(text: str) -> tuple[bool, bool]:
    prefix = re.fullmatch(r"[0-9]{0,3}", text) is not None or re.fullmatch(r"[0-9]{3}-[a-z]{0,4}", text) is not None
    return prefix, re.fullmatch(REGEX, text) is not None


LANGUAGES: dict[str, tuple[StructuredOutputsParams, Callable[[str], tuple[bool, bool]]]] = {
    "choice": (StructuredOutputsParams(choice=CHOICES), choice_viable),
    "regex": (StructuredOutputsParams(regex=REGEX), regex_viable),
}


def token_strings(engine: LLMEngine) -> list[str | None]:
    """Each id's text as the tokenizer decodes it alone (None for special tokens)."""
    tok = engine.tokenizer
    assert tok is not None
    hf = tok.hf_tokenizer
    special = set(hf.all_special_ids) | {t for t in range(engine.model_config.vocab_size)
                                         if tok.decode([t], skip_special_tokens=True) == ""}
    return [None if t in special else tok.decode([t], skip_special_tokens=False)
            for t in range(engine.model_config.vocab_size)]


def check_against_reference(engine: LLMEngine, ref: Any, prompt: list[int], out: RequestOutput,
                            viable: Callable[[str], tuple[bool, bool]]) -> None:
    strings = token_strings(engine)
    eos = engine.eos_token_ids
    toks = out.outputs[0].token_ids
    logits = reference_logits(ref, prompt + toks)
    text = ""
    for i, tok in enumerate(toks):
        allowed = [t for t, s in enumerate(strings) if s is not None and viable(text + s)[0]]
        if viable(text)[1]:
            allowed += sorted(eos)
        assert allowed, f"position {i}: the reference allows nothing after {text!r}"
        row = logits[len(prompt) - 1 + i]
        best = max(allowed, key=lambda t: float(row[t]))
        assert tok in allowed, f"position {i}: token {tok} ({strings[tok]!r}) is outside the language after {text!r}"
        gap = float(row[best] - row[tok])
        assert gap <= GREEDY_TOL, f"position {i}: chose {tok}, reference {best} (gap {gap}) after {text!r}"
        if tok in eos:
            break
        text += strings[tok] or ""
    if out.outputs[0].finish_reason == "stop":
        assert viable(text)[1], f"finished on {text!r}, not a word of the language"


@pytest.fixture(params=["eager", "graphs"])
def graph_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(cuda_graphs, "EMULATE", request.param == "graphs")
    return str(request.param)


def workload(seed: int) -> tuple[dict[int, list], dict[int, list[str]], dict[str, tuple[list[int], str]]]:
    """Staggered arrivals sharing a prefix (prefix-cache hits), both languages, one request aborted."""
    shared = random_prompts(1, [20], seed=seed)[0]
    tails = random_prompts(5, [3, 9, 5, 14, 2], seed=seed + 1)
    reqs = {f"r{i}": (shared + tail, "choice" if i % 2 else "regex") for i, tail in enumerate(tails)}
    arrivals: dict[int, list] = {}
    for i, (rid, (prompt, lang)) in enumerate(reqs.items()):
        params = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=LANGUAGES[lang][0])
        arrivals.setdefault(2 * i, []).append((rid, prompt, params))
    return arrivals, {5: ["r2"]}, reqs


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
# "oracle": the n-gram engine with a proposer that knows the plain run's outputs and plants errors so that verify
# rows accept every length 0..3: the positions after accepted drafts are where a mask must follow the drafts.
SPECS: dict[str, dict[str, Any] | None] = {
    "plain": None,
    "mtp": {"method": "mtp", "num_speculative_tokens": 2},
    "ngram": NGRAM,
    "oracle": NGRAM,
}


def run(ckpts: CheckpointCache, spec: str, async_scheduling: bool, sabotage: Callable[[LLMEngine], None] | None = None,
        **kw: Any) -> tuple[dict[str, RequestOutput], LLMEngine]:
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    llm = make_llm(path, speculative_config=SPECS[spec], async_scheduling=async_scheduling,
                   enable_prefix_caching=True, block_size=16, max_num_batched_tokens=24, max_num_seqs=4, **kw)
    engine = llm.llm_engine
    if spec == "oracle":
        want, _ = run(ckpts, "plain", False, **kw)
        conts = {rid: o.outputs[0].token_ids for rid, o in want.items()}
        conts["r2"] = []  # aborted: its drafts are never right
        engine.proposer = OracleProposer(conts, {rid: [3, 0, 2, 1] for rid in conts}, vocab=440)
    if sabotage is not None:
        sabotage(engine)
    arrivals, aborts, _ = workload(7)
    final = drive(engine, arrivals, aborts)
    engine.assert_no_leaks()
    return final, engine


def test_constrained_greedy_matches_the_reference(ckpts: CheckpointCache) -> None:
    final, engine = run(ckpts, "plain", False)
    _, _, reqs = workload(7)
    ref = ckpts.reference(ckpts.get("conditional", "gdn3_attn1", with_mtp=True))
    assert set(final) == set(reqs) - {"r2"}
    for rid, out in final.items():
        prompt, lang = reqs[rid]
        check_against_reference(engine, ref, prompt, out, LANGUAGES[lang][1])
    assert any(o.outputs[0].finish_reason == "stop" for o in final.values()), "no request completed its word"


@pytest.mark.parametrize("spec", ["plain", "mtp", "ngram", "oracle"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_speculation_async_and_graphs_give_the_same_tokens(ckpts: CheckpointCache, spec: str,
                                                           async_scheduling: bool, graph_mode: str) -> None:
    want, _ = run(ckpts, "plain", False)
    got, engine = run(ckpts, spec, async_scheduling)
    assert {r: o.outputs[0].token_ids for r, o in got.items()} == {r: o.outputs[0].token_ids for r, o in want.items()}
    if spec == "oracle":
        accepted = engine.get_metrics()["hyserve:spec_decode_num_accepted_tokens_per_pos"]
        assert isinstance(accepted, list) and all(a > 0 for a in accepted), accepted


def test_sampling_without_the_masks_is_caught(ckpts: CheckpointCache, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference check fails when the sampler drops the masks (sabotage of the plain path)."""
    from hyserve.layers import sampler

    monkeypatch.setattr(sampler, "apply_grammar_masks", lambda *args: None)
    with pytest.raises((AssertionError, ValueError)):
        test_constrained_greedy_matches_the_reference(ckpts)


@pytest.mark.parametrize("spec", ["plain", "mtp"])
def test_seeded_sampling_stays_in_the_language(ckpts: CheckpointCache, spec: str) -> None:
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    llm = make_llm(path, speculative_config=SPECS[spec])
    prompts = random_prompts(6, [5, 11, 3], seed=3)
    for lang, (so, viable) in LANGUAGES.items():
        params = [SamplingParams(temperature=1.5, top_p=0.95, seed=s, max_tokens=12, structured_outputs=so)
                  for s in range(len(prompts))]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        texts = [o.outputs[0].text for o in outs]
        assert all(o.outputs[0].finish_reason == "stop" for o in outs), (lang, texts)
        assert all(viable(t)[1] for t in texts), (lang, texts)
        assert len(set(texts)) > 1, f"{lang}: every seed gave {texts[0]!r}"


def masks_without_drafts(monkeypatch: pytest.MonkeyPatch) -> Callable[[LLMEngine], None]:
    """Sabotage: a verify row's positions all get the first position's mask (the drafts not consumed)."""
    from hyserve.structured_output import matcher

    original = matcher.GrammarMatcher.masks

    def masks(self: matcher.GrammarMatcher, drafts: list[int]) -> bytes:
        return original(self, []) * (len(drafts) + 1)

    def install(engine: LLMEngine) -> None:
        monkeypatch.setattr(matcher.GrammarMatcher, "masks", masks)
    return install


def verify_ignores_masks(monkeypatch: pytest.MonkeyPatch) -> Callable[[LLMEngine], None]:
    """Sabotage: the rejection sampler drops the grammar masks of verify rows."""
    def install(engine: LLMEngine) -> None:
        verifier = engine.runner.verifier
        assert verifier is not None and verifier.rejection_sampler is not None
        sampler = verifier.rejection_sampler
        original = sampler.launch

        def launch(logits, rows, *args, **kw):  # type: ignore[no-untyped-def]
            for r in rows:
                r.grammar_masks = None
            return original(logits, rows, *args, **kw)

        monkeypatch.setattr(sampler, "launch", launch)
    return install


@pytest.mark.parametrize("sabotage", [masks_without_drafts, verify_ignores_masks])
@pytest.mark.parametrize("spec", ["oracle"])
def test_sabotaged_speculation_is_caught(ckpts: CheckpointCache, monkeypatch: pytest.MonkeyPatch, spec: str,
                                         sabotage: Callable[[pytest.MonkeyPatch], Callable[[LLMEngine], None]]
                                         ) -> None:
    want, _ = run(ckpts, "plain", False)
    with pytest.raises(AssertionError):
        got, _ = run(ckpts, spec, False, sabotage(monkeypatch))
        tokens = {r: o.outputs[0].token_ids for r, o in got.items()}
        assert tokens == {r: o.outputs[0].token_ids for r, o in want.items()}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec", ["mtp", "oracle"])
def test_constrained_speculation_with_captured_graphs_on_gpu(ckpts: CheckpointCache, spec: str) -> None:
    """On CUDA: captured graphs, async scheduling and speculation give the eager plain run's tokens, which follow
    the reference's argmax over the allowed set."""
    want, engine = run(ckpts, "plain", False, device="cuda", enforce_eager=True)
    _, _, reqs = workload(7)
    ref = ckpts.reference(ckpts.get("conditional", "gdn3_attn1", with_mtp=True))
    for rid, out in want.items():
        prompt, lang = reqs[rid]
        check_against_reference(engine, ref, prompt, out, LANGUAGES[lang][1])
    got, graphed = run(ckpts, spec, True, device="cuda")
    assert graphed.runner.graphs is not None and graphed.runner.graphs.sets["verify"].num_replays > 0
    assert {r: o.outputs[0].token_ids for r, o in got.items()} == {r: o.outputs[0].token_ids for r, o in want.items()}


@pytest.mark.parametrize("spec", ["oracle", "mtp"])
def test_constraints_compose_with_penalties_and_bias(ckpts: CheckpointCache, spec: str) -> None:
    """A grammar with repetition / frequency / presence penalties and a logit bias on the same requests: the tokens of
    speculative async runs equal plain decoding's, and every finished text is a word of its language."""
    arrivals, aborts, reqs = workload(11)
    for step in arrivals.values():
        for i, (rid, prompt, p) in enumerate(step):
            step[i] = (rid, prompt, SamplingParams(
                temperature=0.0, max_tokens=12, structured_outputs=p.structured_outputs, repetition_penalty=1.4,
                frequency_penalty=0.7, presence_penalty=0.3, logit_bias={5: 3.0, 17: -2.0}))
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    kw: dict[str, Any] = dict(enable_prefix_caching=True, block_size=16, max_num_batched_tokens=24, max_num_seqs=4)
    want = drive(make_llm(path, **kw).llm_engine, arrivals, aborts)
    engine = make_llm(path, speculative_config=SPECS[spec], async_scheduling=True, **kw).llm_engine
    if spec == "oracle":
        conts = {rid: o.outputs[0].token_ids for rid, o in want.items()}
        engine.proposer = OracleProposer({**conts, "r2": []}, {rid: [3, 0, 2, 1] for rid in conts}, vocab=440)
    got = drive(engine, arrivals, aborts)
    engine.assert_no_leaks()
    assert {r: o.outputs[0].token_ids for r, o in got.items()} == {r: o.outputs[0].token_ids for r, o in want.items()}
    for rid, out in got.items():
        if out.outputs[0].finish_reason == "stop":
            assert LANGUAGES[reqs[rid][1]][1](out.outputs[0].text)[1], (rid, out.outputs[0].text)

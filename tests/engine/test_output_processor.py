"""Outputs as deltas: DELTA outputs add up to the CUMULATIVE ones (text, token ids, logprobs) at every step, for
the plain and the speculative (n-gram, MTP: several tokens per step) paths, with stop strings cut across steps,
staggered arrivals and aborts; FINAL_ONLY gives one output; a slow async consumer loses nothing; and sabotage
(no stop-string holdback, a dropped delta) is caught.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from hyserve import SamplingParams
from hyserve.engine import output_processor
from hyserve.engine.llm_engine import LLMEngine
from hyserve.outputs import RequestOutput
from hyserve.request import Request
from hyserve.sampling_params import RequestOutputKind
from hyserve.server import async_engine as async_engine_module
from hyserve.server.async_engine import AsyncEngine
from hyserve.testing.engine import make_llm, random_prompts
from hyserve.testing.families import CheckpointCache
from hyserve.tokenizer import IncrementalDetokenizer

SPECS: dict[str, dict[str, object] | None] = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2},
    "mtp": {"method": "mtp", "num_speculative_tokens": 3},
}
Arrivals = dict[int, list[tuple[str, list[int], SamplingParams]]]


def greedy(n: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2, **kw)


def ckpt(ckpts: CheckpointCache) -> str:
    return ckpts.get("conditional", "gdn3_attn1", with_mtp=True)


def engine_for(path: str, spec: str) -> LLMEngine:
    return make_llm(path, speculative_config=SPECS[spec], max_num_batched_tokens=24, max_num_seqs=4).llm_engine


def force_drafts(engine: LLMEngine, oracle: dict[str, list[int]]) -> None:
    """Drafts from the known greedy continuations, so that verify steps accept several tokens (a tiny random model's
    own drafts are rarely right). MTP still runs; only its drafts' values are replaced (their number stays)."""

    def known(req: Request, k: int) -> list[int]:
        n = req.num_output_tokens
        return oracle[req.request_id][n:n + k]

    if engine.proposer is not None:
        engine.proposer.propose = lambda todo, ks: [known(r, k) for r, k in zip(todo, ks, strict=True)]  # type: ignore[method-assign]
        return
    assert engine.drafts is not None
    mtp_propose = engine.drafts.propose

    def propose(req: Request, proposal: list[int], max_model_len: int) -> list[int]:
        return known(req, len(mtp_propose(req, proposal, max_model_len)))

    engine.drafts.propose = propose  # type: ignore[method-assign]


def run(path: str, spec: str, arrivals: Arrivals, aborts: dict[int, list[str]], kind: RequestOutputKind,
        oracle: dict[str, list[int]]) -> list[list[RequestOutput]]:
    """Every step's outputs of a fresh engine, each request asking for ``kind``."""
    engine = engine_for(path, spec)
    if spec != "plain":
        force_drafts(engine, oracle)
    steps: list[list[RequestOutput]] = []
    step, last = 0, max(max(arrivals), max(aborts, default=0))
    while step <= last or engine.has_unfinished_requests():
        for rid, prompt, params in arrivals.get(step, []):
            engine.add_request(rid, {"prompt_token_ids": prompt}, dataclasses.replace(params, output_kind=kind))
        for rid in aborts.get(step, []):
            engine.abort_request(rid)
        steps.append(engine.step())
        step += 1
    engine.assert_no_leaks()
    return steps


@dataclasses.dataclass
class Sum:
    text: str = ""
    ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[Any] = dataclasses.field(default_factory=list)
    max_ids: int = 0  # the most token ids one delta carried


def add_up(cum_steps: list[list[RequestOutput]], delta_steps: list[list[RequestOutput]],
           holdback: dict[str, int]) -> tuple[dict[str, Sum], int]:
    """Assert that at every step the DELTA outputs so far add up to the CUMULATIVE output (text up to the held-back
    stop-string prefix, exact once finished); returns the sums and how many outputs had text held back."""
    assert [[o.request_id for o in s] for s in cum_steps] == [[o.request_id for o in s] for s in delta_steps]
    sums: dict[str, Sum] = {}
    held = 0
    for cs, ds in zip(cum_steps, delta_steps, strict=True):
        for c, d in zip(cs, ds, strict=True):
            cc, dd = c.outputs[0], d.outputs[0]
            acc = sums.setdefault(c.request_id, Sum())
            acc.text += dd.text
            acc.ids += dd.token_ids
            acc.logprobs += dd.logprobs or []
            acc.max_ids = max(acc.max_ids, len(dd.token_ids))
            assert acc.ids == cc.token_ids, c.request_id
            assert acc.logprobs == (cc.logprobs or []), c.request_id
            assert (d.finished, dd.finish_reason, dd.stop_reason) == (c.finished, cc.finish_reason, cc.stop_reason)
            assert dd.cumulative_logprob == cc.cumulative_logprob
            if c.finished:
                assert acc.text == cc.text, c.request_id
            else:
                assert cc.text.startswith(acc.text), (c.request_id, acc.text, cc.text)
                assert len(cc.text) - len(acc.text) <= holdback[c.request_id]
                held += len(cc.text) > len(acc.text)
    return sums, held


def stop_across_tokens(engine: LLMEngine, prompt: list[int], ids: list[int], at: int) -> str:
    """The text of output tokens ``at`` and ``at + 1``, a stop string whose first occurrence starts at token
    ``at``: it completes one token after it starts, so a stream without holdback would send its first part."""
    assert engine.tokenizer is not None
    detok = IncrementalDetokenizer(engine.tokenizer, prompt)
    offsets = [0]
    for t in ids:
        detok.append([t])
        offsets.append(len(detok.text))
    for i in range(at, len(ids) - 1):
        stop = detok.text[offsets[i]:offsets[i + 2]]
        if offsets[i + 1] > offsets[i] and offsets[i + 2] > offsets[i + 1] and detok.text.find(stop) == offsets[i]:
            return stop
    raise AssertionError("no stop string found")


Scenario = tuple[Arrivals, dict[int, list[str]], dict[str, int], dict[str, list[int]]]


def scenario(path: str) -> Scenario:
    """Four requests arriving at steps 0, 0, 3 and 6; "b" aborted at step 5; "c" and "d" end on stop strings cut
    across tokens (``d`` keeps it in its text). Also each request's greedy output without stops (the oracle)."""
    prompts = random_prompts(4, [14, 9, 21, 6], seed=5)
    prompts[1] = prompts[1] + prompts[1][:5] + prompts[1]  # repetition: the n-gram proposer finds drafts
    probe = engine_for(path, "plain")
    base = {rid: greedy(24) for rid in "abcd"}
    for rid, prompt in zip("abcd", prompts, strict=True):
        probe.add_request(rid, {"prompt_token_ids": prompt}, base[rid])
    finals: dict[str, list[int]] = {}
    while probe.has_unfinished_requests():
        for out in probe.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0].token_ids
    params = dict(base)
    params["c"] = greedy(24, stop=[stop_across_tokens(probe, prompts[2], finals["c"], 4)])
    params["d"] = greedy(24, stop=["\x00never", stop_across_tokens(probe, prompts[3], finals["d"], 6)],
                         include_stop_str_in_output=True)
    arrivals: Arrivals = {0: [("a", prompts[0], params["a"]), ("b", prompts[1], params["b"])],
                          3: [("c", prompts[2], params["c"])], 6: [("d", prompts[3], params["d"])]}
    holdback = {rid: output_processor.stop_holdback(p) for rid, p in params.items()}
    return arrivals, {5: ["b"]}, holdback, finals


@pytest.mark.parametrize("spec", list(SPECS))
def test_deltas_add_up_to_the_cumulative_outputs(ckpts: CheckpointCache, spec: str) -> None:
    path = ckpt(ckpts)
    arrivals, aborts, holdback, oracle = scenario(path)
    cum = run(path, spec, arrivals, aborts, RequestOutputKind.CUMULATIVE, oracle)
    delta = run(path, spec, arrivals, aborts, RequestOutputKind.DELTA, oracle)
    sums, held = add_up(cum, delta, holdback)
    finals = {o.request_id: o for s in cum for o in s if o.finished}
    assert sorted(finals) == ["a", "c", "d"]  # "b" was aborted: no final output
    assert finals["c"].outputs[0].stop_reason is not None and finals["d"].outputs[0].stop_reason is not None
    assert finals["d"].outputs[0].text.endswith(str(finals["d"].outputs[0].stop_reason))
    assert held > 0  # text was held back for a stop string at some step
    assert 0 < len(sums["b"].ids) < 24
    assert finals["a"].outputs[0].token_ids == oracle["a"]  # forced drafts leave the greedy output as it is
    if spec != "plain":
        assert max(s.max_ids for s in sums.values()) > 1, "no step emitted several tokens of one request"


def test_no_holdback_is_caught(ckpts: CheckpointCache, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage: DELTA outputs without the stop-string holdback send text that the stop string then removes."""
    path = ckpt(ckpts)
    arrivals, aborts, holdback, oracle = scenario(path)
    cum = run(path, "plain", arrivals, aborts, RequestOutputKind.CUMULATIVE, oracle)
    monkeypatch.setattr(output_processor, "stop_holdback", lambda params: 0)
    delta = run(path, "plain", arrivals, aborts, RequestOutputKind.DELTA, oracle)
    with pytest.raises(AssertionError):
        add_up(cum, delta, holdback)


def test_final_only_gives_one_cumulative_output(ckpts: CheckpointCache) -> None:
    path = ckpt(ckpts)
    arrivals, aborts, _, oracle = scenario(path)
    cum = run(path, "mtp", arrivals, aborts, RequestOutputKind.CUMULATIVE, oracle)
    final = run(path, "mtp", arrivals, aborts, RequestOutputKind.FINAL_ONLY, oracle)
    outs = [o for s in final for o in s]
    assert sorted(o.request_id for o in outs) == ["a", "c", "d"] and all(o.finished for o in outs)
    expected = {o.request_id: o for s in cum for o in s if o.finished}
    for o in outs:
        assert o.outputs[0] == expected[o.request_id].outputs[0]


def test_llm_generate_refuses_delta(ckpts: CheckpointCache) -> None:
    llm = make_llm(ckpt(ckpts))
    with pytest.raises(ValueError, match="DELTA"):
        llm.generate([[5, 6, 7]], greedy(4, output_kind=RequestOutputKind.DELTA), use_tqdm=False)
    out = llm.generate([[5, 6, 7]], greedy(4, output_kind=RequestOutputKind.FINAL_ONLY), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


def slow_stream(path: str, params: SamplingParams, prompt: list[int]) -> list[RequestOutput]:
    """The DELTA outputs a consumer reads when it sleeps after each one (the engine steps on meanwhile)."""
    aengine = AsyncEngine(engine_for(path, "plain"))

    async def consume() -> list[RequestOutput]:
        got = []
        async for out in aengine.generate("slow", {"prompt_token_ids": prompt}, params):
            got.append(out)
            await asyncio.sleep(0.05)
        return got

    try:
        return asyncio.run(consume())
    finally:
        aengine.shutdown()


def test_a_slow_async_consumer_loses_nothing(ckpts: CheckpointCache) -> None:
    path = ckpt(ckpts)
    prompt = random_prompts(1, [12], seed=9)[0]
    params = greedy(40, stop=["\x00never"])
    expected = make_llm(path).generate([prompt], params, use_tqdm=False)[0].outputs[0]
    got = slow_stream(path, dataclasses.replace(params, output_kind=RequestOutputKind.DELTA), prompt)
    assert len(got) < 40, "the consumer never fell behind: nothing was merged"
    assert "".join(o.outputs[0].text for o in got) == expected.text
    assert [t for o in got for t in o.outputs[0].token_ids] == expected.token_ids
    assert [e for o in got for e in o.outputs[0].logprobs or []] == expected.logprobs
    assert got[-1].finished and got[-1].outputs[0].finish_reason == "length"


def test_a_dropped_delta_is_caught(ckpts: CheckpointCache, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage: coalescing DELTA outputs as if cumulative (keep the latest) loses tokens."""
    path = ckpt(ckpts)
    prompt = random_prompts(1, [12], seed=9)[0]
    monkeypatch.setattr(async_engine_module, "merge_delta", lambda earlier, later: later)
    got = slow_stream(path, greedy(40, output_kind=RequestOutputKind.DELTA), prompt)
    assert sum(len(o.outputs[0].token_ids) for o in got) < 40


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA])
def test_a_character_cut_by_max_tokens_is_flushed_at_the_end(ckpts: CheckpointCache, kind: RequestOutputKind) -> None:
    """max_tokens ends the output in the middle of a multi-byte character: the final text is the decode of the
    output ids (the held-back bytes come out as U+FFFD), not the text minus them."""
    engine = make_llm(ckpts.get()).llm_engine
    tok = engine.tokenizer
    assert tok is not None
    ids = tok.encode("naïve ü")
    lone = next(i for i in ids if tok.decode([i]).endswith("\ufffd"))  # a token holding part of a character
    proc = engine.output_processor
    params = SamplingParams(max_tokens=2, output_kind=kind)
    req = Request("r", None, [1, 2, 3], params, 0, proc.detokenizer([1, 2, 3], params))
    assert proc.append(req, output_processor.NewTokens([ids[0]])) is None
    assert proc.append(req, output_processor.NewTokens([lone])) == "length"
    req.status = req.status.FINISHED
    assert req.output_text == tok.decode([ids[0], lone]) and req.output_text.endswith("\ufffd")
    out = proc.make_output(req)
    assert out is not None and out.outputs[0].text.endswith("\ufffd")

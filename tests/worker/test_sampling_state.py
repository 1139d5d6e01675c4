"""``SamplingState`` against the adjustments written out token by token (``hyserve.testing.sampling``).

Random requests (penalties, logit_bias, allowed_token_ids, bad words, some with nothing to adjust) each get a history
the way the engine builds one: the prompt when learned, a chunk of known tokens fed from a prefix-cache hit on,
stale tokens past the known length (rejected drafts of earlier steps), then a step of plain rows and verify rows
whose starts come from the device. Every logits row must be the reference's adjustment of the tokens before it:
for a verify row's position j, the known tokens and the drafts before j.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyserve.sampling_params import SamplingParams
from hyserve.scheduler.output import ScheduledRow
from hyserve.testing.sampling import reference_adjust
from hyserve.worker import sampling_state
from hyserve.worker.sampling_state import SamplingState

V = 16
MAX_LEN = 48
CPU = torch.device("cpu")


@st.composite
def params_st(draw: st.DrawFn) -> SamplingParams:
    kw: dict[str, object] = {"temperature": 0.0}
    if draw(st.booleans()):
        kw["presence_penalty"] = draw(st.floats(-2, 2))
        kw["frequency_penalty"] = draw(st.floats(-2, 2))
    if draw(st.booleans()):
        kw["repetition_penalty"] = draw(st.floats(0.3, 2.5))
    if draw(st.booleans()):
        kw["logit_bias"] = draw(st.dictionaries(st.integers(0, V - 1), st.floats(-100, 100), max_size=4))
    if draw(st.booleans()):
        kw["allowed_token_ids"] = draw(st.lists(st.integers(0, V - 1), min_size=1, max_size=6))
    if draw(st.booleans()):
        kw["bad_words_token_ids"] = draw(st.lists(st.lists(st.integers(0, V - 1), min_size=1, max_size=3),
                                                  min_size=1, max_size=3))
    return SamplingParams(**kw)  # type: ignore[arg-type]


@st.composite
def request_st(draw: st.DrawFn) -> dict[str, object]:
    prompt = draw(st.lists(st.integers(0, V - 1), min_size=1, max_size=8))
    # Small alphabets make bad-word prefixes match and counts exceed one.
    out = draw(st.lists(st.integers(0, 4), min_size=1, max_size=10))
    return {"params": draw(params_st()), "prompt": prompt, "out": out, "cached": draw(st.integers(0, len(prompt))),
            "drafts": draw(st.one_of(st.none(), st.lists(st.integers(0, 4), max_size=3)))}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=st.lists(request_st(), min_size=1, max_size=4), seed=st.integers(0, 2**16))
def test_adjusted_rows_match_the_reference(reqs: list[dict[str, object]], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    state = SamplingState(CPU, V, MAX_LEN)
    verify = [i for i, r in enumerate(reqs) if r["drafts"] is not None]
    order = verify + [i for i in range(len(reqs)) if r_is_plain(reqs[i])]  # verify rows come first
    known: dict[str, list[int]] = {}
    prefill_rows, prefill_ids = [], []
    for i, r in enumerate(reqs):
        rid, prompt, out = f"q{i}", list(r["prompt"]), list(r["out"])  # type: ignore[call-overload]
        params = r["params"]
        assert isinstance(params, SamplingParams)
        state.add_request(rid, params, prompt)
        tokens = prompt + out
        known[rid] = tokens
        if rid in state.slot:  # stale tokens past the prompt: what earlier steps' rejected drafts left
            state.history[state.slot[rid], len(prompt):] = torch.randint(0, V, (MAX_LEN - len(prompt),), generator=g)
        cached = int(r["cached"])  # type: ignore[call-overload]
        chunk = tokens[cached:-1]  # known tokens but the last, from the prefix-cache hit on
        if chunk:
            prefill_rows.append(ScheduledRow(rid, cached, chunk, [], 0, samples=False))
            prefill_ids.extend(chunk)
    if prefill_rows:
        qsl = np.cumsum([0] + [len(r.token_ids) for r in prefill_rows])
        state.record_inputs(prefill_rows, torch.tensor(prefill_ids), qsl, torch.zeros(0, dtype=torch.long))

    rows: list[ScheduledRow] = []
    for i in order:
        rid = f"q{i}"
        tokens = known[rid]
        drafts = reqs[i]["drafts"]
        if drafts is None:
            rows.append(ScheduledRow(rid, len(tokens) - 1, [tokens[-1]], [], 0, samples=True))
        else:
            # The host's start is a lower bound; the device's verify_starts has the true one (a row behind another).
            rows.append(ScheduledRow(rid, 0, [tokens[-1], *drafts], [], 0, samples=True, is_verify=True,  # type: ignore[list-item]
                                     start_on_device=True, max_start=len(tokens) - 1))
    input_ids = torch.tensor([t for r in rows for t in r.token_ids])
    qsl = np.cumsum([0] + [len(r.token_ids) for r in rows])
    starts = torch.tensor([len(known[r.req_id]) - 1 for r in rows if r.is_verify], dtype=torch.long)
    state.record_inputs(rows, input_ids, qsl, starts)

    n_verify = sum(len(r.token_ids) for r in rows if r.is_verify)
    logits = torch.randn(len(input_ids), V, generator=g) * 3
    vrows, prows = [r for r in rows if r.is_verify], [r for r in rows if not r.is_verify]
    adj_v = state.adjust(logits[:n_verify], vrows, starts) if vrows else None
    plain_logits = logits[n_verify : n_verify + len(prows)]
    adj_p = state.adjust(plain_logits, prows) if prows else None
    got = torch.cat([a if a is not None else lg for a, lg in ((adj_v, logits[:n_verify]), (adj_p, plain_logits))])
    k = 0
    for r in vrows + prows:
        tokens = known[r.req_id]
        i = int(r.req_id[1:])
        prompt = list(reqs[i]["prompt"])  # type: ignore[call-overload]
        params = reqs[i]["params"]
        assert isinstance(params, SamplingParams)
        n = len(r.token_ids) if r.is_verify else 1
        for j in range(n):
            out = tokens[len(prompt):] + list(r.token_ids[1 : 1 + j])
            want = reference_adjust(logits[k] if r.is_verify else plain_logits[k - n_verify], prompt, out, params,
                                    set())
            row = got[k]
            assert torch.equal(torch.isinf(row), torch.isinf(want)), (r.req_id, j)
            fin = torch.isfinite(want)
            torch.testing.assert_close(row[fin].double(), want[fin], rtol=1e-5, atol=1e-4)
            k += 1
    state.remove_request("q0")
    assert "q0" not in state.params and ("q0" not in state.slot)


def r_is_plain(r: dict[str, object]) -> bool:
    return r["drafts"] is None


def test_requests_without_adjustments_cost_nothing() -> None:
    state = SamplingState(CPU, V, MAX_LEN)
    state.add_request("a", SamplingParams(temperature=0.5, top_k=3), [1, 2, 3])
    assert not state.params and state.history.shape[0] == 0
    row = ScheduledRow("a", 2, [3], [], 0, samples=True)
    assert state.adjust(torch.zeros(1, V), [row]) is None


def test_history_rows_are_reused_and_grow() -> None:
    state = SamplingState(CPU, V, MAX_LEN)
    for i in range(6):
        state.add_request(f"r{i}", SamplingParams(frequency_penalty=1.0), [i])
    assert len(set(state.slot.values())) == 6 and state.history.shape[0] >= 6
    state.remove_request("r2")
    state.add_request("new", SamplingParams(presence_penalty=1.0), [9, 9])
    assert state.slot["new"] not in {state.slot[f"r{i}"] for i in (0, 1, 3, 4, 5)}
    assert bool(state.prompt_mask[state.slot["new"], 9]) and not bool(state.prompt_mask[state.slot["new"], 2])
    assert math.isclose(float(state.history[state.slot["new"], 1]), 9)


def _drafts_unseen(monkeypatch: pytest.MonkeyPatch) -> None:
    record = SamplingState.record_inputs

    def first_only(self, rows, input_ids, query_start_loc, verify_starts):  # type: ignore[no-untyped-def]
        rows = [dataclasses.replace(r, token_ids=r.token_ids[:1]) if r.is_verify else r for r in rows]
        record(self, rows, input_ids, query_start_loc, verify_starts)

    monkeypatch.setattr(SamplingState, "record_inputs", first_only)


def _frequency_counts_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    real = sampling_state.apply_penalties

    def counts_prompt(x, prompt_mask, output_counts, presence, frequency, repetition):  # type: ignore[no-untyped-def]
        real(x, prompt_mask, output_counts + prompt_mask, presence, frequency, repetition)

    monkeypatch.setattr(sampling_state, "apply_penalties", counts_prompt)


def _host_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host's lower-bound start instead of the device's start, for rows behind rows in flight."""
    real = SamplingState._with_verify_starts

    def host_only(self, host, vrow, verify_starts):  # type: ignore[no-untyped-def]
        return real(self, host, vrow, None if verify_starts is None else torch.zeros_like(verify_starts))

    monkeypatch.setattr(SamplingState, "_with_verify_starts", host_only)


@pytest.mark.parametrize("sabotage", [_drafts_unseen, _frequency_counts_prompt, _host_starts])
def test_sabotage_is_caught(sabotage: Callable[[pytest.MonkeyPatch], None], monkeypatch: pytest.MonkeyPatch) -> None:
    sabotage(monkeypatch)
    # Hypothesis reports several distinct failures as a group.
    with pytest.raises((AssertionError, ExceptionGroup)) as caught:
        test_adjusted_rows_match_the_reference()
    if isinstance(caught.value, ExceptionGroup):
        assert caught.value.subgroup(AssertionError) is not None

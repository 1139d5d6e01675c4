"""SamplingParams validation, output classes, and the sampler's distributions, errors and determinism (CPU).

Statistical checks use fixed seeds, so they are deterministic; their bounds are still real ones (a chi-square
quantile far in the tail), so a sampler drawing from the wrong distribution fails them.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyserve.layers.sampler import ERROR_TOKEN_ID, Sampler, SamplerOutput, SamplingRow
from hyserve.outputs import CompletionOutput, Logprob, RequestOutput
from hyserve.sampling_params import SamplingParams, SamplingType

CPU = torch.device("cpu")


# ----------------------------------------------------------------------------------------------------------------
# SamplingParams


def test_defaults_follow_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1, 1.0, 1.0, 0, 0.0, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert (p.ignore_eos, p.max_tokens, p.min_tokens, p.logprobs) == (False, 16, 0, None)
    assert p.skip_special_tokens is True and p.include_stop_str_in_output is False
    assert p.sampling_type is SamplingType.RANDOM and not p.is_greedy


@pytest.mark.parametrize(
    ("kwargs", "field", "shown"),
    [
        ({"n": 0}, "n", "0"),
        ({"n": "1"}, "n", "'1'"),
        ({"temperature": -0.1}, "temperature", "-0.1"),
        ({"temperature": "hot"}, "temperature", "'hot'"),
        ({"temperature": float("nan")}, "temperature", "nan"),
        ({"temperature": float("inf")}, "temperature", "inf"),
        ({"temperature": True}, "temperature", "True"),
        ({"temperature": None}, "temperature", "None"),
        ({"top_p": 0.0}, "top_p", "0.0"),
        ({"top_p": 1.5}, "top_p", "1.5"),
        ({"top_p": -0.5}, "top_p", "-0.5"),
        ({"top_p": "0.9"}, "top_p", "'0.9'"),
        ({"top_k": -2}, "top_k", "-2"),
        ({"top_k": 1.5}, "top_k", "1.5"),
        ({"top_k": "5"}, "top_k", "'5'"),
        ({"min_p": -0.1}, "min_p", "-0.1"),
        ({"min_p": 1.1}, "min_p", "1.1"),
        ({"min_p": [0.1]}, "min_p", "[0.1]"),
        ({"max_tokens": 0}, "max_tokens", "0"),
        ({"max_tokens": -3}, "max_tokens", "-3"),
        ({"max_tokens": 2.5}, "max_tokens", "2.5"),
        ({"min_tokens": -1}, "min_tokens", "-1"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens", "5"),
        ({"logprobs": -1}, "logprobs", "-1"),
        ({"logprobs": 2.0}, "logprobs", "2.0"),
        ({"seed": 1.5}, "seed", "1.5"),
        ({"seed": "42"}, "seed", "'42'"),
        ({"seed": False}, "seed", "False"),
        ({"stop": ""}, "stop", "''"),
        ({"stop": ["a", ""]}, "stop", "['a', '']"),
        ({"stop": [1]}, "stop", "[1]"),
        ({"stop": 7}, "stop", "7"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids", "-1"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids", "'a'"),
        ({"stop_token_ids": 5}, "stop_token_ids", "5"),
        ({"ignore_eos": "yes"}, "ignore_eos", "'yes'"),
        ({"skip_special_tokens": 1}, "skip_special_tokens", "1"),
        ({"include_stop_str_in_output": None}, "include_stop_str_in_output", "None"),
    ],
)
def test_invalid_values_raise_value_error_naming_field_and_value(
    kwargs: dict[str, Any], field: str, shown: str
) -> None:
    with pytest.raises(ValueError, match=r"\S") as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert field in message, message
    assert shown in message, message


def test_invalid_values_are_rejected_even_when_greedy() -> None:
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=0.0, top_p=0.0)


def test_normalization() -> None:
    p = SamplingParams(top_k=-1, stop="###", stop_token_ids=(5, 7), temperature=1, max_tokens=None)  # type: ignore[arg-type]
    assert p.top_k == 0
    assert p.stop == ["###"]
    assert p.stop_token_ids == [5, 7] and isinstance(p.stop_token_ids, list)
    assert isinstance(p.temperature, float)
    assert p.max_tokens is None
    q = SamplingParams(top_k=np.int64(3), top_p=np.float32(0.5), seed=np.int32(9))  # type: ignore[arg-type]
    assert (q.top_k, q.top_p, q.seed) == (3, 0.5, 9)
    assert type(q.top_k) is int and type(q.seed) is int
    stops = ["a", "b"]
    r = SamplingParams(stop=stops)
    stops.append("c")
    assert r.stop == ["a", "b"], "the params own a copy of the stop list"


def test_greedy_resets_truncation_and_sampling_type() -> None:
    g = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2, seed=1)
    assert g.is_greedy and g.sampling_type is SamplingType.GREEDY
    assert (g.top_p, g.top_k, g.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(temperature=1e-6).is_greedy  # vLLM's epsilon
    assert not SamplingParams(temperature=1e-4).is_greedy
    assert SamplingParams(seed=3).sampling_type is SamplingType.RANDOM_SEED


def test_clone_is_independent_and_equal() -> None:
    p = SamplingParams(temperature=0.7, stop=["x"], stop_token_ids=[1], seed=4, logprobs=2)
    c = p.clone()
    assert c == p and c is not p
    c.stop.append("y")
    c.stop_token_ids.append(2)
    assert p.stop == ["x"] and p.stop_token_ids == [1]


# ----------------------------------------------------------------------------------------------------------------
# Output classes


def test_output_classes() -> None:
    lp = Logprob(-0.5, rank=1, decoded_token="a")
    running = CompletionOutput(0, "a", [5], -0.5, [{5: lp}], None, None)
    done = CompletionOutput(0, "ab", [5, 6], -1.0, None, "stop", "\n")
    assert not running.finished() and done.finished()
    out = RequestOutput("r1", "hi", [1, 2], [done], finished=True)
    assert out.metrics is None and out.outputs[0].stop_reason == "\n"
    text = repr(out)
    assert "request_id='r1'" in text and "finish_reason='stop'" in text and "token_ids=[5, 6]" in text
    assert "logprob=-0.5" in repr(lp)


# ----------------------------------------------------------------------------------------------------------------
# Sampler helpers


def _row(seed: int | None = None, banned: list[int] | None = None, **params: Any) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), seed, list(banned or []))


def _reference_probs(logits: np.ndarray, params: SamplingParams, banned: Sequence[int] = ()) -> np.ndarray:
    """The distribution the sampler must draw from, in float64: temperature -> top-k -> top-p -> min-p."""
    x = logits.astype(np.float64).copy()
    x[list(banned)] = -np.inf
    x = (x - x.max()) / params.temperature
    v = x.size
    if 0 < params.top_k < v:
        kth = np.sort(x)[::-1][params.top_k - 1]
        x[x < kth] = -np.inf
    if params.top_p < 1.0:
        probs = np.exp(x - x.max())
        probs /= probs.sum()
        order = np.argsort(-probs, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]
        x[order[before >= params.top_p]] = -np.inf
    if params.min_p > 0.0:
        x[x < math.log(params.min_p)] = -np.inf
    probs = np.exp(x - x.max())
    return np.asarray(probs / probs.sum())


def _draw(sampler: Sampler, logits: torch.Tensor, row: SamplingRow, n: int) -> np.ndarray:
    """Counts per token of ``n`` unseeded draws of one logits row with one row's params (one batched call)."""
    out = sampler(logits.unsqueeze(0).expand(n, -1), [row] * n)
    assert out.error_rows == []
    return np.bincount(np.asarray(out.token_ids), minlength=logits.numel())


def _chi2_upper_bound(df: int, z: float = 5.0) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at a z-score of ``z`` (~3e-7 tail for z=5)."""
    a = 2.0 / (9.0 * df)
    return float(df * (1.0 - a + z * np.sqrt(a)) ** 3)


def _assert_matches(counts: np.ndarray, probs: np.ndarray) -> None:
    """Zero-probability tokens never drawn, and a chi-square goodness-of-fit within a far-tail bound."""
    support = probs > 0
    assert counts[~support].sum() == 0, f"drew outside the support: {np.nonzero(counts * ~support)[0]}"
    n = counts.sum()
    expected = n * probs[support]
    assert expected.min() >= 20, "test design: too few expected draws per bin for a chi-square check"
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    if df == 0:
        return
    assert stat < _chi2_upper_bound(df), f"chi2={stat:.1f} (df={df}) counts={counts} expected={expected.round(1)}"


def _logits(v: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(v, generator=torch.Generator().manual_seed(seed)) * scale


# ----------------------------------------------------------------------------------------------------------------
# Greedy


def test_greedy_is_argmax_with_ties_to_lowest_id() -> None:
    sampler = Sampler(CPU)
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [5.0, 5.0, 5.0, 5.0], [-math.inf, 0.0, 0.0, -math.inf]])
    out = sampler(logits, [_row(temperature=0.0)] * 3)
    assert out.token_ids == [1, 0, 1]
    assert out.error_rows == [] and out.logprobs is None and out.top_logprobs is None
    big = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0))
    assert sampler(big, [_row(temperature=0.0)] * 64).token_ids == big.argmax(dim=1).tolist()


def test_greedy_respects_bans() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0]])
    assert Sampler(CPU)(logits, [_row(banned=[1], temperature=0.0)]).token_ids == [2]
    assert Sampler(CPU)(logits, [_row(banned=[1, 2], temperature=0.0)]).token_ids == [3]


def test_all_greedy_batch_does_not_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("an all-greedy batch must not sort")

    monkeypatch.setattr(torch.Tensor, "sort", forbidden)
    monkeypatch.setattr(torch, "sort", forbidden)
    monkeypatch.setattr(torch, "topk", forbidden)
    logits = torch.randn(8, 50)
    assert (
        Sampler(CPU)(logits, [_row(temperature=0.0, banned=[0])] * 8).token_ids
        == logits[:, 1:].argmax(dim=1).add(1).tolist()
    )


def test_input_logits_not_modified_and_other_dtypes_accepted() -> None:
    logits = _logits(32, 1).repeat(3, 1)
    before = logits.clone()
    rows = [_row(banned=[0, 1], temperature=0.0), _row(seed=1, top_p=0.5, top_k=5, banned=[2]), _row(seed=2, min_p=0.1)]
    out = Sampler(CPU)(logits, rows)
    assert torch.equal(logits, before)
    out16 = Sampler(CPU)(logits.to(torch.bfloat16), rows)
    assert out16.error_rows == [] and all(0 <= t < 32 for t in out16.token_ids)
    assert out.token_ids[0] == int(logits[0, 2:].argmax()) + 2


def test_shape_and_ban_validation() -> None:
    sampler = Sampler(CPU)
    with pytest.raises(ValueError, match="shape"):
        sampler(torch.zeros(2, 5), [_row()])
    with pytest.raises(ValueError, match="banned token id 5"):
        sampler(torch.zeros(1, 5), [_row(banned=[5])])
    empty = sampler(torch.zeros(0, 5), [])
    assert empty == SamplerOutput([], None, None, [])


# ----------------------------------------------------------------------------------------------------------------
# Non-finite logits


def test_non_finite_rows_are_errors_and_other_rows_unaffected() -> None:
    v = 16
    good = [_logits(v, i) for i in range(4)]
    nan_row = _logits(v, 10)
    nan_row[3] = math.nan
    pos_inf = _logits(v, 11)
    pos_inf[5] = math.inf
    all_neg_inf = torch.full((v,), -math.inf)
    one_neg_inf = _logits(v, 12)
    one_neg_inf[7] = -math.inf
    nan_banned = _logits(v, 13)
    nan_banned[2] = math.nan  # banning a NaN does not make the row trustworthy
    logits = torch.stack(
        [good[0], nan_row, good[1], pos_inf, all_neg_inf, one_neg_inf, good[2], good[3], nan_banned, good[0]]
    )
    rows = [
        _row(seed=1, top_k=5),
        _row(seed=2),
        _row(temperature=0.0),
        _row(temperature=0.0, logprobs=3),
        _row(seed=3, top_p=0.9),
        _row(seed=4, min_p=0.05, logprobs=2),
        _row(seed=5, logprobs=1),
        _row(),
        _row(seed=6, banned=[2]),
        _row(seed=7, banned=list(range(v))),  # everything banned: nothing to sample
    ]
    out = Sampler(CPU, seed=3)(logits, rows)
    assert out.error_rows == [1, 3, 4, 8, 9]
    for i in out.error_rows:
        assert out.token_ids[i] == ERROR_TOKEN_ID
    assert out.logprobs is not None and out.top_logprobs is not None
    assert math.isnan(out.logprobs[3]) and out.top_logprobs[3] == []
    for i in (0, 2, 5, 6):  # seeded or greedy: comparable with the row sampled on its own
        alone = Sampler(CPU, seed=99)(logits[i : i + 1], [rows[i]])
        assert out.token_ids[i] == alone.token_ids[0], i
        assert alone.error_rows == []
    assert out.token_ids[5] != 7
    assert 0 <= out.token_ids[7] < v
    assert out.logprobs[5] == pytest.approx(float(torch.log_softmax(one_neg_inf, 0)[out.token_ids[5]]), abs=1e-6)


def test_neg_inf_only_rows_with_one_finite_entry_are_fine() -> None:
    logits = torch.full((2, 10), -math.inf)
    logits[:, 4] = 2.0
    out = Sampler(CPU)(logits, [_row(temperature=0.0), _row(top_p=0.3, top_k=2, min_p=0.5)])
    assert out.token_ids == [4, 4] and out.error_rows == []


# ----------------------------------------------------------------------------------------------------------------
# Seeds and determinism


def _random_mate(rng: random.Random, v: int) -> SamplingRow:
    kind = rng.randrange(6)
    params: dict[str, Any] = {"temperature": rng.choice([0.0, 0.3, 1.0, 2.0])}
    if kind >= 1:
        params["top_k"] = rng.choice([0, 1, 3, v // 2, v + 5])
    if kind >= 2:
        params["top_p"] = rng.choice([0.1, 0.5, 0.95, 1.0])
    if kind >= 3:
        params["min_p"] = rng.choice([0.0, 0.05, 0.3])
    if rng.random() < 0.3:
        params["logprobs"] = rng.randrange(4)
    seed = rng.randrange(1 << 40) if rng.random() < 0.5 else None
    banned = rng.sample(range(v), rng.randrange(3))
    return _row(seed=seed, banned=banned, **params)


@pytest.mark.parametrize(
    "target_params",
    [
        {},
        {"temperature": 0.7},
        {"top_k": 7},
        {"top_p": 0.8},
        {"min_p": 0.1},
        {"top_k": 20, "top_p": 0.9, "min_p": 0.02},
        {"temperature": 1.3, "logprobs": 2},
    ],
)
def test_seeded_token_independent_of_batch_composition(target_params: dict[str, Any]) -> None:
    v = 64
    rng = random.Random(1234)
    for trial in range(25):
        target_logits = _logits(v, 1000 + trial, scale=2.0)
        seed = rng.randrange(1 << 62)
        target = _row(seed=seed, **target_params)
        alone = Sampler(CPU, seed=0)(target_logits.unsqueeze(0), [target]).token_ids[0]
        n_mates = rng.randrange(1, 12)
        pos = rng.randrange(n_mates + 1)
        mates = [_random_mate(rng, v) for _ in range(n_mates)]
        mate_logits = torch.randn(n_mates, v, generator=torch.Generator().manual_seed(trial)) * 3
        rows = [*mates[:pos], target, *mates[pos:]]
        logits = torch.cat([mate_logits[:pos], target_logits.unsqueeze(0), mate_logits[pos:]])
        batched = Sampler(CPU, seed=trial + 7)(logits, rows)
        assert batched.token_ids[pos] == alone, (trial, pos)


def test_seeded_sampling_is_reproducible_and_seeds_differ() -> None:
    v = 1000
    logits = torch.zeros(1, v)  # uniform: any two different draws are distinguishable
    draws = [Sampler(CPU, seed=s)(logits, [_row(seed=s)]).token_ids[0] for s in range(200)]
    again = [Sampler(CPU, seed=s + 1)(logits, [_row(seed=s)]).token_ids[0] for s in range(200)]
    assert draws == again
    assert len(set(draws)) > 150, "different seeds must give (mostly) different draws"
    # Many rows of one batch with different seeds are different draws, too.
    batch = Sampler(CPU)(logits.expand(200, -1), [_row(seed=s) for s in range(200)]).token_ids
    assert batch == draws


def test_seeds_outside_generator_range_are_accepted() -> None:
    logits = torch.zeros(1, 100)
    for seed in (-1, -(1 << 70), (1 << 64) + 5, (1 << 64) - 1):
        out = Sampler(CPU)(logits, [_row(seed=seed)])
        assert out.error_rows == [] and out.token_ids == Sampler(CPU)(logits, [_row(seed=seed)]).token_ids


def test_unseeded_rows_use_the_sampler_generator() -> None:
    logits = torch.zeros(64, 1000)
    rows = [_row()] * 64
    a, b = Sampler(CPU, seed=5), Sampler(CPU, seed=5)
    first, second = a(logits, rows).token_ids, a(logits, rows).token_ids
    assert first != second, "the generator advances between calls"
    assert b(logits, rows).token_ids == first and b(logits, rows).token_ids == second
    assert Sampler(CPU, seed=6)(logits, rows).token_ids != first


# ----------------------------------------------------------------------------------------------------------------
# Distributions


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_frequencies_match_softmax(temperature: float) -> None:
    logits = torch.tensor([0.0, 0.5, 1.0, -0.5, 0.2, 1.5])
    params = SamplingParams(temperature=temperature)
    counts = _draw(Sampler(CPU, seed=11), logits, SamplingRow(params), 20000)
    _assert_matches(counts, _reference_probs(logits.numpy(), params))


def test_wrong_distribution_would_fail_the_check() -> None:
    """The bound is tight enough to see a sampler that ignores temperature."""
    logits = torch.tensor([0.0, 0.5, 1.0, -0.5, 0.2, 1.5])
    counts = _draw(Sampler(CPU, seed=11), logits, _row(temperature=1.0), 20000)
    with pytest.raises(AssertionError, match="chi2"):
        _assert_matches(counts, _reference_probs(logits.numpy(), SamplingParams(temperature=0.7)))


def test_top_k_restricts_support_to_k_largest() -> None:
    logits = _logits(12, 3)
    params = SamplingParams(top_k=4, temperature=1.5)
    counts = _draw(Sampler(CPU, seed=1), logits, SamplingRow(params), 20000)
    top4 = set(torch.topk(logits, 4).indices.tolist())
    assert set(np.nonzero(counts)[0].tolist()) == top4
    _assert_matches(counts, _reference_probs(logits.numpy(), params))


def test_top_p_restricts_support_to_nucleus() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5, -2.0, 0.2])
    params = SamplingParams(top_p=0.7)
    probs = torch.softmax(logits.double(), 0)
    order = torch.argsort(probs, descending=True)
    cum = torch.cumsum(probs[order], 0)
    nucleus = set(order[: int((cum < 0.7).sum()) + 1].tolist())
    assert all(abs(float(c) - 0.7) > 0.02 for c in cum), "test design: p must not sit on a boundary"
    counts = _draw(Sampler(CPU, seed=2), logits, SamplingRow(params), 20000)
    assert set(np.nonzero(counts)[0].tolist()) == nucleus
    _assert_matches(counts, _reference_probs(logits.numpy(), params))


def test_min_p_restricts_support() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5, -2.0, 0.2])
    params = SamplingParams(min_p=0.25)
    probs = torch.softmax(logits.double(), 0)
    ratio = probs / probs.max()
    assert bool(((ratio - 0.25).abs() > 0.02).all()), "test design: min_p must not sit on a boundary"
    allowed = set(torch.nonzero(ratio >= 0.25).flatten().tolist())
    counts = _draw(Sampler(CPU, seed=3), logits, SamplingRow(params), 20000)
    assert set(np.nonzero(counts)[0].tolist()) == allowed
    _assert_matches(counts, _reference_probs(logits.numpy(), params))


def test_combined_truncation_matches_reference() -> None:
    logits = _logits(16, 21, scale=1.5)
    params = SamplingParams(temperature=0.8, top_k=9, top_p=0.9, min_p=0.05)
    counts = _draw(Sampler(CPU, seed=4), logits, SamplingRow(params), 30000)
    _assert_matches(counts, _reference_probs(logits.numpy(), params))


def test_banned_tokens_never_drawn() -> None:
    logits = torch.tensor([3.0, 0.0, 2.5, 0.5, 1.0, 2.9])  # bans hit the most likely tokens
    params = SamplingParams(temperature=1.0)
    banned = [0, 5]
    counts = _draw(Sampler(CPU, seed=5), logits, SamplingRow(params, None, banned), 20000)
    _assert_matches(counts, _reference_probs(logits.numpy(), params, banned))


# ----------------------------------------------------------------------------------------------------------------
# Logprobs


def test_logprobs_are_raw_log_softmax_with_sorted_top_n() -> None:
    v = 50
    logits = torch.randn(5, v, generator=torch.Generator().manual_seed(8)) * 3
    rows = [
        _row(seed=1, logprobs=5, temperature=0.5, top_k=3, banned=[int(logits[0].argmax())]),
        _row(temperature=0.0),  # does not ask
        _row(temperature=0.0, logprobs=0),
        _row(seed=2, logprobs=v + 10, top_p=0.5),
        _row(logprobs=1, min_p=0.2),
    ]
    out = Sampler(CPU)(logits, rows)
    ref = torch.log_softmax(logits.double(), dim=1)
    assert out.logprobs is not None and out.top_logprobs is not None and out.ranks is not None
    assert math.isnan(out.logprobs[1]) and out.top_logprobs[1] == [] and out.ranks[1] is None
    for i in (0, 2, 3, 4):
        tok = out.token_ids[i]
        assert out.logprobs[i] == pytest.approx(float(ref[i, tok]), abs=1e-5)
        assert out.ranks[i] == 1 + int((ref[i] > ref[i, tok]).sum())
        n = min(rows[i].params.logprobs or 0, v)
        top = out.top_logprobs[i]
        assert len(top) == n
        assert [t for t, _ in top] == torch.argsort(ref[i], descending=True)[:n].tolist()
        values = [lp for _, lp in top]
        assert values == sorted(values, reverse=True)
        for t, lp in top:
            assert lp == pytest.approx(float(ref[i, t]), abs=1e-5)
    assert out.ranks[2] == 1 and out.top_logprobs[2] == []
    rank0 = out.ranks[0]
    assert rank0 is not None and rank0 > 1, "the banned argmax still outranks the sampled token (raw logprobs)"


def test_no_logprobs_when_nobody_asks() -> None:
    out = Sampler(CPU)(torch.randn(3, 20), [_row(), _row(temperature=0.0), _row(seed=1, top_p=0.5)])
    assert out.logprobs is None and out.top_logprobs is None and out.ranks is None


# ----------------------------------------------------------------------------------------------------------------
# Properties


@st.composite
def _cases(draw: st.DrawFn) -> tuple[torch.Tensor, SamplingRow]:
    v = draw(st.integers(2, 40))
    # Logits on a quarter grid: exact in float32, with plenty of ties, so truncation sets are well defined.
    values = draw(st.lists(st.integers(-80, 80), min_size=v, max_size=v))
    logits = torch.tensor(values, dtype=torch.float32) / 4
    params = SamplingParams(
        temperature=draw(st.sampled_from([0.0, 0.05, 0.5, 1.0, 3.0])),
        top_k=draw(st.integers(-1, v + 3)),
        top_p=draw(st.sampled_from([0.01, 0.3, 0.5, 0.9, 0.99, 1.0])),
        min_p=draw(st.sampled_from([0.0, 0.01, 0.2, 0.5, 1.0])),
    )
    banned = draw(st.lists(st.integers(0, v - 1), max_size=v, unique=True))
    seed = draw(st.none() | st.integers(-(1 << 63), 1 << 64))
    return logits, SamplingRow(params, seed, banned)


def _allowed(logits: torch.Tensor, row: SamplingRow, tol: float = 1e-4) -> np.ndarray:
    """Tokens the sampler may draw, with a float tolerance at the top-p and min-p boundaries."""
    p = row.params
    x = logits.double().numpy().copy()
    x[row.banned_token_ids] = -np.inf
    if p.is_greedy:
        allowed = np.zeros(x.size, dtype=bool)
        allowed[int(np.argmax(x))] = True
        return allowed
    x = (x - x.max()) / p.temperature
    allowed = np.isfinite(x)
    if 0 < p.top_k < x.size:
        allowed &= x >= np.sort(x)[::-1][p.top_k - 1]
    probs = np.where(allowed, np.exp(x), 0.0)
    probs /= probs.sum()
    if p.top_p < 1.0:
        # Token t survives if the mass strictly above it (its best position among ties) is below p.
        mass_above = np.array([probs[probs > probs[t]].sum() for t in range(x.size)])
        allowed &= mass_above < p.top_p + tol
    if p.min_p > 0.0:
        allowed &= np.exp(x) >= p.min_p * (1 - tol)
    return np.asarray(allowed)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_cases())
def test_sampled_token_is_always_inside_the_allowed_support(case: tuple[torch.Tensor, SamplingRow]) -> None:
    logits, row = case
    out = Sampler(CPU, seed=0)(logits.unsqueeze(0), [row])
    if len(row.banned_token_ids) == logits.numel():
        assert out.error_rows == [0] and out.token_ids == [ERROR_TOKEN_ID]
        return
    assert out.error_rows == []
    token = out.token_ids[0]
    assert token not in row.banned_token_ids
    assert _allowed(logits, row)[token], (token, logits.tolist(), row)


@settings(max_examples=60, deadline=None)
@given(_cases(), st.integers(0, 5), st.integers(0, 1 << 30))
def test_row_result_does_not_depend_on_position(
    case: tuple[torch.Tensor, SamplingRow], pos: int, data_seed: int
) -> None:
    logits, row = case
    if row.seed is None and not row.params.is_greedy:
        row = SamplingRow(row.params, data_seed, row.banned_token_ids)
    v = logits.numel()
    rng = random.Random(data_seed)
    mates = [_random_mate(rng, v) for _ in range(5)]
    mate_logits = torch.randn(5, v, generator=torch.Generator().manual_seed(data_seed))
    batch = torch.cat([mate_logits[:pos], logits.unsqueeze(0), mate_logits[pos:]])
    rows = [*mates[:pos], row, *mates[pos:]]
    alone = Sampler(CPU)(logits.unsqueeze(0), [row]).token_ids[0]
    assert Sampler(CPU, seed=data_seed)(batch, rows).token_ids[pos] == alone

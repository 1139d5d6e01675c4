"""The rejection sampler (speculative decoding's acceptance step), CPU.

Greedy rows are checked against token-by-token greedy decoding of a toy "model" (a deterministic function of the
context). Sampled rows are checked statistically: with fixed seeds the checks are deterministic, and their bounds
are far-tail chi-square quantiles, so a sampler emitting the wrong distribution fails them (shown by deliberately
broken variants that must fail the same check).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hyserve.layers.sampler import Sampler, SamplingRow
from hyserve.sampling_params import SamplingParams
from hyserve.worker.spec_decode.rejection_sampler import RejectionSampler, SpecOutput, SpecRow, process_logits

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0)


# ----------------------------------------------------------------------------------------------------------------
# Helpers


def _ref_probs(logits: np.ndarray, params: SamplingParams, banned: Sequence[int] = ()) -> np.ndarray:
    """The processed target distribution in float64 (independent of the code under test)."""
    x = logits.astype(np.float64).copy()
    x[list(banned)] = -np.inf
    x = (x - x.max()) / params.temperature
    if 0 < params.top_k < x.size:
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


def _chi2_upper_bound(df: int, z: float = 5.0) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile at a z-score of ``z`` (~3e-7 tail for z=5)."""
    a = 2.0 / (9.0 * df)
    return float(df * (1.0 - a + z * np.sqrt(a)) ** 3)


def _chi2(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """(statistic, degrees of freedom) of a goodness-of-fit test; asserts nothing is drawn outside the support."""
    support = probs > 0
    assert counts[~support].sum() == 0, f"drew outside the support: counts={counts} probs={probs.round(3)}"
    if support.sum() == 1:
        return 0.0, 0  # a certain token: nothing to test beyond the support
    expected = counts.sum() * probs[support]
    observed = counts[support].astype(np.float64)
    # Pool the least likely bins into one until it expects >= 20 draws (the chi-square approximation's need).
    order = np.argsort(expected)
    n_pool = int(np.searchsorted(np.cumsum(expected[order]), 20.0)) + 1 if expected.min() < 20 else 0
    if n_pool:
        pooled, kept = order[:n_pool], order[n_pool:]
        expected = np.append(expected[kept], expected[pooled].sum())
        observed = np.append(observed[kept], observed[pooled].sum())
    assert expected.size >= 2 and expected.min() >= 20, f"test design: too few draws ({expected.round(1)})"
    return float(((observed - expected) ** 2 / expected).sum()), expected.size - 1


def _assert_chi2(parts: list[tuple[float, int]], what: str) -> None:
    stat, df = sum(s for s, _ in parts), sum(d for _, d in parts)
    assert df > 0
    assert stat < _chi2_upper_bound(df), f"{what}: chi2={stat:.1f} (df={df}, bound {_chi2_upper_bound(df):.1f})"


def _run(
    sampler: RejectionSampler,
    logits_per_row: Sequence[torch.Tensor],
    rows: list[SpecRow],
    draft_probs: Any = None,
) -> SpecOutput:
    return sampler(torch.cat(list(logits_per_row)), rows, draft_probs)


# ----------------------------------------------------------------------------------------------------------------
# Greedy


class _ToyModel:
    """Deterministic logits for any context: small integers, so that ties are frequent."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.vocab, self.seed = vocab, seed

    def logits(self, ctx: Sequence[int]) -> torch.Tensor:
        h = hash((self.seed, *ctx)) & 0xFFFF_FFFF
        return torch.randint(0, 4, (self.vocab,), generator=torch.Generator().manual_seed(h)).float()


def _greedy_decode(model: _ToyModel, ctx: list[int], n: int, bans: Sequence[Sequence[int]]) -> list[int]:
    out: list[int] = []
    for i in range(n):
        x = model.logits(ctx + out).numpy().copy()
        x[list(bans[i])] = -np.inf
        out.append(int(np.argmax(x)))  # first maximum = lowest id
    return out


def test_greedy_matches_token_by_token_decode_for_every_acceptance_length() -> None:
    vocab = 8
    model = _ToyModel(vocab, seed=3)
    rng = random.Random(0)
    rows: list[SpecRow] = []
    logits: list[torch.Tensor] = []
    expected: list[tuple[int, list[int]]] = []
    cases = [(k, a) for k in range(6) for a in range(k + 1)] * 3  # every acceptance length for every k
    rng.shuffle(cases)
    for i, (k, a) in enumerate(cases):
        ctx = [rng.randrange(vocab) for _ in range(rng.randrange(1, 4))]
        bans = [[rng.randrange(vocab)] if i % 3 == 0 and rng.random() < 0.5 else [] for _ in range(k + 1)]
        greedy = _greedy_decode(model, ctx, k + 1, bans)
        drafts = greedy[:a]
        if a < k:
            drafts.append((greedy[a] + rng.randrange(1, vocab)) % vocab)  # the planted mismatch
            drafts += [rng.randrange(vocab) for _ in range(k - a - 1)]
        rows.append(SpecRow(GREEDY, drafts, None, bans if i % 3 == 0 else None))
        logits.append(torch.stack([model.logits(ctx + drafts[:j]) for j in range(k + 1)]))
        expected.append((a, greedy[: a + 1]))
    out = _run(RejectionSampler(CPU), logits, rows)
    assert out.error_rows == [] and out.logprobs is None
    assert out.num_accepted == [a for a, _ in expected]
    assert out.token_ids == [t for _, t in expected]


def test_greedy_ties_go_to_lowest_id_and_bans_apply() -> None:
    tie = torch.tensor([0.0, 1.0, 3.0, 0.0, 3.0, 3.0])  # argmax 2 (tied with 4 and 5)
    after = torch.tensor([5.0, 0.0, 0.0, 0.0, 0.0, 5.0])  # argmax 0 (tied with 5)
    sampler = RejectionSampler(CPU)
    two = torch.stack([tie, after])
    assert _run(sampler, [two], [SpecRow(GREEDY, [4])]).token_ids == [[2]]
    assert _run(sampler, [two], [SpecRow(GREEDY, [2])]).token_ids == [[2, 0]]
    # Bans per position: 2 banned at position 0 makes 4 the argmax; 0 banned at position 1 makes it 5.
    banned = SpecRow(GREEDY, [4], None, [[2], [0]])
    assert _run(sampler, [two], [banned]).token_ids == [[4, 5]]
    assert _run(sampler, [two], [SpecRow(GREEDY, [2], None, [[2], []])]).token_ids == [[4]]


def test_greedy_and_no_draft_rows_match_the_sampler() -> None:
    logits = torch.randn(40, 50, generator=torch.Generator().manual_seed(0)) * 3
    params = [
        GREEDY,
        SamplingParams(temperature=0.8),
        SamplingParams(top_k=5),
        SamplingParams(top_p=0.7, min_p=0.05),
        SamplingParams(temperature=1.4, top_k=20, top_p=0.9),
    ]
    for i in range(logits.shape[0]):
        p = params[i % len(params)]
        ref = Sampler(CPU)(logits[i : i + 1], [SamplingRow(p, seed=1000 + i, banned_token_ids=[i % 7])])
        out = RejectionSampler(CPU, seed=99)(logits[i : i + 1], [SpecRow(p, [], [1000 + i], [[i % 7]])])
        assert out.token_ids == [[ref.token_ids[0]]] and out.num_accepted == [0]


def test_all_greedy_batch_does_not_sort_or_draw(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("an all-greedy batch must not sort or draw")

    for name in ("sort", "topk", "exponential_", "uniform_", "softmax"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    for name in ("sort", "topk", "softmax"):
        monkeypatch.setattr(torch, name, forbidden)
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    rows = [SpecRow(GREEDY, [1, 0]), SpecRow(GREEDY, [])]
    out = RejectionSampler(CPU)(logits, rows)
    assert out.token_ids == [[1, 0, 2], [0]] and out.num_accepted == [2, 0]


# ----------------------------------------------------------------------------------------------------------------
# Distributions


V = 6


def _sample_from(probs: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` draws from each row's distribution (``probs`` is (V,) or (n, V))."""
    cdf = np.cumsum(np.broadcast_to(probs, (n, probs.shape[-1])), axis=1)
    return np.minimum((rng.random((n, 1)) * cdf[:, -1:] >= cdf).sum(axis=1), probs.shape[-1] - 1)


class _Scenario:
    """A two-step target and proposal over a small vocabulary, with two drafts per row.

    Position 0's target logits are ``L0``; position 1's depend on the first draft (``L1[x0]``), position 2's on
    both (``L2[x0, x1]``). Drafts are sampled from ``q0`` then ``q1[x0]`` (or, for a deterministic proposer,
    picked by a fixed rule).
    """

    def __init__(self, seed: int, params: SamplingParams, banned0: Sequence[int] = ()) -> None:
        g = np.random.default_rng(seed)
        self.params, self.banned0 = params, list(banned0)
        self.l0 = g.normal(size=V) * 1.2
        self.l1 = g.normal(size=(V, V)) * 1.2
        self.l2 = g.normal(size=(V, V, V))
        self.q0 = np.exp(g.normal(size=V))
        self.q0[V - 1] = 0.0  # the proposal never proposes the last token: only the residual can emit it
        self.q0 /= self.q0.sum()
        self.q1 = np.exp(g.normal(size=(V, V)))
        self.q1 /= self.q1.sum(axis=1, keepdims=True)

    def p0(self) -> np.ndarray:
        return _ref_probs(self.l0, self.params, self.banned0)

    def p1(self, t0: int) -> np.ndarray:
        return _ref_probs(self.l1[t0], self.params)

    def run(self, sampler: RejectionSampler, n: int, *, proposal: bool, seeded: bool, rng_seed: int = 0) -> SpecOutput:
        g = np.random.default_rng(rng_seed)
        if proposal:
            x0 = _sample_from(self.q0, n, g)
            x1 = _sample_from(self.q1[x0], n, g)
        else:  # a deterministic proposer: the drafts are a function of the context
            x0 = np.full(n, int(np.argmax(self.l0)))
            x1 = (x0 * 5 + 1) % V
        logits = np.stack([self.l0[None].repeat(n, 0), self.l1[x0], self.l2[x0, x1]], axis=1)  # (n, 3, V)
        seeds = g.integers(0, 1 << 62, size=(n, 3)).tolist() if seeded else [None] * n
        bans = [self.banned0, [], []] if self.banned0 else None
        rows = [SpecRow(self.params, [int(a), int(b)], seeds[i], bans) for i, (a, b) in enumerate(zip(x0, x1))]
        draft_probs = None
        if proposal:
            draft_probs = torch.from_numpy(np.stack([self.q0[None].repeat(n, 0), self.q1[x0]], axis=1)).float()
            draft_probs = draft_probs.reshape(2 * n, V)
        out = sampler(torch.from_numpy(logits).float().reshape(3 * n, V), rows, draft_probs)
        assert out.error_rows == []
        return out

    def check(self, out: SpecOutput) -> None:
        """First emitted token ~ p0; second token ~ p1(. | t0) among rows that accepted their first draft."""
        t0 = np.array([t[0] for t in out.token_ids])
        _assert_chi2([_chi2(np.bincount(t0, minlength=V), self.p0())], "first token")
        t1 = np.array([t[1] if len(t) > 1 else -1 for t in out.token_ids])
        parts = []
        for v in range(V):
            sel = t1[(t0 == v) & (t1 >= 0)]
            if sel.size >= 800:
                parts.append(_chi2(np.bincount(sel, minlength=V), self.p1(v)))
        assert parts, "test design: too few rows accepted their first draft"
        _assert_chi2(parts, "second token given the first")


# name -> (scenario seed, params, tokens banned at position 0)
SCENARIOS: dict[str, tuple[int, SamplingParams, list[int]]] = {
    "plain": (0, SamplingParams(temperature=1.0), []),
    "temperature": (1, SamplingParams(temperature=0.6), []),
    "hot_min_p": (2, SamplingParams(temperature=1.7, min_p=0.1), []),
    "top_k_top_p": (11, SamplingParams(top_k=4, top_p=0.85), []),  # supports of 3 or 4 tokens
    "banned": (4, SamplingParams(temperature=1.0), [0, 3]),
}


@pytest.mark.parametrize("proposal", [True, False], ids=["sampled_draft", "deterministic_draft"])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_emitted_tokens_follow_the_target_distribution(name: str, proposal: bool) -> None:
    seed, params, banned = SCENARIOS[name]
    scenario = _Scenario(seed=seed, params=params, banned0=banned)
    if name == "top_k_top_p":
        assert (scenario.p0() > 0).sum() < V, "test design: truncation must restrict the support"
    out = scenario.run(RejectionSampler(CPU, seed=1), 30000, proposal=proposal, seeded=False)
    scenario.check(out)
    accepted = np.array(out.num_accepted)
    assert 0 < (accepted == 0).sum() and 0 < (accepted == 2).sum(), "test design: exercise every walk length"


def test_seeded_draws_follow_the_target_distribution() -> None:
    scenario = _Scenario(seed=7, params=SamplingParams(temperature=0.9, top_k=5))
    scenario.check(scenario.run(RejectionSampler(CPU), 20000, proposal=True, seeded=True, rng_seed=3))


class _AcceptWithP(RejectionSampler):
    """Broken: accepts with probability p(x) instead of min(1, p(x)/q(x))."""

    @staticmethod
    def _accept(u: torch.Tensor, p_draft: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
        return u < p_draft


class _CorrectFromP(RejectionSampler):
    """Broken: draws the correction from p instead of the residual max(0, p - q)."""

    @staticmethod
    def _residual_logits(
        x: torch.Tensor,
        p: torch.Tensor,
        onehot_local: list[int],
        onehot_tok: list[int],
        q_local: list[int],
        q: torch.Tensor | None,
    ) -> torch.Tensor:
        return x.clone()


@pytest.mark.parametrize(
    ("broken", "proposal"),
    [(_AcceptWithP, True), (_CorrectFromP, True), (_CorrectFromP, False)],
    ids=["accept_with_p", "correct_from_p", "correct_from_p_deterministic"],
)
def test_broken_variants_fail_the_check(broken: Callable[..., RejectionSampler], proposal: bool) -> None:
    scenario = _Scenario(seed=0, params=SamplingParams(temperature=1.0))
    scenario.check(scenario.run(RejectionSampler(CPU, seed=1), 30000, proposal=proposal, seeded=False))
    with pytest.raises(AssertionError, match="chi2"):
        scenario.check(scenario.run(broken(CPU, seed=1), 30000, proposal=proposal, seeded=False))


def _penalized(logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
    """Frequency 0.9, presence 0.4 and repetition 1.7 over ``history`` (all output tokens here), float64."""
    x = logits.astype(np.float64).copy()
    for t in set(history):
        x[t] = x[t] / 1.7 if x[t] > 0 else x[t] * 1.7
        x[t] -= 0.9 * list(history).count(t) + 0.4
    return x


class _PenalizedScenario(_Scenario):
    """``_Scenario`` with penalties over the output so far: position j's target is penalized by the tokens before
    it (an earlier output token, then the drafts before j), as plain decoding would have penalized them."""

    HISTORY: tuple[int, ...] = (2,)

    def p0(self) -> np.ndarray:
        return _ref_probs(_penalized(self.l0, self.HISTORY), self.params, self.banned0)

    def p1(self, t0: int) -> np.ndarray:
        return _ref_probs(_penalized(self.l1[t0], [*self.HISTORY, t0]), self.params)

    def run(self, sampler: RejectionSampler, n: int, *, proposal: bool, seeded: bool, rng_seed: int = 0,
            ignore_adjusted: bool = False) -> SpecOutput:
        launch = sampler.launch

        def with_adjusted(target: torch.Tensor, rows: list[SpecRow], draft_probs: Any = None,
                          draft_ids: Any = None, adjusted: Any = None) -> Any:
            raw = target.view(len(rows), 3, V).double().numpy()
            adj = np.stack([np.stack([_penalized(raw[i, 0], self.HISTORY),
                                      _penalized(raw[i, 1], [*self.HISTORY, r.draft_token_ids[0]]),
                                      _penalized(raw[i, 2], [*self.HISTORY, *r.draft_token_ids])])
                            for i, r in enumerate(rows)])
            adjusted = None if ignore_adjusted else torch.from_numpy(adj).float().view(3 * len(rows), V)
            return launch(target, rows, draft_probs, draft_ids, adjusted=adjusted)

        sampler.launch = with_adjusted  # type: ignore[method-assign]
        return super().run(sampler, n, proposal=proposal, seeded=seeded, rng_seed=rng_seed)


@pytest.mark.parametrize("proposal", [True, False], ids=["sampled_draft", "deterministic_draft"])
def test_penalized_rows_follow_the_penalized_distribution(proposal: bool) -> None:
    """Seeded rows whose target is adjusted (penalties over the tokens before each position): the emitted tokens
    follow the adjusted distribution, and judging by the raw logits instead fails the same check."""
    scenario = _PenalizedScenario(seed=5, params=SamplingParams(temperature=0.9))
    assert np.abs(scenario.p0() - _ref_probs(scenario.l0, scenario.params)).max() > 0.05, "test design"
    scenario.check(scenario.run(RejectionSampler(CPU), 20000, proposal=proposal, seeded=True, rng_seed=4))
    with pytest.raises(AssertionError, match="chi2"):
        scenario.check(scenario.run(RejectionSampler(CPU), 20000, proposal=proposal, seeded=True, rng_seed=4,
                                    ignore_adjusted=True))


def test_adjusted_logits_leave_errors_and_logprobs_raw() -> None:
    """An adjusted row masks a NaN of the raw logits: the row is still an error; logprobs are the raw ones."""
    raw = torch.randn(3, V)
    raw[0, 3] = math.nan
    adjusted = raw.clone()
    adjusted[:, 3] = -math.inf
    adjusted[1:, 0] += 50.0
    rows = [SpecRow(GREEDY, []), SpecRow(SamplingParams(temperature=0.0, logprobs=1), [0])]
    out = RejectionSampler(CPU).launch(raw, rows, adjusted=adjusted).result()
    assert out.error_rows == [0] and out.token_ids[1] == [0, 0]
    assert out.logprobs is not None
    assert out.logprobs[1][0] == pytest.approx(float(torch.log_softmax(raw[1], 0)[0]), abs=1e-6)
    # The Sampler alike.
    plain = Sampler(CPU)(raw[:2], [SamplingRow(GREEDY), SamplingRow(SamplingParams(temperature=0.0, logprobs=1))],
                         adjusted=adjusted[:2].clone())
    assert plain.error_rows == [0] and plain.token_ids[1] == 0
    assert plain.logprobs is not None
    assert plain.logprobs[1] == pytest.approx(float(torch.log_softmax(raw[1], 0)[0]), abs=1e-6)


def test_draft_outside_the_truncated_support_is_always_rejected() -> None:
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    params = SamplingParams(top_k=2)
    n = 2000
    rows = [SpecRow(params, [4])] * n
    out = RejectionSampler(CPU)(torch.stack([logits, logits]).repeat(n, 1), rows)
    assert set(out.num_accepted) == {0}
    assert {t[0] for t in out.token_ids} == {0, 1}
    q = torch.full((n, 5), 0.2)  # a proposal that does give the draft mass
    out = RejectionSampler(CPU)(torch.stack([logits, logits]).repeat(n, 1), rows, q)
    assert set(out.num_accepted) == {0} and {t[0] for t in out.token_ids} == {0, 1}


def test_empty_residual_falls_back_to_the_target() -> None:
    """A proposal >= p everywhere (here unnormalized) can reject with nothing left in max(0, p - q)."""
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.5]] * 2)
    n = 2000
    rows = [SpecRow(SamplingParams(), [2], None, [[0], [0]])] * n
    q = torch.ones(n, 4)  # q(2) = 1 > p(2): rejections happen, and p - q <= 0 everywhere
    out = RejectionSampler(CPU)(logits.repeat(n, 1), rows, q)
    assert 0 < sum(out.num_accepted) < n
    assert all(t[0] in (1, 2, 3) for t in out.token_ids)


def test_identical_proposal_always_accepts() -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(4))
    params = SamplingParams(temperature=0.8, top_p=0.9)
    x = logits.clone()
    p = torch.softmax(process_logits(x, x.amax(dim=1), [params] * 3), dim=1)
    rows = [SpecRow(params, [int(torch.multinomial(p[0], 1)), int(torch.multinomial(p[1], 1))]) for _ in range(500)]
    out = RejectionSampler(CPU)(logits.repeat(500, 1), rows, p[:2].repeat(500, 1))
    assert set(out.num_accepted) == {2}


# ----------------------------------------------------------------------------------------------------------------
# Determinism


def _random_row(rng: random.Random, vocab: int, seeded: bool) -> tuple[SpecRow, torch.Tensor, torch.Tensor | None]:
    k = rng.randrange(0, 5)
    kind = rng.randrange(4)
    params = [
        GREEDY,
        SamplingParams(temperature=rng.uniform(0.3, 2.0)),
        SamplingParams(top_k=rng.randrange(1, 10), top_p=rng.uniform(0.3, 1.0)),
        SamplingParams(min_p=0.05, logprobs=2),
    ][kind]
    seeds: list[int | None] | None = [rng.randrange(1 << 62) for _ in range(k + 1)] if seeded else None
    logits = torch.randn(k + 1, vocab, generator=torch.Generator().manual_seed(rng.randrange(1 << 30))) * 2
    drafts = [rng.randrange(vocab) if rng.random() < 0.5 else int(logits[j].argmax()) for j in range(k)]
    q = None
    if rng.random() < 0.5:
        q = torch.softmax(torch.randn(k, vocab, generator=torch.Generator().manual_seed(rng.randrange(1 << 30))), 1)
    return SpecRow(params, drafts, seeds), logits, q


def test_seeded_rows_are_reproducible_and_independent_of_the_batch() -> None:
    vocab = 40
    rng = random.Random(5)
    for trial in range(20):
        target, target_logits, target_q = _random_row(rng, vocab, seeded=True)
        alone = RejectionSampler(CPU, seed=0)(target_logits, [target], [target_q])
        mates = [_random_row(rng, vocab, seeded=rng.random() < 0.5) for _ in range(rng.randrange(1, 8))]
        pos = rng.randrange(len(mates) + 1)
        batch = [*mates[:pos], (target, target_logits, target_q), *mates[pos:]]
        out = RejectionSampler(CPU, seed=trial + 1)(
            torch.cat([b[1] for b in batch]), [b[0] for b in batch], [b[2] for b in batch]
        )
        assert out.token_ids[pos] == alone.token_ids[0] and out.num_accepted[pos] == alone.num_accepted[0]
        if alone.logprobs is not None:
            assert out.logprobs is not None and out.logprobs[pos] == pytest.approx(alone.logprobs[0])


def test_seeded_rows_differ_across_seeds_and_unseeded_rows_use_the_generator() -> None:
    vocab = 200
    logits = torch.zeros(3, vocab)  # uniform target: acceptance prob 1/V per one-hot draft, corrections spread
    params = SamplingParams()
    seeded = [RejectionSampler(CPU, seed=s)(logits, [SpecRow(params, [0, 1], [s, s + 1, s + 2])]) for s in range(50)]
    again = [RejectionSampler(CPU, seed=0)(logits, [SpecRow(params, [0, 1], [s, s + 1, s + 2])]) for s in range(50)]
    assert [o.token_ids for o in seeded] == [o.token_ids for o in again]
    assert len({tuple(o.token_ids[0]) for o in seeded}) > 40

    rows = [SpecRow(params, [0, 1])] * 30
    a, b = RejectionSampler(CPU, seed=5), RejectionSampler(CPU, seed=5)
    first, second = a(logits.repeat(30, 1), rows).token_ids, a(logits.repeat(30, 1), rows).token_ids
    assert first != second, "the generator advances between calls"
    assert b(logits.repeat(30, 1), rows).token_ids == first and b(logits.repeat(30, 1), rows).token_ids == second
    assert RejectionSampler(CPU, seed=6)(logits.repeat(30, 1), rows).token_ids != first


# ----------------------------------------------------------------------------------------------------------------
# Errors, bans, logprobs, validation


def test_non_finite_rows_are_errors_and_other_rows_are_unaffected() -> None:
    vocab = 10
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(k + 1, vocab, generator=gen) for k in (2, 2, 2, 2, 1, 1, 2, 0)]
    greedy_of = [b.argmax(dim=1).tolist() for b in base]
    sampled = SamplingParams(temperature=1.0)
    rows = [
        SpecRow(sampled, [1, 2], [1, 2, 3]),  # 0: fine
        SpecRow(GREEDY, [greedy_of[1][0], 0]),  # 1: NaN at position 0 -> error
        SpecRow(GREEDY, greedy_of[2][:2]),  # 2: +inf at position 1, reached -> error
        SpecRow(GREEDY, [(greedy_of[3][0] + 1) % vocab, 0]),  # 3: NaN at position 2, never reached -> fine
        SpecRow(GREEDY, [0], None, [[*range(vocab)], []]),  # 4: nothing left after the bans -> error
        SpecRow(GREEDY, [0], None, [[3], []]),  # 5: NaN on a banned entry -> error
        SpecRow(sampled, [4, 5], [7, 8, 9]),  # 6: NaN at position 0 of a sampled row -> error
        SpecRow(sampled, [], [11]),  # 7: fine
    ]
    bad = [b.clone() for b in base]
    bad[1][0, 4] = math.nan
    bad[2][1, 0] = math.inf
    bad[3][2, :] = math.nan
    bad[5][0, 3] = math.nan
    bad[6][0, 1] = math.nan
    out = RejectionSampler(CPU)(torch.cat(bad), rows)
    assert out.error_rows == [1, 2, 4, 5, 6]
    for r in out.error_rows:
        assert out.token_ids[r] == [] and out.num_accepted[r] == 0
    for r in (0, 3, 7):
        assert out.token_ids[r] == RejectionSampler(CPU)(bad[r], [rows[r]]).token_ids[0]
    assert out.token_ids[3] == [greedy_of[3][0]]


@pytest.mark.parametrize("proposal", [True, False])
def test_banned_tokens_are_never_emitted(proposal: bool) -> None:
    n, k = 3000, 3
    logits = torch.tensor([[3.0, 0.0, 2.5, 0.5, 1.0, 2.9]]).repeat(k + 1, 1)
    bans = [[0, 5], [2], [0, 2, 5], [5]]
    params = SamplingParams(temperature=1.0)
    rows = [SpecRow(params, [0, 2, 5], None, bans)] * n  # every draft is banned where it is proposed
    q = torch.full((n * k, V), 1.0 / V) if proposal else None
    out = RejectionSampler(CPU)(logits.repeat(n, 1), rows, q)
    assert out.error_rows == [] and set(out.num_accepted) == {0}
    out = RejectionSampler(CPU)(logits.repeat(n, 1), [SpecRow(params, [2, 0, 4], None, bans)] * n, q)
    assert max(out.num_accepted) == k
    for toks in out.token_ids:
        assert all(t not in bans[j] for j, t in enumerate(toks))


def test_logprobs_are_raw_log_softmax_of_each_emitted_position() -> None:
    vocab = 30
    gen = torch.Generator().manual_seed(2)
    logits = [torch.randn(k + 1, vocab, generator=gen) * 2 for k in (3, 2, 1)]
    rows = [
        SpecRow(SamplingParams(temperature=0.0, logprobs=3), [*logits[0][:2].argmax(dim=1).tolist(), 0]),
        SpecRow(SamplingParams(), [1, 2]),  # does not ask
        SpecRow(SamplingParams(temperature=0.7, logprobs=0), [5], [1, 2]),
    ]
    out = RejectionSampler(CPU)(torch.cat(logits), rows)
    assert out.logprobs is not None and out.top_logprobs is not None and out.ranks is not None
    assert out.logprobs[1] == [] and out.top_logprobs[1] == [] and out.ranks[1] == []
    for r in (0, 2):
        lp = torch.log_softmax(logits[r], dim=1)
        toks = out.token_ids[r]
        assert len(out.logprobs[r]) == len(toks) == len(out.ranks[r]) == len(out.top_logprobs[r])
        for j, t in enumerate(toks):
            assert out.logprobs[r][j] == pytest.approx(float(lp[j, t]), abs=1e-6)
            assert out.ranks[r][j] == 1 + int((lp[j] > lp[j, t]).sum())
            n_top = rows[r].params.logprobs or 0
            top = torch.topk(lp[j], n_top) if n_top else None
            assert [i for i, _ in out.top_logprobs[r][j]] == ([] if top is None else top.indices.tolist())
    assert out.ranks[0] == [1] * len(out.token_ids[0])  # greedy tokens are the argmax
    assert RejectionSampler(CPU)(logits[1], [rows[1]]).logprobs is None


def test_input_not_modified_and_validation() -> None:
    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    row = SpecRow(SamplingParams(top_p=0.5), [1, 2], [1, 2, 3], [[0], [1], [2]])
    RejectionSampler(CPU)(logits, [row])
    assert torch.equal(logits, before)
    assert RejectionSampler(CPU)(torch.empty(0, 8), []) == SpecOutput([], [], None, [])
    bad_calls: list[tuple[torch.Tensor, list[SpecRow], Any]] = [
        (logits[:2], [row], None),  # too few positions
        (logits, [SpecRow(GREEDY, [1, 8])], None),  # draft outside the vocabulary
        (logits, [SpecRow(GREEDY, [1, 2], [1, 2])], None),  # wrong number of seeds
        (logits, [SpecRow(GREEDY, [1, 2], None, [[0]])], None),  # wrong number of ban lists
        (logits, [SpecRow(GREEDY, [1, 2], None, [[0], [9], []])], None),  # ban outside the vocabulary
        (logits, [row], torch.ones(3, 8)),  # stacked proposals of the wrong shape
        (logits, [row], [torch.ones(2, 7)]),  # per-row proposal of the wrong shape
        (logits, [row], [None, None]),  # wrong number of proposals
    ]
    for call in bad_calls:
        with pytest.raises(ValueError):
            RejectionSampler(CPU)(*call)


@st.composite
def _cases(draw: st.DrawFn) -> tuple[torch.Tensor, list[SpecRow], list[torch.Tensor | None]]:
    vocab = draw(st.integers(2, 12))
    n_rows = draw(st.integers(1, 5))
    rows, logits, probs = [], [], []
    for _ in range(n_rows):
        k = draw(st.integers(0, 4))
        params = draw(
            st.sampled_from(
                [GREEDY, SamplingParams(), SamplingParams(top_k=2, temperature=0.5), SamplingParams(top_p=0.6)]
            )
        )
        drafts = draw(st.lists(st.integers(0, vocab - 1), min_size=k, max_size=k))
        bans = [draw(st.lists(st.integers(0, vocab - 1), max_size=vocab - 1)) for _ in range(k + 1)]
        seed = draw(st.integers(0, 1 << 40))
        gen = torch.Generator().manual_seed(seed)
        logits.append(torch.randn(k + 1, vocab, generator=gen).mul(3).round())  # frequent ties
        probs.append(torch.softmax(torch.randn(k, vocab, generator=gen), 1) if seed % 2 else None)
        rows.append(SpecRow(params, drafts, [seed + j for j in range(k + 1)], bans))
    return torch.cat(logits), rows, probs


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_cases())
def test_outputs_are_well_formed_and_inside_the_support(
    case: tuple[torch.Tensor, list[SpecRow], list[torch.Tensor | None]],
) -> None:
    logits, rows, probs = case
    out = RejectionSampler(CPU)(logits, rows, probs)
    assert out.error_rows == []
    start = 0
    for r, row in enumerate(rows):
        k, a, toks = len(row.draft_token_ids), out.num_accepted[r], out.token_ids[r]
        assert 0 <= a <= k and len(toks) == a + 1 and toks[:a] == row.draft_token_ids[:a]
        for j, t in enumerate(toks):
            x = logits[start + j : start + j + 1].clone()
            x[0, (row.banned_token_ids or [[]] * (k + 1))[j]] = -math.inf
            if row.params.is_greedy:
                assert t == int(x.argmax())
            else:  # the processed support (the processing itself is checked against a reference above)
                assert math.isfinite(float(process_logits(x, x.amax(dim=1), [row.params])[0, t]))
        start += k + 1


def test_device_drafts_give_what_host_drafts_give() -> None:
    """``draft_ids`` (the drafts as a device tensor, the rows' lists placeholders) gives exactly the host-list
    result: greedy, sampled, seeded and unseeded rows, with and without proposal distributions, logprobs; a
    tensor of the wrong length is refused."""
    vocab = 40
    rng = random.Random(11)
    accepted = 0
    for trial in range(20):
        batch = [_random_row(rng, vocab, seeded=rng.random() < 0.5) for _ in range(rng.randrange(1, 7))]
        logits = torch.cat([b[1] for b in batch])
        qs = [b[2] for b in batch]
        host = RejectionSampler(CPU, seed=trial)(logits, [b[0] for b in batch], qs)
        ids = torch.tensor([t for b in batch for t in b[0].draft_token_ids], dtype=torch.long)
        placeholders = [SpecRow(b[0].params, [-2] * len(b[0].draft_token_ids), b[0].seeds) for b in batch]
        dev = RejectionSampler(CPU, seed=trial)(logits, placeholders, qs, draft_ids=ids)
        assert dev.num_accepted == host.num_accepted and dev.token_ids == host.token_ids
        assert dev.error_rows == host.error_rows and dev.logprobs == host.logprobs
        accepted += sum(host.num_accepted)
    assert accepted > 20  # drafts were accepted, not only rejected
    row = SpecRow(GREEDY, [-2, -2])
    with pytest.raises(ValueError, match="draft_ids must have shape"):
        RejectionSampler(CPU)(torch.randn(3, vocab), [row], draft_ids=torch.tensor([1]))


# ------------------------------------------------------------------------------------------ one greedy decision


def python_greedy(logits: torch.Tensor, drafts: list[int]) -> tuple[int, list[int]]:
    """The greedy acceptance written out by hand, position by position: (count or -1, emitted tokens)."""
    out: list[int] = []
    for j in range(len(drafts) + 1):
        row = logits[j]
        if not bool(torch.isfinite(row.max())):
            return -1, [*out, 0]
        best = int(row.argmax())
        if j == len(drafts) or best != drafts[j]:
            return j, [*out, best]
        out.append(best)
    raise AssertionError("unreachable")


def both_paths(logits_rows: list[torch.Tensor], drafts: list[list[int]], k: int) -> tuple[list, list]:
    """The acceptance of the same greedy rows by ``launch`` (ragged rows) and by ``accept_greedy`` (the verify
    graph's fixed layout, k drafts a row with the unused columns past ``num_drafts``)."""
    sampler = RejectionSampler(CPU)
    pending = sampler.launch(torch.cat(logits_rows), [SpecRow(GREEDY, d) for d in drafts])
    res = pending.result()
    launched = [(-1, []) if r in res.error_rows else (a, list(toks))
                for r, (a, toks) in enumerate(zip(res.num_accepted, res.token_ids, strict=True))]
    vocab = logits_rows[0].shape[1]
    fixed = torch.cat([torch.cat([lg, torch.zeros(k + 1 - lg.shape[0], vocab)]) for lg in logits_rows])
    padded = torch.tensor([d + [7] * (k - len(d)) for d in drafts], dtype=torch.long)
    out = torch.zeros(len(drafts), k + 2, dtype=torch.long)
    accepted, emitted = sampler.accept_greedy(fixed, padded, torch.tensor([len(d) for d in drafts]), out)
    graphed = [(int(a), emitted[r, : int(a) + 1].tolist()) for r, a in enumerate(accepted.tolist())]
    return launched, graphed


@given(st.data())
@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
def test_launch_and_the_graphed_acceptance_decide_alike(data: st.DataObject) -> None:
    k = data.draw(st.integers(1, 4))
    n = data.draw(st.integers(1, 5))
    vocab = 6
    logits_rows, drafts = [], []
    for _ in range(n):
        c = data.draw(st.integers(0, k))
        lg = torch.tensor(data.draw(st.lists(st.lists(st.sampled_from([0.0, 1.0, 2.0]), min_size=vocab,
                                                      max_size=vocab), min_size=c + 1, max_size=c + 1)))
        if data.draw(st.booleans()) and data.draw(st.booleans()):
            lg[data.draw(st.integers(0, c)), 0] = float("nan")
        # Drafts mostly right (each the argmax with probability 3/4), so that rows accept every length.
        d = [int(lg[j].argmax()) if data.draw(st.integers(0, 3)) else data.draw(st.integers(0, vocab - 1))
             for j in range(c)]
        logits_rows.append(lg)
        drafts.append(d)
    launched, graphed = both_paths(logits_rows, drafts, k)
    want = [python_greedy(lg, d) for lg, d in zip(logits_rows, drafts, strict=True)]
    for r, (w, got_l, got_g) in enumerate(zip(want, launched, graphed, strict=True)):
        assert got_l[0] == w[0] and got_g[0] == w[0], (r, w, got_l, got_g)
        if w[0] >= 0:
            assert list(got_l[1]) == w[1] == got_g[1], (r, w, got_l, got_g)


def test_the_greedy_rule_has_one_home(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage of the one greedy rule (``greedy_accepts``) moves both paths away from the hand-written one."""
    from hyserve.worker.spec_decode import rejection_sampler

    logits = [torch.eye(6)[[1, 2, 3]] * 5, torch.eye(6)[[4, 0]] * 5]
    drafts = [[1, 2], [4]]
    assert both_paths(logits, drafts, 2) == ([(2, [1, 2, 3]), (1, [4, 0])], [(2, [1, 2, 3]), (1, [4, 0])])
    monkeypatch.setattr(rejection_sampler, "greedy_accepts", lambda t, d: t != d)
    launched, graphed = both_paths(logits, drafts, 2)
    assert launched[0][0] == graphed[0][0] == 0 and launched[1][0] == graphed[1][0] == 0

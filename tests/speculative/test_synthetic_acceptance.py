"""``speculative_config``'s ``rejection_sample_method: "synthetic"`` (vLLM's benchmarking method): each draft's verdict
is drawn, not judged by the target's logits, so that an engine is timed at a planted acceptance whatever its head.

* the config: ``synthetic_acceptance_rates`` (per position, the probability that drafts 1 .. i are all kept) or
  ``synthetic_acceptance_length`` (vLLM's schedule: full positions, one at the fraction left, none after), exactly
  one of them, checked as vLLM checks them; the fields without the method refused;
* the conditional rates by hand; the rejection sampler's walk at those rates, over many rows, in ``launch`` (greedy
  and sampled rows alike) and in the verify graph's ``accept_greedy``: each position's acceptance near its rate, the
  token after the kept drafts the target's greedy one;
* the engine: a random MTP head (whose drafts the target almost never keeps) reaches the planted acceptance length
  in process and with its worker in a process of its own (``--distributed-executor-backend mp``, where a patch of the
  engine's process would not reach); the greedy rule in its place (a sampler that ignores the method) is caught.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hyserve import SamplingParams
from hyserve.config import ModelConfig
from hyserve.speculative.config import SpeculativeConfig, conditional_rates
from hyserve.testing.engine import make_llm
from hyserve.testing.families import CheckpointCache
from hyserve.worker.spec_decode.rejection_sampler import RejectionSampler, SpecRow

MODEL = ModelConfig(vocab_size=64, hidden_size=8, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                    head_dim=8, layer_types=["full_attention"], mtp_num_hidden_layers=1)


def _spec(**kw: Any) -> SpeculativeConfig:
    return SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": 3, **kw}, MODEL)


def test_the_rates_and_the_length_as_vllm_reads_them() -> None:
    assert _spec().rejection_sample_method == "standard" and _spec().synthetic_acceptance_rates is None
    s = _spec(rejection_sample_method="synthetic", synthetic_acceptance_rates=[0.8, 0.64, 0.512])
    assert s.synthetic_acceptance_rates == (0.8, 0.64, 0.512)
    assert _spec(rejection_sample_method="synthetic", synthetic_acceptance_length=2.44).synthetic_acceptance_rates \
        == pytest.approx((1.0, 0.44, 0.0))
    assert _spec(rejection_sample_method="synthetic", synthetic_acceptance_length=4).synthetic_acceptance_rates \
        == (1.0, 1.0, 1.0)
    assert _spec(rejection_sample_method="synthetic", synthetic_acceptance_length=1).synthetic_acceptance_rates \
        == (0.0, 0.0, 0.0)
    assert conditional_rates((0.8, 0.64, 0.512)) == pytest.approx([0.8, 0.8, 0.8])
    assert conditional_rates((1.0, 0.44, 0.0)) == pytest.approx([1.0, 0.44, 0.0])
    assert conditional_rates((0.5, 0.0, 0.0)) == [0.5, 0.0, 0.0]


@pytest.mark.parametrize("kw,message", [
    ({"rejection_sample_method": "synthetic"}, "exactly one of"),
    ({"rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [0.5] * 3,
      "synthetic_acceptance_length": 2.0}, "exactly one of"),
    ({"rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [0.5, 0.4]}, "3 numbers in"),
    ({"rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [0.5, 0.4, 1.2]}, "3 numbers in"),
    ({"rejection_sample_method": "synthetic", "synthetic_acceptance_rates": [0.4, 0.5, 0.1]}, "non-increasing"),
    ({"rejection_sample_method": "synthetic", "synthetic_acceptance_length": 4.5}, r"in \[1, 4\]"),
    ({"rejection_sample_method": "synthetic", "synthetic_acceptance_length": True}, r"in \[1, 4\]"),
    ({"rejection_sample_method": "probabilistic"}, "'standard' or 'synthetic'"),
    ({"synthetic_acceptance_length": 2.0}, "need rejection_sample_method 'synthetic'"),
])
def test_bad_synthetic_fields_are_refused(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _spec(**kw)


def _walk_rates(accepted: list[int], k: int) -> list[float]:
    """Per position i, the share of rows that kept drafts 1 .. i."""
    return [sum(a >= i for a in accepted) / len(accepted) for i in range(1, k + 1)]


def test_launch_walks_at_the_planted_rates_for_greedy_and_sampled_rows() -> None:
    torch.manual_seed(0)
    rates = (0.9, 0.6, 0.3)
    sampler = RejectionSampler("cpu", synthetic_rates=rates)
    rows, n, k, vocab = [], 3000, 3, 16
    logits = torch.randn(n * (k + 1), vocab)
    for i in range(n):
        params = SamplingParams(temperature=0.0) if i % 2 else SamplingParams(temperature=1.0, seed=i)
        rows.append(SpecRow(params, [(i + j) % vocab for j in range(k)], None, None))
    out = sampler(logits, rows)
    greedy = [a for i, a in enumerate(out.num_accepted) if i % 2]
    sampled = [a for i, a in enumerate(out.num_accepted) if not i % 2]
    for got in (_walk_rates(greedy, k), _walk_rates(sampled, k)):
        assert got == pytest.approx(list(rates), abs=0.04)
    best = logits.argmax(dim=1)
    for i, (a, toks) in enumerate(zip(out.num_accepted, out.token_ids, strict=True)):
        assert toks[:a] == rows[i].draft_token_ids[:a] and toks[a] == int(best[i * (k + 1) + a])


def test_the_verify_graphs_acceptance_walks_at_the_planted_rates() -> None:
    torch.manual_seed(1)
    rates = (0.8, 0.64)
    sampler = RejectionSampler("cpu", synthetic_rates=rates)
    n, k, vocab = 4000, 2, 16
    logits = torch.randn(n * (k + 1), vocab)
    drafts = torch.randint(0, vocab, (n, k))
    num_drafts = torch.full((n,), k)
    num_drafts[::4] = 1  # a row with one draft never keeps a second
    out = torch.zeros(n, k + 2, dtype=torch.long)
    accepted, _ = sampler.accept_greedy(logits, drafts, num_drafts, out)
    full = accepted[num_drafts == k].tolist()
    assert _walk_rates(full, k) == pytest.approx(list(rates), abs=0.04)
    assert max(accepted[num_drafts == 1].tolist()) == 1
    assert RejectionSampler("cpu").accept_greedy(logits, drafts, num_drafts, out)[0].float().mean() < 0.2


@pytest.mark.parametrize("backend,sabotaged", [("uni", False), ("mp", False), ("uni", True)])
def test_the_engine_reaches_the_planted_acceptance_in_its_workers(ckpts: CheckpointCache, backend: str,
                                                                  sabotaged: bool,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    if sabotaged:  # the method ignored: the greedy rule judges the random head's drafts
        verdicts = RejectionSampler.verdicts
        monkeypatch.setattr(RejectionSampler, "verdicts", lambda self, t, d, p: verdicts(
            RejectionSampler("cpu"), t, d, p))
    spec = {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False, "rejection_sample_method": "synthetic",
            "synthetic_acceptance_rates": [0.8, 0.64]}
    llm = make_llm(path, speculative_config=spec, **({"distributed_executor_backend": "mp"} if backend == "mp"
                                                     else {}))
    try:
        prompts = [{"prompt_token_ids": [(7 * i + j) % 400 + 3 for j in range(9 + i)]} for i in range(6)]
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True), use_tqdm=False)
        length = llm.llm_engine.metrics.mean_acceptance_length
    finally:
        llm.llm_engine.shutdown()
    if sabotaged:
        assert length < 1.3
    else:
        assert length == pytest.approx(1 + 0.8 + 0.64, abs=0.2)

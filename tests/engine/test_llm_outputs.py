"""What vLLM users read off outputs: ``Logprob.rank`` (checked against an independent ranking of transformers'
logits), ``RequestOutput.metrics`` (timestamps in order), and the engine's periodic stats line."""

from __future__ import annotations

import logging

import pytest
import torch

from hyserve import LLM, SamplingParams
from hyserve.engine.metrics import StatsLogger
from hyserve.outputs import RequestMetrics
from hyserve.testing import reference_logits
from hyserve.testing.families import CheckpointCache

POOLS = {"num_kv_blocks": 64, "num_state_slots": 4}
PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [11, 3, 3, 8]]


@pytest.mark.parametrize("spec", [None, {"method": "mtp", "num_speculative_tokens": 2}], ids=["plain", "mtp"])
def test_logprob_ranks_match_transformers(ckpts: CheckpointCache, spec: dict | None) -> None:
    """Plain steps rank in the Sampler, speculative ones (MTP always drafts) in the rejection sampler."""
    path = ckpts.get(with_mtp=True)
    ref = ckpts.reference(path)
    llm = LLM(model=path, device="cpu", speculative_config=spec, **POOLS)
    # Hot sampling: many tokens are not the argmax, so ranks above 1 are checked too.
    params = SamplingParams(temperature=3.0, seed=7, max_tokens=12, logprobs=3, ignore_eos=True)
    ranks_seen: list[int] = []
    for prompt in PROMPTS:
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
        logits = reference_logits(ref, prompt + out.token_ids).double()
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
        for j, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            row = logits[len(prompt) - 1 + j]
            order = torch.argsort(row, descending=True).tolist()  # independent of the engine's counting
            for tid, lp in entry.items():
                assert lp.rank == order.index(tid) + 1, (j, tid, lp.rank, order.index(tid) + 1)
            ranks_seen.append(entry[token].rank or 0)
    assert max(ranks_seen) > 3, f"no sampled token outside the top 3: {ranks_seen}"
    if spec is not None:
        assert llm.get_metrics()["hyserve:spec_decode_num_drafts"], "no verify step ran"


def test_request_metrics_timestamps(ckpts: CheckpointCache) -> None:
    llm = LLM(model=ckpts.get(), device="cpu", **POOLS)
    eng = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    eng.add_request("a", {"prompt_token_ids": PROMPTS[0]}, params)
    seen: list[RequestMetrics] = []
    while eng.has_unfinished_requests():
        for o in eng.step():
            assert isinstance(o.metrics, RequestMetrics)
            assert (o.metrics.finished_time is None) == (not o.finished)
            seen.append(o.metrics)
    m = seen[-1]
    assert m.first_scheduled_time is not None and m.first_token_time is not None
    assert m.last_token_time is not None and m.finished_time is not None and m.time_in_queue is not None
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    assert m.time_in_queue == pytest.approx(m.first_scheduled_time - m.arrival_time)
    assert seen[0].first_token_time == m.first_token_time and seen[0].last_token_time < m.last_token_time
    out = llm.generate({"prompt_token_ids": PROMPTS[1]}, params, use_tqdm=False)[0]
    assert out.metrics is not None and out.metrics.finished_time is not None


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_stats_logger_lines(ckpts: CheckpointCache) -> None:
    llm = LLM(model=ckpts.get(), device="cpu", disable_log_stats=False, **POOLS)
    eng = llm.llm_engine
    clock, lines = FakeClock(), []
    eng.stats_logger = StatsLogger(5.0, clock=clock, log=lines.append)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    eng.add_request("a", {"prompt_token_ids": PROMPTS[0]}, params)
    eng.add_request("b", {"prompt_token_ids": PROMPTS[1]}, params)
    eng.step()  # both prompts prefilled, one token each
    assert lines == []  # less than an interval so far
    clock.now += 10.0
    eng.step()  # logs the interval before this step: 11 prompt tokens, 2 generated, in 10 s
    assert lines == ["Avg prompt throughput: 1.1 tokens/s, Avg generation throughput: 0.2 tokens/s, Running: 2 reqs, "
                     "Waiting: 0 reqs, KV cache usage: 3.2%, state slots usage: 50.0%"], lines
    while eng.has_unfinished_requests():
        eng.step()
    clock.now += 4.0
    assert eng.stats_logger.maybe_log(eng) is None  # not an interval yet
    clock.now += 1.0
    assert eng.stats_logger.maybe_log(eng) == ("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: "
                                               "1.2 tokens/s, Running: 0 reqs, Waiting: 0 reqs, KV cache usage: "
                                               "0.0%, state slots usage: 0.0%")
    clock.now += 60.0
    assert eng.stats_logger.maybe_log(eng) is None  # idle: nothing to say
    assert len(lines) == 2


def test_stats_logging_default_off_offline_and_logged_through_the_logger(ckpts: CheckpointCache,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    assert LLM(model=ckpts.get(), device="cpu", **POOLS).llm_engine.stats_logger is None
    llm = LLM(model=ckpts.get(), device="cpu", disable_log_stats=False, log_stats_interval_s=1e-9, **POOLS)
    with caplog.at_level(logging.INFO, logger="hyserve"):
        llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert any(r.getMessage().startswith("Avg prompt throughput:") for r in caplog.records)

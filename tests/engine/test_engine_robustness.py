"""One request cannot take the engine down: model-dependent sampling parameters are refused at add_request (naming
the field and the vocabulary size), and a failure on one request's path inside a step (its sampling row, its
detokenization, its stop checks) finishes that request alone with finish_reason "error" while the others go on and
still match transformers. Also: a mixed step (a long prompt chunk beside many decoding rows) costs memory in
proportion to its tokens, not to rows x prompt.
"""

from __future__ import annotations

import logging

import pytest
import torch

from hyserve import SamplingParams
from hyserve.engine.llm_engine import LLMEngine
from hyserve.request import Request
from hyserve.testing.engine import assert_matches_reference, drive, make_llm, random_prompts
from hyserve.testing.families import CheckpointCache

VOCAB = 512  # the tiny checkpoints' vocabulary size
SPECS: dict[str, dict[str, object] | None] = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 2},
    "mtp": {"method": "mtp", "num_speculative_tokens": 2},
}


def greedy(n: int, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad_id", [VOCAB, 10**9, 2**63])
def test_stop_token_ids_outside_the_vocabulary_are_refused_at_add_request(ckpts: CheckpointCache,
                                                                          bad_id: int) -> None:
    llm = make_llm(ckpts.get())
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=4, min_tokens=1, stop_token_ids=[3, bad_id])
    for check in (engine.check_sampling_params, lambda p: engine.add_request("r", [1, 2, 3], p)):
        with pytest.raises(ValueError, match=rf"stop_token_ids.*vocabulary.*{VOCAB}"):
            check(params)
    assert not engine.has_unfinished_requests() and "r" not in engine.requests
    engine.check_sampling_params(SamplingParams(stop_token_ids=[0, VOCAB - 1], min_tokens=1))  # in range: fine


def _sabotage_params(engine: LLMEngine, rid: str) -> None:
    """What add_request now refuses, slipped in behind its back: a banned id the sampler cannot index."""
    engine.requests[rid].sampling_params.stop_token_ids = [10**9]


def _sabotage_detokenizer(engine: LLMEngine, rid: str) -> None:
    req: Request = engine.requests[rid]
    assert req.detokenizer is not None

    def broken(tokens: list[int]) -> None:
        raise RuntimeError("detokenizer exploded")

    req.detokenizer.append = broken  # type: ignore[method-assign]


@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("sabotage", [_sabotage_params, _sabotage_detokenizer])
def test_one_failing_request_finishes_alone_with_an_error(ckpts: CheckpointCache, spec: str, sabotage,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    ref = ckpts.reference(path)
    llm = make_llm(path, speculative_config=SPECS[spec], max_num_batched_tokens=24, max_num_seqs=4)
    engine = llm.llm_engine
    prompts = random_prompts(3, [20, 9, 33], seed=11)
    # "bad" is in the same steps as the others: it fails while they prefill and decode beside it.
    params = {"a": greedy(8), "bad": greedy(8, min_tokens=8), "b": greedy(8)}
    for (rid, p), prompt in zip(params.items(), prompts, strict=True):
        engine.add_request(rid, {"prompt_token_ids": prompt}, p)
    sabotage(engine, "bad")
    with caplog.at_level(logging.ERROR, logger="hyserve"):
        final = drive(engine, {})
    assert final["bad"].finished and final["bad"].outputs[0].finish_reason == "error"
    assert any("request bad" in r.getMessage() for r in caplog.records), "no log line names the failed request"
    for rid, prompt in zip(params, prompts, strict=True):
        if rid != "bad":
            out = final[rid]
            assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 8
            assert_matches_reference(ref, prompt, out)
    engine.add_request("after", {"prompt_token_ids": prompts[0]}, greedy(8))  # the engine still serves
    assert drive(engine, {})["after"].outputs[0].token_ids == final["a"].outputs[0].token_ids
    assert engine.get_metrics()["hyserve:request_errors"] >= 1
    engine.assert_no_leaks()


# ---------------------------------------------------------------------------------------------- mixed-step memory


class LargestAllocation(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the largest tensor any op creates while active (bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def _largest_tensor_of_mixed_step(path: str, n_decoding: int, prompt_len: int) -> int:
    llm = make_llm(path, max_num_seqs=n_decoding + 1, num_state_slots=n_decoding + 1, num_kv_blocks=64,
                   max_num_batched_tokens=512, enable_prefix_caching=False)
    engine = llm.llm_engine
    for i, p in enumerate(random_prompts(n_decoding, [5], seed=2)):
        engine.add_request(f"d{i}", {"prompt_token_ids": p}, greedy(50))
    engine.step()
    engine.step()  # every row decodes now
    engine.add_request("long", {"prompt_token_ids": random_prompts(1, [prompt_len], seed=3)[0]}, greedy(1))
    with LargestAllocation() as mode:
        outs = engine.step()  # the decoding rows and a chunk of the long prompt in one step
    assert len(outs) == n_decoding + 1
    return mode.largest


def test_a_mixed_step_costs_what_its_tokens_cost(ckpts: CheckpointCache) -> None:
    """A long prompt chunk beside decoding rows: the largest intermediate must not grow with rows x prompt (the
    padded attention reference once made (rows, chunk, context) score tensors: 16 rows x 480 tokens here)."""
    path = ckpts.get()
    alone = _largest_tensor_of_mixed_step(path, 1, 480)
    crowded = _largest_tensor_of_mixed_step(path, 16, 480)
    assert crowded <= 2 * alone, f"largest tensor {crowded} bytes with 16 decoding rows vs {alone} with 1"

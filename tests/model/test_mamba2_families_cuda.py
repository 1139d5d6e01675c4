"""The three Mamba2 families on CUDA, the whole engine: Nemotron-H (Mamba2, MoE and attention blocks), Granite-4.0-H
(Mamba2 first, MoE, multipliers) and Falcon-H1 (Mamba2 beside attention in every layer, muP multipliers), each
with real CUDA graphs, prefix caching, chunked prefill, n-gram speculation and async scheduling on together,
against transformers' own class (float32, CPU, teacher-forced on the engine's greedy tokens). Then bf16, whose
prompts go through fla's chunked scan: close to the float32 reference within bf16's reach.

Skipped without CUDA (the CPU suite runs the same families through the torch path in their own tests).
"""

from __future__ import annotations

import pytest
import torch

from hyserve import SamplingParams
from hyserve.testing.engine import assert_matches_reference, make_llm, random_prompts
from hyserve.testing.families import CheckpointCache
from hyserve.testing.qwen3_5 import reference_logits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CASES = {  # (family, pattern, overrides of ckpts.get)
    "nemotron_h_moe": ("nemotron_h", "moe", {}),
    "granite_mamba_first": ("granitemoehybrid", "mamba_first", {}),
    "falcon_h1_release": ("falcon_h1", "hybrid3", {"variant": "release"}),
}
# Prompts repeat their own tails so that n-gram lookup proposes drafts; a shared prefix so that the cache hits.
SHARED = random_prompts(1, [40], seed=11)[0]
PROMPTS = [SHARED + p + p[:6] for p in random_prompts(4, [9, 23, 3, 30], seed=5)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)


def _llm(path: str, dtype: str):  # type: ignore[no-untyped-def]
    return make_llm(path, device="cuda", dtype=dtype, max_num_batched_tokens=32, max_num_seqs=4, num_kv_blocks=64,
                    block_size=16, enable_prefix_caching=True, recurrent_snapshot_interval=16,
                    num_snapshot_slots=32, async_scheduling=True,
                    speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                        "prompt_lookup_max": 3, "prompt_lookup_min": 1})


@pytest.mark.parametrize("case", list(CASES))
def test_float32_with_every_feature_matches_transformers(ckpts: CheckpointCache, case: str) -> None:
    family, pattern, kw = CASES[case]
    path = ckpts.get("causal", pattern, family=family, **kw)
    llm = _llm(path, "float32")
    assert llm.llm_engine.runner.graphs is not None, "CUDA graphs are off"
    ref = ckpts.reference(path)
    for rnd in range(2):  # the second round hits the prefix cache (Mamba2 snapshots at 16-token blocks)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        for prompt, out in zip(PROMPTS, outs, strict=True):
            assert_matches_reference(ref, prompt, out)
        if rnd == 1:
            assert any((o.num_cached_tokens or 0) > 0 for o in outs), "the second round hit no cached prefix"


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_stays_near_the_float32_reference(ckpts: CheckpointCache, case: str) -> None:
    family, pattern, kw = CASES[case]
    path = ckpts.get("causal", pattern, family=family, **kw)
    llm = _llm(path, "bfloat16")
    ref = ckpts.reference(path)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    worst = 0.0
    for prompt, out in zip(PROMPTS, outs, strict=True):
        toks = out.outputs[0].token_ids
        logits = reference_logits(ref, prompt + toks)
        logp = torch.log_softmax(logits.double(), dim=-1)
        for i, tok in enumerate(toks):
            row = logits[len(prompt) - 1 + i]
            gap = float(row.max() - row[tok])
            err = abs(out.outputs[0].logprobs[i][tok].logprob - float(logp[len(prompt) - 1 + i, tok]))
            worst = max(worst, err)
            assert gap <= 0.25, f"{case} token {i}: chose {tok}, reference argmax {int(row.argmax())} (gap {gap})"
            assert err <= 0.15, f"{case} token {i}: logprob error {err}"
    print(case, "bf16 worst logprob error", worst)

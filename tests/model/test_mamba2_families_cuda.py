"""The three Mamba2 families on CUDA, the whole engine: Nemotron-H (Mamba2, MoE and attention blocks), Granite-4.0-H
(Mamba2 first, MoE, multipliers) and Falcon-H1 (Mamba2 beside attention in every layer, muP multipliers), each
with real CUDA graphs, prefix caching, chunked prefill, n-gram speculation and async scheduling on together,
against transformers' own class (float32, CPU, teacher-forced on the engine's greedy tokens). Then bf16, whose
prompts go through fla's chunked scan: close to the float32 reference within bf16's reach.

Skipped without CUDA (the CPU suite runs the same families through the torch path in their own tests).
"""

from __future__ import annotations

import copy

import pytest
import torch

from hyserve import SamplingParams
from hyserve.testing.engine import assert_matches_reference, make_llm, random_prompts
from hyserve.testing.falcon_h1 import FALCON_H1
from hyserve.testing.families import CheckpointCache
from hyserve.testing.granitemoehybrid import GRANITE_H
from hyserve.testing.nemotron_h import NEMOTRON_H
from hyserve.testing.qwen3_5 import reference_logits

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CASES = {  # (family, pattern, overrides of ckpts.get)
    "nemotron_h_moe": (NEMOTRON_H.name, "moe", {}),
    "granite_mamba_first": (GRANITE_H.name, "mamba_first", {}),
    "falcon_h1_release": (FALCON_H1.name, "hybrid3", {"variant": "release"}),
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
def test_bf16_first_tokens_near_the_float32_reference(ckpts: CheckpointCache, case: str) -> None:
    """The first output token after each prompt (its prefill through fla's chunked scan on CUDA): the reference's
    argmax wherever that leads by a clear margin, and its logprob's error against the float32 reference, on average
    over the prompts, within twice transformers' own bf16 error plus 0.05 (bf16's reach depends on the checkpoint:
    Granite's multipliers give the tiny model large logits). Later tokens are left out: a tiny random MoE's routing
    flips under bf16 rounding and the texts part."""
    family, pattern, kw = CASES[case]
    path = ckpts.get("causal", pattern, family=family, **kw)
    llm = _llm(path, "bfloat16")
    ref = ckpts.reference(path)
    ref_bf16 = copy.deepcopy(ref).to(torch.bfloat16)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    errs, ref_errs = [], []
    for prompt, out in zip(PROMPTS, outs, strict=True):
        tok = out.outputs[0].token_ids[0]
        row = reference_logits(ref, [*prompt, tok])[len(prompt) - 1]
        logp = torch.log_softmax(row.double(), dim=-1)
        logp_bf16 = torch.log_softmax(reference_logits(ref_bf16, prompt)[-1].double(), dim=-1)
        top2 = torch.topk(row, 2).values
        if float(top2[0] - top2[1]) > 0.5:
            assert tok == int(row.argmax()), f"{case}: chose {tok}, reference argmax {int(row.argmax())} (clear)"
        errs.append(abs(out.outputs[0].logprobs[0][tok].logprob - float(logp[tok])))
        ref_errs.append(abs(float(logp_bf16[tok] - logp[tok])))
    mean, ref_mean = sum(errs) / len(errs), sum(ref_errs) / len(ref_errs)
    print(case, "bf16 first-token logprob errors", [round(e, 4) for e in errs], "transformers bf16's",
          [round(e, 4) for e in ref_errs])
    assert mean <= 2 * ref_mean + 0.05, f"{case}: mean bf16 logprob error {mean:.4f}, transformers' {ref_mean:.4f}"

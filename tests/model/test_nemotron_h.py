"""Nemotron-H (``NemotronHForCausalLM``: Mamba2, attention with no position embedding, squared-ReLU MLP and MoE
blocks) against transformers' own class on tiny random checkpoints written by transformers' ``save_pretrained``
with the releases' ``hybrid_override_pattern`` (float32, CPU, teacher-forced): four block patterns, the MoE with
latent projections, a sabotaged routing weight; the scheduling scenario on Mamba2, MoE and attention blocks
(staggered arrivals sharing prefixes, so the Mamba2 snapshots hit; chunked prefill; an abort; preemption) with
n-gram drafts accepted and rejected, and async scheduling or emulated CUDA graphs, rows on slots other than their
own; two uneven pipeline stages; the config's refusals.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from hyserve import SamplingParams
from hyserve.layers import sigmoid_moe
from hyserve.layers.mamba2 import Mamba2Mixer
from hyserve.layers.sigmoid_moe import SigmoidMoE
from hyserve.model.nemotron_h import NemotronHForCausalLM
from hyserve.model.registry import load_model_config
from hyserve.testing.engine import assert_matches_reference, make_llm, random_prompts
from hyserve.testing.families import CheckpointCache
from hyserve.testing.fp8 import assert_close_to_fp8_reference
from hyserve.testing.nemotron_h import NEMOTRON_H, NEMOTRON_H_PATTERNS
from hyserve.testing.scenarios import (
    MAMBA2_SABOTAGES,
    assert_ngram_scenario_matches,
    one_token_rows_committed_again,
    plain_scenario_run,
)
from hyserve.worker import cuda_graphs

FAMILY = NEMOTRON_H.name
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)


def _check(llm, ref, prompts: list[list[int]]) -> None:  # type: ignore[no-untyped-def]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert_matches_reference(ref, prompt, out)


@pytest.mark.parametrize("pattern", list(NEMOTRON_H_PATTERNS))
def test_matches_transformers(ckpts: CheckpointCache, pattern: str) -> None:
    path = ckpts.get("causal", pattern, family=FAMILY)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        assert "hybrid_override_pattern" in json.load(f)  # the releases' form
    llm = make_llm(path, max_num_batched_tokens=16)
    model = llm.llm_engine.runner.model
    assert type(model) is NemotronHForCausalLM
    assert [b.layer_type for b in model.backbone.layers] == NEMOTRON_H_PATTERNS[pattern]
    assert sum(isinstance(b.mixer, Mamba2Mixer) for b in model.backbone.layers) == \
        NEMOTRON_H_PATTERNS[pattern].count("linear_attention")
    _check(llm, ckpts.reference(path), random_prompts(4, [1, 7, 23, 40], seed=3))


def _scenario_path(ckpts: CheckpointCache) -> str:
    return ckpts.get("causal", "moe", family=FAMILY, seed=2)  # Mamba2, MoE and attention blocks


@pytest.fixture(scope="module")
def plain_run(ckpts: CheckpointCache) -> dict:
    """The scenario run synchronously without speculation: it preempts and hits, and matches the reference."""
    return plain_scenario_run(ckpts, _scenario_path(ckpts))


@pytest.mark.parametrize("async_scheduling,graphs", [(True, False), (False, True)], ids=["async", "graphs"])
def test_features_compose(ckpts: CheckpointCache, plain_run: dict, monkeypatch: pytest.MonkeyPatch,
                          async_scheduling: bool, graphs: bool) -> None:
    """Prefix caching (Mamba2 conv and SSM snapshots), chunked prefill, n-gram drafts (verify rows whose rejected
    positions never reach the live state) and async scheduling or the emulated CUDA graphs together give the plain
    run's outputs, rows mapped to slots other than their own."""
    monkeypatch.setattr(cuda_graphs, "EMULATE", graphs)
    assert_ngram_scenario_matches(_scenario_path(ckpts), plain_run, async_scheduling, graphs)


@pytest.mark.parametrize("sabotaged", [False, True])
def test_steps_at_k0_advance_the_mamba2_slots_in_place(ckpts: CheckpointCache, plain_run: dict,
                                                        sabotaged: bool) -> None:
    """n-gram speculation whose length per step is scripted through 0 (hyserve.speculative.adaptive): at k = 0 the
    Mamba2 layers advance their slots in place and commit nothing; committing those steps again is caught."""
    sabotage = one_token_rows_committed_again if sabotaged else None
    schedule = [0, 3, 0, 0, 1, 2]
    if sabotaged:
        with pytest.raises(AssertionError, match="differ"):  # the outputs (assert_same_outputs)
            assert_ngram_scenario_matches(_scenario_path(ckpts), plain_run, True, False, sabotage, schedule)
    else:
        assert_ngram_scenario_matches(_scenario_path(ckpts), plain_run, True, False, None, schedule)


@pytest.mark.parametrize("sabotage", list(MAMBA2_SABOTAGES))
def test_sabotaged_mamba2_states_are_caught(ckpts: CheckpointCache, plain_run: dict, sabotage: str) -> None:
    """The scenario above fails when snapshots are taken one step late or a Mamba2 commit keeps a rejected draft."""
    with pytest.raises(AssertionError, match=r"tokens differ|logprob \d+ differs"):
        assert_ngram_scenario_matches(_scenario_path(ckpts), plain_run, False, False, MAMBA2_SABOTAGES[sabotage])


def test_moe_with_latent_projections_matches_transformers(ckpts: CheckpointCache,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Nemotron 3's latent MoE: the experts run in a ``moe_latent_size`` space between two projections; the
    checkpoint stores one 2-D tensor per expert (loaded into the stacked experts' views). The experts take the
    fused kernels (``relu2``) exactly where they should: under ``TRITON_INTERPRET=1`` (as on CUDA;
    ``tests/kernels/test_moe_engine.py`` runs this so), not on the CPU path."""
    path = ckpts.get("causal", "moe", family=FAMILY, moe_latent_size=24)
    calls: list[str] = []
    real = sigmoid_moe.fused_experts

    def counting(*args, **kw):  # type: ignore[no-untyped-def]
        calls.append(kw["activation"])
        return real(*args, **kw)

    monkeypatch.setattr(sigmoid_moe, "fused_experts", counting)
    llm = make_llm(path, max_num_batched_tokens=16)
    moe = llm.llm_engine.runner.model.backbone.layers[1].mixer
    assert isinstance(moe, SigmoidMoE) and moe.fc1_latent_proj is not None
    assert moe.experts.up_proj.shape == (8, 48, 24)
    _check(llm, ckpts.reference(path), random_prompts(3, [6, 19, 31], seed=7))
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert calls and set(calls) == {"relu2"}
    else:
        assert not calls


def test_routing_weights_from_the_biased_scores_are_caught(ckpts: CheckpointCache,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotaged: the routing weights taken from the scores plus the correction bias (which only chooses); the
    reference check fails."""
    path = ckpts.get("causal", "moe", family=FAMILY)
    real = SigmoidMoE.route

    def biased(self: SigmoidMoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w, idx = real(self, x)
        return w + self.scaling * self.gate.e_score_correction_bias[idx], idx

    monkeypatch.setattr(SigmoidMoE, "route", biased)
    llm = make_llm(path, max_num_batched_tokens=16)
    with pytest.raises(AssertionError):
        _check(llm, ckpts.reference(path), random_prompts(3, [6, 19, 31], seed=7))


def test_two_uneven_pipeline_stages_match_transformers(ckpts: CheckpointCache) -> None:
    path = ckpts.get("causal", "mamba_run", family=FAMILY, seed=4)
    llm = make_llm(path, max_num_batched_tokens=16, pipeline_parallel_size=2, pp_layer_partition=[4, 2],
                   async_scheduling=True)
    _check(llm, ckpts.reference(path), random_prompts(3, [9, 30, 17], seed=5))
    llm.llm_engine.shutdown()


def _edited(ckpts: CheckpointCache, tmp_path: Path, **fields: object) -> str:
    src = ckpts.get("causal", "m_attn_m_mlp", family=FAMILY)
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    raw.update(fields)
    dst = tmp_path / "cfg"
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(raw))
    return str(dst)


@pytest.mark.parametrize("fields,message", [
    ({"mlp_bias": True}, "mlp_bias=true"),
    ({"hybrid_override_pattern": "M*X-"}, "unknown block letters"),
    ({"attention_bias": True}, "attention_bias=true is not supported"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings=true is not supported"),
    ({"mlp_hidden_act": "gelu"}, "mlp_hidden_act 'gelu'"),
])
def test_unsupported_configs_are_refused_by_name(ckpts: CheckpointCache, tmp_path: Path, fields: dict,
                                                 message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_model_config(_edited(ckpts, tmp_path, **fields))


def test_tensor_parallel_sizes_that_do_not_split_are_refused_by_name(ckpts: CheckpointCache,
                                                                     tmp_path: Path) -> None:
    """Tensor parallelism runs in tests/distributed/test_mamba2_tensor_parallel.py; here the config's refusals."""
    cfg = load_model_config(_edited(ckpts, tmp_path, mamba_num_heads=6, n_groups=3))
    cfg.check_tensor_parallel(1)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 and the Mamba2 groups \(n_groups=3\)"):
        cfg.check_tensor_parallel(2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not divide mamba_num_heads=6"):
        cfg.check_tensor_parallel(4)


def test_a_bf16_mamba2_state_is_stored_and_stays_close(ckpts: CheckpointCache) -> None:
    """``--mamba-ssm-cache-dtype bfloat16``: the Mamba2 layers' SSM state stored in bf16 at half the bytes (the conv
    windows as they were), the outputs close to the float32 reference (every clear position its argmax) but not
    within the float32 check: the rounding is seen."""
    path = ckpts.get("causal", "mamba_run", family=FAMILY)
    ref = ckpts.reference(path)
    half, full = (make_llm(path, max_num_batched_tokens=32, **kw) for kw in ({"mamba_ssm_cache_dtype": "bfloat16"}, {}))
    for llm, want in ((half, torch.bfloat16), (full, torch.float32)):
        mixers = [b.mixer for b in llm.llm_engine.runner.model.backbone.layers if isinstance(b.mixer, Mamba2Mixer)]
        assert mixers and all(m.state["ssm_state"].dtype == want for m in mixers)
    specs = [e.llm_engine.runner.cache_specs for e in (half, full)]
    ssm = sum(t.nbytes for spec in specs[1].recurrent for t in spec.tensors if t.name == "ssm_state")
    assert specs[1].state_bytes_per_slot - specs[0].state_bytes_per_slot == ssm // 2
    prompts = random_prompts(4, [5, 23, 41, 70], seed=3)
    outs = half.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert_close_to_fp8_reference(ref, list(zip(prompts, outs, strict=True)), 3e-2, 0.5, 0.5, min_clear=8)
    with pytest.raises(AssertionError, match="logprob"):
        for p, o in zip(prompts, outs, strict=True):
            assert_matches_reference(ref, p, o)

"""Falcon-H1 (``FalconH1ForCausalLM``: Mamba2 and RoPE attention side by side in every layer, then a SwiGLU MLP,
with muP multipliers) against transformers' own class on tiny random checkpoints written by transformers'
``save_pretrained`` with the releases' config.json fields (float32, CPU, teacher-forced): the release's mixer
without the gated norm, the gated norm before and after the gate (with every projection bias, a tied LM head, a dt
limit), every multiplier different from 1; a misplaced segment multiplier and a dropped key multiplier caught; the
scheduling scenario (staggered arrivals sharing prefixes, so the Mamba2 snapshots hit; chunked prefill; an abort;
preemption) with n-gram drafts accepted and rejected, and async scheduling or emulated CUDA graphs, rows on slots
other than their own; two uneven pipeline stages with the tied head; the config's refusals.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from hyserve import SamplingParams
from hyserve.layers.attention import PlainAttention
from hyserve.layers.mamba2 import Mamba2Mixer
from hyserve.model.falcon_h1 import FalconH1ForCausalLM
from hyserve.model.registry import load_model_config
from hyserve.testing.engine import assert_matches_reference, make_llm, random_prompts
from hyserve.testing.falcon_h1 import FALCON_H1, FALCON_H1_VARIANTS
from hyserve.testing.families import CheckpointCache
from hyserve.testing.scenarios import (
    MAMBA2_SABOTAGES,
    assert_ngram_scenario_matches,
    plain_scenario_run,
)
from hyserve.worker import cuda_graphs

FAMILY = FALCON_H1.name
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)


def _check(llm, ref, prompts: list[list[int]]) -> None:  # type: ignore[no-untyped-def]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert_matches_reference(ref, prompt, out)


@pytest.mark.parametrize("variant", list(FALCON_H1_VARIANTS))
def test_matches_transformers(ckpts: CheckpointCache, variant: str) -> None:
    path = ckpts.get("causal", "hybrid3", family=FAMILY, variant=variant)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    assert "rope_theta" in raw and "rope_parameters" not in raw  # the releases' form
    llm = make_llm(path, max_num_batched_tokens=16)
    model = llm.llm_engine.runner.model
    assert type(model) is FalconH1ForCausalLM
    # Every layer owns both caches: a Mamba2 state slot and paged K/V, shaped as config.json says.
    specs = model.cache_specs(torch.float32)
    assert len(specs.recurrent) == len(specs.attention) == raw["num_hidden_layers"] == 3
    conv_dim = raw["mamba_d_ssm"] + 2 * raw["mamba_n_groups"] * raw["mamba_d_state"]
    for rec in specs.recurrent:
        assert [(t.name, t.shape) for t in rec.tensors] == [
            ("conv_state", (conv_dim, raw["mamba_d_conv"] - 1)),
            ("ssm_state", (raw["mamba_n_heads"], raw["mamba_d_head"], raw["mamba_d_state"]))]
    assert {(a.num_kv_heads, a.head_dim) for a in specs.attention} == {(raw["num_key_value_heads"], raw["head_dim"])}
    assert all(isinstance(layer.mamba, Mamba2Mixer) and isinstance(layer.self_attn, PlainAttention)
               for layer in model.model.layers)
    ref = ckpts.reference(path)
    assert model.config.num_parameters() == sum(p.numel() for p in ref.parameters())
    _check(llm, ref, random_prompts(4, [1, 7, 23, 40], seed=3))


@pytest.mark.parametrize("sabotage", ["segments_swapped", "key_multiplier_dropped"])
def test_misplaced_multipliers_are_caught(ckpts: CheckpointCache, monkeypatch: pytest.MonkeyPatch,
                                          sabotage: str) -> None:
    """Sabotaged: the ssm_multipliers of x and B exchanged, or k left unscaled; the reference check fails."""
    path = ckpts.get("causal", "hybrid3", family=FAMILY, variant="release")
    real = Mamba2Mixer.segment_scale

    def swapped(self: Mamba2Mixer, like: torch.Tensor) -> torch.Tensor:
        m, i, gn = self.segment_multipliers, self.intermediate, self.n_groups * self.state_size
        assert m is not None
        scale = real(self, like).clone()
        scale[i : 2 * i], scale[2 * i : 2 * i + gn] = m[2], m[1]
        return scale

    if sabotage == "segments_swapped":
        monkeypatch.setattr(Mamba2Mixer, "segment_scale", swapped)
    llm = make_llm(path, max_num_batched_tokens=16)
    if sabotage == "key_multiplier_dropped":
        for layer in llm.llm_engine.runner.model.model.layers:
            layer.self_attn.key_multiplier = 1.0
    with pytest.raises(AssertionError, match="output token"):
        _check(llm, ckpts.reference(path), random_prompts(3, [6, 19, 31], seed=7))


def _scenario_path(ckpts: CheckpointCache) -> str:
    return ckpts.get("causal", "hybrid3", family=FAMILY, variant="release", seed=2)


@pytest.fixture(scope="module")
def plain_run(ckpts: CheckpointCache) -> dict:
    """The scenario run synchronously without speculation: it preempts and hits, and matches the reference."""
    return plain_scenario_run(ckpts, _scenario_path(ckpts))


@pytest.mark.parametrize("async_scheduling,graphs", [(True, False), (False, True)], ids=["async", "graphs"])
def test_features_compose(ckpts: CheckpointCache, plain_run: dict, monkeypatch: pytest.MonkeyPatch,
                          async_scheduling: bool, graphs: bool) -> None:
    """Prefix caching (Mamba2 conv and SSM snapshots beside the shared KV blocks of the same layers), chunked
    prefill, n-gram drafts (verify rows whose rejected positions never reach the live state) and async scheduling
    or the emulated CUDA graphs (whose logits path applies the LM head multiplier too) together give the plain run's
    outputs, rows mapped to slots other than their own."""
    monkeypatch.setattr(cuda_graphs, "EMULATE", graphs)
    assert_ngram_scenario_matches(_scenario_path(ckpts), plain_run, async_scheduling, graphs)


@pytest.mark.parametrize("sabotage", list(MAMBA2_SABOTAGES))
def test_sabotaged_mamba2_states_are_caught(ckpts: CheckpointCache, plain_run: dict, sabotage: str) -> None:
    """The scenario above fails when snapshots are taken one step late or a Mamba2 commit keeps a rejected draft."""
    with pytest.raises(AssertionError, match=r"tokens differ|logprob \d+ differs"):
        assert_ngram_scenario_matches(_scenario_path(ckpts), plain_run, False, False, MAMBA2_SABOTAGES[sabotage])


def test_two_uneven_pipeline_stages_with_a_tied_head_match_transformers(ckpts: CheckpointCache) -> None:
    """The last stage holds the embedding too (the tied LM head), the first hands over the residual alone."""
    path = ckpts.get("causal", "hybrid4", family=FAMILY, variant="norm_before_gate", seed=4)
    llm = make_llm(path, max_num_batched_tokens=16, pipeline_parallel_size=2, pp_layer_partition=[3, 1],
                   async_scheduling=True)
    _check(llm, ckpts.reference(path), random_prompts(3, [9, 30, 17], seed=5))
    llm.llm_engine.shutdown()


def _edited(ckpts: CheckpointCache, tmp_path: Path, **fields: object) -> str:
    src = ckpts.get("causal", "hybrid3", family=FAMILY, variant="release")
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    raw.update(fields)
    dst = tmp_path / "cfg"
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(raw))
    return str(dst)


@pytest.mark.parametrize("fields,message", [
    ({"mlp_bias": True}, "mlp_bias=true"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
    ({"attn_layer_indices": [0, 2]}, "attn_layer_indices is not supported"),
    ({"mamba_use_mlp": False}, "mamba_use_mlp=false"),
    ({"mamba_d_head": 16}, "mamba_d_head=16 times mamba_n_heads=4"),
    ({"ssm_multipliers": [1.0, 2.0]}, "ssm_multipliers must list 5"),
    ({"key_multiplier": None}, "key_multiplier must be a number"),
])
def test_unsupported_configs_are_refused_by_name(ckpts: CheckpointCache, tmp_path: Path, fields: dict,
                                                 message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_model_config(_edited(ckpts, tmp_path, **fields))


def test_tensor_parallel_sizes_that_do_not_split_are_refused_by_name(ckpts: CheckpointCache,
                                                                     tmp_path: Path) -> None:
    """Tensor parallelism runs in tests/distributed/test_mamba2_tensor_parallel.py; here the config's refusals."""
    cfg = load_model_config(_edited(ckpts, tmp_path, mamba_n_heads=6, mamba_n_groups=3, mamba_d_ssm=72))
    cfg.check_tensor_parallel(1)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 and the Mamba2 groups \(n_groups=3\)"):
        cfg.check_tensor_parallel(2)

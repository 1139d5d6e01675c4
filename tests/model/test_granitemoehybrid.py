"""Granite-4.0-H (``GraniteMoeHybridForCausalLM``: Mamba2 or attention, then the top-k softmax MoE and the shared
MLP, four multipliers) against transformers' own class on tiny random checkpoints written by transformers'
``save_pretrained`` with the releases' config.json form (float32, CPU, teacher-forced): Mamba2 first with a tied
head and no RoPE, attention first with RoPE, a dense (no experts) untied model with projection biases, attention
layers alone (Granite-4.0-Micro's kind: dense, RoPE, no recurrent state); sabotages (a multiplier dropped, the
experts' gate and up halves swapped, the Mamba2 norm grouped) caught; the scheduling scenario on Mamba2, MoE and
attention (staggered arrivals sharing prefixes, so the Mamba2 snapshots hit; chunked prefill; an abort;
preemption) with n-gram drafts accepted and rejected, async scheduling or the emulated CUDA graphs, rows on slots
other than their own; two uneven pipeline stages with the tied head; the config's refusals and a missing tensor
named as the releases name it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hyserve import SamplingParams
from hyserve.layers.granite_moe import SoftmaxTopKMoE
from hyserve.layers.mamba2 import GroupedGatedRMSNorm, Mamba2Mixer
from hyserve.model.granitemoehybrid import GraniteMoeHybridForCausalLM
from hyserve.model.registry import load_model_config
from hyserve.testing.engine import assert_matches_reference, make_llm, random_prompts
from hyserve.testing.families import CheckpointCache
from hyserve.testing.granitemoehybrid import GRANITE_H, GRANITE_H_PATTERNS
from hyserve.testing.scenarios import (
    MAMBA2_SABOTAGES,
    assert_ngram_scenario_matches,
    plain_scenario_run,
)
from hyserve.worker import cuda_graphs

FAMILY = GRANITE_H.name
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
CASES = {
    "mamba_first": ("mamba_first", {}),
    "attn_first_rope": ("attn_first", {"position_embedding_type": "rope"}),
    "dense_untied_biases": ("mamba_run", {"num_local_experts": 0, "tie_word_embeddings": False,
                                          "attention_bias": True, "mamba_proj_bias": True}),
    "attention_only_dense_rope": ("attention_only", {"num_local_experts": 0, "position_embedding_type": "rope"}),
}


def _path(ckpts: CheckpointCache, case: str, **kw: object) -> str:
    pattern, overrides = CASES[case]
    return ckpts.get("causal", pattern, family=FAMILY, **overrides, **kw)


def _check(llm, ref, prompts: list[list[int]]) -> None:  # type: ignore[no-untyped-def]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert_matches_reference(ref, prompt, out)


@pytest.mark.parametrize("case", list(CASES))
def test_matches_transformers(ckpts: CheckpointCache, case: str) -> None:
    path = _path(ckpts, case)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    assert set(raw["layer_types"]) <= {"mamba", "attention"}  # the releases' form
    llm = make_llm(path, max_num_batched_tokens=16)
    model = llm.llm_engine.runner.model
    assert type(model) is GraniteMoeHybridForCausalLM
    pattern, overrides = CASES[case]
    assert [b.layer_type for b in model.model.layers] == GRANITE_H_PATTERNS[pattern]
    assert all((b.block_sparse_moe is None) == ("num_local_experts" in overrides) for b in model.model.layers)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == raw["tie_word_embeddings"]
    assert (model.model.rotary is not None) == (raw["position_embedding_type"] == "rope")
    _check(llm, ckpts.reference(path), random_prompts(4, [1, 7, 23, 40], seed=3))


def _swap_gate_up(model: GraniteMoeHybridForCausalLM) -> None:
    for m in model.modules():
        if isinstance(m, SoftmaxTopKMoE):
            w = m.experts.gate_up_proj.data
            w.copy_(torch.cat(w.chunk(2, dim=1)[::-1], dim=1))


def _drop_residual_multiplier(model: GraniteMoeHybridForCausalLM) -> None:
    for layer in model.model.layers:
        layer.residual_multiplier = 1.0


def _group_the_mamba_norm(model: GraniteMoeHybridForCausalLM) -> None:
    for m in model.modules():
        if isinstance(m, Mamba2Mixer):
            assert isinstance(m.norm, GroupedGatedRMSNorm) and m.norm.group_size == m.intermediate
            m.norm.group_size = m.intermediate // m.n_groups  # Nemotron-H's grouping


@pytest.mark.parametrize("sabotage", [_swap_gate_up, _drop_residual_multiplier, _group_the_mamba_norm])
def test_sabotage_is_caught(ckpts: CheckpointCache, sabotage) -> None:  # type: ignore[no-untyped-def]
    """The experts' gate and up halves swapped, the residual multiplier dropped, or the Mamba2 gated norm grouped
    as Nemotron-H's: the reference check fails."""
    path = _path(ckpts, "mamba_first")
    llm = make_llm(path, max_num_batched_tokens=16)
    sabotage(llm.llm_engine.runner.model)
    with pytest.raises(AssertionError):
        _check(llm, ckpts.reference(path), random_prompts(2, [7, 23], seed=3))


def _scenario_path(ckpts: CheckpointCache) -> str:
    return ckpts.get("causal", "mamba_run", family=FAMILY, seed=2)  # Mamba2, MoE and attention


@pytest.fixture(scope="module")
def plain_run(ckpts: CheckpointCache) -> dict:
    """The scenario run synchronously without speculation: it preempts and hits, and matches the reference."""
    return plain_scenario_run(ckpts, _scenario_path(ckpts))


@pytest.mark.parametrize("async_scheduling,graphs", [(True, False), (False, True)], ids=["async", "graphs"])
def test_features_compose(ckpts: CheckpointCache, plain_run: dict, monkeypatch: pytest.MonkeyPatch,
                          async_scheduling: bool, graphs: bool) -> None:
    """Prefix caching (Mamba2 conv and SSM snapshots), chunked prefill, preemption, an abort, n-gram drafts
    (verify rows whose rejected positions never reach the live state) and async scheduling or the emulated CUDA
    graphs together give the plain run's outputs, rows mapped to slots other than their own."""
    monkeypatch.setattr(cuda_graphs, "EMULATE", graphs)
    assert_ngram_scenario_matches(_scenario_path(ckpts), plain_run, async_scheduling, graphs)


@pytest.mark.parametrize("sabotage", list(MAMBA2_SABOTAGES))
def test_sabotaged_mamba2_states_are_caught(ckpts: CheckpointCache, plain_run: dict, sabotage: str) -> None:
    """The scenario above fails when snapshots are taken one step late or a Mamba2 commit keeps a rejected draft."""
    with pytest.raises(AssertionError, match=r"tokens differ|logprob \d+ differs"):
        assert_ngram_scenario_matches(_scenario_path(ckpts), plain_run, False, False, MAMBA2_SABOTAGES[sabotage])


def test_two_uneven_pipeline_stages_with_a_tied_head_match_transformers(ckpts: CheckpointCache) -> None:
    """The last stage holds the embedding too (the tied head reads it)."""
    path = ckpts.get("causal", "mamba_run", family=FAMILY, seed=4)
    llm = make_llm(path, max_num_batched_tokens=16, pipeline_parallel_size=2, pp_layer_partition=[3, 2])
    _check(llm, ckpts.reference(path), random_prompts(3, [9, 30, 17], seed=5))
    llm.llm_engine.shutdown()


def _edited(ckpts: CheckpointCache, tmp_path: Path, **fields: object) -> str:
    src = _path(ckpts, "mamba_first")
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    raw.update(fields)
    dst = tmp_path / "cfg"
    dst.mkdir()
    (dst / "config.json").write_text(json.dumps(raw))
    return str(dst)


@pytest.mark.parametrize("fields,message", [
    ({"layer_types": ["mamba", "moe", "mamba", "mamba"]}, "unknown types \\['moe'\\]"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"position_embedding_type": "alibi"}, "position_embedding_type 'alibi'"),
    ({"position_embedding_type": "rope", "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_type 'yarn'"),
    ({"mamba_d_head": 24}, "mamba_d_head=24"),
    ({"num_hidden_layers": 5}, "num_hidden_layers=5 but layer_types lists 4"),
    ({"normalization_function": "layernorm"}, "normalization_function 'layernorm'"),
    ({"mlp_bias": True}, "mlp_bias is set"),
])
def test_unsupported_configs_are_refused_by_name(ckpts: CheckpointCache, tmp_path: Path, fields: dict,
                                                 message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_model_config(_edited(ckpts, tmp_path, **fields))


def test_config_reads_the_release_fields(ckpts: CheckpointCache) -> None:
    cfg = load_model_config(_path(ckpts, "mamba_first"))
    assert (cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attention_multiplier, cfg.logits_scaling) == \
        (0.6, 1.6, 0.09, 2.5)  # type: ignore[attr-defined]
    assert cfg.time_step_limit == (0.0, float("inf"))  # type: ignore[attr-defined]  # transformers' {"__float__"}
    assert cfg.tie_word_embeddings and not cfg.use_rope  # type: ignore[attr-defined]
    model = GraniteMoeHybridForCausalLM(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_parameters()


def test_expert_parallel_splits_the_experts_not_their_channels(ckpts: CheckpointCache) -> None:
    """With expert parallelism the ranks must split the experts (whole), not each expert's channels (EP 2 against
    transformers and the refusals: tests/distributed/test_mamba2_tensor_parallel.py)."""
    cfg = load_model_config(_path(ckpts, "mamba_first"))
    assert cfg.num_experts == 8  # type: ignore[attr-defined]
    ep, tp = cfg.tensor_parallel_counts(expert_parallel=True), cfg.tensor_parallel_counts()
    assert ep["num_local_experts"] == 8 and "intermediate_size" not in ep
    assert tp["intermediate_size"] and "num_local_experts" not in tp


def test_a_missing_tensor_is_named_as_the_release_names_it(ckpts: CheckpointCache, tmp_path: Path) -> None:
    """The loader maps the releases' MoE names to the model's, and names a missing one as it is named on disk."""
    src = _path(ckpts, "mamba_first")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    del tensors["model.layers.2.block_sparse_moe.router.layer.weight"]
    save_file(tensors, str(dst / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensor\(s\) in checkpoint: 'model\.layers\.2\.block_sparse_moe"
                                         r"\.router\.layer\.weight'"):
        make_llm(str(dst))

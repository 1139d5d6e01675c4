"""Qwen3-Next (``Qwen3NextForCausalLM``) on the CPU, against transformers' ``Qwen3NextForCausalLM`` (float32,
teacher-forced), on tiny checkpoints written by transformers' ``save_pretrained`` in the release's layout (fused
``in_proj_qkvz`` / ``in_proj_ba``, one tensor per expert): 6 experts, top-k 2 and 3, ``norm_topk_prob`` both ways,
a shared expert, sparse and dense feed-forward layers (``decoder_sparse_step``, ``mlp_only_layers``), GDN and
attention layers in several orders:

* the fused projections' re-order is transformers' ``fix_query_key_value_ordering``, for all key heads and for
  each tensor-parallel rank's group; read as Qwen3.5's ungrouped layout instead, the outputs are caught;
* greedy tokens and log-probabilities match the reference, two layer patterns, both ways of making dense layers;
* prefix caching, chunked prefill, MTP (k = 2, planted drafts accepted) and async scheduling or the emulated CUDA
  graphs together, with staggered arrivals, an abort and preemption over non-identity row-to-slot mappings, give
  the plain synchronous run's outputs, which match the reference;
* tensor parallel 2 on gloo (a key-head group per rank) and expert parallel on it, MTP on, and two uneven
  pipeline stages with MTP and async scheduling match the reference;
* the MTP head's drafts and output (its layer's MoE block, or the dense MLP where the config makes layer 0 dense)
  match a head built from transformers' modules, and a head routing to one expert instead of three is caught;
* ``load_format="dummy"`` serves from config.json alone, the same on one and two ranks;
* a fused projection of the wrong shape, or Qwen3.5's split projections in its place, are refused by name;
* the config: transformers' defaults, refusals, and the weights counted as transformers' model holds them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn import functional as F
from transformers import Qwen3NextConfig
from transformers import Qwen3NextForCausalLM as Reference
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from hyserve import SamplingParams
from hyserve.config import FULL_ATTENTION, LINEAR_ATTENTION
from hyserve.layers.mlp import MLP
from hyserve.layers.moe import SparseMoeBlock
from hyserve.layers.sharding import Shard
from hyserve.model import qwen3_next, registry
from hyserve.model.qwen3_next import FusedGatedDeltaNet, Qwen3NextForCausalLM, Qwen3NextMTPHead, fused_in_proj_rows
from hyserve.model.qwen3_next_config import Qwen3NextConfig as Config
from hyserve.model.qwen3_next_config import parse_qwen3_next_config
from hyserve.model.registry import load_model_config
from hyserve.testing.engine import SlotRecorder, assert_matches_reference, drive, make_llm, random_prompts
from hyserve.testing.families import LAYER_PATTERNS, CheckpointCache
from hyserve.testing.qwen3_5_moe import check_mtp_drafts
from hyserve.testing.qwen3_next import QWEN3_NEXT, tiny_next_config
from hyserve.testing.scenarios import (
    assert_k_schedule_matches,
    assert_same_outputs,
    plain_scenario_run,
    run_k_schedule,
    scenario,
    scenario_engine,
)
from hyserve.worker import cuda_graphs

FAMILY = QWEN3_NEXT.name
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
MTP = {"method": "mtp", "num_speculative_tokens": 2}


def _check(llm, ref, prompts: list[list[int]]) -> None:  # type: ignore[no-untyped-def]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert_matches_reference(ref, prompt, out)


@pytest.mark.parametrize("k_range", [(0, 2), (0, 1), (1, 2)], ids=["whole", "rank0_of_2", "rank1_of_2"])
def test_the_reorder_is_transformers_grouping(k_range: tuple[int, int]) -> None:
    """The rows ``fused_in_proj_rows`` takes give [q | k | v | z] and [b | a] of key heads ``k_range`` (and their
    value heads) exactly as transformers' ``fix_query_key_value_ordering`` splits the fused outputs."""
    cfg = tiny_next_config(LAYER_PATTERNS["gdn3_attn1"])
    torch.manual_seed(0)
    gdn = Qwen3NextGatedDeltaNet(cfg, 0)
    nk, nv, h = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.hidden_size
    x = torch.randn(1, 5, h)
    with torch.no_grad():
        q, k, v, z, b, a = gdn.fix_query_key_value_ordering(gdn.in_proj_qkvz(x), gdn.in_proj_ba(x))
        qkvz, ba = fused_in_proj_rows(nk, nv, cfg.linear_key_head_dim, cfg.linear_value_head_dim, k_range)
        w_qkvz = Shard(tuple(gdn.in_proj_qkvz.weight.shape), 0, qkvz).take(gdn.in_proj_qkvz.weight)
        w_ba = Shard(tuple(gdn.in_proj_ba.weight.shape), 0, ba).take(gdn.in_proj_ba.weight)
    (k0, k1), r = k_range, nv // nk
    keys, values = slice(k0, k1), slice(k0 * r, k1 * r)
    want = torch.cat([q[:, :, keys].flatten(2), k[:, :, keys].flatten(2), v[:, :, values].flatten(2),
                      z[:, :, values].flatten(2)], dim=-1)
    torch.testing.assert_close(F.linear(x, w_qkvz), want)
    torch.testing.assert_close(F.linear(x, w_ba), torch.cat([b[:, :, values], a[:, :, values]], dim=-1))


@pytest.mark.parametrize("pattern,kw,sparse", [
    ("gdn3_attn1", {"decoder_sparse_step": 2, "num_experts_per_tok": 2}, [False, True, False, True]),
    ("attn_first", {"mlp_only_layers": (0, 2), "num_experts_per_tok": 3, "norm_topk_prob": False},
     [False, True, False, True]),
], ids=["sparse_step_2", "mlp_only_layers"])
def test_matches_transformers(ckpts: CheckpointCache, pattern: str, kw: dict[str, Any], sparse: list[bool]) -> None:
    path = ckpts.get("causal", pattern, family=FAMILY, **kw)
    llm = make_llm(path, max_num_batched_tokens=16)
    model = llm.llm_engine.runner.model
    assert type(model) is Qwen3NextForCausalLM
    layers = list(model.model.layers)
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in layers] == sparse
    assert all(isinstance(layer.mlp, MLP) for layer, s in zip(layers, sparse, strict=True) if not s)
    assert [layer.layer_type for layer in layers] == LAYER_PATTERNS[pattern]
    assert all(type(layer.linear_attn) is FusedGatedDeltaNet for layer in layers
               if layer.layer_type == LINEAR_ATTENTION)
    _check(llm, ckpts.reference(path), random_prompts(4, [1, 7, 23, 40], seed=3))


def _ungrouped_rows(num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                    k_range: tuple[int, int]) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Sabotage: the fused tensors read as if they were Qwen3.5's [q | k | v | z] and [b | a], not per key head."""
    (k0, k1), r = k_range, num_v_heads // num_k_heads
    fk, fv, vd = num_k_heads * head_k_dim, num_v_heads * head_v_dim, r * head_v_dim
    qkvz = ((k0 * head_k_dim, k1 * head_k_dim), (fk + k0 * head_k_dim, fk + k1 * head_k_dim),
            (2 * fk + k0 * vd, 2 * fk + k1 * vd), (2 * fk + fv + k0 * vd, 2 * fk + fv + k1 * vd))
    return qkvz, ((k0 * r, k1 * r), (num_v_heads + k0 * r, num_v_heads + k1 * r))


def test_the_ungrouped_layout_is_caught(ckpts: CheckpointCache, monkeypatch: pytest.MonkeyPatch) -> None:
    path = ckpts.get("causal", "gdn3_attn1", family=FAMILY, decoder_sparse_step=2, num_experts_per_tok=2)
    monkeypatch.setattr(qwen3_next, "fused_in_proj_rows", _ungrouped_rows)
    llm = make_llm(path, max_num_batched_tokens=16)
    with pytest.raises(AssertionError, match=r"logprob|reference argmax"):
        _check(llm, ckpts.reference(path), random_prompts(4, [1, 7, 23, 40], seed=3))


def _scenario_path(ckpts: CheckpointCache) -> str:
    """Layer 2 dense, the others (and the MTP layer, index 0) sparse."""
    return ckpts.get("causal", "gdn3_attn1", family=FAMILY, with_mtp=True, num_experts_per_tok=3,
                     mlp_only_layers=(2,))


@pytest.fixture(scope="module")
def plain_run(ckpts: CheckpointCache) -> dict:
    """The scenario run synchronously without speculation: it preempts and hits, and matches the reference."""
    return plain_scenario_run(ckpts, _scenario_path(ckpts))


@pytest.mark.parametrize("async_scheduling,graphs", [(True, False), (False, True)], ids=["async", "graphs"])
def test_features_compose(ckpts: CheckpointCache, plain_run: dict, plant_drafts: Callable,
                          monkeypatch: pytest.MonkeyPatch, async_scheduling: bool, graphs: bool) -> None:
    """Prefix caching, chunked prefill, MTP (the head's own MoE block; planted drafts, accepted and rejected) and
    async scheduling or the emulated CUDA graphs together give the plain run's outputs, rows mapped to slots other
    than their own."""
    monkeypatch.setattr(cuda_graphs, "EMULATE", graphs)
    path = _scenario_path(ckpts)
    arrivals, aborts, _ = scenario(path)
    engine = scenario_engine(path, "mtp", async_scheduling=async_scheduling)
    assert (engine.runner.graphs is not None) == graphs
    assert isinstance(engine.runner.mtp, Qwen3NextMTPHead)
    assert isinstance(engine.runner.mtp.layers[0].mlp, SparseMoeBlock)
    slots = SlotRecorder(engine)
    plant_drafts(engine, {rid: out.outputs[0].token_ids for rid, out in plain_run.items() if rid != "d"})
    got = drive(engine, arrivals, aborts)
    engine.assert_no_leaks()
    assert slots.saw_non_identity()
    assert set(got) == set(plain_run) and len(got["d"].outputs[0].token_ids) == 12  # "d" samples: draws differ
    assert_same_outputs({r: o for r, o in got.items() if r != "d"}, {r: o for r, o in plain_run.items() if r != "d"})
    metrics = engine.get_metrics()
    assert metrics["hyserve:num_preemptions"] > 0 and metrics["hyserve:prefix_cache_hits"] > 0  # type: ignore[operator]
    assert metrics["hyserve:spec_decode_num_accepted_tokens"] > 0  # type: ignore[operator]


@pytest.mark.parametrize("async_scheduling,graphs", [(True, True), (False, False)], ids=["async-graphs", "sync-eager"])
def test_a_scripted_speculation_length_gives_the_plain_outputs(ckpts: CheckpointCache, plain_run: dict,
                                                               plant_drafts: Callable,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               async_scheduling: bool, graphs: bool) -> None:
    """The speculation length changing step after step (``hyserve.testing.scenarios.K_SCHEDULE``: 3, 0, 1, 0, 0,
    2, ...) through the scenario with the family's MTP head: the plain run's outputs, every row kept to its step's
    k (``assert_k_schedule_matches``)."""
    monkeypatch.setattr(cuda_graphs, "EMULATE", graphs)
    got, recorder, engine = run_k_schedule(_scenario_path(ckpts), plain_run, plant_drafts, async_scheduling, graphs)
    assert_k_schedule_matches(got, recorder, engine, plain_run)


@pytest.mark.parametrize("kw", [
    pytest.param({"tensor_parallel_size": 2}, marks=pytest.mark.slow),  # tp2_ep shards the rest the same way
    {"tensor_parallel_size": 2, "enable_expert_parallel": True},
    {"pipeline_parallel_size": 2, "pp_layer_partition": [4, 2], "async_scheduling": True},
], ids=["tp2", "tp2_ep", "pp2_uneven"])
def test_parallel_matches_transformers(ckpts: CheckpointCache, kw: dict[str, Any]) -> None:
    """Tensor parallel 2 on gloo (each rank one key-head group of the fused projections, half of every expert and
    of the dense MLPs; expert parallel: 3 whole experts each), and stages of 4 and 2 layers, MTP on."""
    path = ckpts.get("causal", "attn_last_gdn_run", family=FAMILY, decoder_sparse_step=2, num_experts_per_tok=3,
                     with_mtp=True)
    llm = make_llm(path, max_num_batched_tokens=16, speculative_config=MTP, **kw)
    _check(llm, ckpts.reference(path), random_prompts(3, [9, 30, 17], seed=5))
    assert llm.get_metrics()["hyserve:spec_decode_num_draft_tokens"] > 0  # type: ignore[operator]
    llm.llm_engine.shutdown()


def test_dummy_weights_from_config_json_alone(ckpts: CheckpointCache, tmp_path: Path) -> None:
    """``load_format="dummy"`` on a directory holding only config.json: one and two ranks (each taking its key-head
    group of one drawn fused tensor) give the same tokens, MTP on."""
    src = ckpts.get("causal", "gdn3_attn1", family=FAMILY, with_mtp=True, decoder_sparse_step=2)
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(os.path.join(src, "config.json"), bare / "config.json")
    outs = []
    for tp in (1, 2):
        llm = make_llm(str(bare), load_format="dummy", seed=0, tensor_parallel_size=tp, speculative_config=MTP)
        got = llm.generate([{"prompt_token_ids": p} for p in random_prompts(2, [5, 12], seed=2)], GREEDY,
                           use_tqdm=False)
        outs.append([o.outputs[0].token_ids for o in got])
        llm.llm_engine.shutdown()
    assert outs[0] == outs[1]


@pytest.mark.parametrize("mlp_only_layers,sabotage", [((1,), False), ((0,), False), ((1,), True)],
                         ids=["moe_head", "dense_head", "moe_head_top1"])
def test_the_mtp_heads_drafts_match_a_transformers_built_head(ckpts: CheckpointCache, mlp_only_layers: tuple[int],
                                                              sabotage: bool) -> None:
    """MTP k = 1, one request: every draft is the argmax of a head built from transformers' Qwen3-Next modules,
    its layer's feed-forward block the MoE block or (layer 0 in ``mlp_only_layers``) the dense MLP; with the MoE
    block routing each token to its first choice only (sabotage) the drafts are not."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextModel, Qwen3NextRMSNorm

    path = ckpts.get("causal", "attn_first", family=FAMILY, num_experts_per_tok=3, with_mtp=True,
                     mlp_only_layers=mlp_only_layers)
    llm = make_llm(path, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    block = llm.llm_engine.runner.mtp.layers[0].mlp  # type: ignore[union-attr]
    assert isinstance(block, MLP if 0 in mlp_only_layers else SparseMoeBlock)
    if sabotage:
        assert isinstance(block, SparseMoeBlock)
        block.top_k = 1
    check_mtp_drafts(llm, path, ckpts.reference(path), Qwen3NextModel, Qwen3NextRMSNorm, sabotage)


def test_a_fused_projection_of_the_wrong_shape_or_qwen3_5s_split_ones_are_refused(ckpts: CheckpointCache,
                                                                                  tmp_path: Path) -> None:
    """``in_proj_qkvz`` one key-head group short, or the four projections of Qwen3.5 instead of the two fused ones:
    refused by name before anything loads."""
    from safetensors.torch import load_file, save_file

    src = ckpts.get("causal", "gdn3_attn1", family=FAMILY, decoder_sparse_step=2, num_experts_per_tok=2)
    path = tmp_path / "bad"
    shutil.copytree(src, path)
    tensors = load_file(path / "model.safetensors")
    name = "model.layers.1.linear_attn.in_proj_qkvz.weight"
    short = {**tensors, name: tensors[name][: tensors[name].shape[0] // 2].contiguous()}
    save_file(short, path / "model.safetensors")
    with pytest.raises(ValueError, match=rf"shape mismatch for '{name}'"):
        make_llm(str(path))
    split = {n: t for n, t in tensors.items() if not n.startswith("model.layers.1.linear_attn.in_proj_")}
    split.update({f"model.layers.1.linear_attn.in_proj_{p}.weight": t for p, t in zip(
        ("qkv", "z"), tensors[name].split([128, 64]), strict=True)})
    save_file(split, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"unexpected tensor.*in_proj_qkv\.weight"):
        make_llm(str(path))


def _raw(ckpts: CheckpointCache, **kw: Any) -> dict[str, Any]:
    with open(os.path.join(ckpts.get("causal", "attn_first", family=FAMILY, **kw), "config.json"),
              encoding="utf-8") as f:
        return dict(json.load(f))


def test_the_config(ckpts: CheckpointCache) -> None:
    """The registry's entry and draft head; transformers' layer pattern when ``layer_types`` is absent; the MTP
    layers of ``num_nextn_predict_layers`` (absent as in the releases: 1); the weights counted as transformers'
    model holds them, for the tiny mixed model and the 80B-A3B shape; unsupported values refused by name."""
    raw = _raw(ckpts, mlp_only_layers=(0, 2), with_mtp=True)
    cfg = parse_qwen3_next_config(raw)
    assert isinstance(cfg, Config) and registry.model_class(load_model_config(
        ckpts.get("causal", "attn_first", family=FAMILY, mlp_only_layers=(0, 2), with_mtp=True))) \
        is Qwen3NextForCausalLM
    assert registry.draft_head(cfg).build is Qwen3NextMTPHead
    assert cfg.mtp_num_hidden_layers == 1 and cfg.mlp_only_layers == (0, 2) and cfg.rotary_dim == 8
    assert "intermediate_size" in cfg.tensor_parallel_counts()
    fields = {k: v for k, v in raw.items() if k not in ("architectures", "num_nextn_predict_layers")}
    with torch.device("meta"):
        ref = Reference(Qwen3NextConfig(**fields))
        ours = Qwen3NextForCausalLM(cfg)
    assert cfg.num_parameters() == sum(p.numel() for p in ref.parameters())
    assert cfg.num_parameters() == sum(p.numel() for p in ours.parameters())
    real = {k: v for k, v in Qwen3NextConfig().to_dict().items() if k not in ("architectures", "layer_types")}
    real_cfg = parse_qwen3_next_config({**real, "model_type": "qwen3_next", "full_attention_interval": 4})
    assert real_cfg.layer_types == Qwen3NextConfig().layer_types
    assert real_cfg.layer_types[:4] == [LINEAR_ATTENTION] * 3 + [FULL_ATTENTION]
    assert "intermediate_size" not in real_cfg.tensor_parallel_counts() and real_cfg.mtp_num_hidden_layers == 1
    assert parse_qwen3_next_config({**raw, "num_nextn_predict_layers": 0}).mtp_num_hidden_layers == 0
    with torch.device("meta"):
        n = sum(p.numel() for p in Reference(Qwen3NextConfig()).parameters())
    assert real_cfg.num_parameters() == n and 79e9 < n < 82e9
    legacy = parse_qwen3_next_config({**raw, "layer_types": ["attention", "mamba", "mamba", "attention"]})
    assert legacy.layer_types == [FULL_ATTENTION, LINEAR_ATTENTION, LINEAR_ATTENTION, FULL_ATTENTION]
    for bad, match in [({"rope_parameters": {"rope_type": "mrope", "rope_theta": 1e4}}, "rope_type 'mrope'"),
                       ({"mlp_only_layers": [4]}, "mlp_only_layers"),
                       ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
                       ({"linear_num_value_heads": 3}, "not a multiple of linear_num_key_heads"),
                       ({"hidden_act": "gelu"}, "hidden_act"),
                       ({"num_experts_per_tok": 7}, "num_experts_per_tok"),
                       ({"model_type": "qwen3_5_moe_text"}, "not Qwen3-Next's")]:
        with pytest.raises(ValueError, match=match):
            parse_qwen3_next_config({**raw, **bad})


def test_the_cache_specs_are_qwen3_5s(ckpts: CheckpointCache) -> None:
    """The fused projections and the experts change no cache: the specs equal the dense Qwen3.5 model's."""
    from hyserve.model.qwen3_5 import Qwen3_5ForCausalLM
    from hyserve.model.qwen3_5_config import Qwen3_5Config

    cfg = load_model_config(ckpts.get("causal", "attn_first", family=FAMILY, mlp_only_layers=(0, 2), with_mtp=True))
    dense = Qwen3_5Config(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(Qwen3_5Config)})
    with torch.device("meta"):
        assert Qwen3NextForCausalLM(cfg).cache_specs(torch.bfloat16) == Qwen3_5ForCausalLM(dense).cache_specs(
            torch.bfloat16)

"""Qwen4-Exp served by the engine against transformers 5.24's own classes (in a process of their own:
``hyserve.testing.qwen4_exp``), teacher-forced, float32 on the CPU: hyper-connections, PLE layers (n-gram
restart after EOS inside prompts, the token context and the PLE conv window carried across chunks), QSA attention
whose selection matters (prompts longer than the indexer budget), both checkpoint forms, and the features that
compose on one process (prefix caching with recurrent snapshots, chunked prefill, preemption, aborts, staggered
arrivals with rows on slots other than their own, n-gram speculation, async scheduling, emulated CUDA graphs)."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from hyserve import SamplingParams
from hyserve.layers.ple import PerLayerEmbedding
from hyserve.layers.qsa import IndexedAttention
from hyserve.model.qwen4_exp import Qwen4ExpForCausalLM
from hyserve.model.registry import load_model_config
from hyserve.testing.engine import SlotRecorder, assert_matches_reference, drive, make_llm, random_prompts
from hyserve.testing.families import CheckpointCache
from hyserve.testing.qwen4_exp import QWEN4_EXP, QWEN4_EXP_LAYER_PATTERNS
from hyserve.testing.scenarios import assert_same_outputs, plain_scenario_run, scenario, scenario_engine
from hyserve.worker import cuda_graphs

FAMILY = QWEN4_EXP.name
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)


def _get(ckpts: CheckpointCache, form: str, pattern: str, **kw: Any) -> str:
    """A checkpoint with eight indexer heads: a block scores exactly 0 only when every head's dot product is
    negative, and exact ties are the one place the engine (earlier block first) and transformers (torch.topk's
    order) may choose differently."""
    return ckpts.get(form, pattern, family=FAMILY, **{"indexer_n_heads": 8, **kw})


def _prompts(path: str, seed: int = 3) -> list[list[int]]:
    """Lengths 1 to 40 (the indexer budget is 8: long prompts select), EOS inside two of them (PLE restarts)."""
    eos = load_model_config(path).ple_eos_token_id  # type: ignore[attr-defined]
    prompts = random_prompts(5, [1, 7, 23, 40, 17], seed=seed)
    prompts[2][5] = eos
    prompts[3][11] = prompts[3][12] = eos
    return prompts


def _check(llm: Any, ref: Any, prompts: list[list[int]]) -> None:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert_matches_reference(ref, prompt, out)


@pytest.mark.parametrize("pattern", list(QWEN4_EXP_LAYER_PATTERNS))
def test_matches_transformers(ckpts: CheckpointCache, pattern: str) -> None:
    path = _get(ckpts, "causal", pattern)
    llm = make_llm(path, max_num_batched_tokens=16)  # chunks: the PLE and GDN states cross steps
    model = llm.llm_engine.runner.model
    assert type(model) is Qwen4ExpForCausalLM
    layers = list(model.model.layers)
    assert any(layer.ple is not None for layer in layers)
    assert all(isinstance(layer.self_attn, IndexedAttention) for layer in layers if hasattr(layer, "self_attn"))
    _check(llm, ckpts.reference(path), _prompts(path))


def test_vlm_form_and_dense_attention(ckpts: CheckpointCache) -> None:
    """The conditional form (``model.language_model.*``, a vision tower) with config.json's released attention
    name; and a checkpoint without the indexer fields is refused by transformers, so the dense path is the
    engine's own: checked against the QSA model with a budget no prompt exceeds (QSA is then dense)."""
    path = _get(ckpts, "vlm", "attn_both_ends", attention_name="indexed_attention")
    _check(make_llm(path, max_num_batched_tokens=16), ckpts.reference(path), _prompts(path, seed=4))
    wide = _get(ckpts, "causal", "attn_mid", indexer_budget=64)
    dense = os.path.join(ckpts.root, "qwen4_dense")
    if not os.path.exists(dense):
        shutil.copytree(wide, dense)
        cfg = json.load(open(os.path.join(dense, "config.json")))
        for key in ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget",
                    "indexer_compress_ratio"):
            cfg.pop(key)
        json.dump(cfg, open(os.path.join(dense, "config.json"), "w"))
        weights = load_file(os.path.join(dense, "model.safetensors"))
        save_file({n: t for n, t in weights.items() if ".indexer." not in n}, os.path.join(dense, "model.safetensors"),
                  metadata={"format": "pt"})
    llm = make_llm(dense, max_num_batched_tokens=16)
    assert not any(isinstance(m, IndexedAttention) for m in llm.llm_engine.runner.model.modules())
    _check(llm, ckpts.reference(wide), _prompts(wide, seed=5))


def test_a_checkpoint_whose_hash_constants_differ_is_refused(ckpts: CheckpointCache, tmp_path: Any) -> None:
    """The n-gram constants a checkpoint stores are checked against the config's (never loaded); the n-gram table
    loads from its shards."""
    path = _get(ckpts, "causal", "attn_mid")
    names = load_file(os.path.join(path, "model.safetensors"))
    assert any(".ngram_embedding.shard_" in n for n in names) and not any(n.endswith("ngram_embedding.weight")
                                                                            for n in names)
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    key = next(n for n in names if n.endswith("ple_embedding.layer_multipliers"))
    names[key] = names[key] + 2
    save_file(names, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="layer_multipliers"):
        make_llm(str(bad))


def _scenario_path(ckpts: CheckpointCache) -> str:
    return _get(ckpts, "causal", "attn_mid")


@pytest.fixture(scope="module")
def plain_run(ckpts: CheckpointCache) -> dict:
    """The scenario synchronously without speculation: it preempts, hits the prefix cache (PLE and GDN states from
    snapshots), aborts, and matches transformers."""
    return plain_scenario_run(ckpts, _scenario_path(ckpts))


@pytest.mark.parametrize("async_scheduling,graphs", [(True, False), (False, True)], ids=["async", "graphs"])
def test_features_compose(ckpts: CheckpointCache, plain_run: dict, monkeypatch: pytest.MonkeyPatch,
                          async_scheduling: bool, graphs: bool) -> None:
    """Prefix caching, chunked prefill, preemption, an abort, n-gram drafts (verify rows: the PLE context and conv
    window per candidate position) and async scheduling or the emulated CUDA graphs give the plain run's outputs,
    rows mapped to slots other than their own."""
    monkeypatch.setattr(cuda_graphs, "EMULATE", graphs)
    path = _scenario_path(ckpts)
    arrivals, aborts, _ = scenario(path)
    engine = scenario_engine(path, "ngram", async_scheduling=async_scheduling)
    assert sum(isinstance(m, PerLayerEmbedding) for m in engine.runner.model.modules()) >= 1
    slots = SlotRecorder(engine)
    got = drive(engine, arrivals, aborts)
    engine.assert_no_leaks()
    assert slots.saw_non_identity()
    assert set(got) == set(plain_run)
    assert_same_outputs({r: o for r, o in got.items() if r != "d"}, {r: o for r, o in plain_run.items() if r != "d"})
    metrics = engine.get_metrics()
    assert metrics["hyserve:num_preemptions"] > 0 and metrics["hyserve:prefix_cache_hits"] > 0  # type: ignore[operator]
    assert metrics["hyserve:spec_decode_num_draft_tokens"] > 0  # type: ignore[operator]


def test_the_sum_of_streams_is_not_the_mix(ckpts: CheckpointCache, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage: the final mixer reads one stream instead of the gated mean over streams; the check catches it."""
    from hyserve.layers import hyper_connection

    path = _get(ckpts, "causal", "attn_mid")
    original = hyper_connection.GatedResidual.mix

    def first_stream(self: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        mixed, w = original(self, x)
        return (x[..., : self.hidden_size] if w is None else mixed), w

    monkeypatch.setattr(hyper_connection.GatedResidual, "mix", first_stream)
    with pytest.raises(AssertionError, match=r"logprob|reference argmax"):
        _check(make_llm(path, max_num_batched_tokens=16), ckpts.reference(path), _prompts(path))

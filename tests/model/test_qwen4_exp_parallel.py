"""Qwen4-Exp over several processes (gloo, CPU, float32) against transformers 5.24 (``hyserve.testing.qwen4_exp``),
teacher-forced greedy: tensor parallel 2 (the GDN, attention and MoE layers sharded; the hyper-connection linears,
the PLE layers and the QSA indexer whole on every rank), uneven pipeline stages (the handover between stages is the
wide residual, all ``hc_count`` streams; the first stage embeds, the last mixes the streams for the LM head), with
an attention layer and a PLE layer on different stages, async scheduling, and the engine scenario (prefix hits with
recurrent snapshots, chunks, preemption, an abort, n-gram drafts verified on every stage) giving one process's
outputs. Prompts carry EOS inside (PLE restarts) and exceed the indexer budget (QSA selects)."""

from __future__ import annotations

import dataclasses
import os
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hyserve import SamplingParams
from hyserve.config import FULL_ATTENTION
from hyserve.distributed import parallel_state
from hyserve.layers.sharding import shard_of
from hyserve.model.qwen3_5 import MissingLayer
from hyserve.model.qwen4_exp import Qwen4ExpForCausalLM
from hyserve.model.registry import load_model_config
from hyserve.testing.engine import assert_matches_reference, drive, make_llm, random_prompts
from hyserve.testing.qwen4_exp import Qwen4ExpReference, load_qwen4_exp_reference, write_tiny_qwen4_exp_checkpoint
from hyserve.testing.scenarios import assert_same_outputs, scenario, scenario_engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
GDN, ATTN = "linear_attention", "full_attention"
# Seven layers: PLE on layers 2 and 6 (1-indexed), attention on 4 and 7. Stages "3,4": PLE 2 | attention 4, 7 and
# PLE 6; stages "2,2,2,1": PLE 2 | attention 4 | PLE 6 | attention 7.
SEVEN = [GDN, GDN, GDN, ATTN, GDN, GDN, ATTN]
SEVEN_PLE = [2, 6]


@pytest.fixture(scope="module")
def seven(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Qwen4ExpReference]]:
    """The seven-layer checkpoint (eight indexer heads, as test_qwen4_exp's ``_get``) and its reference."""
    path = write_tiny_qwen4_exp_checkpoint(tmp_path_factory.mktemp("qwen4_seven") / "ckpt", layer_types=SEVEN,
                                           ple_layer_ids=SEVEN_PLE, indexer_n_heads=8)
    ref = load_qwen4_exp_reference(path)
    yield path, ref
    ref.close()


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


def _stage_of(partition: list[int], layer: int) -> int:
    return next(s for s in range(len(partition)) if layer < sum(partition[: s + 1]))


def _stage_model(monkeypatch: pytest.MonkeyPatch, cfg: Any, partition: list[int], stage: int,
                 tp: int = 1) -> Qwen4ExpForCausalLM:
    """Stage ``stage``'s model on the meta device, as a worker of that stage (and ``tp`` ranks) builds it."""
    monkeypatch.setattr(parallel_state, "_PP_RANK", stage)
    monkeypatch.setattr(parallel_state, "_PP_SIZE", len(partition))
    monkeypatch.setattr(parallel_state, "_STAGE_LAYERS", parallel_state.stage_range(partition, stage))
    monkeypatch.setattr(parallel_state, "_TP_SIZE", tp)
    with torch.device("meta"):
        return Qwen4ExpForCausalLM(cfg)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_each_stage_holds_only_its_tensors(seven: tuple[str, Qwen4ExpReference], monkeypatch: pytest.MonkeyPatch,
                                           tied: bool) -> None:
    """Stages "2,2,2,1": each builds and loads only its layers; the first the embedding, the last the streams'
    mixer, the LM head (and the embedding when tied to it)."""
    cfg = dataclasses.replace(load_model_config(seven[0]), tie_word_embeddings=tied)
    partition = [2, 2, 2, 1]
    for stage in range(4):
        model = _stage_model(monkeypatch, cfg, partition, stage)
        start, end = parallel_state.stage_range(partition, stage)
        first, last = stage == 0, stage == 3
        own = [i for i, layer in enumerate(model.model.layers) if not isinstance(layer, MissingLayer)]
        assert own == list(range(start, end))
        assert (model.model.hyper_connection_mixer is not None) == last
        assert (model.model.embed_tokens is not None) == (first or (last and tied))
        assert model.holds("model.hyper_connection_mixer.input_mix_weight_down.weight") == last
        assert model.holds("model.hyper_connection_mixer.hc_norm.weight") == last
        assert model.holds("model.embed_tokens.weight") == (first or (last and tied))
        assert model.holds("lm_head.weight") == last
        for i in range(7):
            assert model.holds(f"model.layers.{i}.attn_hyper_connection.hc_norm.weight") == (start <= i < end)
            assert model.holds(f"model.layers.{i}.ple.key_proj.weight") == (start <= i < end)
        names = {n for n, _ in model.named_parameters()}
        assert all(model.holds(n) for n in names), [n for n in names if not model.holds(n)]


def test_tensor_parallel_replicates_hyper_connections_ple_and_indexer(seven: tuple[str, Qwen4ExpReference],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """With two ranks the mixers and experts are sharded; the hyper-connection linears, the PLE layers and the QSA
    indexer are whole (the loader copies the whole checkpoint tensor into each rank)."""
    cfg = load_model_config(seven[0])
    one = dict(_stage_model(monkeypatch, cfg, [7], 0).named_parameters())
    two = dict(_stage_model(monkeypatch, cfg, [7], 0, tp=2).named_parameters())
    assert one.keys() == two.keys()
    replicated = [n for n in two if "hyper_connection" in n or ".ple." in n or ".indexer." in n]
    assert any(".ple." in n for n in replicated) and any(".indexer." in n for n in replicated)
    for name in replicated:
        assert shard_of(two[name]) is None and two[name].shape == one[name].shape, name
    assert any(shard_of(p) is not None for n, p in two.items() if ".linear_attn." in n)
    assert any(shard_of(p) is not None for n, p in two.items() if ".self_attn." in n and ".indexer." not in n)


def test_tensor_parallel_matches_transformers(seven: tuple[str, Qwen4ExpReference]) -> None:
    path, ref = seven
    llm = make_llm(path, max_num_batched_tokens=16, tensor_parallel_size=2)  # chunks: states cross steps
    _check(llm, ref, _prompts(path))
    llm.llm_engine.shutdown()


@pytest.mark.parametrize("partition,async_scheduling",
                         [([3, 4], False), pytest.param([2, 2, 2, 1], False, marks=pytest.mark.slow), ([3, 4], True)],
                         ids=["pp2_graphs", "pp4", "pp2_async"])
def test_uneven_pipeline_stages_match_transformers(seven: tuple[str, Qwen4ExpReference], partition: list[int],
                                                   async_scheduling: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two stages also with the stages' CUDA graphs (emulated in the workers): a later stage's graph reads the
    wide streams from its persistent input buffer."""
    graphs = len(partition) == 2 and not async_scheduling
    if graphs:
        monkeypatch.setenv("HYSERVE_EMULATE_CUDA_GRAPHS", "1")
    path, ref = seven
    cfg = load_model_config(path)
    attn_stage = {_stage_of(partition, i) for i, t in enumerate(cfg.layer_types) if t == FULL_ATTENTION}
    ple_stage = {_stage_of(partition, i - 1) for i in SEVEN_PLE}
    assert ple_stage - attn_stage, (ple_stage, attn_stage)  # a PLE layer on a stage without attention
    llm = make_llm(path, max_num_batched_tokens=16, pipeline_parallel_size=len(partition),
                   pp_layer_partition=partition, async_scheduling=async_scheduling,
                   **({"cuda_graph_sizes": [8]} if graphs else {}))
    _check(llm, ref, _prompts(path, seed=4))
    if graphs:
        replays = llm.llm_engine.executor.collective_rpc("graph_replays")
        assert all(r.get("decode", 0) > 0 for r in replays), replays
    llm.llm_engine.shutdown()


def test_handing_over_only_the_first_stream_is_caught(seven: tuple[str, Qwen4ExpReference], tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage in the worker processes (``sitecustomize``): a stage sends its first stream in every stream's
    place; the next stage's outputs must not match the reference."""
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent("""
        from hyserve.distributed.parallel_state import StageLink

        original = StageLink.send

        def first_stream_only(self, *parts):
            assert len(parts) == 1, "Qwen4-Exp hands its streams over alone"
            h = parts[0].shape[-1] // 4
            original(self, parts[0][..., :h].repeat(1, 4))

        StageLink.send = first_stream_only
    """))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("HYSERVE_WORKER_MULTIPROC_METHOD", "exec")  # sitecustomize: fresh interpreters
    path, ref = seven
    llm = make_llm(path, max_num_batched_tokens=16, pipeline_parallel_size=2, pp_layer_partition=[3, 4])
    try:
        with pytest.raises(AssertionError, match=r"logprob|reference argmax"):
            _check(llm, ref, _prompts(path, seed=4))
    finally:
        llm.llm_engine.shutdown()


def test_scenario_on_stages_gives_one_process_outputs(seven: tuple[str, Qwen4ExpReference]) -> None:
    """The engine scenario (prefix hits restoring PLE and GDN snapshots, chunks, preemption, an abort, a seeded
    sampled request) with n-gram drafts and async scheduling on stages "2,5" (the verify steps' PLE and GDN
    candidates committed late on the first stage) gives the one-process run's outputs."""
    path = seven[0]
    arrivals, aborts, _ = scenario(path)
    engine = scenario_engine(path, "ngram")
    want = drive(engine, arrivals, aborts)
    engine.assert_no_leaks()
    metrics = engine.get_metrics()
    assert metrics["hyserve:num_preemptions"] > 0 and metrics["hyserve:prefix_cache_hits"] > 0  # type: ignore[operator]
    engine.shutdown()
    engine = scenario_engine(path, "ngram", async_scheduling=True, pipeline_parallel_size=2,
                             pp_layer_partition=[2, 5])
    got = drive(engine, arrivals, aborts)
    engine.assert_no_leaks()
    assert engine.executor.collective_rpc("num_uncommitted_steps") == [0, 0]
    assert engine.get_metrics()["hyserve:spec_decode_num_draft_tokens"] > 0  # type: ignore[operator]
    engine.shutdown()
    assert_same_outputs(got, want)

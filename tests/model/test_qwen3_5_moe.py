"""Qwen3.5-MoE (``Qwen3_5MoeForCausalLM``, ``Qwen3_5MoeForConditionalGeneration``) on the CPU, against
transformers' ``Qwen3_5MoeForCausalLM`` (float32, teacher-forced), on tiny checkpoints with 6 experts, top-k 2 and 3,
``norm_topk_prob`` both ways, a shared expert, GDN and attention layers in several orders:

* greedy tokens and log-probabilities match the reference in both forms and both expert layouts (fused
  ``experts.gate_up_proj`` / ``down_proj``, and one tensor per expert and projection);
* the scheduling scenario (staggered arrivals, prefix-cache hits, chunked prefill, an abort, preemption) gives the
  reference's greedy tokens, and async scheduling, n-gram and MTP (k = 2, the MTP layer's own MoE) speculation and
  the emulated CUDA graphs give the plain synchronous run's outputs (planted MTP drafts are accepted);
* the MTP head's drafts and output (its own MoE block) match a head built from transformers' modules
  (``hyserve.testing.qwen3_5_moe.reference_mtp``), both layouts, and a head routing to one expert instead of three
  is caught;
* the conditional form with images (one, several, none; a prefix-cache hit past an image) matches transformers'
  ``Qwen3_5MoeForConditionalGeneration``, and served (images, MTP, prefix caching) to the openai client as offline;
* pipeline parallel over three uneven stages with MTP and async scheduling matches the reference;
* tensor parallel 2 on gloo (each expert's intermediate dimension split, the MTP head's too) matches the reference,
  both layouts;
* expert parallel on tensor parallel 2 (each rank holds half the experts whole, the MTP head's too) gives the greedy
  tokens of one process and of plain tensor parallel 2, both layouts; a rank holding the other's experts is caught;
  experts that do not split over the ranks are refused, and with one rank the flag changes nothing;
* a sabotaged MoE (top-k weights not renormalized, routing in bfloat16) fails the reference check;
* ``load_format="dummy"`` draws the experts from config.json alone, the same for one and two ranks;
* the loader refuses a checkpoint with both layouts of one layer, or an expert missing; the config counts the expert
  weights exactly as transformers' model holds them.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5MoeForCausalLM as Reference
from transformers import Qwen3_5MoeTextConfig

from hyserve import SamplingParams
from hyserve.engine.llm_engine import LLMEngine
from hyserve.layers import moe
from hyserve.layers.moe import SparseMoeBlock
from hyserve.model.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeMTPHead
from hyserve.model.qwen3_5_moe_config import parse_qwen3_5_moe_config
from hyserve.model.registry import load_model_config
from hyserve.testing.engine import assert_matches_reference, drive, make_llm, random_prompts
from hyserve.testing.families import CheckpointCache
from hyserve.testing.images import tiny_png
from hyserve.testing.qwen3_5_moe import (
    QWEN3_5_MOE,
    check_mtp_drafts,
    load_moe_vlm_reference_model,
    write_tiny_moe_vlm_checkpoint,
)
from hyserve.testing.qwen3_5_vlm import reference_vlm_greedy, reference_vlm_inputs, reference_vlm_logits
from hyserve.testing.scenarios import (
    assert_k_schedule_matches,
    assert_same_outputs,
    plain_scenario_run,
    run_k_schedule,
    scenario,
    scenario_engine,
)
from hyserve.worker import cuda_graphs

FAMILY = QWEN3_5_MOE.name
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)


def _check(llm, ref, prompts: list[list[int]]) -> None:  # type: ignore[no-untyped-def]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert_matches_reference(ref, prompt, out)


@pytest.mark.parametrize("form,layout,pattern,top_k,norm", [
    ("causal", "fused", "gdn3_attn1", 2, True),
    ("causal", "per_expert", "attn_first", 3, False),
    ("conditional", "fused", "attn_both_ends", 3, True),
    ("conditional", "per_expert", "gdn3_attn1", 2, False),
])
def test_matches_transformers(ckpts: CheckpointCache, form: str, layout: str, pattern: str, top_k: int,
                              norm: bool) -> None:
    path = ckpts.get(form, pattern, family=FAMILY, layout=layout, num_experts_per_tok=top_k, norm_topk_prob=norm)
    llm = make_llm(path, max_num_batched_tokens=16)
    model = llm.llm_engine.runner.model
    assert type(model) is Qwen3_5MoeForCausalLM
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert len(blocks) == 4 and all(b.top_k == top_k and b.renormalize == norm for b in blocks)
    _check(llm, ckpts.reference(path), random_prompts(4, [1, 7, 23, 40], seed=3))


def _scenario_path(ckpts: CheckpointCache) -> str:
    # The shared expert as wide as an expert (elsewhere 48 against 32): on the fused kernels
    # (tests/kernels/test_moe_engine.py runs this file's feature test under the interpreter) it is stacked with them.
    return ckpts.get("conditional", "gdn3_attn1", family=FAMILY, with_mtp=True, num_experts_per_tok=3,
                     shared_expert_intermediate_size=32)


@pytest.fixture(scope="module")
def plain_run(ckpts: CheckpointCache) -> dict:
    """The scenario run synchronously without speculation: it preempts and hits, and matches the reference."""
    return plain_scenario_run(ckpts, _scenario_path(ckpts))


@pytest.mark.parametrize("spec,async_scheduling,graphs", [
    ("plain", False, False), ("plain", True, True), ("ngram", True, False), ("mtp", False, True), ("mtp", True, False),
])
def test_features_compose_with_moe(ckpts: CheckpointCache, plain_run: dict, monkeypatch: pytest.MonkeyPatch,
                                   plant_drafts: Callable, spec: str, async_scheduling: bool, graphs: bool) -> None:
    monkeypatch.setattr(cuda_graphs, "EMULATE", graphs)
    path = _scenario_path(ckpts)
    arrivals, aborts, _ = scenario(path)
    engine = scenario_engine(path, spec, async_scheduling=async_scheduling)
    assert (engine.runner.graphs is not None) == graphs
    if spec == "mtp":
        assert isinstance(engine.runner.mtp, Qwen3_5MoeMTPHead)
        plant_drafts(engine, {rid: out.outputs[0].token_ids for rid, out in plain_run.items() if rid != "d"})
    got = drive(engine, arrivals, aborts)
    engine.assert_no_leaks()
    if spec == "plain":
        assert_same_outputs(got, plain_run)
    else:  # the seeded sampled request "d" draws differently once drafts are verified
        assert set(got) == set(plain_run) and len(got["d"].outputs[0].token_ids) == 12
        assert_same_outputs({r: o for r, o in got.items() if r != "d"},
                            {r: o for r, o in plain_run.items() if r != "d"})
    metrics = engine.get_metrics()
    if spec != "plain":
        assert metrics["hyserve:spec_decode_num_draft_tokens"] > 0  # type: ignore[operator]
    if spec == "mtp":
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


# fused: slow (the suite's budget; test_expert_parallel_on_tensor_parallel_2[fused] runs plain tensor parallel 2 too)
@pytest.mark.parametrize("layout", [pytest.param("fused", marks=pytest.mark.slow), "per_expert"])
def test_tensor_parallel_2_splits_the_experts(ckpts: CheckpointCache, layout: str) -> None:
    """Each rank holds its half of every expert's (and the shared expert's) intermediate dimension, the MTP head's
    MoE block too (per-expert layout: MTP speculation on)."""
    path = ckpts.get("causal", "attn_first", family=FAMILY, layout=layout, num_experts_per_tok=3, with_mtp=True)
    spec = {"method": "mtp", "num_speculative_tokens": 2} if layout == "per_expert" else None
    llm = make_llm(path, tensor_parallel_size=2, max_num_batched_tokens=16, speculative_config=spec)
    _check(llm, ckpts.reference(path), random_prompts(3, [9, 30, 17], seed=5))
    if spec is not None:
        assert llm.get_metrics()["hyserve:spec_decode_num_draft_tokens"] > 0  # type: ignore[operator]
    llm.llm_engine.shutdown()


def _tokens(llm, prompts: list[list[int]]) -> list[list[int]]:  # type: ignore[no-untyped-def]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


# Loaded first by the worker processes (PYTHONPATH): rank 1 builds rank 0's experts instead of its own.
WRONG_PLACEMENT = """
from hyserve.distributed import parallel_state
from hyserve.layers import moe

right = moe.expert_range


def wrong(num_experts):
    start, end = right(num_experts)
    return (0, end - start) if parallel_state.tp_rank() == 1 else (start, end)


moe.expert_range = wrong
"""


@pytest.mark.parametrize("layout", ["fused", pytest.param("per_expert", marks=pytest.mark.slow)])
def test_expert_parallel_on_tensor_parallel_2(ckpts: CheckpointCache, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                                              layout: str) -> None:
    """Each of the two gloo ranks holds 3 of the 6 experts whole (the MTP head's MoE block too, MTP speculation on):
    the greedy tokens are one process's and plain tensor parallel 2's. Fused layout: a rank 1 that holds rank 0's
    experts (rank 0's tensors loaded, its experts' tokens computed twice) changes the tokens. Per-expert layout:
    with one rank the flag changes nothing (one INFO line)."""
    import logging

    path = ckpts.get("causal", "attn_first", family=FAMILY, layout=layout, num_experts_per_tok=3, with_mtp=True)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    prompts = random_prompts(3, [9, 30, 17], seed=5)
    runs = {}
    for name, kw in {"one": {}, "tp2": {"tensor_parallel_size": 2},
                     "ep2": {"tensor_parallel_size": 2, "enable_expert_parallel": True}}.items():
        with caplog.at_level(logging.INFO, logger="hyserve"):
            llm = make_llm(path, max_num_batched_tokens=16, speculative_config=spec, **kw)
        runs[name] = _tokens(llm, prompts)
        llm.llm_engine.shutdown()
    assert runs["ep2"] == runs["one"] == runs["tp2"]
    assert sum("each of the 2 tensor-parallel ranks holds 3 whole experts of 6" in r.message
               for r in caplog.records) == 1
    if layout == "per_expert":
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="hyserve"):
            llm = make_llm(path, max_num_batched_tokens=16, enable_expert_parallel=True)
        assert sum("nothing to change with tensor_parallel_size=1" in r.message for r in caplog.records) == 1
        assert _tokens(llm, prompts) == runs["one"]
        return
    (tmp_path / "sitecustomize.py").write_text(WRONG_PLACEMENT)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("HYSERVE_WORKER_MULTIPROC_METHOD", "exec")  # sitecustomize: fresh interpreters
    llm = make_llm(path, max_num_batched_tokens=16, speculative_config=spec, tensor_parallel_size=2,
                   enable_expert_parallel=True)
    assert _tokens(llm, prompts) != runs["one"]
    llm.llm_engine.shutdown()


def test_experts_that_do_not_split_over_the_ranks_are_refused(ckpts: CheckpointCache) -> None:
    """5 experts over 2 ranks: refused before any worker starts, naming both numbers."""
    path = ckpts.get("causal", "attn_first", family=FAMILY, layout="fused", num_experts=5)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide num_experts=5"):
        make_llm(path, tensor_parallel_size=2, enable_expert_parallel=True)


def test_three_uneven_pipeline_stages_with_mtp(ckpts: CheckpointCache) -> None:
    """Stages of 3, 2 and 1 layers (per-expert checkpoint: each stage loads only its layers' experts), the last
    stage running the MTP head's MoE block, async scheduling."""
    path = ckpts.get("causal", "attn_last_gdn_run", family=FAMILY, layout="per_expert", num_experts_per_tok=3,
                     with_mtp=True)
    llm = make_llm(path, pipeline_parallel_size=3, pp_layer_partition=[3, 2, 1], max_num_batched_tokens=16,
                   async_scheduling=True, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    _check(llm, ckpts.reference(path), random_prompts(3, [9, 30, 17], seed=5))
    llm.llm_engine.shutdown()


def _unnormalized(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return ROUTE(logits, top_k, False)


def _bf16(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits.to(torch.bfloat16), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.float(), experts


ROUTE = moe.route


@pytest.mark.parametrize("sabotage", [_unnormalized, _bf16], ids=["no_renormalization", "bf16_routing"])
def test_a_sabotaged_moe_is_caught(ckpts: CheckpointCache, monkeypatch: pytest.MonkeyPatch, sabotage: object) -> None:
    path = ckpts.get("causal", "gdn3_attn1", family=FAMILY, layout="fused", num_experts_per_tok=2,
                     norm_topk_prob=True)
    monkeypatch.setattr(moe, "route", sabotage)
    llm = make_llm(path, max_num_batched_tokens=16)
    with pytest.raises(AssertionError, match=r"logprob|reference argmax"):
        _check(llm, ckpts.reference(path), random_prompts(4, [1, 7, 23, 40], seed=3))


def _copy(ckpts: CheckpointCache, tmp_path: Path, layout: str) -> tuple[str, dict[str, torch.Tensor]]:
    src = ckpts.get("causal", "gdn3_attn1", family=FAMILY, layout=layout)
    dst = str(tmp_path / layout)
    shutil.copytree(src, dst)
    return dst, load_file(os.path.join(dst, "model.safetensors"))


def test_both_layouts_of_one_layer_or_a_missing_expert_are_refused(ckpts: CheckpointCache, tmp_path: Path) -> None:
    path, tensors = _copy(ckpts, tmp_path, "per_expert")
    _, fused = _copy(ckpts, tmp_path, "fused")
    both = {**tensors, "model.layers.1.mlp.experts.down_proj": fused["model.layers.1.mlp.experts.down_proj"]}
    save_file(both, os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match=r"both 'model\.layers\.1\.mlp\.experts\.down_proj' and its pieces"):
        make_llm(path)
    save_file({n: t for n, t in tensors.items() if n != "model.layers.2.mlp.experts.4.up_proj.weight"},
              os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensor.*model\.layers\.2\.mlp\.experts\.4\.up_proj\.weight"):
        make_llm(path)


def test_the_config_counts_the_expert_weights(ckpts: CheckpointCache) -> None:
    path = ckpts.get("causal", "attn_first", family=FAMILY, layout="per_expert", num_experts_per_tok=3)
    cfg = load_model_config(path)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    with torch.device("meta"):
        ref = Reference(Qwen3_5MoeTextConfig(**{k: v for k, v in raw.items() if k != "architectures"}))
        ours = Qwen3_5MoeForCausalLM(cfg)
    assert cfg.num_parameters() == sum(p.numel() for p in ref.parameters())
    assert cfg.num_parameters() == sum(p.numel() for p in ours.parameters())
    # The Qwen3.5-35B-A3B text shape (transformers' defaults): 34.66e9 parameters, as transformers builds it.
    real = {k: v for k, v in Qwen3_5MoeTextConfig().to_dict().items() if k not in ("architectures",)}
    real_cfg = parse_qwen3_5_moe_config({**real, "model_type": "qwen3_5_moe_text"})
    with torch.device("meta"):
        n = sum(p.numel() for p in Reference(Qwen3_5MoeTextConfig()).parameters())
    assert real_cfg.num_parameters() == n and 34e9 < n < 35e9
    with pytest.raises(ValueError, match="mlp_only_layers"):
        parse_qwen3_5_moe_config({**raw, "mlp_only_layers": [0]})


IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def _user(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def _image(w: int, h: int, seed: int) -> Image.Image:
    return Image.open(io.BytesIO(tiny_png(w, h, seed))).convert("RGB")


def test_images_in_the_conditional_form_match_transformers(tmp_path: Path) -> None:
    """The MoE VLM with images (one, several, none) and prefix caching, against transformers'
    ``Qwen3_5MoeForConditionalGeneration`` given the same pixels and grids."""
    path = write_tiny_moe_vlm_checkpoint(tmp_path / "vlm", seed=3, num_experts_per_tok=3)
    ref = load_moe_vlm_reference_model(path)
    llm = make_llm(path, enable_prefix_caching=True, max_num_batched_tokens=32)
    cases = [(_user(f"{IMAGE}What is shown?"), [_image(40, 32, 1)]),
             (_user(f"Compare {IMAGE} with {IMAGE}."), [_image(48, 48, 2), _image(16, 40, 3)]),
             (_user("No image here, only text."), []),
             (_user(f"{IMAGE}What is shown?"), [_image(40, 32, 1)])]  # a prefix-cache hit past the image
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=0)
    prompts = [{"prompt": t, "multi_modal_data": {"image": i}} if i else t for t, i in cases]
    outs = llm.generate(prompts[:3], params, use_tqdm=False) + llm.generate(prompts[3:], params, use_tqdm=False)
    assert (outs[3].num_cached_tokens or 0) >= 16
    for (text, imgs), out in zip(cases, outs, strict=True):
        ids, pixels, grid = reference_vlm_inputs(path, text, imgs)
        assert out.prompt_token_ids == ids
        want = reference_vlm_greedy(ref, ids, pixels, grid, 5)
        assert out.outputs[0].token_ids == want, text
        logp = torch.log_softmax(reference_vlm_logits(ref, ids + want, pixels, grid)[len(ids) - 1 : -1].double(), -1)
        for j, tok in enumerate(want):
            assert abs(out.outputs[0].logprobs[j][tok].logprob - float(logp[j, tok])) < 3e-3  # type: ignore[index]


@pytest.mark.parametrize("layout,sabotage", [("fused", False), ("per_expert", False), ("fused", True)])
def test_the_mtp_heads_moe_drafts_match_a_transformers_built_head(ckpts: CheckpointCache, layout: str,
                                                                  sabotage: bool) -> None:
    """MTP k = 1, one request: every draft is the argmax of the reference head's logits at its position; with the
    head's MoE block routing each token to its first choice only (sabotage) the drafts are not."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm, Qwen3_5MoeTextModel

    path = ckpts.get("causal", "attn_first", family=FAMILY, layout=layout, num_experts_per_tok=3, with_mtp=True)
    llm = make_llm(path, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    if sabotage:
        block = llm.llm_engine.runner.mtp.layers[0].mlp  # type: ignore[union-attr]
        assert isinstance(block, SparseMoeBlock) and block.renormalize
        block.top_k = 1
    check_mtp_drafts(llm, path, ckpts.reference(path), Qwen3_5MoeTextModel, Qwen3_5MoeRMSNorm, sabotage)


@pytest.mark.parametrize("form", ["causal", "conditional"])
def test_the_registry_builds_the_family_whose_cache_specs_are_qwen3_5s(ckpts: CheckpointCache, form: str) -> None:
    """Both architectures resolve to the MoE family; the experts add no cache: the specs equal those of the dense
    Qwen3.5 model with the same mixers."""
    import dataclasses

    from hyserve.model import registry
    from hyserve.model.qwen3_5 import Qwen3_5ForCausalLM
    from hyserve.model.qwen3_5_config import Qwen3_5Config

    cfg = load_model_config(ckpts.get(form, "attn_both_ends", family=FAMILY, with_mtp=True))
    assert cfg.architecture == ("Qwen3_5MoeForCausalLM" if form == "causal" else "Qwen3_5MoeForConditionalGeneration")
    assert registry.model_class(cfg) is Qwen3_5MoeForCausalLM
    assert registry.draft_head(cfg).build is Qwen3_5MoeMTPHead
    dense = Qwen3_5Config(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(Qwen3_5Config)})
    for dtype in (torch.float32, torch.bfloat16):
        with torch.device("meta"):
            specs = Qwen3_5MoeForCausalLM(cfg).cache_specs(dtype)
            want = Qwen3_5ForCausalLM(dense).cache_specs(dtype)
        assert specs == want


def test_served_with_images_mtp_and_prefix_caching(tmp_path: Path) -> None:
    """``hyserve``'s server on the MoE VLM with MTP and prefix caching answers the official openai client's image
    chat as the offline engine does (whose image outputs match transformers above), the second ask hitting the
    cache past the image."""
    from hyserve import LLM
    from hyserve.config import EngineConfig
    from hyserve.server import AsyncEngine, build_app
    from hyserve.testing import png_data_url
    from hyserve.testing.server import ServerThread

    path = write_tiny_moe_vlm_checkpoint(tmp_path / "served", seed=5, with_mtp=True)
    kw: dict = dict(device="cpu", dtype="float32", cpu_cache_memory_bytes=64 * 1024 * 1024)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    async_engine = AsyncEngine(LLMEngine(EngineConfig(model=path, enable_prefix_caching=True,
                                                      speculative_config=spec, **kw)), start=False)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_data_url(
        tiny_png(32, 48, seed=1))}}, {"type": "text", "text": "What is in this picture?"}]}]
    with ServerThread(async_engine, app=build_app(async_engine, "moe")) as server:
        client = server.client()
        answers = [client.chat.completions.create(model="moe", messages=messages,  # type: ignore[arg-type]
                                                  max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
                   for _ in range(2)]
        metrics = server.metrics()
        server.settle()
    assert metrics["hyserve:prefix_cache_hits"] > 0 and metrics["hyserve:spec_decode_num_drafts"] > 0
    want = LLM(model=path, **kw).chat(messages, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                      use_tqdm=False)[0].outputs[0].text
    assert [a.choices[0].message.content for a in answers] == [want, want]


@pytest.mark.slow  # 13 s: the suite's budget (dummy weights over two ranks stay: test_load_format.py)
def test_dummy_weights_from_config_json_alone_with_tp_and_mtp(ckpts: CheckpointCache, tmp_path: Path) -> None:
    """``load_format="dummy"`` on a directory holding only the MoE config.json: every expert tensor drawn (none
    left as allocated), and two tensor-parallel ranks serve the single-process model (each takes its shard of one
    drawn tensor; expert parallel: its experts of the drawn stack), MTP on."""
    src = ckpts.get("causal", "gdn3_attn1", family=FAMILY, with_mtp=True, num_experts_per_tok=3)
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(os.path.join(src, "config.json"), bare / "config.json")
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    outs = []
    for tp, ep in ((1, False), (2, False), (2, True)):
        llm = make_llm(str(bare), load_format="dummy", seed=0, tensor_parallel_size=tp, speculative_config=spec,
                       enable_expert_parallel=ep)
        if tp == 1:
            experts = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, moe.Experts)]
            assert len(experts) == 4
            for t in [e.gate_up_proj for e in experts] + [e.down_proj for e in experts]:
                assert float(t.abs().max()) <= 1e-3 and float(t.std()) > 0  # drawn as the dummy format draws
        got = llm.generate([{"prompt_token_ids": p} for p in random_prompts(2, [5, 12], seed=2)], GREEDY,
                           use_tqdm=False)
        outs.append([o.outputs[0].token_ids for o in got])
        llm.llm_engine.shutdown()
    assert outs[0] == outs[1] == outs[2]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec", [None, "mtp"])
def test_cuda_graphs_with_the_fused_experts_match_eager_and_transformers(ckpts: CheckpointCache,
                                                                          spec: str | None) -> None:
    """On the GPU (float32): the fused expert kernels inside captured CUDA graphs, with prefix caching, chunked
    prefill, staggered arrivals, and MTP under async scheduling, equal the eager run and the reference."""
    path = _scenario_path(ckpts)
    ref = ckpts.reference(path)
    prompts = random_prompts(7, [9, 30, 3, 17, 25, 5, 12], seed=81)
    prompts[3] = prompts[1][:20] + prompts[3]  # a shared prefix
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    kw: dict[str, object] = dict(device="cuda", max_num_batched_tokens=32, max_num_seqs=6, num_state_slots=6,
                                 num_kv_blocks=128, enable_prefix_caching=True)
    if spec is not None:
        kw["speculative_config"] = {"method": spec, "num_speculative_tokens": 3}
    eager = make_llm(path, enforce_eager=True, **kw)
    graphed = make_llm(path, async_scheduling=spec == "mtp", **kw)
    graphs = graphed.llm_engine.runner.graphs
    assert graphs is not None and all(s.graphs for s in graphs.sets.values()), "nothing was captured"
    arrivals = {3 * i: [(f"r{i}", p, params)] for i, p in enumerate(prompts)}
    want = drive(eager.llm_engine, arrivals)
    got = drive(graphed.llm_engine, arrivals)
    replayed = {n: s.num_replays for n, s in graphs.sets.items()}
    assert all(replayed[n] > 0 for n in (("verify", "mtp") if spec else ("decode",))), replayed
    for i, p in enumerate(prompts):
        assert got[f"r{i}"].outputs[0].token_ids == want[f"r{i}"].outputs[0].token_ids
        assert_matches_reference(ref, p, got[f"r{i}"])
    graphed.llm_engine.assert_no_leaks()

"""The attention layers' long prefill rows through SDPA (``HYSERVE_PREFILL_ATTENTION=sdpa``; on CUDA ``auto`` takes
it where FlashAttention runs) in the engine, against transformers' reference (float32, CPU, teacher-forced): the
threshold lowered to 8 queries so that the tiny model's chunks cross it, with prefix caching (a row after a cached
context: the lower-right mask over keys read back from the paged cache), chunked prefill (later chunks after the
first), MTP with planted drafts (verify rows beside prefill rows: the short rows' paged sub-batch), async
scheduling, staggered arrivals and an abort. A sabotaged mask (upper-left after a context) must be seen."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hyserve import SamplingParams
from hyserve.kernels.attention import sdpa
from hyserve.layers import attention as attention_layer
from hyserve.testing import load_reference_model, write_tiny_checkpoint
from hyserve.testing.engine import assert_matches_reference, drive, make_llm, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
MTP = {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}
THRESHOLD = 8

_A, _B, _C, _E, _F = random_prompts(5, [53, 23, 41, 5, 30], seed=11)
PROMPTS = {"a": _A, "b": _B, "c": _C, "d": _A + random_prompts(1, [12], seed=12)[0], "e": _E, "f": _F}
ARRIVALS = {0: [("a", PROMPTS["a"], GREEDY), ("b", PROMPTS["b"], GREEDY)], 2: [("c", PROMPTS["c"], GREEDY)],
            4: [("d", PROMPTS["d"], GREEDY), ("f", PROMPTS["f"], GREEDY)], 5: [("e", PROMPTS["e"], GREEDY)]}
ABORTS = {6: ["f"]}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("prefill_attention") / "m", with_mtp=True)
    return path, load_reference_model(path)


@pytest.fixture
def sdpa_rows(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """The SDPA path forced with the lowered threshold; records each row it takes as (queries, context before)."""
    monkeypatch.setenv("HYSERVE_PREFILL_ATTENTION", "sdpa")
    monkeypatch.setattr(attention_layer, "SDPA_MIN_QUERIES", THRESHOLD)
    taken: list[tuple[int, int]] = []
    real = attention_layer.paged_attention_rows

    def recorded(*args: Any) -> Any:
        taken.extend((n, ctx - n) for _, _, n, ctx in args[-1].sdpa_rows)  # the step's RowPlan
        return real(*args)

    monkeypatch.setattr(attention_layer, "paged_attention_rows", recorded)
    return taken


def count_wrong(ref: Any, got: dict[str, Any]) -> int:
    """How many of the driven requests' outputs differ from transformers' (``PROMPTS``)."""
    wrong = 0
    for rid, out in got.items():
        try:
            assert_matches_reference(ref, PROMPTS[rid], out)
        except AssertionError:
            wrong += 1
    return wrong


def engine_kw(**kw: Any) -> dict[str, Any]:
    return dict(max_num_batched_tokens=32, enable_prefix_caching=True, recurrent_snapshot_interval=16,
                num_snapshot_slots=32, **kw)


def test_features_compose_with_sdpa_prefill_rows(tiny: tuple[str, Any], sdpa_rows: list[tuple[int, int]],
                                                 plant_drafts: Any) -> None:
    path, ref = tiny
    plain = drive(make_llm(path, **engine_kw()).llm_engine, ARRIVALS, ABORTS)
    sdpa_rows.clear()
    llm = make_llm(path, **engine_kw(speculative_config=MTP, async_scheduling=True))
    plant_drafts(llm.llm_engine, {rid: list(out.outputs[0].token_ids) for rid, out in plain.items()})
    got = drive(llm.llm_engine, ARRIVALS, ABORTS)
    for rid, out in got.items():
        if rid != "f":  # aborted mid-flight
            assert_matches_reference(ref, PROMPTS[rid], out)
    assert any(ctx == 0 for _, ctx in sdpa_rows) and any(ctx > 0 for _, ctx in sdpa_rows), sdpa_rows
    metrics = llm.get_metrics()
    assert metrics["hyserve:spec_decode_num_accepted_tokens"] > 0 and metrics["hyserve:prefix_cache_hits"] > 0
    llm.llm_engine.assert_no_leaks()


@pytest.mark.parametrize("mtp_rows_through_sdpa", [True, False], ids=["mtp_sdpa", "mtp_paged_sabotage"])
def test_the_mtp_heads_prompt_pass_takes_sdpa_and_matches_a_transformers_built_head(
        tiny: tuple[str, Any], sdpa_rows: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch,
        mtp_rows_through_sdpa: bool) -> None:
    """MTP k = 1, one 19-token prompt: the head's pass over the prompt's positions is a long row, which takes SDPA as
    the target's attention layers' rows do (one more such row than the target has attention layers), and every
    draft and the head's output equal those of a head built from transformers' Qwen3.5 modules. Sabotage: the
    pass's metadata without the host's row offsets (the paged kernel, as before) is seen by the count."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5TextModel

    from hyserve.testing.qwen3_5_moe import check_mtp_drafts
    from hyserve.worker.spec_decode import mtp_drafter

    if not mtp_rows_through_sdpa:
        real = mtp_drafter.StepMetadata

        def without_host_offsets(**kw: Any) -> Any:
            return real(**{**kw, "query_start_loc_cpu": None, "seq_lens_cpu": None})

        monkeypatch.setattr(mtp_drafter, "StepMetadata", without_host_offsets)
    path, ref = tiny
    llm = make_llm(path, speculative_config={"method": "mtp", "num_speculative_tokens": 1, "adaptive": False})
    check_mtp_drafts(llm, path, ref, Qwen3_5TextModel, Qwen3_5RMSNorm, sabotaged=False)
    attention_layers = ref.config.layer_types.count("full_attention")
    prompt_rows = [q for q, ctx in sdpa_rows if q == 19 and ctx == 0]
    if mtp_rows_through_sdpa:
        assert len(prompt_rows) == attention_layers + 1, (sdpa_rows, attention_layers)
    else:
        assert len(prompt_rows) == attention_layers, (sdpa_rows, attention_layers)


def test_an_upper_left_mask_after_a_context_is_seen(tiny: tuple[str, Any], sdpa_rows: list[tuple[int, int]],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path, ref = tiny
    monkeypatch.setattr(sdpa, "causal_lower_right", lambda n, ctx_len: None)  # is_causal: top-left aligned
    got = drive(make_llm(path, **engine_kw()).llm_engine, ARRIVALS)
    assert any(ctx > 0 for _, ctx in sdpa_rows)
    wrong = count_wrong(ref, got)
    assert wrong > 0, "the sabotaged mask went unseen"


@pytest.fixture(scope="module")
def two_attention_layers(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("prefill_attention_2") / "m",
                                 layer_types=["linear_attention", "full_attention"] * 2)
    return path, load_reference_model(path)


@pytest.mark.parametrize("kept_past_its_step", [False, True], ids=["per_step", "stale_plan_sabotage"])
def test_each_step_plans_its_rows_once(two_attention_layers: tuple[str, Any], sdpa_rows: list[tuple[int, int]],
                                       monkeypatch: pytest.MonkeyPatch, kept_past_its_step: bool) -> None:
    """The split of a step's rows between SDPA and the paged kernels (``RowPlan``) is worked out by the step's first
    attention layer and taken by the others: as many plans as steps with long rows, each taken by every attention
    layer, and every output right against transformers. Sabotaged, the first plan is kept for every later step (a
    memo that outlives its step): the outputs go wrong."""
    path, ref = two_attention_layers
    plans: list[sdpa.RowPlan] = []
    real_of = attention_layer.RowPlan.of

    def counted(*args: Any) -> sdpa.RowPlan:
        if kept_past_its_step and plans:
            return plans[0]
        plans.append(real_of(*args))
        return plans[-1]

    monkeypatch.setattr(attention_layer.RowPlan, "of", staticmethod(counted))
    taken: list[sdpa.RowPlan] = []
    real_rows = attention_layer.paged_attention_rows
    monkeypatch.setattr(attention_layer, "paged_attention_rows", lambda *a: (taken.append(a[-1]), real_rows(*a))[1])
    got = drive(make_llm(path, **engine_kw()).llm_engine, ARRIVALS)
    wrong = count_wrong(ref, got)
    if kept_past_its_step:
        assert wrong > 0, "a plan kept past its step went unseen"
        return
    assert wrong == 0
    layers = ref.config.layer_types.count("full_attention")
    assert layers == 2 and len(plans) > 1
    assert len(taken) == len(plans) * layers
    assert all(taken[i] is plans[i // layers] for i in range(len(taken)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sdpa_rows_in_the_engine(tiny: tuple[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """On the card, at the shipped threshold (128 queries) with prompts of 150-440 tokens, prefix caching and
    256-token chunks: a float32 model with SDPA forced (its own CUDA backend) token-exact against transformers, and
    a bf16 model on ``auto`` (FlashAttention) beside the paged kernel alone (``triton``) within bf16's rule."""
    from test_ssm_state_dtype import TOP2, assert_parts_only_at_close_calls

    path, ref = tiny
    long_a, long_b, long_c = random_prompts(3, [300, 150, 200], seed=13)
    prompts = [long_a, long_b, long_c, long_a + random_prompts(1, [140], seed=14)[0]]  # the last after a cached context
    kw: dict[str, Any] = dict(device="cuda", max_num_batched_tokens=256, enable_prefix_caching=True,
                              max_model_len=1024)
    taken: list[int] = []
    real = attention_layer.paged_attention_rows
    monkeypatch.setattr(attention_layer, "paged_attention_rows",
                        lambda *a: (taken.append(a[-1].num_rows), real(*a))[1])
    monkeypatch.setenv("HYSERVE_PREFILL_ATTENTION", "sdpa")
    outs = make_llm(path, dtype="float32", **kw).generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                                          use_tqdm=False)
    for p, out in zip(prompts, outs, strict=True):
        assert_matches_reference(ref, p, out)
    assert taken
    runs = {}
    for mode in ("auto", "triton"):
        monkeypatch.setenv("HYSERVE_PREFILL_ATTENTION", mode)
        taken.clear()
        runs[mode] = make_llm(path, dtype="bfloat16", **kw).generate([{"prompt_token_ids": p} for p in prompts],
                                                                      TOP2, use_tqdm=False)
        assert bool(taken) == (mode == "auto"), (mode, taken)
    assert_parts_only_at_close_calls(runs["auto"], runs["triton"])

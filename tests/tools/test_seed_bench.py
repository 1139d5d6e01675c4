"""The seed's deployment benchmark (``benchmarks/seed_bench.py``) on the CPU: the GUI-agent trace's properties (prompt
lengths within bounds, the sliding two-screenshot history, shared prefixes between an episode's steps, determinism),
the closed loop of agents through hyserve's ``AsyncEngine`` on a tiny VLM with images, MTP and planted acceptance,
every reported figure recomputed from the records, the report's ratios; the seed's FP8_DYNAMIC form (written by
``peer_bench.py write --fp8 ct_dynamic``) loaded by hyserve against transformers' dequantized reference, and the
27B shape's files. Sabotaged variants (a trace that keeps every screenshot, a client that times from the batch's
start) are caught."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import peer_bench as pb
import seed_bench as sb
import shapes

from hyserve import LLM, SamplingParams
from hyserve.layers.linear import LinearBase
from hyserve.testing import vlm_special_token_ids, write_tiny_vlm_checkpoint
from hyserve.testing.engine import random_prompts
from hyserve.testing.fp8 import FP8, assert_close_to_fp8_reference, load_fp8_reference, write_fp8_checkpoint

TINY = sb.SEED_TRACES["tiny"]
START = vlm_special_token_ids()["<|vision_start|>"]
PAD = vlm_special_token_ids()["<|image_pad|>"]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_tiny_vlm_checkpoint(tmp_path_factory.mktemp("vlm"), with_mtp=True, seed=3)


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _outputs(ep: sb.Episode) -> list[list[int]]:
    return [[7 + j % 5] * n for j, n in enumerate(ep.output_lens)]


def window_problems(prompts: sb.SeedPrompts, ep: sb.Episode) -> list[str]:
    """What breaks the sliding window in ``ep``'s prompts: step s must carry min(s + 1, 3) images (the current
    screenshot and the two before it), the stand-in text of every older screenshot and of no shown one, and the
    images asked for must be those screenshots, in order."""
    problems = []
    outputs = _outputs(ep)
    for step in range(ep.num_steps):
        ids = prompts.ids(ep, step, outputs)
        want = list(range(max(0, step - 2), step + 1))
        if ids.count(PAD) != len(want) or ids.count(START) != len(want):
            problems.append(f"step {step}: {ids.count(PAD)} images, want {len(want)}")
        for k in range(step + 1):
            stand_in = ep.earlier[k]
            found = any(ids[i : i + len(stand_in)] == stand_in for i in range(len(ids)))
            if found != (k not in want):
                problems.append(f"step {step}: screenshot {k}'s stand-in text {'present' if found else 'missing'}")
        images = prompts.request(ep, step, outputs)["multi_modal_data"]["image"]
        if [i.tobytes() for i in images] != [prompts.screenshot(ep, k).tobytes() for k in want]:
            problems.append(f"step {step}: not screenshots {want}")
    return problems


def test_trace_prompts_are_within_bounds_and_deterministic(vlm: str) -> None:
    """Every step's prompt (placeholders expanded) lies in ``prompt_len``; an episode is cut before a step that would
    pass it; the same seed gives the same trace, another seed another one."""
    prompts = sb.SeedPrompts(vlm, TINY, seed=0)
    lens, cut = [], 0
    for i in range(40):
        ep = prompts.episode(i)
        outputs = [[0] * n for n in ep.output_lens]
        full = [prompts.expanded_len(ep, s, outputs) for s in range(ep.drawn_steps)]
        lens += full[: ep.num_steps]
        if ep.num_steps < ep.drawn_steps:
            cut += 1
            assert full[ep.num_steps] > TINY.prompt_len[1]
        assert all(TINY.output_len[0] <= n <= TINY.output_len[1] for n in ep.output_lens)
        assert TINY.steps[0] <= ep.drawn_steps <= TINY.steps[1]
    assert TINY.prompt_len[0] <= min(lens) and max(lens) <= TINY.prompt_len[1]
    assert cut > 0  # the bound is met by cutting, not by luck
    again, other = sb.SeedPrompts(vlm, TINY, seed=0), sb.SeedPrompts(vlm, TINY, seed=1)
    for i in range(5):
        a, b, c = prompts.episode(i), again.episode(i), other.episode(i)
        assert prompts.ids(a, 1, _outputs(a)) == again.ids(b, 1, _outputs(b))
        assert prompts.screenshot(a, 1).tobytes() == again.screenshot(b, 1).tobytes()
        assert prompts.ids(a, 0, _outputs(a)) != other.ids(c, 0, _outputs(c))
    # The expanded length is what hyserve's processor makes of the prompt (checked by the engine run below too).
    assert prompts.image_tokens == 24


def test_sliding_window_and_shared_prefixes(vlm: str) -> None:
    """Step s shows screenshots s-2 .. s; consecutive steps share the prompt up to the screenshot that leaves the
    window (the whole previous prompt while none leaves); every episode shares the system prompt."""
    prompts = sb.SeedPrompts(vlm, TINY, seed=0)
    eps = [prompts.episode(i) for i in range(12)]
    long = [ep for ep in eps if ep.num_steps >= 4]
    assert long
    for ep in eps:
        assert window_problems(prompts, ep) == []
    for ep in long:
        outputs = _outputs(ep)
        for s in range(ep.num_steps - 1):
            a, b = prompts.ids(ep, s, outputs), prompts.ids(ep, s + 1, outputs)
            common = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            if s + 1 <= 2:  # no screenshot leaves: the previous prompt is a prefix of this one
                assert common == len(a)
            else:  # screenshot s - 2 turns into text: shared up to its image
                assert common == next(i for i, t in enumerate(a) if t == START)
    first = [prompts.ids(ep, 0, _outputs(ep)) for ep in eps]
    for ids in first[1:]:  # the system prompt (and the chat markup before the first message)
        assert ids[: TINY.prefix_len] == first[0][: TINY.prefix_len]


def test_a_trace_that_keeps_every_screenshot_is_caught(vlm: str) -> None:
    """Sabotage: the window dropped (every screenshot stays an image)."""

    class KeepAll(sb.Episode):
        def visible(self, step: int) -> list[int]:
            return list(range(step + 1))

    prompts = sb.SeedPrompts(vlm, TINY, seed=0)
    ep = next(e for e in (prompts.episode(i) for i in range(12)) if e.num_steps >= 4)
    bad = KeepAll(TINY, ep.index, prompts.prefix, prompts.vocab, 0)
    bad.num_steps = ep.num_steps
    assert any("images, want" in p for p in window_problems(prompts, bad))


# ------------------------------------------------------------------------------------------------ the closed loop


@pytest.fixture(scope="module")
def run(vlm: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The tiny trace through hyserve with the seed's flags (max_model_len lowered for the tiny model), MTP k = 2
    at a planted 0.8, 4 agents, 20 requests."""
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("run") / "hyserve_seed.json"
    rc = sb.main(["measure", "--engine", "hyserve", "--model", vlm, "--scale", "tiny", "--device", "cpu", "--dtype",
                  "float32", "--load-format", "auto", "--engine-flags", "--max-model-len 1024", "--profile-steps",
                  "5,15", "--out", str(out)])
    assert rc == 0
    return dict(json.loads(out.read_text()))


def _records(run: dict[str, Any]) -> list[sb.RequestRecord]:
    return [sb.RequestRecord(**r) for r in run["records"]]


def test_closed_loop_runs_the_trace_and_computes_every_figure(run: dict[str, Any]) -> None:
    """The seed's flags reach hyserve's parser; 20 requests in 4 agents' episodes, each step after its
    predecessor's answer; the figures equal their definitions over the records (numpy percentiles); later steps hit
    the cache; the planted acceptance is reached."""
    assert run["engine_flags"][: len(sb.SEED_FLAGS)] == sb.SEED_FLAGS
    spec = json.loads(run["engine_flags"][run["engine_flags"].index("--speculative-config") + 1])
    assert spec["rejection_sample_method"] == "synthetic" and spec["synthetic_acceptance_rates"] == [0.8, 0.64]
    recs = _records(run)
    sb.check_records(recs, 4)
    fig = run["figures"]
    n = len(recs)
    assert n == TINY.requests == fig["requests"]
    start = min(r.submitted for r in recs)
    end = max(r.finished for r in recs if r.finished is not None)
    ttft = np.array([r.first - r.submitted for r in recs])  # type: ignore[operator]
    e2e = np.array([r.finished - r.submitted for r in recs])  # type: ignore[operator]
    tpot = np.array([(r.finished - r.first) / (r.output_tokens - 1) for r in recs])  # type: ignore[operator]
    prompt = sum(r.prompt_tokens for r in recs)
    cached = sum(r.cached_tokens for r in recs)
    later = [r for r in recs if r.step > 0]
    want = {
        "duration_s": end - start, "requests_per_s": n / (end - start),
        "output_tok_s": sum(r.output_tokens for r in recs) / (end - start),
        "ttft_mean_s": ttft.mean(), "ttft_p50_s": np.percentile(ttft, 50), "ttft_p99_s": np.percentile(ttft, 99),
        "tpot_mean_s": tpot.mean(), "tpot_p50_s": np.percentile(tpot, 50), "tpot_p99_s": np.percentile(tpot, 99),
        "e2e_p50_s": np.percentile(e2e, 50), "e2e_p99_s": np.percentile(e2e, 99),
        "prefix_hit_rate": cached / prompt,
        "prefix_hit_rate_later_steps": sum(r.cached_tokens for r in later) / sum(r.prompt_tokens for r in later),
        "images_per_request": np.mean([min(r.step + 1, 3) for r in recs]),
        **{key: sum(r.cached_tokens for r in rs) / sum(r.prompt_tokens for r in rs)
           for key, rs in (("prefix_hit_rate_step_1", [r for r in recs if r.step == 1]),
                           ("prefix_hit_rate_step_2", [r for r in recs if r.step == 2]),
                           ("prefix_hit_rate_steps_3_on", [r for r in recs if r.step >= 3])) if rs},
        "output_tokens_mean": np.mean([r.max_tokens for r in recs]),  # ignore_eos: every answer its max_tokens
    }
    # the opening burst: every agent's first request (submitted before any request finished)
    burst = [r for r in recs if r.submitted < min(r.finished for r in recs)]  # type: ignore[operator]
    assert sorted(r.episode for r in burst) == sorted({r.episode for r in recs if r.step == 0})[: TINY.concurrency]
    burst_s = max(r.first for r in burst) - start  # type: ignore[operator,type-var]
    want.update(burst_requests=len(burst), burst_s=burst_s,
                burst_prompt_tok_s=sum(r.prompt_tokens - r.cached_tokens for r in burst) / burst_s)
    for key, value in want.items():
        assert fig[key] == pytest.approx(float(value), rel=1e-9), key
    assert 0 < fig["prefix_hit_rate"] < fig["prefix_hit_rate_later_steps"] < 1
    assert all(r.cached_tokens > 0 for r in later)  # every later step resumes from its episode's cache
    assert all(r.prompt_tokens == r.expected_prompt_tokens for r in recs)
    # every request brings one new screenshot, encoded once (the tiny one's rows all stay on the device)
    assert fig["images_encoded"] >= n and fig["images_from_host"] == 0
    assert all(TINY.prompt_len[0] <= r.prompt_tokens <= TINY.prompt_len[1] for r in recs)
    assert (ttft > 0).all() and (ttft <= e2e).all()
    # A closed loop: the agents overlap, and an episode's step waits for the previous step's answer.
    assert len({r.episode for r in recs}) >= 5
    assert fig["spec_planted_acceptance_length"] == pytest.approx(2.44)
    assert 1.6 < fig["spec_mean_acceptance_length"] < 3.0
    assert run["acceptance"]["k"] == 2 and run["notes"]["prompt_tokens_as_expected"]
    # The loop clock, from the warm-up's end: each timed request's images processed once, off the loop thread (the
    # engine's add_request would process them on it, and prepare_prompt would not be called); the loop thread's
    # adding and stepping fit in the run's time.
    assert fig["prepare_images_calls"] == n and fig["prepare_images_s"] > 0
    assert fig["loop_steps"] >= max(r.max_tokens for r in recs) / 3 and fig["loop_step_s"] > 0
    assert 0 < fig["loop_add_request_s"] + fig["loop_step_s"] <= fig["duration_s"] + 1.0
    # The steps' trace: the prompt tokens of the timed requests, each computed once (the first timed step's aside:
    # it may carry the first prompts of every agent at once), the decode-only steps among them, and the figures it
    # gives equal to their definitions.
    steps = np.array(run["steps"])
    assert len(steps) == fig["steps_timed"] and (steps[:, 0] >= 0).all() and (steps[:, 2] <= steps[:, 1]).all()
    computed = prompt - cached
    assert computed - TINY.concurrency * max(r.prompt_tokens for r in recs) <= steps[:, 2].sum() <= computed
    decode = steps[:, 2] == 0
    assert 0 < decode.sum() == fig["steps_decode_only"] < len(steps)
    # The workers' own times of the steps (the CPU's execution times here): one for each step with rows, inside the
    # loop thread's stepping; the figures from them.
    assert 0.8 * len(steps) <= fig["device_steps"] <= len(steps) + 1
    assert 0 < fig["device_prompt_steps_s"] + fig["device_decode_steps_s"] <= fig["loop_step_s"]
    assert fig["device_prompt_tok_s"] > 0 and 0 < fig["device_decode_step_ms_p50"] < 1e3 * fig["loop_step_s"]
    dev = np.array(run["device_steps"])  # the same steps, listed: (seconds, tokens, prompt tokens)
    assert len(dev) == fig["device_steps"] and (dev[:, 2] <= dev[:, 1]).all()
    has = dev[:, 2] > 0
    assert fig["device_prompt_steps_s"] == pytest.approx(dev[has, 0].sum(), abs=1e-6 * len(dev))
    slope, fixed = np.polyfit(dev[has, 2], dev[has, 0], 1)
    assert (fig["device_prompt_us_per_token"], fig["device_prompt_step_fixed_ms"]) == pytest.approx(
        (1e6 * slope, 1e3 * fixed), rel=1e-2, abs=1e-3)
    # The profiled window: ten steps' results, their trace written beside the result (no device on the CPU: no gaps).
    prof = run["profile"]
    assert [tuple(x) for x in prof["steps"]] == [tuple(x) for x in run["steps"][4:14]]
    assert prof["window_us"] == 0.0 and os.path.getsize(run["profile_trace"]) > 0
    # The runner names each step's launches by its kind (the device time is summed by these names on CUDA).
    import trace_gaps

    names = {str(e.get("name")) for e in trace_gaps.trace_events(run["profile_trace"])}
    ours = {n for n in names if n.startswith("hyserve::")}
    assert ours & {"hyserve::step(prompt)", "hyserve::step(decode)"}, ours
    from hyserve.worker.model_runner import STEP_PARTS

    parts = {f"hyserve::{p}" for p in STEP_PARTS}
    # and the parts of a step: every step loads states and runs the forward, and this trace drafts with MTP
    assert {"hyserve::state", "hyserve::forward", "hyserve::sample"} <= ours, ours
    assert ours & {"hyserve::mtp", "hyserve::verify+mtp"}, ours
    assert ours <= {"hyserve::step(prompt)", "hyserve::step(decode)", "hyserve::vision", *parts}, ours
    # (the trace's intervals are rounded to the microsecond)
    assert fig["step_decode_only_s"] == pytest.approx(steps[decode, 0].sum(), abs=1e-6 * len(steps))
    assert fig["step_with_prompt_s"] == pytest.approx(steps[~decode, 0].sum(), abs=1e-6 * len(steps))
    assert fig["step_decode_only_ms_p50"] == pytest.approx(1e3 * np.median(steps[decode, 0]), abs=1e-3)
    slope, fixed = np.polyfit(steps[:, 1], steps[:, 0], 1)
    assert (fig["step_us_per_token"], fig["step_fixed_ms"]) == pytest.approx((1e6 * slope, 1e3 * fixed), rel=1e-2)
    # What the cache learned of each kind of resume point, reported: the kinds this trace resumes from moved away
    # from the prior (1/2) they start at. A rate per snapshot taken, not a probability: a share point that serves
    # several agents' first steps counts each of them, so it may pass 1.
    utilities = {k: fig[f"prefix_cache_utility_{k}"] for k in ("share", "first_image", "prompt_end", "answer",
                                                                "recurred")}
    assert all(u > 0 for u in utilities.values()) and max(abs(u - 0.5) for u in utilities.values()) > 0.1


def test_the_hit_rate_stays_under_the_trace_ideal_and_near_it(run: dict[str, Any]) -> None:
    """The ideal (every snapshot kept, 16-token blocks) bounds what the engine served from its cache (a bound
    computed too low fails here), and with the tiny run's ample cache the engine comes near it (a bound too high
    fails here)."""
    fig = run["figures"]
    assert 0 < fig["prefix_hit_rate"] <= fig["prefix_hit_rate_ideal"] + 1e-12
    assert fig["prefix_hit_rate"] >= 0.8 * fig["prefix_hit_rate_ideal"]


def test_a_client_that_times_from_the_batch_start_is_caught(run: dict[str, Any]) -> None:
    """Sabotage: every request's submission taken as the run's start (TTFT from the batch start, as an offline
    ``generate`` call measures it): the records' check fails and the TTFT figures move."""
    recs = _records(run)
    bad = [dataclasses.replace(r, submitted=min(x.submitted for x in recs)) for r in recs]
    with pytest.raises(AssertionError, match="submitted at"):
        sb.check_records(bad, 4)
    assert sb.figures(bad)["ttft_p50_s"] > run["figures"]["ttft_p50_s"]
    # and a client that ran more agents than asked
    crowd = copy.deepcopy(recs)
    for r in crowd:
        r.submitted, r.first, r.finished = 0.0, 1.0, 2.0
        r.episode, r.step = r.episode * 100 + r.step, 0
    with pytest.raises(AssertionError, match="in flight"):
        sb.check_records(crowd, 4)


def test_report_pairs_the_engines_with_ratios(run: dict[str, Any], tmp_path: Path) -> None:
    """hyserve better by: ours / theirs for higher-is-better figures, theirs / ours for lower-is-better ones; none
    where a figure is missing or not rated."""
    ours = {**run, "figures": {"requests_per_s": 3.0, "ttft_p50_s": 0.5, "tpot_mean_s": 0.02,
                               "prefix_hit_rate": 0.3, "prompt_tokens_mean": 7000.0}}
    theirs = {**run, "engine": "vllm", "version": "0.24.0", "vllm_mode": "default",
              "figures": {"requests_per_s": 2.0, "ttft_p50_s": 1.0, "tpot_mean_s": 0.03, "prefix_hit_rate": 0.4,
                          "prompt_tokens_mean": 7000.0, "output_tok_s": 100.0}}
    a, b = tmp_path / "h.json", tmp_path / "v.json"
    a.write_text(json.dumps(ours))
    b.write_text(json.dumps(theirs))
    entries = {e["measure"]: e for e in sb.report([str(a), str(b)], str(tmp_path / "out"))}
    assert entries["requests_per_s"]["ratio"] == pytest.approx(1.5)
    assert entries["ttft_p50_s"]["ratio"] == pytest.approx(2.0)
    assert entries["tpot_mean_s"]["ratio"] == pytest.approx(1.5)
    assert entries["prefix_hit_rate"]["ratio"] == pytest.approx(0.75)
    assert entries["prompt_tokens_mean"]["ratio"] is None  # a check on the trace, not a speed
    assert entries["output_tok_s"]["ratio"] is None and entries["output_tok_s"]["hyserve"] is None
    # files without the by-step hit rates (written before them): computed from their records
    second = [r for r in run["records"] if r["step"] == 1]
    want = sum(r["cached_tokens"] for r in second) / sum(r["prompt_tokens"] for r in second)
    assert want > 0 and entries["prefix_hit_rate_step_1"]["hyserve"] == pytest.approx(want)
    assert entries["prefix_hit_rate_step_1"]["vllm"] == pytest.approx(want)
    md = (tmp_path / "out" / "seed.md").read_text()
    assert "| TTFT p50, s | 0.500 | 1.000 | 2.00x |" in md and "0.24.0" in md
    assert sb.ratio(2.0, 0.0, True) is None and sb.ratio(1.0, 4.0, False) == 4.0
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "out" / "seed.png").stat().st_size > 0


# ------------------------------------------------------------------------------------------------ the checkpoint


def test_the_27b_files_carry_the_shape_tower_and_fp8_form(tmp_path: Path) -> None:
    """``write --shape 27b --vision 27b --fp8 ct_dynamic --no-weights``: config.json with Qwen3.5-27B's text shape,
    the 27B class's tower (out_hidden_size the text width), one MTP layer and compressed-tensors FP8_DYNAMIC
    (channel weight scales, dynamic per-token activations) keeping ``SEED_FP8_IGNORE`` in bf16."""
    out = str(tmp_path / "s27")
    pb.write("27b", out, "cpu", vision="27b", weights=False, fp8="ct_dynamic")
    cfg = json.loads((tmp_path / "s27" / "config.json").read_text())
    text, vision = cfg["text_config"], cfg["vision_config"]
    for key, value in shapes.SHAPE_27B.items():
        if key not in ("partial_rotary_factor",):
            assert text[key] == value, key
    assert text["mtp_num_hidden_layers"] == 1
    assert text["layer_types"].count("full_attention") == 16
    for key, value in shapes.VISION_27B.items():
        assert vision[key] == value, key
    assert vision["out_hidden_size"] == 5120
    q = cfg["quantization_config"]
    group = q["config_groups"]["group_0"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "float-quantized"
    assert group["weights"]["strategy"] == "channel" and not group["weights"]["dynamic"]
    assert group["input_activations"]["strategy"] == "token" and group["input_activations"]["dynamic"]
    assert q["ignore"] == pb.SEED_FP8_IGNORE
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))  # image requests need the vision tokens
    with pytest.raises(ValueError, match="fp8"):
        pb.write("tiny", str(tmp_path / "x"), "cpu", fp8="block")


def _quantized(llm: LLM) -> dict[str, bool]:
    """Every linear part of the text model and of the MTP head (``mtp.*``) -> whether its weight is FP8."""
    runner = llm.llm_engine.executor.driver_worker.runner
    out = {m.part_name(p): m.weight.dtype == FP8 for module in (runner.model, runner.mtp)
           for m in module.modules() if isinstance(m, LinearBase) for p in m.parts}
    assert any(name.startswith("mtp.") for name in out)
    return out


def test_hyserve_runs_the_seed_fp8_form_as_the_dequantized_reference(tmp_path: Path) -> None:
    """A tiny VLM-form checkpoint quantized with the seed's ignore list: hyserve (MTP 2, prefix caching) generates
    the greedy tokens of transformers' model holding the dequantized weights with per-token FP8 activations; the
    ignored layers (GDN in_proj_a / in_proj_b, the MTP layer) load in bf16, the rest in FP8."""
    path = write_fp8_checkpoint(tmp_path / "ct", "ct_dynamic", form="conditional", with_mtp=True,
                                ignore=list(pb.SEED_FP8_IGNORE))
    llm = LLM(model=path, device="cpu", dtype="float32", max_num_seqs=4, num_kv_blocks=256, num_state_slots=8,
              enable_prefix_caching=True, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=5)
    prompts = random_prompts(3, [29, 41, 35], seed=5)
    runs = [(p, llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0]) for p in prompts]
    quantized = _quantized(llm)
    llm.shutdown()
    assert_close_to_fp8_reference(load_fp8_reference(path), runs, 0.15, 1.5, 0.5, min_clear=10)
    assert sum(quantized.values()) >= 10
    for name, fp8 in quantized.items():
        kept = name.endswith(("in_proj_a", "in_proj_b")) or name.startswith("mtp.")
        assert fp8 != kept, name


def test_the_written_fp8_checkpoint_loads_dummy_and_real(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``peer_bench.py write --fp8 ct_dynamic`` on the tiny shape: with weights, hyserve loads the quantized files
    (FP8 layers, the MTP layer in bf16) and generates; config-only with a small tower of the 27B kind, hyserve's
    ``--load-format dummy`` makes FP8 weights and runs the seed's trace with images and MTP through ``measure``."""
    real = str(tmp_path / "real")
    pb.write("tiny", real, "cpu", fp8="ct_dynamic")
    llm = LLM(model=real, device="cpu", dtype="float32", max_num_seqs=2, num_kv_blocks=64, num_state_slots=4,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    out = llm.generate({"prompt_token_ids": list(range(3, 40))},
                       SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    quantized = _quantized(llm)
    llm.shutdown()
    assert len(out.outputs[0].token_ids) == 6
    assert sum(quantized.values()) >= 10 and not any(v for k, v in quantized.items() if k.startswith("mtp"))
    monkeypatch.setitem(pb.VISIONS, "27b", dict(pb.VISIONS["27b"], depth=1, hidden_size=32, intermediate_size=64,
                                                num_heads=2))
    dummy = str(tmp_path / "dummy")
    pb.write("tiny", dummy, "cpu", vision="27b", weights=False, fp8="ct_dynamic")
    # The tiny shape's tower takes 256x256 pixels at least (Qwen3.5's bounds): 64 placeholder tokens a screenshot.
    trace = dataclasses.replace(TINY, screen=(64, 64), prompt_len=(150, 700), requests=8, concurrency=2)
    monkeypatch.setitem(sb.SEED_TRACES, "tiny", trace)
    result = tmp_path / "dummy.json"
    # vLLM resolves the class from ``architectures`` (without it, a pooling model): written as a saved model would
    assert json.loads((tmp_path / "dummy" / "config.json").read_text())["architectures"] == \
        ["Qwen3_5ForConditionalGeneration"]
    rc = sb.main(["measure", "--engine", "hyserve", "--model", dummy, "--scale", "tiny", "--device", "cpu",
                  "--dtype", "float32", "--engine-flags", "--max-model-len 2048", "--warmup", "0", "--out",
                  str(result), "--cache-layout", "300,2,5"])
    res = json.loads(result.read_text())
    fig = res["figures"]
    assert rc == 0 and fig["requests"] == 8 and fig["prefix_hit_rate_later_steps"] > 0
    assert "--load-format" in res["engine_flags"]
    # the card's counts replayed: the engine took them, and the run says what its cache did under them
    assert {k: res["cache_layout"][k] for k in ("kv_blocks", "state_slots", "snapshots", "given")} == \
        {"kv_blocks": 300, "state_slots": 2, "snapshots": 5, "given": True}
    assert fig["prefix_cache_snapshots_taken"] >= fig["prefix_cache_snapshot_hits"] > 0
    assert fig["prefix_cache_snapshot_evictions"] > 0  # five entries for two agents' snapshots: some are evicted


@pytest.mark.parametrize("text", ["300,2", "a,b,c", "300,0,5", "1,2,3,4,5", "1,2,3,-1"])
def test_a_bad_cache_layout_is_refused(text: str) -> None:
    with pytest.raises(SystemExit, match="cache-layout"):
        sb.cache_layout(text)
    assert sb.cache_layout("300,2,5") == {"num_kv_blocks": 301, "num_state_slots": 2, "num_snapshot_slots": 5,
                                          "num_host_snapshot_slots": 0}
    assert sb.cache_layout("300,2,5,7")["num_host_snapshot_slots"] == 7  # type: ignore[index]
    assert sb.cache_layout(None) is None


def test_the_cache_layout_is_refused_for_vllm(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="hyserve's"):
        sb.main(["measure", "--engine", "vllm", "--model", str(tmp_path), "--cache-layout", "300,2,5"])


# ------------------------------------------------------------------------------------------------ vLLM's side


class _StubArgs:
    """vLLM's ``AsyncEngineArgs`` as far as ``VllmAsync`` uses it: its flags on a parser, the engine args back."""

    @staticmethod
    def add_cli_args(parser: Any) -> Any:
        parser.add_argument("--model")
        parser.add_argument("--engine-flags-seen", nargs="*", default=None)
        return parser

    @staticmethod
    def from_cli_args(args: Any) -> Any:
        return args


class _StubLLM:
    """vLLM's ``AsyncLLM`` as far as the client uses it: ``generate(prompt, params, request_id)`` streaming cumulative
    outputs (the first token alone, then all), every prompt token after the first 10 counted as cached."""

    made: ClassVar[list[Any]] = []

    def __init__(self, args: Any) -> None:
        self.args, self.requests, self.closed = args, [], False

    @classmethod
    def from_engine_args(cls, args: Any, usage_context: Any = None) -> _StubLLM:
        cls.made.append(cls(args))
        cls.made[-1].usage_context = usage_context
        return cls.made[-1]

    async def generate(self, prompt: dict[str, Any], params: Any, request_id: str) -> Any:
        import asyncio
        from types import SimpleNamespace

        self.requests.append((request_id, params))
        ids = list(prompt["prompt_token_ids"])
        for n in (1, params.max_tokens):
            await asyncio.sleep(0.001)
            yield SimpleNamespace(prompt_token_ids=ids, num_cached_tokens=len(ids) - 10,
                                  outputs=[SimpleNamespace(token_ids=[500 + i for i in range(n)])])

    def shutdown(self) -> None:
        self.closed = True


def test_the_vllm_client_takes_the_seed_flags_and_runs_the_loop(vlm: str, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """``measure --engine vllm`` against stand-ins for vLLM's parser and ``AsyncLLM``: the report's flags with the
    synthetic speculative config (the rates of 0.8 per draft token) reach vLLM's parser, every request goes through
    ``generate(prompt, params, request_id)`` with greedy ``ignore_eos`` params, answers outside the text range are
    folded back into it for the next step, and the engine is shut down."""
    import argparse
    import types

    parsed: list[list[str]] = []

    class Parser(argparse.ArgumentParser):
        def parse_args(self, args: Any = None, namespace: Any = None) -> Any:  # type: ignore[override]
            parsed.append(list(args))
            return argparse.Namespace(argv=list(args))

    class Params:
        def __init__(self, **kw: Any) -> None:
            self.__dict__.update(kw)

    mods = {"vllm": types.ModuleType("vllm"), "vllm.engine": types.ModuleType("vllm.engine"),
            "vllm.engine.arg_utils": types.ModuleType("vllm.engine.arg_utils"),
            "vllm.v1": types.ModuleType("vllm.v1"), "vllm.v1.engine": types.ModuleType("vllm.v1.engine"),
            "vllm.v1.engine.async_llm": types.ModuleType("vllm.v1.engine.async_llm"),
            "vllm.utils": types.ModuleType("vllm.utils"),
            "vllm.utils.argparse_utils": types.ModuleType("vllm.utils.argparse_utils"),
            "vllm.usage": types.ModuleType("vllm.usage"),
            "vllm.usage.usage_lib": types.ModuleType("vllm.usage.usage_lib")}
    # vLLM's UsageContext as far as the client names it (vllm/usage/usage_lib.py: an enum of these names)
    mods["vllm.usage.usage_lib"].UsageContext = types.SimpleNamespace(  # type: ignore[attr-defined]
        ENGINE_CONTEXT="engine_context", OPENAI_API_SERVER="openai_api_server")
    mods["vllm"].__version__ = "0.24.0-stub"  # type: ignore[attr-defined]
    mods["vllm"].SamplingParams = Params  # type: ignore[attr-defined]
    mods["vllm.engine.arg_utils"].AsyncEngineArgs = _StubArgs  # type: ignore[attr-defined]
    mods["vllm.v1.engine.async_llm"].AsyncLLM = _StubLLM  # type: ignore[attr-defined]
    mods["vllm.utils.argparse_utils"].FlexibleArgumentParser = Parser  # type: ignore[attr-defined]
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    _StubLLM.made = []
    out = tmp_path / "vllm_seed.json"
    assert sb.main(["measure", "--engine", "vllm", "--model", vlm, "--scale", "tiny", "--device", "cpu",
                    "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    argv = parsed[0]
    assert argv[:2] == ["--model", vlm] and argv[2 : 2 + len(sb.SEED_FLAGS)] == sb.SEED_FLAGS
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {"method": "mtp", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic",
                    "synthetic_acceptance_rates": [0.8, 0.64]}
    assert argv[argv.index("--load-format") + 1] == "dummy" and "--device" not in argv
    llm = _StubLLM.made[0]
    # built as `vllm serve` builds it: its defaults (8,192 tokens a step on an H100) follow the usage context
    assert llm.usage_context == "openai_api_server"
    assert llm.closed and len(llm.requests) == TINY.requests + TINY.concurrency  # the warm-up's first steps too
    assert all(p.temperature == 0.0 and p.ignore_eos and TINY.output_len[0] <= p.max_tokens <= TINY.output_len[1]
               for _, p in llm.requests)
    fig = res["figures"]
    assert fig["requests"] == TINY.requests and res["version"] == "0.24.0-stub"
    assert res["vllm_mode"].startswith("default") and "spec_mean_acceptance_length" not in fig
    assert fig["output_tokens_mean"] == pytest.approx(np.mean([r["max_tokens"] for r in res["records"]]))
    assert res["acceptance"]["planted_acceptance_length"] == pytest.approx(2.44)
    # The stub's answers (ids 500 and up) lie above the tiny VLM's text range (448): folded into it for the history.
    prompts = sb.SeedPrompts(vlm, TINY)
    assert prompts.history_ids([500, 3, 447, 448]) == [52, 3, 447, 0]


def test_no_request_is_submitted_after_the_deadline(vlm: str) -> None:
    """``deadline``: agents stop submitting once the clock passes it; those in flight finish and are recorded."""
    import asyncio

    ticks = [0.0]

    def clock() -> float:
        ticks[0] += 1.0
        return ticks[0]

    class Engine:
        async def stream(self, request_id: str, prompt: dict[str, Any], max_tokens: int) -> Any:
            from types import SimpleNamespace

            await asyncio.sleep(0)
            yield SimpleNamespace(prompt_token_ids=prompt["prompt_token_ids"], num_cached_tokens=0,
                                  outputs=[SimpleNamespace(token_ids=[1] * max_tokens)])

    prompts = sb.SeedPrompts(vlm, TINY)
    full = asyncio.run(sb.run_closed_loop(Engine(), prompts, prompts.episodes(), 4, 20, clock=clock))
    assert len(full) == 20
    ticks[0] = 0.0
    cut = asyncio.run(sb.run_closed_loop(Engine(), prompts, prompts.episodes(), 4, 20, clock=clock, deadline=30.0))
    assert 0 < len(cut) < 20 and all(r.submitted <= 30.0 for r in cut)
    assert all(r.finished is not None for r in cut)
    sb.check_records(cut, 4)


# ------------------------------------------------------------------------------------- the snapshot budget


def _agent_rounds(vlm: str, snapshots: int, agents: int = 8, steps: int = 6) -> float:
    """``agents`` GUI agents of the tiny trace (episodes of ``steps`` steps, prompts up to 900 tokens, answers of 17-30
    tokens: each reaches a block boundary, as the seed's 20-100 do), one step each
    per round, a round one batch (deterministic: no client timing), MTP 2, ``snapshots`` snapshot entries: the share
    of prompt tokens served from the cache from the fourth step on (each prompt turned its oldest screenshot into
    text)."""
    trace = dataclasses.replace(TINY, steps=(steps, steps), prompt_len=(120, 900), output_len=(17, 30))
    prompts = sb.SeedPrompts(vlm, trace)
    eps = [prompts.episode(i) for i in range(agents)]
    history: list[list[list[int]]] = [[] for _ in eps]
    llm = LLM(model=vlm, device="cpu", dtype="float32", max_model_len=1024, max_num_seqs=agents, num_kv_blocks=600,
              num_state_slots=agents, num_snapshot_slots=snapshots,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    cached = total = 0
    for step in range(steps):
        params = [SamplingParams(temperature=0.0, max_tokens=ep.output_lens[step], ignore_eos=True) for ep in eps]
        outs = llm.generate([prompts.request(ep, step, history[i]) for i, ep in enumerate(eps)], params,
                            use_tqdm=False)
        for i, out in enumerate(outs):
            history[i].append(prompts.history_ids(list(out.outputs[0].token_ids)))
            if step >= 3:
                cached += out.num_cached_tokens or 0
                total += len(out.prompt_token_ids)
    llm.shutdown()
    return cached / total


@pytest.mark.slow  # 33 s; the policy's own tests (tests/cache/test_snapshot_policy.py) stay in the default suite
def test_a_tight_snapshot_budget_keeps_the_agents_resume_points(vlm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight agents against 24 snapshot entries: the prefix cache evicts the spare snapshots first (interval points,
    the points before later images, prompt ends once the answer has a block boundary) and keeps each request's
    point before its first image as recently used as the hits beyond it, so from the fourth step on each agent
    resumes there more often than under plain LRU (every snapshot alike) or a policy blind to images (no
    first-image point): both sabotages lose, and so does the rule without learning which kinds of resume point
    pay (prompt ends and answers are never resumed from here)."""
    from hyserve.cache.prefix_cache import PrefixCache

    ours = _agent_rounds(vlm, 24)
    with monkeypatch.context() as m:
        m.setattr(PrefixCache, "_resume_point", lambda self, req, position, answered=False: True)
        m.setattr(PrefixCache, "_chance_later", lambda self, h: 0.5)
        lru = _agent_rounds(vlm, 24)
    with monkeypatch.context() as m:
        m.setattr(PrefixCache, "_first_image_point", lambda self, req: None)
        blind = _agent_rounds(vlm, 24)
    with monkeypatch.context() as m:  # every kind of resume point alike: no learning which ones pay
        m.setattr(PrefixCache, "_chance_later", lambda self, h: 0.5)
        unlearned = _agent_rounds(vlm, 24)
    assert ours > 1.3 * max(lru, blind), (ours, lru, blind)
    assert ours > unlearned, (ours, unlearned)  # the rounds are deterministic (one batch a round, no timing)
    assert ours > 0.15
    assert _agent_rounds(vlm, 64) > ours  # room for every point: nearer the trace's ideal still

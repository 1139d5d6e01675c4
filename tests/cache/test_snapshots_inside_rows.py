"""Prefix-cache snapshots taken inside prefill rows (GDN and Mamba2 models, ``snapshots_inside_rows``): a chunk runs
past the snapshot points it crosses and every recurrent layer writes its state there during the forward; later
requests that hit those snapshots give transformers' greedy tokens.

Checked: one row spans a prompt's interior points (the old behaviour, rows ending at each point, fails the check);
siblings and multi-turn resumes hit interior snapshots, several rows with different starts in one step; MTP with
planted drafts, async scheduling, preemption and an abort; the late result of an aborted request publishes
nothing. Sabotages caught: the SSM state taken one token late, the conv window taken from the wrong positions, and
an aborted request's late result publishing its snapshots.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch

from hyserve import SamplingParams
from hyserve.engine.llm_engine import LLMEngine
from hyserve.layers import gdn as gdn_layer
from hyserve.layers import mamba2 as mamba2_layer
from hyserve.model.metadata import RowSnapshots
from hyserve.request import Request
from hyserve.scheduler.output import ScheduledRow, SchedulerOutput
from hyserve.scheduler.scheduler import Scheduler
from hyserve.testing.engine import SlotRecorder, assert_matches_reference, drive, make_llm, toks
from hyserve.testing.falcon_h1 import FALCON_H1
from hyserve.testing.families import CheckpointCache
from hyserve.testing.nemotron_h import NEMOTRON_H
from hyserve.testing.speculative import solo_outputs

INTERVAL = 32


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1)


def cached(path: str, **kw: object) -> Any:
    args: dict[str, object] = dict(recurrent_snapshot_interval=INTERVAL, num_snapshot_slots=96,
                                   max_num_batched_tokens=256, num_kv_blocks=512, max_num_seqs=8, num_state_slots=8)
    args.update(kw)
    return make_llm(path, **args)


class RowLog:
    """Every scheduled row as (request, start, end, interior snapshot points)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.rows: list[tuple[str, int, int, list[int]]] = []
        self.steps: list[list[tuple[str, int, int, list[int]]]] = []
        original = engine.scheduler.schedule

        def schedule() -> SchedulerOutput:
            out = original()
            step = [(r.req_id, r.start, r.end, [p for p, _ in r.interior_snapshots]) for r in out.rows]
            self.rows.extend(step)
            if step:
                self.steps.append(step)
            return out

        engine.scheduler.schedule = schedule  # type: ignore[method-assign]

    def of(self, rid: str) -> list[tuple[int, int, list[int]]]:
        return [(a, b, p) for r, a, b, p in self.rows if r == rid]


def prompt_in_one_row(log: RowLog, rid: str, n: int, points: list[int]) -> bool:
    """Whether ``rid``'s prompt of ``n`` tokens ran as one row with ``points`` taken inside it."""
    rows = log.of(rid)
    return bool(rows) and rows[0] == (0, n, points)


@pytest.mark.parametrize("inside", [True, False])
def test_one_row_spans_the_snapshot_points_and_later_requests_hit_them(ckpts: CheckpointCache, inside: bool) -> None:
    """A 150-token prompt runs as one row with its interval points (32 .. 128) and its prompt end (144) taken inside;
    then two requests arrive together that share its first 100 and 70 tokens (hits at 96 and 64: rows of different
    starts in one step, each with points inside), and a multi-turn resume of the first (hit at its end-of-request
    snapshot). Greedy tokens equal a run without caching and transformers. With ``inside=False`` (rows end at every
    point, the previous behaviour) the one-row check fails: the check can see the old behaviour return."""
    path = ckpts.get("conditional", "gdn3_attn1")
    ref = ckpts.reference(path)
    a = toks(150, 11)
    prompts = {"a": a, "b": a[:100] + toks(40, 12), "c": a[:70] + toks(50, 13)}
    llm = cached(path, snapshots_inside_rows=inside)
    eng = llm.llm_engine
    assert eng.scheduler.snapshots_inside_rows == inside
    log = RowLog(eng)
    rec = SlotRecorder(eng)
    final = drive(eng, {0: [("a", prompts["a"], greedy(6))], 9: [("b", prompts["b"], greedy(6)),
                                                                   ("c", prompts["c"], greedy(6))]})
    turn2 = prompts["a"] + final["a"].outputs[0].token_ids + toks(30, 14)
    prompts["a2"] = turn2
    final.update(drive(eng, {0: [("a2", turn2, greedy(6))]}))
    assert prompt_in_one_row(log, "a", 150, [32, 64, 96, 128, 144]) == inside
    if inside:
        assert log.of("b")[0] == (96, 140, [128])  # b's prompt end 140 -> 128, taken inside its row
        assert log.of("c")[0] == (64, 120, [96, 112])
        assert any({r for r, *_ in s} >= {"b", "c"} for s in log.steps), "b and c were not in one step"
    assert [final[r].num_cached_tokens for r in ("b", "c")] == [96, 64]
    assert final["a2"].num_cached_tokens == 144  # the end of a's request (155 computed -> 144)
    want = solo_outputs(path, prompts, 6)
    for rid, p in prompts.items():
        assert final[rid].outputs[0].token_ids == want[rid], rid
        assert_matches_reference(ref, p, final[rid])
    assert rec.saw_non_identity()
    m = llm.get_metrics()
    assert m["hyserve:prefix_cache_snapshot_hits"] >= 3
    eng.assert_no_leaks()


@pytest.mark.parametrize("family", [NEMOTRON_H.name, FALCON_H1.name])
def test_mamba2_families_take_them_too(ckpts: CheckpointCache, family: str) -> None:
    """Nemotron-H (Mamba2 and attention blocks) and Falcon-H1 (Mamba2 beside attention in every layer): a 150-token
    prompt as one row with its points inside, then siblings hitting them, against transformers and an uncached
    run."""
    falcon = family == FALCON_H1.name
    kw: dict[str, object] = {"variant": "release"} if falcon else {}
    path = ckpts.get("causal", "hybrid3" if falcon else "mamba_run", family=family, seed=4, **kw)
    ref = ckpts.reference(path)
    a = toks(150, 71)
    prompts = {"a": a, "b": a[:100] + toks(30, 72), "c": a[:70] + toks(40, 73)}
    llm = cached(path)
    eng = llm.llm_engine
    assert eng.scheduler.snapshots_inside_rows
    log = RowLog(eng)
    final = drive(eng, {0: [("a", a, greedy(5))], 8: [("b", prompts["b"], greedy(5)), ("c", prompts["c"], greedy(5))]})
    assert prompt_in_one_row(log, "a", 150, [32, 64, 96, 128, 144])
    assert [final[r].num_cached_tokens for r in ("b", "c")] == [96, 64]
    want = solo_outputs(path, prompts, 5)
    for rid, p in prompts.items():
        assert final[rid].outputs[0].token_ids == want[rid], rid
        assert_matches_reference(ref, p, final[rid])
    eng.assert_no_leaks()


def test_mtp_async_preemption_and_abort(ckpts: CheckpointCache, plant_drafts: Callable[..., None]) -> None:
    """MTP k = 2 with planted drafts, async scheduling, a KV pool small enough to preempt, and an abort of a
    request whose rows are in flight: staggered requests share a 130-token prefix at several depths and hit the
    snapshots an earlier one took inside its rows; every surviving request gives the tokens of a run without
    caching or speculation, and transformers' for a sample."""
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    ref = ckpts.reference(path)
    shared = toks(130, 21)
    prompts = {"p0": shared + toks(20, 22), "p1": shared[:100] + toks(25, 23), "victim": shared + toks(40, 24),
               "p2": shared[:120] + toks(50, 25), "p3": shared + toks(45, 26), "p4": shared[:75] + toks(60, 27)}
    want = solo_outputs(path, prompts, 20)
    llm = cached(path, speculative_config={"method": "mtp", "num_speculative_tokens": 2}, async_scheduling=True,
                 num_kv_blocks=18, max_num_batched_tokens=192, max_model_len=256)
    eng = llm.llm_engine
    log = RowLog(eng)
    plant_drafts(eng, want)
    arrivals = {0: [("p0", prompts["p0"], greedy(20))], 2: [("victim", prompts["victim"], greedy(20)),
                                                            ("p1", prompts["p1"], greedy(20))],
                4: [("p2", prompts["p2"], greedy(20)), ("p3", prompts["p3"], greedy(20))],
                6: [("p4", prompts["p4"], greedy(20))]}
    final = drive(eng, arrivals, aborts={3: ["victim"]})
    assert "victim" not in final or final["victim"].outputs[0].finish_reason == "abort"
    for rid in ("p0", "p1", "p2", "p3", "p4"):
        assert final[rid].outputs[0].token_ids == want[rid], rid
    for rid in ("p1", "p4"):
        assert_matches_reference(ref, prompts[rid], final[rid], check_logprobs=False)
    m = llm.get_metrics()
    assert m["hyserve:num_preemptions"] > 0
    assert m["hyserve:spec_decode_num_accepted_tokens"] > 0
    assert any(p for _, _, _, p in log.rows), "no snapshot was taken inside a row"
    hits = {rid: final[rid].num_cached_tokens for rid in ("p1", "p2", "p3", "p4")}
    assert any(h and h % INTERVAL == 0 and h < 130 for h in hits.values()), hits  # interval points inside p0's row
    eng.assert_no_leaks()


# ---------------------------------------------------------------------------------------------- aborts


def _publish_aborted_late_results(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage: the late result of a row whose request is gone publishes that row's interior snapshots."""
    seen: dict[str, Request] = {}
    on_scheduled = Scheduler._on_scheduled
    release = Scheduler._release_row

    def remember(self: Scheduler, req: Request, row: ScheduledRow, point: int | None, out: SchedulerOutput) -> None:
        on_scheduled(self, req, row, point, out)
        seen[row.req_id] = req

    def leaky(self: Scheduler, row: ScheduledRow) -> None:
        assert self.prefix_cache is not None
        for p, entry in row.interior_snapshots:
            self.prefix_cache.commit_snapshot(seen[row.req_id], p, entry)
        row.interior_snapshots = []
        release(self, row)

    monkeypatch.setattr(Scheduler, "_on_scheduled", remember)
    monkeypatch.setattr(Scheduler, "_release_row", leaky)


@pytest.mark.parametrize("sabotage", [False, True])
def test_an_aborted_requests_late_result_publishes_nothing(ckpts: CheckpointCache, monkeypatch: pytest.MonkeyPatch,
                                                           sabotage: bool) -> None:
    """Async scheduling: a 150-token prompt's one row (points 32 .. 144 inside) is in flight when the request is
    aborted; its result comes in after, and none of its snapshots may be published (their entries go back): the
    cache holds none (the KV of the aborted prefix is not published either, so a hit could not show one). A later
    request sharing 100 tokens hits nothing and gives the uncached tokens. Sabotaged, the late result publishes
    them and the count sees it."""
    if sabotage:
        _publish_aborted_late_results(monkeypatch)
    path = ckpts.get()
    llm = cached(path, async_scheduling=True)
    eng = llm.llm_engine
    a = toks(150, 31)
    eng.add_request("a", {"prompt_token_ids": a}, greedy(4))
    eng.step()  # launches a's row; its result is read by the next step() call
    assert eng.scheduler.num_steps_in_flight == 1
    eng.abort_request("a")
    while eng.scheduler.num_steps_in_flight or eng.has_unfinished_requests():
        eng.step()
    pc = eng.prefix_cache
    assert pc is not None
    assert (pc.stats.taken == 0 and pc.num_snapshots == 0) != sabotage, (pc.stats.taken, pc.num_snapshots)
    if sabotage:
        return
    later = a[:100] + toks(20, 32)
    out = llm.generate({"prompt_token_ids": later}, greedy(5), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == solo_outputs(path, {"l": later}, 5)["l"]
    eng.assert_no_leaks()


# ---------------------------------------------------------------------------------------------- sabotages


def _one_token_late(snaps: RowSnapshots) -> RowSnapshots:
    shifted = [min(o + 1, snaps.row_lens[r] - 1) for r, o in zip(snaps.rows, snaps.offsets, strict=True)]
    return RowSnapshots.build(snaps.rows, shifted, snaps.entries.tolist(), snaps.slots.tolist(), snaps.row_lens,
                              snaps.entries.device)


def _late_ssm_snapshots(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage: every GDN and Mamba2 layer takes the SSM state of a snapshot inside a row one token late."""
    gdn_forward, mamba2_scan = gdn_layer.gdn_forward, mamba2_layer.mamba2_scan

    def gdn_late(*args: Any) -> Any:
        if len(args) > 10 and isinstance(args[10], RowSnapshots):
            args = (*args[:10], _one_token_late(args[10]))
        return gdn_forward(*args)

    def mamba2_late(*args: Any, **kw: Any) -> Any:
        if isinstance(kw.get("snapshots"), RowSnapshots):
            kw["snapshots"] = _one_token_late(kw["snapshots"])
        return mamba2_scan(*args, **kw)

    monkeypatch.setattr(gdn_layer, "gdn_forward", gdn_late)
    monkeypatch.setattr(mamba2_layer, "mamba2_scan", mamba2_late)


def _shifted_conv_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage: the conv window of a snapshot inside a row is taken one position late."""
    original = gdn_layer.snapshot_conv_windows

    def shifted(x: Any, conv_state: Any, snaps: Any) -> None:
        original(x, conv_state, replace(snaps, ends=snaps.ends + 1, offsets_t=snaps.offsets_t + 1, _windows={}))

    monkeypatch.setattr(gdn_layer, "snapshot_conv_windows", shifted)
    monkeypatch.setattr(mamba2_layer, "snapshot_conv_windows", shifted)


@pytest.mark.parametrize("family", ["qwen3_5", NEMOTRON_H.name])
@pytest.mark.parametrize("sabotage", [None, _late_ssm_snapshots, _shifted_conv_windows],
                         ids=["intact", "ssm_one_token_late", "conv_window_shifted"])
def test_checks_catch_a_wrong_snapshot_inside_a_row(ckpts: CheckpointCache, monkeypatch: pytest.MonkeyPatch,
                                                    sabotage: Callable[[pytest.MonkeyPatch], None] | None,
                                                    family: str) -> None:
    """Siblings hit snapshots their first computed inside its row (prompt 120: points 32 .. 112 inside, not at the
    row's end); each sibling's logprobs are checked against transformers. Intact every check passes; with either
    sabotage some hitting sibling's check fails (GDN and Mamba2 layers alike)."""
    if sabotage is not None:
        sabotage(monkeypatch)
    path = ckpts.get("conditional", "gdn3_attn1") if family == "qwen3_5" else \
        ckpts.get("causal", "mamba_run", family=family, seed=4)
    ref = ckpts.reference(path)
    base = toks(120, 41)
    prompts = {"s1": base[:40] + toks(9, 42), "s2": base[:70] + toks(7, 43), "s3": base[:100] + toks(11, 44)}
    llm = cached(path)
    eng = llm.llm_engine
    log = RowLog(eng)
    drive(eng, {0: [("base", base, greedy(2))]})
    assert prompt_in_one_row(log, "base", 120, [32, 64, 96, 112])
    failures = 0
    for rid, p in prompts.items():
        out = llm.generate({"prompt_token_ids": p}, greedy(6), use_tqdm=False)[0]
        assert out.num_cached_tokens in (32, 64, 96), (rid, out.num_cached_tokens)
        try:
            assert_matches_reference(ref, p, out)
        except AssertionError:
            failures += 1
    assert (failures > 0) == (sabotage is not None), failures


def test_where_a_layer_cannot_chunks_end_at_the_points(ckpts: CheckpointCache) -> None:
    """Qwen4-Exp's PLE layers take no snapshot inside a row: by default its chunks end at snapshot points, asking for
    snapshots inside rows is refused with the flag to change, and GDN models take them by default unless turned
    off (or without prefix caching, where asking is refused)."""
    from hyserve.testing.qwen4_exp import QWEN4_EXP

    path = ckpts.get("causal", "gdn3_attn1", family=QWEN4_EXP.name)
    eng = cached(path, max_num_batched_tokens=64).llm_engine
    assert not eng.scheduler.snapshots_inside_rows
    log = RowLog(eng)
    drive(eng, {0: [("a", toks(100, 51), greedy(2))]})
    assert [(a, b) for a, b, _ in log.of("a")][:3] == [(0, 32), (32, 64), (64, 96)]
    with pytest.raises(ValueError, match="--snapshots-inside-rows"):
        cached(path, snapshots_inside_rows=True)
    gdn = ckpts.get()
    assert cached(gdn).llm_engine.scheduler.snapshots_inside_rows
    assert not cached(gdn, snapshots_inside_rows=False).llm_engine.scheduler.snapshots_inside_rows
    assert not cached(gdn, enable_prefix_caching=False).llm_engine.scheduler.snapshots_inside_rows
    with pytest.raises(ValueError, match="prefix caching is off"):
        cached(gdn, enable_prefix_caching=False, snapshots_inside_rows=True)


def test_the_flag() -> None:
    from hyserve import cli
    from hyserve.engine_args import llm_kwargs

    for flags, want in (([], None), (["--snapshots-inside-rows"], True), (["--no-snapshots-inside-rows"], False)):
        args = cli.build_parser().parse_args(["serve", "m", *flags])
        assert llm_kwargs(args, "m")["snapshots_inside_rows"] is want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cuda_snapshots_inside_rows_match_chunks_ending_there(ckpts: CheckpointCache, dtype: str) -> None:
    """On the card (bf16: fla's chunked prefill, its per-chunk states through fla-core 0.6.0's stages; float32: the
    recurrent kernel from each row's start): a 300-token prompt as one row with its points inside, then siblings
    hitting them (rows of different starts in one step), against the same engine whose chunks end at the points.
    Log-probs compared up to where the two runs part: within the bf16 rule (one rounding of the state to the model
    dtype at a 64-token chunk start) or float32's."""
    path = ckpts.get("conditional", "gdn3_attn1")
    a = toks(300, 61)
    prompts = {"a": a, "b": a[:200] + toks(40, 62), "c": a[:130] + toks(70, 63), "d": a[:260] + toks(20, 64)}
    arrivals = {0: [("a", a, greedy(8))], 12: [(r, prompts[r], greedy(8)) for r in ("b", "c", "d")]}
    kw: dict[str, object] = dict(device="cuda", dtype=dtype, recurrent_snapshot_interval=64,
                                 max_num_batched_tokens=512)
    runs = {}
    for inside in (True, False):
        llm = cached(path, snapshots_inside_rows=inside, **kw)
        log = RowLog(llm.llm_engine)
        runs[inside] = drive(llm.llm_engine, arrivals)
        assert prompt_in_one_row(log, "a", 300, [64, 128, 192, 256, 288]) == inside
        assert [runs[inside][r].num_cached_tokens for r in ("b", "c", "d")] == [192, 128, 256]
        llm.llm_engine.assert_no_leaks()
    mean_tol, max_tol = (3e-2, 0.5) if dtype == "bfloat16" else (1e-3, 1e-2)
    diffs = []
    for rid in prompts:
        x, y = runs[True][rid].outputs[0], runs[False][rid].outputs[0]
        for i, (t, u) in enumerate(zip(x.token_ids, y.token_ids, strict=True)):
            diffs.append(abs(x.logprobs[i][t].logprob - y.logprobs[i][t].logprob) if t == u else max_tol)
            if t != u:
                break
    assert diffs and sum(diffs) / len(diffs) <= mean_tol and max(diffs) <= max_tol, diffs


def test_cuda_16_bit_ranks_take_them_only_with_the_pinned_fla(monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """On CUDA in 16 bits the snapshots inside rows call fla-core 0.6.0's internal stages: with another fla-core (or
    none) a rank reports it cannot, says why in the log, and chunks end at snapshot points again (an explicit
    ``snapshots_inside_rows=True`` is then refused at startup); float32 and the CPU do not need fla."""
    import sys
    import types

    from hyserve.kernels.fla_stages import FLA_PINNED_VERSION, fla_row_snapshots_unavailable
    from hyserve.worker.model_runner import ModelRunner

    class Layer:
        supports_row_snapshots = True

    def runner(device: str, dtype: torch.dtype) -> Any:
        model = types.SimpleNamespace(recurrent_layers=lambda: [Layer(), Layer()])
        return types.SimpleNamespace(model=model, device=torch.device(device), dtype=dtype)

    for version, ok in ((FLA_PINNED_VERSION, True), ("0.6.1", False)):
        monkeypatch.setitem(sys.modules, "fla", types.SimpleNamespace(__version__=version))
        assert (fla_row_snapshots_unavailable() is None) == ok
        with caplog.at_level("WARNING", logger="hyserve"):
            assert ModelRunner._row_snapshots(runner("cuda", torch.bfloat16)) == ok  # type: ignore[arg-type]
        assert ("fla-core 0.6.1" in caplog.text) == (not ok)
        assert ModelRunner._row_snapshots(runner("cuda", torch.float32)) is True  # type: ignore[arg-type]
        assert ModelRunner._row_snapshots(runner("cpu", torch.bfloat16)) is True  # type: ignore[arg-type]
    monkeypatch.setitem(sys.modules, "fla", None)  # not installed: the import fails
    assert fla_row_snapshots_unavailable() == "fla-core is not installed"

"""Verify rows behind verify rows in flight (async scheduling + MTP on one rank): a speculating request's next verify
row is scheduled and enqueued before the accepted count of its row in flight reaches the host. It starts where that
count puts it, from the last token and the drafts that row's acceptance and drafting left on the device
(``ScheduledRow.start_on_device``); the scheduler sets its start when the count comes in.

What could go wrong, and where it shows: a row behind starting at a stale or off-by-one position, or feeding the
wrong last token (the outputs, against plain decoding); another slot's drafts (the drafts compared, keyed by request
and position, against the runs without rows behind); a candidate snapshot at the wrong point (a later request's
prefix hit through the decode region, its logprobs against a plain prefill); blocks or snapshot entries lost when
a request ends with a row behind in flight (``assert_no_leaks``). Each sabotaged variant below is caught.

On the CPU the draft graphs are emulated (the whole verify step enqueued at once, as on CUDA) or absent (the
drafting passes run one by one: a row behind then reads its start from the device before the step, one wait).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_device_drafts import (
    FOLLOW,
    PROMPTS,
    K,
    chosen_logprobs,
    greedy,
    planted_targets,
    record_fed,
    snapshots_one_early,
)

from hyserve import SamplingParams
from hyserve.scheduler.scheduler import Scheduler
from hyserve.testing.engine import drive, make_llm
from hyserve.testing.families import CheckpointCache
from hyserve.testing.speculative import solo_output
from hyserve.worker import cuda_graphs
from hyserve.worker.spec_decode.verifier import Verifier
from hyserve.worker.state_ops import StateOps

LOGPROBS = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, logprobs=1)  # never behind
# A fixed speculation length (CUDA's default, adaptive k, would choose lengths from measured times, and the
# drafts of two runs would differ); the lengths changing from step to step: test_adaptive_k_behind.py.
SPEC = {"method": "mtp", "num_speculative_tokens": K, "adaptive": False}


def plain_outputs(path: str, prompts: dict[str, list[int]], params: dict[str, SamplingParams],
                  device: str = "cpu") -> dict[str, list[int]]:
    """Each prompt's plain greedy output, alone (``solo_output``: once per session)."""
    return {rid: list(solo_output(path, p, params[rid], device).outputs[0].token_ids) for rid, p in prompts.items()}


def sabotage(monkeypatch: pytest.MonkeyPatch, kind: str | None) -> None:
    """Break one piece of the mechanism (None: nothing)."""
    if kind in ("start", "stale", "token"):  # every acceptance advances through it (the accept graph too)
        advance = Verifier.advance_verified

        def broken(self: Verifier, accepted: torch.Tensor, emitted: torch.Tensor) -> None:
            assert self.verify_next_start is not None and self.verify_next_token is not None
            slots = self.batch.dev_bufs["state_slots"][: accepted.shape[0]]
            before = self.verify_next_start.index_select(0, slots)
            advance(self, accepted, emitted)
            if kind == "start":  # the next start one short: start + accepted
                self.verify_next_start.index_add_(0, slots, torch.full_like(before, -1))
            elif kind == "stale":  # the start left by the row before: the commit's count not read
                self.verify_next_start.index_copy_(0, slots, before)
            else:  # the last token from the column before the accepted count's
                a = accepted.clamp(min=0)
                vocab = self.state_ops.model.config.vocab_size
                wrong = emitted.gather(1, (a - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
                self.verify_next_token.index_copy_(0, slots, torch.where(a == 0, (wrong + 1) % vocab, wrong))
        monkeypatch.setattr(Verifier, "advance_verified", broken)
    elif kind == "behind-graph":  # the behind graph leaves the KV slots at the earliest start (seen once accepted)
        behind = Verifier._graph_behind

        def kv_stays(self: Verifier, q: int, size: int) -> tuple[torch.Tensor, ...]:
            mapping = self.batch.dev_bufs["slot_mapping"].clone()
            out = behind(self, q, size)
            self.batch.dev_bufs["slot_mapping"].copy_(mapping)
            return out
        monkeypatch.setattr(Verifier, "_graph_behind", kv_stays)
    elif kind == "place":  # the scheduler places a row behind one position early
        place = Scheduler._place
        monkeypatch.setattr(Scheduler, "_place", lambda self, row, start: place(self, row, start - 1))
    elif kind == "snapshots":
        snapshots_one_early(monkeypatch)
    elif kind == "snapshot-graph":  # the snapshot graph reads each candidate's position one early
        def early(self: StateOps, size: int) -> tuple[torch.Tensor, ...]:
            r, p, e = self.batch.dev_bufs["snap"][:, :size].unbind(0)
            for layer in self.model.recurrent_layers():
                layer.snapshot_candidates(r, (p - 1).clamp(min=0), e, self.batch.dev_bufs["state_slots"])
            return ()
        monkeypatch.setattr(StateOps, "_graph_snapshot", early)
    else:
        assert kind is None


def workload_params(stop: dict[str, int] | None = None) -> dict[str, SamplingParams]:
    """``workload``'s requests' parameters (``stop``: e's stop token)."""
    stop = stop or {}
    return {"a": greedy(26), "b": greedy(22), "gone": greedy(30), "c": LOGPROBS, "d": greedy(29),
            "e": SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop["e"]] if "e" in stop else None)}


def workload(path: str, behind: bool, graphs: bool, monkeypatch: pytest.MonkeyPatch,
             stop: dict[str, int] | None = None, device: str = "cpu") -> dict[str, Any]:
    """Staggered arrivals, an abort, preemption (14 KV blocks), prefix hits, a request asking for logprobs (never
    behind) and one ending on a stop token, under async scheduling. Records, per (request, start), the drafts each
    verify row was compared with."""
    monkeypatch.setattr(cuda_graphs, "EMULATE", graphs and device == "cpu")  # on CUDA: captured graphs
    llm = make_llm(path, speculative_config=SPEC, block_size=16, num_kv_blocks=14, max_model_len=192,
                   max_num_batched_tokens=32, max_num_seqs=4, enable_prefix_caching=True,
                   recurrent_snapshot_interval=16, num_snapshot_slots=64, async_scheduling=True, device=device,
                   enforce_eager=not graphs)
    eng = llm.llm_engine
    runner = eng.runner
    assert (runner.graphs is not None) == graphs and eng.scheduler.async_verify
    eng.scheduler.async_verify = behind
    sampler = runner.verifier.rejection_sampler
    assert sampler is not None
    launch = sampler.launch
    fed: dict[int, list[int]] = {}  # step id -> the drafts its acceptance compared with, in row order
    current: list[int] = []
    execute = runner.execute_model_async

    def execute_recorded(so: Any) -> Any:
        current[:] = [so.step_id]
        return execute(so)

    def record(logits: torch.Tensor, rows: list[Any], draft_probs: Any = None,
               draft_ids: torch.Tensor | None = None, **kw: Any) -> Any:
        fed[current[0]] = draft_ids.tolist() if draft_ids is not None else [t for r in rows for t in r.draft_token_ids]
        return launch(logits, rows, draft_probs, draft_ids=draft_ids, **kw)

    runner.execute_model_async = execute_recorded  # type: ignore[method-assign]
    sampler.launch = record  # type: ignore[method-assign]
    in_graph = runner.verifier.accept_in_graph

    def record_graph(rows: list[Any], spec_rows: list[Any], size: int) -> Any:
        pending = in_graph(rows, spec_rows, size)
        if pending is not None:
            steps: list[list[int]] = []
            record_fed(runner, spec_rows, steps, [])
            fed[current[0]] = steps[0]
        return pending

    runner.verifier.accept_in_graph = record_graph  # type: ignore[method-assign]
    drafts: dict[tuple[str, int], list[int]] = {}
    update = eng.scheduler.update_from_output

    def keyed(so: Any, ro: Any, sink: Any) -> Any:
        ran = update(so, ro, sink)  # rows behind have their start from here on
        flat, at = fed.get(so.step_id, []), 0
        for row in so.rows:
            if row.is_verify:
                drafts.setdefault((row.req_id, row.start), flat[at : at + row.num_drafts])
                at += row.num_drafts
        return ran

    eng.scheduler.update_from_output = keyed  # type: ignore[method-assign]
    params = workload_params(stop)
    arrivals = {0: [("a", PROMPTS["a"], params["a"]), ("b", PROMPTS["b"], params["b"])],
                3: [("gone", PROMPTS["gone"], params["gone"])],
                6: [("c", PROMPTS["c"], params["c"]), ("d", PROMPTS["d"], params["d"])],
                15: [("e", PROMPTS["e"], params["e"])]}
    final = drive(eng, arrivals, aborts={9: ["gone"]})
    m = llm.get_metrics()
    eng.assert_no_leaks()
    return {"outputs": {rid: list(o.outputs[0].token_ids) for rid, o in final.items() if rid != "gone"},
            "finish": {rid: o.outputs[0].finish_reason for rid, o in final.items()}, "params": params,
            "drafts": drafts, "behind": eng.scheduler.num_rows_behind, "preemptions": m["hyserve:num_preemptions"],
            "hits": sum(o.num_cached_tokens for o in final.values())}


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("graphs", [True, False], ids=["draft-graph", "eager-drafting"])
def test_rows_behind_emit_what_plain_decoding_does(ckpts: CheckpointCache, monkeypatch: pytest.MonkeyPatch,
                                                   graphs: bool, device: str) -> None:
    """On the CPU with emulated graphs or none; on CUDA with captured ones or none (float32), where the host
    really runs ahead of the device."""
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    free = plain_outputs(path, {"e": PROMPTS["e"]}, {"e": greedy(40)}, device)["e"]
    stop = {"e": free[9]}  # e ends on a stop token inside its output (a verify row in flight ends it)
    got = workload(path, True, graphs, monkeypatch, stop, device)
    want = plain_outputs(path, {rid: PROMPTS[rid] for rid in got["outputs"]}, got["params"], device)
    assert got["outputs"] == want
    assert got["finish"]["e"] == "stop" and len(want["e"]) <= 10
    assert got["behind"] > 20 and got["preemptions"] > 0 and got["hits"] > 0
    # The drafts rows behind read are those the same request was given at the same position without them.
    sync = workload(path, False, graphs, monkeypatch, stop, device)
    assert sync["outputs"] == want and sync["behind"] == 0
    common = sorted(set(got["drafts"]) & set(sync["drafts"]))
    assert len(common) > 0.6 * len(sync["drafts"])
    assert [got["drafts"][key] for key in common] == [sync["drafts"][key] for key in common]


@pytest.mark.parametrize("kind", ["start", "stale", "token", "place"])
def test_a_row_behind_in_the_wrong_place_is_caught(ckpts: CheckpointCache, monkeypatch: pytest.MonkeyPatch,
                                                   kind: str) -> None:
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    params = workload_params()
    want = plain_outputs(path, {rid: PROMPTS[rid] for rid in params if rid != "gone"}, params)  # before the sabotage
    sabotage(monkeypatch, kind)
    if kind == "place":  # the scheduler's own check sees a start before the earliest one
        with pytest.raises(AssertionError, match=r"^\(\d+, \d+, \d+\)$"):  # (earliest, placed, latest)
            workload(path, True, True, monkeypatch)
        return
    got = workload(path, True, True, monkeypatch)
    assert got["behind"] > 20 and set(got["outputs"]) == set(want)
    assert got["outputs"] != want


def planted(path: str, want: dict[str, list[int]], follow: list[int], monkeypatch: pytest.MonkeyPatch
            ) -> dict[str, Any]:
    """a and b decode with their true greedy continuation planted as drafts (most are accepted: rows behind start
    up to k positions past their earliest), then f = a's prompt + a's output + more hits a's decode region, whose
    snapshots come from verified candidates of rows behind."""
    monkeypatch.setattr(cuda_graphs, "EMULATE", True)
    llm = make_llm(path, speculative_config=SPEC, block_size=16, max_model_len=256, max_num_batched_tokens=64,
                   max_num_seqs=4, enable_prefix_caching=True, recurrent_snapshot_interval=16, num_snapshot_slots=64,
                   async_scheduling=True)
    eng = llm.llm_engine
    runner = eng.runner
    prompts = {"a": PROMPTS["a"], "b": PROMPTS["b"], "f": follow}
    execute = runner.execute_model_async

    def plant(so: Any) -> Any:  # on the CPU the step has run when this returns: its device values are there
        handle = execute(so)
        assert runner.verifier.draft_slots is not None and runner.verifier.verify_next_start is not None
        for row in so.rows:
            if row.is_verify:
                known = int(runner.verifier.verify_next_start[row.state_slot]) + 1
            elif row.samples:
                known = row.end + 1
            else:
                continue
            cont = want[row.req_id][known - len(prompts[row.req_id]):][:K]
            runner.verifier.draft_slots[row.state_slot, : len(cont)] = torch.tensor(cont, dtype=torch.long)
        return handle

    runner.execute_model_async = plant  # type: ignore[method-assign]
    final = drive(eng, {0: [("a", prompts["a"], greedy(40)), ("b", prompts["b"], greedy(40))],
                        60: [("f", prompts["f"], FOLLOW)]})
    m = llm.get_metrics()
    eng.assert_no_leaks()
    return {"outputs": {rid: list(o.outputs[0].token_ids) for rid, o in final.items()},
            "accepted": m["hyserve:spec_decode_num_accepted_tokens"]
            / max(m["hyserve:spec_decode_num_draft_tokens"], 1),
            "hit": final["f"].num_cached_tokens, "f_logprobs": chosen_logprobs(final["f"]),
            "behind": eng.scheduler.num_rows_behind, "snapshot_replays": runner.graphs.sets["snapshot"].num_replays}


@pytest.mark.parametrize("kind", [None, "snapshots", "snapshot-graph", "behind-graph", "start", "token"])
def test_rows_behind_accept_commit_and_snapshot_what_was_verified(ckpts: CheckpointCache,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  kind: str | None) -> None:
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    want, follow, ref_f = planted_targets(path, 40, 33, 321)
    sabotage(monkeypatch, kind)
    got = planted(path, want, follow, monkeypatch)
    drift = max(abs(x - y) for x, y in zip(got["f_logprobs"], chosen_logprobs(ref_f), strict=False))
    right = got["outputs"] == want and drift < 1e-4
    if kind is None:
        # Planted drafts are accepted, so rows behind start past their earliest start; the hit reaches into a's
        # decode region (a block boundary that a row behind crossed), and f continues from it exactly.
        assert got["accepted"] > 0.5 and got["behind"] > 10 and got["hit"] > len(PROMPTS["a"]) + 16
        assert got["snapshot_replays"] > 0
        assert right, (got["outputs"] == want, drift)
    else:
        assert not right, drift


def test_rows_behind_with_the_worker_in_another_process(ckpts: CheckpointCache) -> None:
    """The worker gets pickled copies of the rows: it takes the starts from its own device values, and the engine
    places its copies from the counts; the outputs are plain decoding's."""
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    llm = make_llm(path, speculative_config=SPEC, block_size=16, num_kv_blocks=14, max_model_len=192,
                   max_num_batched_tokens=32, max_num_seqs=4, enable_prefix_caching=True,
                   recurrent_snapshot_interval=16, num_snapshot_slots=64, async_scheduling=True,
                   distributed_executor_backend="mp")
    eng = llm.llm_engine
    params = {"a": greedy(26), "b": greedy(22), "d": greedy(29), "e": greedy(18)}
    try:
        final = drive(eng, {0: [("a", PROMPTS["a"], params["a"]), ("b", PROMPTS["b"], params["b"])],
                            4: [("d", PROMPTS["d"], params["d"]), ("e", PROMPTS["e"], params["e"])]})
        eng.assert_no_leaks()
        assert eng.scheduler.num_rows_behind > 10
    finally:
        eng.shutdown()
    want = plain_outputs(path, {rid: PROMPTS[rid] for rid in params}, params)
    assert {rid: list(o.outputs[0].token_ids) for rid, o in final.items()} == want


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_the_accept_graph_decides_as_the_rejection_sampler(ckpts: CheckpointCache, monkeypatch: pytest.MonkeyPatch,
                                                           device: str) -> None:
    """The accept graph's greedy acceptance against ``RejectionSampler.launch`` on the same logits and drafts:
    rows with k, fewer (their masked tail's 0 matching the argmax) and no drafts, drafts mostly right (runs of
    acceptance), ties (first maximum), a row whose logits turn non-finite at its stopping position (an error row)
    and one non-finite only past its stop (not an error); and the next starts and last tokens it leaves per slot.
    On CUDA the captured graph replays."""
    from hyserve.worker.spec_decode.rejection_sampler import SpecRow

    monkeypatch.setattr(cuda_graphs, "EMULATE", device == "cpu")
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    runner = make_llm(path, speculative_config=SPEC, max_num_seqs=8, max_num_batched_tokens=64,
                      device=device).llm_engine.runner
    q, size = K + 1, 8
    vocab = runner.graph_logits.f32.shape[1]
    gen = torch.Generator().manual_seed(5)
    counts = [K, K, K - 1, 0, K, 1, K, K]
    logits = torch.randn(size * q, vocab, generator=gen)
    logits[5 * q, 7] = logits[5 * q, 3] = logits[5 * q].max() + 1.0  # a tie: the lower id wins
    logits[2 * q + 2, 0] = logits[2 * q + 2].max() + 2.0  # row 2's masked tail feeds 0: no phantom draft
    best = logits.argmax(dim=1).view(size, q)
    drafts = torch.randint(0, vocab, (size, K), generator=gen)
    for r, right in enumerate([3, 1, 2, 0, 2, 1, 3, 0]):  # the first `right` drafts are the argmax
        drafts[r, :right] = best[r, :right]
    logits[4 * q + 2] = float("nan")  # row 4 accepts 2: its stop position is not finite -> error row
    logits[1 * q + 3] = float("inf")  # row 1 stops at 1: a non-finite position past its stop does not count
    ids = torch.zeros(size, q, dtype=torch.long)
    ids[:, 1:] = drafts
    for r, c in enumerate(counts):
        ids[r, 1 + c :] = 0  # the verify graph's masked tail
    starts = torch.tensor([10, 20, 30, 40, 50, 60, 70, 80])
    slots = torch.tensor([3, 0, 5, 1, 7, 2, 6, 4])  # not the identity
    d = runner.input_batch.dev_bufs
    runner.graph_logits.f32[: size * q].copy_(logits)
    d["input_ids"][: size * q].copy_(ids.view(-1))
    d["draft_count"][:size].copy_(torch.tensor(counts))
    d["verify_starts"][:size].copy_(starts)
    d["state_slots"][:size].copy_(slots)
    assert runner.graphs is not None
    runner.graphs.sets["accept"].run(size)
    got = runner.verifier.accept_summary[:size].cpu()
    real = torch.cat([torch.arange(r * q, r * q + c + 1) for r, c in enumerate(counts)])
    rows = [SpecRow(params=greedy(10), draft_token_ids=drafts[r, :c].tolist()) for r, c in enumerate(counts)]
    assert runner.verifier is not None
    want = runner.verifier.rejection_sampler.launch(logits[real].to(device), rows)
    assert got[:, 0].tolist() == want.accepted.tolist()
    assert want.accepted.tolist()[4] == -1 and want.accepted.tolist()[1] == 1
    for r, a in enumerate(want.accepted.tolist()):
        if a >= 0:
            assert got[r, 1 : a + 2].tolist() == want.emitted[r, : a + 1].tolist(), r
            assert int(runner.verifier.verify_next_start[int(slots[r])]) == starts[r] + a + 1
            assert int(runner.verifier.verify_next_token[int(slots[r])]) == int(want.emitted[r, a])

"""MTP drafts that stay on the device: the draft graph leaves each request's drafts in its state slot's row of
``draft_slots``, the scheduler sends ``PREVIOUS_DRAFT`` placeholders, and the next verify row reads them there.

The drafts a verify step compares with must be exactly those the host transport (drafts copied to the host and
sent back as ids) gives, step for step, under staggered arrivals, an abort, preemption, prefix caching and async
scheduling (the draft graphs emulated on the CPU). Outputs alone could not tell: greedy verification keeps outputs
right whatever the drafts are, so a draft read from another request's row only lowers acceptance. The sabotaged
variant shows it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hyserve import SamplingParams
from hyserve.scheduler.output import PREVIOUS_DRAFT
from hyserve.testing.engine import drive, make_llm, toks
from hyserve.testing.families import CheckpointCache
from hyserve.testing.speculative import solo_output
from hyserve.worker import cuda_graphs
from hyserve.worker.model_runner import ModelRunner
from hyserve.worker.spec_decode.verifier import Verifier
from hyserve.worker.state_ops import StateOps

K = 3
# A request asking for logprobs: its steps draft through the graph without the device chain (logits are read late).
LOGPROBS = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=1)
FOLLOW = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
SHARED = toks(40, 300)
PROMPTS = {"a": SHARED + toks(9, 301), "b": toks(37, 302), "gone": toks(30, 303), "c": SHARED + toks(5, 304),
           "d": toks(21, 305), "e": SHARED + toks(12, 306)}


def record_fed(runner: ModelRunner, spec_rows: list[Any], fed: list[list[int]], from_device: list[bool]) -> None:
    """The drafts the accept graph compared with, as the rejection sampler is given them: from the device where
    some were PREVIOUS_DRAFT inputs, else the rows' own."""
    ids = runner.verifier.verify_draft_ids
    from_device.append(ids is not None)
    fed.append(ids.tolist() if ids is not None else [t for r in spec_rows for t in r.draft_token_ids])


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def run(path: str, device_drafts: bool, async_scheduling: bool, device: str = "cpu",
        behind: bool = False) -> dict[str, Any]:
    """``behind``: verify rows may go behind their request's row in flight (async scheduling); off, both transports
    schedule the same steps, which the step-for-step comparison needs (test_async_verify.py has them on)."""
    llm = make_llm(path, speculative_config={"method": "mtp", "num_speculative_tokens": K, "adaptive": False},
                   block_size=16, num_kv_blocks=14, max_model_len=192, max_num_batched_tokens=32, max_num_seqs=4,
                   enable_prefix_caching=True, recurrent_snapshot_interval=16, num_snapshot_slots=64,
                   async_scheduling=async_scheduling, device=device)
    eng = llm.llm_engine
    runner = eng.runner
    assert runner.graphs is not None and runner.verifier.draft_slots is not None
    if not device_drafts:
        runner.verifier.draft_slots = None  # the host transport: the draft graph's tokens are copied to the host
    eng.scheduler.async_verify = behind and device_drafts  # rows behind rows in flight read drafts on the device
    placeholders = 0
    count_rows = runner._spec_row

    def counted(row: Any, i: int, errors: dict[int, str]) -> Any:
        nonlocal placeholders
        placeholders += sum(t == PREVIOUS_DRAFT for t in row.token_ids[1:])
        return count_rows(row, i, errors)

    runner._spec_row = counted  # type: ignore[method-assign]
    fed: list[list[int]] = []  # per verify step, the drafts acceptance compared with, in row order
    from_device: list[bool] = []
    sampler = runner.verifier.rejection_sampler
    assert sampler is not None
    launch = sampler.launch  # every acceptance goes through it (a call, or the device chain's launch)

    def record(logits: torch.Tensor, rows: list[Any], draft_probs: Any = None,
               draft_ids: torch.Tensor | None = None, **kw: Any) -> Any:
        from_device.append(draft_ids is not None)
        fed.append(draft_ids.tolist() if draft_ids is not None else [t for r in rows for t in r.draft_token_ids])
        return launch(logits, rows, draft_probs, draft_ids=draft_ids, **kw)

    sampler.launch = record  # type: ignore[method-assign]
    in_graph = runner.verifier.accept_in_graph  # a greedy verify graph's acceptance: the accept graph

    def record_graph(rows: list[Any], spec_rows: list[Any], size: int) -> Any:
        pending = in_graph(rows, spec_rows, size)
        if pending is not None:
            record_fed(runner, spec_rows, fed, from_device)
        return pending

    runner.verifier.accept_in_graph = record_graph  # type: ignore[method-assign]
    chained = 0
    chain = runner.verifier.verify_and_draft_on_device

    def count_chain(*args: Any, **kw: Any) -> Any:
        nonlocal chained
        chained += 1
        return chain(*args, **kw)

    runner.verifier.verify_and_draft_on_device = count_chain  # type: ignore[method-assign]
    arrivals = {0: [("a", PROMPTS["a"], greedy(22)), ("b", PROMPTS["b"], greedy(18))],
                3: [("gone", PROMPTS["gone"], greedy(30))],
                6: [("c", PROMPTS["c"], LOGPROBS), ("d", PROMPTS["d"], greedy(25))],
                15: [("e", PROMPTS["e"], greedy(16))]}
    final = drive(eng, arrivals, aborts={9: ["gone"]})
    m = llm.get_metrics()
    eng.assert_no_leaks()
    return {"outputs": {rid: o.outputs[0].token_ids for rid, o in final.items() if rid != "gone"}, "fed": fed,
            "chained": chained, "logprobs": final["c"].outputs[0].logprobs,
            "from_device": from_device, "placeholders": placeholders,
            "preemptions": m["hyserve:num_preemptions"], "hits": sum(o.num_cached_tokens for o in final.values()),
            "draft_replays": runner.graphs.sets["draft"].num_replays}


@pytest.fixture()
def emulated_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_graphs, "EMULATE", True)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("async_scheduling", [pytest.param(False, marks=pytest.mark.slow), True])  # budget
def test_device_drafts_are_the_drafts_the_host_transport_gives(ckpts: CheckpointCache, emulated_graphs: None,
                                                               async_scheduling: bool, device: str) -> None:
    """On the CPU with emulated graphs; on CUDA with captured ones (float32)."""
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    dev = run(path, device_drafts=True, async_scheduling=async_scheduling, device=device)
    host = run(path, device_drafts=False, async_scheduling=async_scheduling, device=device)
    assert dev["outputs"] == host["outputs"] and len(dev["outputs"]) == 5
    plain = make_llm(path, enable_prefix_caching=False, device=device)  # speculation emits what plain decoding does
    for rid, out in dev["outputs"].items():
        ref = plain.generate([{"prompt_token_ids": PROMPTS[rid]}], greedy(len(out)), use_tqdm=False)[0]
        assert ref.outputs[0].token_ids == out, rid
    assert dev["preemptions"] > 0 and dev["hits"] > 0 and dev["draft_replays"] > 0
    assert any(dev["from_device"]) and dev["placeholders"] > 0  # the device path ran ...
    assert dev["chained"] > 0 and host["chained"] == 0  # ... the whole verify step enqueued at once too
    assert [list(p) for p in dev["logprobs"]] == [list(p) for p in host["logprobs"]]
    assert not any(host["from_device"]) and host["placeholders"] == 0  # ... and the host one did not
    assert dev["fed"] == host["fed"]  # the same drafts, step for step


def test_a_draft_read_from_the_wrong_row_is_caught(ckpts: CheckpointCache, emulated_graphs: None,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage: the next verify row reads the drafts row of the next state slot. Outputs stay right (greedy
    verification), the drafts compared differ from the host transport's."""
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    host = run(path, device_drafts=False, async_scheduling=True)
    feed = Verifier.feed_device_drafts

    def wrong_row(self: Verifier, fed: list[tuple[int, int]]) -> None:
        assert self.draft_slots is not None
        size = self.draft_slots.numel()
        feed(self, [(t, (j + K) % size) for t, j in fed])

    monkeypatch.setattr(Verifier, "feed_device_drafts", wrong_row)
    dev = run(path, device_drafts=True, async_scheduling=True)
    assert dev["outputs"] == host["outputs"]
    assert dev["fed"] != host["fed"]


def snapshots_one_early(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage: every candidate snapshot taken one position early."""
    snaps = StateOps.save_snapshots

    def early(self: StateOps, rows: list[Any], acc: torch.Tensor) -> None:
        layers = self.model.recurrent_layers()
        originals = [layer.snapshot_candidates for layer in layers]
        for layer, orig in zip(layers, originals, strict=True):
            layer.snapshot_candidates = (  # type: ignore[method-assign]
                lambda r, p, e, slots, orig=orig: orig(r, (p - 1).clamp(min=0), e, slots))
        try:
            snaps(self, rows, acc)
        finally:
            for layer, orig in zip(layers, originals, strict=True):
                layer.snapshot_candidates = orig  # type: ignore[method-assign]

    monkeypatch.setattr(StateOps, "save_snapshots", early)


def commit_before_candidate_snapshots(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage: a step's candidate snapshots taken after its commit (the order of a scratch of whole candidate
    states): a GDN layer then rebuilds them from the committed state, not the state before the step."""
    snaps, commit = StateOps.save_snapshots, StateOps.commit_verified
    deferred: list[tuple[Any, Any]] = []

    def later(self: StateOps, rows: list[Any], acc: Any) -> None:
        if any(r.candidate_snapshot is not None for r in rows):
            deferred.append((rows, acc))
        else:
            snaps(self, rows, acc)

    def commit_then_snapshots(self: StateOps, acc: Any) -> None:
        commit(self, acc)
        while deferred:
            snaps(self, *deferred.pop(0))

    monkeypatch.setattr(StateOps, "save_snapshots", later)
    monkeypatch.setattr(StateOps, "commit_verified", commit_then_snapshots)


def planted_targets(path: str, n: int, cut: int, seed: int) -> tuple[dict[str, list[int]], list[int], Any]:
    """a's and b's plain greedy outputs of ``n`` tokens; f = a's prompt + the first ``cut`` of a's output + 7 more
    tokens; f's plain output (FOLLOW: with logprobs). Each a ``solo_output`` run (once per session)."""
    want = {rid: list(solo_output(path, PROMPTS[rid], greedy(n)).outputs[0].token_ids) for rid in ("a", "b")}
    follow = PROMPTS["a"] + want["a"][:cut] + toks(7, seed)
    ref_f = solo_output(path, follow, FOLLOW)
    want["f"] = list(ref_f.outputs[0].token_ids)
    return want, follow, ref_f


def planted_run(path: str, want: dict[str, list[int]], follow: list[int], sabotage: str | None,
                monkeypatch: pytest.MonkeyPatch, schedule: list[int] | None = None) -> dict[str, Any]:
    """Requests a and b, then f = a's prompt + a's output + more (a prefix hit through a's decode region, whose
    snapshots come from verified candidates). After every step the drafts rows of running requests are overwritten
    with their true greedy continuation, so most drafts are accepted: the commit and the candidate snapshots of the
    device chain run with counts above zero."""
    if sabotage == "commit":  # every row takes candidate 0 whatever was accepted
        commit = StateOps.commit_verified

        def candidate_zero(self: StateOps, acc: Any) -> None:  # the device chain's counts
            commit(self, acc.clamp(max=0) if isinstance(acc, torch.Tensor) else acc)

        monkeypatch.setattr(StateOps, "commit_verified", candidate_zero)
    elif sabotage == "snapshots":
        snapshots_one_early(monkeypatch)
    elif sabotage == "commit_first":
        commit_before_candidate_snapshots(monkeypatch)
    spec = {"method": "mtp", "num_speculative_tokens": K, "adaptive": schedule is not None}
    llm = make_llm(path, speculative_config=spec, block_size=16,
                   max_model_len=256, max_num_batched_tokens=64, max_num_seqs=4, enable_prefix_caching=True,
                   recurrent_snapshot_interval=16, num_snapshot_slots=64, async_scheduling=True)
    eng = llm.llm_engine
    runner = eng.runner
    if schedule is not None:  # the speculation length of each step, in turn (hyserve.speculative.adaptive)
        assert eng.drafts is not None
        eng.drafts.policy.script(schedule)
    if sabotage == "one_token_snapshots":  # a k = 0 step's candidate snapshots replayed over the advanced slots
        for layer in runner.model.recurrent_layers():
            layer.copy_slots = (  # type: ignore[method-assign]
                lambda r, e, slots, layer=layer: layer.snapshot_candidates(r, torch.zeros_like(r), e, slots))
    # Planted after each result: a row behind one in flight would be enqueued before (tests/worker/test_async_verify.py
    # plants on the worker instead).
    eng.scheduler.async_verify = False
    update = eng.scheduler.update_from_output
    prompts = {"a": PROMPTS["a"], "b": PROMPTS["b"], "f": follow}

    def plant(so: Any, ro: Any, sink: Any) -> Any:
        ran = update(so, ro, sink)
        assert runner.verifier.draft_slots is not None
        for req in eng.scheduler.running:
            if PREVIOUS_DRAFT in req.draft_token_ids:
                cont = want[req.request_id][req.num_output_tokens:][:K]
                runner.verifier.draft_slots[req.state_slot, : len(cont)] = torch.tensor(cont)
        return ran

    eng.scheduler.update_from_output = plant  # type: ignore[method-assign]
    final = drive(eng, {0: [("a", prompts["a"], greedy(24)), ("b", prompts["b"], greedy(24))],
                        40: [("f", prompts["f"], FOLLOW)]})
    m = llm.get_metrics()
    eng.assert_no_leaks()
    return {"outputs": {rid: o.outputs[0].token_ids for rid, o in final.items()},
            "accepted": m["hyserve:spec_decode_num_accepted_tokens"]
            / max(m["hyserve:spec_decode_num_draft_tokens"], 1),
            "hit": final["f"].num_cached_tokens, "f_logprobs": chosen_logprobs(final["f"]),
            "snapshot_replays": runner.graphs.sets["snapshot"].num_replays}


def chosen_logprobs(out: Any) -> list[float]:
    o = out.outputs[0]
    return [lp[t].logprob for t, lp in zip(o.token_ids, o.logprobs, strict=True)]


@pytest.mark.parametrize("sabotage", [None, "commit", "snapshots", "commit_first"])
def test_device_chain_commits_and_snapshots_what_was_accepted(ckpts: CheckpointCache, emulated_graphs: None,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              sabotage: str | None) -> None:
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    want, follow, ref_f = planted_targets(path, 24, 24, 320)
    got = planted_run(path, want, follow, sabotage, monkeypatch)
    # f's logprobs from its hit against a plain prefill of its whole prompt (float32; paths differ by rounding).
    drift = max(abs(x - y) for x, y in zip(got["f_logprobs"], chosen_logprobs(ref_f), strict=False))
    right = got["outputs"] == want and drift < 1e-4
    if sabotage is None:
        # The hit reaches past a's prompt, into its decode region: that snapshot is a verified candidate's.
        assert got["accepted"] > 0.5 and got["hit"] > len(PROMPTS["a"])
        assert got["snapshot_replays"] > 0  # the candidates were copied by the snapshot graph
        assert right, (got["outputs"] == want, drift)
    else:
        assert not right, drift


@pytest.mark.parametrize("sabotage", [None, "one_token_snapshots"])
def test_steps_at_k0_snapshot_the_slots_they_advanced(ckpts: CheckpointCache, emulated_graphs: None,
                                                      monkeypatch: pytest.MonkeyPatch, sabotage: str | None) -> None:
    """Every step at speculation length 0 (verify rows of one token: the GDN layers advance the slots in place and
    commit nothing): f's hit reaches into a's decode region, whose snapshots are those steps' slots, copied; a
    snapshot rebuilt as a verify candidate is (the token replayed over the advanced slot) is caught."""
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    want, follow, ref_f = planted_targets(path, 24, 24, 320)
    got = planted_run(path, want, follow, sabotage, monkeypatch, schedule=[0])
    drift = max(abs(x - y) for x, y in zip(got["f_logprobs"], chosen_logprobs(ref_f), strict=False))
    right = got["outputs"] == want and drift < 1e-4
    if sabotage is None:
        assert got["hit"] > len(PROMPTS["a"]), got["hit"]  # a snapshot of a step at k = 0
        assert right, (got["outputs"] == want, drift)
    else:
        assert not right, drift

"""Rows behind rows in flight while the speculation length changes from step to step (async scheduling, MTP on one
rank, ``hyserve.speculative.adaptive``'s scripted schedule): a step verifying k drafts in flight and the next one
verifying none, fewer, or all k, in every order. A row behind one in flight takes exactly its step's k_step of the
drafts the row in flight leaves on the device (none: its last token alone), and its start, positions and KV slots
come from the device as with a fixed k; a row behind with fewer than k drafts keeps its masked tail in the verify
graph's layout.

The outputs against plain decoding (itself checked against transformers elsewhere), with drafts planted on the
worker (most accepted: rows behind start past their earliest start), staggered arrivals, an abort, preemption, and a
prefix hit into a's decode region whose snapshot came from a verified candidate (f's logprobs against a plain
prefill); emulated CUDA graphs (each speculation length its own verify, accept and behind graphs, or all steps the
graphs of k drafts per row) and eager drafting. Sabotaged: a row behind taking the configured k's placeholders
(caught by the step checks), the behind graph giving a short row's masked tail KV slots, the accept graph of a
shorter length reading the layout of k (the outputs), the eager layout of rows behind spreading every row over
k + 1 tokens (the next row's tokens moved).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_device_drafts import FOLLOW, PROMPTS, chosen_logprobs, greedy, planted_targets

from hyserve.scheduler.output import PREVIOUS_DRAFT, PREVIOUS_SAMPLED
from hyserve.scheduler.scheduler import Scheduler
from hyserve.testing.engine import drive, make_llm
from hyserve.testing.families import CheckpointCache
from hyserve.testing.scenarios import K_SCHEDULE, KStepRecorder
from hyserve.testing.speculative import solo_output
from hyserve.worker import cuda_graphs
from hyserve.worker.spec_decode.verifier import Verifier

K = 3


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@CUDA
def test_rows_behind_follow_the_steps_k_on_cuda(ckpts: CheckpointCache, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same with the graphs of every length captured and replayed on the card (float32), against plain
    decoding on the card."""
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    plain = make_llm(path, enable_prefix_caching=False, device="cuda")

    def solo(prompt: list[int], params: Any) -> Any:
        return plain.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]

    want = {rid: list(solo(PROMPTS[rid], greedy(n)).outputs[0].token_ids) for rid, n in (("a", 40), ("b", 40),
                                                                                        ("d", 29))}
    follow = PROMPTS["a"] + want["a"][:33] + [7, 8, 9, 10, 11, 12, 13]
    want["f"] = list(solo(follow, FOLLOW).outputs[0].token_ids)
    got = run(path, want, follow, True, monkeypatch, device="cuda")
    assert got["outputs"] == want and not got["recorder"].errors and not got["tails"]
    assert sorted(q for q, n in got["replays"].items() if n) == list(range(1, K + 2)), got["replays"]


def placeholders_of_k(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage: a row behind one in flight takes the configured k's placeholders, not the step's k."""
    chunk = Scheduler._chunk

    def full(self: Scheduler, req: Any, start: int, budget: int) -> Any:
        row, point = chunk(self, req, start, budget)
        if row.start_on_device:
            assert self.drafts is not None
            row.token_ids = [PREVIOUS_SAMPLED] + [PREVIOUS_DRAFT] * self.drafts.k
        return row, point

    monkeypatch.setattr(Scheduler, "_chunk", full)


def run(path: str, want: dict[str, list[int]], follow: list[int], graphs: bool, monkeypatch: pytest.MonkeyPatch,
        own_graphs: bool = True, device: str = "cpu") -> dict[str, Any]:
    """``own_graphs``: each speculation length has its verify graphs ("adaptive": true); off ("adaptive": false,
    the schedule scripted all the same) every step runs the graphs of k drafts per row, shorter rows masked. On
    CUDA the graphs are captured and replayed."""
    monkeypatch.setattr(cuda_graphs, "EMULATE", graphs and device == "cpu")
    llm = make_llm(path, speculative_config={"method": "mtp", "num_speculative_tokens": K, "adaptive": own_graphs},
                   block_size=16, num_kv_blocks=15, max_model_len=160, max_num_batched_tokens=48, max_num_seqs=4,
                   enable_prefix_caching=True, recurrent_snapshot_interval=16, num_snapshot_slots=64,
                   async_scheduling=True, enforce_eager=not graphs, device=device)
    eng = llm.llm_engine
    runner = eng.runner
    assert eng.scheduler.async_verify and (runner.graphs is not None) == graphs
    assert eng.drafts is not None
    eng.drafts.policy.script(K_SCHEDULE)
    recorder = KStepRecorder(eng)
    execute = runner.execute_model_async
    prompts = {**PROMPTS, "f": follow}

    tails: list[int] = []  # KV slots the verify graph's masked tails were given (must be none: -1)
    replays: dict[int, int] = {}  # verify graph steps by their tokens per row

    def plant(so: Any) -> Any:  # on the CPU the step has run when this returns: its device values are there
        handle = execute(so)
        verifier = runner.verifier
        if so.rows and all(r.is_verify for r in so.rows) and runner.input_batch.verify_graph_size is not None:
            mapping = runner.input_batch.dev_bufs["slot_mapping"]
            q = runner.input_batch.verify_graph_q  # k_step + 1 where the step's own graph ran, else k + 1
            replays[q] = replays.get(q, 0) + 1
            for i, row in enumerate(so.rows):
                tails.extend(int(x) for x in mapping[i * q + row.num_new_tokens : (i + 1) * q] if x >= 0)
        assert verifier.draft_slots is not None and verifier.verify_next_start is not None
        for row in so.rows:
            if row.req_id not in want:
                continue
            if row.is_verify:
                known = int(verifier.verify_next_start[row.state_slot]) + 1
            elif row.samples:
                known = row.end + 1
            else:
                continue
            cont = want[row.req_id][known - len(prompts[row.req_id]):][:K]
            if len(cont) == K:
                cont[-1] = (cont[-1] + 1) % 50  # the last one wrong: rejections too
            verifier.draft_slots[row.state_slot, : len(cont)] = torch.tensor(cont, dtype=torch.long)
        return handle

    runner.execute_model_async = plant  # type: ignore[method-assign]
    final = drive(eng, {0: [("a", prompts["a"], greedy(40)), ("b", prompts["b"], greedy(40))],
                        3: [("gone", prompts["gone"], greedy(30))],
                        6: [("d", prompts["d"], greedy(29))],
                        60: [("f", prompts["f"], FOLLOW)]}, aborts={9: ["gone"]})
    m = llm.get_metrics()
    eng.assert_no_leaks()
    return {"outputs": {rid: list(o.outputs[0].token_ids) for rid, o in final.items() if rid != "gone"},
            "accepted": m["hyserve:spec_decode_num_accepted_tokens"], "drafted":
            m["hyserve:spec_decode_num_draft_tokens"], "preemptions": m["hyserve:num_preemptions"],
            "hit": final["f"].num_cached_tokens, "f_logprobs": chosen_logprobs(final["f"]), "recorder": recorder,
            "tails": tails, "replays": replays}


@pytest.fixture(scope="module")
def targets(ckpts: CheckpointCache) -> tuple[str, dict[str, list[int]], list[int], Any]:
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    want, follow, ref_f = planted_targets(path, 40, 33, 321)
    want["d"] = list(solo_output(path, PROMPTS["d"], greedy(29)).outputs[0].token_ids)
    return path, want, follow, ref_f


@pytest.mark.parametrize("graphs,own_graphs", [(True, True), (True, False), (False, True)],
                         ids=["graphs-per-k", "graphs-of-k", "eager-drafting"])
def test_rows_behind_follow_the_steps_k(targets: tuple, monkeypatch: pytest.MonkeyPatch, graphs: bool,
                                        own_graphs: bool) -> None:
    path, want, follow, ref_f = targets
    got = run(path, want, follow, graphs, monkeypatch, own_graphs)
    rec = got["recorder"]
    assert got["outputs"] == want
    drift = max(abs(x - y) for x, y in zip(got["f_logprobs"], chosen_logprobs(ref_f), strict=True))
    assert drift < 1e-4
    assert not rec.errors, rec.errors[:5]
    assert rec.chosen == [K_SCHEDULE[i % len(K_SCHEDULE)] for i in range(len(rec.chosen))]
    assert 0 < got["accepted"] < got["drafted"] and got["preemptions"] > 0
    assert got["hit"] > len(PROMPTS["a"]) + 16  # into a's decode region
    if graphs:  # with the draft graph a row goes behind one in flight at every k, none included
        assert all(rec.rows_behind.get(k, 0) > 0 for k in range(K + 1)), rec.rows_behind
        assert not got["tails"]  # a short row's masked tail writes no KV, behind one in flight too
        # each speculation length ran its own verify graph (rows of k_step + 1 tokens), or every step k + 1's
        want_q = range(1, K + 2) if own_graphs else [K + 1]
        assert sorted(q for q, n in got["replays"].items() if n) == list(want_q), got["replays"]


def unmasked_tails(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage: the behind graph gives every token of a row behind a KV slot, its masked tail's too."""
    behind = Verifier._graph_behind

    def every_slot(self: Verifier, q: int, size: int) -> tuple[torch.Tensor, ...]:
        count = self.batch.dev_bufs["draft_count"][:size].clone()
        self.batch.dev_bufs["draft_count"][:size].fill_(K)
        out = behind(self, q, size)
        self.batch.dev_bufs["draft_count"][:size].copy_(count)
        return out

    monkeypatch.setattr(Verifier, "_graph_behind", every_slot)


def accept_of_k(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage: the accept graph of a shorter speculation length reads the logits and drafts in the layout of k
    drafts per row."""
    accept = Verifier._graph_accept
    monkeypatch.setattr(Verifier, "_graph_accept", lambda self, q, size: accept(self, K + 1, size))


def drafting_of_k(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage: the MTP head drafts k tokens after every step, whatever the step's k_step."""
    from hyserve.worker.spec_decode.mtp_proposer import MTPProposer

    chain, on_device, propose = Verifier.device_chain, Verifier.verify_and_draft_on_device, MTPProposer.propose
    monkeypatch.setattr(Verifier, "device_chain", lambda self, rows, spec_rows, n=None: chain(self, rows, spec_rows))
    monkeypatch.setattr(Verifier, "verify_and_draft_on_device",
                        lambda self, *a, num_drafts=None, **kw: on_device(self, *a, **kw))
    monkeypatch.setattr(MTPProposer, "propose", lambda self, *a: propose(self, *a[:4]))


@pytest.mark.parametrize("sabotage", ["placeholders", "tails", "accept", "drafting"])
def test_rows_behind_that_ignore_the_steps_k_are_caught(targets: tuple, monkeypatch: pytest.MonkeyPatch,
                                                        sabotage: str) -> None:
    path, want, follow, _ = targets
    {"placeholders": placeholders_of_k, "tails": unmasked_tails, "accept": accept_of_k,
     "drafting": drafting_of_k}[sabotage](monkeypatch)
    try:
        got = run(path, want, follow, True, monkeypatch, own_graphs=sabotage != "tails")
    except (AssertionError, RuntimeError, IndexError):  # the engine's own checks stopped it
        assert sabotage == "accept"
        return
    if sabotage == "placeholders":
        assert "a row behind with 3 drafts" in " ".join(got["recorder"].errors)
    elif sabotage == "drafting":
        assert "3 drafts after a step at k_step 0 (want 1)" in " ".join(got["recorder"].errors)
    elif sabotage == "tails":
        assert got["tails"]
    else:
        assert got["outputs"] != want


def test_start_behind_lays_each_row_out_in_its_own_tokens(ckpts: CheckpointCache,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The eager layout of rows behind (``Verifier.start_behind``): rows of 1, 3 and 4 tokens back to back, slots
    not the identity; each row's positions, KV slots and context length from its slot's next start, and the tokens
    of the rows around it untouched. The old layout (every row k + 1 tokens) is caught."""
    _check_start_behind(ckpts, sabotaged=False)
    with pytest.raises(AssertionError):
        _check_start_behind(ckpts, sabotaged=True)


def _check_start_behind(ckpts: CheckpointCache, sabotaged: bool) -> None:
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    runner = make_llm(path, speculative_config={"method": "mtp", "num_speculative_tokens": K},
                      max_num_seqs=4, max_num_batched_tokens=64, block_size=16).llm_engine.runner
    verifier: Verifier = runner.verifier
    assert verifier.verify_next_start is not None and verifier.verify_next_token is not None
    d = runner.input_batch.dev_bufs
    lens, slots, starts = [1, 3, 4], [2, 0, 3], [21, 40, 7]
    tables = [[5, 6, 7, 8], [1, 2, 3, 4], [9, 10, 11, 12]]
    for name in ("positions", "slot_mapping", "input_ids"):
        d[name].fill_(-7)
    for r, (slot, start, table) in enumerate(zip(slots, starts, tables, strict=True)):
        verifier.verify_next_start[slot] = start
        verifier.verify_next_token[slot] = 100 + r
        d["block_tables"][r, : len(table)] = torch.tensor(table, dtype=d["block_tables"].dtype)
    firsts = [0, 1, 4]
    behind = [(r, t, s, n) for r, (t, s, n) in enumerate(zip(firsts, slots, lens, strict=True))]
    if sabotaged:
        behind = [(r, t, s, K + 1) for r, t, s, _ in behind]
    verifier.start_behind(behind)
    for r, (t, n, start, table) in enumerate(zip(firsts, lens, starts, tables, strict=True)):
        pos = list(range(start, start + n))
        assert d["positions"][t : t + n].tolist() == pos
        assert d["slot_mapping"][t : t + n].tolist() == [table[p // 16] * 16 + p % 16 for p in pos]
        assert int(d["input_ids"][t]) == 100 + r
        assert int(d["seq_lens"][r]) == start + n
        assert int(d["verify_starts"][r]) == start
    assert d["positions"][8:12].tolist() == [-7] * 4  # past the last row: untouched


def random_schedule_run(path: str, seed: int, device: str) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """Seven staggered requests (prompts of 3 to 30 tokens, chunks of 32 tokens, six at most at once), real MTP
    drafts with async scheduling and graphs, the speculation length scripted from a random schedule of 37 steps;
    then the same prompts again (hits on the prefix cache, its snapshots taken inside prefill rows or from
    verified candidates). Returns the two passes' outputs against plain decoding's."""
    import random

    from hyserve import SamplingParams
    from hyserve.testing.engine import random_prompts

    prompts = random_prompts(7, [9, 30, 3, 17, 25, 5, 12], seed=81)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    kw: dict[str, Any] = dict(device=device, max_num_batched_tokens=32, max_num_seqs=6, num_state_slots=6,
                              num_kv_blocks=128)
    plain = drive(make_llm(path, **kw).llm_engine, {3 * i: [(f"r{i}", p, params)] for i, p in enumerate(prompts)})
    llm = make_llm(path, speculative_config={"method": "mtp", "num_speculative_tokens": K, "adaptive": True},
                   async_scheduling=True, **kw)
    assert llm.llm_engine.drafts is not None and llm.llm_engine.runner.graphs is not None
    rng = random.Random(seed)
    llm.llm_engine.drafts.policy.script([rng.randrange(K + 1) for _ in range(37)])
    got = {}
    for tag in ("r", "b"):
        out = drive(llm.llm_engine, {3 * i: [(f"{tag}{i}", p, params)] for i, p in enumerate(prompts)})
        got.update({rid: list(o.outputs[0].token_ids) for rid, o in out.items()})
    llm.llm_engine.assert_no_leaks()
    want = {f"{tag}{i}": list(plain[f"r{i}"].outputs[0].token_ids) for tag in ("r", "b") for i in range(7)}
    return got, want


@pytest.mark.parametrize("seed", [0, 1])
def test_random_schedules_emit_plain_decoding_through_the_prefix_cache(ckpts: CheckpointCache,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      seed: int) -> None:
    """The speculation length changing at random from step to step (as adaptive k changes it on the card, from
    measured step times) with the real MTP head's drafts, emulated graphs, async scheduling, chunked prefill and a
    second pass on the prefix cache: every request emits what plain decoding does."""
    monkeypatch.setattr(cuda_graphs, "EMULATE", True)
    got, want = random_schedule_run(ckpts.get("conditional", "gdn3_attn1", with_mtp=True), seed, "cpu")
    assert got == want


@CUDA
@pytest.mark.parametrize("seed", [0, 1])
def test_random_schedules_emit_plain_decoding_on_cuda(ckpts: CheckpointCache, seed: int) -> None:
    """The same on the card (float32, the graphs of every length captured and replayed)."""
    got, want = random_schedule_run(ckpts.get("conditional", "gdn3_attn1", with_mtp=True), seed, "cuda")
    assert got == want


def test_random_schedules_catch_an_accept_graph_reading_the_layout_of_k(ckpts: CheckpointCache,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage: the accept graph of a shorter length reads the layout of k; the random schedules' outputs (or the
    engine's own checks) catch it."""
    monkeypatch.setattr(cuda_graphs, "EMULATE", True)
    accept_of_k(monkeypatch)
    try:
        got, want = random_schedule_run(ckpts.get("conditional", "gdn3_attn1", with_mtp=True), 0, "cpu")
    except (AssertionError, RuntimeError, IndexError):
        return
    assert got != want

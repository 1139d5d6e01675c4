"""One scenario every scheduling mode must run identically: staggered arrivals sharing prefixes (prefix-cache hits),
prompts longer than the token budget (chunked prefill), one abort, preemption (10 KV blocks), a seeded sampled
request, and early stops. ``reference_run`` runs it synchronously (the reference for async, pipeline-parallel,
tensor-parallel and multiprocess runs) and checks that it does preempt and hit."""

from __future__ import annotations

from collections.abc import Callable

import torch

from hyserve import SamplingParams
from hyserve.engine.llm_engine import LLMEngine
from hyserve.outputs import RequestOutput
from hyserve.scheduler.output import SchedulerOutput
from hyserve.testing.engine import drive, make_llm, random_prompts, run_key
from hyserve.testing.families import CheckpointCache

SPECS = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    "mtp": {"method": "mtp", "num_speculative_tokens": 2},
}


def scenario(path: str) -> tuple[dict[int, list], dict[int, list[str]], dict[str, list[int]]]:
    """Staggered arrivals sharing prefixes (hits), prompts longer than the token budget (chunks), one abort."""
    shared = random_prompts(1, [37], seed=31)[0]
    tails = random_prompts(6, [3, 20, 9, 14, 5, 26], seed=32)
    prompts = {"a": shared + tails[0], "b": shared + tails[1], "c": random_prompts(1, [61], seed=33)[0],
               "d": tails[2], "e": shared + tails[3], "f": shared + tails[4], "g": shared + tails[1][:9] + tails[5]}
    greedy = {n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1) for n in (5, 9, 14, 20)}
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True, logprobs=1)
    arrivals: dict[int, list] = {
        0: [("a", prompts["a"], greedy[14]), ("b", prompts["b"], greedy[9])],
        1: [("c", prompts["c"], greedy[20])],
        3: [("d", prompts["d"], seeded)],
        6: [("e", prompts["e"], greedy[5]), ("f", prompts["f"], greedy[20])],
        11: [("g", prompts["g"], greedy[14])],
    }
    return arrivals, {9: ["c"]}, prompts


def with_stops(engine: LLMEngine, arrivals: dict[int, list], want: dict[str, RequestOutput]) -> dict[int, list]:
    """The same arrivals, but "a" and "f" stop at a token their run without stops produced (EOS-like early ends)."""
    out: dict[int, list] = {}
    for step, reqs in arrivals.items():
        out[step] = []
        for rid, prompt, params in reqs:
            if rid in ("a", "f"):
                stop = want[rid].outputs[0].token_ids[3]
                params = SamplingParams(temperature=0.0, max_tokens=params.max_tokens, ignore_eos=True,
                                        logprobs=1, stop_token_ids=[stop])
            out[step].append((rid, prompt, params))
    return out


def scenario_engine(path: str, spec: str | dict, **kw: object) -> LLMEngine:
    llm = make_llm(path, max_num_batched_tokens=24, max_num_seqs=4, num_kv_blocks=10, block_size=16,
                   enable_prefix_caching=True, recurrent_snapshot_interval=16, num_snapshot_slots=32,
                   speculative_config=SPECS[spec] if isinstance(spec, str) else spec, **kw)
    return llm.llm_engine


def run_scenario(path: str, spec: str, async_scheduling: bool, arrivals: dict[int, list], aborts: dict[int, list[str]],
         sabotage=None) -> tuple[dict[str, RequestOutput], LLMEngine]:  # type: ignore[no-untyped-def]
    engine = scenario_engine(path, spec, async_scheduling=async_scheduling)
    if sabotage is not None:
        sabotage(engine)
    final = drive(engine, arrivals, aborts)
    engine.assert_no_leaks()
    return final, engine


# Two float32 runs of one scenario batch their rows differently (speculation lengths, graphs' pad rows, async steps),
# so the GEMMs add up in other orders: a logprob 13 tokens into a row moved by 1.02e-4 on a 2-core Xeon's CPU build of
# torch (2026-12-06) where the CI machine of the day before stayed under 1e-4. The tokens are compared exactly; the
# logprobs within three times that drift.
LOGPROB_TOL = 3e-4


def assert_same_outputs(got: dict[str, RequestOutput], want: dict[str, RequestOutput]) -> None:
    assert set(got) == set(want)
    for rid, w in want.items():
        g = got[rid]
        assert g.outputs[0].token_ids == w.outputs[0].token_ids, f"request {rid}: tokens differ"
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason, f"request {rid}: finish reason differs"
        for i, (lg, lw) in enumerate(zip(g.outputs[0].logprobs or [], w.outputs[0].logprobs or [], strict=True)):
            tok = g.outputs[0].token_ids[i]
            assert abs(lg[tok].logprob - lw[tok].logprob) < LOGPROB_TOL, (
                f"request {rid}: logprob {i} differs ({lg[tok].logprob} against {lw[tok].logprob})")


def reference_run(ckpts: CheckpointCache, spec: str) -> tuple[str, dict[int, list], dict[int, list[str]],
                                                                dict[str, list[int]], dict[str, RequestOutput]]:
    """The scenario with its stops, run synchronously in this process with speculation ``spec``: (path, arrivals,
    aborts, prompts, outputs). Computed once per session and switches (``CheckpointCache.memo``; about 1.5 s a run
    and a dozen tests in several files take it), each caller getting its own copy."""
    return ckpts.memo(("reference_run", spec, run_key()), lambda: _reference_run(ckpts, spec))  # type: ignore[no-any-return]


def _reference_run(ckpts: CheckpointCache, spec: str) -> tuple[str, dict[int, list], dict[int, list[str]],
                                                                 dict[str, list[int]], dict[str, RequestOutput]]:
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    arrivals, aborts, prompts = scenario(path)
    first, engine = run_scenario(path, spec, False, arrivals, aborts)
    arrivals = with_stops(engine, arrivals, first)
    want, engine = run_scenario(path, spec, False, arrivals, aborts)
    metrics = engine.get_metrics()
    preemptions, hits = metrics["hyserve:num_preemptions"], metrics["hyserve:prefix_cache_hits"]
    assert isinstance(preemptions, float | int) and preemptions > 0, "the scenario must preempt"
    assert isinstance(hits, float | int) and hits > 0, "the scenario must hit the prefix cache"
    assert want["a"].outputs[0].finish_reason == "stop" and "c" not in want  # c is aborted before its end
    return path, arrivals, aborts, prompts, want


def plain_scenario_run(ckpts: CheckpointCache, path: str) -> dict[str, RequestOutput]:
    """The scenario on ``path`` run synchronously without speculation: it must preempt, hit the prefix cache,
    abort "c", and give the reference's greedy tokens (all but the sampled "d"). Once per session and switches
    (``CheckpointCache.memo``), as ``reference_run``."""
    return ckpts.memo(("plain_scenario_run", path, run_key()),  # type: ignore[no-any-return]
                      lambda: _plain_scenario_run(ckpts, path))


def _plain_scenario_run(ckpts: CheckpointCache, path: str) -> dict[str, RequestOutput]:
    from hyserve.testing.engine import assert_matches_reference

    arrivals, aborts, prompts = scenario(path)
    engine = scenario_engine(path, "plain")
    want = drive(engine, arrivals, aborts)
    engine.assert_no_leaks()
    metrics = engine.get_metrics()
    assert metrics["hyserve:num_preemptions"] > 0 and metrics["hyserve:prefix_cache_hits"] > 0  # type: ignore[operator]
    assert "c" not in want  # aborted
    ref = ckpts.reference(path)
    for rid, out in want.items():
        if rid != "d":  # sampled
            assert_matches_reference(ref, prompts[rid], out)
    return want


def assert_ngram_scenario_matches(path: str, plain_run: dict[str, RequestOutput], async_scheduling: bool,
                                  graphs: bool, sabotage: Callable[[LLMEngine], None] | None = None,
                                  schedule: list[int] | None = None) -> None:
    """The scenario on ``path`` with n-gram speculation, async scheduling or CUDA graphs (emulated on the CPU when the
    caller set ``cuda_graphs.EMULATE``) gives ``plain_run``'s outputs, rows mapped to slots other than their own.
    Drafts of full length come from the known continuations with errors planted (random prompts rarely repeat, so
    prompt lookup alone would propose little): verify rows accept 0 to 3 of 3, and the test asks for both.
    ``sabotage`` (one of ``MAMBA2_SABOTAGES``) breaks the engine before it runs: the outputs must then differ.
    ``schedule``: the speculation length of each step in turn (``hyserve.speculative.adaptive``; 0: verify rows of
    one token, which the recurrent layers may advance in place)."""
    from hyserve.testing.engine import SlotRecorder
    from hyserve.testing.speculative import OracleProposer

    arrivals, aborts, _ = scenario(path)
    ngram = SPECS["ngram"]
    assert ngram is not None
    spec: str | dict = "ngram" if schedule is None else {**ngram, "adaptive": True}
    engine = scenario_engine(path, spec, async_scheduling=async_scheduling)
    assert (engine.runner.graphs is not None) == graphs
    if schedule is not None:
        assert engine.drafts is not None
        engine.drafts.policy.script(schedule)
    if sabotage is not None:
        sabotage(engine)
    slots = SlotRecorder(engine)
    conts = {rid: out.outputs[0].token_ids for rid, out in plain_run.items() if rid != "d"}
    plan = {rid: [0, 3, 1, 2] for rid in conts}
    engine.proposer = OracleProposer({"c": [], "d": [], **conts}, plan, vocab=440)  # c aborted, d sampled: none
    got = drive(engine, arrivals, aborts)
    engine.assert_no_leaks()
    assert slots.saw_non_identity()
    assert set(got) == set(plain_run)
    assert_same_outputs({r: o for r, o in got.items() if r != "d"}, {r: o for r, o in plain_run.items() if r != "d"})
    metrics = engine.get_metrics()
    assert metrics["hyserve:num_preemptions"] > 0 and metrics["hyserve:prefix_cache_hits"] > 0  # type: ignore[operator]
    drafted = metrics["hyserve:spec_decode_num_draft_tokens"]
    accepted = metrics["hyserve:spec_decode_num_accepted_tokens"]
    assert 0 < accepted < drafted  # type: ignore[operator]  # drafts accepted and rejected


def late_snapshots(engine: LLMEngine) -> None:
    """Sabotage: every snapshot copy-out runs one step late, so the snapshot holds the state over the tokens of one
    more step (the seeds' bug: a state taken one position late reaching later requests through the prefix cache).
    A snapshot inside a prefill row is not written by the forward but copied from its row's slot one step late
    too."""
    runner = engine.runner
    pool = runner.state_pool
    original_copy = pool.copy
    pending: list[tuple[list[int], list[int]]] = []
    original_save: Callable = runner.state_ops.save_snapshots
    original_metadata: Callable = runner.input_batch.metadata

    def metadata(step):  # type: ignore[no-untyped-def]
        meta = original_metadata(step)
        meta.row_snapshots = None
        return meta

    def save(rows, num_accepted):  # type: ignore[no-untyped-def]
        for src, dst in pending:
            original_copy(src, dst)
        pending.clear()
        inside = [(row.state_slot, entry) for row in rows for _, entry in row.interior_snapshots]
        if inside:
            pending.append(([s for s, _ in inside], [e for _, e in inside]))
        pool.copy = lambda src, dst: pending.append((list(src), list(dst)))  # type: ignore[method-assign]
        try:
            original_save(rows, num_accepted)
        finally:
            pool.copy = original_copy  # type: ignore[method-assign]

    runner.input_batch.metadata = metadata  # type: ignore[method-assign]
    runner.state_ops.save_snapshots = save  # type: ignore[method-assign]


def mamba2_rollback_one_late(engine: LLMEngine) -> None:
    """Sabotage: each Mamba2 layer's commit after a verify step takes the candidate one position past the accepted
    one (the state over the first rejected draft) where there is one."""
    from hyserve.layers.mamba2 import Mamba2Mixer

    for layer in engine.runner.model.recurrent_layers():
        if isinstance(layer, Mamba2Mixer):
            commit = layer.commit_verified

            def late(slots, acc, commit=commit, layer=layer):  # type: ignore[no-untyped-def]
                k = layer.verify_scratch["x"].shape[1] - 1  # the stash's positions
                commit(slots, torch.where(acc >= 0, (acc + 1).clamp(max=k), acc))

            layer.commit_verified = late  # type: ignore[method-assign]


def one_token_rows_committed_again(engine: LLMEngine) -> None:
    """Sabotage: a step of one-token verify rows (speculation length 0) advances the recurrent slots in place and
    is committed as well (the candidate, or the replayed token, applied a second time)."""
    for layer in engine.runner.model.recurrent_layers():
        layer.verifies_one_token_rows_in_place = False  # type: ignore[misc]


MAMBA2_SABOTAGES: dict[str, Callable[[LLMEngine], None]] = {
    "snapshots_one_step_late": late_snapshots,
    "mamba2_rollback_one_late": mamba2_rollback_one_late,
}


# Speculation lengths scripted step after step (hyserve.speculative.adaptive): full, none, partial, runs of none,
# and back up, so a row goes behind one in flight with another k (and with none) in every direction.
K_SCHEDULE = [3, 0, 1, 0, 0, 2, 3, 1, 2, 0, 3, 3]
ADAPTIVE_MTP = {"method": "mtp", "num_speculative_tokens": 3, "adaptive": True}


class KStepRecorder:
    """Wraps the scheduler's ``schedule`` to check every step against its speculation length k_step: each verify
    row holds at most k_step drafts, a row behind one in flight exactly k_step or, where the step of the row in
    flight drafted fewer (``SchedulerOutput.num_drafting``), that many; the request's KV blocks cover the row's
    latest end plus the MTP head's drafting positions (``DraftManager.lookahead_tokens``); after a step the MTP
    head left each request far from its end that step's drafting; and each step drafted what the next step's choice
    asks (none where it is 0, else ``max(k_step, 1)``, ``SpecLengthPolicy.drafting``)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.steps: list[tuple[int, list[int]]] = []  # (k_step, each verify row's drafts) of steps with verify rows
        self.chosen: list[int] = []  # the k_step of every step the policy chose for
        self.rows_behind: dict[int, int] = {}  # k_step -> rows behind one in flight at that k
        self.errors: list[str] = []
        last_drafting: dict[str, int] = {}  # the drafting of each request's last verify row's step
        previous: list[SchedulerOutput] = []  # the last step the policy chose for
        sched = engine.scheduler
        drafts = engine.drafts
        assert drafts is not None
        original = sched.schedule
        bs = sched.block_pool.block_size

        def schedule():  # type: ignore[no-untyped-def]
            before = drafts.policy.histogram.total()
            so = original()
            if drafts.policy.histogram.total() > before:
                self.chosen.append(so.num_spec_tokens)
                if previous and drafts.short_drafting:
                    p = previous[0]
                    want = 0 if so.num_spec_tokens == 0 else max(p.num_spec_tokens, 1)
                    if p.num_drafting != want:
                        self.errors.append(f"step {p.step_id} at k_step {p.num_spec_tokens} drafted "
                                           f"{p.num_drafting} before a step at {so.num_spec_tokens} (want {want})")
                previous[:] = [so]
            verify = [r for r in so.rows if r.is_verify]
            if verify:
                self.steps.append((so.num_spec_tokens, [r.num_drafts for r in verify]))
            for r in verify:
                if r.num_drafts > so.num_spec_tokens:
                    self.errors.append(f"step {so.step_id}: {r.num_drafts} drafts at k_step {so.num_spec_tokens}")
                if r.start_on_device:
                    self.rows_behind[so.num_spec_tokens] = self.rows_behind.get(so.num_spec_tokens, 0) + 1
                    want = min(so.num_spec_tokens, last_drafting[r.req_id])
                    if r.num_drafts != want:
                        self.errors.append(f"step {so.step_id}: a row behind with {r.num_drafts} drafts at k_step "
                                           f"{so.num_spec_tokens} (want {want})")
                assert so.num_drafting is not None
                last_drafting[r.req_id] = so.num_drafting
                end = min(r.latest_start + r.num_new_tokens + drafts.lookahead_tokens, engine.max_model_len)
                if len(r.block_table) * bs < end:
                    self.errors.append(f"step {so.step_id}: blocks for {len(r.block_table) * bs} tokens, the row "
                                       f"and its drafting reach {end}")
            return so

        sched.schedule = schedule  # type: ignore[method-assign]
        update = sched.update_from_output

        def drafted(so, ro, sink):  # type: ignore[no-untyped-def]
            ran = update(so, ro, sink)
            if drafts.config.method != "mtp" or not so.rows:
                return ran
            want = so.num_drafting
            for row in so.rows:
                req = sched.requests.get(row.req_id)
                if req is None or req.is_finished or req.num_inflight_tokens or not req.is_decoding:
                    continue
                if drafts.num_drafts(req, engine.max_model_len) >= drafts.k and len(req.draft_token_ids) != want:
                    self.errors.append(f"step {so.step_id}: {len(req.draft_token_ids)} drafts after a step at "
                                       f"k_step {so.num_spec_tokens} (want {want})")
            return ran

        sched.update_from_output = drafted  # type: ignore[method-assign]


def run_k_schedule(path: str, plain_run: dict[str, RequestOutput], plant: Callable[[LLMEngine, dict], None],
                   async_scheduling: bool, graphs: bool, schedule: list[int] | None = None,
                   sabotage: Callable[[LLMEngine], None] | None = None,
                   **engine_kw: object) -> tuple[dict[str, RequestOutput], KStepRecorder, LLMEngine]:
    """The scenario with MTP (k = 3) whose speculation length follows ``schedule`` step after step (the policy's
    test hook), drafts planted by ``plant`` (tests' ``plant_drafts``: accepted and rejected), async scheduling or
    not, CUDA graphs emulated (the caller sets ``cuda_graphs.EMULATE``) or not; ``engine_kw`` to the engine (worker
    processes: graphs as the environment says, rows and slots not recorded). Returns the outputs, the recorder and
    the engine; ``assert_k_schedule_matches`` checks them."""
    from hyserve.testing.engine import SlotRecorder

    arrivals, aborts, _ = scenario(path)
    engine = scenario_engine(path, ADAPTIVE_MTP, async_scheduling=async_scheduling, **engine_kw)
    in_process = not engine_kw
    if in_process:
        assert (engine.runner.graphs is not None) == graphs
    assert engine.drafts is not None
    engine.drafts.policy.script(schedule or K_SCHEDULE)
    recorder = KStepRecorder(engine)
    if sabotage is not None:
        sabotage(engine)
    slots = SlotRecorder(engine) if in_process else None
    plant(engine, {rid: out.outputs[0].token_ids for rid, out in plain_run.items() if rid != "d"})
    got = drive(engine, arrivals, aborts)
    engine.assert_no_leaks()
    assert slots is None or slots.saw_non_identity()
    return got, recorder, engine


def assert_k_schedule_matches(got: dict[str, RequestOutput], recorder: KStepRecorder, engine: LLMEngine,
                              plain_run: dict[str, RequestOutput], schedule: list[int] | None = None) -> None:
    """``run_k_schedule``'s run gave the plain run's outputs (the sampled "d" aside) with the scenario's preemption,
    hits and abort, its steps took the scripted speculation lengths in turn, every row kept to its step's k_step
    (``KStepRecorder``), and drafts were accepted and rejected."""
    schedule = schedule or K_SCHEDULE
    assert set(got) == set(plain_run) and len(got["d"].outputs[0].token_ids) == 12  # "d" samples: draws differ
    assert_same_outputs({r: o for r, o in got.items() if r != "d"}, {r: o for r, o in plain_run.items() if r != "d"})
    assert not recorder.errors, recorder.errors[:5]
    chosen = recorder.chosen
    assert len(chosen) > len(schedule) and chosen == [schedule[i % len(schedule)] for i in range(len(chosen))]
    assert {k for k, drafts in recorder.steps if any(drafts)} >= {k for k in schedule if k}
    metrics = engine.get_metrics()
    assert metrics["hyserve:num_preemptions"] > 0 and metrics["hyserve:prefix_cache_hits"] > 0  # type: ignore[operator]
    drafted = metrics["hyserve:spec_decode_num_draft_tokens"]
    accepted = metrics["hyserve:spec_decode_num_accepted_tokens"]
    assert 0 < accepted < drafted  # type: ignore[operator]  # drafts accepted and rejected
    assert drafted == sum(sum(d) for _, d in recorder.steps)  # type: ignore[operator]  # drafts actually verified
    per_k = [sum(1 for k, _ in recorder.steps if k == j) for j in range(max(k for k, _ in recorder.steps) + 1)]
    assert metrics["hyserve:spec_decode_steps_per_k"] == per_k

"""The speculation length chosen per step (``hyserve.speculative.adaptive``; docs/async_spec.md "How many drafts a
step verifies").

The policy as a unit: expected tokens per verify row from the acceptance per position (hand-computed), the choice
from a table of step times at two batch sizes, the acceptance counts' update position by position, exploration and
the probe that keeps every k measured while another wins; sabotaged variants (the acceptance counted one position
off, the batch size ignored) are caught. The configuration: fields checked, unknown ones refused, the default by
device.

The engine: the speculation length follows a scripted schedule (3, 0, 1, 0, 0, 2, ...) step after step while the
shared scenario runs (staggered arrivals, prefix hits, chunked prefill, an abort, preemption, rows mapped to other
slots, planted MTP drafts accepted and rejected), with async scheduling (rows behind rows in flight, across every
change of k) and without, eager and with emulated CUDA graphs: the outputs are the plain run's (which matches
transformers), every row keeps to its step's k, and its KV blocks cover its drafting. Sabotaged engines (a row behind
taking the configured k's placeholders; blocks reserved for the step's k in place of the drafting's; a step at k = 0,
whose GDN layers advance the slots in place, committed again) are caught (a k = 0 step's candidate snapshots:
tests/worker/test_device_drafts.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from hyserve.config import ModelConfig
from hyserve.engine.llm_engine import LLMEngine
from hyserve.scheduler.output import ScheduledRow
from hyserve.speculative import adaptive
from hyserve.speculative.adaptive import SpecLengthPolicy, bucket, expected_tokens
from hyserve.speculative.config import SpeculativeConfig
from hyserve.testing.engine import make_llm
from hyserve.testing.families import CheckpointCache
from hyserve.testing.scenarios import (
    assert_k_schedule_matches,
    assert_same_outputs,
    one_token_rows_committed_again,
    plain_scenario_run,
    run_k_schedule,
)
from hyserve.worker import cuda_graphs

# ---------------------------------------------------------------------------------------------------------- policy


def test_expected_tokens_by_hand() -> None:
    a = [0.8, 0.5, 0.5]
    assert expected_tokens(a, 0) == 1.0
    assert expected_tokens(a, 1) == pytest.approx(1.8)
    assert expected_tokens(a, 2) == pytest.approx(1.8 + 0.4)
    assert expected_tokens(a, 3) == pytest.approx(1.8 + 0.4 + 0.2)


def measured(policy: SpecLengthPolicy, table: dict[int, dict[int, float]]) -> None:
    """Step times ``table[b][k]`` observed once each."""
    for b, row in table.items():
        for k, t in row.items():
            policy.observe_step(b, k, t)


def set_acceptance(policy: SpecLengthPolicy, a: list[float]) -> None:
    policy.accepted = [x * 1000.0 for x in a]
    policy.reached = [1000.0] * len(a)


# At one row a verify step costs little more than a plain one; at 32 rows almost (k + 1) times as much.
TABLE = {1: {0: 1.0, 1: 1.2, 2: 1.5, 3: 1.9}, 32: {0: 1.0, 1: 1.9, 2: 2.5, 3: 3.0}}


def test_the_choice_maximises_expected_tokens_per_second_at_the_steps_batch() -> None:
    policy = SpecLengthPolicy(3, probe_interval=0)
    measured(policy, TABLE)
    set_acceptance(policy, [0.8, 0.5, 0.5])
    # batch 1: 1/1.0, 1.8/1.2 = 1.5, 2.2/1.5 = 1.467, 2.4/1.9 = 1.263 -> k = 1
    assert policy.choose(1) == 1
    # batch 30 (bucket 32 for 25..32 rows): 1.0, 0.947, 0.88, 0.8 -> k = 0
    assert policy.choose(30) == 0 and bucket(30) == 32
    # every draft accepted: batch 1: 4/1.9 = 2.1 -> 3; batch 32: 4/3.0 = 1.33 against 3/2.5 = 1.2 -> 3
    set_acceptance(policy, [1.0, 1.0, 1.0])
    assert policy.choose(1) == 3 and policy.choose(32) == 3
    # nothing accepted: plain steps at any batch
    set_acceptance(policy, [0.0, 0.0, 0.0])
    assert policy.choose(1) == 0 and policy.choose(32) == 0
    assert policy.histogram == {1: 1, 0: 3, 3: 2}


_CHOOSE = SpecLengthPolicy._choose


def ignores_batch(self: SpecLengthPolicy, b: int) -> int:  # sabotage: every decision made at batch 1
    return _CHOOSE(self, 1)


@pytest.mark.parametrize("sabotaged", [False, True])
def test_a_policy_that_ignores_the_batch_size_is_caught(monkeypatch: pytest.MonkeyPatch, sabotaged: bool) -> None:
    if sabotaged:
        monkeypatch.setattr(SpecLengthPolicy, "_choose", ignores_batch)
    policy = SpecLengthPolicy(3, probe_interval=0)
    measured(policy, TABLE)
    set_acceptance(policy, [0.8, 0.5, 0.5])
    assert (policy.choose(1), policy.choose(32)) == ((1, 1) if sabotaged else (1, 0))


def reference_acceptance(rows_per_step: list[list[tuple[int, int]]], k: int) -> list[float]:
    """a_j computed by hand from the definition: decayed counts of rows reaching position j and accepting it."""
    acc = [adaptive.PRIOR_ACCEPTANCE * adaptive.PRIOR_WEIGHT] * k
    reach = [adaptive.PRIOR_WEIGHT] * k
    for rows in rows_per_step:
        acc = [x * adaptive.ACCEPT_DECAY for x in acc]
        reach = [x * adaptive.ACCEPT_DECAY for x in reach]
        for d, a in rows:
            for j in range(1, k + 1):
                if j <= d and a >= j - 1:  # position j verified: every draft before it accepted
                    reach[j - 1] += 1
                    acc[j - 1] += a >= j
    return [x / y for x, y in zip(acc, reach, strict=True)]


def shifted_update(self: SpecLengthPolicy, num_drafts: list[int], num_accepted: list[int]) -> None:
    """Sabotage: the accepted count credited one position late (position j + 1 for j)."""
    for j in range(self.k):
        self.accepted[j] *= adaptive.ACCEPT_DECAY
        self.reached[j] *= adaptive.ACCEPT_DECAY
    for d, a in zip(num_drafts, num_accepted, strict=True):
        if d <= 0 or a < 0:
            continue
        for j in range(min(a + 1, d, self.k)):
            self.reached[j] += 1.0
            if 0 < j <= a:
                self.accepted[j] += 1.0


STEPS = [[(3, 1), (3, 3), (2, 0)], [(3, 0), (1, 1), (3, 2), (0, -1)], [(2, 2), (3, -1), (3, 3)]]


@pytest.mark.parametrize("sabotaged", [False, True])
def test_acceptance_counts_position_by_position(monkeypatch: pytest.MonkeyPatch, sabotaged: bool) -> None:
    """Rows with 3, 2, 1 and no drafts, errors (-1) skipped; a_j against the hand computation."""
    if sabotaged:
        monkeypatch.setattr(SpecLengthPolicy, "observe_verify", shifted_update)
    policy = SpecLengthPolicy(3)
    assert policy.acceptance == [0.5, 0.5, 0.5]  # the prior
    for rows in STEPS:
        policy.observe_verify([d for d, _ in rows], [a for _, a in rows])
    want = reference_acceptance([[(d, a) for d, a in rows if a >= 0 and d > 0] for rows in STEPS], 3)
    # position 1 by hand after the first step: (0.98 * 2 + 2) / (0.98 * 4 + 3)
    assert reference_acceptance(STEPS[:1], 3)[0] == pytest.approx((0.98 * 2 + 2) / (0.98 * 4 + 3))
    close = all(g == pytest.approx(w) for g, w in zip(policy.acceptance, want, strict=True))
    assert close != sabotaged


def test_exploration_then_probes_keep_every_k_measured() -> None:
    """Each bucket first tries every k (the largest first); afterwards, while k = 0 wins, every ``probe_interval``-th
    decision takes the k measured longest ago, so the times of the other k and the acceptance keep updating."""
    policy = SpecLengthPolicy(3, probe_interval=4)
    set_acceptance(policy, [0.3, 0.3, 0.3])
    times = TABLE[32]
    first = []
    for _ in range(4):
        k = policy.choose(32)
        first.append(k)
        policy.observe_step(32, k, times[k])
    assert first == [3, 2, 1, 0]
    later = []
    for _ in range(12):
        k = policy.choose(32)
        later.append(k)
        policy.observe_step(32, k, times[k])
    # decisions 4..15: the 4th, 8th, 12th and 16th decisions are probes (n % 4 == 3): the oldest entry each time
    assert later == [0, 0, 0, 3, 0, 0, 0, 2, 0, 0, 0, 1]
    # another bucket explores on its own
    assert policy.choose(1) == 3


def test_drafting_foresees_the_next_choice() -> None:
    """The drafting of a step is none exactly where the next decision is foreseen at 0, else max(k_step, 1): through
    the exploration (the largest k first, then 0; each step's time arrives after its drafting is decided, as in the
    engine), a run at k = 0 with its probes (drafting one before each), the script and disable_by_batch_size.
    Hand-computed from the same table as above."""
    policy = SpecLengthPolicy(3, probe_interval=4)
    set_acceptance(policy, [0.3, 0.3, 0.3])
    times = TABLE[32]
    got = []
    for _ in range(16):
        k = policy.choose(32)
        got.append((k, policy.drafting(32, k)))
        policy.observe_step(32, k, times[k])
    # choices: 3, 2, 1, 0 (exploring), then 0, 0, 0, 3 (probe), 0, 0, 0, 2, 0, 0, 0, 1
    assert [k for k, _ in got] == [3, 2, 1, 0, 0, 0, 0, 3, 0, 0, 0, 2, 0, 0, 0, 1]
    assert [d for _, d in got] == [3, 2, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0]
    scripted = SpecLengthPolicy(3)
    scripted.script([2, 0, 0, 1])
    pairs = []
    for _ in range(5):
        k = scripted.choose(8)
        pairs.append((k, scripted.drafting(8, k)))
    assert pairs == [(2, 0), (0, 0), (0, 1), (1, 1), (2, 0)]
    capped = SpecLengthPolicy(3, adaptive=False, disable_by_batch_size=8)
    assert [(capped.choose(b), capped.drafting(b, capped.choose(b))) for b in (4, 8)] == [(3, 3), (0, 0)]


def test_step_times_average_and_drop_from_a_one_off() -> None:
    """The EWMA (weight ``TIME_ALPHA``) of a (bucket, k)'s step times; a first time 100 times too long (a kernel
    compiled in that step) is replaced by the next normal one, not averaged for hundreds of steps."""
    policy = SpecLengthPolicy(1)
    policy.observe_step(8, 1, 100.0)
    policy.observe_step(8, 1, 1.0)
    assert policy.times[(8, 1)].seconds == 1.0
    policy.observe_step(8, 1, 1.5)
    assert policy.times[(8, 1)].seconds == pytest.approx(1.0 + adaptive.TIME_ALPHA * 0.5)
    policy.observe_step(7, 1, 2.0)  # bucket 8 too
    assert policy.times[(8, 1)].seconds == pytest.approx(1.1 + adaptive.TIME_ALPHA * 0.9)


def test_fixed_rules_and_the_script() -> None:
    fixed = SpecLengthPolicy(3, adaptive=False)
    assert [fixed.choose(b) for b in (1, 8, 64)] == [3, 3, 3]
    capped = SpecLengthPolicy(3, adaptive=False, disable_by_batch_size=8)
    assert [capped.choose(b) for b in (1, 7, 8, 64)] == [3, 3, 0, 0]
    fixed.script([2, 0])
    assert [fixed.choose(64) for _ in range(5)] == [2, 0, 2, 0, 2]
    fixed.script(None)
    assert fixed.choose(64) == 3
    with pytest.raises(ValueError, match=r"in \[0, 3\]"):
        fixed.script([4])


# ---------------------------------------------------------------------------------------------------------- config


def model_config(ckpts: CheckpointCache) -> ModelConfig:
    from hyserve.model.registry import load_model_config

    return load_model_config(ckpts.get("conditional", "gdn3_attn1", with_mtp=True))


@pytest.mark.parametrize("raw,message", [
    ({"adaptive": "yes"}, "adaptive must be true or false"),
    ({"disable_by_batch_size": 0}, "disable_by_batch_size must be a positive int"),
    ({"disable_by_batch_size": True}, "disable_by_batch_size must be a positive int"),
    ({"adaptive_k": True}, "unknown keys"),
])
def test_bad_fields_are_refused(ckpts: CheckpointCache, raw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": 2, **raw}, model_config(ckpts))


def test_the_default_by_device_and_the_fields_reach_the_policy(ckpts: CheckpointCache) -> None:
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    for raw, adaptive_on in (({}, False), ({"adaptive": True}, True), ({"adaptive": False}, False)):
        eng = make_llm(path, speculative_config={"method": "mtp", "num_speculative_tokens": 2, **raw},
                       disable_log_stats=True).llm_engine
        assert eng.drafts is not None and eng.drafts.policy.adaptive == adaptive_on  # the CPU's default: off
    eng = make_llm(path, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                             "disable_by_batch_size": 3}).llm_engine
    assert eng.drafts is not None and eng.drafts.policy.disable_by_batch_size == 3


# ---------------------------------------------------------------------------------------------------------- engine


@pytest.fixture(scope="module")
def plain_run(ckpts: CheckpointCache) -> dict:
    return plain_scenario_run(ckpts, ckpts.get("conditional", "gdn3_attn1", with_mtp=True))


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_a_scripted_k_schedule_gives_plain_decodings_outputs(ckpts: CheckpointCache, plain_run: dict,
                                                             plant_drafts: Callable, monkeypatch: pytest.MonkeyPatch,
                                                             async_scheduling: bool, graphs: bool) -> None:
    monkeypatch.setattr(cuda_graphs, "EMULATE", graphs)
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    got, recorder, engine = run_k_schedule(path, plain_run, plant_drafts, async_scheduling, graphs)
    assert_k_schedule_matches(got, recorder, engine, plain_run)
    if graphs:  # the steps of every speculation length ran verify graphs of their own length, and drafted
        sets = engine.runner.graphs.sets  # type: ignore[union-attr]  # max(k_step, 1) tokens in graphs of that many,
        # or none before a step at 0 (draft@0: the first pass's KV entries alone)
        kinds = ["verify@0", "verify@1", "verify@2", "draft", "draft@0", "draft@1", "draft@2"]
        # (Rows of all k = 3 drafts need two steps at 3 in a row and requests far from their ends: the synchronous
        # run has them; with rows behind rows in flight the scenario's requests end first.)
        kinds += [] if async_scheduling else ["verify"]
        assert all(sets[kind].num_replays > 0 for kind in kinds), {n: s.num_replays for n, s in sets.items()}


def lookahead_of_k_step(engine: LLMEngine) -> None:
    """Sabotage: a row's blocks cover only its own tokens plus the step's k, not the drafting's k positions."""
    sched = engine.scheduler

    def blocks_end(req, row: ScheduledRow) -> int:  # type: ignore[no-untyped-def]
        return min(row.latest_start + row.num_new_tokens + (sched._k_step if row.samples else 0),
                   sched.max_model_len)

    sched._blocks_end = blocks_end  # type: ignore[method-assign]


@pytest.mark.parametrize("sabotage", [lookahead_of_k_step, one_token_rows_committed_again])
def test_rows_that_ignore_the_steps_k_are_caught(ckpts: CheckpointCache, plain_run: dict, plant_drafts: Callable,
                                                 monkeypatch: pytest.MonkeyPatch, sabotage: Callable) -> None:
    monkeypatch.setattr(cuda_graphs, "EMULATE", True)
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    try:
        got, recorder, engine = run_k_schedule(path, plain_run, plant_drafts, True, True, sabotage=sabotage)
    except IndexError:  # the drafting's KV writes ran past the request's blocks (the eager MTP pass)
        assert sabotage is lookahead_of_k_step
        return
    with pytest.raises(AssertionError):
        assert_k_schedule_matches(got, recorder, engine, plain_run)


def test_ngram_speculation_follows_the_scripted_k(ckpts: CheckpointCache, plain_run: dict,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The n-gram proposer under the same per-step length: its drafts (known continuations with errors planted)
    trimmed to each step's k, the plain run's outputs, async scheduling and emulated graphs."""
    from hyserve.testing.engine import drive
    from hyserve.testing.scenarios import KStepRecorder, scenario, scenario_engine
    from hyserve.testing.speculative import OracleProposer

    monkeypatch.setattr(cuda_graphs, "EMULATE", True)
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    arrivals, aborts, _ = scenario(path)
    engine = scenario_engine(path, {"method": "ngram", "num_speculative_tokens": 3, "adaptive": True},
                             async_scheduling=True)
    assert engine.drafts is not None
    engine.drafts.policy.script([3, 0, 2, 1, 0])
    recorder = KStepRecorder(engine)
    conts = {rid: out.outputs[0].token_ids for rid, out in plain_run.items() if rid != "d"}
    engine.proposer = OracleProposer({"c": [], "d": [], **conts}, {rid: [3, 1, 2] for rid in conts}, vocab=440)
    got = drive(engine, arrivals, aborts)
    engine.assert_no_leaks()
    assert_same_outputs({r: o for r, o in got.items() if r != "d"}, {r: o for r, o in plain_run.items() if r != "d"})
    assert not recorder.errors and recorder.chosen == [[3, 0, 2, 1, 0][i % 5] for i in range(len(recorder.chosen))]
    assert {k for k, drafts in recorder.steps if any(drafts)} == {1, 2, 3}


def _plain_outputs(path: str, prompts: dict[str, list[int]], params: Any) -> dict[str, list[int]]:
    """Each prompt's greedy output from an engine without speculation (each request alone)."""
    plain = make_llm(path, enable_prefix_caching=False)
    return {rid: list(plain.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids)
            for rid, p in prompts.items()}


# Fake step times by bucket and k: at one row verifying is nearly free, at four rows it costs nearly k + 1 steps.
FAKE_TIMES = {1: {0: 1.0, 1: 1.1, 2: 1.2, 3: 1.3}, 4: {0: 1.0, 1: 2.5, 2: 4.0, 3: 5.5}}


def test_the_engine_turns_speculation_off_where_it_cannot_pay(ckpts: CheckpointCache, plant_drafts: Callable) -> None:
    """The live loop: the engine feeds the policy its verify results and step times (the times replaced by
    ``FAKE_TIMES``, the acceptance measured: planted drafts, the last of each step's drafts wrong where it has
    more than one). Alone, a request speculates (one right draft alone gives E = 2 tokens for 1.1 against 1.0
    plain); four at once decode plainly, with a probe now and then; the outputs are plain decoding's all along."""
    from hyserve import SamplingParams
    from hyserve.testing.engine import drive

    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    prompts = {rid: [(7 * i + j) % 400 + 3 for j in range(12 + 3 * i)] for i, rid in enumerate("abcde")}
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    want = _plain_outputs(path, prompts, params)
    eng = make_llm(path, speculative_config={"method": "mtp", "num_speculative_tokens": 3, "adaptive": True},
                   max_num_seqs=4, async_scheduling=False).llm_engine
    assert eng.drafts is not None
    policy = eng.drafts.policy
    policy.probe_interval = 8
    observe = policy.observe_step
    policy.observe_step = lambda b, k, seconds: observe(b, k, FAKE_TIMES[bucket(b)][k])  # type: ignore[method-assign]
    plant_drafts(eng, want)
    alone = drive(eng, {0: [("a", prompts["a"], params)]})
    at_one = dict(policy.histogram)
    policy.histogram.clear()
    together = drive(eng, {0: [(rid, prompts[rid], params) for rid in "bcde"]})
    eng.assert_no_leaks()
    assert {rid: list(o.outputs[0].token_ids) for rid, o in {**alone, **together}.items()} == want
    assert policy.acceptance[0] > 0.9  # the first draft is always right; later ones end planted wrong
    assert sum(n for k, n in at_one.items() if k) > 0.6 * sum(at_one.values()), at_one  # E(1) = 2 in 1.1: speculate
    at_four = dict(policy.histogram)
    assert at_four[0] > 0.6 * sum(at_four.values()) and set(at_four) == {0, 1, 2, 3}, at_four  # probes included


@pytest.mark.parametrize("sabotaged", [False, True])
def test_the_policy_learns_the_workers_step_times_not_the_hosts_intervals(
        ckpts: CheckpointCache, plant_drafts: Callable, monkeypatch: pytest.MonkeyPatch, sabotaged: bool) -> None:
    """With steps in flight the host may read a step's result only after launching the next step, so the interval
    between two results holds other work (on the seed's trace a 32 ms decode step read 0.2-0.9 s after the one
    before, behind an eager prompt step's launch, and k = 2 stayed chosen at zero acceptance). Here every draft is
    wrong, a step that verifies drafts costs the worker 30 ms more, and the host is held 0.1 s before it reads the
    result of a step at k = 0. The policy learns each step's time from the worker (``StepTimer``, reported with its
    result) and decodes plainly; a worker that reports no times (the host's intervals learned) is caught."""
    import time as _time

    from hyserve import SamplingParams
    from hyserve.testing.engine import drive
    from hyserve.worker import model_runner

    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    prompts = {rid: [(5 * i + j) % 300 + 3 for j in range(10 + 2 * i)] for i, rid in enumerate("abcd")}
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    want = _plain_outputs(path, prompts, params)
    wrong = {rid: [(t + 1) % 50 for t in toks] for rid, toks in want.items()}
    execute = model_runner.ModelRunner._execute_last

    def costly_verify(self: Any, so: Any, out: Any) -> Any:
        if any(r.num_drafts for r in so.rows):
            _time.sleep(0.03)  # well above a loaded CI machine's noise in a step's time
        return execute(self, so, out)

    monkeypatch.setattr(model_runner.ModelRunner, "_execute_last", costly_verify)
    if sabotaged:
        take = model_runner.StepTimer.take
        monkeypatch.setattr(model_runner.StepTimer, "take", lambda self: take(self) and None)
    eng = make_llm(path, speculative_config={"method": "mtp", "num_speculative_tokens": 2, "adaptive": True},
                   max_num_seqs=4, async_scheduling=True).llm_engine
    assert eng.drafts is not None
    policy = eng.drafts.policy
    policy.probe_interval = 32
    learned: list[tuple[int, float]] = []
    observe = policy.observe_step

    def spy(b: int, k: int, seconds: float) -> None:
        learned.append((k, seconds))
        observe(b, k, seconds)

    policy.observe_step = spy  # type: ignore[method-assign]
    observe_spec = eng._observe_spec

    def late_reader(so: Any, ro: Any, verify: list[int], t0: float) -> None:
        if so.rows and so.num_spec_tokens == 0:
            _time.sleep(0.1)
        observe_spec(so, ro, verify, t0)

    eng._observe_spec = late_reader  # type: ignore[method-assign]
    plant_drafts(eng, wrong)
    got = drive(eng, {0: [(rid, prompts[rid], params) for rid in "abcd"]})
    eng.assert_no_leaks()
    assert {rid: list(o.outputs[0].token_ids) for rid, o in got.items()} == want
    assert policy.acceptance[0] < 0.2

    def plain_decoding_chosen() -> None:
        at_zero = [s for k, s in learned if k == 0]
        assert at_zero and any(k for k, _ in learned)
        assert sorted(at_zero)[len(at_zero) // 2] < 0.05  # the worker's times: the host's hold is not in them
        hist = dict(policy.histogram)
        assert hist.get(0, 0) > 0.6 * sum(hist.values()), hist  # plain decoding, with the probes

    if sabotaged:
        with pytest.raises(AssertionError):
            plain_decoding_chosen()
    else:
        plain_decoding_chosen()

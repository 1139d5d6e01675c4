"""CUDA graphs for decode steps (``hyserve.worker.cuda_graphs``).

On the CPU the graphs are emulated: the same padded static forward (pad rows on the pad slot, full-width block
tables, ``max_seq_len = max_model_len``, logits for every padded row) runs eagerly in place of a replay, so these
tests check everything but capture and replay themselves against transformers; the CUDA test checks those.
"""

from __future__ import annotations

import pytest
import torch

from hyserve import SamplingParams
from hyserve.cli import build_parser
from hyserve.testing.engine import assert_matches_reference, drive, make_llm, random_prompts
from hyserve.testing.families import CheckpointCache
from hyserve.testing.scenarios import K_SCHEDULE
from hyserve.worker import cuda_graphs
from hyserve.worker.cuda_graphs import DEFAULT_CAPTURE_SIZES, capture_sizes


@pytest.fixture
def emulate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cuda_graphs, "EMULATE", True)


class RunRecorder:
    """Wraps the graph runner: (real rows, padded size) of every graph step."""

    def __init__(self, runner: object) -> None:
        self.steps: list[tuple[int, int]] = []
        graphs = runner.graphs  # type: ignore[attr-defined]
        assert graphs is not None, "graphs were not set up"
        original_prepare = runner.prepare  # type: ignore[attr-defined]

        def prepare(rows, pad_to=None):  # type: ignore[no-untyped-def]
            if pad_to is not None:
                self.steps.append((len(rows), pad_to))
            return original_prepare(rows, pad_to=pad_to)

        runner.prepare = prepare  # type: ignore[attr-defined]

    @property
    def padded_steps(self) -> int:
        return sum(1 for r, s in self.steps if s > r)


def test_capture_sizes() -> None:
    assert capture_sizes(256, None) == list(DEFAULT_CAPTURE_SIZES)
    assert capture_sizes(5, None) == [1, 2, 4, 5]
    assert capture_sizes(1000, None)[-1] == 256
    assert capture_sizes(6, [8, 1, 3, 3]) == [1, 3]
    with pytest.raises(ValueError, match="cuda_graph_sizes must be positive"):
        capture_sizes(8, [0, 2])


@pytest.mark.parametrize("pattern", ["gdn3_attn1", "attn_first"])
def test_emulated_graphs_match_transformers_with_chunking_caching_aborts(
        ckpts: CheckpointCache, emulate: None, pattern: str) -> None:
    path = ckpts.get("causal", pattern)
    ref = ckpts.reference(path)
    # 5 sequences: sizes 1, 2, 4, 5; a 20-token budget chunks the prompts and mixes prefill with decode (eager).
    llm = make_llm(path, max_num_batched_tokens=20, max_num_seqs=5, num_state_slots=7)
    eng = llm.llm_engine
    assert eng.runner.graphs is not None and eng.runner.graphs.sets["decode"].sizes == [1, 2, 4, 5]
    assert set(eng.runner.graphs.sets) == {"decode"}
    rec = RunRecorder(eng.runner)
    prompts = random_prompts(7, [9, 30, 3, 17, 25, 5, 12], seed=61)
    shared = prompts[1][:24]  # later requests resume a cached prefix (KV blocks and a recurrent snapshot)
    prompts[5] = shared + prompts[5]
    prompts[6] = shared + prompts[6]
    greedy = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, logprobs=1)
    arrivals = {0: [("r0", prompts[0], greedy), ("r1", prompts[1], greedy)], 2: [("r2", prompts[2], greedy)],
                5: [("r3", prompts[3], greedy), ("x", prompts[4], greedy)], 9: [("r4", prompts[4], greedy)],
                30: [("r5", prompts[5], greedy), ("r6", prompts[6], greedy)]}
    final = drive(eng, arrivals, aborts={12: ["x"]})
    assert "x" not in final
    for i in range(7):
        assert_matches_reference(ref, prompts[i], final[f"r{i}"])
    assert rec.padded_steps > 0, "no step ran with pad rows"
    assert {s for _, s in rec.steps} >= {1, 4}, f"graph sizes used: {rec.steps}"
    assert final["r5"].num_cached_tokens > 0 and final["r6"].num_cached_tokens > 0, "prefix cache not hit"
    eng.assert_no_leaks()


def test_emulated_graphs_equal_eager_under_preemption_and_sampling(ckpts: CheckpointCache,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = ckpts.get("causal", "attn_both_ends")
    prompts = random_prompts(6, [14, 20, 9, 17, 11, 19], seed=21)
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(temperature=1.0, seed=7 * i, max_tokens=20, ignore_eos=True) for i in range(6)]
    kw = dict(block_size=4, num_kv_blocks=15, num_state_slots=6, max_model_len=56, max_num_batched_tokens=16,
              max_num_seqs=6)
    eager = make_llm(path, **kw)
    assert eager.llm_engine.runner.graphs is None
    expected = eager.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    monkeypatch.setattr(cuda_graphs, "EMULATE", True)
    graphed = make_llm(path, **kw)
    rec = RunRecorder(graphed.llm_engine.runner)
    outs = graphed.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert graphed.get_metrics()["hyserve:num_preemptions"] > 0
    assert rec.padded_steps > 0
    for i, (e, o) in enumerate(zip(expected, outs, strict=True)):
        assert o.outputs[0].token_ids == e.outputs[0].token_ids, f"request {i} differs with graphs"
    graphed.llm_engine.assert_no_leaks()
    # enforce_eager turns the graphs off.
    assert make_llm(path, enforce_eager=True, **kw).llm_engine.runner.graphs is None


@pytest.mark.parametrize("mode", ["decode", "verify", "mtp"])
def test_pad_rows_touch_no_request_state(ckpts: CheckpointCache, emulate: None, mode: str) -> None:
    """At every step: recurrent slots change only for the step's own requests (and the pad slot), the null KV block
    of every cache (target and MTP) never changes, and graph steps with pad rows did happen."""
    from hyserve.testing.speculative import OracleProposer, solo_outputs

    kw: dict[str, object] = dict(max_num_seqs=4, num_state_slots=6, num_kv_blocks=64, max_num_batched_tokens=64)
    prompts = {f"r{i}": p for i, p in enumerate(random_prompts(3, [6, 11, 8], seed=71))}
    if mode == "decode":
        path = ckpts.get("causal", "gdn3_attn1")
    elif mode == "verify":
        path = ckpts.get("causal", "gdn3_attn1")
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
    else:
        path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
        kw["speculative_config"] = {"method": "mtp", "num_speculative_tokens": 2}
    want = solo_outputs(path, prompts, 24)
    llm = make_llm(path, **kw)
    eng = llm.llm_engine
    runner = eng.runner
    if mode == "verify":  # full-length drafts with planted errors: every acceptance length, every step a graph
        eng.proposer = OracleProposer(want, {rid: [0, 2, 1] for rid in prompts}, vocab=eng.model_config.vocab_size)
    assert runner.graphs is not None
    padded: list[tuple[str, int, int]] = []
    for name, graph_set in runner.graphs.sets.items():
        original = graph_set.run

        def run(size: int, _name: str = name, _run=original):  # type: ignore[no-untyped-def]
            padded.append((_name, size, len(eng.scheduler.running)))
            return _run(size)

        graph_set.run = run  # type: ignore[method-assign]
    pool = runner.state_pool
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for rid, p in prompts.items():
        eng.add_request(rid, {"prompt_token_ids": p}, greedy)
    final = {}
    while eng.has_unfinished_requests():
        states = [t.clone() for t in pool.conv_states + pool.ssm_states]
        nulls = [(k[0].clone(), v[0].clone()) for k, v in runner.kv_caches_all]
        step_slots = {r.state_slot for r in eng.scheduler.running} | {r.state_slot for r in eng.scheduler.waiting}
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out.outputs[0].token_ids
        step_slots |= {r.state_slot for r in eng.scheduler.running}
        for before, after in zip(states, pool.conv_states + pool.ssm_states, strict=True):
            # Request slots and the pad slot (snapshot entries after it are filled by copies, not by a forward).
            changed = {i for i in range(pool.pad_slot + 1) if not torch.equal(before[i], after[i])}
            assert changed <= step_slots | {pool.pad_slot}, f"slots changed: {changed}, step slots {step_slots}"
        for (k0, v0), (k, v) in zip(nulls, runner.kv_caches_all, strict=True):
            assert torch.equal(k0, k[0]) and torch.equal(v0, v[0]), "the null block was written"
    assert final == want, "outputs differ from the plain run"
    kinds = {"decode": {"decode"}, "verify": {"verify"}, "mtp": {"verify", "mtp"}}[mode]
    assert {n for n, size, rows in padded if size > rows} >= kinds, f"no padded graph step of each kind: {padded}"
    eng.assert_no_leaks()


def test_ragged_verify_rows_replay_the_verify_graph(ckpts: CheckpointCache, emulate: None) -> None:
    """Rows with fewer drafts than k (none, some) share the verify graph with full rows: each is laid out in k + 1
    tokens with the tail masked. Outputs must equal the plain run's and transformers'."""
    from hyserve.testing.speculative import OracleProposer, solo_outputs

    class Ragged(OracleProposer):
        def propose(self, requests, num_tokens):  # type: ignore[no-untyped-def]
            out = super().propose(requests, num_tokens)
            return [d[: (len(self.forced) + i) % (len(d) + 1)] for i, d in enumerate(out)]

    path = ckpts.get("causal", "attn_first")
    ref = ckpts.reference(path)
    prompts = {f"r{i}": p for i, p in enumerate(random_prompts(5, [7, 19, 4, 12, 26], seed=91))}
    want = solo_outputs(path, prompts, 20)
    llm = make_llm(path, max_num_seqs=5, max_num_batched_tokens=64, enable_prefix_caching=True,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
    eng = llm.llm_engine
    eng.proposer = Ragged(want, {rid: [0, 3, 1, 2] for rid in prompts}, vocab=eng.model_config.vocab_size)
    verify = eng.runner.graphs.sets["verify"]  # type: ignore[union-attr]
    lens: list[list[int]] = []  # row lengths of each verify-graph step
    prepare = eng.runner.prepare

    def record(rows, **kw):  # type: ignore[no-untyped-def]
        if kw.get("row_len"):
            lens.append([r.num_new_tokens for r in rows])
        return prepare(rows, **kw)

    eng.runner.prepare = record  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=1)
    final = drive(eng, {2 * i: [(rid, p, params)] for i, (rid, p) in enumerate(prompts.items())})
    for rid, p in prompts.items():
        assert final[rid].outputs[0].token_ids == want[rid], rid
        assert_matches_reference(ref, p, final[rid])
    assert verify.num_replays == len(lens) > 0
    ragged = [ls for ls in lens if len(set(ls)) > 1 and min(ls) == 1]
    assert ragged, f"no graph step mixed rows without drafts and rows with drafts: {lens}"
    eng.assert_no_leaks()


def test_speculative_graph_kinds_and_sizes(ckpts: CheckpointCache, emulate: None) -> None:
    ngram = make_llm(ckpts.get(), max_num_seqs=5, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                                     "prompt_lookup_max": 3})
    graphs = ngram.llm_engine.runner.graphs
    assert graphs is not None and set(graphs.sets) == {"verify", "commit", "snapshot"}
    assert graphs.sets["verify"].sizes == graphs.sets["commit"].sizes == graphs.sets["snapshot"].sizes == [1, 2, 4, 5]
    mtp = make_llm(ckpts.get("conditional", "gdn3_attn1", with_mtp=True), max_num_seqs=8, max_num_batched_tokens=24,
                   speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    graphs = mtp.llm_engine.runner.graphs
    assert graphs is not None and set(graphs.sets) == {"verify", "commit", "snapshot", "mtp", "draft", "draft_fill",
                                                        "behind", "accept"}
    assert graphs.sets["verify"].sizes == [1, 2, 4, 6]  # 24 tokens per step / 4 tokens per verify row
    assert graphs.sets["draft"].sizes == [1, 2, 4, 6]  # the drafting of a verify step of those rows
    assert graphs.sets["mtp"].sizes == [1, 2, 4, 8]


def _sabotage_draft_fill(runner: object, how: str) -> None:
    """Break the draft graph's inputs after each fill: chained passes one position late, or every row reading the
    next row's blocks (a row -> request mapping that is off by one)."""
    def broken(original):  # type: ignore[no-untyped-def]
        def fill(rows, *args):  # type: ignore[no-untyped-def]
            index = original(rows, *args)
            d = runner.drafter.draft_dev  # type: ignore[attr-defined]
            n = len(rows)
            if how == "positions":
                d["chain_positions"][:, :n] += 1
            elif n > 1:
                d["block_tables"][:n] = d["block_tables"][:n].roll(1, dims=0)
            return index
        return fill

    # Both fills: the host's (steps whose drafting waits for the host) and the one reading counts on the device.
    drafter = runner.drafter  # type: ignore[attr-defined]
    drafter._fill_draft = broken(drafter._fill_draft)
    drafter.fill_draft_on_device = broken(drafter.fill_draft_on_device)


@pytest.mark.parametrize("sabotage", [None, "positions", "rows"])
def test_draft_graph_drafts_what_the_pass_by_pass_drafting_does(ckpts: CheckpointCache,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                sabotage: str | None) -> None:
    """A verify step's whole drafting in one ``draft`` graph (first pass over the accepted positions, k - 1 passes
    chained on the device) against the passes one by one: the same drafts and first-pass outputs at every step of
    staggered requests, some of which may draft fewer than k tokens (max_tokens). A sabotaged fill must differ."""
    from hyserve.testing.speculative import record_drafts

    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    prompts = {f"r{i}": random_prompts(1, [12 + 7 * i], seed=60 + i)[0] for i in range(4)}
    arrivals = {2 * i: [(rid, p, SamplingParams(temperature=0.0, max_tokens=9 + 4 * i, ignore_eos=True))]
                for i, (rid, p) in enumerate(prompts.items())}
    runs = {}
    for emulate in (False, True):
        monkeypatch.setattr(cuda_graphs, "EMULATE", emulate)
        llm = make_llm(path, max_num_seqs=3, max_num_batched_tokens=24,
                       speculative_config={"method": "mtp", "num_speculative_tokens": 3})
        engine = llm.llm_engine
        if emulate and sabotage is not None:
            _sabotage_draft_fill(engine.runner, sabotage)
        seen = record_drafts(engine)
        final = drive(engine, arrivals)
        replays = engine.runner.graphs.sets["draft"].num_replays if emulate else 0  # type: ignore[union-attr]
        runs[emulate] = (seen, {rid: o.outputs[0].token_ids for rid, o in final.items()}, replays)
        engine.assert_no_leaks()
    (eager, out_e, _), (graph, out_g, replays) = runs[False], runs[True]
    assert replays > 0
    assert out_g == out_e  # speculation never changes outputs, whatever the drafts
    same = set(eager) == set(graph) and all(
        [d for d, _ in eager[rid]] == [d for d, _ in graph[rid]]
        and all(torch.allclose(he, hg, rtol=1e-5, atol=1e-5) for (_, he), (_, hg) in zip(eager[rid], graph[rid],
                                                                                          strict=True)
                if he is not None and hg is not None)
        for rid in eager)
    assert same is (sabotage is None)


@pytest.mark.parametrize("sabotage", [False, True])
def test_commit_graph_commits_each_row_to_its_own_slot(ckpts: CheckpointCache, emulate: None,
                                                       monkeypatch: pytest.MonkeyPatch, sabotage: bool) -> None:
    """The verify rows' commit in one ``commit`` graph: n-gram speculation over staggered requests is token-exact
    with plain decoding; a commit graph that reads the rows' slots in reverse order must not be."""
    from hyserve.worker.state_ops import StateOps

    if sabotage:
        def reversed_commit(self, size):  # type: ignore[no-untyped-def]
            bufs = self.batch.dev_bufs
            slots, acc = bufs["state_slots"][:size].flip(0), bufs["num_accepted"][:size]
            for layer in self.model.recurrent_layers():
                layer.commit_verified(slots, acc)
            return ()

        monkeypatch.setattr(StateOps, "_graph_commit", reversed_commit)
    path = ckpts.get()
    prompts = {f"r{i}": random_prompts(1, [10 + 5 * i], seed=80 + i)[0] * 2 for i in range(3)}  # repeats: n-gram hits
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    arrivals = {i: [(rid, p, params)] for i, (rid, p) in enumerate(prompts.items())}
    plain = drive(make_llm(path, max_num_seqs=4).llm_engine, arrivals)
    llm = make_llm(path, max_num_seqs=4, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                              "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    spec = drive(llm.llm_engine, arrivals)
    assert llm.llm_engine.runner.graphs.sets["commit"].num_replays > 0  # type: ignore[union-attr]
    same = all(spec[rid].outputs[0].token_ids == plain[rid].outputs[0].token_ids for rid in prompts)
    assert same is not sabotage


def test_cli_graph_flags() -> None:
    args = build_parser().parse_args(["generate", "m", "--enforce-eager", "--cuda-graph-sizes", "1,2,8"])
    assert args.enforce_eager is True and args.cuda_graph_sizes == [1, 2, 8]
    args = build_parser().parse_args(["serve"])
    assert args.enforce_eager is False and args.cuda_graph_sizes is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec", [None, "ngram", "mtp", "mtp-k-schedule"])
def test_cuda_graphs_match_eager_on_gpu(ckpts: CheckpointCache, spec: str | None) -> None:
    """Graphs against eager on the card (float32). The speculation length is fixed (CUDA's default, adaptive k,
    chooses from measured step times, so two engines would verify different lengths), or, ``mtp-k-schedule``, both
    engines follow one scripted schedule of lengths (every shorter length's graphs replayed)."""
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    schedule = spec == "mtp-k-schedule"
    spec = "mtp" if schedule else spec
    ref = ckpts.reference(path)
    prompts = random_prompts(7, [9, 30, 3, 17, 25, 5, 12], seed=81)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    kw: dict[str, object] = dict(device="cuda", max_num_batched_tokens=32, max_num_seqs=6, num_state_slots=6,
                                 num_kv_blocks=128)
    if spec is not None:
        kw["speculative_config"] = {"method": spec, "num_speculative_tokens": 3, "prompt_lookup_max": 2,
                                    "adaptive": False} \
            if spec == "ngram" else {"method": spec, "num_speculative_tokens": 3, "adaptive": schedule}
    eager = make_llm(path, enforce_eager=True, **kw)
    # MTP under async scheduling: verify rows behind rows in flight replay the draft_fill, behind and accept graphs.
    graphed = make_llm(path, async_scheduling=spec == "mtp", **kw)
    if schedule:
        for llm in (eager, graphed):
            llm.llm_engine.drafts.policy.script(K_SCHEDULE)
    graphs = graphed.llm_engine.runner.graphs
    assert graphs is not None and all(s.graphs for s in graphs.sets.values()), "nothing was captured"
    arrivals = {3 * i: [(f"r{i}", p, params)] for i, p in enumerate(prompts)}
    want = drive(eager.llm_engine, arrivals)
    if spec == "ngram":  # drafts of full length with planted errors, so that verify steps replay graphs
        from hyserve.testing.speculative import OracleProposer

        conts = {rid: o.outputs[0].token_ids for rid, o in want.items()}
        graphed.llm_engine.proposer = OracleProposer(conts, {rid: [0, 3, 1, 2] for rid in conts}, vocab=440)
    got = drive(graphed.llm_engine, arrivals)
    if spec == "mtp":  # rows asking for logprobs never go behind: the same prompts again without them
        plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        behind = drive(graphed.llm_engine, {3 * i: [(f"b{i}", p, plain)] for i, p in enumerate(prompts)})
        for i in range(len(prompts)):
            assert behind[f"b{i}"].outputs[0].token_ids == want[f"r{i}"].outputs[0].token_ids
    replays = {n: s.num_replays for n, s in graphs.sets.items()}
    if schedule:  # the lengths the schedule takes: the verify graphs of each
        assert all(n for name, n in replays.items() if name.startswith("verify")), replays
    else:
        assert all(replays.values()), replays
    for i, p in enumerate(prompts):
        assert got[f"r{i}"].outputs[0].token_ids == want[f"r{i}"].outputs[0].token_ids
        assert_matches_reference(ref, p, got[f"r{i}"])
    graphed.llm_engine.assert_no_leaks()

"""Pipeline parallelism on the CPU: stages of consecutive layers in worker processes, hidden states and residuals
sent between them over gloo (``pipeline_parallel_size`` P, with tensor parallelism inside a stage).

Each stage holds its layers' KV blocks and recurrent states under the same block and slot ids; the last stage
samples, verifies drafts and runs the MTP head. Up to P steps are in flight (micro-batches: a request waits for
its own result), so a stage before the last runs steps past a verify step before that step's accepted counts come
back; it applies them through that step's own rows when they arrive (``SchedulerOutput.verify_commits``). Checked
against the single-process engine (token for token, logprobs) and transformers (teacher-forced) with prefix hits,
chunked prefill, preemption, an abort, stops, seeded sampling and speculation on together; stages holding only
recurrent or only attention layers; an uneven partition over three stages; TP=2 x PP=2; sabotaged stages that
apply a late step's counts through another step's rows; dead ranks.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hyserve import SamplingParams
from hyserve.cache.planner import CacheInfo, plan_caches_for_ranks
from hyserve.config import EngineConfig
from hyserve.distributed.parallel_state import layer_partition
from hyserve.engine.llm_engine import LLMEngine
from hyserve.executor.multiproc import MultiprocExecutor
from hyserve.outputs import RequestOutput
from hyserve.testing.engine import assert_matches_reference, drive, make_llm
from hyserve.testing.families import CheckpointCache
from hyserve.testing.scenarios import (
    SPECS,
    assert_k_schedule_matches,
    plain_scenario_run,
    reference_run,
    run_k_schedule,
    scenario,
    scenario_engine,
    with_stops,
)


def _tokens(final: dict[str, RequestOutput]) -> dict[str, list[int]]:
    return {rid: out.outputs[0].token_ids for rid, out in final.items()}


def _assert_same_logprobs(got: dict[str, RequestOutput], want: dict[str, RequestOutput]) -> None:
    for rid, out in got.items():
        tok = out.outputs[0].token_ids
        for i, lp in enumerate(out.outputs[0].logprobs or []):
            assert abs(lp[tok[i]].logprob - want[rid].outputs[0].logprobs[i][tok[i]].logprob) < 1e-4  # type: ignore[index]


def _run_all_ranks_clean(engine: LLMEngine, arrivals: dict[int, list], aborts: dict[int, list[str]]
                         ) -> dict[str, RequestOutput]:
    got = drive(engine, arrivals, aborts)
    engine.assert_no_leaks()
    # Every stage applied every verify step's accepted counts (nothing left for a later request to trip on).
    assert engine.executor.collective_rpc("num_uncommitted_steps") == [0] * engine.config.world_size
    return got


def test_layer_partition_defaults_and_errors() -> None:
    assert layer_partition(48, 4) == [12, 12, 12, 12]
    assert layer_partition(49, 4) == [12, 12, 13, 12]  # the remainder goes before the last stage
    assert layer_partition(6, 4) == [1, 2, 2, 1]
    assert layer_partition(48, 4, [13, 13, 13, 9]) == [13, 13, 13, 9]
    with pytest.raises(ValueError, match=r"13,13,13 has 3 entries for pipeline_parallel_size=4"):
        layer_partition(48, 4, [13, 13, 13])
    with pytest.raises(ValueError, match=r"sums to 47 layers but the model has num_hidden_layers=48"):
        layer_partition(48, 4, [13, 13, 12, 9])
    with pytest.raises(ValueError, match=r"every stage needs at least one layer"):
        layer_partition(4, 2, [4, 0])
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=5 is more than .*num_hidden_layers=4"):
        layer_partition(4, 5)


def test_bad_pipeline_settings_are_refused_before_any_worker_starts(ckpts: CheckpointCache) -> None:
    path = ckpts.get()
    with pytest.raises(ValueError, match=r"pp_layer_partition 1,2 sums to 3 layers .*num_hidden_layers=4"):
        make_llm(path, pipeline_parallel_size=2, pp_layer_partition=[1, 2])
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=2 needs one process per rank"):
        make_llm(path, pipeline_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match=r"pipeline_parallel_size must be positive"):
        make_llm(path, pipeline_parallel_size=0)


def test_one_layout_fits_every_stage() -> None:
    """Stage 0 holds only recurrent layers, stage 1 only attention: the block count comes from stage 1, the slot
    and snapshot counts from stage 0; a stage without recurrent state does not limit the snapshots."""
    config = EngineConfig(model="unused", cpu_cache_memory_bytes=10_000_000)
    infos = [CacheInfo(0, 100_000, True), CacheInfo(8_192, 0, False)]
    layout = plan_caches_for_ranks(config, infos, 8, 0, lambda: [10_000_000, 10_000_000], "cpu")
    alone = [plan_caches_for_ranks(config, [info], 8, 0, lambda: [10_000_000], "cpu") for info in infos]
    assert layout.num_kv_blocks == alone[1].num_kv_blocks < alone[0].num_kv_blocks
    assert layout.num_snapshots == alone[0].num_snapshots > 0 and alone[1].num_snapshots == 0
    assert layout.num_state_slots == 8
    # Verify scratch sets are counted: a stage keeping three sets fits fewer sequences in the same budget.
    tight = EngineConfig(model="unused", cpu_cache_memory_bytes=3_000_000, enable_prefix_caching=False)
    one = plan_caches_for_ranks(tight, [CacheInfo(8_192, 100_000, True)], 64, 2, lambda: [3_000_000], "cpu")
    three = plan_caches_for_ranks(tight, [CacheInfo(8_192, 100_000, True, 3)], 64, 2, lambda: [3_000_000], "cpu")
    assert three.max_num_seqs < one.max_num_seqs


@pytest.fixture(scope="module")
def spare() -> Iterator[dict[str, LLMEngine]]:
    """Engines a test is done with, left running for a later test that only needs some PP 2 engine to kill a rank
    of (its worker processes then start once); shut down at the module's end if no test took them."""
    engines: dict[str, LLMEngine] = {}
    yield engines
    for engine in engines.values():
        engine.shutdown()


@pytest.mark.parametrize("spec", [pytest.param("plain", marks=pytest.mark.slow), "mtp"])  # budget: mtp has it all
def test_pp2_matches_one_process_with_every_feature(ckpts: CheckpointCache, spare: dict[str, LLMEngine],
                                                    spec: str) -> None:
    """Two stages of two layers: stage 0 holds only GDN layers, stage 1 a GDN and the attention layer, the norm,
    the LM head and the MTP head."""
    path, arrivals, aborts, prompts, want = reference_run(ckpts, spec)
    engine = scenario_engine(path, spec, pipeline_parallel_size=2)
    assert isinstance(engine.executor, MultiprocExecutor) and len(engine.executor.pids) == 2
    assert engine.max_steps_in_flight == 1  # two micro-batches in flight, one per stage
    got = _run_all_ranks_clean(engine, arrivals, aborts)
    metrics = engine.get_metrics()
    if spec == "plain":
        spare.setdefault("pp2", engine)  # for test_a_dead_stage_is_reported_by_rank_within_seconds
    else:
        engine.shutdown()
    assert _tokens(got) == _tokens(want)
    _assert_same_logprobs(got, want)
    assert metrics["hyserve:prefix_cache_hits"] > 0 and metrics["hyserve:num_preemptions"] > 0
    ref = ckpts.reference(path)
    for rid, out in got.items():
        if rid != "d":  # sampled
            assert_matches_reference(ref, prompts[rid], out)


def test_pp2_follows_a_scripted_speculation_length(ckpts: CheckpointCache, plant_drafts: Callable,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Two stages, async scheduling, graphs emulated in the workers, the speculation length scripted step after step
    (``hyserve.testing.scenarios.K_SCHEDULE``): every stage runs the step's rows (the last one its verify graph of
    their length where they all have it, the first eagerly where rows are short of k + 1), and the outputs are the
    plain run's."""
    monkeypatch.setenv("HYSERVE_EMULATE_CUDA_GRAPHS", "1")
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    plain_run = plain_scenario_run(ckpts, path)
    got, recorder, engine = run_k_schedule(path, plain_run, plant_drafts, True, True, pipeline_parallel_size=2)
    try:
        assert_k_schedule_matches(got, recorder, engine, plain_run)
        replays = engine.executor.collective_rpc("graph_replays")
    finally:
        engine.shutdown()
    # the last stage's verify graphs of several lengths (a row of j drafts runs verify@j where every row has j)
    assert sum(1 for kind, n in replays[1].items() if kind.startswith("verify") and n) >= 2, replays


def _compare_with_one_process(path: str, spec: str, **kw: object) -> tuple[dict, dict, LLMEngine]:
    arrivals, aborts, _ = scenario(path)
    first = drive(scenario_engine(path, spec), arrivals, aborts)
    arrivals = with_stops(scenario_engine(path, spec), arrivals, first)
    want = drive(scenario_engine(path, spec), arrivals, aborts)
    engine = scenario_engine(path, spec, **kw)
    got = _run_all_ranks_clean(engine, arrivals, aborts)
    return got, want, engine


def test_three_uneven_stages_with_mtp3_and_an_attention_only_last_stage(ckpts: CheckpointCache,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Six layers split 3,2,1: the last stage holds only the attention layer (no recurrent state), the others
    only GDN layers; MTP with three drafts; async scheduling on (three steps in flight); graphs emulated in the
    workers (the middle stage's verify graphs read its received input, one graph per scratch set)."""
    monkeypatch.setenv("HYSERVE_EMULATE_CUDA_GRAPHS", "1")
    path = ckpts.get("causal", "attn_last_gdn_run", with_mtp=True)
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    SPECS["mtp3"] = spec
    try:
        got, want, engine = _compare_with_one_process(path, "mtp3", pipeline_parallel_size=3,
                                                      pp_layer_partition=[3, 2, 1], async_scheduling=True)
    finally:
        del SPECS["mtp3"]
    assert engine.max_steps_in_flight == 3
    infos = engine.executor.cache_infos()
    replays = engine.executor.collective_rpc("graph_replays")
    engine.shutdown()
    assert sum(replays[1].values()) > 0 and set(replays[1]) == {f"verify{i}" for i in range(4)}, replays
    assert [i.has_recurrent_state for i in infos] == [True, True, False]
    assert [i.verify_scratch_sets for i in infos] == [4, 4, 1]
    assert _tokens(got) == _tokens(want)
    _assert_same_logprobs(got, want)


def test_tp2_x_pp2_with_ngram_and_an_attention_only_first_stage(ckpts: CheckpointCache) -> None:
    """Four ranks: stage 0 (ranks 0, 1) holds the attention layer alone, stage 1 (ranks 2, 3) three GDN layers,
    each split over its two ranks; n-gram drafts verified on the last stage."""
    path = ckpts.get("conditional", "attn_first")
    got, want, engine = _compare_with_one_process(path, "ngram", pipeline_parallel_size=2, tensor_parallel_size=2,
                                                  pp_layer_partition=[1, 3])
    assert len(engine.executor.pids) == 4 and engine.executor.output_rank == 2  # type: ignore[attr-defined]
    engine.shutdown()
    assert _tokens(got) == _tokens(want)
    _assert_same_logprobs(got, want)


@pytest.mark.parametrize("spec,sabotage",
                         [pytest.param("plain", False, marks=pytest.mark.slow), ("mtp", False), ("plain", True)])
def test_pp2_with_graphs_on_every_stage(ckpts: CheckpointCache, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                        spec: str, sabotage: bool) -> None:
    """The stages' CUDA graphs (emulated in the worker processes): decode graphs on both stages, the second
    reading the first's output from its persistent input buffer; with MTP the verify, commit and draft graphs on
    the last stage and, on the stage before it, one verify graph per scratch set (each uncommitted step's
    candidates in its own set). Same outputs as one process; a stage that takes the received rows in reverse order
    must not give them."""
    monkeypatch.setenv("HYSERVE_EMULATE_CUDA_GRAPHS", "1")
    if sabotage:
        (tmp_path / "sitecustomize.py").write_text(textwrap.dedent("""
            from hyserve.worker.pipeline_stage import StageIO

            original = StageIO.recv_stage_input

            def reversed_rows(self, num_tokens):
                original(self, num_tokens)
                if self.link is not None and not self.is_first_stage:
                    self.pp_in[:num_tokens] = self.pp_in[:num_tokens].flip(0).clone()

            StageIO.recv_stage_input = reversed_rows
        """))
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
        monkeypatch.setenv("HYSERVE_WORKER_MULTIPROC_METHOD", "exec")  # sitecustomize: fresh interpreters
    path, arrivals, aborts, _, want = reference_run(ckpts, spec)
    engine = scenario_engine(path, spec, pipeline_parallel_size=2)
    got = drive(engine, arrivals, aborts) if sabotage else _run_all_ranks_clean(engine, arrivals, aborts)
    replays = engine.executor.collective_rpc("graph_replays")
    engine.shutdown()
    if sabotage:
        assert _tokens(got) != _tokens(want)
        return
    assert _tokens(got) == _tokens(want)
    _assert_same_logprobs(got, want)
    if spec == "plain":
        assert replays[0]["decode"] > 0 and replays[1]["decode"] > 0, replays
    else:
        # Stage 0's verify graphs, one per scratch set (two steps in flight: two sets in turn).
        assert sorted(replays[0]) == ["verify0", "verify1"] and all(n > 0 for n in replays[0].values()), replays
        assert all(replays[1][k] > 0 for k in ("verify", "commit", "draft")), replays


_SABOTAGES = {
    # The accepted counts of step s applied to the newest uncommitted step (its rows, slots and candidates).
    "late_counts_to_newest_step": """
        def pending_commit(self, step_id):
            newest = max(self._uncommitted)
            return self._uncommitted.pop(newest)
    """,
    # Step s's candidates and counts, but written through the slots of the step the stage ran last (the seed
    # report's stale row mapping).
    "current_step_mapping": """
        def pending_commit(self, step_id):
            pending = self._uncommitted.pop(step_id)
            last_meta = self.state_ops.batch.last_meta
            vm = last_meta.verify if last_meta is not None else None
            if vm is not None and vm.state_slots.shape == pending.state_slots.shape:
                pending.state_slots = vm.state_slots.clone()
            return pending
    """,
}


# The newest step's counts: slow (the suite's budget); the seed report's stale mapping, the same mechanism (a late
# step's counts applied through other rows), stays.
@pytest.mark.parametrize("sabotage", [pytest.param(s, marks=pytest.mark.slow) if s == "late_counts_to_newest_step"
                                      else s for s in _SABOTAGES])
def test_a_stage_applying_counts_through_other_rows_is_caught(ckpts: CheckpointCache, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch, sabotage: str) -> None:
    """Sabotage in the worker processes (through ``sitecustomize``): the outputs must differ from the single-process
    engine's."""
    (tmp_path / "sitecustomize.py").write_text(
        "from hyserve.worker.pipeline_stage import StageCommits\n" + textwrap.dedent(_SABOTAGES[sabotage])
        + "\nStageCommits.pending_commit = pending_commit\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("HYSERVE_WORKER_MULTIPROC_METHOD", "exec")  # sitecustomize: fresh interpreters
    path, arrivals, aborts, _, want = reference_run(ckpts, "mtp")
    # The scenario's schedule with chunks ending at snapshot points: there the sabotaged stages run to the end
    # (with points taken inside rows, the newest step's verify rows differ in number and the stage fails loudly).
    engine = scenario_engine(path, "mtp", pipeline_parallel_size=2, snapshots_inside_rows=False)
    got = drive(engine, arrivals, aborts)
    engine.shutdown()
    assert set(got) == set(want)  # it runs to the end: only the outputs show it
    assert _tokens(got) != _tokens(want)


@pytest.mark.parametrize("dead", [0, pytest.param(1, marks=pytest.mark.slow)], ids=["first_stage", "last_stage"])
def test_a_dead_stage_is_reported_by_rank_within_seconds(ckpts: CheckpointCache, spare: dict[str, LLMEngine],
                                                         dead: int) -> None:
    """The other stage would wait for it in a send or receive; the engine reports the dead rank instead. On an idle
    PP 2 engine an earlier test is done with (``spare``), else a new one."""
    import signal
    import time

    from hyserve.executor.multiproc import WorkerError

    engine = spare.pop("pp2", None) or make_llm(ckpts.get(), pipeline_parallel_size=2).llm_engine
    assert not engine.has_unfinished_requests()
    os.kill(engine.executor.pids[dead], signal.SIGKILL)  # type: ignore[attr-defined]
    engine.add_request("r", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=3))
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=rf"worker rank {dead}: the process died"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - t0 < 5
    engine.shutdown()


_MOVE_BEFORE_COMMITS = """
from hyserve.worker.model_runner import ModelRunner

_stage = ModelRunner._execute_stage


def _execute_stage(self, so, out):
    self.state_ops.offload_snapshots(so.snapshot_offloads)  # before the earlier steps' verify commits
    so.snapshot_offloads = []
    return _stage(self, so, out)


ModelRunner._execute_stage = _execute_stage
"""


@pytest.mark.parametrize("sabotaged", [False, True])
def test_pp2_conversations_resume_through_the_host_tier(ckpts: CheckpointCache, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch, sabotaged: bool) -> None:
    """Two stages (the first only GDN layers), MTP, async scheduling, three device snapshot entries and 32 host
    entries: each stage moves its own layers' evicted snapshots to its host rows and copies them back on a hit, as
    the step's metadata says; the conversations' outputs are the one-process engine's without caching. The first
    stage writes a verify step's candidate snapshots when that step's accepted counts arrive with a later step, after
    the scheduler published them: a stage that moves them before applying those counts (the sabotage, through
    ``sitecustomize`` in the workers) moves what the entry held before."""
    from hyserve.cache.prefix_cache import PrefixCache
    from hyserve.testing.engine import make_convs, run_conversations, toks

    # The policy keeps a decoding answer's latest boundary off the host (it moves on); here every boundary is taken
    # as final, in both runs, so the candidates a verify step published are moved the step after, the order at stake.
    monkeypatch.setattr(PrefixCache, "_still_moving", lambda self, h: False)
    if sabotaged:
        (tmp_path / "sitecustomize.py").write_text(_MOVE_BEFORE_COMMITS)
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
        monkeypatch.setenv("HYSERVE_WORKER_MULTIPROC_METHOD", "exec")  # sitecustomize: fresh interpreters
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    convs = make_convs(6, 4, toks(40, 8), seed=13)
    want = run_conversations(make_llm(path, enable_prefix_caching=False, speculative_config=spec).llm_engine, convs,
                             out_len=9)
    engine = make_llm(path, pipeline_parallel_size=2, speculative_config=spec, async_scheduling=True,
                      recurrent_snapshot_interval=32, num_snapshot_slots=3, num_host_snapshot_slots=32,
                      max_num_batched_tokens=64, num_kv_blocks=512).llm_engine
    try:
        got = run_conversations(engine, convs, out_len=9)
        engine.assert_no_leaks()
        metrics = engine.get_metrics()
    finally:
        engine.shutdown()
    assert metrics["hyserve:prefix_cache_snapshot_offloads"] > 0
    assert metrics["hyserve:prefix_cache_snapshot_host_hits"] > 0
    assert (got == want) is not sabotaged

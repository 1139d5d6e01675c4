"""The scheduler/worker seam and async scheduling, on the CPU, with every feature on together.

* A test executor that pickles every ``SchedulerOutput`` and ``RunnerOutput`` (and refuses tensors and live
  requests in them) gives outputs identical to the in-process executor.
* Async scheduling (step n + 1 scheduled and launched before step n's result is applied; the worker feeds step n's
  sampled ids on the device; the host learns them one step late) gives the synchronous engine's outputs and
  transformers' greedy tokens, with prefix caching (hits), chunked prefill, preemption, aborts, staggered arrivals,
  stop tokens that end requests early (the step run past them is dropped), seeded sampling, n-gram and MTP
  speculation, eager and emulated CUDA graphs. Rows and slots differ (slots are handed out from the top).
* Two sabotaged engines fail those checks: one whose scheduler applies a late result through the current step's
  rows (the seeds' bug class), one whose worker feeds the previous step's sampled ids by the row's position in the
  current step.
"""

from __future__ import annotations

import pytest
import torch

from hyserve.engine import llm_engine
from hyserve.engine.llm_engine import LLMEngine
from hyserve.scheduler.output import PREVIOUS_SAMPLED, SchedulerOutput
from hyserve.testing import PicklingExecutor
from hyserve.testing.engine import assert_matches_reference, drive, make_llm
from hyserve.testing.families import CheckpointCache
from hyserve.testing.scenarios import SPECS, assert_same_outputs, reference_run, run_scenario, scenario, scenario_engine
from hyserve.worker import cuda_graphs


@pytest.fixture(params=["eager", "graphs"])
def graph_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(cuda_graphs, "EMULATE", request.param == "graphs")
    return str(request.param)














@pytest.mark.parametrize("spec", list(SPECS))
def test_async_scheduling_matches_sync_and_transformers(ckpts: CheckpointCache, spec: str, graph_mode: str) -> None:
    path, arrivals, aborts, prompts, want = reference_run(ckpts, spec)
    events: list[tuple[str, int]] = []
    placeholders = 0

    def watch(engine: LLMEngine) -> None:
        schedule, update = engine.scheduler.schedule, engine.scheduler.update_from_output

        def sched() -> SchedulerOutput:
            nonlocal placeholders
            so = schedule()
            events.append(("schedule", so.step_id))
            placeholders += sum(r.token_ids[0] == PREVIOUS_SAMPLED for r in so.rows)
            return so

        def upd(so, ro, sink):  # type: ignore[no-untyped-def]
            events.append(("update", so.step_id))
            return update(so, ro, sink)

        engine.scheduler.schedule = sched  # type: ignore[method-assign]
        engine.scheduler.update_from_output = upd  # type: ignore[method-assign]

    got, engine = run_scenario(path, spec, True, arrivals, aborts, sabotage=watch)
    assert engine.async_scheduling
    assert_same_outputs(got, want)
    ref = ckpts.reference(path)
    for rid, out in got.items():
        if rid not in ("c", "d"):  # aborted; sampled
            assert_matches_reference(ref, prompts[rid], out)
    # Results were applied late: step n's update came after step n + 1 was scheduled.
    late = [n for kind, n in events if kind == "update" and ("schedule", n + 1) in events[: events.index((kind, n))]]
    assert late, "no result arrived after the next step was scheduled"
    if spec == "plain":
        assert placeholders > 0, "no step fed a token the host did not know yet"
        if graph_mode == "graphs":
            assert engine.runner.graphs is not None and engine.runner.graphs.sets["decode"].num_replays > 0


@pytest.mark.parametrize("spec", list(SPECS))
def test_pickled_seam_gives_identical_outputs(ckpts: CheckpointCache, spec: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    path, arrivals, aborts, _, want = reference_run(ckpts, spec)
    made: list[PicklingExecutor] = []

    def executor(worker):  # type: ignore[no-untyped-def]
        made.append(PicklingExecutor(worker))
        return made[-1]

    monkeypatch.setattr(llm_engine, "UniProcExecutor", executor)
    for async_scheduling in (False, True):
        got, _ = run_scenario(path, spec, async_scheduling, arrivals, aborts)
        assert_same_outputs(got, want)
    assert len(made) == 2 and all(e.num_messages > 20 for e in made)


def _apply_through_current_rows(engine: LLMEngine) -> None:
    """Sabotage: a late result is read through the rows of the step scheduled last (not its own step's rows)."""
    schedule, update = engine.scheduler.schedule, engine.scheduler.update_from_output
    latest: list[SchedulerOutput] = []

    def sched() -> SchedulerOutput:
        so = schedule()
        if so.rows:
            latest[:] = [so]
        return so

    def upd(so, ro, sink):  # type: ignore[no-untyped-def]
        cur = latest[0] if latest else so
        for i, row in enumerate(so.rows):
            if i < len(cur.rows) and cur.rows[i].req_id in engine.scheduler.requests:
                row.req_id = cur.rows[i].req_id
        return update(so, ro, sink)

    engine.scheduler.schedule = sched  # type: ignore[method-assign]
    engine.scheduler.update_from_output = upd  # type: ignore[method-assign]


def _feed_by_position(engine: LLMEngine) -> None:
    """Sabotage: the worker takes the previous step's sampled id by the row's position in the current step."""
    runner = engine.runner
    original = runner.execute_model_async

    def execute(so):  # type: ignore[no-untyped-def]
        runner.input_batch.prev_rows = {r.req_id: i for i, r in enumerate(so.rows)}
        return original(so)

    runner.execute_model_async = execute  # type: ignore[method-assign]


@pytest.mark.parametrize("spec,sabotage", [("plain", _apply_through_current_rows), ("mtp", _apply_through_current_rows),
                                           ("plain", _feed_by_position)])
def test_sabotaged_async_engines_are_caught(ckpts: CheckpointCache, spec: str, sabotage) -> None:  # type: ignore[no-untyped-def]
    path, arrivals, aborts, _, want = reference_run(ckpts, spec)
    with pytest.raises((AssertionError, KeyError, IndexError, RuntimeError)):
        got, _ = run_scenario(path, spec, True, arrivals, aborts, sabotage=sabotage)
        assert_same_outputs(got, want)


def test_async_scheduling_defaults_and_flag(ckpts: CheckpointCache) -> None:
    from hyserve.cli import build_parser

    path = ckpts.get()
    assert not make_llm(path).llm_engine.async_scheduling  # off by default on the CPU
    assert make_llm(path, async_scheduling=True).llm_engine.async_scheduling
    parser = build_parser()
    assert parser.parse_args(["serve", path, "--async-scheduling"]).async_scheduling is True
    assert parser.parse_args(["serve", path, "--no-async-scheduling"]).async_scheduling is False
    assert parser.parse_args(["serve", path]).async_scheduling is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec", list(SPECS))
def test_async_scheduling_matches_sync_on_gpu(ckpts: CheckpointCache, spec: str) -> None:
    """The same scenario on CUDA with captured graphs: sampled ids really stay on the device between steps."""
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    arrivals, aborts, _ = scenario(path)
    runs = []
    for async_scheduling in (False, True):
        engine = scenario_engine(path, spec, device="cuda", async_scheduling=async_scheduling)
        runs.append(drive(engine, arrivals, aborts))
        engine.assert_no_leaks()
    assert_same_outputs(runs[1], runs[0])

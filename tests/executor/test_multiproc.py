"""The multiprocess executor (``distributed_executor_backend="mp"``): the worker in its own process, only plain data
across the boundary; identical outputs; no worker outlives its engine however the engine ends; a failing or dead
worker is an error that names its rank, within seconds."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from hyserve import SamplingParams
from hyserve.executor.multiproc import MultiprocExecutor, WorkerError
from hyserve.scheduler.output import ScheduledRow, SchedulerOutput
from hyserve.testing.engine import drive, make_llm
from hyserve.testing.families import CheckpointCache
from hyserve.testing.scenarios import reference_run, scenario_engine
from hyserve.testing.server import process_gone


@pytest.mark.parametrize("spec,async_scheduling", [pytest.param("plain", False, marks=pytest.mark.slow),  # budget
                                                   ("mtp", True)])
def test_mp_backend_matches_the_in_process_engine(ckpts: CheckpointCache, spec: str, async_scheduling: bool) -> None:
    """The async-scheduling scenario (prefix hits, chunks, preemption, an abort, stops, seeded sampling) with the
    worker in another process gives the in-process engine's outputs."""
    path, arrivals, aborts, _, want = reference_run(ckpts, spec)
    engine = scenario_engine(path, spec, async_scheduling=async_scheduling, distributed_executor_backend="mp")
    assert isinstance(engine.executor, MultiprocExecutor) and engine.executor.pids[0] != os.getpid()
    got = drive(engine, arrivals, aborts)
    engine.assert_no_leaks()
    assert {r: o.outputs[0].token_ids for r, o in got.items()} == {r: o.outputs[0].token_ids for r, o in want.items()}
    pid = engine.executor.pids[0]
    engine.shutdown()
    assert process_gone(pid), "the worker outlived shutdown()"


@pytest.fixture(params=["exec", "forkserver"])
def start_method(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways a worker starts (``HYSERVE_WORKER_MULTIPROC_METHOD``; the suite forks them elsewhere)."""
    monkeypatch.setenv("HYSERVE_WORKER_MULTIPROC_METHOD", request.param)
    return str(request.param)


def test_a_failing_or_dead_worker_is_an_error_naming_its_rank(ckpts: CheckpointCache, start_method: str) -> None:
    llm = make_llm(ckpts.get(), distributed_executor_backend="mp")
    engine = llm.llm_engine
    bogus = SchedulerOutput(step_id=0, rows=[ScheduledRow("nobody", 0, [1], [1], 0, samples=True)])
    with pytest.raises(WorkerError, match=r"worker rank 0: KeyError: 'nobody'"):
        engine.executor.execute_model(bogus)
    # The worker survives its failed message and serves the next one.
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    assert len(llm.generate({"prompt_token_ids": [1, 2, 3]}, params, use_tqdm=False)[0].outputs[0].token_ids) == 3
    pid = engine.executor.pids[0]
    os.kill(pid, signal.SIGKILL)
    engine.add_request("after", {"prompt_token_ids": [4, 5, 6]}, params)
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match=r"worker rank 0: the process died"):
        engine.step()
    assert time.monotonic() - t0 < 5
    llm.shutdown()


@pytest.mark.parametrize("start_method", ["exec", pytest.param("forkserver", marks=pytest.mark.slow)],  # budget
                         indirect=True)
def test_no_worker_outlives_its_engine(ckpts: CheckpointCache, start_method: str) -> None:
    path = ckpts.get()
    # The last reference going away.
    llm = make_llm(path, distributed_executor_backend="mp")
    pid = llm.llm_engine.executor.pids[0]  # type: ignore[attr-defined]
    del llm
    gc.collect()
    assert process_gone(pid), "the worker outlived its engine's last reference"
    # The interpreter exiting without shutdown(), and the parent killed outright.
    script = textwrap.dedent(f"""
        import os, sys, time
        from hyserve import LLM
        llm = LLM(model={path!r}, device="cpu", num_kv_blocks=64, num_state_slots=4,
                  distributed_executor_backend="mp")
        print(llm.llm_engine.executor.pids[0], flush=True)
        if sys.argv[1] == "hang":
            time.sleep(60)
    """)
    procs = {how: subprocess.Popen([sys.executable, "-c", script, how], stdout=subprocess.PIPE, text=True)
             for how in ("exit", "hang")}  # both at once (the suite's budget)
    for how, proc in procs.items():
        assert proc.stdout is not None
        worker = int(proc.stdout.readline())
        if how == "hang":
            proc.kill()
        proc.wait(30)
        assert process_gone(worker), f"the worker outlived its parent ({how})"


def test_the_server_answers_with_the_worker_in_another_process(ckpts: CheckpointCache) -> None:
    from hyserve.config import EngineConfig
    from hyserve.engine.llm_engine import LLMEngine
    from hyserve.server import AsyncEngine
    from hyserve.testing.server import ServerThread

    path = ckpts.get()
    engine = LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", num_kv_blocks=64, num_state_slots=4,
                                    distributed_executor_backend="mp", async_scheduling=True))
    want = make_llm(path).generate("The quick brown fox", SamplingParams(temperature=0.0, max_tokens=6,
                                                                         ignore_eos=True), use_tqdm=False)[0]
    with ServerThread(AsyncEngine(engine, start=False)) as srv:
        resp = srv.client().completions.create(model=os.path.basename(path), prompt="The quick brown fox", max_tokens=6,
                                               temperature=0, extra_body={"ignore_eos": True})
        srv.settle()
    assert resp.choices[0].text == want.outputs[0].text
    pid = engine.executor.pids[0]  # type: ignore[attr-defined]
    engine.shutdown()
    assert process_gone(pid)


def test_unknown_backends_are_refused(ckpts: CheckpointCache) -> None:
    from hyserve.cli import build_parser

    args = build_parser().parse_args(["serve", ckpts.get(), "--distributed-executor-backend", "mp"])
    assert args.distributed_executor_backend == "mp"
    with pytest.raises(ValueError, match=r"distributed_executor_backend='ray'.*'uni', 'mp' or 'torchrun'"):
        make_llm(ckpts.get(), distributed_executor_backend="ray")
    with pytest.raises(ValueError, match=r"needs the process to be started by torchrun \(RANK is not set\)"):
        make_llm(ckpts.get(), distributed_executor_backend="torchrun")




@pytest.mark.parametrize("sabotage", [None, "environment_not_applied"])
def test_a_forked_worker_imports_hyserve_under_the_engines_environment(ckpts: CheckpointCache, sabotage: str | None,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A forked worker sees the environment as the engine had it when the worker started, as a fresh interpreter
    would, also what hyserve reads as it imports (``HYSERVE_GDN_FUSED``, refused when bogus), though the server was
    started earlier without it. Sabotage: the worker imports hyserve under the server's environment."""
    from hyserve.executor import multiproc

    monkeypatch.setenv("HYSERVE_WORKER_MULTIPROC_METHOD", "forkserver")
    make_llm(ckpts.get(), distributed_executor_backend="mp").llm_engine.shutdown()  # the server runs from here on
    if sabotage:
        monkeypatch.setattr(multiproc, "_FORKED_WORKER", multiproc._FORKED_WORKER.replace("os.environ.update", "len"))
    monkeypatch.setenv("HYSERVE_GDN_FUSED", "bogus")
    try:
        make_llm(ckpts.get(), distributed_executor_backend="mp").llm_engine.shutdown()
        refused = False
    except WorkerError as e:
        assert "failed to start: ValueError: HYSERVE_GDN_FUSED='bogus'" in str(e)
        refused = True
    assert refused is (sabotage is None)


def test_start_methods_are_checked(ckpts: CheckpointCache, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """An unknown start method is refused; so is a forked worker once ``PYTHONPATH`` changed after the server
    started (read as an interpreter starts: the worker could not apply it)."""
    monkeypatch.setenv("HYSERVE_WORKER_MULTIPROC_METHOD", "spawn")
    with pytest.raises(ValueError, match=r"HYSERVE_WORKER_MULTIPROC_METHOD='spawn': expected exec or forkserver"):
        make_llm(ckpts.get(), distributed_executor_backend="mp")
    monkeypatch.setenv("HYSERVE_WORKER_MULTIPROC_METHOD", "forkserver")
    make_llm(ckpts.get(), distributed_executor_backend="mp").llm_engine.shutdown()
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    with pytest.raises(ValueError, match=r"forkserver: PYTHONPATH changed since this process's worker server started"):
        make_llm(ckpts.get(), distributed_executor_backend="mp")


def test_a_group_port_taken_before_rank_0_binds_it_is_chosen_again(ckpts: CheckpointCache,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process binds the group's port between its choice and rank 0's bind (two engines, or two test
    workers, starting on one host): the workers start again on another port, and only that error is retried."""
    addresses: list[str] = []
    real_init = MultiprocExecutor.__init__

    def taken_once(self: MultiprocExecutor, world: int, args: tuple, kw: dict, **more: object) -> None:
        addresses.append(kw["dist_init_method"])
        if len(addresses) == 1:
            raise WorkerError(0, "failed to start: DistNetworkError: ... EADDRINUSE, message: address already in use")
        real_init(self, world, args, kw, **more)  # type: ignore[arg-type]

    monkeypatch.setattr(MultiprocExecutor, "__init__", taken_once)
    llm = make_llm(ckpts.get(), tensor_parallel_size=2, distributed_executor_backend="mp")
    try:
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 3
        assert len(addresses) == 2 and addresses[0] != addresses[1]
    finally:
        llm.shutdown()

    def always_other_error(self: MultiprocExecutor, world: int, args: tuple, kw: dict, **more: object) -> None:
        addresses.append(kw["dist_init_method"])
        raise WorkerError(0, "failed to start: ValueError: a bad checkpoint")

    monkeypatch.setattr(MultiprocExecutor, "__init__", always_other_error)
    with pytest.raises(WorkerError, match="bad checkpoint"):
        make_llm(ckpts.get(), tensor_parallel_size=2, distributed_executor_backend="mp")
    assert len(addresses) == 3  # not retried


def test_a_failing_first_stage_is_an_error_not_a_hang(ckpts: CheckpointCache, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Pipeline stages: the first stage fails in its step (its handover raises, in the worker processes through
    ``sitecustomize``) while the last one waits for its activations; the engine reports the first stage's error
    within seconds instead of waiting on the last stage."""
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent("""
        from hyserve.distributed.parallel_state import StageLink

        def broken(self, *parts):
            raise RuntimeError("planted handover failure")

        StageLink.send = broken
    """))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("HYSERVE_WORKER_MULTIPROC_METHOD", "exec")  # sitecustomize: fresh interpreters
    llm = make_llm(ckpts.get(), pipeline_parallel_size=2, pp_layer_partition=[2, 2])
    engine = llm.llm_engine
    engine.add_request("r", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0.0, max_tokens=2))
    t0 = time.monotonic()
    try:
        with pytest.raises(WorkerError, match=r"worker rank 0: RuntimeError: planted handover failure"):
            for _ in range(4):
                engine.step()
        assert type(engine.executor).__name__ == "MultiprocExecutor"
        assert time.monotonic() - t0 < 30
    finally:
        llm.shutdown()


@pytest.mark.parametrize("sabotage", [None, "given_back_before_read", "pool_never_closed"])
def test_large_arrays_cross_through_shared_memory(sabotage: str | None) -> None:
    """A step's arrays of a megabyte or more (a screenshot's pixels) are pickled as shared memory segments, one per
    array, read back equal, the small ones kept in the message. A step's segments go back to the pool once every
    worker it went to (two here) has answered it, and the next step's array of the same size reuses one; closing
    the pool unlinks them. Sabotaged: a segment given back before a worker read it is overwritten by the next
    step's array (the first step reads the second's pixels); a pool never closed leaves its segments behind."""
    import io
    import multiprocessing.reduction

    import numpy as np

    from hyserve.executor import multiproc

    def alive(name: str) -> bool:
        return os.path.exists(f"/dev/shm/{name.lstrip('/')}")

    def pickled(payload: object, segments: multiproc._Segments) -> bytes:
        buf = io.BytesIO()
        multiproc._StepPickler(buf, segments).dump(("step", payload))
        return buf.getvalue()

    def read(data: bytes) -> object:
        kind, payload = multiprocessing.reduction.ForkingPickler.loads(data)
        assert kind == "step"
        return payload

    pool = multiproc.SegmentPool()
    big = np.arange(3520 * 200, dtype=np.float32).reshape(3520, 200)  # 2.8 MB; every second row, 1.4 MB
    small = np.arange(10, dtype=np.int64)
    first = multiproc._Segments(pool, waiting=2)
    data = pickled({"pixels": [big, big[::2]], "positions": small}, first)
    names = [shm.name for shm, _ in first.shms]
    assert len(names) == 2 and len(data) < 2000  # the pixels' bytes are not in the message
    other = big + 1
    if sabotage == "given_back_before_read":
        first.release()
        pickled({"pixels": [other]}, multiproc._Segments(pool, waiting=1))  # takes the segment given back
        got = read(data)
        assert not np.array_equal(got["pixels"][0], big)  # type: ignore[index]
        pool.close()
        return
    got = read(data)
    assert np.array_equal(got["pixels"][0], big) and np.array_equal(got["pixels"][1], big[::2])  # type: ignore[index]
    assert np.array_equal(got["positions"], small)  # type: ignore[index]
    first.answered()  # the first worker
    second = multiproc._Segments(pool, waiting=1)
    pickled({"pixels": [other]}, second)
    assert second.shms[0][0].name not in names  # the first step's segments are still being read
    first.answered()  # the second worker: back to the pool
    third = multiproc._Segments(pool, waiting=1)
    got = read(pickled({"pixels": [other]}, third))
    assert third.shms[0][0].name == names[0] and np.array_equal(got["pixels"][0], other)  # type: ignore[index]
    second.answered()
    third.answered()
    assert all(alive(n) for n in names)  # kept for reuse
    if sabotage != "pool_never_closed":
        pool.close()
    left = [n for n in names if alive(n)]
    if sabotage == "pool_never_closed":
        assert left, "a pool never closed went unseen"
        pool.close()
    else:
        assert not left

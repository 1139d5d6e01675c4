"""A worker that dies under the server: every open request is failed (a stream ends with an error event and
``data: [DONE]``), then ``hyserve serve`` exits non-zero within seconds and leaves no worker process behind, so that
whatever supervises it restarts it. A worker that dies while the server is idle is noticed too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest

from hyserve.config import EngineConfig
from hyserve.engine.llm_engine import LLMEngine
from hyserve.executor.multiproc import MultiprocExecutor, WorkerError
from hyserve.server import AsyncEngine
from hyserve.testing.families import CheckpointCache
from hyserve.testing.server import child_pids, free_port, process_gone, wait_up


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc for the worker processes")
def test_a_killed_worker_fails_the_streams_then_serve_exits_nonzero(ckpts: CheckpointCache) -> None:
    path = ckpts.get()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:  # a file, not a pipe: nobody has to drain it while the test runs
        proc = subprocess.Popen([sys.executable, "-m", "hyserve.cli", "serve", path, "--device", "cpu", "--port",
                                 str(port), "--tensor-parallel-size", "2", "--shutdown-timeout", "2"],
                                stdout=log, stderr=subprocess.STDOUT, text=True,
                                # exec: the workers are the server's children (forked ones, the forkserver's)
                                env={**os.environ, "OMP_NUM_THREADS": "1", "HYSERVE_WORKER_MULTIPROC_METHOD": "exec"})
        try:
            wait_up(proc, url)
            workers = sorted(child_pids(proc.pid))  # started in rank order
            assert len(workers) == 2, workers
            body = {"model": os.path.basename(path), "prompt": "The quick brown fox", "max_tokens": 3000,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            events: list[str] = []
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    events.append(line[len("data: "):])
                    if len(events) == 1:
                        os.kill(workers[1], signal.SIGKILL)  # TP rank 1, mid-stream
            t_done = time.monotonic()
            assert events[-1] == "[DONE]", events[-3:]
            error = json.loads(events[-2])["error"]
            assert error["code"] == "503" and "worker rank 1" in error["message"], error
            assert len(events) < 3000, "the stream ran to its end: the worker's death was not noticed"
            try:
                code = proc.wait(20)
            except subprocess.TimeoutExpired:
                pytest.fail("hyserve serve was still running 20 s after its worker died")
            assert code == 1, code
            assert time.monotonic() - t_done < 20
            assert all(process_gone(w, 5) for w in workers), "a worker outlived hyserve serve"
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
            log.seek(0)
            output = log.read()
    assert "exiting with status 1: the engine failed" in output and "worker rank 1: the process died" in output, \
        output[-3000:]


def test_a_worker_dying_while_idle_fails_the_loop(ckpts: CheckpointCache) -> None:
    engine = LLMEngine(EngineConfig(model=ckpts.get(), device="cpu", dtype="float32", num_kv_blocks=64,
                                    num_state_slots=4, distributed_executor_backend="mp"))
    assert isinstance(engine.executor, MultiprocExecutor)
    pid = engine.executor.pids[0]
    async_engine = AsyncEngine(engine, start=False)
    async_engine.health_check_interval_s = 0.1
    failed = threading.Event()
    errors: list[BaseException] = []
    try:
        async_engine.start()
        assert async_engine.is_alive()
        os.kill(pid, signal.SIGKILL)  # no request in flight: nothing waits on the worker
        deadline = time.monotonic() + 5
        while async_engine.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not async_engine.is_alive(), "the worker's death went unnoticed while idle"
        error = async_engine.dead_error
        assert isinstance(error, WorkerError) and error.rank == 0 and "the process died" in str(error)

        def on_dead(e: BaseException) -> None:
            errors.append(e)
            failed.set()

        # The loop has set its error but may still be failing the open requests: a callback added now is called
        # on the loop thread as it ends; once it has ended, at once (both are the contract).
        async_engine.add_dead_callback(on_dead)
        assert failed.wait(5) and errors == [error]
        thread = async_engine._thread
        assert thread is not None
        thread.join(5)
        late: list[BaseException] = []
        async_engine.add_dead_callback(late.append)  # registered after the loop ended: called at once
        assert late == [error]
    finally:
        async_engine.shutdown()
        engine.shutdown()
    assert process_gone(pid)


def test_the_async_engine_imports_without_the_web_stack() -> None:
    """``AsyncEngine`` (the engine on its thread, as ``benchmarks/seed_bench.py`` drives it in process) and the engine
    arguments import where FastAPI, Starlette and uvicorn are not installed (a GPU machine with torch alone: the
    seed deployment's first run failed on ``import fastapi`` through ``hyserve.server``); ``build_app`` alone needs
    them, and says so."""
    code = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('fastapi', 'starlette', 'uvicorn'):
            raise ImportError('not installed: ' + name)
sys.meta_path.insert(0, Block())
from hyserve.server import AsyncEngine
from hyserve.engine_args import engine_args, expand_dotted, make_llm
assert not any(m.split('.')[0] in ('fastapi', 'starlette', 'uvicorn') for m in sys.modules)
import hyserve.server
try:
    hyserve.server.build_app
except ImportError as e:
    print('build_app:', e)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "build_app: not installed: fastapi" in out.stdout

"""The multiprocess executor: each worker in its own process, started by the engine (``distributed_executor_backend
="mp"``) as ``python -m hyserve.executor.multiproc`` (a fresh interpreter that never re-runs the user's script, so no
``if __name__ == "__main__"`` guard is needed), holding its end of a pipe.

Only plain data crosses the process boundary: ``SchedulerOutput`` to the workers, ``RunnerOutput`` back, and the
arguments and answers of ``collective_rpc``, pickled over one pipe per worker (tensors between workers will go
through torch.distributed collectives). A step is pickled once for every worker, and its large arrays (an image's
pixels: a 1280 x 720 screenshot is 3,520 x 1,536 float32, 21.6 MB) go through shared memory, not the pipe: through
the pipe each took the engine's loop thread 64-107 ms on a two-core machine (``benchmarks/step_handoff_bench.py``),
while the seed's trace ran 27 % slower than in one process at the same device time. The worker copies each array
out as it reads the step; once every worker has answered the step its segments go back to a pool for later steps
(``SegmentPool``: a fresh segment's pages fault in as the array is copied), which unlinks them at shutdown. A
worker runs the messages it receives in order, so the engine may send step n + 1 before it reads step n's result
(async scheduling): ``execute_model_async`` returns a handle whose ``result()`` reads the answer.

How a worker starts (``HYSERVE_WORKER_MULTIPROC_METHOD``, ``worker_start_method``): ``exec`` (the default) as
above; ``forkserver`` forks each worker from a server process that this process starts once and that has imported
torch (multiprocessing's forkserver): about 3 s of CPU less a worker (torch's import), so an engine of eight ranks
starts in about the time of one. The worker applies the engine's environment as it was when the worker started
before it imports hyserve, as a fresh interpreter would see it. multiprocessing's rule applies: the server's children
import the engine's main module (as ``__mp_main__``), so a script must guard its entry point with
``if __name__ == "__main__"``; the console scripts and ``python -m`` / ``-c`` entries need nothing.

Lifetime and failure:

- ``shutdown()`` (also run when the executor is garbage-collected and at interpreter exit) asks each worker to
  stop, waits a few seconds, then terminates and finally kills it. A worker whose parent dies sees its pipe close
  and exits; on Linux it also asks the kernel to kill it when its parent dies (``PR_SET_PDEATHSIG``).
- A worker that raises answers with the error and its traceback; the engine raises ``WorkerError`` naming the rank.
  A worker that dies is noticed within ``poll_interval_s`` while the engine waits for it; a worker that answers
  nothing for ``timeout_s`` is an error too. Nothing waits forever. ``check_health()`` raises the same
  ``WorkerError`` at once when a worker has died, without sending anything (an idle server polls it).
- A worker that died broke the group: the others may be blocked in a collective that can never complete, so
  ``shutdown()`` then gives them no grace period: they are terminated (then killed) at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import io
import multiprocessing
import multiprocessing.connection
import multiprocessing.reduction
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import numpy as np

from hyserve.executor.base import Executor, StepHandle
from hyserve.scheduler.output import RunnerOutput, SchedulerOutput

# Seconds a worker may take to answer one message (a step, or an RPC such as loading the model).
DEFAULT_TIMEOUT_S = 600.0

WORKER_START_METHODS = ("exec", "forkserver")

# (Set in a worker forked by the forkserver) the engine's resource tracker is this process's too.
_SHARED_TRACKER = False
# (In the engine's process) the ``PYTHON*`` variables as its worker server started.
_SERVER_START_ENV: dict[str, str] | None = None


def free_tcp_address() -> str:
    """A ``tcp://127.0.0.1:PORT`` address with a port free now (for the workers' torch.distributed group)."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


class WorkerError(RuntimeError):
    """A worker process failed (raised, died or stopped answering); ``rank`` says which."""

    def __init__(self, rank: int, why: str) -> None:
        super().__init__(f"worker rank {rank}: {why}")
        self.rank = rank


@dataclass(slots=True)
class WorkerSpec:
    """What a worker process builds its ``Worker`` from (all picklable)."""

    rank: int
    world_size: int
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


# Arrays of at least this many bytes cross to the workers through shared memory (see the module docstring).
SHARED_ARRAY_MIN_BYTES = 1 << 20


def _copy_out(name: str, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """(In a worker, as it unpickles a step) the array the engine put in shared memory segment ``name``, copied
    out: the engine unlinks the segment once the step is answered."""
    shm = SharedMemory(name=name)
    try:
        # Attaching registers the segment with this process's resource tracker (before Python 3.13), which would
        # unlink it, or warn of a leak, at exit: the engine owns it. A forked worker shares the engine's tracker,
        # where the name is registered once (the engine's unlink unregisters it).
        if not _SHARED_TRACKER:
            resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        return np.ndarray(shape, dtype=np.dtype(dtype), buffer=shm.buf).copy()
    finally:
        shm.close()


class SegmentPool:
    """Shared memory segments for the arrays of the steps in flight, kept for reuse once a step is answered (a
    fresh segment's pages fault in as the array is copied: about 24 ms of the loop thread for a screenshot on a
    two-core machine, against a few for a segment reused). Up to ``max_bytes`` are kept free; the rest, and all of
    them at ``close()``, are unlinked."""

    def __init__(self, max_bytes: int = 512 << 20) -> None:
        self.max_bytes = max_bytes
        self.free: dict[int, list[SharedMemory]] = {}  # by the array's byte count
        self.free_bytes = 0
        self.closed = False

    def take(self, nbytes: int) -> SharedMemory:
        kept = self.free.get(nbytes)
        if kept:
            self.free_bytes -= nbytes
            return kept.pop()
        return SharedMemory(create=True, size=nbytes)

    def give(self, shm: SharedMemory, nbytes: int) -> None:
        """Segment ``shm`` (taken for an array of ``nbytes``) no longer read by any worker."""
        if self.closed or self.free_bytes + nbytes > self.max_bytes:
            _unlink(shm)
            return
        self.free.setdefault(nbytes, []).append(shm)
        self.free_bytes += nbytes

    def close(self) -> None:
        self.closed = True
        for kept in self.free.values():
            for shm in kept:
                _unlink(shm)
        self.free.clear()
        self.free_bytes = 0


def _unlink(shm: SharedMemory) -> None:
    with contextlib.suppress(OSError):
        shm.close()
    with contextlib.suppress(FileNotFoundError):
        shm.unlink()


class _StepPickler(multiprocessing.reduction.ForkingPickler):
    """The pipe's pickler (its reducers kept), with arrays of at least ``SHARED_ARRAY_MIN_BYTES`` copied into shared
    memory segments of ``segments``' pool (``segments`` records them, for the caller to give back) and pickled as
    their names."""

    def __init__(self, file: io.BytesIO, segments: _Segments) -> None:
        super().__init__(file, 5)
        self.segments = segments

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, np.ndarray) or obj.nbytes < SHARED_ARRAY_MIN_BYTES or obj.dtype.hasobject:
            return NotImplemented
        shm = self.segments.pool.take(obj.nbytes)
        self.segments.shms.append((shm, obj.nbytes))
        np.ndarray(obj.shape, dtype=obj.dtype, buffer=shm.buf)[...] = obj
        return _copy_out, (shm.name, tuple(obj.shape), obj.dtype.str)


@dataclass(slots=True, eq=False)
class _Segments:
    """A sent message's shared memory segments (with their arrays' byte counts), given back to ``pool`` once each
    of the ``waiting`` workers it went to has answered it (each copied the arrays out as it read the message)."""

    pool: SegmentPool
    shms: list[tuple[SharedMemory, int]] = field(default_factory=list)
    waiting: int = 0

    def answered(self) -> None:
        self.waiting -= 1
        if self.waiting <= 0:
            self.release()

    def release(self) -> None:
        for shm, nbytes in self.shms:
            self.pool.give(shm, nbytes)
        self.shms.clear()


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass  # the pipe's EOF still ends the worker


def worker_main(conn: multiprocessing.connection.Connection) -> None:
    """A worker process: build the ``Worker`` its first message describes, then answer messages until told to stop
    or the connection closes."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the engine, which stops the workers
    try:
        spec: WorkerSpec = conn.recv()
        import torch

        from hyserve.worker.worker import Worker

        threads = spec.kwargs.pop("cpu_threads", None)
        if threads is not None:
            torch.set_num_threads(threads)
        worker = Worker(*spec.args, **{**spec.kwargs, "rank": spec.rank, "world_size": spec.world_size})
        conn.send(("ready", os.getpid()))
    except BaseException as e:  # the engine reports it with the rank
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    pending: Any = None  # the step launched last: answered when the next message arrives (see below)

    def answer_pending() -> None:
        nonlocal pending
        if pending is not None:
            handle, pending = pending, None
            try:
                conn.send(("ok", handle.result()))
            except BaseException as e:  # this step failed: say why, keep serving (the engine decides)
                conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))

    # A step is launched as soon as it arrives and answered when the next message does (the next step, a "flush",
    # an RPC or "stop"): step n + 1 is then queued on the device before the worker waits for step n's results, so
    # the device runs them back to back (async scheduling).
    while True:
        try:
            kind, payload = conn.recv()
        except (EOFError, OSError):
            return  # the engine is gone
        if kind == "step":
            try:
                launched = worker.execute_model_async(payload)
            except BaseException as e:  # this message failed: say why, keep serving (the engine decides)
                answer_pending()
                conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
                continue
            answer_pending()
            pending = launched
            continue
        answer_pending()
        if kind == "flush":
            continue
        if kind == "stop":
            try:
                worker.shutdown()  # every rank is told to stop: each leaves the group on its own
            finally:
                conn.send(("stopped", None))
            return
        try:
            method, args, kwargs = payload
            conn.send(("ok", getattr(worker, method)(*args, **kwargs)))
        except BaseException as e:  # this message failed: say why, keep serving (the engine decides)
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def worker_start_method() -> str:
    """How workers start: ``HYSERVE_WORKER_MULTIPROC_METHOD``, ``exec`` (default) or ``forkserver`` (the module's
    docstring); any other value is an error."""
    value = os.environ.get("HYSERVE_WORKER_MULTIPROC_METHOD", "exec")
    if value not in WORKER_START_METHODS:
        raise ValueError(f"HYSERVE_WORKER_MULTIPROC_METHOD={value!r}: expected "
                         f"{' or '.join(WORKER_START_METHODS)}")
    return value


# What a worker forked by the forkserver runs (through ``exec``, a builtin: unpickling the target then imports
# nothing of hyserve, whose modules read the environment as they import).
_FORKED_WORKER = """
import os
os.environ.clear()
os.environ.update(environ)
from hyserve.executor import multiproc
multiproc._SHARED_TRACKER = True
multiproc.worker_main(conn)
"""


class _Forked:
    """A worker forked by the forkserver, with the part of ``subprocess.Popen``'s interface ``_Proc`` uses."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self._process = process
        self.pid = process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"hyserve worker {self.pid}", timeout or 0.0)
        return self._process.exitcode

    def terminate(self) -> None:
        self._process.terminate()

    def kill(self) -> None:
        self._process.kill()


def _start_worker(method: str, child: multiprocessing.connection.Connection) -> subprocess.Popen[bytes] | _Forked:
    """Start one worker holding ``child``, its end of the pipe (``worker_start_method``)."""
    if method == "exec":
        return subprocess.Popen([sys.executable, "-m", "hyserve.executor.multiproc", str(child.fileno())],
                                pass_fds=(child.fileno(),))
    global _SERVER_START_ENV
    started = {k: v for k, v in os.environ.items() if k.startswith("PYTHON")}
    if _SERVER_START_ENV is None:
        _SERVER_START_ENV = started
    elif started != _SERVER_START_ENV:  # read as an interpreter starts: a forked worker cannot apply them
        changed = sorted({k for k, _ in set(started.items()) ^ set(_SERVER_START_ENV.items())})
        raise ValueError(f"HYSERVE_WORKER_MULTIPROC_METHOD=forkserver: {', '.join(changed)} changed "
                         "since this process's worker server started; a forked worker cannot take it (use exec)")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch"])  # read when this process's server starts, then kept
    process = ctx.Process(target=exec, args=(_FORKED_WORKER, {"conn": child, "environ": dict(os.environ)}),
                          name="hyserve-worker")
    process.start()
    return _Forked(process)


class _Proc:
    def __init__(self, rank: int, process: subprocess.Popen[bytes] | _Forked,
                 conn: multiprocessing.connection.Connection) -> None:
        self.rank = rank
        self.process = process
        self.conn = conn
        self.pending: deque[str] = deque()  # kinds of the messages sent and not answered yet, in order
        self.segments: deque[_Segments | None] = deque()  # beside ``pending``: each message's shared arrays
        self.early: deque[tuple[str, Any]] = deque()  # answers read while waiting for another worker, in order

    def is_alive(self) -> bool:
        return self.process.poll() is None


class MultiprocExecutor(Executor):
    def __init__(self, world_size: int, worker_args: tuple[Any, ...], worker_kwargs: dict[str, Any] | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, poll_interval_s: float = 0.5, output_rank: int = 0) -> None:
        self.world_size = world_size
        self.output_rank = output_rank
        self.timeout_s = timeout_s
        self.poll_interval_s = poll_interval_s
        self._lock = threading.Lock()
        self._procs: list[_Proc] = []
        self._last_step: _StepAnswer | None = None
        self._segment_pool = SegmentPool()
        method = worker_start_method()
        for rank in range(world_size):
            parent, child = multiprocessing.Pipe(duplex=True)
            process = _start_worker(method, child)
            child.close()
            self._procs.append(_Proc(rank, process, parent))
            parent.send(WorkerSpec(rank, world_size, worker_args, dict(worker_kwargs or {})))
        # Stop the workers however this executor goes: shutdown(), garbage collection, interpreter exit.
        self._finalizer = weakref.finalize(self, _stop_all, list(self._procs), self._segment_pool)  # also at exit
        try:
            for p in self._procs:
                kind, payload = self._recv(p)
                if kind != "ready":
                    raise WorkerError(p.rank, f"failed to start: {payload}")
        except BaseException:
            self.shutdown()
            raise
        self.pids = [p.process.pid for p in self._procs]

    # ------------------------------------------------------------------ messages

    def _recv(self, p: _Proc) -> tuple[str, Any]:
        """The next answer of worker ``p``; WorkerError if it or any other worker dies or reports an error (the
        others would wait for it in a collective or a pipeline handover: a failed first stage leaves the last one
        waiting for its activations), or if ``p`` says nothing for ``timeout_s``. Other workers' answers read
        meanwhile are kept, in order, for their own turn."""
        if p.early:
            return p.early.popleft()
        deadline = time.monotonic() + self.timeout_s
        while True:
            ready = multiprocessing.connection.wait([q.conn for q in self._procs], self.poll_interval_s)
            if p.conn in ready:
                return self._read(p)
            for q in self._procs:
                if q.conn in ready:
                    kind, payload = self._read(q)
                    if kind == "error":
                        q.pending.popleft()
                        self._answered(q)
                        raise WorkerError(q.rank, payload)
                    q.early.append((kind, payload))
            if not ready:
                for q in [p, *self._procs]:
                    if not q.is_alive():
                        raise WorkerError(q.rank, f"the process died (exit code {q.process.returncode})")
                if time.monotonic() > deadline:
                    raise WorkerError(p.rank, f"no answer within {self.timeout_s:.0f} s")

    @staticmethod
    def _read(p: _Proc) -> tuple[str, Any]:
        try:
            return p.conn.recv()  # type: ignore[no-any-return]
        except (EOFError, OSError) as e:
            raise WorkerError(p.rank, f"the process died (exit code {p.process.poll()}): {e}") from e

    @staticmethod
    def _answered(p: _Proc) -> None:
        """Worker ``p`` answered its oldest message: that message's shared arrays may go once every worker has."""
        sent = p.segments.popleft() if p.segments else None
        if sent is not None:
            sent.answered()

    def _answer(self, p: _Proc) -> Any:
        kind, payload = self._recv(p)
        p.pending.popleft()
        self._answered(p)
        if kind == "error":
            # A peer that died makes this worker's collective fail: report the death as the cause.
            time.sleep(0.05)
            dead = [q for q in self._procs if q is not p and not q.is_alive()]
            if dead:
                first = str(payload).splitlines()[0] if payload else ""
                raise WorkerError(dead[0].rank, f"the process died (exit code {dead[0].process.returncode}); "
                                                f"rank {p.rank} then failed: {first}")
            raise WorkerError(p.rank, payload)
        return payload

    def _send(self, p: _Proc, kind: str, payload: Any,
              pickled: tuple[memoryview, _Segments | None] | None = None) -> None:
        """Send ``(kind, payload)`` to worker ``p``; ``pickled``: the message already pickled for every worker, and
        its shared arrays (``_pickle_step``)."""
        if self._finalizer is None or not self._finalizer.alive:
            raise RuntimeError("this executor was shut down")
        try:
            if pickled is None:
                p.conn.send((kind, payload))
            else:
                p.conn.send_bytes(pickled[0])
        except (BrokenPipeError, OSError) as e:
            raise WorkerError(p.rank, f"the process died (exit code {p.process.poll()}): {e}") from e
        p.pending.append(kind)
        p.segments.append(None if pickled is None else pickled[1])  # (unlinked once every worker answers)

    def _pickle_step(self, scheduler_output: SchedulerOutput) -> tuple[memoryview, _Segments | None]:
        """A step pickled once for every worker, its large arrays in shared memory segments (module docstring)."""
        segments = _Segments(self._segment_pool, waiting=len(self._procs))
        buf = io.BytesIO()
        try:
            _StepPickler(buf, segments).dump(("step", scheduler_output))
        except BaseException:
            segments.release()
            raise
        return buf.getbuffer(), segments if segments.shms else None

    def collective_rpc(self, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
                       ) -> list[Any]:
        with self._lock:
            for p in self._procs:
                self._send(p, "rpc", (method, args, kwargs or {}))
            self._last_step = None  # the RPC makes the workers answer every step before it
            answers = []
            for p in self._procs:
                while len(p.pending) > 1:  # steps whose results nobody reads (an RPC cut in): read in order
                    self._answer(p)
                answers.append(self._answer(p))
            return answers

    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        return self.execute_model_async(scheduler_output).result()

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> StepHandle:
        with self._lock:
            pickled = self._pickle_step(scheduler_output)
            for p in self._procs:
                self._send(p, "step", scheduler_output, pickled)
            self._last_step = _StepAnswer(self, self._procs[self.output_rank])
        return self._last_step

    def _flush(self) -> None:
        """Ask the workers to answer the step they launched last (they otherwise answer it with the next message)."""
        self._last_step = None
        for p in self._procs:
            with contextlib.suppress(BrokenPipeError, OSError):  # a dead worker is reported by _recv
                p.conn.send(("flush", None))

    def check_health(self) -> None:
        """Raise ``WorkerError`` naming the first worker that has died (non-blocking; sends nothing). After
        ``shutdown()`` the workers are gone on purpose: nothing is raised."""
        if self._finalizer is None or not self._finalizer.alive:
            return
        for p in self._procs:
            if not p.is_alive():
                raise WorkerError(p.rank, f"the process died (exit code {p.process.returncode})")

    def shutdown(self) -> None:
        if self._finalizer is not None:
            self._finalizer()


class _StepAnswer:
    """The output rank's answer to one step, read when asked; steps are answered in the order they were sent (the
    other ranks' answers to it are read too, to keep the order)."""

    def __init__(self, executor: MultiprocExecutor, driver: _Proc) -> None:
        self._executor = executor
        self._driver = driver
        self._out: RunnerOutput | None = None

    def result(self) -> RunnerOutput:
        if self._out is None:
            with self._executor._lock:
                if self._executor._last_step is self:
                    self._executor._flush()
                others = [p for p in self._executor._procs if p is not self._driver]
                self._out = self._executor._answer(self._driver)
                for p in others:  # their answers are the same step's: read to keep the order
                    self._executor._answer(p)
        return self._out


def _stop_all(procs: list[_Proc], pool: SegmentPool | None = None, grace_s: float = 5.0) -> None:
    if any(not p.is_alive() for p in procs):
        grace_s = 0.0  # a worker died: the group is broken and the others may never answer "stop"
    for p in procs:
        with contextlib.suppress(BrokenPipeError, OSError):  # already gone
            p.conn.send(("stop", None))
    deadline = time.monotonic() + grace_s
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.process.wait(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.process.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.process.wait(2.0)
        if p.is_alive():
            p.process.kill()
            p.process.wait(2.0)
        p.conn.close()
        for sent in p.segments:  # steps never answered: their shared arrays go with the workers
            if sent is not None:
                sent.release()
        p.segments.clear()
    if pool is not None:
        pool.close()


if __name__ == "__main__":  # a worker process (MultiprocExecutor starts it with its end of the pipe)
    worker_main(multiprocessing.connection.Connection(int(sys.argv[1])))
    # The interpreter's exit then leaves the objects alive now (torch's modules, the model) to the process's end
    # instead of collecting them: 0.7-0.9 s of CPU less a worker on a two-core machine, nothing in them to finalize.
    gc.freeze()

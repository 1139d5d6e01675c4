"""``AsyncEngine``: an ``LLMEngine`` driven by one background thread, fed from asyncio handlers.

How the loop works:

- Handlers never touch the engine while it steps. ``add_request`` (called on an event loop) validates and tokenizes
  the prompt itself (the tokenizer and model config are read-only), registers an ``asyncio.Queue`` for the request
  and appends it to an inbox; ``abort`` appends the id to the inbox too (or drops a request still in the inbox). Both
  take only the inbox lock, held for microseconds, and notify the loop thread.
- The loop thread sleeps on a condition while the inbox is empty and the engine has nothing to run (no busy spin).
  Otherwise it takes the whole inbox, then, under the engine lock, adds the new requests, applies the aborts and runs
  one ``engine.step()``. Requests that arrive while a step runs are added before the next one, so concurrent HTTP
  requests are batched by the engine's continuous batching.
- After each step every ``RequestOutput`` (cumulative token ids and text) goes to its request's queue through
  ``loop.call_soon_threadsafe``; a finished output unregisters the request. ``generate`` yields the latest output
  available when the consumer gets to it (outputs are cumulative, so a slow consumer skips intermediate ones and
  loses nothing).
- A consumer that stops early (client disconnect: the handler's task is cancelled or the generator is closed) aborts
  its request from ``generate``'s ``finally``; the loop thread frees its blocks and slot before the next step.
- An exception from the engine itself is a bug: the loop logs it, fails every open request with ``EngineDeadError``
  and stops; ``is_alive()`` turns false (``/health`` answers 503). ``shutdown()`` stops and joins the thread.

Anything else that reads the engine from another thread (``get_metrics``, ``assert_no_leaks``) takes the engine
lock, so it never sees the engine in the middle of a step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from hyserve.engine.llm_engine import LLMEngine, PromptType
from hyserve.outputs import RequestOutput
from hyserve.sampling_params import SamplingParams

logger = logging.getLogger("hyserve.server")


class EngineDeadError(RuntimeError):
    """The engine loop is not running (it failed, or the engine was shut down)."""


class RequestAbortedError(RuntimeError):
    """The request was aborted before it finished."""


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


@dataclass(slots=True)
class _NewRequest:
    request_id: str
    prompt: dict[str, Any]
    params: SamplingParams


class AsyncEngine:
    """Runs ``engine.step()`` on a background thread and streams outputs to asyncio consumers."""

    def __init__(self, engine: LLMEngine, *, start: bool = True) -> None:
        self.engine = engine
        self._engine_lock = threading.Lock()
        self._cond = threading.Condition()  # guards everything below
        self._streams: dict[str, _Stream] = {}
        self._inbox: dict[str, _NewRequest] = {}
        self._aborts: list[str] = []
        self._busy = False  # the engine had unfinished requests after the last step
        self._stopping = False
        self._dead: BaseException | None = None
        self._thread: threading.Thread | None = None
        if start:
            self.start()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        with self._cond:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name="hyserve-engine-loop", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop thread; open requests are aborted and their consumers get ``EngineDeadError``."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                logger.warning("the engine loop did not stop within %.0f s", timeout)
                return
        with self._engine_lock:
            self._fail_all(EngineDeadError("the engine was shut down"))

    def is_alive(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive() and self._dead is None and not self._stopping

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop failed: {self._dead!r}") from self._dead
        if self._stopping:
            raise EngineDeadError("the engine is shutting down")
        if self._thread is None:
            raise EngineDeadError("the engine loop was not started")

    # ------------------------------------------------------------------ requests

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def encode_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Tokenize and check a prompt without touching the engine's mutable state; raises ``ValueError``."""
        text, ids = self.engine.encode_prompt(prompt)
        if not ids:
            raise ValueError("the prompt is empty (0 tokens)")
        if len(ids) >= self.engine.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, but max_model_len is {self.engine.max_model_len} "
                             "(the prompt must leave room for at least one output token)")
        return text, ids

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams
                    ) -> asyncio.Queue[RequestOutput | BaseException]:
        """Queue a request for the loop thread; call on the event loop that will consume its outputs.

        Raises ``ValueError`` for a bad prompt or a duplicate id and ``EngineDeadError`` if the loop is not running.
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams (got {type(params).__name__})")
        text, ids = self.encode_prompt(prompt)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        with self._cond:
            self._check_alive()
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = _Stream(loop, queue)
            item: dict[str, Any] = {"prompt_token_ids": ids}
            if text is not None:
                item["prompt"] = text
            self._inbox[request_id] = _NewRequest(request_id, item, params)
            self._cond.notify_all()
        return queue

    async def generate(self, request_id: str, prompt: PromptType, params: SamplingParams
                       ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's cumulative ``RequestOutput`` as it progresses; the last one has ``finished`` set.

        The request is queued at the first iteration. Closing the generator early (``aclose()``, or cancelling the
        task consuming it) aborts the request in the engine.
        """
        queue = self.add_request(request_id, prompt, params)
        finished = False
        try:
            while True:
                item = await queue.get()
                while not isinstance(item, BaseException) and not item.finished and not queue.empty():
                    item = queue.get_nowait()  # cumulative: the latest output subsumes the earlier ones
                if isinstance(item, BaseException):
                    finished = True  # the loop has already dropped the request
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe; unknown or finished ids are ignored).

        A consumer still waiting on its outputs gets ``RequestAbortedError``.
        """
        with self._cond:
            stream = self._streams.pop(request_id, None)
            if stream is None:
                return
            if self._inbox.pop(request_id, None) is None:
                self._aborts.append(request_id)  # else it never reached the engine
                self._cond.notify_all()
        # A consumer still waiting (someone else aborted its request) wakes up with an error, never hangs.
        self._post(stream, RequestAbortedError(f"request {request_id} was aborted"))

    # ------------------------------------------------------------------ reads from other threads

    def get_metrics(self) -> dict[str, float | list[float]]:
        with self._engine_lock:
            return self.engine.get_metrics()

    def num_unfinished_requests(self) -> int:
        with self._cond:
            pending = len(self._inbox)
        with self._engine_lock:
            return pending + self.engine.get_num_unfinished_requests()

    def wait_until_idle(self, timeout: float = 10.0) -> bool:
        """Block until the inbox is empty and the engine has no unfinished requests (True) or the timeout passes."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._dead is not None or not (self._inbox or self._aborts or self._busy), timeout)

    def assert_no_leaks(self) -> None:
        """Tests: nothing runs and every KV block and state slot is back in its pool."""
        with self._cond:
            if self._inbox or self._streams:
                raise AssertionError(f"requests still open in the server: {sorted(self._streams)}")
        with self._engine_lock:
            self.engine.assert_no_leaks()

    # ------------------------------------------------------------------ the loop thread

    def _run(self) -> None:
        engine = self.engine
        idle_steps = 0
        try:
            while True:
                with self._cond:
                    while not (self._stopping or self._inbox or self._aborts or self._busy):
                        self._cond.wait()
                    if self._stopping:
                        return
                    new = list(self._inbox.values())
                    self._inbox.clear()
                    aborts, self._aborts = self._aborts, []
                outputs: list[RequestOutput] = []
                with self._engine_lock:
                    for req in new:
                        try:
                            engine.add_request(req.request_id, req.prompt, req.params)
                        except ValueError as e:  # validated before queueing: should not happen
                            logger.warning("request %s refused by the engine: %s", req.request_id, e)
                            self._deliver_error(req.request_id, e)
                    if aborts:
                        engine.abort_request(aborts)
                    if engine.has_unfinished_requests():
                        outputs = engine.step()
                    busy = engine.has_unfinished_requests()
                self._dispatch(outputs)
                with self._cond:
                    self._busy = busy
                    self._cond.notify_all()  # wakes wait_until_idle
                # A step that schedules nothing while requests wait would spin: back off briefly.
                idle_steps = idle_steps + 1 if busy and not outputs else 0
                if idle_steps:
                    time.sleep(min(0.001 * idle_steps, 0.05))
        except BaseException as e:
            logger.exception("the engine loop failed; every open request is failed and /health reports it")
            with self._cond:
                self._dead = e
                self._cond.notify_all()
            err = EngineDeadError(f"the engine loop failed: {e!r}")
            with self._engine_lock:
                self._fail_all(err)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        lost: list[str] = []
        with self._cond:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    if not out.finished:
                        lost.append(out.request_id)  # nobody listens (aborted meanwhile): make sure it stops
                    continue
                if out.finished:
                    del self._streams[out.request_id]
                if not self._post(stream, out) and not out.finished:
                    self._streams.pop(out.request_id, None)
                    lost.append(out.request_id)
            if lost:
                self._aborts.extend(lost)

    @staticmethod
    def _post(stream: _Stream, item: RequestOutput | BaseException) -> bool:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
            return True
        except RuntimeError:  # the consumer's event loop is closed
            return False

    def _deliver_error(self, request_id: str, err: BaseException) -> None:
        with self._cond:
            stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._post(stream, err)

    def _fail_all(self, err: BaseException) -> None:
        """Fail every open request (caller holds the engine lock)."""
        with self._cond:
            streams, self._streams = self._streams, {}
            self._inbox.clear()
            self._aborts.clear()
            self._busy = False
            self._cond.notify_all()
        try:
            self.engine.abort_request(list(self.engine.requests))
        except Exception:
            logger.exception("could not abort the open requests")
        for stream in streams.values():
            self._post(stream, err)

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
- After each step every ``RequestOutput`` goes to its request's queue through ``loop.call_soon_threadsafe``; a
  finished output unregisters the request. ``generate`` yields what is available when the consumer gets to it: for
  cumulative outputs the latest (it subsumes the earlier ones), for DELTA outputs (``SamplingParams.output_kind``,
  what the server streams) all of them merged into one (``merge_delta``), so a slow consumer loses nothing.
- A consumer that stops early (client disconnect: the handler's task is cancelled or the generator is closed) aborts
  its request from ``generate``'s ``finally``; the loop thread frees its blocks and slot before the next step.
- A prompt with ``multi_modal_data`` (images) given to ``generate`` has its images processed in a worker thread
  before it is queued (``LLMEngine.prepare_prompt``: load, resize, normalise, cut into patches, widen the
  placeholders), as the server's chat route does with ``prepare_images``: tens of milliseconds of a core per new
  image that the loop thread would otherwise spend between two steps, stalling every running request. A bad image
  raises ``ValueError`` from ``generate`` then, before anything is queued. ``open`` (synchronous) hands raw images
  to the engine, which processes them when the loop adds the request (its caller, the server, prepares them
  first); a refusal there ends that request alone. A prompt without images whose ids hold the image placeholder
  token (text can spell it) is refused at the door, as the engine would refuse it.
- ``add_request`` refuses at the door what the engine would fail on later: besides the prompt, token ids in the
  sampling params (``stop_token_ids``) must lie in the model's vocabulary, so one request can never take the engine
  loop down. A request the engine still refuses when the loop adds it (any exception) ends alone with that error;
  the others go on.
- An exception from ``engine.step()`` is a bug or a dead worker: the loop logs it, fails every open request with
  ``EngineDeadError`` and stops; ``is_alive()`` turns false (``/health`` answers 503), and then the callbacks given to
  ``add_dead_callback`` run (``hyserve serve`` exits non-zero from one). ``shutdown()`` stops and joins the thread
  (no callback runs then).
- While idle the loop wakes every ``health_check_interval_s`` to ask the executor whether its workers are alive
  (``check_health()``, where the executor has one: workers in other processes), so a worker that dies between
  requests fails the loop the same way, not only when the next request reaches it.
- ``abort_all()`` (server shutdown) ends every open request at once: each consumer gets a last output marked
  finished with ``finish_reason="abort"`` (the text produced so far; for DELTA outputs what it has not read yet),
  so a stream can close with a final chunk.

Anything else that reads the engine from another thread (``get_metrics``, ``assert_no_leaks``) takes the engine
lock, so it never sees the engine in the middle of a step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from hyserve.engine.llm_engine import LLMEngine, PromptType, has_raw_images
from hyserve.engine.request_metrics import RequestMetrics
from hyserve.outputs import CompletionOutput, RequestOutput, merge_delta
from hyserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("hyserve.server")

DEFAULT_HEALTH_CHECK_INTERVAL_S = 1.0


class EngineDeadError(RuntimeError):
    """The engine loop is not running (it failed, or the engine was shut down)."""


class RequestAbortedError(RuntimeError):
    """The request was aborted before it finished."""


class ShutdownAbortError(RequestAbortedError):
    """The server is shutting down: ``generate`` turns it into a last output with ``finish_reason="abort"``."""


def aborted_output(last: RequestOutput | None, request_id: str, prompt: dict[str, Any], n: int = 1) -> RequestOutput:
    """The final output of a request ended by shutdown: ``last`` (or an empty one), finished. ``last`` is the latest
    output for cumulative outputs, the merged unread ones for DELTA outputs; each of the ``n`` completions it lacks
    is an empty one."""
    if last is None:
        last = RequestOutput(request_id=request_id, prompt=prompt.get("prompt"),
                             prompt_token_ids=list(prompt["prompt_token_ids"]), outputs=[], finished=False)
    have = {c.index: c for c in last.outputs}
    outputs = [dataclasses.replace(have[i], finish_reason="abort", stop_reason=None) if i in have else
               CompletionOutput(index=i, text="", token_ids=[], cumulative_logprob=None, logprobs=None,
                                finish_reason="abort") for i in range(max(n, len(have)))]
    return dataclasses.replace(last, outputs=outputs, finished=True)


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

    def __init__(self, engine: LLMEngine, *, start: bool = True,
                 health_check_interval_s: float = DEFAULT_HEALTH_CHECK_INTERVAL_S) -> None:
        self.engine = engine
        self.health_check_interval_s = health_check_interval_s
        # None once the loop has failed and run them: a callback added then is called at once.
        self._dead_callbacks: list[Callable[[BaseException], None]] | None = []
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

    def add_dead_callback(self, callback: Callable[[BaseException], None]) -> None:
        """Call ``callback(error)`` once the loop has failed and every open request has been failed (on the loop
        thread; at once if it has failed already). Not called by ``shutdown()``."""
        with self._cond:
            dead = self._dead
            if self._dead_callbacks is not None:
                self._dead_callbacks.append(callback)
                return
        assert dead is not None
        callback(dead)

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

    def _check_no_placeholders(self, ids: list[int]) -> None:
        mm = self.engine.model_config.multimodal
        if mm is not None and mm.image_token_id in ids:
            raise ValueError(f"the prompt holds {ids.count(mm.image_token_id)} image placeholder tokens (id "
                             f"{mm.image_token_id}) but no images")

    def check_params(self, params: SamplingParams) -> None:
        """Refuse sampling params the engine would fail on mid-step; ``ValueError`` names the field.

        Token ids must lie in the model's vocabulary [0, vocab_size): an id outside it reaches the sampler's ban
        masks (``min_tokens``) and would fail the whole step, i.e. every request in it.
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams (got {type(params).__name__})")
        validate = getattr(self.engine, "check_sampling_params", None)  # the engine's own check, where it has one
        if callable(validate):
            validate(params)
        vocab = self.engine.model_config.vocab_size
        bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"stop_token_ids contains ids outside the vocabulary [0, {vocab}) (vocab_size "
                             f"{vocab}): {bad[:5]}")

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams
                    ) -> asyncio.Queue[RequestOutput | BaseException]:
        """Queue a request for the loop thread; call on the event loop that will consume its outputs.

        Raises ``ValueError`` for a bad prompt, bad sampling params or a duplicate id and ``EngineDeadError`` if the
        loop is not running.
        """
        return self._add_request(request_id, prompt, params)[0]

    def _add_request(self, request_id: str, prompt: PromptType, params: SamplingParams
                     ) -> tuple[asyncio.Queue[RequestOutput | BaseException], dict[str, Any]]:
        self.check_params(params)
        mm_data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if mm_data is not None and isinstance(prompt, dict):
            # Images are processed (and the prompt widened) by the engine when its loop adds the request: here only
            # the ids are checked, so no pixel work runs on the event loop.
            prompt = {k: v for k, v in prompt.items() if k != "multi_modal_data"}
        text, ids = self.encode_prompt(prompt)
        if mm_data is None and not (isinstance(prompt, dict) and "multi_modal_inputs" in prompt):
            self._check_no_placeholders(ids)
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
            if mm_data is not None:
                item["multi_modal_data"] = mm_data
            if isinstance(prompt, dict) and "multi_modal_inputs" in prompt:  # processed already (prepare_images)
                item["multi_modal_inputs"] = prompt["multi_modal_inputs"]
            self._inbox[request_id] = _NewRequest(request_id, item, params)
            self._cond.notify_all()
        return queue, item

    async def generate(self, request_id: str, prompt: PromptType, params: SamplingParams
                       ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's cumulative ``RequestOutput`` as it progresses; the last one has ``finished`` set.

        The request is queued at the first iteration, after its images (``multi_modal_data``), if any, are
        processed in a worker thread. Closing the generator early (``aclose()``, or cancelling the task consuming
        it) aborts the request in the engine.
        """
        if has_raw_images(prompt):
            self.check_params(params)  # the cheap refusals before the pixel work
            prompt = await asyncio.to_thread(self.engine.prepare_prompt, prompt)
        queue, item = self._add_request(request_id, prompt, params)
        async for out in self._outputs(request_id, queue, item, params):
            yield out

    def open(self, request_id: str, prompt: PromptType, params: SamplingParams
             ) -> AsyncGenerator[RequestOutput, None]:
        """``generate``, except that the request is validated and queued now (``ValueError``/``EngineDeadError``
        raise here, before any response starts), not at the first iteration."""
        queue, item = self._add_request(request_id, prompt, params)
        return self._outputs(request_id, queue, item, params)

    async def _outputs(self, request_id: str, queue: asyncio.Queue[RequestOutput | BaseException],
                       prompt: dict[str, Any], params: SamplingParams) -> AsyncGenerator[RequestOutput, None]:
        delta = params.output_kind is RequestOutputKind.DELTA
        finished = False
        # Cumulative: the latest output taken. DELTA: the outputs taken and not yielded yet (merged), else None.
        last: RequestOutput | None = None
        try:
            while True:
                item = await queue.get()
                while not isinstance(item, BaseException) and not item.finished and not queue.empty():
                    nxt = queue.get_nowait()
                    if isinstance(nxt, BaseException):
                        last = item
                        item = nxt
                        break
                    # Cumulative: the latest output subsumes the earlier ones. DELTA: each holds only its own
                    # tokens, so they are merged, never dropped.
                    item = merge_delta(item, nxt) if delta else nxt
                if isinstance(item, ShutdownAbortError):
                    finished = True  # abort_all has already queued the engine abort
                    yield aborted_output(last, request_id, prompt, params.n)
                    return
                if isinstance(item, BaseException):
                    finished = True  # the loop has already dropped the request
                    raise item
                if item.finished:
                    finished = True
                last = None if delta else item
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str, error: RequestAbortedError | None = None) -> None:
        """Abort a request (thread-safe; unknown or finished ids are ignored).

        A consumer still waiting on its outputs gets ``error`` (default ``RequestAbortedError``).
        """
        with self._cond:
            stream = self._streams.pop(request_id, None)
            if stream is None:
                return
            if self._inbox.pop(request_id, None) is None:
                self._aborts.append(request_id)  # else it never reached the engine
                self._cond.notify_all()
        # A consumer still waiting (someone else aborted its request) wakes up with an error, never hangs.
        self._post(stream, error or RequestAbortedError(f"request {request_id} was aborted"))

    def abort_all(self, reason: str = "the server is shutting down") -> int:
        """End every open request now (thread-safe); their consumers get a last output with ``finish_reason``
        ``"abort"``. Returns how many were open."""
        with self._cond:
            ids = list(self._streams)
        for request_id in ids:
            self.abort(request_id, ShutdownAbortError(reason))
        return len(ids)

    def num_open_requests(self) -> int:
        with self._cond:
            return len(self._streams)

    # ------------------------------------------------------------------ reads from other threads

    def get_metrics(self) -> dict[str, float | list[float]]:
        """The engine's metrics, with ``hyserve:state_slots_usage_perc`` (request state slots in use, 0..1) beside
        ``hyserve:kv_cache_usage_perc`` even where the engine does not export it."""
        with self._engine_lock:
            metrics = self.engine.get_metrics()
            states = self.engine.state_slots
            used = states.num_slots - states.num_free_slots
        metrics.setdefault("hyserve:state_slots_usage_perc", used / max(states.num_slots, 1))
        return metrics

    def get_request_metrics(self) -> RequestMetrics:
        """A copy of the engine's per-request histograms and finish-reason counts."""
        with self._engine_lock:
            return self.engine.metrics.requests.copy()

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
        check_health = getattr(getattr(engine, "executor", None), "check_health", None)
        idle_wait = self.health_check_interval_s if callable(check_health) else None
        try:
            while True:
                with self._cond:
                    while not (self._stopping or self._inbox or self._aborts or self._busy):
                        if not self._cond.wait(idle_wait) and check_health is not None:
                            check_health()  # idle: a worker that died raises here (WorkerError)
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
                        except Exception as e:  # validated before queueing: only this request fails
                            logger.warning("request %s refused by the engine: %r", req.request_id, e)
                            with suppress(Exception):
                                engine.abort_request(req.request_id)  # in case it got half-way in
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
            with self._cond:
                callbacks, self._dead_callbacks = self._dead_callbacks or [], None
            for callback in callbacks:
                try:
                    callback(e)
                except Exception:
                    logger.exception("a callback on the engine loop's failure failed")

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

"""The OpenAI-compatible HTTP server: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/tokenize``,
``/detokenize``, ``/health``, ``/version`` and ``/metrics``, in front of an ``AsyncEngine``.

``build_app`` assembles it: the routes (``hyserve.server.routes``: one router per API) reach what they share through
``app.state.context`` (``hyserve.server.context.ServerContext``); the error answers are ``hyserve.server.errors``'s,
the API key and the body bounds ``hyserve.server.middleware``'s.

Choices worth knowing:

- Bad input is a 4xx with ``{"error": {"message", "type": "invalid_request_error", "param", "code"}}`` naming the
  field: invalid JSON, wrong types or values, a prompt that does not fit ``max_model_len`` (both numbers in the
  message), ``max_tokens`` beyond the room the prompt leaves, malformed messages, sampling values that
  ``SamplingParams`` refuses: 400; an unknown model: 404. A 500 only comes from a genuine bug (logged with its
  traceback); a dead engine loop gives 503.
- A request whose logits turn non-finite ends with ``finish_reason: "error"`` in an ordinary 200 answer (streamed or
  not), and the server logs it: the tokens produced before it are valid and returned, and a streamed answer has
  already sent its 200 when the error happens, so both paths report it the same way. ``hyserve:request_errors``
  counts these requests.
- Streaming (``text/event-stream``): ``data: {json}\\n\\n`` chunks with the engine's DELTA outputs as they come
  (text, token ids and logprobs new since the last chunk), a final chunk with ``finish_reason``, an optional usage
  chunk (``stream_options.include_usage``; ``continuous_usage_stats`` puts the usage so far on every chunk) and
  ``data: [DONE]``. The engine's output processor holds back the last
  ``max(len(stop)) - 1`` characters until the request finishes, so a stop string cut from the end is never sent:
  the streamed text equals the non-streamed one.
- A client that disconnects (mid-stream, or while waiting for a non-streamed answer) has its request aborted in the
  engine, which frees its KV blocks and state slot before the next step.
- ``api_key``: every ``/v1/*`` route needs ``Authorization: Bearer <key>`` (compared in constant time), else a 401
  with an OpenAI-style body; ``/health``, ``/version`` and ``/metrics`` stay open (as vLLM's do).
- Bounded work per request, so that one request cannot stall the others: a body over ``max_request_body_bytes`` is
  a 413 (refused from its Content-Length before it is read, or as soon as the bytes read pass the bound; at most
  that many bytes are ever held) and must arrive within ``body_read_timeout_s`` (408); text longer than
  ``4 * max_model_len * (longest token in characters)`` can never fit the context and is refused before it is
  tokenized; tokenizing runs in a worker thread through the tokenizer's GIL-releasing batch call (neither the
  event loop nor the engine thread ever tokenizes text: the engine gets token ids); a chat template renders in a
  worker thread under a deadline (``chat_template_timeout_s``) that the template's own code checks on every line,
  so a runaway loop stops burning CPU when the deadline passes (single huge operations, such as
  ``'x' * 10**10``, are not interrupted: only the checkpoint's template and trusted request templates run).
- Images (``image_url`` content parts in chat messages; ``hyserve.multimodal.chat``): counted against
  ``--limit-mm-per-prompt`` and refused for a text-only checkpoint before any is read, then fetched and decoded in
  a worker thread under ``load_image``'s rules (data URLs; http(s) only on ``--allowed-media-domains`` hosts;
  file:// only under ``--allowed-local-media-path``). Text is tokenized with special tokens recognised, so it can
  spell the image placeholder: a prompt without images that holds one is a 400 (completions too), and the rendered
  prompt of one with images must hold one image placeholder per image, and its length with each image's tokens
  (sized from the image's dimensions, as the processor resizes) is checked against ``max_model_len`` and the room
  for ``max_tokens``. Every refusal is a 400 whose ``param`` names the part
  (``messages[1].content[2]``). The engine processes the pixels when its loop adds the request; should it still
  refuse the request there, the answer is a 400 (streamed: an error event and ``data: [DONE]``).
- A request-supplied ``chat_template`` (or ``chat_template_kwargs.chat_template``) is refused (400) unless the server
  was started with ``trust_request_chat_template`` (vLLM's ``--trust-request-chat-template``).
- The OpenAPI schema declares, route by route, the statuses as they are answered (400, 401, 404, 408, 413 and 503
  with the error body, never a 422), ``/metrics`` as ``text/plain; version=0.0.4``; the request models' schemas are
  in ``protocol``. ``/docs`` and ``/redoc`` load their assets from this server (``routes.docs``), and a path with no
  route is a 404 that lists the routes.
- Server shutdown (``hyserve.server.serving``) ends every open request through ``AsyncEngine.abort_all()``: a stream
  gets a final chunk with ``finish_reason: "abort"`` and ``data: [DONE]``, a non-streamed answer the text so far with
  the same finish reason.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

import hyserve
from hyserve.server.async_engine import AsyncEngine
from hyserve.server.context import ServerContext
from hyserve.server.errors import add_error_handlers
from hyserve.server.metrics import HTTPMetricsMiddleware
from hyserve.server.middleware import APIKeyMiddleware, BodyLimitMiddleware
from hyserve.server.routes import chat, completions, info, tokenize
from hyserve.server.routes.docs import add_docs_routes, add_not_found_handler
from hyserve.server.tools import ToolSettings

logger = logging.getLogger("hyserve.server")

DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 2**20
DEFAULT_BODY_READ_TIMEOUT_S = 30.0
DEFAULT_CHAT_TEMPLATE_TIMEOUT_S = 10.0


def build_app(async_engine: AsyncEngine, served_model_name: str | None = None, *,
              shutdown_engine_on_exit: bool = True, api_key: str | None = None,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
              body_read_timeout_s: float = DEFAULT_BODY_READ_TIMEOUT_S,
              trust_request_chat_template: bool = False,
              chat_template_timeout_s: float = DEFAULT_CHAT_TEMPLATE_TIMEOUT_S,
              enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
              reasoning_parser: str | None = None) -> FastAPI:
    """The FastAPI app serving ``async_engine`` (started on app startup if it is not yet); see the module docstring
    for ``api_key``, the bounds and ``trust_request_chat_template``; ``hyserve.server.tools`` and
    ``hyserve.server.reasoning`` for the tool-call and reasoning parsers (an unknown name is a ``ValueError``)."""
    context = ServerContext(async_engine, served_model_name, trust_request_chat_template=trust_request_chat_template,
                            chat_template_timeout_s=chat_template_timeout_s,
                            tool_settings=ToolSettings(enable_auto_tool_choice, tool_call_parser),
                            reasoning_parser=reasoning_parser)
    # docs_url / redoc_url: FastAPI's pages load their assets from a CDN; add_docs_routes serves them locally.
    app = FastAPI(title="hyserve", version=hyserve.__version__, docs_url=None, redoc_url=None,
                  lifespan=functools.partial(_lifespan, shutdown_engine_on_exit=shutdown_engine_on_exit))
    app.state.context = context
    app.state.engine = async_engine
    app.state.served_model_name = context.model_name
    app.state.http_metrics = context.http_metrics
    add_error_handlers(app)
    add_not_found_handler(app)
    routers = (completions.router, chat.router, info.router, tokenize.router)
    for router in routers:
        app.include_router(router)
    add_docs_routes(app)

    # Every path the app serves (its own documentation routes and the routers'), for the metrics' path label.
    routes = [*app.routes, *(route for router in routers for route in router.routes)]
    known_paths = frozenset(path for route in routes if (path := getattr(route, "path", "")))
    # Starlette runs the last added outermost: metrics see every answer (401s and 413s included), the key is
    # checked before any body byte is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_body_bytes, timeout_s=body_read_timeout_s)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(HTTPMetricsMiddleware, metrics=context.http_metrics, known_paths=known_paths)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI, shutdown_engine_on_exit: bool) -> AsyncIterator[None]:
    """Start the engine loop with the app; stop it (``shutdown_engine_on_exit``) when the app stops."""
    context: ServerContext = app.state.context
    context.async_engine.start()
    logger.info("serving %s as %r (max_model_len %d)", context.model_dir, context.model_name,
                context.engine.max_model_len)
    try:
        yield
    finally:
        if shutdown_engine_on_exit:
            await asyncio.to_thread(_shutdown_engine, context.async_engine)


def _shutdown_engine(async_engine: AsyncEngine) -> None:
    """Stop the loop thread and say whether every KV block and state slot came back."""
    open_requests = async_engine.num_open_requests()
    async_engine.shutdown()
    if async_engine.dead_error is not None:  # its requests were failed; the workers may be gone: nothing to check
        logger.info("engine stopped after its loop failed (its open requests were failed); no leak check")
        return
    try:
        async_engine.assert_no_leaks()
    except AssertionError as e:
        logger.error("after shutdown: %s", e)
    else:
        logger.info("engine stopped (%d requests were still open); every KV block and state slot is back in its "
                    "pool", open_requests)

"""The server's sharp edges: API key, bounded shutdown, refusal of unimplemented fields, tools through the chat
template, bad text, bounded bodies/text/templates/stop lists, bounded metric labels, bounded connections, token ids
outside the vocabulary, the checkpoint's sampling defaults and the README's examples.

Most tests run the app in-process (``httpx.ASGITransport``, the engine loop on its thread); the ones about sockets
and streams run uvicorn on a thread; two run ``hyserve serve`` as a subprocess and signal it.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from hyserve.config import EngineConfig
from hyserve.engine.llm_engine import LLMEngine
from hyserve.server import AsyncEngine, build_app, context, middleware
from hyserve.server.context import encode_text, max_text_chars
from hyserve.server.serving import make_server
from hyserve.testing import write_tiny_checkpoint
from hyserve.testing.server import ServerThread, free_port, wait_up

CACHE_BYTES = 64 * 1024 * 1024
NAME = "tiny-hard"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("hard") / NAME))


@pytest.fixture(scope="module")
def aengine(path: str) -> Iterator[AsyncEngine]:
    engine = LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", cpu_cache_memory_bytes=CACHE_BYTES))
    async_engine = AsyncEngine(engine)
    yield async_engine
    async_engine.shutdown()


def hardened_app(aengine: AsyncEngine, **kw: Any) -> FastAPI:
    return build_app(aengine, shutdown_engine_on_exit=False, **kw)


def call(app: FastAPI, method: str, url: str, **kw: Any) -> httpx.Response:
    """One request to ``app`` in-process, in a fresh event loop."""

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            return await client.request(method, url, **kw)

    return asyncio.run(go())


def check_error(r: httpx.Response, status: int, param: str | None, needle: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert needle in err["message"], err
    return dict(err)


def settle(aengine: AsyncEngine) -> None:
    assert aengine.wait_until_idle(10)
    aengine.assert_no_leaks()


CHAT = [{"role": "user", "content": "Hello there"}]


# ---------------------------------------------------------------------------------------------------- API key


def test_api_key_guards_v1_only(aengine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    app = hardened_app(aengine, api_key="s3cret")
    seen: list[tuple[bytes, bytes]] = []
    real = middleware.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        seen.append((a, b))
        return real(a, b)

    monkeypatch.setattr(middleware.hmac, "compare_digest", spy)
    body = {"model": NAME, "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                    {"Authorization": "Basic s3cret"}, {"Authorization": "Bearer s3cret2"}):
        for method, url in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                            ("GET", "/v1/nothing")):
            r = call(app, method, url, json=body if method == "POST" else None, headers=headers)
            err = check_error(r, 401, None, "API key")
            assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
            assert r.headers["www-authenticate"] == "Bearer"
    assert seen and all(b == b"s3cret" for _, b in seen)  # every compare of a Bearer token is constant-time
    ok = {"Authorization": "Bearer s3cret"}
    assert call(app, "GET", "/v1/models", headers=ok).status_code == 200
    assert call(app, "POST", "/v1/completions", json=body, headers=ok).status_code == 200
    for url in ("/health", "/metrics", "/version"):  # open, as vLLM's
        assert call(app, "GET", url).status_code == 200
    metrics = call(app, "GET", "/metrics").text
    assert 'hyserve:http_requests_total{method="GET",path="/v1/models",status="401"} 5' in metrics
    settle(aengine)


def test_no_api_key_means_open(aengine: AsyncEngine) -> None:
    assert call(hardened_app(aengine), "GET", "/v1/models").status_code == 200


# ---------------------------------------------------------------------------------------------------- refused fields


REFUSED: list[tuple[str, dict[str, Any], str, str]] = [
    ("completions", {"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "not supported"),
    ("completions", {"structured_outputs": {"json": {}, "structural_tag": "x"}}, "structured_outputs.structural_tag",
     "not supported"),
    ("completions", {"prompt_logprobs": 21}, "prompt_logprobs", "prompt_logprobs must be in [0, 20]"),
    ("completions", {"made_up_field": 1}, "made_up_field", "not supported"),
    ("completions", {"tool_choice": "none"}, "tool_choice", "not supported"),  # chat only
    ("chat", {"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "not supported"),
    ("chat", {"reasoning_effort": "high"}, "reasoning_effort", "not supported"),
    ("chat", {"prompt_logprobs": 0}, "prompt_logprobs", "not supported"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice", "tool-call parser"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}, "tool_choice",
     "tool-call parser"),
    # "required" and a named function constrain the answer: another constraint beside them is refused, naming both.
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
              "response_format": {"type": "json_object"}}, "response_format", "tool_choice 'required'"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}],
              "tool_choice": {"type": "function", "function": {"name": "f"}}, "guided_regex": "a+"}, "guided_regex",
     "tool_choice a named function"),
    ("chat", {"tool_choice": "required"}, "tool_choice", "no tools"),
    ("chat", {"tool_choice": "none"}, "tool_choice", "no tools"),  # OpenAI's answer too
    ("chat", {"tool_choice": "sometimes"}, "tool_choice", "tool_choice must be"),
    ("chat", {"tools": [{"type": "retrieval"}], "tool_choice": "none"}, "tools[0]", "function"),
    ("chat", {"response_format": {"type": "structural_tag"}}, "response_format.type", "not supported"),
    ("chat", {"messages": [{"role": "user", "content": "hi", "audio": {"id": "x"}}]}, "messages[0].audio",
     "not supported"),
    ("chat", {"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, "messages[0].tool_calls",
     "assistant"),
    ("chat", {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "not valid JSON"),
    ("chat", {"messages": [{"role": "tool", "content": "1", "tool_call_id": 5}]}, "messages[0].tool_call_id",
     "string"),
    ("chat", {"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "tools"),
]


@pytest.mark.parametrize(("route", "extra", "param", "needle"), REFUSED,
                         ids=[f"{r[0]}-{r[2]}-{i}" for i, r in enumerate(REFUSED)])
def test_unimplemented_fields_are_refused(aengine: AsyncEngine, route: str, extra: dict[str, Any], param: str,
                                          needle: str) -> None:
    app = hardened_app(aengine)
    if route == "completions":
        body: dict[str, Any] = {"model": NAME, "prompt": "hi", "max_tokens": 2, **extra}
        r = call(app, "POST", "/v1/completions", json=body)
    else:
        body = {"model": NAME, "messages": CHAT, "max_tokens": 2, **extra}
        r = call(app, "POST", "/v1/chat/completions", json=body)
    check_error(r, 400, param, needle)


def test_no_op_values_are_accepted(aengine: AsyncEngine) -> None:
    """Fields set to their no-op value change nothing: the answer equals the plain request's."""
    app = hardened_app(aengine)
    base = {"model": NAME, "messages": CHAT, "max_tokens": 4, "temperature": 0}
    plain = call(app, "POST", "/v1/chat/completions", json=base).json()["choices"][0]["message"]["content"]
    for extra in ({"guided_json": None, "reasoning_effort": None, "prompt_logprobs": None},
                  {"parallel_tool_calls": False},
                  {"stream_options": {"continuous_usage_stats": False, "include_usage": True}, "stream": True},
                  {"messages": [{**CHAT[0], "refusal": None, "audio": None}]}):
        r = call(app, "POST", "/v1/chat/completions", json={**base, **extra})
        assert r.status_code == 200, (extra, r.text)
        if extra.get("stream"):
            text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content", "")
                           for line in r.text.splitlines()
                           if line.startswith("data: {") and json.loads(line[6:])["choices"])
        else:
            text = r.json()["choices"][0]["message"]["content"]
        assert text == plain, extra
    settle(aengine)


TOOL_TEMPLATE = (
    "{%- for t in tools or [] %}TOOL {{ t.function.name }}\n{% endfor %}"
    "{%- for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}CALL {{ c.function.name }}(x={{ c.function.arguments.x }}){% endfor %}"
    "{%- if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}\n{% endfor %}"
    "{%- if add_generation_prompt %}<assistant>{% endif %}"
)


def test_tools_and_tool_calls_reach_the_template(aengine: AsyncEngine) -> None:
    app = hardened_app(aengine, trust_request_chat_template=True)
    tok = aengine.engine.tokenizer
    assert tok is not None
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"x": 3}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    body = {"model": NAME, "messages": messages, "tools": tools, "tool_choice": "none", "max_tokens": 2,
            "chat_template": TOOL_TEMPLATE, "return_token_ids": True}
    r = call(app, "POST", "/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    prompt = tok.decode(r.json()["prompt_token_ids"], skip_special_tokens=False)
    expected = "TOOL get_weather\n<user>weather?<assistant>CALL get_weather(x=3)<tool>sunny[call_1]<assistant>"
    assert prompt == expected
    # As transformers renders it, with the arguments as an object.
    hf_messages = [dict(m) for m in messages]
    hf_messages[1] = {**messages[1], "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"x": 3}}}]}
    assert tok.hf_tokenizer.apply_chat_template(hf_messages, tools=tools, chat_template=TOOL_TEMPLATE,
                                                tokenize=False, add_generation_prompt=True) == expected
    settle(aengine)


# ---------------------------------------------------------------------------------------------------- templates


def test_request_chat_template_needs_trust(aengine: AsyncEngine) -> None:
    untrusted = hardened_app(aengine)
    body = {"model": NAME, "messages": CHAT, "max_tokens": 2, "chat_template": "{{ messages[0].content }}"}
    check_error(call(untrusted, "POST", "/v1/chat/completions", json=body), 400, "chat_template",
                "--trust-request-chat-template")
    via_kwargs = {"model": NAME, "messages": CHAT, "max_tokens": 2,
                  "chat_template_kwargs": {"chat_template": "{{ messages[0].content }}"}}
    check_error(call(untrusted, "POST", "/v1/chat/completions", json=via_kwargs), 400, "chat_template_kwargs",
                "chat_template")
    r = call(hardened_app(aengine, trust_request_chat_template=True), "POST", "/v1/chat/completions",
             json={**body, "return_token_ids": True})
    assert r.status_code == 200, r.text
    tok = aengine.engine.tokenizer
    assert tok is not None
    assert r.json()["prompt_token_ids"] == tok.encode("Hello there", add_special_tokens=False)
    settle(aengine)


def _cpu_seconds_over(interval: float) -> float:
    t0 = time.process_time()
    time.sleep(interval)
    return time.process_time() - t0


def test_runaway_template_is_stopped(aengine: AsyncEngine) -> None:
    """A 10,000 x 10,000 loop is cut at the deadline, and the CPU burn stops with it (not only the waiting)."""
    app = hardened_app(aengine, trust_request_chat_template=True, chat_template_timeout_s=0.5)
    template = "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}x"
    t0 = time.monotonic()
    r = call(app, "POST", "/v1/chat/completions", json={"model": NAME, "messages": CHAT, "chat_template": template})
    assert time.monotonic() - t0 < 5
    check_error(r, 400, "chat_template", "longer than 0.5 s")
    assert _cpu_seconds_over(1.0) < 0.3  # nothing keeps rendering in the background
    # The checkpoint's own template runs under the same deadline and still renders normally.
    assert call(app, "POST", "/v1/chat/completions", json={"model": NAME, "messages": CHAT,
                                                           "max_tokens": 2}).status_code == 200
    settle(aengine)


# ---------------------------------------------------------------------------------------------------- bad text


def _raw(app: FastAPI, url: str, payload: bytes) -> httpx.Response:
    return call(app, "POST", url, content=payload, headers={"content-type": "application/json"})


SURROGATES: list[tuple[str, bytes, str]] = [
    ("/v1/completions", b'{"prompt": "ab\\ud800cd", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": ["\\udc00\\ud800"], "max_tokens": 2}', "prompt[0]"),
    ("/v1/completions", b'{"prompt": "hi", "model": "\\ud800"}', "model"),
    ("/v1/completions", b'{"prompt": "hi", "stop": "\\ud800"}', "stop"),
    ("/v1/completions", b'{"prompt": "hi", "stop": ["ok", "x\\udfff"]}', "stop[1]"),
    ("/v1/completions", b'{"prompt": "hi", "user": "\\ud83d"}', "user"),
    ("/v1/completions", b'{"prompt": "CESU \xed\xa0\x80 bytes", "max_tokens": 2}', "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
     "messages[0].content[0].text"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "model": "\\udbff\\udbff"}',
     "model"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi", "\\ud800": 1}]}', "messages[0]"),
]


@pytest.mark.parametrize(("url", "payload", "param"), SURROGATES, ids=[s[2] for s in SURROGATES])
def test_lone_surrogates_are_a_400_naming_the_field(aengine: AsyncEngine, url: str, payload: bytes,
                                                    param: str) -> None:
    r = _raw(hardened_app(aengine), url, payload)
    check_error(r, 400, param, "surrogate")


def test_echoes_are_bounded(aengine: AsyncEngine) -> None:
    app = hardened_app(aengine)
    err = check_error(call(app, "POST", "/v1/completions", json={"prompt": "hi", "model": "m" * 100_000}), 404,
                      "model", "does not exist")
    assert len(err["message"]) < 300
    err = check_error(call(app, "POST", "/v1/completions", json={"prompt": "hi", "stop": {"k": "v" * 100_000}}),
                      400, "stop", "stop must be")
    assert len(err["message"]) < 300
    err = check_error(call(app, "POST", "/v1/completions", json={"prompt": "hi", "max_tokens": "9" * 100_000}), 400,
                      "max_tokens", "integer")
    assert len(err["message"]) < 300
    err = check_error(call(app, "POST", "/v1/completions", json={"prompt": "hi", "temperature": 5,
                                                                 "stop_token_ids": [-1] * 1000}),
                      400, "stop_token_ids", "stop_token_ids")
    assert len(err["message"]) < 500
    r = call(app, "POST", "/v1/completions", json={"prompt": "hi", "x" * 10_000: 1})
    assert r.status_code == 400
    err = r.json()["error"]
    assert "not supported" in err["message"] and len(err["message"]) < 2100
    assert err["param"].startswith("x" * 200) and len(err["param"]) < 250


def test_stop_lists_are_bounded(aengine: AsyncEngine) -> None:
    app = hardened_app(aengine)
    url = "/v1/completions"
    check_error(call(app, "POST", url, json={"prompt": "hi", "stop": ["a"] * 65}), 400, "stop", "at most 64")
    check_error(call(app, "POST", url, json={"prompt": "hi", "stop": "z" * 1025}), 400, "stop", "at most 1024")
    check_error(call(app, "POST", url, json={"prompt": "hi", "stop": ["a", 5]}), 400, "stop", "stop[1]")
    check_error(call(app, "POST", url, json={"prompt": "hi", "stop_token_ids": [1] * 1025}), 400,
                "stop_token_ids", "at most 1024")
    assert call(app, "POST", url, json={"prompt": "hi", "stop": ["a"] * 64, "max_tokens": 2}).status_code == 200
    settle(aengine)


# ---------------------------------------------------------------------------------------------------- big requests


def test_request_body_is_bounded(aengine: AsyncEngine) -> None:
    app = hardened_app(aengine, max_request_body_bytes=1000)
    small = {"model": NAME, "prompt": "hi", "max_tokens": 2}
    assert call(app, "POST", "/v1/completions", json=small).status_code == 200
    big = {**small, "prompt": "a" * 2000}
    err = check_error(call(app, "POST", "/v1/completions", json=big), 413, None, "1000 bytes")
    assert err["code"] == "body_too_large"

    async def chunks() -> Any:  # no Content-Length: counted as read
        for _ in range(100):
            yield b" " * 100

    check_error(call(app, "POST", "/v1/completions", content=chunks()), 413, None, "larger than")
    # A declared length over the bound is refused before a byte is read.
    reads = [0]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        reads[0] += 1
        return {"type": "http.request", "body": b"x" * 10, "more_body": True}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [
        (b"content-length", b"1000000000"), (b"content-type", b"application/json")], "query_string": b"",
        "http_version": "1.1", "scheme": "http", "server": ("t", 80), "client": ("c", 1), "root_path": ""}
    asyncio.run(app(scope, receive, send))  # type: ignore[arg-type]
    assert reads[0] == 0 and sent[0]["status"] == 413
    settle(aengine)


def test_body_must_arrive_in_time(aengine: AsyncEngine) -> None:
    app = hardened_app(aengine, body_read_timeout_s=0.3)
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(10)  # a client that stops sending mid-body
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [(b"content-length", b"50")],
             "query_string": b"", "http_version": "1.1", "scheme": "http", "server": ("t", 80), "client": ("c", 1),
             "root_path": ""}
    t0 = time.monotonic()
    asyncio.run(app(scope, receive, send))  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 3 and sent[0]["status"] == 408


def test_overlong_text_is_refused_before_tokenizing(aengine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    app = hardened_app(aengine)
    tok = aengine.engine.tokenizer
    assert tok is not None
    limit = max_text_chars(tok, aengine.engine.max_model_len)
    assert limit is not None
    calls: list[int] = []

    def spy(tok_: Any, text: str, add_special_tokens: bool) -> list[int]:
        calls.append(len(text))
        return encode_text(tok_, text, add_special_tokens)

    monkeypatch.setattr(context, "encode_text", spy)
    check_error(call(app, "POST", "/v1/completions", json={"prompt": "a" * (limit + 1)}), 400, "prompt",
                "characters")
    check_error(call(app, "POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "a" *
                                                                              (limit + 1)}]}), 400, "messages",
                "characters")
    assert calls == []
    # Just under the bound: tokenized (and then refused for its token count).
    check_error(call(app, "POST", "/v1/completions", json={"prompt": "a b " * 3000}), 400, "prompt",
                "max_model_len")
    assert calls == [len("a b " * 3000)]
    # Token-id prompts over max_model_len are refused from their length.
    check_error(call(app, "POST", "/v1/completions", json={"prompt": [5] * 100_000}), 400, "prompt",
                "100000 tokens")


def test_tokenizing_runs_in_a_worker_without_the_gil(aengine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Text is tokenized neither on the event loop nor on the engine thread, and the worker lets the loop run."""
    tok = aengine.engine.tokenizer
    assert tok is not None
    threads: list[tuple[str, bool]] = []
    real = context.encode_text

    def spy(tok_: Any, text: str, add_special_tokens: bool) -> list[int]:
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            on_loop = False
        threads.append((threading.current_thread().name, on_loop))
        return real(tok_, text, add_special_tokens)

    def engine_encode(text: str, add_special_tokens: bool = True) -> list[int]:
        threads.append((threading.current_thread().name, True))  # nobody may use the engine's encode here
        return []

    monkeypatch.setattr(context, "encode_text", spy)
    monkeypatch.setattr(tok, "encode", engine_encode)
    app = hardened_app(aengine)
    assert call(app, "POST", "/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 2}
                ).status_code == 200
    assert call(app, "POST", "/v1/chat/completions", json={"model": NAME, "messages": CHAT, "max_tokens": 2}
                ).status_code == 200
    assert len(threads) == 2 and all(not on_loop and name != "hyserve-engine-loop" for name, on_loop in threads)
    monkeypatch.undo()
    # The batch call releases the GIL: a thread tokenizing a long text leaves the main thread running.
    text = "def f(x):\n    return x + 1\n" * 40_000
    done = threading.Event()

    def work() -> None:
        encode_text(tok, text, True)
        done.set()

    worker = threading.Thread(target=work)
    t0 = time.monotonic()
    worker.start()
    ticks = 0
    while not done.is_set():
        time.sleep(0.002)
        ticks += 1
    worker.join()
    elapsed = time.monotonic() - t0
    assert elapsed > 0.1, "the text is too short to tell"
    assert ticks > elapsed / 0.002 / 10, (ticks, elapsed)  # the GIL-holding encode gives ~1 tick in all
    settle(aengine)


# ---------------------------------------------------------------------------------------------------- metrics


def test_http_metric_labels_are_bounded(aengine: AsyncEngine) -> None:
    app = hardened_app(aengine)
    rng = random.Random(0)

    def series() -> set[str]:
        text = call(app, "GET", "/metrics").text
        return {line.rsplit(" ", 1)[0] for line in text.splitlines() if line.startswith("hyserve:http_requests_total")}

    before = series()

    async def flood() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            for i in range(2000):
                method = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(6)) if i % 2 else \
                    rng.choice(["GET", "POST", "DELETE"])
                await client.request(method, f"/{rng.getrandbits(64):x}/v1/{i}")

    asyncio.run(flood())
    after = series()
    assert len(after - before) <= 10, sorted(after - before)
    assert any('method="other",path="other"' in s for s in after)
    assert all(re.search(r'method="(GET|HEAD|POST|PUT|DELETE|PATCH|OPTIONS|other)"', s) for s in after)


def test_state_slot_usage_metric(aengine: AsyncEngine) -> None:
    app = hardened_app(aengine)
    text = call(app, "GET", "/metrics").text
    assert "# TYPE hyserve:state_slots_usage_perc gauge" in text
    assert re.search(r"^hyserve:state_slots_usage_perc 0\.0$", text, re.M)
    slots = aengine.engine.state_slots.num_slots

    async def during() -> float:
        from hyserve import SamplingParams

        outputs = aengine.open("slot-metric", {"prompt_token_ids": [5, 6, 7]},
                               SamplingParams(max_tokens=500, ignore_eos=True, temperature=0.0))
        try:
            async for out in outputs:
                if out.outputs[0].token_ids:
                    value = aengine.get_metrics()["hyserve:state_slots_usage_perc"]
                    assert isinstance(value, float)
                    return value
        finally:
            await outputs.aclose()
        return -1.0

    assert asyncio.run(during()) == pytest.approx(1 / slots)
    settle(aengine)


def test_openapi_types_prompt_messages_stop(aengine: AsyncEngine) -> None:
    schema = call(hardened_app(aengine), "GET", "/openapi.json").json()["components"]["schemas"]
    prompt = schema["CompletionRequest"]["properties"]["prompt"]
    assert {"type": "string", "minLength": 1} in prompt["anyOf"]
    assert {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1} in prompt["anyOf"]
    stop = schema["CompletionRequest"]["properties"]["stop"]
    assert any(s.get("type") == "string" for s in stop["anyOf"]) and any(s.get("type") == "array"
                                                                          for s in stop["anyOf"])
    messages = schema["ChatCompletionRequest"]["properties"]["messages"]
    assert messages["type"] == "array"
    kinds = messages["items"]["anyOf"]  # assistant messages (null content, tool_calls) and the others
    roles = [r for k in kinds for r in k["properties"]["role"].get("enum", [k["properties"]["role"].get("const")])]
    assert sorted(roles) == sorted(["system", "developer", "user", "assistant", "tool"])
    assert any("array" in str(k["properties"]["tool_calls"]) for k in kinds)


def test_models_root_is_the_served_name(aengine: AsyncEngine, path: str) -> None:
    card = call(hardened_app(aengine), "GET", "/v1/models").json()["data"][0]
    assert card["id"] == card["root"] == NAME
    assert path not in json.dumps(card)


# ---------------------------------------------------------------------------------------------------- engine safety


@pytest.mark.parametrize("bad", [512, 4096, 10**9, 2**63])
def test_token_ids_outside_the_vocabulary_are_a_400(aengine: AsyncEngine, bad: int) -> None:
    app = hardened_app(aengine)
    vocab = aengine.engine.model_config.vocab_size
    assert vocab <= bad
    for url, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": CHAT})):
        r = call(app, "POST", url, json={**body, "model": NAME, "stop_token_ids": [3, bad], "min_tokens": 1,
                                         "max_tokens": 3})
        check_error(r, 400, "stop_token_ids", f"vocabulary [0, {vocab})")
    r = call(app, "POST", "/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 3, "min_tokens": 1,
                                                   "stop_token_ids": [vocab - 1]})
    assert r.status_code == 200 and aengine.is_alive()
    settle(aengine)


def test_engine_loop_survives_a_request_the_engine_refuses(aengine: AsyncEngine,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    app = hardened_app(aengine)
    engine = aengine.engine
    real = engine.add_request

    def add_request(request_id: str, prompt: Any, params: Any = None) -> None:
        if params is not None and params.max_tokens == 13:
            raise RuntimeError("this request breaks the engine")
        real(request_id, prompt, params)

    monkeypatch.setattr(engine, "add_request", add_request)
    r = call(app, "POST", "/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 13})
    assert r.status_code == 500 and "this request breaks the engine" in r.text
    assert aengine.is_alive()
    assert call(app, "GET", "/health").status_code == 200
    r = call(app, "POST", "/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    settle(aengine)


# ---------------------------------------------------------------------------------------------------- defaults


def test_checkpoint_sampling_defaults_fill_unset_fields(aengine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    app = hardened_app(aengine)
    engine = aengine.engine
    monkeypatch.setattr(engine, "default_sampling_params", {"temperature": 0.0, "max_tokens": 5}, raising=False)
    base = {"model": NAME, "prompt": "Once upon a time", "ignore_eos": True}
    r = call(app, "POST", "/v1/completions", json=base).json()
    assert r["usage"]["completion_tokens"] == 5  # the checkpoint's max_tokens, not OpenAI's 16
    greedy = call(app, "POST", "/v1/completions", json={**base, "temperature": 0.0, "max_tokens": 5}).json()
    assert r["choices"][0]["text"] == greedy["choices"][0]["text"]  # its temperature 0
    assert call(app, "POST", "/v1/completions", json={**base, "max_tokens": 7}).json()["usage"][
        "completion_tokens"] == 7  # the request's own value wins
    chat = call(app, "POST", "/v1/chat/completions", json={"model": NAME, "messages": CHAT, "ignore_eos": True})
    assert chat.json()["usage"]["completion_tokens"] == 5  # chat: the default, not the whole room
    settle(aengine)


def _readme_server_section() -> str:
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    start = text.index("### Server")
    return text[start:text.index("\n### ", start + 1)]


def test_readme_examples_run_against_the_packaged_model() -> None:
    section = _readme_server_section()
    curl = re.search(r"curl -s http://127\.0\.0\.1:8000(/v1/completions).*?-d '(\{.*?\})'", section, re.S)
    assert curl is not None
    body = json.loads(curl.group(2))
    chat_model = re.search(r'chat\.completions\.create\(\s*model="([^"]+)"', section)
    assert chat_model is not None
    from hyserve.llm import default_model_dir

    engine = LLMEngine(EngineConfig(model=default_model_dir(), device="cpu", dtype="float32"))
    async_engine = AsyncEngine(engine)
    try:
        app = build_app(async_engine, shutdown_engine_on_exit=False)
        r = call(app, "POST", curl.group(1), json=body)
        assert r.status_code == 200, r.text
        r = call(app, "POST", "/v1/chat/completions", json={"model": chat_model.group(1), "max_tokens": 4,
                                                            "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
    finally:
        async_engine.shutdown()


# ---------------------------------------------------------------------------------------------------- uvicorn


def served(aengine: AsyncEngine, **kw: Any) -> ServerThread:
    """``make_server`` (the CLI's server) on a free loopback port, on a thread."""
    return ServerThread(aengine, app=hardened_app(aengine),
                        make_server=lambda app: make_server(app, aengine, log_level="warning", **kw))


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
        return True
    except TimeoutError:
        return False


def test_slow_and_idle_connections_are_closed(aengine: AsyncEngine) -> None:
    with served(aengine, request_read_timeout_s=0.5) as srv:
        idle = socket.create_connection(("127.0.0.1", srv.port))
        slow = socket.create_connection(("127.0.0.1", srv.port))
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and the rest never comes
        t0 = time.monotonic()
        assert _closed_within(idle, 5) and _closed_within(slow, 5)
        assert time.monotonic() - t0 < 3
        # A request that arrives in time is answered, and a long answer is not cut by the timer.
        body = {"model": NAME, "prompt": "hi", "max_tokens": 40, "ignore_eos": True}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200
        idle.close()
        slow.close()
    assert srv.server.config.limit_concurrency == 1024 and srv.server.config.timeout_keep_alive == 5
    settle(aengine)


def _sse(lines: list[str]) -> list[Any]:
    return [json.loads(x[6:]) if x != "data: [DONE]" else "[DONE]" for x in lines if x.startswith("data: ")]


def test_shutdown_ends_open_requests_with_abort_and_done(aengine: AsyncEngine) -> None:
    srv = served(aengine, shutdown_timeout_s=0.5).__enter__()
    long = {"model": NAME, "prompt": "hi", "max_tokens": 3000, "ignore_eos": True, "temperature": 0}
    got: dict[str, Any] = {}

    def non_streamed() -> None:
        got["plain"] = httpx.post(srv.url + "/v1/completions", json=long, timeout=60)

    plain = threading.Thread(target=non_streamed)
    plain.start()
    lines: list[str] = []
    with httpx.Client(timeout=60) as client, client.stream(
            "POST", srv.url + "/v1/chat/completions",
            json={**{k: v for k, v in long.items() if k != "prompt"}, "messages": CHAT, "stream": True,
                  "stream_options": {"include_usage": True}}) as r:
        it = r.iter_lines()
        assert r.status_code == 200
        for line in it:
            lines.append(line)
            if len(_sse(lines)) >= 3:
                break
        t0 = time.monotonic()
        srv.server.should_exit = True  # what the first SIGTERM does
        lines.extend(it)
    elapsed = time.monotonic() - t0
    plain.join(30)
    srv.thread.join(30)
    srv.sock.close()
    assert elapsed < 5, elapsed
    events = _sse(lines)
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"]["completion_tokens"] > 0  # the usage chunk asked for
    assert events[-3]["choices"][0]["finish_reason"] == "abort"
    body = got["plain"].json()
    assert got["plain"].status_code == 200 and body["choices"][0]["finish_reason"] == "abort"
    assert 0 < body["usage"]["completion_tokens"] < 3000
    settle(aengine)
    assert aengine.is_alive()  # the app's lifespan does not own this engine here


# ---------------------------------------------------------------------------------------------------- subprocess




def _serve(port: int) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "hyserve.cli", "serve", "--device", "cpu", "--port", str(port), "--shutdown-timeout",
         "2", "--uvicorn-log-level", "info"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        cwd=ROOT)




@pytest.mark.parametrize("signals", [[signal.SIGTERM], [signal.SIGINT, signal.SIGINT]], ids=["sigterm", "ctrl-c-x2"])
def test_serve_process_shuts_down_cleanly(signals: list[int]) -> None:
    """A real ``hyserve serve`` signalled during a long stream: the stream ends with a final chunk and [DONE]
    within the bound, the process exits 0 and prints no traceback, and the engine gave every block back."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve(port)
    try:
        wait_up(proc, url)
        body = {"model": "default_model", "prompt": "def main():\n", "max_tokens": 4000, "ignore_eos": True,
                "stream": True}
        lines: list[str] = []
        with httpx.Client(timeout=60) as client, client.stream("POST", url + "/v1/completions", json=body) as r:
            it = r.iter_lines()
            for line in it:
                lines.append(line)
                if len(_sse(lines)) >= 3:
                    break
            t0 = time.monotonic()
            for i, sig in enumerate(signals):
                if i:
                    time.sleep(0.3)
                proc.send_signal(sig)
            lines.extend(it)
            elapsed = time.monotonic() - t0
        _, err = proc.communicate(timeout=30)
        total = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    events = _sse(lines)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "abort", events[-3:]
    assert elapsed < (2 + 3 if len(signals) == 1 else 2), elapsed  # a second Ctrl-C aborts at once
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "CancelledError" not in err, err
    assert "every KV block and state slot is back" in err, err
    assert total < 15

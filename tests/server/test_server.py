"""The OpenAI-compatible server end to end: a real uvicorn server on 127.0.0.1 (a background thread) serving a tiny
checkpoint, driven by the official ``openai`` client and by ``httpx`` for the error paths.

Greedy outputs are checked against an offline ``LLM`` on the same checkpoint, streaming against non-streaming,
concurrent clients against their solo runs; every refused input must name its field; a client that disconnects must
have its request aborted with every KV block and state slot back in the pools.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

import hyserve
import hyserve.llm
from hyserve import LLM, SamplingParams
from hyserve.cli import build_parser, main
from hyserve.config import EngineConfig
from hyserve.engine.llm_engine import LLMEngine
from hyserve.server import AsyncEngine, EngineDeadError, RequestAbortedError
from hyserve.server.middleware import APIKeyMiddleware, BodyLimitMiddleware
from hyserve.server.serving import GracefulServer
from hyserve.testing import write_tiny_checkpoint
from hyserve.testing.server import ServerThread

CACHE_BYTES = 64 * 1024 * 1024
MODEL_NAME = "tiny-qwen"
PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n: int) -> int:",
    "Hybrid models mix linear attention layers",
    "Hello, world! How are you today?",
    "Once upon a time there was a little robot",
    "Numbers: 0 1 2 3 4 5",
]


def _engine(path: str, **kw: Any) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", cpu_cache_memory_bytes=CACHE_BYTES,
                                  **kw))




@dataclass
class Ctx:
    server: ServerThread
    path: str
    llm: LLM  # offline reference on the same checkpoint

    def ref(self, prompt: Any, params: SamplingParams) -> Any:
        return self.llm.generate([prompt], params, use_tqdm=False)[0]

    def ref_chat(self, messages: list[dict[str, str]], params: SamplingParams) -> Any:
        return self.llm.chat(messages, params, use_tqdm=False)[0]


@pytest.fixture(scope="module")
def ctx(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ctx]:
    path = write_tiny_checkpoint(str(tmp_path_factory.mktemp("srv") / MODEL_NAME))
    llm = LLM(model=path, device="cpu", dtype="float32", cpu_cache_memory_bytes=CACHE_BYTES)
    with ServerThread(AsyncEngine(_engine(path), start=False)) as server:
        yield Ctx(server, path, llm)


def _greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


# ---------------------------------------------------------------------------------------------------- basics


def test_models_health_version(ctx: Ctx) -> None:
    models = ctx.server.client().models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    r = httpx.get(ctx.server.url + "/health")
    assert r.status_code == 200
    assert httpx.get(ctx.server.url + "/version").json() == {"version": hyserve.__version__}


def test_completion_matches_offline_engine(ctx: Ctx) -> None:
    client = ctx.server.client()
    for prompt in PROMPTS[:3]:
        ref = ctx.ref(prompt, _greedy(12))
        resp = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True})
        choice = resp.choices[0]
        assert choice.text == ref.outputs[0].text
        assert choice.finish_reason == "length"
        assert resp.model == MODEL_NAME and resp.object == "text_completion"
        assert resp.usage is not None
        assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert resp.usage.completion_tokens == 12
        assert resp.usage.total_tokens == len(ref.prompt_token_ids) + 12


def test_completion_default_max_tokens_is_16(ctx: Ctx) -> None:
    resp = ctx.server.client().completions.create(model=MODEL_NAME, prompt=PROMPTS[0], temperature=0,
                                                  extra_body={"ignore_eos": True})
    assert resp.usage is not None and resp.usage.completion_tokens == 16


def test_token_id_prompts(ctx: Ctx) -> None:
    client = ctx.server.client()
    ids = ctx.llm.get_tokenizer().encode(PROMPTS[1])
    ref = ctx.ref({"prompt_token_ids": ids}, _greedy(10))
    for prompt in (ids, [ids], [PROMPTS[1]]):
        resp = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=10, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert resp.choices[0].text == ref.outputs[0].text
        assert resp.usage is not None and resp.usage.prompt_tokens == len(ids)


def test_chat_matches_offline_engine(ctx: Ctx) -> None:
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is Paris?"}]
    ref = ctx.ref_chat(messages, _greedy(10))
    resp = ctx.server.client().chat.completions.create(model=MODEL_NAME, messages=messages,  # type: ignore[arg-type]
                                                       max_tokens=10, temperature=0,
                                                       extra_body={"ignore_eos": True})
    assert resp.object == "chat.completion"
    msg = resp.choices[0].message
    assert msg.role == "assistant" and msg.content == ref.outputs[0].text
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == 10


def test_chat_default_max_tokens_is_the_room_left(ctx: Ctx) -> None:
    # No max_tokens: generation may run to the end of the context; with a short max_model_len server that shows.
    path = ctx.path
    with ServerThread(AsyncEngine(_engine(path, max_model_len=40), start=False)) as srv:
        resp = srv.client().chat.completions.create(model=MODEL_NAME, temperature=0,
                                                    messages=[{"role": "user", "content": "hi"}],
                                                    extra_body={"ignore_eos": True})
        assert resp.usage is not None
        assert resp.usage.total_tokens == 40
        assert resp.choices[0].finish_reason == "length"
        srv.settle()


# ---------------------------------------------------------------------------------------------------- streaming


def _stream_completion(client: openai.OpenAI, **kw: Any) -> tuple[str, str | None, Any, int]:
    text, reason, usage, chunks = "", None, None, 0
    for chunk in client.completions.create(model=MODEL_NAME, stream=True, **kw):
        chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.text
            if c.finish_reason is not None:
                assert reason is None
                reason = c.finish_reason
    return text, reason, usage, chunks


def _stream_chat(client: openai.OpenAI, **kw: Any) -> tuple[str, str | None, Any, list[Any]]:
    text, reason, usage, logprobs = "", None, None, []
    roles = []
    for chunk in client.chat.completions.create(model=MODEL_NAME, stream=True, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.delta.role)
            text += c.delta.content or ""
            if c.logprobs is not None and c.logprobs.content:
                logprobs += c.logprobs.content
            if c.finish_reason is not None:
                assert reason is None
                reason = c.finish_reason
    assert roles == ["assistant"]
    return text, reason, usage, logprobs


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "top_p": 0.9, "seed": 1234}])
def test_streaming_equals_non_streaming(ctx: Ctx, sampling: dict[str, Any]) -> None:
    client = ctx.server.client()
    kw: dict[str, Any] = {"prompt": PROMPTS[2], "max_tokens": 20, "extra_body": {"ignore_eos": True}, **sampling}
    full = client.completions.create(model=MODEL_NAME, **kw)
    text, reason, usage, chunks = _stream_completion(client, stream_options={"include_usage": True}, **kw)
    assert text == full.choices[0].text
    assert reason == full.choices[0].finish_reason == "length"
    assert chunks > 2  # incremental, not one blob
    assert usage is not None and full.usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == \
        (full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens)

    messages = [{"role": "user", "content": PROMPTS[3]}]
    ckw: dict[str, Any] = {"messages": messages, "max_tokens": 20, "extra_body": {"ignore_eos": True}, **sampling}
    cfull = client.chat.completions.create(model=MODEL_NAME, **ckw)
    ctext, creason, cusage, _ = _stream_chat(client, stream_options={"include_usage": True}, **ckw)
    assert ctext == cfull.choices[0].message.content
    assert creason == cfull.choices[0].finish_reason == "length"
    assert cusage is not None and cfull.usage is not None
    assert cusage.completion_tokens == cfull.usage.completion_tokens == 20


def test_stream_without_usage_has_no_usage_field(ctx: Ctx) -> None:
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", ctx.server.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


# ---------------------------------------------------------------------------------------------------- concurrency


def test_concurrent_clients_match_solo_outputs(ctx: Ctx) -> None:
    client = ctx.server.client()
    n_tokens = 24
    solo = {}
    for p in PROMPTS:
        r = client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=n_tokens, temperature=0,
                                      extra_body={"ignore_eos": True})
        solo[p] = r.choices[0].text
    before = ctx.server.metrics()
    barrier = threading.Barrier(len(PROMPTS))
    results: dict[str, str] = {}
    errors: list[BaseException] = []

    def worker(prompt: str, stream: bool) -> None:
        try:
            c = ctx.server.client()
            barrier.wait()
            if stream:
                text, _, _, _ = _stream_completion(c, prompt=prompt, max_tokens=n_tokens, temperature=0,
                                                   extra_body={"ignore_eos": True})
            else:
                r = c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=n_tokens, temperature=0,
                                         extra_body={"ignore_eos": True})
                text = r.choices[0].text
            results[prompt] = text
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(p, i % 2 == 0)) for i, p in enumerate(PROMPTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert results == solo
    after = ctx.server.metrics()
    generated = after["hyserve:generation_tokens"] - before["hyserve:generation_tokens"]
    steps = after["hyserve:num_steps"] - before["hyserve:num_steps"]
    assert generated == len(PROMPTS) * n_tokens
    assert steps < generated  # the requests shared steps: the engine batched them
    ctx.server.settle()


# ---------------------------------------------------------------------------------------------------- features


def test_completion_logprobs(ctx: Ctx) -> None:
    client = ctx.server.client()
    ref = ctx.ref(PROMPTS[0], _greedy(8, logprobs=3))
    resp = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=3,
                                     extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    ref_out = ref.outputs[0]
    assert ref_out.logprobs is not None
    for i, tid in enumerate(ref_out.token_ids):
        expected = ref_out.logprobs[i][tid]
        assert lp.tokens[i] == expected.decoded_token
        assert lp.token_logprobs[i] == pytest.approx(expected.logprob, abs=1e-5)
        top = lp.top_logprobs[i]
        assert len(top) >= 3 or len(set(t.decoded_token for t in ref_out.logprobs[i].values())) < 3
        assert max(top.values()) == pytest.approx(lp.token_logprobs[i], abs=1e-5)  # greedy: the top token
        assert all(v <= 0 for v in top.values())
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0

    streamed: list[float] = []
    for chunk in client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                           logprobs=3, stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.token_logprobs or []
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-6)


def test_chat_logprobs(ctx: Ctx) -> None:
    client = ctx.server.client()
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    resp = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6,  # type: ignore[arg-type]
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    content = resp.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 6
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-6)  # greedy
        assert item.bytes == list(item.token.encode("utf-8"))
    _, _, _, streamed = _stream_chat(client, messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                     top_logprobs=2, extra_body={"ignore_eos": True})
    assert [x.logprob for x in streamed] == pytest.approx([x.logprob for x in content], abs=1e-6)
    plain = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2)  # type: ignore[arg-type]
    assert plain.choices[0].logprobs is None


def test_stop_strings_and_stop_token_ids(ctx: Ctx) -> None:
    client = ctx.server.client()
    prompt = PROMPTS[4]
    ref = ctx.ref(prompt, _greedy(24)).outputs[0]
    full = ref.text
    # A stop string taken from the middle of the greedy text, cut at its first occurrence.
    stop = next(full[i:i + 3] for i in range(4, len(full) - 3) if full[i:i + 3].strip() and "\ufffd" not in
                full[i:i + 3])
    cut = full.find(stop)
    assert cut > 0
    kw: dict[str, Any] = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "stop": [stop, "\x00never"],
                          "extra_body": {"ignore_eos": True}}
    resp = client.completions.create(model=MODEL_NAME, **kw)
    assert resp.choices[0].text == full[:cut]
    assert resp.choices[0].finish_reason == "stop"
    text, reason, _, _ = _stream_completion(client, **kw)
    assert (text, reason) == (full[:cut], "stop")  # the held-back tail never leaks the stop string

    stop_id = ref.token_ids[5]
    first = ref.token_ids.index(stop_id)
    resp = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]})
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage is not None and resp.usage.completion_tokens == first + 1


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_stop_string_over_several_tokens_reaches_a_slow_reader_cut(ctx: Ctx, async_scheduling: bool) -> None:
    """A stop string that takes several tokens (so several steps and SSE chunks) to complete, read by a client that
    sleeps between chunks while the engine runs ahead (with async scheduling, one step past the stop): the chunks
    add up to the text before the stop, and no chunk carries any of it."""
    prompt = PROMPTS[5]
    ref = ctx.ref(prompt, _greedy(30)).outputs[0]
    full, ids = ref.text, ref.token_ids
    ends = [len(ctx.llm.llm_engine.tokenizer.decode(ids[:n])) for n in range(len(ids) + 1)]  # type: ignore[union-attr]
    # From the middle of token a's text to the middle of token a + 3's: it completes three tokens after it starts.
    spans = [((ends[a] + ends[a + 1]) // 2, (ends[a + 3] + ends[a + 4]) // 2) for a in range(3, len(ids) - 4)]
    start, stop_end = next((b, e) for b, e in spans if full[b:e].strip() and "\ufffd" not in full[b:e]
                           and full.find(full[b:e]) == b and e - b >= 4)
    stop = full[start:stop_end]
    with ServerThread(AsyncEngine(_engine(ctx.path, async_scheduling=async_scheduling), start=False)) as srv:
        client = srv.client()
        chunks: list[str] = []
        reason = None
        for chunk in client.completions.create(model=MODEL_NAME, stream=True, prompt=prompt, max_tokens=30,
                                               temperature=0, stop=[stop], extra_body={"ignore_eos": True}):
            time.sleep(0.05)  # a slow reader: the engine produces the next tokens meanwhile
            for c in chunk.choices:
                chunks.append(c.text)
                reason = c.finish_reason or reason
        srv.settle()
    assert "".join(chunks) == full[:start] and reason == "stop"
    assert len(chunks) >= 2  # the text came in pieces (a loaded machine may coalesce the deltas behind a slow reader)


def test_token_id_extras(ctx: Ctx) -> None:
    """vLLM's return_token_ids / return_tokens_as_token_ids, for clients that work in token ids."""
    ids = ctx.llm.get_tokenizer().encode(PROMPTS[3])
    ref = ctx.ref({"prompt_token_ids": ids}, _greedy(9, logprobs=2)).outputs[0]
    body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": 9, "temperature": 0, "ignore_eos": True,
            "logprobs": 2, "return_token_ids": True, "return_tokens_as_token_ids": True}
    choice = httpx.post(ctx.server.url + "/v1/completions", json=body, timeout=30).json()["choices"][0]
    assert choice["token_ids"] == ref.token_ids
    assert choice["prompt_token_ids"] == ids
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in ref.token_ids]
    assert all(all(k.startswith("token_id:") for k in top) for top in choice["logprobs"]["top_logprobs"])

    streamed: list[int] = []
    prompt_ids = None
    with httpx.stream("POST", ctx.server.url + "/v1/completions", json={**body, "stream": True, "logprobs": None},
                      timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    streamed += c["token_ids"]
                    prompt_ids = c.get("prompt_token_ids", prompt_ids)
    assert streamed == ref.token_ids and prompt_ids == ids

    chat = httpx.post(ctx.server.url + "/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "return_token_ids": True}).json()
    assert len(chat["choices"][0]["token_ids"]) == chat["usage"]["completion_tokens"]
    assert len(chat["prompt_token_ids"]) == chat["usage"]["prompt_tokens"]
    plain = httpx.post(ctx.server.url + "/v1/completions", json={"prompt": ids, "max_tokens": 2}, timeout=30).json()
    assert "token_ids" not in plain["choices"][0]  # only when asked for


def test_seeded_sampling_is_reproducible(ctx: Ctx) -> None:
    client = ctx.server.client()
    kw: dict[str, Any] = {"prompt": PROMPTS[5], "max_tokens": 12, "temperature": 1.0, "seed": 7,
                          "extra_body": {"top_k": 20, "min_p": 0.01, "ignore_eos": True}}
    a = client.completions.create(model=MODEL_NAME, **kw).choices[0].text
    b = client.completions.create(model=MODEL_NAME, **kw).choices[0].text
    assert a == b
    ref = ctx.ref(PROMPTS[5], SamplingParams(temperature=1.0, seed=7, top_k=20, min_p=0.01, max_tokens=12,
                                             ignore_eos=True))
    assert a == ref.outputs[0].text


# ---------------------------------------------------------------------------------------------------- bad input


def _too_long(n: int) -> list[int]:
    return [5] * n


BAD_COMPLETIONS: list[tuple[Any, int, str | None, str]] = [
    ({"prompt": "hi", "max_tokens": "16"}, 400, "max_tokens", "integer"),
    ({"prompt": "hi", "max_tokens": 1.5}, 400, "max_tokens", "integer"),
    ({"prompt": "hi", "max_tokens": -1}, 400, "max_tokens", "max_tokens must be at least 1"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "at least 1"),
    ({"prompt": "hi", "temperature": -0.5}, 400, "temperature", "temperature must be >= 0"),
    ({"prompt": "hi", "temperature": True}, 400, "temperature", "number"),
    ({"prompt": "hi", "top_p": 1.5}, 400, "top_p", "top_p"),
    ({"prompt": "hi", "top_k": -2}, 400, "top_k", "top_k"),
    ({"prompt": "hi", "min_p": 2}, 400, "min_p", "min_p"),
    ({"prompt": "hi", "seed": "x"}, 400, "seed", "integer"),
    ({"prompt": "hi", "n": 0}, 400, "n", "n must be in [1, 128]"),
    ({"prompt": "hi", "best_of": 3}, 400, "best_of", "best_of=3 is not supported"),
    ({"prompt": "hi", "stop": [""]}, 400, "stop", "empty"),
    ({"prompt": "hi", "stop": 5}, 400, "stop", "stop"),
    ({"prompt": "hi", "stop_token_ids": [-1]}, 400, "stop_token_ids", "stop_token_ids"),
    ({"prompt": "hi", "stop_token_ids": [1, "a"]}, 400, "stop_token_ids[1]", "integer"),
    ({"prompt": "hi", "logprobs": 50}, 400, "logprobs", "logprobs"),
    ({"prompt": "hi", "logprobs": -1}, 400, "logprobs", "logprobs"),
    ({"prompt": "hi", "min_tokens": 5, "max_tokens": 2}, 400, "min_tokens", "min_tokens"),
    ({"prompt": "hi", "stream": "yes"}, 400, "stream", "boolean"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
    ({"prompt": "hi", "stream": True, "stream_options": {"include_usage": 1}}, 400, "stream_options.include_usage",
     "boolean"),
    ({"prompt": "hi", "frequency_penalty": 2.5}, 400, "frequency_penalty", "[-2, 2]"),
    ({"prompt": "hi", "logit_bias": {"99999": 1.0}}, 400, "logit_bias", "outside the vocabulary"),
    ({"prompt": "hi", "suffix": "x"}, 400, "suffix", "suffix"),
    ({"max_tokens": 3}, 400, "prompt", "prompt is required"),
    ({"prompt": 5}, 400, "prompt", "prompt must be"),
    ({"prompt": ""}, 400, "prompt", "empty"),
    ({"prompt": []}, 400, "prompt", "empty"),
    ({"prompt": ["a", [3, 4]]}, 400, "prompt", "mixes strings and token-id lists"),
    ({"prompt": ["a", ""]}, 400, "prompt[1]", "prompt[1] must not be empty"),
    ({"prompt": [1, "a"]}, 400, "prompt", "prompt must be"),
    ({"prompt": [1, True]}, 400, "prompt", "prompt must be"),
    ({"prompt": [99999]}, 400, "prompt", "outside the vocabulary"),
    ({"prompt": _too_long(5000)}, 400, "prompt", "5000 tokens, but max_model_len is 4096"),
    ({"prompt": _too_long(4000), "max_tokens": 200}, 400, "max_tokens", "4000 tokens and max_model_len is 4096"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model", "gpt-4"),
]

BAD_CHATS: list[tuple[Any, int, str | None, str]] = [
    ({}, 400, "messages", "messages is required"),
    ({"messages": []}, 400, "messages", "empty"),
    ({"messages": "hi"}, 400, "messages", "list"),
    ({"messages": ["hi"]}, 400, "messages[0]", "object"),
    ({"messages": [{"role": "user"}]}, 400, "messages[0].content", "missing"),
    ({"messages": [{"content": "hi"}]}, 400, "messages[0].role", "role must be one of"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role", "wizard"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "string"),
    ({"messages": [{"role": "user", "content": None}]}, 400, "messages[0].content", "null"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content[0]", "text"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs", "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 30}, 400, "top_logprobs",
     "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": 3}, 400, "logprobs", "boolean"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -1}, 400, "max_completion_tokens",
     "at least 1"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}, 400, "max_tokens", "max_model_len"),
    ({"messages": [{"role": "user", "content": "a " * 5000}]}, 400, "messages", "max_model_len is 4096"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 129}, 400, "n", "n must be in [1, 128]"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "tool_choice", "tool_choice: 'none'"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}], "tool_choice": "none"}, 400,
     "tools[0]", "function"),
    ({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"tokenize": True}}, 400,
     "chat_template_kwargs", "tokenize"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "nope"}, 404, "model", "nope"),
]


def _check_error(r: httpx.Response, status: int, param: str | None, needle: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert needle in err["message"], err
    if status < 500:
        assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(("body", "status", "param", "needle"), BAD_COMPLETIONS,
                         ids=[f"c{i}-{b[2]}" for i, b in enumerate(BAD_COMPLETIONS)])
def test_bad_completion_requests(ctx: Ctx, body: Any, status: int, param: str | None, needle: str) -> None:
    r = httpx.post(ctx.server.url + "/v1/completions", json=body, timeout=30)
    _check_error(r, status, param, needle)


@pytest.mark.parametrize(("body", "status", "param", "needle"), BAD_CHATS,
                         ids=[f"chat{i}-{b[2]}" for i, b in enumerate(BAD_CHATS)])
def test_bad_chat_requests(ctx: Ctx, body: Any, status: int, param: str | None, needle: str) -> None:
    r = httpx.post(ctx.server.url + "/v1/chat/completions", json=body, timeout=30)
    _check_error(r, status, param, needle)


def test_malformed_bodies_and_routes(ctx: Ctx) -> None:
    url = ctx.server.url
    headers = {"content-type": "application/json"}
    r = httpx.post(url + "/v1/completions", content=b'{"prompt": "hi",', headers=headers)
    _check_error(r, 400, None, "not valid JSON")
    r = httpx.post(url + "/v1/chat/completions", content=b"[1, 2]", headers=headers)
    _check_error(r, 400, None, "JSON object")
    r = httpx.post(url + "/v1/completions", content=b"", headers=headers)
    _check_error(r, 400, None, "JSON object")
    r = httpx.post(url + "/v1/completions", content=b"prompt=hi",
                   headers={"content-type": "application/x-www-form-urlencoded"})
    _check_error(r, 400, None, "application/json")
    r = httpx.get(url + "/v1/nothing-here")
    _check_error(r, 404, None, "Not Found")
    r = httpx.get(url + "/v1/completions")
    _check_error(r, 405, None, "Method Not Allowed")
    # The openai client surfaces the error body.
    with pytest.raises(openai.BadRequestError) as info:
        ctx.server.client().completions.create(model=MODEL_NAME, prompt="hi", max_tokens=-3)
    assert "max_tokens" in str(info.value)
    with pytest.raises(openai.NotFoundError):
        ctx.server.client().completions.create(model="other", prompt="hi")
    assert httpx.get(url + "/health").status_code == 200
    ctx.server.settle()


# ---------------------------------------------------------------------------------------------------- disconnects


def test_client_disconnect_mid_stream_aborts_the_request(ctx: Ctx) -> None:
    before = ctx.server.metrics()
    body = {"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 3000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=30) as client, client.stream("POST", ctx.server.url + "/v1/completions",
                                                           json=body) as r:
        assert r.status_code == 200
        got = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                got += 1
                if got == 2:
                    break  # leave: closing the response closes the connection mid-stream
    assert httpx.get(ctx.server.url + "/health").status_code == 200
    ctx.server.settle()  # nothing running, every KV block and state slot back in the pools
    after = ctx.server.metrics()
    assert after["hyserve:request_aborted"] - before["hyserve:request_aborted"] == 1
    assert after["hyserve:generation_tokens"] - before["hyserve:generation_tokens"] < 3000
    # The server still answers normally.
    resp = ctx.server.client().completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=3)
    assert resp.usage is not None and resp.usage.completion_tokens <= 3


def test_client_disconnect_while_waiting_for_a_full_answer(ctx: Ctx) -> None:
    before = ctx.server.metrics()
    body = {"model": MODEL_NAME, "prompt": PROMPTS[1], "max_tokens": 3000, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(ctx.server.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    ctx.server.settle()
    after = ctx.server.metrics()
    assert after["hyserve:request_aborted"] - before["hyserve:request_aborted"] == 1
    assert after["hyserve:generation_tokens"] - before["hyserve:generation_tokens"] < 3000
    assert httpx.get(ctx.server.url + "/health").status_code == 200


# ---------------------------------------------------------------------------------------------------- metrics


def test_metrics(ctx: Ctx) -> None:
    client = ctx.server.client()
    ctx.server.settle()
    before = ctx.server.metrics()
    long_prompt = " ".join(PROMPTS)  # > 2 KV blocks: the second request hits the prefix cache
    n_prompt = 0
    n_generated = 0
    for max_tokens in (5, 7):
        r = client.completions.create(model=MODEL_NAME, prompt=long_prompt, max_tokens=max_tokens, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.usage is not None
        n_prompt += r.usage.prompt_tokens
        n_generated += r.usage.completion_tokens
    assert r.usage.prompt_tokens >= 32
    after = ctx.server.metrics()

    def delta(name: str) -> float:
        return after[name] - before[name]

    assert delta("hyserve:generation_tokens") == n_generated == 12
    assert delta("hyserve:prompt_tokens") == n_prompt
    assert delta("hyserve:num_requests") == 2
    assert delta("hyserve:request_success") == 2
    assert delta("hyserve:prefix_cache_queries") == n_prompt
    assert 16 <= delta("hyserve:prefix_cache_hits") < n_prompt / 2 + 1
    assert after["hyserve:spec_decode_num_drafts"] == 0  # speculative decoding is off on this server
    assert after["hyserve:num_requests_running"] == 0
    assert 0 <= after["hyserve:kv_cache_usage_perc"] <= 1
    assert delta('hyserve:http_requests_total{method="POST",path="/v1/completions",status="200"}') == 2
    assert after['hyserve:http_requests_total{method="GET",path="/metrics",status="200"}'] >= 1

    text = httpx.get(ctx.server.url + "/metrics").text
    assert "# TYPE hyserve:generation_tokens counter" in text
    assert "# TYPE hyserve:kv_cache_usage_perc gauge" in text
    for name in ("hyserve:generation_tokens", "hyserve:prefix_cache_queries", "hyserve:prefix_cache_hits",
                 "hyserve:spec_decode_num_drafts"):
        assert any(line.startswith(name + " ") for line in text.splitlines()), name


def test_speculative_server_metrics(ctx: Ctx) -> None:
    """A server with n-gram speculation: same greedy text, drafts counted, list metric labelled per position."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    prompt = "a b c a b c a b c a b c a b"
    ref = ctx.ref(prompt, _greedy(24)).outputs[0].text
    with ServerThread(AsyncEngine(_engine(ctx.path, speculative_config=spec), start=False), "spec-model") as srv:
        resp = srv.client().completions.create(model="spec-model", prompt=prompt, max_tokens=24, temperature=0,
                                               extra_body={"ignore_eos": True})
        assert resp.choices[0].text == ref
        m = srv.metrics()
        assert m["hyserve:spec_decode_num_drafts"] > 0
        assert m["hyserve:generation_tokens"] == 24
        assert m["hyserve:spec_decode_num_draft_tokens"] >= m["hyserve:spec_decode_num_accepted_tokens"]
        per_pos = {k: v for k, v in m.items() if k.startswith("hyserve:spec_decode_num_accepted_tokens_per_pos")}
        assert all('{position="' in k for k in per_pos)
        assert sum(per_pos.values()) == m["hyserve:spec_decode_num_accepted_tokens"]
        srv.settle()


# ---------------------------------------------------------------------------------------------------- failures


def test_error_finish_reason_is_reported_and_logged(ctx: Ctx, caplog: pytest.LogCaptureFixture) -> None:
    engine = _engine(ctx.path)
    real_step = engine.step

    def step() -> list[Any]:  # the engine ends a request with "error" (as it does on non-finite logits)
        outs = real_step()
        for out in outs:
            # The request's own count: a streamed request's outputs are DELTA (only the step's new tokens).
            req = engine.requests.get(out.request_id)
            if req is not None and req.num_output_tokens >= 3 and not out.finished:
                engine.abort_request(out.request_id)
                out.outputs[0].finish_reason = "error"
                out.finished = True
        return outs

    engine.step = step  # type: ignore[method-assign]
    with ServerThread(AsyncEngine(engine, start=False)) as srv, caplog.at_level(logging.ERROR, "hyserve.server"):
        resp = srv.client().completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=10,
                                               extra_body={"ignore_eos": True})
        assert resp.choices[0].finish_reason == "error"
        assert resp.usage is not None and resp.usage.completion_tokens == 3
        _, reason, _, _ = _stream_chat(srv.client(), messages=[{"role": "user", "content": "hi"}], max_tokens=10,
                                       extra_body={"ignore_eos": True})
        assert reason == "error"
        srv.settle()
    assert sum("finished with an error" in rec.getMessage() for rec in caplog.records) == 2


def test_engine_failure_gives_503_not_a_crash(ctx: Ctx) -> None:
    engine = _engine(ctx.path)

    def step() -> list[Any]:
        raise RuntimeError("boom")

    engine.step = step  # type: ignore[method-assign]
    with ServerThread(AsyncEngine(engine, start=False)) as srv:
        assert httpx.get(srv.url + "/health").status_code == 200
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        _check_error(r, 503, None, "boom")
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 503 and "boom" in r.json()["error"]["message"]
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "stream": True}, timeout=30)
        _check_error(r, 503, None, "boom")
        assert httpx.get(srv.url + "/metrics").status_code == 200


def test_async_engine_api(ctx: Ctx) -> None:
    """AsyncEngine without HTTP: duplicate ids, an abort from elsewhere, closing a generator, shutdown."""
    async_engine = AsyncEngine(_engine(ctx.path))
    params = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)

    async def scenario() -> None:
        # Outputs are cumulative, and the last one is finished.
        outs = [o async for o in async_engine.generate("a", "Hello", _greedy(5))]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 5
        assert all(len(x.outputs[0].token_ids) <= len(y.outputs[0].token_ids) for x, y in itertools.pairwise(outs))
        # A duplicate id is refused while the first request runs.
        gen = async_engine.generate("b", "Hello", params)
        first = await gen.__anext__()
        assert not first.finished
        with pytest.raises(ValueError, match="already in use"):
            async_engine.add_request("b", "Hello", params)
        # Closing the generator aborts the request.
        await gen.aclose()
        # An abort from elsewhere wakes the consumer with RequestAbortedError.
        gen2 = async_engine.generate("c", "Hello", params)
        await gen2.__anext__()
        async_engine.abort("c")
        with pytest.raises(RequestAbortedError):
            async for _ in gen2:
                pass
        with pytest.raises(ValueError, match="max_model_len"):
            async_engine.add_request("d", [7] * 5000, params)

    asyncio.run(scenario())
    assert async_engine.wait_until_idle(10)
    async_engine.assert_no_leaks()
    assert async_engine.get_metrics()["hyserve:request_aborted"] == 2

    async def pending_then_shutdown() -> None:
        gen = async_engine.generate("e", "Hello", params)
        await gen.__anext__()
        await asyncio.to_thread(async_engine.shutdown)
        with pytest.raises(EngineDeadError):
            async for _ in gen:
                pass
        with pytest.raises(EngineDeadError):
            async_engine.add_request("f", "Hello", params)

    asyncio.run(pending_then_shutdown())
    assert not async_engine.is_alive()
    async_engine.assert_no_leaks()


# ---------------------------------------------------------------------------------------------------- CLI


def test_serve_cli(ctx: Ctx, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("MODEL_DIR", "--host", "--port", "--served-model-name", "--max-model-len", "--device", "--dtype",
                 "--enable-prefix-caching", "--speculative-config", "--max-num-seqs", "--gpu-memory-utilization",
                 "--max-num-batched-tokens", "--block-size", "--seed", "--api-key", "--shutdown-timeout",
                 "--max-request-body-bytes", "--request-read-timeout", "--timeout-keep-alive", "--limit-concurrency",
                 "--trust-request-chat-template", "--chat-template-timeout", "HYSERVE_API_KEY"):
        assert flag in out, flag
    args = build_parser().parse_args(["serve"])
    assert args.model is None and args.host == "127.0.0.1" and args.port == 8000

    def no_default() -> str:
        raise ValueError("no default model")

    monkeypatch.setattr(hyserve.llm, "default_model_dir", no_default)
    assert main(["serve"]) == 2
    assert "MODEL_DIR" in capsys.readouterr().err

    # With a model: the engine is built from the flags and the app handed to uvicorn.
    seen: dict[str, Any] = {}
    monkeypatch.setattr(GracefulServer, "run", lambda self, sockets=None: seen.update(server=self))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # free now (serve checks that the port is free before loading the model)
    assert main(["serve", ctx.path, "--device", "cpu", "--dtype", "float32", "--port", str(port), "--max-model-len",
                 "64", "--served-model-name", "m1"]) == 0
    config = seen["server"].config
    assert (config.host, config.port) == ("127.0.0.1", port)
    assert config.app.state.served_model_name == "m1"
    assert config.app.state.engine.max_model_len == 64
    # The server's bounds, and the API key from the environment.
    assert (config.timeout_keep_alive, config.limit_concurrency, seen["server"].shutdown_timeout_s) == (5, 1024, 5.0)
    assert not any(m.cls is APIKeyMiddleware for m in config.app.user_middleware)
    monkeypatch.setenv("HYSERVE_API_KEY", "from-env")
    assert main(["serve", ctx.path, "--device", "cpu", "--dtype", "float32", "--max-model-len", "64",
                 "--port", str(port), "--shutdown-timeout", "1.5", "--limit-concurrency", "7",
                 "--max-request-body-bytes", "999"]) == 0
    app = seen["server"].config.app
    keys = [m.kwargs["api_key"] for m in app.user_middleware if m.cls is APIKeyMiddleware]
    assert keys == ["from-env"]
    assert [m.kwargs["max_bytes"] for m in app.user_middleware if m.cls is BodyLimitMiddleware] == [999]
    assert (seen["server"].shutdown_timeout_s, seen["server"].config.limit_concurrency) == (1.5, 7)
    assert main(["serve", ctx.path, "--device", "cpu", "--dtype", "float32", "--max-model-len", "64",
                 "--port", str(port), "--api-key", "from-flag"]) == 0
    app = seen["server"].config.app
    assert [m.kwargs["api_key"] for m in app.user_middleware if m.cls is APIKeyMiddleware] == ["from-flag"]


def test_served_model_name_idle_loop_and_shutdown(ctx: Ctx) -> None:
    engine = _engine(ctx.path)
    calls = [0]
    real_step = engine.step

    def step() -> list[Any]:
        calls[0] += 1
        return real_step()

    engine.step = step  # type: ignore[method-assign]
    async_engine = AsyncEngine(engine, start=False)
    with ServerThread(async_engine, "custom-name") as srv:
        assert [m.id for m in srv.client().models.list().data] == ["custom-name"]
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "hi"})
        _check_error(r, 404, "model", "custom-name")
        assert srv.client().completions.create(model="custom-name", prompt="hi", max_tokens=2).choices
        srv.settle()
        n = calls[0]
        assert 1 <= n <= 3
        time.sleep(0.3)
        assert calls[0] == n  # idle: the loop sleeps, it does not spin on empty steps
    assert not async_engine.is_alive()  # the app's shutdown stopped the loop thread
    async_engine.assert_no_leaks()

"""Image chat requests served end to end: the official ``openai`` client sends a base64 PNG data URL in a chat
message to a real server on a tiny ``Qwen3_5ForConditionalGeneration`` checkpoint (``write_tiny_vlm_checkpoint``).

Checked: a 200 with text, streamed and not (the same text, and the same as offline ``LLM.chat``), and
``usage.prompt_tokens`` counting each image's expanded placeholder tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from hyserve import LLM, SamplingParams
from hyserve.config import EngineConfig
from hyserve.engine.llm_engine import LLMEngine
from hyserve.multimodal.chat import image_token_count
from hyserve.multimodal.image import ImageProcessorSettings
from hyserve.server import AsyncEngine, build_app
from hyserve.testing import png_data_url, tiny_png, write_tiny_vlm_checkpoint
from hyserve.testing.server import ServerThread

CACHE_BYTES = 64 * 1024 * 1024
MODEL = "tiny-vlm"
QUESTION = "What is in this picture?"
WIDTH, HEIGHT = 32, 48  # an 8x12 patch grid on the tiny checkpoint: 24 placeholder tokens


@dataclass
class Ctx:
    server: ServerThread
    path: str
    media: Path
    llm: LLM


def _engine(path: str, **kw: Any) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", cpu_cache_memory_bytes=CACHE_BYTES,
                                  **kw))


@pytest.fixture(scope="module")
def ctx(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ctx]:
    path = write_tiny_vlm_checkpoint(str(tmp_path_factory.mktemp("vlm") / MODEL))
    media = tmp_path_factory.mktemp("media")
    llm = LLM(model=path, device="cpu", dtype="float32", cpu_cache_memory_bytes=CACHE_BYTES)
    async_engine = AsyncEngine(_engine(path, allowed_local_media_path=str(media)), start=False)
    with ServerThread(async_engine, app=build_app(async_engine, MODEL)) as server:
        yield Ctx(server, path, media, llm)


def image_message(url: str, question: str = QUESTION) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": question}]}]


def text_prompt_tokens(ctx: Ctx, messages: list[dict[str, Any]]) -> int:
    """Tokens of the rendered chat prompt before any placeholder is widened."""
    tok = ctx.llm.get_tokenizer()
    parts = messages[0]["content"]
    template = [{"role": "user", "content": [{"type": "image"} if p["type"] == "image_url" else p for p in parts]}]
    return len(tok.encode(tok.apply_chat_template(template), add_special_tokens=False))


def image_tokens(ctx: Ctx, width: int, height: int) -> int:
    return image_token_count((width, height), ImageProcessorSettings.from_checkpoint(ctx.path))


def test_image_chat_non_streaming_and_streaming(ctx: Ctx) -> None:
    url = png_data_url(tiny_png(WIDTH, HEIGHT, seed=1))
    messages = image_message(url)
    client = ctx.server.client()
    resp = client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                          max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    text = resp.choices[0].message.content
    assert isinstance(text, str) and text
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage is not None and resp.usage.completion_tokens == 8
    n_image = image_tokens(ctx, WIDTH, HEIGHT)
    assert n_image == 24
    n_text = text_prompt_tokens(ctx, messages)  # holds one <|image_pad|>
    assert resp.usage.prompt_tokens == n_text - 1 + n_image
    plain = client.chat.completions.create(model=MODEL, max_tokens=1, temperature=0,
                                           messages=[{"role": "user", "content": QUESTION}])
    assert plain.usage is not None and resp.usage.prompt_tokens > plain.usage.prompt_tokens + n_image

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages,  # type: ignore[call-overload]
                                                 max_tokens=8, temperature=0, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens == resp.usage.prompt_tokens

    ref = ctx.llm.chat(messages, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert ref.outputs[0].text == text
    assert len(ref.prompt_token_ids) == resp.usage.prompt_tokens
    ctx.server.settle()


def test_two_images_and_a_local_file(ctx: Ctx) -> None:
    (ctx.media / "b.png").write_bytes(tiny_png(16, 16, seed=3))
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "Compare"}, {"type": "image_url", "image_url": {"url": png_data_url(
            tiny_png(WIDTH, HEIGHT, seed=2))}},
        {"type": "text", "text": "with"}, {"type": "image_url", "image_url": (ctx.media / "b.png").as_uri()}]}]
    resp = ctx.server.client().chat.completions.create(model=MODEL, messages=messages,  # type: ignore[arg-type]
                                                       max_tokens=4, temperature=0)
    assert resp.usage is not None
    tok = ctx.llm.get_tokenizer()
    template = [{"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image"},
                                             {"type": "text", "text": "with"}, {"type": "image"}]}]
    n_text = len(tok.encode(tok.apply_chat_template(template), add_special_tokens=False))
    assert resp.usage.prompt_tokens == n_text - 2 + image_tokens(ctx, WIDTH, HEIGHT) + image_tokens(ctx, 16, 16)
    ctx.server.settle()


def test_max_tokens_counts_the_image_tokens(ctx: Ctx) -> None:
    async_engine = AsyncEngine(_engine(ctx.path, max_model_len=64), start=False)
    with ServerThread(async_engine, app=build_app(async_engine, MODEL)) as srv:
        messages = image_message(png_data_url(tiny_png(WIDTH, HEIGHT, seed=1)))
        n_prompt = text_prompt_tokens(ctx, messages) - 1 + image_tokens(ctx, WIDTH, HEIGHT)
        room = 64 - n_prompt
        assert 0 < room < 64 - text_prompt_tokens(ctx, messages)
        body = {"model": MODEL, "messages": messages, "max_tokens": room + 1}
        r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "max_tokens" and f"the prompt has {n_prompt} tokens" in err["message"]
        r = httpx.post(srv.url + "/v1/chat/completions", json={**body, "max_tokens": room, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"] == {**r.json()["usage"], "prompt_tokens": n_prompt, "completion_tokens": room}
        srv.settle()


def test_async_generate_processes_images_off_the_loop_thread(ctx: Ctx, monkeypatch: pytest.MonkeyPatch) -> None:
    """``AsyncEngine.generate`` with ``multi_modal_data`` processes the images in a worker thread: while one
    request's image is held in its processing, another request runs to its end (the loop thread processing it would
    stall every request for as long), and the held request then gives what ``LLM.generate`` gives."""
    import asyncio
    import threading

    engine = _engine(ctx.path)
    entered, release = threading.Event(), threading.Event()
    threads: list[str] = []
    real = engine.prepare_images

    def held(ids: list[int], images: list[Any]) -> Any:
        threads.append(threading.current_thread().name)
        entered.set()
        assert release.wait(60), "never released"
        return real(ids, images)

    monkeypatch.setattr(engine, "prepare_images", held)
    tok = ctx.llm.get_tokenizer()
    prompt = {"prompt": "<|vision_start|><|image_pad|><|vision_end|>" + QUESTION,
              "multi_modal_data": {"image": tiny_png(WIDTH, HEIGHT, seed=5)}}
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    async_engine = AsyncEngine(engine)

    async def last(request_id: str, p: dict[str, Any]) -> Any:
        out = None
        async for out in async_engine.generate(request_id, p, params):
            pass
        return out

    async def scenario() -> tuple[Any, Any, bool]:
        held_task = asyncio.create_task(last("image", prompt))
        assert await asyncio.to_thread(entered.wait, 30)
        text = await asyncio.wait_for(last("text", {"prompt_token_ids": tok.encode(QUESTION)}), 30)
        still_held = not held_task.done()
        release.set()
        return text, await asyncio.wait_for(held_task, 60), still_held

    try:
        text, image, still_held = asyncio.run(scenario())
        assert text.finished and len(text.outputs[0].token_ids) == 4
        assert still_held  # the text request ended while the image request's pixels were being processed
        assert threads and "hyserve-engine-loop" not in threads
        ref = ctx.llm.generate([prompt], params, use_tqdm=False)[0]
        assert image.prompt_token_ids == ref.prompt_token_ids
        assert image.outputs[0].token_ids == ref.outputs[0].token_ids

        async def bad() -> Any:  # a refused image raises from generate, before anything is queued
            return await last("bad", {**prompt, "multi_modal_data": {"image": b"\x89PNG but not really"}})

        release.set()
        with pytest.raises(ValueError, match="image"):
            asyncio.run(bad())
        assert async_engine.is_alive() and async_engine.num_open_requests() == 0
    finally:
        release.set()
        async_engine.shutdown()

"""The ``qwen3`` reasoning parser: ``<think>...</think>`` split into ``reasoning_content`` and ``content``, whole and
streamed at every chunking, with Qwen3.5's ``<think>`` in the prompt, thinking turned off, a tool call that ends the
thinking, and output cut short; then end to end with the ``openai`` client on a scripted tiny checkpoint
(``hyserve.testing.scripted``), composed with the ``qwen3_coder`` tool parser.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from hyserve.server.chat_output import ChatDeltaStream, ChatOutputParser
from hyserve.server.reasoning import Qwen3ReasoningParser, ReasoningSplit, prompt_ends_reasoning
from hyserve.server.tool_parsers import tool_parser_class
from hyserve.testing.scripted import ScriptedModel, scripted_server
from hyserve.testing.server import ServerThread

TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}, "offset": {"type": "integer"}}}}}]
CALL = "<tool_call>\n<function=get_time>\n<parameter=offset>\n2\n</parameter>\n</function>\n</tool_call>"

SPLITS = [  # (output, thinking, reasoning, content)
    ("Let me think.\n</think>\n\nParis.", True, "Let me think.\n", "\n\nParis."),  # Qwen3.5: <think> in the prompt
    ("<think>\nHmm.\n</think>\n\nParis.", True, "\nHmm.\n", "\n\nParis."),  # an older template: the model opens it
    ("Still thinking when cut", True, "Still thinking when cut", ""),  # cut short: all reasoning
    ("Paris.", False, "", "Paris."),  # thinking off: all content
    ("Plan: call it.\n" + CALL, True, "Plan: call it.\n", CALL),  # a tool call ends the thinking
    ("I might write <tool_call> later", True, "I might write <tool_call> later", ""),  # not a call: reasoning
    ("a</think>b</think>c", True, "a", "b</think>c"),
    ("x <tool_call>\n<functio", True, "x <tool_call>\n<functio", ""),  # cut before the call is sure
    ("", True, "", ""),
]


def test_whole_splits() -> None:
    for text, thinking, reasoning, content in SPLITS:
        assert Qwen3ReasoningParser(thinking).split(text) == ReasoningSplit(reasoning, content), text


def test_prompt_ends_reasoning() -> None:
    assert prompt_ends_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_ends_reasoning("<|im_start|>assistant\n<think>\n")


def chunkings(text: str, rng: random.Random) -> Iterator[list[str]]:
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield [*text, ""]
    for _ in range(20):
        cuts = sorted(rng.randint(0, len(text)) for _ in range(rng.randint(2, 8)))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def streamed(parser: ChatOutputParser, chunks: list[str]) -> tuple[str, str, list[tuple[str, str]]]:
    s = ChatDeltaStream(parser)
    reasoning, content, calls = "", "", []
    for i, chunk in enumerate(chunks):
        delta = s.feed(chunk, final=i == len(chunks) - 1)
        if delta is None:
            continue
        reasoning += delta.reasoning_content or ""
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            if piece.index == len(calls):
                calls.append((piece.function.name or "", piece.function.arguments or ""))
            else:
                name, arguments = calls[piece.index]
                calls[piece.index] = (name, arguments + (piece.function.arguments or ""))
    return reasoning, content, calls


def check_stream(make: Any, text: str) -> None:
    rng = random.Random(0)
    whole = make().parse(text)
    for chunks in chunkings(text, rng):
        got = streamed(make(), chunks)
        assert got == (whole.reasoning, whole.content, [(c.name, c.arguments) for c in whole.calls]), chunks


@pytest.mark.parametrize(("text", "thinking"), [(s[0], s[1]) for s in SPLITS])
def test_streamed_split_equals_the_whole_at_every_chunking(text: str, thinking: bool) -> None:
    check_stream(lambda: ChatOutputParser(Qwen3ReasoningParser(thinking), None), text)


def test_reasoning_and_tool_calls_compose() -> None:
    def make() -> ChatOutputParser:
        return ChatOutputParser(Qwen3ReasoningParser(), tool_parser_class("qwen3_coder")(TOOLS))

    for text in ("Need the time.\n</think>\n\nOne moment.\n" + CALL, "Need the time.\n" + CALL,
                 "Thinking about <tool_call> tags\n</think>\n\n" + CALL):
        parsed = make().parse(text)
        assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("get_time", {"offset": 2})], text
        assert "<tool_call>\n<function" not in parsed.reasoning
        check_stream(make, text)
    # A call before </think> ends the thinking (the earlier of the two does): it is content, and parsed.
    parsed = make().parse("Plan.\n" + CALL + "\n</think>\n\ndone")
    assert parsed.reasoning == "Plan.\n" and len(parsed.calls) == 1


class SwallowsTheEnd(ChatOutputParser):
    """Sabotage: reasoning held back while the text may grow is never flushed at the end."""

    def parse(self, text: str, final: bool = True) -> Any:
        return super().parse(text, final=False)


def test_the_stream_check_catches_a_parser_that_never_flushes() -> None:
    for text in ("cut short <tool_call>\n<func", "thinking</thi", "a thought ending in </"):
        whole = ChatOutputParser(Qwen3ReasoningParser(), None).parse(text)
        with pytest.raises(AssertionError):
            got = streamed(SwallowsTheEnd(Qwen3ReasoningParser(), None), [text[:3], text[3:]])
            assert got == (whole.reasoning, whole.content, [])


def test_include_reasoning_false_drops_it() -> None:
    parsed = ChatOutputParser(Qwen3ReasoningParser(), None, include_reasoning=False).parse("hm</think>Paris")
    assert parsed.reasoning == "" and parsed.content == "Paris"


# ---------------------------------------------------------------------------------------------------- end to end


@dataclass
class Served:
    server: ServerThread
    model: ScriptedModel


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with scripted_server(str(tmp_path_factory.mktemp("reasoning")), "tiny-think", enable_auto_tool_choice=True,
                         tool_call_parser="qwen3_coder", reasoning_parser="qwen3") as (server, model):
        yield Served(server, model)


def chat(served: Served, planted: str, stream: bool, **kw: Any) -> tuple[str | None, str | None, str | None, Any]:
    """(reasoning, content, finish reason, tool calls) of one answer, streamed or not."""
    served.model.plant(planted)
    client = served.server.client()
    messages = [{"role": "user", "content": "what time is it?"}]
    max_tokens = kw.pop("max_tokens", 200)
    if not stream:
        resp = client.chat.completions.create(model="tiny-think", messages=messages, max_tokens=max_tokens, **kw)
        m = resp.choices[0].message
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []]
        return getattr(m, "reasoning_content", None), m.content, resp.choices[0].finish_reason, calls
    reasoning, content, reason, calls = "", "", None, {}
    for chunk in client.chat.completions.create(model="tiny-think", messages=messages, max_tokens=max_tokens,
                                                stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        reason = chunk.choices[0].finish_reason or reason
        for p in delta.tool_calls or []:
            name, arguments = calls.get(p.index, (None, ""))
            calls[p.index] = (name or p.function.name, arguments + (p.function.arguments or ""))
    return reasoning or None, content or None, reason, [(n, json.loads(a)) for n, a in calls.values()]


def test_reasoning_end_to_end(served: Served) -> None:
    for stream in (False, True):
        assert chat(served, "The user wants Paris.\n</think>\n\nParis.", stream) == (
            "The user wants Paris.\n", "\n\nParis.", "stop", [])
        # Thinking turned off through chat_template_kwargs: the template closes it in the prompt; all content.
        assert chat(served, "Paris.", stream, extra_body={"chat_template_kwargs": {"enable_thinking": False}}) == (
            None, "Paris.", "stop", [])
        # Cut short while thinking: all reasoning.
        planted = "a long thought that goes on and on"
        n = len(served.model.tokenizer.encode(planted, add_special_tokens=False))
        reasoning, content, reason, _ = chat(served, planted, stream, max_tokens=n - 2)
        assert reason == "length" and content is None and reasoning and planted.startswith(reasoning)
        # Reasoning, then a call parsed out of the content part.
        assert chat(served, "Need the time.\n</think>\n\n" + CALL, stream, tools=TOOLS) == (
            "Need the time.\n", None, "tool_calls", [("get_time", {"offset": 2})])
        # include_reasoning false (vLLM's field): the reasoning is not returned.
        assert chat(served, "hm\n</think>\n\nParis.", stream, extra_body={"include_reasoning": False}) == (
            None, "\n\nParis.", "stop", [])
    served.server.settle()


def test_thinking_off_reaches_the_template(served: Served) -> None:
    served.model.plant("ok")
    r = httpx.post(served.server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "return_token_ids": True,
        "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text
    tok = served.server.async_engine.engine.tokenizer
    assert tok is not None
    assert tok.decode(r.json()["prompt_token_ids"], skip_special_tokens=False).endswith(
        "assistant\n<think>\n\n</think>\n\n")
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "ok"}
    served.server.settle()

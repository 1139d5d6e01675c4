"""Tool calling: the parsers (``hermes``, ``qwen3_coder``, ``qwen3_xml``) on hand-written model outputs, their streamed
deltas against the whole parse at every chunking, the request's ``tool_choice`` rules, and the server end to end with
the ``openai`` client on a tiny checkpoint whose model says what the test plants (``hyserve.testing.scripted``).

The streaming property: feeding a text in any chunks (every 2-way split, random multi-way splits, one character at a
time) and assembling the deltas as OpenAI's client does gives exactly the whole text's parse; sabotaged streams (a
parser that never flushes at the end, a stream that drops the last chunk's arguments) must fail it.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from hyserve import cli
from hyserve.server.chat_output import ChatDeltaStream, ChatOutputParser
from hyserve.server.protocol import APIError, ChatCompletionRequest, DeltaMessage
from hyserve.server.tool_parsers import TOOL_PARSERS, ToolParse, ToolParser, tool_parser_class
from hyserve.server.tool_parsers.qwen3_coder import convert_value
from hyserve.server.tools import ToolSettings, check_parser_flags, plan_tools
from hyserve.testing.scripted import ScriptedModel, scripted_server
from hyserve.testing.server import ServerThread

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "temp": {"type": "number"}, "opts": {"type": "object"}, "tags": {"type": "array"},
        "note": {"type": ["string", "null"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}
TOOLS = [WEATHER, TIME]


def qwen_call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def hermes_call(name: str, arguments: Any) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


QWEN_TEXTS = [
    "Let me check.\n" + qwen_call("get_weather", city="Paris", days="3"),
    qwen_call("get_weather", city="New\nYork", metric="true") + "\n" + qwen_call("get_time", zone="UTC"),
    qwen_call("get_weather", opts='{"a": [1, 2]}', temp="21.5", tags="['x', 'y']"),
    "<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>",  # no <tool_call>: still a call
    qwen_call("get_weather", city="Paris")[:-20],  # cut short inside the call: closed with what it holds
    "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n<parameter=city>\nPar",  # cut in a value
    "<tool_call>\n<function=get_wea",  # cut inside the header: text
    qwen_call("launch_rockets", n="3") + " and " + qwen_call("get_time", zone="UTC"),  # unknown function: text
    "<tool_call>\nnot a function\n</tool_call> plain text after",
    "a < b and <tool_c are not tags; <function is not either",
    qwen_call("get_weather", city="Paris") + "\n\n" + qwen_call("get_weather", city="Rome") + "\n",
    "No tools needed: 2 + 2 = 4.",
    "",
]
HERMES_TEXTS = [
    "Sure.\n" + hermes_call("get_weather", {"city": "Paris", "days": 3}),
    hermes_call("get_weather", {"city": "Zürich"}) + "\n" + hermes_call("get_time", {"zone": "UTC"}),
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Par}\n</tool_call>",  # bad JSON: text
    hermes_call("nope", {}) + " text",  # unknown function: text
    hermes_call("get_time", [1, 2]),  # arguments not an object: text
    hermes_call("get_time", {"zone": "UTC"})[:-5],  # unclosed: text
    "plain <tool_call answer",
]
CORPUS = [(name, text) for name in ("qwen3_coder", "qwen3_xml") for text in QWEN_TEXTS] + \
    [("hermes", text) for text in HERMES_TEXTS]


# ---------------------------------------------------------------------------------------------------- parsers


def parse(name: str, text: str, tools: list[dict[str, Any]] | None = None) -> ToolParse:
    return tool_parser_class(name)(TOOLS if tools is None else tools).parse(text)


def args(parsed: ToolParse) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


def test_registry_and_unknown_names() -> None:
    assert set(TOOL_PARSERS) == {"hermes", "qwen3_coder", "qwen3_xml"}
    with pytest.raises(ValueError, match="known: hermes, qwen3_coder, qwen3_xml"):
        tool_parser_class("mistral")
    with pytest.raises(ValueError, match="known: hermes, qwen3_coder, qwen3_xml"):
        ToolSettings(True, "nope")
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        ToolSettings(True, None)
    with pytest.raises(ValueError, match="unknown reasoning parser 'deepseek'; known: qwen3"):
        check_parser_flags(False, None, "deepseek")


@pytest.mark.parametrize("name", ["qwen3_coder", "qwen3_xml"])
def test_qwen3_calls_and_content(name: str) -> None:
    out = parse(name, QWEN_TEXTS[0])
    assert out.content == "Let me check.\n" and args(out) == [("get_weather", {"city": "Paris", "days": 3})]
    out = parse(name, QWEN_TEXTS[1])
    assert out.content == ""
    assert args(out) == [("get_weather", {"city": "New\nYork", "metric": True}), ("get_time", {"zone": "UTC"})]
    assert args(parse(name, QWEN_TEXTS[3])) == [("get_time", {"zone": "CET"})]
    # Cut short: the call is closed with what it holds (a cut value counts), as the whole parse reads it.
    assert args(parse(name, QWEN_TEXTS[4])) == [("get_weather", {"city": "Paris"})]
    assert args(parse(name, QWEN_TEXTS[5])) == [("get_weather", {"days": 2, "city": "Par"})]
    # The arguments are JSON text as OpenAI sends them, written as json.dumps writes the object.
    call = parse(name, QWEN_TEXTS[0]).calls[0]
    assert call.arguments == json.dumps({"city": "Paris", "days": 3})


@pytest.mark.parametrize(("raw", "schema", "value"), [
    ("3", {"type": "string"}, "3"), ("3", {"type": "integer"}, 3), ("three", {"type": "integer"}, "three"),
    ("2.0", {"type": "number"}, 2), ("2.5", {"type": "number"}, 2.5), ("nan", {"type": "number"}, "nan"),
    ("inf", {"type": "number"}, "inf"), ("True", {"type": "boolean"}, True), ("no", {"type": "boolean"}, False),
    ('{"a": 1}', {"type": "object"}, {"a": 1}), ("{'a': 1}", {"type": "object"}, {"a": 1}),
    ("[1, 2]", {"type": "array"}, [1, 2]), ("[1, 2", {"type": "array"}, "[1, 2"),
    ("{1, 2}", {"type": "array"}, "{1, 2}"),  # a Python set is no JSON: stays the text
    ("null", {"type": "integer"}, None), ("NULL", {"type": "string"}, None),
    ("x", {"type": ["string", "null"]}, "x"), ("7", {"type": ["integer", "null"]}, 7), ("7", {}, "7"),
    ("9" * 5000, {"type": "integer"}, "9" * 5000),  # past Python's digit limit: the text
])
def test_parameter_values_take_the_schema_type(raw: str, schema: dict[str, Any], value: Any) -> None:
    assert convert_value(raw, schema) == value
    assert type(convert_value(raw, schema)) is type(value)


def test_qwen3_values_convert_per_the_tools_schema() -> None:
    out = parse("qwen3_coder", QWEN_TEXTS[2])
    assert args(out) == [("get_weather", {"opts": {"a": [1, 2]}, "temp": 21.5, "tags": ["x", "y"]})]
    # A parameter the schema does not declare stays a string; so does every value of a tool without a schema.
    text = qwen_call("get_weather", city="Paris", extra="5")
    assert args(parse("qwen3_coder", text)) == [("get_weather", {"city": "Paris", "extra": "5"})]
    bare = [{"type": "function", "function": {"name": "get_weather"}}]
    assert args(parse("qwen3_coder", qwen_call("get_weather", days="3"), bare)) == [("get_weather", {"days": "3"})]


def test_hermes_calls() -> None:
    out = parse("hermes", HERMES_TEXTS[0])
    assert out.content == "Sure.\n" and args(out) == [("get_weather", {"city": "Paris", "days": 3})]
    out = parse("hermes", HERMES_TEXTS[1])
    assert args(out) == [("get_weather", {"city": "Zürich"}), ("get_time", {"zone": "UTC"})]
    assert out.calls[0].arguments == '{"city": "Zürich"}'  # not ASCII-escaped


@pytest.mark.parametrize(("name", "text"), [
    ("qwen3_coder", QWEN_TEXTS[6]), ("qwen3_coder", QWEN_TEXTS[8]), ("qwen3_coder", QWEN_TEXTS[9]),
    ("qwen3_coder", qwen_call("launch_rockets", n="3")), *[("hermes", t) for t in HERMES_TEXTS[2:]],
])
def test_malformed_calls_are_text(name: str, text: str) -> None:
    out = parse(name, text)
    assert out.calls == [] and out.content == text


def test_a_malformed_call_beside_a_good_one() -> None:
    out = parse("qwen3_coder", QWEN_TEXTS[7])
    assert args(out) == [("get_time", {"zone": "UTC"})]
    assert out.content == qwen_call("launch_rockets", n="3") + " and "


# ---------------------------------------------------------------------------------------------------- streaming


def assemble(deltas: list[DeltaMessage]) -> tuple[str, list[dict[str, Any]]]:
    """Content and calls as OpenAI's client assembles a stream: a call's first piece has its index, id, type and
    name; later pieces (index only) append to its arguments."""
    content = ""
    calls: list[dict[str, Any]] = []
    for d in deltas:
        content += d.content or ""
        for piece in d.tool_calls or []:
            if piece.index == len(calls):
                assert piece.id and piece.type == "function" and piece.function.name, piece
                calls.append({"id": piece.id, "name": piece.function.name,
                              "arguments": piece.function.arguments or ""})
            else:
                assert piece.index < len(calls) and piece.id is None and piece.function.name is None, piece
                calls[piece.index]["arguments"] += piece.function.arguments or ""
    return content, calls


def stream(parser: ChatOutputParser, chunks: list[str], stream_cls: type[ChatDeltaStream] = ChatDeltaStream
           ) -> list[DeltaMessage]:
    s = stream_cls(parser)
    out = [s.feed(chunk, final=i == len(chunks) - 1) for i, chunk in enumerate(chunks)]
    return [d for d in out if d is not None]


def splits(text: str, rng: random.Random) -> Iterator[list[str]]:
    """Every 2-way split, one character at a time, and random multi-way splits (empty chunks included)."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield [*text, ""]
    for _ in range(20):
        cuts = sorted(rng.randint(0, len(text)) for _ in range(rng.randint(2, 8)))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def check_streaming(make: Any, texts: list[tuple[str, str]], stream_cls: type[ChatDeltaStream] = ChatDeltaStream
                    ) -> None:
    """Every chunking of each text streams (through ``make(name)``'s parser) to the whole text's honest parse."""
    rng = random.Random(0)
    for name, text in texts:
        whole = tool_output_parser(name).parse(text)
        expected = [(c.name, c.arguments) for c in whole.calls]
        for chunks in splits(text, rng):
            content, calls = assemble(stream(make(name), chunks, stream_cls))
            assert content == whole.content, (name, text, chunks)
            assert [(c["name"], c["arguments"]) for c in calls] == expected, (name, text, chunks)


def tool_output_parser(name: str) -> ChatOutputParser:
    return ChatOutputParser(None, tool_parser_class(name)(TOOLS))


def test_streamed_calls_equal_the_whole_parse_at_every_split() -> None:
    check_streaming(tool_output_parser, CORPUS)


class NeverFinal(ToolParser):
    """Sabotage: ignores that the text ended, so held-back text and a cut-short call are never flushed."""

    def __init__(self, inner: ToolParser) -> None:
        super().__init__(None)
        self.inner = inner

    def parse(self, text: str, final: bool = True) -> ToolParse:
        return self.inner.parse(text, final=False)


class DropsLastArguments(ChatDeltaStream):
    """Sabotage: the argument pieces of the last chunk are lost."""

    def feed(self, new_text: str, final: bool) -> DeltaMessage | None:
        delta = super().feed(new_text, final)
        if final and delta is not None and delta.tool_calls:
            for piece in delta.tool_calls:
                piece.function.arguments = ""
        return delta


def test_the_streaming_check_catches_sabotaged_streams() -> None:
    def never_final(name: str) -> ChatOutputParser:
        return ChatOutputParser(None, NeverFinal(tool_parser_class(name)(TOOLS)))

    for name, text in (("qwen3_coder", QWEN_TEXTS[4]), ("qwen3_coder", QWEN_TEXTS[6]), ("hermes", HERMES_TEXTS[5]),
                       ("qwen3_coder", "a text ending in <tool_ca")):
        with pytest.raises(AssertionError):
            check_streaming(never_final, [(name, text)])
    for name, text in (("qwen3_coder", QWEN_TEXTS[0]), ("hermes", HERMES_TEXTS[0])):
        with pytest.raises(AssertionError):
            check_streaming(tool_output_parser, [(name, text)], DropsLastArguments)


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    text = QWEN_TEXTS[1]
    parser = ChatOutputParser(None, tool_parser_class("qwen3_coder")(TOOLS), parallel=False)
    assert [c.name for c in parser.parse(text).calls] == ["get_weather"]
    _, calls = assemble(stream(parser, [text[:40], text[40:90], text[90:]]))
    assert [c["name"] for c in calls] == ["get_weather"]


# ---------------------------------------------------------------------------------------------------- tool_choice


def plan(settings: ToolSettings, **body: Any) -> Any:
    return plan_tools(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **body), settings)


def test_tool_choice_rules() -> None:
    on = ToolSettings(True, "qwen3_coder")
    off = ToolSettings()
    assert plan(on).parser is None and plan(on).template_tools is None
    auto = plan(on, tools=TOOLS)  # absent with tools: auto
    assert auto.parser is not None and auto.template_tools == TOOLS and auto.parallel
    assert not plan(on, tools=TOOLS, parallel_tool_calls=False).parallel
    none = plan(on, tools=TOOLS, tool_choice="none")
    assert none.parser is None and none.template_tools == TOOLS
    assert plan(off, tools=TOOLS, tool_choice="none").template_tools == TOOLS

    def refused(settings: ToolSettings, needle: str, **body: Any) -> None:
        with pytest.raises(APIError, match=needle) as e:
            plan(settings, **body)
        assert e.value.status_code == 400 and e.value.param in ("tool_choice", "tools[0]")

    for choice in ("none", "auto", "required", {"type": "function", "function": {"name": "get_time"}}):
        refused(on, "only allowed when tools are given", tool_choice=choice)
    refused(off, "--enable-auto-tool-choice --tool-call-parser", tools=TOOLS)
    refused(off, "--enable-auto-tool-choice --tool-call-parser", tools=TOOLS, tool_choice="auto")
    # Constrained by the grammar, with or without the tool-call flags (tests/server/test_tool_choice.py).
    for settings in (on, off):
        assert plan(settings, tools=TOOLS, tool_choice="required").constraint is not None
        assert plan(settings, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}}
                    ).constraint is not None
    refused(on, "not in tools", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    refused(on, "tool_choice must be", tools=TOOLS, tool_choice="sometimes")
    refused(on, "tools\\[0\\] must be", tools=[{"type": "retrieval"}], tool_choice="none")


# ---------------------------------------------------------------------------------------------------- end to end


@dataclass
class Served:
    server: ServerThread
    model: ScriptedModel


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with scripted_server(str(tmp_path_factory.mktemp("tools")), "tiny-tools", enable_auto_tool_choice=True,
                         tool_call_parser="qwen3_coder", reasoning_parser="qwen3") as (server, model):
        yield Served(server, model)


NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def ask(served: Served, planted: str, stream: bool, **kw: Any) -> tuple[Any, str | None, list[dict[str, Any]]]:
    """(the message or the assembled stream's content, finish reason, tool calls as name and parsed arguments)."""
    served.model.plant(planted)
    client = served.server.client()
    kw.setdefault("tools", TOOLS)
    kw.setdefault("extra_body", NO_THINKING)
    messages = kw.pop("messages", [{"role": "user", "content": "weather in Paris?"}])
    if not stream:
        resp = client.chat.completions.create(model="tiny-tools", messages=messages, max_tokens=200, **kw)
        choice = resp.choices[0]
        calls = [{"id": c.id, "name": c.function.name, "arguments": json.loads(c.function.arguments)}
                 for c in choice.message.tool_calls or []]
        return choice.message, choice.finish_reason, calls
    content, reason, pieces = "", None, []
    for chunk in client.chat.completions.create(model="tiny-tools", messages=messages, max_tokens=200, stream=True,
                                                **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reason = chunk.choices[0].finish_reason or reason
        pieces.append(DeltaMessage(tool_calls=[p.model_dump() for p in delta.tool_calls]) if delta.tool_calls
                      else DeltaMessage())
    _, assembled = assemble(pieces)
    return content, reason, [{"id": c["id"], "name": c["name"], "arguments": json.loads(c["arguments"])}
                             for c in assembled]


def test_tool_calls_end_to_end(served: Served) -> None:
    planted = "Checking.\n" + qwen_call("get_weather", city="Paris", days="3") + "\n" + qwen_call("get_time",
                                                                                                zone="CET")
    expected = [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
                {"name": "get_time", "arguments": {"zone": "CET"}}]
    message, reason, calls = ask(served, planted, stream=False)
    assert reason == "tool_calls" and message.content == "Checking.\n"
    assert [{k: c[k] for k in ("name", "arguments")} for c in calls] == expected
    assert all(c["id"].startswith("call_") for c in calls) and len({c["id"] for c in calls}) == 2
    content, reason, calls = ask(served, planted, stream=True)
    assert reason == "tool_calls" and content == "Checking.\n"
    assert [{k: c[k] for k in ("name", "arguments")} for c in calls] == expected
    # parallel_tool_calls=false: the first call only, streamed or not.
    for stream in (False, True):
        _, reason, calls = ask(served, planted, stream, parallel_tool_calls=False)
        assert reason == "tool_calls" and [c["name"] for c in calls] == ["get_weather"]
    served.server.settle()


def test_malformed_and_unasked_calls_are_text(served: Served) -> None:
    bad = qwen_call("launch_rockets", n="3")
    for stream in (False, True):
        message, reason, calls = ask(served, bad, stream)
        assert reason == "stop" and calls == []
        assert (message if stream else message.content) == bad
        # tool_choice "none": the tools are rendered, the answer is text, calls and all.
        good = qwen_call("get_time", zone="CET")
        message, reason, calls = ask(served, good, stream, tool_choice="none")
        assert reason == "stop" and calls == [] and (message if stream else message.content) == good
    served.server.settle()


def test_tool_history_reaches_the_template(served: Served) -> None:
    tok = served.server.async_engine.engine.tokenizer
    assert tok is not None
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    served.model.plant("It is sunny.")
    r = httpx.post(served.server.url + "/v1/chat/completions", timeout=60, json={
        "messages": messages, "tools": TOOLS, "max_tokens": 20, "return_token_ids": True, **NO_THINKING})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny."}
    prompt = tok.decode(r.json()["prompt_token_ids"], skip_special_tokens=False)
    hf_messages = [messages[0], {**messages[1], "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        messages[2]]
    assert prompt == tok.hf_tokenizer.apply_chat_template(hf_messages, tools=TOOLS, add_generation_prompt=True,
                                                          tokenize=False, enable_thinking=False)
    assert "get_weather: {" in prompt and "<parameter=city>\nOslo\n</parameter>" in prompt
    assert "<tool_response id=call_1>\nsunny\n</tool_response>" in prompt and prompt.endswith("</think>\n\n")
    served.server.settle()


def test_refusals_over_http(served: Served) -> None:
    def post(**body: Any) -> httpx.Response:
        return httpx.post(served.server.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body})

    for body, needle in (({"tool_choice": "auto"}, "only allowed when tools"),
                         ({"tools": TOOLS, "tool_choice": "required"}, "enable_thinking"),  # the grammar: no room
                         ({"tools": TOOLS, "chat_template_kwargs": {"enable_thinking": "no"}}, "must be a bool")):
        for stream in (False, True):
            r = post(stream=stream, **body)
            assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    served.server.settle()


def test_serve_refuses_unknown_parsers_before_loading(capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    def no_model_load(*args: Any, **kw: Any) -> Any:
        raise AssertionError("the model was loaded before the parser flags were checked")

    monkeypatch.setattr(cli, "make_llm", no_model_load)
    for flags, needle in ((["--enable-auto-tool-choice", "--tool-call-parser", "nope"],
                           "unknown tool-call parser 'nope'; known: hermes, qwen3_coder, qwen3_xml"),
                          (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
                          (["--reasoning-parser", "r1"], "unknown reasoning parser 'r1'; known: qwen3")):
        assert cli.main(["serve", "--device", "cpu", "--port", "0", *flags]) == 2
        assert needle in capsys.readouterr().err

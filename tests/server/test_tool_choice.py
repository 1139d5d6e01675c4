"""``tool_choice: "required"`` and a named function, constrained by the grammar engine: the schemas, the parsers of
the constrained answer (streamed deltas equal the whole parse at every chunking), the request rules, and the server
end to end with the ``openai`` client on a tiny random checkpoint, where only the grammar makes the answer a valid
call (a sabotaged server that drops the constraint must fail the same checks).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from hyserve.config import EngineConfig
from hyserve.engine.llm_engine import LLMEngine
from hyserve.server import AsyncEngine, build_app
from hyserve.server import tools as tools_module
from hyserve.server.chat_output import ChatDeltaStream, ChatOutputParser
from hyserve.server.protocol import APIError, ChatCompletionRequest, DeltaMessage
from hyserve.server.tool_choice import NamedCallParser, RequiredCallsParser, named_schema, required_schema
from hyserve.server.tool_parsers import ParsedCall, ToolParse
from hyserve.server.tools import ToolSettings, plan_tools
from hyserve.testing.families import CheckpointCache
from hyserve.testing.server import ServerThread

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 1,
                                                                             "maximum": 7},
                                     "alerts": {"type": "boolean"}},
    "required": ["unit", "days", "alerts"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def valid(schema: dict[str, Any], value: Any) -> bool:
    """The few JSON-schema keywords the tools above use (object, enum, integer with bounds, boolean)."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema.get("type")
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool) and \
            schema.get("minimum", value) <= value <= schema.get("maximum", value)
    if kind == "object":
        props = schema.get("properties", {})
        return isinstance(value, dict) and set(schema.get("required", [])) <= set(value) and \
            (schema.get("additionalProperties", True) is not False or set(value) <= set(props)) and \
            all(valid(props[k], v) for k, v in value.items() if k in props)
    raise AssertionError(f"the test's validator does not know {schema}")


def valid_call(name: str, arguments: str) -> bool:
    try:
        args = json.loads(arguments)
    except ValueError:
        return False
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    return name in params and valid(params[name], args)


def test_the_validator_refuses_what_it_should() -> None:
    assert valid_call("get_weather", '{"unit":"c","days":7,"alerts":false}')
    for name, args in (("get_weather", '{"unit":"k","days":7,"alerts":false}'),
                       ("get_weather", '{"unit":"c","days":8,"alerts":false}'),
                       ("get_weather", '{"unit":"c","days":true,"alerts":false}'),
                       ("get_weather", '{"unit":"c","days":2}'), ("get_weather", '{"unit":"c","days":2,"alerts":0}'),
                       ("get_time", '{"zone":"UTC","x":1}'), ("get_date", "{}"), ("get_time", '{"zone":"UT')):
        assert not valid_call(name, args), (name, args)


# ---------------------------------------------------------------------------------------------------- schemas


def test_schemas() -> None:
    assert named_schema(TOOLS, "get_time") == TIME["function"]["parameters"]
    schema = required_schema(TOOLS)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    branches = schema["items"]["anyOf"]
    assert [b["properties"]["name"] for b in branches] == [{"type": "string", "enum": ["get_weather"]},
                                                          {"type": "string", "enum": ["get_time"]}]
    assert branches[1]["properties"]["parameters"] == TIME["function"]["parameters"]
    assert all(b["required"] == ["name", "parameters"] for b in branches)
    assert required_schema(TOOLS, parallel=False)["maxItems"] == 1
    # No parameters: an object with no properties. $defs move to the top (the tools are not changed).
    bare = {"type": "function", "function": {"name": "ping"}}
    defs = {"type": "function", "function": {"name": "put", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "integer"}}}}}
    schema = required_schema([bare, defs])
    assert schema["items"]["anyOf"][0]["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert schema["$defs"] == {"P": {"type": "integer"}} and "$defs" in defs["function"]["parameters"]
    assert "$defs" not in schema["items"]["anyOf"][1]["properties"]["parameters"]
    other = json.loads(json.dumps(defs).replace('"integer"', '"string"').replace('"put"', '"put2"'))
    with pytest.raises(ValueError, match="P"):
        required_schema([defs, other])


# ---------------------------------------------------------------------------------------------------- parsers


def assemble(deltas: list[DeltaMessage]) -> tuple[str, list[tuple[str, str]]]:
    """Content and calls as OpenAI's client assembles a stream (a call's first piece: index, id, type, name)."""
    content, calls = "", []
    for d in deltas:
        content += d.content or ""
        for piece in d.tool_calls or []:
            if piece.index == len(calls):
                assert piece.id and piece.type == "function" and piece.function.name, piece
                calls.append([piece.function.name, piece.function.arguments or ""])
            else:
                assert piece.index < len(calls) and piece.id is None and piece.function.name is None, piece
                calls[piece.index][1] += piece.function.arguments or ""
    return content, [(n, a) for n, a in calls]


def streamed(parser: ChatOutputParser, chunks: list[str]) -> tuple[str, list[tuple[str, str]]]:
    s = ChatDeltaStream(parser)
    out = [s.feed(chunk, final=i == len(chunks) - 1) for i, chunk in enumerate(chunks)]
    return assemble([d for d in out if d is not None])


def chunkings(text: str, rng: random.Random) -> Iterator[list[str]]:
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield [*text, ""]
    for _ in range(10):
        cuts = sorted(rng.randint(0, len(text)) for _ in range(rng.randint(2, 8)))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


W1 = '{"name":"get_weather","parameters":{"unit":"c","days":3,"alerts":true}}'
T1 = '{"name":"get_time","parameters":{"zone":"UTC"}}'
REQUIRED = [
    (f"[{W1}]", [("get_weather", '{"unit":"c","days":3,"alerts":true}')]),
    (f"[{W1},{T1}]", [("get_weather", '{"unit":"c","days":3,"alerts":true}'), ("get_time", '{"zone":"UTC"}')]),
    # Whitespace (a grammar that allows it), strings holding brackets and quotes.
    ('[ { "name" : "get_time" , "parameters" : { "zone" : "a]}\\"{" } } ,\n' + T1 + " ]",
     [("get_time", '{ "zone" : "a]}\\"{" }'), ("get_time", '{"zone":"UTC"}')]),
    # The other order: sent whole once the item closes.
    ('[{"parameters":{"zone":"CET"},"name":"get_time"}]', [("get_time", '{"zone":"CET"}')]),
    (f"[{W1},{T1[:-8]}", [("get_weather", '{"unit":"c","days":3,"alerts":true}'), ("get_time", '{"zone"')]),  # cut
    (f"[{T1},{{\"name\":\"get_da", [("get_time", '{"zone":"UTC"}')]),  # cut inside a name
    ('[{"name":"launch","parameters":{}}]', []),  # not a tool: text
    ("Sure! get_time", []),  # not an array (an unconstrained model): text
]


@pytest.mark.parametrize("text, calls", REQUIRED)
def test_required_answers_stream_to_their_whole_parse(text: str, calls: list[tuple[str, str]]) -> None:
    whole = ChatOutputParser(None, RequiredCallsParser(TOOLS)).parse(text)
    assert [(c.name, c.arguments) for c in whole.calls] == calls
    assert whole.content == ("" if calls else text)
    rng = random.Random(0)
    for chunks in chunkings(text, rng):
        assert streamed(ChatOutputParser(None, RequiredCallsParser(TOOLS)), chunks) == (whole.content, calls), chunks


@pytest.mark.parametrize("text", ['{"unit":"f","days":1,"alerts":false}', ' {"unit": "c"} \n', '{"unit":"c'])
def test_named_answers_stream_to_their_whole_parse(text: str) -> None:
    whole = ChatOutputParser(None, NamedCallParser(TOOLS, "get_weather")).parse(text)
    assert whole.content == "" and [(c.name, c.arguments) for c in whole.calls] == [("get_weather", text.strip())]
    for chunks in chunkings(text, random.Random(0)):
        assert streamed(ChatOutputParser(None, NamedCallParser(TOOLS, "get_weather")), chunks) == \
            ("", [("get_weather", text.strip())]), chunks


class NoHoldBack(NamedCallParser):
    """Sabotage: trailing whitespace is sent while the text may grow (the whole parse strips it)."""

    def parse(self, text: str, final: bool = True) -> ToolParse:
        out = super().parse(text, final)
        if not final:
            out.calls[0].arguments = text.lstrip()
        return out


class EarlyName(RequiredCallsParser):
    """Sabotage: an open item is sent as soon as its name starts, so a stream may send half a name."""

    def item(self, text: str, start: int, end: int | None) -> ParsedCall | None:
        call = super().item(text, start, end)
        if call is None and end is None and text.startswith('{"name":"', start):
            return ParsedCall(text[start + 9:].split('"')[0], "", complete=False)
        return call


def check_stream(make: Any, text: str) -> None:
    whole = ChatOutputParser(None, make()).parse(text)
    for chunks in chunkings(text, random.Random(0)):
        assert streamed(ChatOutputParser(None, make()), chunks) == \
            (whole.content, [(c.name, c.arguments) for c in whole.calls]), chunks


def test_the_stream_checks_catch_sabotaged_parsers() -> None:
    check_stream(lambda: NamedCallParser(TOOLS, "get_weather"), ' {"unit": "c"} \n')
    with pytest.raises(AssertionError):
        check_stream(lambda: NoHoldBack(TOOLS, "get_weather"), ' {"unit": "c"} \n')
    check_stream(lambda: RequiredCallsParser(TOOLS), REQUIRED[1][0])
    with pytest.raises(AssertionError):
        check_stream(lambda: EarlyName(TOOLS), REQUIRED[1][0])


def test_parallel_false_keeps_one_call() -> None:
    parser = ChatOutputParser(None, RequiredCallsParser(TOOLS), parallel=False)
    assert [c.name for c in parser.parse(REQUIRED[1][0]).calls] == ["get_weather"]


# ---------------------------------------------------------------------------------------------------- rules


def plan(**body: Any) -> Any:
    return plan_tools(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **body), ToolSettings())


def test_plans_need_no_tool_parser_and_carry_the_constraint() -> None:
    named = plan(tools=TOOLS, tool_choice=NAMED)
    assert isinstance(named.parser, NamedCallParser) and named.template_tools == TOOLS
    assert named.constraint.json == WEATHER["function"]["parameters"] and named.constraint.disable_any_whitespace
    required = plan(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert isinstance(required.parser, RequiredCallsParser) and not required.parallel
    assert required.constraint.json == required_schema(TOOLS, parallel=False)
    assert plan(tools=TOOLS, tool_choice="required", response_format={"type": "text"}).constraint is not None


@pytest.mark.parametrize("field, value", [
    ("response_format", {"type": "json_object"}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}),
    ("structured_outputs", {"regex": "a+"}), ("guided_json", {"type": "object"}), ("guided_choice", ["a"]),
    ("guided_regex", "a"), ("guided_grammar", "start: 'a'")])
def test_another_constraint_is_refused_naming_both(field: str, value: Any) -> None:
    for choice, shown in (("required", "'required'"), (NAMED, "named function")):
        with pytest.raises(APIError, match=f"tool_choice.*{shown}.*{field}") as e:
            plan(tools=TOOLS, tool_choice=choice, **{field: value})
        assert e.value.status_code == 400 and e.value.param == field


# ---------------------------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def server(ckpts: CheckpointCache) -> Iterator[ServerThread]:
    """A server with a reasoning parser and no tool-call flags (named and required need none)."""
    engine = LLMEngine(EngineConfig(model=ckpts.get(), device="cpu", dtype="float32",
                                    cpu_cache_memory_bytes=64 * 2**20))
    async_engine = AsyncEngine(engine, start=False)
    with ServerThread(async_engine, app=build_app(async_engine, "tiny", reasoning_parser="qwen3")) as srv:
        yield srv


NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def ask(server: ServerThread, stream: bool, **kw: Any) -> tuple[Any, str | None, list[tuple[str, str]]]:
    """(content, finish reason, calls as (name, arguments)), a stream assembled as OpenAI's client does."""
    client = server.client()
    kw = {"model": "tiny", "messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS, "max_tokens": 64,
          "temperature": 0.0, "extra_body": NO_THINKING, **kw}
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls or [])
        return choice.message.content, choice.finish_reason, calls
    deltas, reason = [], None
    for chunk in client.chat.completions.create(stream=True, **kw):
        if chunk.choices:
            delta = chunk.choices[0].delta
            reason = chunk.choices[0].finish_reason or reason
            deltas.append(DeltaMessage(content=delta.content, tool_calls=[
                p.model_dump() for p in delta.tool_calls] if delta.tool_calls else None))
    content, calls = assemble(deltas)
    return content or None, reason, calls


def check_named(server: ServerThread) -> None:
    seen = []
    for stream in (False, True):
        content, reason, calls = ask(server, stream, tool_choice=NAMED)
        assert content is None and reason == "stop", (content, reason)
        assert len(calls) == 1 and calls[0][0] == "get_weather" and valid_call(*calls[0]), calls
        seen.append(calls)
    assert seen[0] == seen[1], seen


def check_required(server: ServerThread) -> None:
    for parallel in (False, True):
        seen = []
        for stream in (False, True):
            content, reason, calls = ask(server, stream, tool_choice="required", parallel_tool_calls=parallel)
            assert content is None and calls, (content, calls)
            # Cut short (a random model may go on listing calls): the last call may be open; the others are whole.
            ok = [valid_call(*c) for c in calls]
            assert reason in ("tool_calls", "length") and all(ok[:-1]) and ok[0], (reason, calls)
            assert ok[-1] or reason == "length", (reason, calls)
            if not parallel:
                assert len(calls) == 1 and reason == "tool_calls", (reason, calls)
            seen.append(calls)
        assert seen[0] == seen[1], seen


def test_named_function_end_to_end(server: ServerThread) -> None:
    check_named(server)
    server.settle()


def test_required_end_to_end(server: ServerThread) -> None:
    check_required(server)
    server.settle()


def test_the_checks_catch_an_unconstrained_answer(server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage: the plan carries no constraint, so the random model writes what it likes."""
    real = tools_module.forced_plan

    def unconstrained(*args: Any) -> Any:
        p = real(*args)
        p.constraint = None
        return p

    monkeypatch.setattr(tools_module, "forced_plan", unconstrained)
    with pytest.raises(AssertionError):
        check_named(server)
    with pytest.raises(AssertionError):
        check_required(server)
    server.settle()


def test_refusals_over_http(server: ServerThread) -> None:
    def post(**body: Any) -> httpx.Response:
        return httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": TOOLS, **body})

    for body, needle, param in (
            ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
             "response_format"),
            ({"tool_choice": NAMED, "structured_outputs": {"choice": ["a"]}, **NO_THINKING}, "structured_outputs",
             "structured_outputs"),
            ({"tool_choice": NAMED, "guided_json": {"type": "object"}}, "guided_json", "guided_json"),
            # Thinking on with a reasoning parser: the grammar would leave no room to think.
            ({"tool_choice": "required"}, "enable_thinking", "tool_choice"),
            ({"tool_choice": NAMED, "chat_template_kwargs": {"enable_thinking": True}}, "reasoning", "tool_choice")):
        for stream in (False, True):
            r = post(stream=stream, **body)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert needle in error["message"] and "tool_choice" in error["message"] and error["param"] == param, error
    server.settle()

"""Structured output over the HTTP API, with the openai client: ``response_format`` (json_object, json_schema),
``structured_outputs`` and the ``guided_*`` fields reach the engine as the same constraint ``LLM.generate`` takes
(equal tokens), outputs are in their language, and what cannot be honoured is a 400 naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from hyserve import LLM, SamplingParams
from hyserve.config import EngineConfig
from hyserve.engine.llm_engine import LLMEngine
from hyserve.server import AsyncEngine
from hyserve.testing.families import CheckpointCache
from hyserve.testing.server import ServerThread

CACHE_BYTES = 64 * 1024 * 1024
SCHEMA = {"type": "object", "properties": {"a": {"enum": ["x", "yy"]}, "b": {"type": "boolean"}},
          "required": ["a", "b"], "additionalProperties": False}


@pytest.fixture(scope="module")
def served(ckpts: CheckpointCache) -> Iterator[tuple[ServerThread, LLM]]:
    path = ckpts.get()
    engine = LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", cpu_cache_memory_bytes=CACHE_BYTES))
    offline = LLM(model=path, device="cpu", dtype="float32", cpu_cache_memory_bytes=CACHE_BYTES)
    with ServerThread(AsyncEngine(engine, start=False), "tiny") as srv:
        yield srv, offline


def offline_text(llm: LLM, prompt: str, **so: Any) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=so)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text


def test_each_spelling_reaches_the_same_constraint(served: tuple[ServerThread, LLM]) -> None:
    srv, offline = served
    client = srv.client()
    cases: list[tuple[dict[str, Any], dict[str, Any]]] = [
        ({"extra_body": {"guided_choice": ["yes", "no", "maybe"]}}, {"choice": ["yes", "no", "maybe"]}),
        ({"extra_body": {"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}}, {"regex": "[0-9]{3}-[a-z]{2}"}),
        ({"extra_body": {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}},
         {"json": SCHEMA, "disable_any_whitespace": True}),
        # The completions client has no response_format argument: vLLM takes it there too, through extra_body.
        ({"extra_body": {"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}}},
         {"json": SCHEMA}),
        ({"extra_body": {"response_format": {"type": "json_object"}}}, {"json_object": True}),
    ]
    for kw, so in cases:
        want = offline_text(offline, "Hello, world!", **so)
        got = client.completions.create(model="tiny", prompt="Hello, world!", max_tokens=40, temperature=0.0, **kw)
        assert got.choices[0].text == want, (kw, got.choices[0].text, want)
    # Chat, the one a JSON agent sends: the reply parses and matches the schema once it ends.
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "give me json"}], max_tokens=60, temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}},
        extra_body={"ignore_eos": False})
    text = reply.choices[0].message.content or ""
    assert text.startswith("{")
    if reply.choices[0].finish_reason == "stop":
        value = json.loads(text)
        assert value["a"] in ("x", "yy") and isinstance(value["b"], bool) and set(value) == {"a", "b"}
    srv.settle()


def test_a_streamed_choice_is_one_of_them(served: tuple[ServerThread, LLM]) -> None:
    srv, _ = served
    stream = srv.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "yes or no?"}], max_tokens=10, temperature=0.0,
        stream=True, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text in ("yes", "no")
    srv.settle()


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "structural_tag"}}, "response_format.type", "not supported"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "t"}}}, "response_format.json_schema",
     "json_schema.schema"),
    ({"structured_outputs": {"regex": "a+", "whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern",
     "not supported"),
    ({"structured_outputs": {"regex": "a+", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex", "both ask"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
])
def test_malformed_constraints_are_400s_naming_the_field(served: tuple[ServerThread, LLM], body: dict[str, Any],
                                                        param: str, words: str) -> None:
    srv, _ = served
    r = httpx.post(srv.url + "/v1/completions", timeout=30,
                   json={"prompt": "hi", "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_a_grammar_the_engine_cannot_compile_is_a_400(served: tuple[ServerThread, LLM]) -> None:
    srv, _ = served
    for body in ({"structured_outputs": {"grammar": "start: undefined_rule"}}, {"guided_regex": "(unclosed"}):
        r = httpx.post(srv.url + "/v1/completions", timeout=30, json={"prompt": "hi", "max_tokens": 4, **body})
        assert r.status_code == 400, r.text
        assert "structured outputs" in r.json()["error"]["message"]
    srv.settle()

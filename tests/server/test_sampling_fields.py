"""The penalty and logit-mask fields through the server: the ``openai`` client sends OpenAI's ``presence_penalty``,
``frequency_penalty`` and ``logit_bias`` and vLLM's ``repetition_penalty``, ``min_tokens``, ``bad_words`` and
``allowed_token_ids`` (``extra_body``), and gets the tokens ``LLM.generate`` gives for the same SamplingParams; bad
values are 400s naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from hyserve import LLM, SamplingParams
from hyserve.config import EngineConfig
from hyserve.engine.llm_engine import LLMEngine
from hyserve.server import AsyncEngine
from hyserve.testing import write_tiny_checkpoint
from hyserve.testing.server import ServerThread

CACHE_BYTES = 64 * 1024 * 1024
MODEL = "tiny-qwen"
PROMPT = "Numbers: 0 1 2 3 4 5 and 0 1 2 3 4 5"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerThread, LLM]]:
    path = write_tiny_checkpoint(str(tmp_path_factory.mktemp("srv") / MODEL))
    llm = LLM(model=path, device="cpu", dtype="float32", cpu_cache_memory_bytes=CACHE_BYTES)
    engine = LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", cpu_cache_memory_bytes=CACHE_BYTES))
    with ServerThread(AsyncEngine(engine, start=False)) as server:
        yield server, llm


def _token_ids(choice: Any) -> list[int]:
    return list((choice.model_extra or {})["token_ids"])


def test_fields_give_what_llm_generate_gives(served: tuple[ServerThread, LLM]) -> None:
    server, llm = served
    tok = llm.get_tokenizer()
    plain = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    word = tok.decode(plain[2:4])
    cases: list[tuple[dict[str, Any], dict[str, Any]]] = [
        ({"presence_penalty": 1.5, "frequency_penalty": 0.8, "logit_bias": {str(plain[0]): -100, "7": 4.5}},
         {}),
        ({"presence_penalty": -0.5}, {"repetition_penalty": 1.6, "min_tokens": 6, "bad_words": [word]}),
        ({}, {"allowed_token_ids": sorted(set(plain[:5]) | {11, 12, 13}), "repetition_penalty": 0.8}),
    ]
    client = server.client()
    changed = 0
    for body, extra in cases:
        resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True, "return_token_ids": True, **extra},
                                         **body)
        got = _token_ids(resp.choices[0])
        bias = {int(k): v for k, v in body.get("logit_bias", {}).items()} or None
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias=bias,
                                presence_penalty=body.get("presence_penalty", 0.0),
                                frequency_penalty=body.get("frequency_penalty", 0.0), **extra)
        want = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
        assert got == want, (body, extra)
        changed += got != plain
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                              max_tokens=6, temperature=0, extra_body={"ignore_eos": True, **extra},
                                              **body)
        assert chat.choices[0].finish_reason == "length"
    assert changed == len(cases)
    server.settle()


@pytest.mark.parametrize(("field", "value"), [
    ("presence_penalty", 2.5), ("frequency_penalty", -2.01), ("repetition_penalty", 0), ("logit_bias", {"x": 1}),
    ("logit_bias", {"999999": 1}), ("allowed_token_ids", []), ("allowed_token_ids", [999999]), ("bad_words", [""]),
])
def test_bad_values_are_400s_naming_the_field(served: tuple[ServerThread, LLM], field: str, value: Any) -> None:
    server, _ = served
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                         field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert field in err["message"], err

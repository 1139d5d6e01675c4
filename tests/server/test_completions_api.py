"""``/v1/completions`` for evaluation and sampling: echo with logprobs (what lm-eval's loglikelihood sends) checked
against transformers, prompt_logprobs, a list of prompts with n completions each (choice order, streamed chunks'
indices, usage), n on chat, and ``/tokenize`` / ``/detokenize``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from hyserve.config import EngineConfig
from hyserve.engine.llm_engine import LLMEngine
from hyserve.server import AsyncEngine
from hyserve.testing import reference_logits
from hyserve.testing.engine import LOGPROB_TOL
from hyserve.testing.families import CheckpointCache
from hyserve.testing.server import ServerThread

NAME = "tiny"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerThread, Any]]:
    ckpts = CheckpointCache(str(tmp_path_factory.mktemp("cmpl")))
    path = ckpts.get()
    # Small chunks: a prompt's logprobs come from several prefill chunks.
    engine = LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", max_num_batched_tokens=16,
                                    num_kv_blocks=128, num_state_slots=8))
    with ServerThread(AsyncEngine(engine, start=False), NAME) as srv:
        yield srv, ckpts.reference(path)


def post(srv: ServerThread, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{srv.url}{route}", json={"model": NAME, **body}, timeout=60)


def stream(srv: ServerThread, body: dict[str, Any]) -> list[dict[str, Any]]:
    r = post(srv, "/v1/completions", {**body, "stream": True})
    assert r.status_code == 200, r.text
    lines = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


PROMPT_IDS = [5, 17, 33, 2, 9, 41, 7, 100, 3, 3, 8, 250, 12, 19, 77, 6, 90, 31, 4, 44]


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_logprobs_as_lm_eval_reads_them(server: tuple[ServerThread, Any], max_tokens: int) -> None:
    srv, ref = server
    # A request without prompt logprobs computes the prompt first: the prefix cache holds it, and the echo request
    # must compute it again.
    assert post(srv, "/v1/completions", {"prompt": PROMPT_IDS, "max_tokens": 1}).status_code == 200
    body = {"prompt": PROMPT_IDS, "max_tokens": max_tokens, "echo": True, "logprobs": 1, "temperature": 0}
    r = post(srv, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    n = len(PROMPT_IDS) + max_tokens
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    logp = torch.log_softmax(reference_logits(ref, PROMPT_IDS).double(), dim=-1)
    for p in range(1, len(PROMPT_IDS)):
        assert abs(lp["token_logprobs"][p] - float(logp[p - 1, PROMPT_IDS[p]])) <= LOGPROB_TOL, p
        # logprobs=1: the top token besides the prompt's own
        assert max(lp["top_logprobs"][p].values()) == pytest.approx(float(logp[p - 1].max()), abs=LOGPROB_TOL)
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    detok = post(srv, "/detokenize", {"tokens": PROMPT_IDS}).json()["prompt"]
    assert choice["text"].startswith(detok) and "".join(lp["tokens"][: len(PROMPT_IDS)]) == detok
    assert r.json()["usage"]["completion_tokens"] == max_tokens
    # Streamed: the same tokens and logprobs, the echo in the first chunk.
    chunks = stream(srv, body)
    got = [t for c in chunks for ch in c["choices"] if ch["logprobs"] for t in ch["logprobs"]["token_logprobs"]]
    assert got == lp["token_logprobs"]
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == choice["text"]


def test_prompt_logprobs_field(server: tuple[ServerThread, Any]) -> None:
    srv, _ = server
    r = post(srv, "/v1/completions", {"prompt": PROMPT_IDS[:6], "max_tokens": 2, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] is not None
    assert post(srv, "/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}).status_code == 400


def test_list_of_prompts_with_n(server: tuple[ServerThread, Any]) -> None:
    srv, _ = server
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    body = {"prompt": prompts, "n": 2, "max_tokens": 4, "temperature": 1.0, "seed": 3, "ignore_eos": True,
            "return_token_ids": True}
    r = post(srv, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    # prompt-major: choices 0, 1 complete prompt 0
    assert [c["prompt_token_ids"] for c in choices] == [prompts[0], prompts[0], prompts[1], prompts[1]]
    assert choices[0]["token_ids"] != choices[1]["token_ids"], "two completions of one prompt drew alike"
    assert r.json()["usage"]["prompt_tokens"] == 7 and r.json()["usage"]["completion_tokens"] == 16
    # Each prompt alone, n=2 with the same seed: the same completions (each prompt is its own request).
    alone = post(srv, "/v1/completions", {**body, "prompt": prompts[1]}).json()["choices"]
    assert [c["token_ids"] for c in alone] == [c["token_ids"] for c in choices[2:]]
    # Streamed: every chunk names its choice; the pieces add up to the whole answer.
    chunks = stream(srv, {**body, "stream_options": {"include_usage": True}})
    ids: dict[int, list[int]] = {}
    for c in chunks:
        for ch in c["choices"]:
            ids.setdefault(ch["index"], []).extend(ch["token_ids"])
    assert ids == {c["index"]: c["token_ids"] for c in choices}
    assert chunks[-1]["usage"]["completion_tokens"] == 16
    greedy = post(srv, "/v1/completions", {"prompt": "hello", "n": 3, "max_tokens": 5, "temperature": 0}).json()
    assert len({c["text"] for c in greedy["choices"]}) == 1 and len(greedy["choices"]) == 3


def test_n_on_chat_and_best_of(server: tuple[ServerThread, Any]) -> None:
    srv, _ = server
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 3, "seed": 1}
    r = post(srv, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    r = post(srv, "/v1/chat/completions", {**body, "stream": True})
    indices = {ch["index"] for ln in r.text.splitlines() if ln.startswith("data: {")
               for ch in json.loads(ln[6:])["choices"]}
    assert indices == {0, 1}
    r = post(srv, "/v1/completions", {"prompt": "hi", "best_of": 3, "n": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"


def test_tokenize_detokenize_round_trip(server: tuple[ServerThread, Any]) -> None:
    srv, _ = server
    r = post(srv, "/tokenize", {"prompt": "Hello world, again"})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] > 0 and "token_strs" not in out
    assert post(srv, "/detokenize", {"tokens": out["tokens"]}).json() == {"prompt": "Hello world, again"}
    strs = post(srv, "/tokenize", {"prompt": "Hello", "return_token_strs": True}).json()["token_strs"]
    assert isinstance(strs, list) and strs
    chat = post(srv, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    text = post(srv, "/detokenize", {"tokens": chat["tokens"]}).json()["prompt"]
    assert "hi" in text and chat["count"] > 2
    assert post(srv, "/detokenize", {"tokens": [10**9]}).status_code == 400
    assert post(srv, "/tokenize", {}).status_code == 400


def test_two_ids_of_one_text_keep_the_likelier_logprob() -> None:
    """Legacy completions logprobs key the top-N by text: where two token ids decode alike, the likelier one's
    logprob stands (a dict built in descending order would keep the lower)."""
    from hyserve.outputs import Logprob
    from hyserve.server.responses import completion_logprobs

    entry = {7: Logprob(-0.3, 1, "ab"), 9: Logprob(-0.9, 2, "a"), 4: Logprob(-2.5, 3, "a")}
    res, _ = completion_logprobs([7], [entry], 0)
    assert res is not None and res.top_logprobs == [{"ab": -0.3, "a": -0.9}]

"""``hyserve serve`` on a tiny Falcon-H1 checkpoint (Mamba2 and attention in every layer, muP multipliers) with
prefix caching and n-gram speculation on, on the CPU, asked with the official ``openai`` client: chat and
completions, the prefix cache hit by a repeated conversation (each layer's Mamba2 states restored from a snapshot
beside its shared KV blocks), n-gram drafts proposed."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from hyserve.testing.falcon_h1 import write_tiny_falcon_h1_checkpoint
from hyserve.testing.server import serve_subprocess

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = write_tiny_falcon_h1_checkpoint(tmp_path_factory.mktemp("falcon_h1_serve") / "ckpt", seed=2)
    with serve_subprocess(path, "--served-model-name", "falcon", "--enable-prefix-caching",
                          "--speculative-config", NGRAM, "--shutdown-timeout", "5") as (url, _, _):
        yield url


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def test_chat_and_completions_with_prefix_caching_and_ngram(url: str) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["falcon"]
    messages = [{"role": "system", "content": "You answer in one line. " * 4},
                {"role": "user", "content": "Name three rivers, then name them again."}]
    first = client.chat.completions.create(model="falcon", messages=messages,  # type: ignore[arg-type]
                                           max_tokens=16, temperature=0)
    again = client.chat.completions.create(model="falcon", messages=messages,  # type: ignore[arg-type]
                                           max_tokens=16, temperature=0)
    assert first.usage is not None and first.usage.completion_tokens > 0
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert (again.usage.prompt_tokens_details.cached_tokens or 0) >= 16  # the prefix cache hit
    done = client.completions.create(model="falcon", prompt="one two three one two three one two", max_tokens=24,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert done.choices[0].finish_reason == "length" and done.usage is not None
    assert done.usage.completion_tokens == 24
    assert _metric(url, "hyserve:spec_decode_num_draft_tokens") > 0  # n-gram drafts were proposed

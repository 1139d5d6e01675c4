"""``hyserve serve`` on a tiny checkpoint of each Mamba2 family with prefix caching and n-gram speculation on, on the
CPU, asked with the official ``openai`` client: chat and completions, the prefix cache hit by a repeated conversation
(the Mamba2 states restored from a snapshot), n-gram drafts proposed.

- Nemotron-H: Mamba2, attention and MLP blocks.
- Granite-4.0-H: Mamba2 and attention layers, each followed by the MoE and the shared MLP; a tied head; multipliers.
- Falcon-H1: Mamba2 and attention in every layer (each layer's Mamba2 states restored beside its shared KV blocks),
  muP multipliers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from hyserve.testing.falcon_h1 import write_tiny_falcon_h1_checkpoint
from hyserve.testing.granitemoehybrid import GRANITE_H_PATTERNS, write_tiny_granitemoehybrid_checkpoint
from hyserve.testing.nemotron_h import NEMOTRON_H_PATTERNS, write_tiny_nemotron_h_checkpoint
from hyserve.testing.server import serve_subprocess

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
WRITERS: dict[str, Callable[[Path], str]] = {
    "nemotron": lambda d: write_tiny_nemotron_h_checkpoint(d, layer_types=NEMOTRON_H_PATTERNS["mamba_run"], seed=3),
    "granite": lambda d: write_tiny_granitemoehybrid_checkpoint(d, layer_types=GRANITE_H_PATTERNS["mamba_run"],
                                                                seed=3),
    # seed 2: the tiny model's greedy text repeats, so prompt lookup proposes drafts
    "falcon": lambda d: write_tiny_falcon_h1_checkpoint(d, seed=2),
}


# Nemotron-H served by default; Granite and Falcon-H1 in the slow suite (the suite's budget: 8-11 s each to start;
# their engine tests run by default)
@pytest.fixture(scope="module", params=[n if n == "nemotron" else pytest.param(n, marks=pytest.mark.slow)
                                        for n in WRITERS])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    name = request.param
    path = WRITERS[name](tmp_path_factory.mktemp(f"{name}_serve") / "ckpt")
    with serve_subprocess(path, "--served-model-name", name, "--enable-prefix-caching",
                          "--speculative-config", NGRAM, "--shutdown-timeout", "5") as (url, _, _):
        yield name, url


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def test_chat_and_completions_with_prefix_caching_and_ngram(served: tuple[str, str]) -> None:
    name, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == [name]
    messages = [{"role": "system", "content": "You answer in one line. " * 4},
                {"role": "user", "content": "Name three rivers, then name them again."}]
    first = client.chat.completions.create(model=name, messages=messages,  # type: ignore[arg-type]
                                           max_tokens=16, temperature=0)
    again = client.chat.completions.create(model=name, messages=messages,  # type: ignore[arg-type]
                                           max_tokens=16, temperature=0)
    assert first.usage is not None and first.usage.completion_tokens > 0
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert (again.usage.prompt_tokens_details.cached_tokens or 0) >= 16  # the prefix cache hit
    done = client.completions.create(model=name, prompt="one two three one two three one two", max_tokens=24,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert done.choices[0].finish_reason == "length" and done.usage is not None
    assert done.usage.completion_tokens == 24
    assert _metric(url, "hyserve:spec_decode_num_draft_tokens") > 0  # n-gram drafts were proposed

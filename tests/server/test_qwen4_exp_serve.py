"""Issue report 1's serve line (``VLLM_PP_LAYER_PARTITION=13,13,13,9 vllm serve MODEL --pipeline-parallel-size 4
--max-num-seqs 8 --enable-prefix-caching --mamba-cache-mode align --speculative-config '{"method": "mtp",
"num_speculative_tokens": 4}' --compilation-config '{"cudagraph_mode": "FULL_AND_PIECEWISE"}'``, async scheduling
being vLLM's default) with ``hyserve`` in vllm's place, on a tiny Qwen4-Exp VLM checkpoint with an MTP head (nine
layers split 3,3,2,1), on the CPU (the stages' graphs emulated), asked with the official ``openai`` client: chat
and completions (text), the prefix cache hit by a repeated prompt. Every flag of the line is accepted (the
startup log names the partition, the graph mode and align). Images: a screenshot turn answered through the
same line, and again from the prefix cache."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import httpx
import openai
import pytest

from hyserve.testing import png_data_url, tiny_png
from hyserve.testing.qwen4_exp import write_tiny_qwen4_exp_checkpoint
from hyserve.testing.server import child_pids, process_gone, serve_subprocess

GDN, ATTN = "linear_attention", "full_attention"
NINE = [GDN, GDN, ATTN, GDN, GDN, ATTN, GDN, ATTN, GDN]
SEED_1_FLAGS = ["--pipeline-parallel-size", "4", "--max-num-seqs", "8", "--enable-prefix-caching",
                "--mamba-cache-mode", "align", "--speculative-config",
                '{"method": "mtp", "num_speculative_tokens": 4}',
                "--compilation-config", '{"cudagraph_mode": "FULL_AND_PIECEWISE"}', "--async-scheduling"]


class Served:
    def __init__(self, url: str, log: IO[str], proc: subprocess.Popen[str]) -> None:
        self.url, self.log, self.proc = url, log, proc

    def client(self, timeout: float = 60) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, timeout=timeout)

    def log_text(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name) and not line.startswith("#"))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    path = write_tiny_qwen4_exp_checkpoint(tmp_path_factory.mktemp("qwen4_serve") / "ckpt", form="vlm",
                                           layer_types=NINE, ple_layer_ids=[2, 5, 9], indexer_n_heads=8,
                                           with_mtp=True)
    assert Path(path, "preprocessor_config.json").exists()
    env = {"VLLM_PP_LAYER_PARTITION": "3,3,2,1", "HYSERVE_EMULATE_CUDA_GRAPHS": "1",
           "HYSERVE_WORKER_MULTIPROC_METHOD": "exec"}  # the workers are the server's children (checked at the end)
    with serve_subprocess(path, "--served-model-name", "flash-next", *SEED_1_FLAGS, "--shutdown-timeout", "5",
                          env=env) as (url, proc, log):
        workers = child_pids(proc.pid)
        yield Served(url, log, proc)
    assert all(process_gone(pid) for pid in workers)


def test_every_flag_of_the_line_is_taken(served: Served) -> None:
    log = served.log_text()
    assert "VLLM_PP_LAYER_PARTITION=3,3,2,1: the 4 pipeline stages hold 3, 3, 2, 1 decoder layers" in log
    assert "cudagraph_mode=FULL_AND_PIECEWISE" in log and "--mamba-cache-mode align" in log
    assert "speculative decoding: mtp, 4 tokens per step" in log and "async scheduling is on" in log
    assert "max_num_seqs 8" in log and "prefix cache:" in log
    assert "WARNING" not in log and "refused" not in log, log


def test_chat_and_completions_with_the_openai_client(served: Served) -> None:
    client = served.client()
    assert [m.id for m in client.models.list().data] == ["flash-next"]
    messages = [{"role": "system", "content": "You are a terse assistant. " * 4},
                {"role": "user", "content": "Name three rivers."}]
    first = client.chat.completions.create(model="flash-next", messages=messages,  # type: ignore[arg-type]
                                           max_tokens=16, temperature=0)
    again = client.chat.completions.create(model="flash-next", messages=messages,  # type: ignore[arg-type]
                                           max_tokens=16, temperature=0)
    assert first.choices[0].finish_reason in ("length", "stop")
    assert first.usage is not None and first.usage.completion_tokens > 0
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert (again.usage.prompt_tokens_details.cached_tokens or 0) >= 16  # the prefix cache hit
    done = client.completions.create(model="flash-next", prompt="Once upon a time", max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert done.choices[0].finish_reason == "length" and done.usage is not None
    assert done.usage.completion_tokens == 24
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="flash-next", prompt="Once upon a time", max_tokens=24, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    assert streamed == done.choices[0].text
    assert served.metric("hyserve:spec_decode_num_draft_tokens") > 0  # MTP 4 drafted on the last stage


def test_images_are_answered_with_the_seed_flags_and_hit_the_prefix_cache(served: Served) -> None:
    """A screenshot turn asked twice (the second hits the prefix cache across the image) and a text turn after:
    answered through PP 4, MTP 4 and QSA with M-RoPE (the outputs against transformers are
    ``tests/model/test_qwen4_exp_images.py``'s)."""
    client = served.client(timeout=60)
    image = {"type": "image_url", "image_url": {"url": png_data_url(tiny_png(48, 40, 0))}}
    messages = [{"role": "system", "content": "You look at screens. " * 3},
                {"role": "user", "content": [{"type": "text", "text": "What is in it?"}, image]}]
    first = client.chat.completions.create(model="flash-next", max_tokens=12, temperature=0,
                                           messages=messages)  # type: ignore[arg-type]
    again = client.chat.completions.create(model="flash-next", max_tokens=12, temperature=0,
                                           messages=messages)  # type: ignore[arg-type]
    assert first.usage is not None and first.usage.completion_tokens > 0 and first.usage.prompt_tokens > 40
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert (again.usage.prompt_tokens_details.cached_tokens or 0) >= 32  # past the image's placeholders
    after = client.chat.completions.create(model="flash-next", max_tokens=4, temperature=0,
                                           messages=[{"role": "user", "content": "still there?"}])
    assert after.choices[0].message.content is not None

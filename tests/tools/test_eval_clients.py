"""Evaluation and benchmark clients run end to end against a real ``hyserve serve`` on the packaged model.

One ``hyserve serve`` subprocess (the packaged default model, float32 on the CPU, a served name of its own) answers
three client runs, each a subprocess of the client's own CLI with the Hugging Face hub and datasets offline (the
tokenizer is the model directory, the tasks are local files):

- guidellm's default streaming chat benchmark (synthetic prompts of 16 tokens, 8 output tokens each);
- lm-eval's ``local-chat-completions`` on a tiny ``generate_until`` task;
- lm-eval's ``local-completions`` on a tiny ``multiple_choice`` task (loglikelihoods, echo + logprobs).

Each test reads the client's own JSON output and checks it against numbers computed independently: the server's
own answer to a plain request, or transformers' float32 forward over the same tokens.
"""

from __future__ import annotations

import glob
import importlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from hyserve.llm import DEFAULT_MODEL_DIR
from hyserve.testing import load_reference_model, reference_logits
from hyserve.testing.server import free_port, wait_up

SERVED_NAME = "hyserve-eval"
CLIENT_TIMEOUT_S = 180


def _require(*modules: str) -> None:
    """The clients are in the test extra: a missing one fails (a skip would pass for a run that checked nothing)."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise AssertionError(f"{module} is missing: it is in the test extra (pip install -e '.[test]')") from e


def _client_env(tmp_path: Path) -> dict[str, str]:
    """Nothing may come from the network: the hub and datasets offline, caches under the test's own folder."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "HF_HOME": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _run_client(args: list[str], tmp_path: Path) -> str:
    proc = subprocess.run([sys.executable, "-m", *args], cwd=tmp_path, env=_client_env(tmp_path),
                          capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{args[0]} exited {proc.returncode}:\n{output[-4000:]}"
    return output


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """``hyserve serve`` on the packaged model (no model argument), float32 so loglikelihoods match the reference."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([sys.executable, "-m", "hyserve.cli", "serve", "--device", "cpu", "--dtype",
                                 "float32", "--port", str(port), "--served-model-name", SERVED_NAME],
                                stdout=log, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
        try:
            wait_up(proc, url)
            yield url
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)


def _post(url: str, route: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(url + route, json=body, timeout=60)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


@pytest.mark.slow  # 21 s: the suite's budget (the lm-eval clients stay)
def test_guidellm_streaming_benchmark_counts_every_token(server: str, tmp_path: Path) -> None:
    """guidellm's default run: streamed chat completions with ``stream_options: {include_usage,
    continuous_usage_stats}``, ``max_completion_tokens`` and ``ignore_eos`` for fixed output lengths, token counts
    taken from the server's usage.

    Failures it sees: a server that refuses any of those fields errors every request while guidellm still exits 0
    with tables of zeros (successful != 4, errored != 0); usage missing or wrong on the streamed chunks gives token
    counts of 0 or the raw prompt's 16 (not the templated prompt's count the server answers unstreamed); a stream
    that sends several tokens per chunk, or fewer/more than asked, breaks the 8 token iterations of 8 tokens; a
    streamed text that differs from the unstreamed answer for the same request fails the text check."""
    _require("guidellm")
    n_requests, prompt_tokens, output_tokens = 4, 16, 8
    out = tmp_path / "guidellm.json"
    _run_client(["guidellm", "run",
                 "--backend", f"kind=openai_http,target={server},model={SERVED_NAME},extras.body.temperature=0",
                 "--profile", "kind=synchronous",
                 "--constraint", f"kind=max_requests,count={n_requests}",
                 "--tokenizer", f"kind=hf_auto,model={DEFAULT_MODEL_DIR}",
                 "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
                 "--output", f"kind=json,path={out}",
                 "--disable-console-interactive"], tmp_path)
    report = json.loads(out.read_text())
    (bench,) = report["benchmarks"]
    assert bench["metrics"]["request_totals"] == {"successful": n_requests, "errored": 0, "incomplete": 0,
                                                  "total": n_requests}, bench["metrics"]["request_totals"]
    assert not bench["requests"]["errored"] and not bench["requests"]["incomplete"]
    requests = bench["requests"]["successful"]
    assert len(requests) == n_requests
    for req in requests:
        body = json.loads(req["request_args"])["body"]
        assert body["stream"] is True
        assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
        assert body["max_completion_tokens"] == output_tokens and body["ignore_eos"] is True
        assert body["temperature"] == 0  # greedy (the only extra passed), so the texts can be compared
        assert req["info"]["error"] is None and req["info"]["status"] == "completed"
        timings = req["info"]["timings"]
        assert timings["token_iterations"] == output_tokens, timings  # one streamed chunk per token
        assert req["output_tokens"] == output_tokens, req
        # The same request unstreamed: its usage is what guidellm must have read from the streamed chunks.
        plain = _post(server, "/v1/chat/completions", {k: v for k, v in body.items()
                                                        if k not in ("stream", "stream_options")})
        assert plain["usage"]["completion_tokens"] == output_tokens
        assert req["prompt_tokens"] == plain["usage"]["prompt_tokens"] > prompt_tokens, (req, plain["usage"])
        assert req["total_tokens"] == plain["usage"]["total_tokens"]
        assert req["output"] == plain["choices"][0]["message"]["content"]
    stats = bench["metrics"]["output_token_count"]["successful"]
    assert stats["mean"] == output_tokens and stats["count"] == n_requests, stats


GEN_DOCS = [{"question": "def fibonacci(n):", "answer": "x"},
            {"question": "Write a haiku about rain.", "answer": "y"},
            {"question": "import numpy as np", "answer": "z"}]
GEN_UNTIL, GEN_MAX_TOKENS = ["\n"], 16

MC_DOCS = [{"question": "def fibonacci(n):", "choices": ["return n", "pass", "if n < 2:"], "label": 2},
           {"question": "import numpy as", "choices": ["np", "pd"], "label": 0},
           {"question": "The capital of France is", "choices": ["Paris", "Rome", "Berlin", "a city"], "label": 0},
           {"question": "for i in", "choices": ["range(10):", "x", "enumerate(items):"], "label": 0}]


def _write_task(folder: Path, name: str, docs: list[dict[str, Any]], task_yaml: str) -> None:
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        f"test_split: test\n{task_yaml}")


def _samples(output_path: Path, task: str) -> list[dict[str, Any]]:
    (path,) = glob.glob(str(output_path / "**" / f"samples_{task}_*.jsonl"), recursive=True)
    lines = Path(path).read_text().splitlines()
    return sorted((json.loads(line) for line in lines), key=lambda s: s["doc_id"])


def _results(output_path: Path) -> dict[str, Any]:
    (path,) = glob.glob(str(output_path / "**" / "results_*.json"), recursive=True)
    out: dict[str, Any] = json.loads(Path(path).read_text())
    return out


@pytest.mark.slow  # 21 s: the suite's budget (loglikelihoods stay)
def test_lm_eval_chat_generate_until_gives_the_servers_greedy_answers(server: str, tmp_path: Path) -> None:
    """lm-eval ``local-chat-completions`` with ``--apply_chat_template`` on a local ``generate_until`` task, at
    lm-eval's default batch size.

    Failures it sees: a refused request (a sampling field lm-eval sends: seed, stop, max_tokens) fails the run; a
    missing or wrong answer per document (stop strings not applied, max_tokens not honoured, the messages not
    rendered as the server renders them) differs from the server's own greedy answer to the same messages."""
    _require("lm_eval", "tenacity")
    tasks, output_path = tmp_path / "tasks", tmp_path / "out"
    tasks.mkdir()
    _write_task(tasks, "hyserve_gen", GEN_DOCS,
                'output_type: generate_until\ndoc_to_text: "{{question}}"\ndoc_to_target: "{{answer}}"\n'
                f"generation_kwargs:\n  until: {json.dumps(GEN_UNTIL)}\n  max_gen_toks: {GEN_MAX_TOKENS}\n"
                "  do_sample: false\nmetric_list:\n  - metric: exact_match\n")
    _run_client(["lm_eval", "--model", "local-chat-completions", "--model_args",
                 f"base_url={server}/v1/chat/completions,model={SERVED_NAME},max_retries=1",
                 "--apply_chat_template", "--tasks", "hyserve_gen", "--include_path", str(tasks),
                 "--output_path", str(output_path), "--log_samples"], tmp_path)
    assert _results(output_path)["n-samples"]["hyserve_gen"] == {"original": len(GEN_DOCS),
                                                                 "effective": len(GEN_DOCS)}
    samples = _samples(output_path, "hyserve_gen")
    assert [s["doc"] for s in samples] == GEN_DOCS
    for doc, sample in zip(GEN_DOCS, samples, strict=True):
        messages = [{"role": "user", "content": doc["question"]}]
        assert json.loads(sample["arguments"]["gen_args_0"]["arg_0"][0]) == messages
        expected = _post(server, "/v1/chat/completions", {
            "model": SERVED_NAME, "messages": messages, "max_tokens": GEN_MAX_TOKENS, "temperature": 0,
            "stop": GEN_UNTIL})["choices"][0]["message"]["content"]
        assert expected, doc
        assert sample["resps"] == [[expected]], (doc, sample["resps"], expected)


def _reference_loglikelihoods(docs: list[dict[str, Any]]) -> list[list[float]]:
    """Each choice's loglikelihood as lm-eval defines it, computed with transformers on the packaged model: the
    context (the question) and the continuation (" " + choice) tokenized as lm-eval's causal ``_encode_pair`` does
    (the whole text, then the context's tokens cut off its front), then the sum of the float32 teacher-forced
    log-softmax values of the continuation's tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR, local_files_only=True)
    ref = load_reference_model(DEFAULT_MODEL_DIR)
    out = []
    for doc in docs:
        context = doc["question"]
        context_ids = tokenizer(context, add_special_tokens=False).input_ids
        per_choice = []
        for choice in doc["choices"]:
            whole = tokenizer(context + " " + choice, add_special_tokens=False).input_ids
            assert whole[:len(context_ids)] == context_ids, (context, choice)
            logprobs = torch.log_softmax(reference_logits(ref, whole).double(), dim=-1)
            per_choice.append(sum(float(logprobs[pos - 1, whole[pos]]) for pos in range(len(context_ids),
                                                                                          len(whole))))
        out.append(per_choice)
    return out


@pytest.mark.slow  # 22 s with the server's start and stop: the suite's budget (the echoed prompt logprobs lm-eval reads
# stay in tests/server/test_completions_api.py)
def test_lm_eval_completions_loglikelihoods_match_transformers(server: str, tmp_path: Path) -> None:
    """lm-eval ``local-completions`` on a local ``multiple_choice`` task: each choice is one request with the
    context + continuation token ids as the prompt, ``echo: true``, ``logprobs: 1``, ``max_tokens: 1``, and lm-eval
    sums the echoed prompt logprobs of the continuation.

    Failures it sees: echo refused (the run fails on its first request), a list of prompts refused, echoed
    logprobs off by a position, missing the first token or computed at another precision (each choice's sum must
    lie within 1e-3 of transformers' float32 forward), and an accuracy that does not follow the argmax."""
    _require("lm_eval", "tenacity", "transformers")
    tasks, output_path = tmp_path / "tasks", tmp_path / "out"
    tasks.mkdir()
    _write_task(tasks, "hyserve_mc", MC_DOCS,
                'output_type: multiple_choice\ndoc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
                'doc_to_target: "{{label}}"\nmetric_list:\n  - metric: acc\n')
    _run_client(["lm_eval", "--model", "local-completions", "--model_args",
                 f"base_url={server}/v1/completions,model={SERVED_NAME},tokenizer={DEFAULT_MODEL_DIR},"
                 "tokenizer_backend=huggingface,max_retries=1",
                 "--tasks", "hyserve_mc", "--include_path", str(tasks),
                 "--output_path", str(output_path), "--log_samples"], tmp_path)
    samples = _samples(output_path, "hyserve_mc")
    assert [s["doc"] for s in samples] == MC_DOCS
    reference = _reference_loglikelihoods(MC_DOCS)
    for doc, sample, ref in zip(MC_DOCS, samples, reference, strict=True):
        got = [float(r[0][0]) for r in sample["resps"]]
        assert len(got) == len(doc["choices"])
        assert all(math.isfinite(x) and x < 0 for x in got), got
        for choice, g, r in zip(doc["choices"], got, ref, strict=True):
            assert abs(g - r) <= 1e-3, (doc["question"], choice, g, r)
        best = max(range(len(ref)), key=ref.__getitem__)
        assert sample["acc"] == float(best == doc["label"]), (doc, got, ref, sample["acc"])
    accuracy = sum(float(max(range(len(r)), key=r.__getitem__) == d["label"]) for d, r in zip(MC_DOCS, reference,
                                                                                              strict=True))
    assert _results(output_path)["results"]["hyserve_mc"]["acc,none"] == pytest.approx(accuracy / len(MC_DOCS))

"""Operators' dashboards: vLLM's metric names beside hyserve's own on ``/metrics`` (counters, gauges, latency
histograms with vLLM's buckets), vLLM's published Grafana dashboard served unchanged, ``stream_options.
continuous_usage_stats``, the OpenAPI schema's status codes against the ones the server answers, ``/docs`` with no
internet, and the 404 that lists the routes.

A real uvicorn server on 127.0.0.1 over a tiny checkpoint (CPU, float32), driven by ``httpx`` and the ``openai``
client.
"""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hyserve.config import EngineConfig
from hyserve.engine.llm_engine import LLMEngine
from hyserve.engine.request_metrics import Histogram, build_1_2_5_buckets
from hyserve.server import AsyncEngine, build_app
from hyserve.server.routes.docs import assets_dir
from hyserve.testing import write_tiny_checkpoint
from hyserve.testing.server import ServerThread

MODEL = "tiny-qwen"
CACHE_BYTES = 64 * 1024 * 1024
PROMPTS = ["The quick brown fox", "def fibonacci(n: int) -> int:", "Hybrid models mix linear attention layers"]

# The metric names queried by vLLM's published Grafana dashboard, examples/online_serving/prometheus_grafana/
# grafana.json of the vllm-project/vllm repository (as of commit 004f771f, vLLM's V1 engine era: no swapped
# requests, still vllm:gpu_cache_usage_perc and vllm:time_per_output_token_seconds), every one as its PromQL names
# it; its model_name variable is label_values({__name__=~"vllm:.*"}, model_name).
GRAFANA_DASHBOARD_METRICS = (
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket", "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count",
    "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:gpu_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
)
# The other names operators know from vLLM's loggers.py (vllm/v1/metrics/loggers.py).
VLLM_METRICS = (
    "vllm:kv_cache_usage_perc", "vllm:inter_token_latency_seconds_bucket", "vllm:request_inference_time_seconds_sum",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
    "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
)
# vLLM's bucket boundaries, written out (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0]
REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0]


def _engine(path: str, **kw: Any) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, device="cpu", dtype="float32", cpu_cache_memory_bytes=CACHE_BYTES,
                                  **kw))


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("vllm-metrics") / MODEL))


@pytest.fixture(scope="module")
def server(path: str) -> Iterator[ServerThread]:
    with ServerThread(AsyncEngine(_engine(path), start=False)) as srv:
        yield srv


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(srv: ServerThread) -> Samples:
    """Every sample of /metrics, keyed (sample name, labels)."""
    r = httpx.get(srv.url + "/metrics")
    assert r.status_code == 200
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    """The one sample ``name`` whose labels include ``labels`` (model_name and engine are checked)."""
    found = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def buckets(samples: Samples, name: str) -> list[tuple[float, float]]:
    out = sorted((float(dict(ls)["le"]), v) for (n, ls), v in samples.items() if n == f"{name}_bucket")
    assert out, name
    return out


def run_completions(srv: ServerThread) -> tuple[int, int, int]:
    """Known requests: (requests, prompt tokens, generated tokens) as the answers' usage counts them."""
    client = srv.client()
    n_prompt = n_out = 0
    for i, prompt in enumerate(PROMPTS):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3 + 2 * i, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.usage is not None and r.usage.completion_tokens == 3 + 2 * i
        n_prompt += r.usage.prompt_tokens
        n_out += r.usage.completion_tokens
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert chat.usage is not None
    return len(PROMPTS) + 1, n_prompt + chat.usage.prompt_tokens, n_out + chat.usage.completion_tokens


# ---------------------------------------------------------------------------------------------------- metrics


def test_histogram_counts_each_value_in_its_bucket() -> None:
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 1.0, 3.0):  # a value on a bound counts in that bound's bucket (le is inclusive)
        h.observe(v)
    assert h.counts == [2, 2, 1] and h.count == 5 and h.sum == pytest.approx(4.65)
    assert h.cumulative() == [(0.1, 2), (1.0, 4), (float("inf"), 5)]
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)


def test_vllm_metrics_count_known_requests(server: ServerThread) -> None:
    server.settle()
    before = scrape(server)
    n, n_prompt, n_out = run_completions(server)
    server.settle()
    after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("vllm:prompt_tokens_total") == n_prompt
    assert delta("vllm:generation_tokens_total") == n_out
    assert delta("vllm:request_success_total", finished_reason="length") == n
    assert delta("vllm:request_success_total", finished_reason="stop") == 0
    for hist in ("vllm:e2e_request_latency_seconds", "vllm:time_to_first_token_seconds",
                 "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
                 "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
                 "vllm:request_max_num_generation_tokens"):
        assert delta(f"{hist}_count") == n, hist
    assert delta("vllm:request_prompt_tokens_sum") == n_prompt
    assert delta("vllm:request_generation_tokens_sum") == n_out
    # One inter-token observation per output step after the first: one token a step without speculation.
    assert delta("vllm:inter_token_latency_seconds_count") == n_out - n
    assert delta("vllm:time_per_output_token_seconds_count") == n_out - n
    assert delta("vllm:time_per_output_token_seconds_sum") == pytest.approx(
        delta("vllm:inter_token_latency_seconds_sum"))
    # Phases of the same requests: queue + prefill + decode never exceed end to end; the first token comes within it.
    e2e = delta("vllm:e2e_request_latency_seconds_sum")
    phases = sum(delta(f"vllm:request_{p}_time_seconds_sum") for p in ("queue", "prefill", "decode"))
    assert 0 < phases <= e2e + 1e-6
    assert 0 < delta("vllm:time_to_first_token_seconds_sum") <= e2e + 1e-6
    assert delta("vllm:request_inference_time_seconds_sum") == pytest.approx(
        delta("vllm:request_prefill_time_seconds_sum") + delta("vllm:request_decode_time_seconds_sum"), abs=1e-6)

    for name, bounds in (("vllm:time_to_first_token_seconds", TTFT_BUCKETS),
                         ("vllm:inter_token_latency_seconds", ITL_BUCKETS),
                         ("vllm:time_per_output_token_seconds", ITL_BUCKETS),
                         ("vllm:e2e_request_latency_seconds", REQUEST_BUCKETS),
                         ("vllm:request_queue_time_seconds", REQUEST_BUCKETS)):
        cumulative = buckets(after, name)
        assert [le for le, _ in cumulative] == [*bounds, float("inf")], name
        counts = [c for _, c in cumulative]
        assert counts == sorted(counts) and counts[-1] == value(after, f"{name}_count"), name
    # The tiny model answers within a second: every end-to-end observation is at or below the 1.0 s bucket.
    e2e_buckets = dict(buckets(after, "vllm:e2e_request_latency_seconds"))
    assert e2e_buckets[1.0] - dict(buckets(before, "vllm:e2e_request_latency_seconds"))[1.0] == n


def test_vllm_metrics_agree_with_hyserve_names(server: ServerThread) -> None:
    run_completions(server)
    server.settle()
    exposed = server.metrics()  # hyserve:* samples as exposed (no _total)
    samples = scrape(server)
    pairs = {"vllm:prompt_tokens_total": "hyserve:prompt_tokens",
             "vllm:generation_tokens_total": "hyserve:generation_tokens",
             "vllm:num_requests_running": "hyserve:num_requests_running",
             "vllm:num_requests_waiting": "hyserve:num_requests_waiting",
             "vllm:kv_cache_usage_perc": "hyserve:kv_cache_usage_perc",
             "vllm:gpu_cache_usage_perc": "hyserve:kv_cache_usage_perc",
             "vllm:prefix_cache_queries_total": "hyserve:prefix_cache_queries",
             "vllm:prefix_cache_hits_total": "hyserve:prefix_cache_hits",
             "vllm:num_preemptions_total": "hyserve:num_preemptions",
             "vllm:spec_decode_num_drafts_total": "hyserve:spec_decode_num_drafts"}
    for vllm_name, hyserve_name in pairs.items():
        assert value(samples, vllm_name) == exposed[hyserve_name], (vllm_name, hyserve_name)
    assert exposed["hyserve:prefix_cache_queries"] > 0
    finished = {r: value(samples, "vllm:request_success_total", finished_reason=r)
                for r in ("stop", "length", "abort", "error")}
    assert finished["stop"] + finished["length"] == exposed["hyserve:request_success"] > 0
    assert finished["abort"] == exposed["hyserve:request_aborted"]
    assert finished["error"] == exposed["hyserve:request_errors"]
    assert value(samples, "vllm:e2e_request_latency_seconds_count") == sum(finished.values()) \
        == exposed["hyserve:num_requests"]
    # Every vllm:* series is labelled as vLLM labels it.
    vllm_samples = [ls for (n, ls) in samples if n.startswith("vllm:")]
    assert vllm_samples and all({("model_name", MODEL), ("engine", "0")} <= ls for ls in vllm_samples)


def test_vllm_grafana_dashboard_queries_are_all_served(server: ServerThread) -> None:
    run_completions(server)
    samples = scrape(server)
    served = {n for (n, ls) in samples if ("model_name", MODEL) in ls}
    missing = [m for m in (*GRAFANA_DASHBOARD_METRICS, *VLLM_METRICS) if m not in served]
    assert not missing, f"vLLM's dashboard queries what /metrics does not serve: {missing}"


def test_speculative_decoding_vllm_counters(path: str) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    with ServerThread(AsyncEngine(_engine(path, speculative_config=spec), start=False), "spec") as srv:
        srv.client().completions.create(model="spec", prompt="a b c a b c a b c a b c a b", max_tokens=24,
                                        temperature=0, extra_body={"ignore_eos": True})
        srv.settle()
        exposed, samples = srv.metrics(), scrape(srv)
        assert value(samples, "vllm:spec_decode_num_drafts_total") == exposed["hyserve:spec_decode_num_drafts"] > 0
        assert value(samples, "vllm:spec_decode_num_draft_tokens_total") == \
            exposed["hyserve:spec_decode_num_draft_tokens"]
        accepted = value(samples, "vllm:spec_decode_num_accepted_tokens_total")
        assert accepted == exposed["hyserve:spec_decode_num_accepted_tokens"]
        per_pos = {dict(ls)["position"]: v for (n, ls), v in samples.items()
                   if n == "vllm:spec_decode_num_accepted_tokens_per_pos_total"}
        assert per_pos and sum(per_pos.values()) == accepted
        assert per_pos == {k[len('hyserve:spec_decode_num_accepted_tokens_per_pos{position="'):-2]: v
                           for k, v in exposed.items() if k.startswith("hyserve:spec_decode_num_accepted_tokens_per")}
        # One inter-token observation per output step, and a verify step emits its accepted drafts and one more
        # token: 24 tokens take 24 - accepted steps (accepted drafts cut off at max_tokens, up to 3, aside).
        itl = value(samples, "vllm:inter_token_latency_seconds_count")
        assert 23 - accepted <= itl <= 23 - accepted + 3


# ---------------------------------------------------------------------------------------------------- usage


@pytest.mark.parametrize("include_usage", [True, False])
@pytest.mark.parametrize("api", ["completions", "chat"])
def test_continuous_usage_stats(server: ServerThread, api: str, include_usage: bool) -> None:
    client = server.client()
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 9, "temperature": 0}
    extra = {"ignore_eos": True, "return_token_ids": True}
    if api == "completions":
        whole = client.completions.create(prompt=PROMPTS[1], extra_body=extra, **kw)
        stream: Any = client.completions.create(prompt=PROMPTS[1], stream=True, extra_body=extra, stream_options={
            "include_usage": include_usage, "continuous_usage_stats": True}, **kw)  # type: ignore[typeddict-unknown-key]
    else:
        messages: Any = [{"role": "user", "content": PROMPTS[1]}]
        whole = client.chat.completions.create(messages=messages, extra_body=extra, **kw)
        stream = client.chat.completions.create(messages=messages, stream=True, extra_body=extra, stream_options={
            "include_usage": include_usage, "continuous_usage_stats": True}, **kw)  # type: ignore[typeddict-unknown-key]
    assert whole.usage is not None
    sent = 0
    content_chunks = 0
    final_usage = None
    for chunk in stream:
        if not chunk.choices:  # the usage-only chunk (include_usage)
            final_usage = chunk.usage
            continue
        content_chunks += 1
        assert chunk.usage is not None, "a chunk without usage"
        sent += len(getattr(chunk.choices[0], "token_ids", None) or [])
        assert chunk.usage.prompt_tokens == whole.usage.prompt_tokens
        assert chunk.usage.completion_tokens == sent, "completion_tokens is not the count sent so far"
        assert chunk.usage.total_tokens == whole.usage.prompt_tokens + sent
    assert content_chunks > 2 and sent == whole.usage.completion_tokens == 9
    if include_usage:
        assert final_usage is not None
        assert (final_usage.prompt_tokens, final_usage.completion_tokens, final_usage.total_tokens) == (
            whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens)
    else:
        assert final_usage is None


def test_usage_left_out_of_chunks_unless_asked(server: ServerThread) -> None:
    lines = []
    with httpx.stream("POST", server.url + "/v1/completions", json={
            "model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True}, timeout=30) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    assert lines and not any('"usage"' in line for line in lines)


# ---------------------------------------------------------------------------------------------------- routes


@pytest.mark.parametrize(("method", "route"), [("POST", "/v1/embeddings"), ("POST", "/pooling"),
                                               ("POST", "/v1/audio/transcriptions"), ("GET", "/v1/nothing")])
def test_unknown_route_404_lists_the_routes(server: ServerThread, method: str, route: str) -> None:
    r = httpx.request(method, server.url + route, json={"input": "x"})
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["code"] == "route_not_found" and error["type"] == "invalid_request_error"
    listed = set(re.findall(r"(?:GET|POST) /[\w/.]*", error["message"]))
    assert {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /health", "GET /metrics",
            "GET /version"} <= listed
    assert f"{method} {route}" in error["message"]
    # A 404 a route answers (an unknown model) keeps its own message.
    r = httpx.post(server.url + "/v1/completions", json={"model": "other", "prompt": "hi"})
    assert r.status_code == 404 and "route_not_found" not in r.text and "other" in r.json()["error"]["message"]


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_load_nothing_from_elsewhere(server: ServerThread, page: str) -> None:
    r = httpx.get(server.url + page)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", r.text, re.IGNORECASE), \
        "the page loads something from another host"
    if assets_dir() is None:
        assert "fastapi-offline" in r.text and "/openapi.json" in r.text
        return
    refs = re.findall(r"""(?:src|href)=["']([^"']+)["']""", r.text)
    refs += re.findall(r"""(?:url|spec-url)[:=]\s*["']([^"']+)["']""", r.text)
    assert any(ref.endswith(".js") for ref in refs) and "/openapi.json" in refs, refs
    for ref in refs:
        assert ref.startswith("/"), ref
        assert httpx.get(server.url + ref).status_code == 200, ref


def _slow_body_status(srv: ServerThread, route: str) -> int:
    """A body that stops arriving: the server answers 408 (or closes the connection)."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as s:
        s.sendall(f"POST {route} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\nContent-Type: application/json\r\n"
                  "Content-Length: 100\r\n\r\n{".encode())
        data = s.recv(4096).decode(errors="replace")
    return int(data.split()[1])


def test_openapi_documents_the_statuses_the_server_answers(path: str) -> None:
    """For every route, the status codes the schema declares are the ones these requests provoke."""
    provoked: dict[tuple[str, str], set[int]] = {}

    def record(method: str, route: str, status: int) -> None:
        provoked.setdefault((method, route), set()).add(status)

    auth = {"Authorization": "Bearer k"}
    aengine = AsyncEngine(_engine(path), start=False)
    app = build_app(aengine, MODEL, api_key="k", max_request_body_bytes=4096, body_read_timeout_s=0.3)
    with ServerThread(aengine, app=app) as srv:
        doc = httpx.get(srv.url + "/openapi.json").json()
        for route, good in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {
                "messages": [{"role": "user", "content": "hi"}]})):
            url = srv.url + route
            for body, headers in (({**good, "max_tokens": 2}, auth), ({**good, "seed": -1}, auth), (good, {}),
                                  ({**good, "model": "other"}, auth), ({**good, "pad": "x" * 5000}, auth)):
                record("post", route, httpx.post(url, json={"model": MODEL, **body}, headers=headers,
                                                 timeout=30).status_code)
            record("post", route, _slow_body_status(srv, route))
        for route, good in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1, 2]})):
            for body in (good, {**good, "seed": -1}, {**good, "model": "other"}, {**good, "pad": "x" * 5000}):
                r = httpx.post(srv.url + route, json={"model": MODEL, **body}, timeout=30)
                record("post", route, r.status_code)
            record("post", route, _slow_body_status(srv, route))
        for route in ("/v1/models", "/health", "/version", "/metrics"):
            record("get", route, httpx.get(srv.url + route, headers=auth).status_code)
        record("get", "/v1/models", httpx.get(srv.url + "/v1/models").status_code)
        srv.settle()
        aengine.shutdown()  # the engine loop stops: what a dead engine answers
        deadline = time.monotonic() + 10
        while aengine.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        record("get", "/health", httpx.get(srv.url + "/health").status_code)
        for route, good in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {
                "messages": [{"role": "user", "content": "hi"}]})):
            record("post", route, httpx.post(srv.url + route, json={"model": MODEL, **good}, headers=auth,
                                             timeout=30).status_code)
    documented = {(method, route): {int(s) for s in op["responses"] if s.isdigit()}
                  for route, ops in doc["paths"].items() for method, op in ops.items()}
    assert documented == provoked
    assert all(
        op["responses"][s]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
        for ops in doc["paths"].values() for op in ops.values() for s in op["responses"] if s[0] in "45")
    assert "422" not in str(doc)

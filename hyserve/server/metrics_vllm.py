"""The ``vllm:*`` series of ``/metrics``, beside hyserve's own ``hyserve:*`` ones, so that dashboards and alerts built
for vLLM (its published Grafana dashboard, guidellm, autoscalers reading ``vllm:num_requests_waiting``) work
unchanged.

Names, types, labels and histogram buckets are vLLM's (``vllm/v1/metrics/loggers.py``): every series carries
``model_name`` (the served name) and ``engine="0"``; counters are written as prometheus_client writes them (``# TYPE
vllm:prompt_tokens counter``, sample ``vllm:prompt_tokens_total``); latencies are histograms (``_bucket{le=...}``,
``_sum``, ``_count``). The values are the engine's: the counters and gauges are the ``hyserve:*`` values of the same
meaning, the histograms ``hyserve.engine.request_metrics``'. ``vllm:time_per_output_token_seconds`` (the name vLLM's
published dashboard still queries) holds the same observations as ``vllm:inter_token_latency_seconds``, as in vLLM;
``vllm:gpu_cache_usage_perc`` (likewise) the same value as ``vllm:kv_cache_usage_perc``; with one completion per
request ``vllm:request_max_num_generation_tokens`` is ``vllm:request_generation_tokens``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from hyserve.engine.request_metrics import Histogram, RequestMetrics

__all__ = ["VLLM_COUNTERS", "VLLM_GAUGES", "VLLM_HISTOGRAMS", "render_vllm_metrics"]

LABELS = ("model_name", "engine")
ENGINE_INDEX = "0"

# vllm name -> (hyserve engine key it mirrors, help text).
VLLM_GAUGES = {
    "vllm:num_requests_running": ("hyserve:num_requests_running", "Number of requests in model execution batches."),
    "vllm:num_requests_waiting": ("hyserve:num_requests_waiting", "Number of requests waiting to be processed."),
    "vllm:kv_cache_usage_perc": ("hyserve:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
    "vllm:gpu_cache_usage_perc": ("hyserve:kv_cache_usage_perc",
                                  "KV-cache usage. 1 means 100 percent usage (vllm:kv_cache_usage_perc's old name)."),
}
VLLM_COUNTERS = {
    "vllm:prompt_tokens": ("hyserve:prompt_tokens", "Number of prefill tokens processed."),
    "vllm:generation_tokens": ("hyserve:generation_tokens", "Number of generation tokens processed."),
    "vllm:num_preemptions": ("hyserve:num_preemptions", "Cumulative number of preemptions from the engine."),
    "vllm:prefix_cache_queries": ("hyserve:prefix_cache_queries",
                                  "Prefix cache queries, in terms of number of queried tokens."),
    "vllm:prefix_cache_hits": ("hyserve:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
    "vllm:spec_decode_num_drafts": ("hyserve:spec_decode_num_drafts", "Number of spec decoding drafts."),
    "vllm:spec_decode_num_draft_tokens": ("hyserve:spec_decode_num_draft_tokens", "Number of draft tokens."),
    "vllm:spec_decode_num_accepted_tokens": ("hyserve:spec_decode_num_accepted_tokens",
                                             "Number of accepted tokens."),
}
# vllm name -> (RequestMetrics field, help text).
VLLM_HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": ("ttft", "Histogram of time to first token in seconds."),
    "vllm:inter_token_latency_seconds": ("inter_token", "Histogram of inter-token latency in seconds."),
    "vllm:time_per_output_token_seconds": ("inter_token", "Histogram of time per output token in seconds "
                                                          "(vllm:inter_token_latency_seconds' old name)."),
    "vllm:e2e_request_latency_seconds": ("e2e", "Histogram of e2e request latency in seconds."),
    "vllm:request_queue_time_seconds": ("queue", "Histogram of time spent in WAITING phase for request."),
    "vllm:request_inference_time_seconds": ("inference", "Histogram of time spent in RUNNING phase for request."),
    "vllm:request_prefill_time_seconds": ("prefill", "Histogram of time spent in PREFILL phase for request."),
    "vllm:request_decode_time_seconds": ("decode", "Histogram of time spent in DECODE phase for request."),
    "vllm:request_prompt_tokens": ("prompt_tokens", "Number of prefill tokens processed."),
    "vllm:request_generation_tokens": ("generation_tokens", "Number of generation tokens processed."),
    "vllm:request_max_num_generation_tokens": ("generation_tokens",
                                               "Histogram of maximum number of requested generation tokens."),
}


def _histogram(name: str, doc: str, labels: list[str], h: Histogram) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=list(LABELS))
    family.add_metric(labels, buckets=[(floatToGoString(bound), float(n)) for bound, n in h.cumulative()],
                      sum_value=h.sum)
    return family


class _Snapshot(Collector):
    """One scrape's values as prometheus_client metric families."""

    def __init__(self, engine: Mapping[str, float | Sequence[float]], requests: RequestMetrics,
                 model_name: str) -> None:
        self.engine, self.requests, self.labels = engine, requests, [model_name, ENGINE_INDEX]

    def collect(self) -> Iterator[Metric]:
        for name, (key, doc) in VLLM_GAUGES.items():
            g = GaugeMetricFamily(name, doc, labels=list(LABELS))
            g.add_metric(self.labels, float(self._scalar(key)))
            yield g
        for name, (key, doc) in VLLM_COUNTERS.items():
            c = CounterMetricFamily(name, doc, labels=list(LABELS))
            c.add_metric(self.labels, float(self._scalar(key)))
            yield c
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=[*LABELS, "finished_reason"])
        for reason, n in sorted(self.requests.finished.items()):
            success.add_metric([*self.labels, reason], float(n))
        yield success
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.", labels=[*LABELS, "position"])
        accepted = self.engine.get("hyserve:spec_decode_num_accepted_tokens_per_pos")
        per_position: Sequence[float] = accepted if isinstance(accepted, Sequence) else ()
        for i, accepted_at in enumerate(per_position):
            per_pos.add_metric([*self.labels, str(i)], float(accepted_at))
        yield per_pos
        for name, (attr, doc) in VLLM_HISTOGRAMS.items():
            yield _histogram(name, doc, self.labels, getattr(self.requests, attr))

    def _scalar(self, key: str) -> float:
        value = self.engine.get(key, 0.0)
        return 0.0 if isinstance(value, Sequence) else float(value)


def render_vllm_metrics(engine: Mapping[str, float | Sequence[float]], requests: RequestMetrics,
                        model_name: str) -> str:
    """The ``vllm:*`` series in the text exposition format 0.0.4, from one snapshot of the engine's metrics."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(engine, requests, model_name))
    return generate_latest(registry).decode("utf-8")

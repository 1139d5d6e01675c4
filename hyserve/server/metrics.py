"""``/metrics``: the engine's ``get_metrics()`` and the server's HTTP counters in Prometheus text format (0.0.4).

Every engine key keeps its name, colon included (``hyserve:prefix_cache_hits``): cumulative values are typed
``counter``, the rest ``gauge`` (keys this module does not know yet are exported as gauges). Counters keep the
engine's names rather than getting a ``_total`` suffix, so the names in the README, ``get_metrics()`` and Prometheus
are the same. A list-valued metric (``hyserve:spec_decode_num_accepted_tokens_per_pos``) becomes one series per
position, labelled ``{position="0"}``, ``{position="1"}``, ...

The server's own series: ``hyserve:http_requests_total{method, path, status}`` and
``hyserve:http_requests_in_progress``. Every label takes a bounded set of values, so that scanners cannot blow up
the label set: ``path`` is the route template or ``other`` for unknown paths, ``method`` one of ``HTTP_METHODS`` or
``other``, ``status`` a three-digit code.

vLLM's names for the same numbers (``vllm:*``, with its latency histograms) follow them on ``/metrics``:
``hyserve.server.metrics_vllm``.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.utils import floatToGoString
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["CONTENT_TYPE_LATEST", "HTTPMetrics", "HTTPMetricsMiddleware", "render_metrics"]

# Engine keys that only grow (Prometheus counters); every other key is a gauge.
COUNTERS = frozenset({
    "hyserve:num_requests", "hyserve:prompt_tokens", "hyserve:generation_tokens", "hyserve:scheduled_tokens",
    "hyserve:num_steps", "hyserve:step_time_seconds", "hyserve:request_success", "hyserve:request_aborted",
    "hyserve:request_errors", "hyserve:num_preemptions", "hyserve:prefix_cache_queries",
    "hyserve:prefix_cache_hits", "hyserve:prefix_cache_snapshot_hits", "hyserve:prefix_cache_snapshot_misses",
    "hyserve:prefix_cache_snapshots_taken", "hyserve:prefix_cache_snapshot_evictions",
    "hyserve:prefix_cache_snapshot_host_hits", "hyserve:prefix_cache_snapshot_offloads",
    "hyserve:prefix_cache_kv_evictions", "hyserve:mm_cache_queries", "hyserve:mm_cache_hits",
    "hyserve:spec_decode_num_drafts", "hyserve:spec_decode_num_draft_tokens",
    "hyserve:spec_decode_num_accepted_tokens", "hyserve:spec_decode_num_accepted_tokens_per_pos",
    "hyserve:spec_decode_steps_per_k",
})

HELP = {
    "hyserve:num_requests": "Requests added to the engine.",
    "hyserve:prompt_tokens": "Prompt tokens of the requests added.",
    "hyserve:generation_tokens": "Tokens generated (sampled or accepted).",
    "hyserve:scheduled_tokens": "Tokens computed by the model (prefill chunks, decode and verify rows).",
    "hyserve:num_steps": "Engine steps run.",
    "hyserve:step_time_seconds": "Seconds spent in engine steps.",
    "hyserve:request_success": "Requests finished by EOS, a stop condition or their length limit.",
    "hyserve:request_aborted": "Requests aborted (client disconnects included).",
    "hyserve:request_errors": "Requests finished with an error (non-finite logits).",
    "hyserve:num_preemptions": "Requests preempted (recomputed) because the KV cache ran out.",
    "hyserve:num_requests_running": "Requests running now.",
    "hyserve:num_requests_waiting": "Requests waiting for admission now.",
    "hyserve:kv_cache_usage_perc": "Share of KV blocks in use (0..1).",
    "hyserve:state_slots_usage_perc": "Share of recurrent-state slots in use by requests (0..1).",
    "hyserve:prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "hyserve:prefix_cache_hits": "Prompt tokens served from the prefix cache.",
    "hyserve:prefix_cache_snapshot_hits": "Recurrent-state snapshots reused.",
    "hyserve:prefix_cache_snapshot_misses": "Prefix lookups that found no usable recurrent snapshot.",
    "hyserve:prefix_cache_snapshots_taken": "Recurrent-state snapshots taken.",
    "hyserve:prefix_cache_snapshot_evictions": "Recurrent-state snapshots evicted.",
    "hyserve:prefix_cache_snapshots": "Recurrent-state snapshots held now.",
    "hyserve:prefix_cache_snapshot_bytes": "Bytes held by recurrent-state snapshots now.",
    "hyserve:prefix_cache_snapshot_host_hits": "Snapshot hits served from the host tier (counted in snapshot_hits).",
    "hyserve:prefix_cache_snapshot_offloads": "Evicted resume-point snapshots moved to the host tier.",
    "hyserve:prefix_cache_host_snapshots": "Recurrent-state snapshots held in the host tier now.",
    "hyserve:prefix_cache_kv_blocks": "KV blocks held by the prefix cache now.",
    "hyserve:prefix_cache_kv_evictions": "Cached KV blocks evicted.",
    "hyserve:mm_cache_queries": "Images looked up in the multimodal processor cache.",
    "hyserve:mm_cache_hits": "Images found in the multimodal processor cache (not processed again).",
    "hyserve:spec_decode_num_drafts": "Speculative decoding: verify rows with at least one draft token.",
    "hyserve:spec_decode_num_draft_tokens": "Speculative decoding: draft tokens proposed.",
    "hyserve:spec_decode_num_accepted_tokens": "Speculative decoding: draft tokens accepted.",
    "hyserve:spec_decode_num_accepted_tokens_per_pos": "Speculative decoding: drafts accepted at each position.",
    "hyserve:spec_decode_steps_per_k": "Speculative decoding: steps with verify rows at each speculation length "
                                       "(the position label is k_step).",
}

HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})

_NAME_RE = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_BAD_CHARS = re.compile(r"[^a-zA-Z0-9_:]")


def _metric_name(key: str) -> str:
    if _NAME_RE.match(key):
        return key
    name = _BAD_CHARS.sub("_", key)
    return name if _NAME_RE.match(name) else "_" + name


def _value(x: Any) -> str:
    v = float(x)
    return floatToGoString(v) if not math.isnan(v) else "NaN"


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


def _escape_label(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape_label(v)}"' for k, v in sorted(labels.items())) + "}"


def render_engine_metrics(metrics: Mapping[str, float | Sequence[float]]) -> list[str]:
    lines: list[str] = []
    for key in sorted(metrics):
        value = metrics[key]
        name = _metric_name(key)
        kind = "counter" if key in COUNTERS else "gauge"
        lines.append(f"# HELP {name} {_escape_help(HELP.get(key, f'hyserve engine metric {key}.'))}")
        lines.append(f"# TYPE {name} {kind}")
        if isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                lines.append(f"{name}{_labels({'position': str(i)})} {_value(v)}")
        else:
            lines.append(f"{name} {_value(value)}")
    return lines


class HTTPMetrics:
    """Thread-safe HTTP request counters."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: dict[tuple[str, str, str], int] = {}
        self._in_progress = 0

    def started(self) -> None:
        with self._lock:
            self._in_progress += 1

    def finished(self, method: str, path: str, status: int) -> None:
        with self._lock:
            self._in_progress -= 1
            key = (method, path, str(status))
            self._requests[key] = self._requests.get(key, 0) + 1

    def count(self, method: str, path: str, status: int) -> int:
        with self._lock:
            return self._requests.get((method, path, str(status)), 0)

    def render(self) -> list[str]:
        with self._lock:
            requests = sorted(self._requests.items())
            in_progress = self._in_progress
        lines = ["# HELP hyserve:http_requests_total HTTP requests answered, by method, route and status.",
                 "# TYPE hyserve:http_requests_total counter"]
        for (method, path, status), n in requests:
            lines.append(f"hyserve:http_requests_total{_labels({'method': method, 'path': path, 'status': status})}"
                         f" {n}")
        lines += ["# HELP hyserve:http_requests_in_progress HTTP requests being answered now.",
                  "# TYPE hyserve:http_requests_in_progress gauge",
                  f"hyserve:http_requests_in_progress {in_progress}"]
        return lines


def render_metrics(engine_metrics: Mapping[str, float | Sequence[float]], http: HTTPMetrics | None) -> str:
    lines = render_engine_metrics(engine_metrics)
    if http is not None:
        lines += http.render()
    return "\n".join(lines) + "\n"


class HTTPMetricsMiddleware:
    """Pure ASGI middleware (it neither buffers streaming responses nor interferes with disconnect detection)."""

    def __init__(self, app: ASGIApp, metrics: HTTPMetrics, known_paths: frozenset[str] | set[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.known_paths = known_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        label = path if path in self.known_paths else "other"
        method = scope.get("method", "")
        method = method if method in HTTP_METHODS else "other"
        status = 500

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        self.metrics.started()
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.finished(method, label, status if 100 <= status <= 599 else 500)

"""A small client of a running OpenAI-compatible server (``hyserve serve`` or vLLM) for ``hyserve soak`` and
``hyserve bench``: ``/v1/completions`` with token-id prompts, plain or streamed, ``/v1/models`` and ``/metrics``.

Token ids of the output are needed (a soak turn's next prompt is built from them). They are asked for with vLLM's
``return_token_ids`` request field (the response's ``choices[i].token_ids``, also per chunk when streaming) and,
as a fallback, read from ``logprobs.tokens`` written as ``"token_id:N"`` (vLLM's ``return_tokens_as_token_ids``).
The client is shared by the driver's threads: ``httpx.Client`` is thread-safe and pools connections.

``CompletionsClient.abandon`` plays a client that gives up mid-flight (``hyserve soak --abort-fraction``): it closes
its connection before the response or after some streamed chunks, which a server must turn into an abort of the
request in its engine.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["NO_TOKEN_IDS", "Completion", "CompletionsClient", "StreamTiming", "parse_prometheus"]

NO_TOKEN_IDS = ("the server returned no output token ids: it must support vLLM's return_token_ids request field "
                "(choices[].token_ids) or return_tokens_as_token_ids with logprobs ('token_id:N' tokens)")



def _sse_chunks(response: Any) -> Iterator[dict[str, Any]]:
    """The JSON chunks of a server-sent event stream, up to its ``[DONE]``."""
    for line in response.iter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[len("data:"):].strip()
        if payload == "[DONE]":
            return
        yield json.loads(payload)

@dataclass(slots=True)
class Completion:
    """One finished completion, whichever way it ran (offline engine or server).

    ``top_logprobs[i]`` maps token id -> logprob at output position ``i`` (when logprobs were asked for).
    """

    token_ids: list[int] | None
    text: str | None
    finish_reason: str | None
    top_logprobs: list[dict[int, float]] | None = None
    num_cached_tokens: int | None = None
    error: str | None = None


@dataclass(slots=True)
class StreamTiming:
    """Client-side timings of one streamed completion, in seconds from the request's start."""

    ttft_s: float
    e2e_s: float
    num_output_tokens: int
    finish_reason: str | None


def _token_id(key: str) -> int | None:
    if key.startswith("token_id:"):
        try:
            return int(key[len("token_id:"):])
        except ValueError:
            return None
    return None


def _choice_token_ids(choice: dict[str, Any]) -> list[int] | None:
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        return [int(t) for t in ids]
    lp = choice.get("logprobs")
    if isinstance(lp, dict) and isinstance(lp.get("tokens"), list):
        parsed = [_token_id(str(t)) for t in lp["tokens"]]
        if all(t is not None for t in parsed):
            return [int(t) for t in parsed if t is not None]
    return None


def _choice_top_logprobs(choice: dict[str, Any]) -> list[dict[int, float]] | None:
    lp = choice.get("logprobs")
    if not isinstance(lp, dict) or not isinstance(lp.get("top_logprobs"), list):
        return None
    out: list[dict[int, float]] = []
    tokens = lp.get("tokens") or []
    token_lps = lp.get("token_logprobs") or []
    for i, entry in enumerate(lp["top_logprobs"]):
        d: dict[int, float] = {}
        for k, v in (entry or {}).items():
            tid = _token_id(str(k))
            if tid is not None and v is not None:
                d[tid] = float(v)
        if i < len(tokens) and i < len(token_lps) and token_lps[i] is not None:
            tid = _token_id(str(tokens[i]))
            if tid is not None:
                d.setdefault(tid, float(token_lps[i]))
        out.append(d)
    return out


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{.*\})?\s+(\S+)")


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample values of a Prometheus text exposition, summed over label sets, by metric name.

    A counter exported as ``name_total`` is also listed under ``name`` (``prometheus_client`` adds the suffix).
    """
    values: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if m is None:
            continue
        name = m.group(1)
        try:
            value = float(m.group(2))
        except ValueError:
            continue
        if math.isnan(value):
            continue
        values[name] = values.get(name, 0.0) + value
        if name.endswith("_total"):
            base = name[: -len("_total")]
            values[base] = values.get(base, 0.0) + value
    return values


class CompletionsClient:
    """``/v1/completions`` of a running server, with token-id prompts."""

    def __init__(self, url: str, model: str | None = None, *, timeout_s: float = 600.0, max_connections: int = 64,
                 transport: Any = None) -> None:
        try:
            import httpx
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ValueError("talking to a server (--url) needs httpx: pip install httpx") from e
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        # ``transport``: an ``httpx`` transport to use instead of the network (tests pass ``httpx.MockTransport``).
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s, limits=limits, transport=transport)
        self._model = model

    def close(self) -> None:
        self._http.close()

    @property
    def model(self) -> str:
        """The served model name: the one given, else the first listed by ``/v1/models``."""
        if self._model is None:
            r = self._http.get("/v1/models")
            r.raise_for_status()
            data = r.json().get("data") or []
            if not data:
                raise ValueError(f"{self.url}/v1/models lists no model; pass --served-model-name")
            self._model = str(data[0]["id"])
        return self._model

    def _body(self, prompt_ids: Sequence[int], max_tokens: int, temperature: float, ignore_eos: bool,
              logprobs: int | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model, "prompt": list(prompt_ids), "max_tokens": max_tokens, "temperature": temperature,
            "ignore_eos": ignore_eos, "return_token_ids": True, "return_tokens_as_token_ids": True,
        }
        if logprobs is not None:
            body["logprobs"] = logprobs
        return body

    def complete(self, prompt_ids: Sequence[int], *, max_tokens: int, temperature: float = 0.0,
                 ignore_eos: bool = False, logprobs: int | None = None) -> Completion:
        """One completion; an HTTP or protocol failure comes back as ``Completion.error``, not an exception."""
        try:
            r = self._http.post("/v1/completions",
                                json=self._body(prompt_ids, max_tokens, temperature, ignore_eos, logprobs))
            if r.status_code != 200:
                return Completion(None, None, None, error=f"HTTP {r.status_code}: {r.text[:300]}")
            return self._completion(r.json())
        except Exception as e:  # network errors, bad JSON: reported per request
            return Completion(None, None, None, error=f"{type(e).__name__}: {e}")

    @staticmethod
    def _completion(data: dict[str, Any]) -> Completion:
        """A non-streamed ``/v1/completions`` body's first choice."""
        choice = data["choices"][0]
        ids = _choice_token_ids(choice)
        if ids is None:
            return Completion(None, choice.get("text"), choice.get("finish_reason"), error=NO_TOKEN_IDS)
        usage = data.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        return Completion(ids, choice.get("text"), choice.get("finish_reason"), _choice_top_logprobs(choice),
                          num_cached_tokens=int(cached) if isinstance(cached, int) else None)

    def abandon(self, prompt_ids: Sequence[int], *, max_tokens: int, temperature: float = 0.0,
                ignore_eos: bool = False, stream: bool = True, after_tokens: int = 0,
                delay_s: float = 0.0) -> tuple[Completion, bool]:
        """A completion whose client hangs up before it ends, closing its connection (the server must abort it):

        - ``stream=False``: a plain request whose client stops waiting ``delay_s`` seconds after sending it;
        - ``stream=True``, ``after_tokens`` = 0: a stream closed ``delay_s`` seconds after its response headers,
          before any chunk is read;
        - ``stream=True``, ``after_tokens`` >= 1: a stream closed as soon as ``after_tokens`` output tokens arrived.

        Returns the completion and whether it was abandoned. An abandoned one holds what the client received
        (``finish_reason="abort"``); one that finished first is whole, as :meth:`complete` would return it; HTTP
        and protocol failures come back as ``Completion.error`` (not abandoned).
        """
        import httpx

        body = self._body(prompt_ids, max_tokens, temperature, ignore_eos, None)
        if not stream:
            try:
                r = self._http.post("/v1/completions", json=body,
                                    timeout=httpx.Timeout(self.timeout_s, read=max(delay_s, 1e-3)))
                if r.status_code != 200:
                    return Completion(None, None, None, error=f"HTTP {r.status_code}: {r.text[:300]}"), False
                return self._completion(r.json()), False
            except httpx.TimeoutException:
                return Completion([], "", "abort"), True  # httpx drops the connection it gave up on
            except Exception as e:
                return Completion(None, None, None, error=f"{type(e).__name__}: {e}"), False
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        ids: list[int] = []
        text: list[str] = []
        finish: str | None = None
        cached: int | None = None
        try:
            with self._http.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    r.read()
                    return Completion(None, None, None, error=f"HTTP {r.status_code}: {r.text[:300]}"), False
                if after_tokens <= 0:
                    time.sleep(delay_s)
                    return Completion([], "", "abort"), True  # leaving unread closes the connection
                for chunk in _sse_chunks(r):
                    details = (chunk.get("usage") or {}).get("prompt_tokens_details") or {}
                    if isinstance(details.get("cached_tokens"), int):
                        cached = int(details["cached_tokens"])
                    if chunk.get("error"):
                        return Completion(None, None, None, error=f"stream error: {chunk['error']}"), False
                    for choice in chunk.get("choices") or []:
                        new = choice.get("token_ids")
                        if choice.get("text") and not isinstance(new, list):
                            return Completion(None, "".join(text), None, error=NO_TOKEN_IDS), False
                        ids += [int(t) for t in new or []]
                        text.append(choice.get("text") or "")
                        finish = choice.get("finish_reason") or finish
                    if finish is None and len(ids) >= after_tokens:
                        return Completion(ids, "".join(text), "abort"), True
        except Exception as e:  # network errors, bad JSON: reported per request
            return Completion(None, None, None, error=f"{type(e).__name__}: {e}"), False
        if finish is None:
            return Completion(ids, "".join(text), None, error="the stream ended without a finish reason"), False
        return Completion(ids, "".join(text), finish, num_cached_tokens=cached), False

    def stream(self, prompt_ids: Sequence[int], *, max_tokens: int, temperature: float = 0.0,
               ignore_eos: bool = True, on_first_token: Callable[[], None] | None = None) -> StreamTiming:
        """One streamed completion, timed on the client: TTFT at the first chunk that carries output."""
        body = self._body(prompt_ids, max_tokens, temperature, ignore_eos, None)
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        t0 = time.perf_counter()
        ttft: float | None = None
        n_ids = n_chunks = 0
        usage_tokens: int | None = None
        finish: str | None = None
        with self._http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
            for chunk in _sse_chunks(r):
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
                for choice in chunk.get("choices") or []:
                    ids = choice.get("token_ids")
                    has_output = bool(choice.get("text")) or bool(ids)
                    if has_output:
                        n_chunks += 1
                        n_ids += len(ids) if isinstance(ids, list) else 0
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                            if on_first_token is not None:
                                on_first_token()
                    if choice.get("finish_reason"):
                        finish = choice["finish_reason"]
        e2e = time.perf_counter() - t0
        n_out = usage_tokens if usage_tokens is not None else (n_ids or n_chunks)
        return StreamTiming(ttft_s=ttft if ttft is not None else e2e, e2e_s=e2e, num_output_tokens=n_out,
                            finish_reason=finish)

    def metrics(self) -> dict[str, float] | None:
        """The server's ``/metrics`` as name -> value, or ``None`` when it has none."""
        try:
            r = self._http.get("/metrics")
        except Exception:
            return None
        if r.status_code != 200:
            return None
        return parse_prometheus(r.text)

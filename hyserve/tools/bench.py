"""``hyserve bench``: throughput and latency on random token-id prompts, offline (default) or against a server.

    hyserve bench                                              # a tiny random checkpoint on this machine
    hyserve bench MODEL_DIR --num-prompts 256 --input-len 1024 --output-len 128 --result-json r.json --plot r.png
    hyserve bench --url http://127.0.0.1:8000 --vocab-size 32000 --concurrency 32

Every prompt is ``--input-len`` random ids (from the tokenizer's ordinary vocabulary) and generates exactly
``--output-len`` tokens (``ignore_eos``). At most ``--concurrency`` requests are in flight: a new one starts when
one finishes. Offline, requests go through ``LLMEngine.step()`` and their times are taken at the end of the step
that produced their first token and their last; with ``--url`` they are streamed from ``/v1/completions`` and timed
on the client (one thread per request in flight). Per request:

- TTFT: from submission to the first output token;
- TPOT: time per output token after the first, ``(e2e - TTFT) / (output tokens - 1)`` (requests of one token have
  none);
- E2E latency: from submission to the last token.

The result JSON (``--result-json``) has, with vLLM's benchmark names where they exist: ``backend`` ("offline" or
"server"), ``model``, ``url``, ``num_prompts``, ``input_len``, ``output_len``, ``concurrency``, ``temperature``,
``completed``, ``failed``, ``duration_s``, ``total_input_tokens``, ``total_output_tokens``, ``request_throughput``
(req/s), ``output_throughput`` (tok/s), ``total_token_throughput`` (tok/s); for X in ``ttft``, ``tpot``, ``e2el``:
``mean_X_ms``, ``median_X_ms`` (= ``p50_X_ms``), ``p50_X_ms``, ``p90_X_ms``, ``p99_X_ms``; per-request lists
``ttfts``, ``tpots``, ``e2els`` (seconds), ``input_lens``, ``output_lens``, ``errors``; ``engine`` (the offline
engine's flags) and ``metrics`` (the engine's ``hyserve:*`` counters over the run, offline only).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from hyserve.engine_args import engine_args, make_llm
from hyserve.tools import add_missing_defaults
from hyserve.tools.client import CompletionsClient
from hyserve.tools.soak import ordinary_vocab

if TYPE_CHECKING:
    from hyserve.llm import LLM

__all__ = ["RequestTiming", "build_result", "percentile", "random_prompts", "register", "run"]

LATENCY_METRICS = ("ttft", "tpot", "e2el")
PERCENTILES = (50, 90, 99)
MAX_CLIENT_THREADS = 256


@dataclass(slots=True)
class RequestTiming:
    """One request's times in seconds from its submission; ``error`` set when it failed."""

    input_len: int
    output_len: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.output_len < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_len - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def random_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(f"hyserve-bench/{seed}")
    return [[rng.randrange(vocab_size) for _ in range(input_len)] for _ in range(num_prompts)]


# ------------------------------------------------------------------------------------------------------ drivers


def bench_offline(llm: LLM, prompts: Sequence[list[int]], output_len: int, concurrency: int, temperature: float,
                  bar: tqdm | None = None) -> tuple[list[RequestTiming], float]:
    """Run the prompts through ``LLMEngine.step()``, ``concurrency`` in flight; returns timings and duration."""
    from hyserve.sampling_params import SamplingParams

    eng = llm.llm_engine
    params = SamplingParams(temperature=temperature, max_tokens=output_len, ignore_eos=True)
    timings = [RequestTiming(input_len=len(p)) for p in prompts]
    todo = deque(range(len(prompts)))
    live: dict[str, tuple[int, float]] = {}

    def submit() -> None:
        i = todo.popleft()
        rid = f"bench-{i}"
        live[rid] = (i, time.perf_counter())
        eng.add_request(rid, {"prompt_token_ids": prompts[i]}, params)

    t0 = time.perf_counter()
    for _ in range(min(concurrency, len(todo))):
        submit()
    while live:
        if not eng.has_unfinished_requests():
            raise RuntimeError(f"the engine is idle with {len(live)} bench requests unfinished")
        outs = eng.step()
        now = time.perf_counter()
        for out in outs:
            if out.request_id not in live:
                continue
            i, start = live[out.request_id]
            t = timings[i]
            n = len(out.outputs[0].token_ids)
            if t.ttft_s is None and n:
                t.ttft_s = now - start
            if out.finished:
                del live[out.request_id]
                t.e2e_s = now - start
                t.output_len = n
                if out.outputs[0].finish_reason in ("error", "abort"):
                    t.error = f"finish_reason {out.outputs[0].finish_reason}"
                if bar is not None:
                    bar.update(1)
                if todo:
                    submit()
    return timings, time.perf_counter() - t0


def bench_server(client: CompletionsClient, prompts: Sequence[list[int]], output_len: int, concurrency: int,
                 temperature: float, bar: tqdm | None = None) -> tuple[list[RequestTiming], float]:
    """Stream every prompt from ``/v1/completions``, ``concurrency`` threads; returns timings and duration."""
    lock = threading.Lock()

    def one(prompt: list[int]) -> RequestTiming:
        t = RequestTiming(input_len=len(prompt))
        try:
            s = client.stream(prompt, max_tokens=output_len, temperature=temperature, ignore_eos=True)
            t.ttft_s, t.e2e_s, t.output_len = s.ttft_s, s.e2e_s, s.num_output_tokens
        except Exception as e:  # one failed request is reported, not fatal
            t.error = f"{type(e).__name__}: {e}"
        if bar is not None:
            with lock:
                bar.update(1)
        return t

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        timings = list(pool.map(one, prompts))
    return timings, time.perf_counter() - t0


# ------------------------------------------------------------------------------------------------------ results


def _stats(values: Sequence[float], name: str) -> dict[str, float]:
    ms = [v * 1000.0 for v in values]
    out = {f"mean_{name}_ms": sum(ms) / len(ms) if ms else math.nan,
           f"median_{name}_ms": percentile(ms, 50)}
    out.update({f"p{q}_{name}_ms": percentile(ms, q) for q in PERCENTILES})
    return out


def build_result(timings: Sequence[RequestTiming], duration_s: float, **config: Any) -> dict[str, Any]:
    """The result dict (see the module docstring for its keys); NaN statistics become ``None``."""
    ok = [t for t in timings if t.error is None and t.e2e_s is not None]
    ttfts = [t.ttft_s for t in ok if t.ttft_s is not None]
    tpots = [t.tpot_s for t in ok if t.tpot_s is not None]
    e2els = [t.e2e_s for t in ok if t.e2e_s is not None]
    n_in = sum(t.input_len for t in ok)
    n_out = sum(t.output_len for t in ok)
    dur = max(duration_s, 1e-9)
    result: dict[str, Any] = dict(config)
    result.update(
        completed=len(ok), failed=len(timings) - len(ok), duration_s=duration_s, total_input_tokens=n_in,
        total_output_tokens=n_out, request_throughput=len(ok) / dur, output_throughput=n_out / dur,
        total_token_throughput=(n_in + n_out) / dur,
    )
    for name, vals in (("ttft", ttfts), ("tpot", tpots), ("e2el", e2els)):
        result.update(_stats(vals, name))
    result.update(ttfts=ttfts, tpots=tpots, e2els=e2els, input_lens=[t.input_len for t in timings],
                  output_lens=[t.output_len for t in timings], errors=[t.error for t in timings])
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in result.items()}


def format_result(r: dict[str, Any]) -> str:
    def num(v: Any, fmt: str = ".2f") -> str:
        return "n/a" if v is None else format(v, fmt)

    lines = [f"{' hyserve bench: ' + r['backend'] + ' ':=^60}",
             f"{'Successful requests:':<40}{r['completed']:>20}",
             f"{'Failed requests:':<40}{r['failed']:>20}",
             f"{'Concurrency:':<40}{r['concurrency']:>20}",
             f"{'Benchmark duration (s):':<40}{num(r['duration_s']):>20}",
             f"{'Total input tokens:':<40}{r['total_input_tokens']:>20}",
             f"{'Total generated tokens:':<40}{r['total_output_tokens']:>20}",
             f"{'Request throughput (req/s):':<40}{num(r['request_throughput']):>20}",
             f"{'Output token throughput (tok/s):':<40}{num(r['output_throughput']):>20}",
             f"{'Total token throughput (tok/s):':<40}{num(r['total_token_throughput']):>20}"]
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "e2el": "End-to-end Latency"}
    for name in LATENCY_METRICS:
        lines.append(f"{' ' + titles[name] + ' ':-^60}")
        lines.append(f"{'Mean ' + name.upper() + ' (ms):':<40}{num(r[f'mean_{name}_ms']):>20}")
        for q in PERCENTILES:
            lines.append(f"{f'P{q} ' + name.upper() + ' (ms):':<40}{num(r[f'p{q}_{name}_ms']):>20}")
    lines.append("=" * 60)
    return "\n".join(lines)


def plot(r: dict[str, Any], path: str) -> bool:
    """Histograms of TTFT, TPOT and E2E latency with their mean/p50/p90/p99; False (and a message) without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return False
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    series = {"ttft": r["ttfts"], "tpot": r["tpots"], "e2el": r["e2els"]}
    titles = {"ttft": "time to first token", "tpot": "time per output token", "e2el": "end-to-end latency"}
    for ax, name in zip(axes, LATENCY_METRICS):
        ms = [v * 1000.0 for v in series[name]]
        if ms:
            ax.hist(ms, bins=min(40, max(5, len(ms) // 2)), color="#4C72B0", alpha=0.8)
            for key, style in (("mean", "-"), ("p50", "--"), ("p90", "-."), ("p99", ":")):
                v = r[f"{key}_{name}_ms"]
                if v is not None:
                    ax.axvline(v, color="#C44E52", linestyle=style, label=f"{key} {v:.1f} ms")
            ax.legend(fontsize=8)
        ax.set_title(titles[name])
        ax.set_xlabel("ms")
        ax.set_ylabel("requests")
    fig.suptitle(f"hyserve bench ({r['backend']}): {r['completed']} requests, in {r['input_len']} / out "
                 f"{r['output_len']}, concurrency {r['concurrency']}: {r['output_throughput']:.1f} output tok/s, "
                 f"{r['request_throughput']:.2f} req/s", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ------------------------------------------------------------------------------------------------------ command


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``hyserve bench`` to a ``hyserve`` sub-command parser set."""
    p = subparsers.add_parser(
        "bench", help="throughput and latency (TTFT, TPOT, E2E) offline or against a server",
        description=(__doc__ or "").replace("``", ""), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint directory (default: write a tiny random checkpoint; with --url: only read for "
                        "its vocabulary)")
    p.add_argument("--url", default=None,
                   help="benchmark a running server at this base URL (default: none, the offline engine)")
    p.add_argument("--served-model-name", default=None,
                   help="--url: the model name to send (default: the first one /v1/models lists)")
    p.add_argument("--num-prompts", type=int, default=64, help="requests to run (default: 64)")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens per request (default: 256)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request (default: 64)")
    p.add_argument("--concurrency", type=int, default=None,
                   help=f"requests in flight (default: all at once; offline the engine runs --max-num-seqs of "
                        f"them, with --url at most {MAX_CLIENT_THREADS} client threads)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    p.add_argument("--dataset-seed", type=int, default=0, help="seed of the random prompts (default: 0)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="draw prompt ids from [0, N) (default: the tokenizer's ordinary vocabulary; 448 without "
                        "MODEL_DIR)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="one untimed short request first (default: on)")
    p.add_argument("--result-json", default=None, help="write the results here (default: none)")
    p.add_argument("--plot", default=None, help="write a PNG of the latency distributions here (default: none)")
    p.add_argument("--timeout", type=float, default=600.0, help="--url: seconds per HTTP request (default: 600)")
    engine_args(p)
    add_missing_defaults(p)
    p.set_defaults(func=run)


def _warmup_prompt(vocab: int) -> list[int]:
    """16 ids that no random prompt starts with (almost surely): the warm-up leaves nothing for them to hit."""
    return [(7 * i + 3) % vocab for i in range(16)]


def _validate(args: argparse.Namespace) -> None:
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)})")
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError(f"--concurrency must be at least 1 (got {args.concurrency})")


def run(args: argparse.Namespace) -> int:
    """``hyserve bench``: 0 when every request completed, 1 when some failed."""
    _validate(args)
    if args.model is None and args.url is None:
        from hyserve.testing import write_tiny_checkpoint

        with tempfile.TemporaryDirectory(prefix="hyserve-bench-") as d:
            max_pos = max(4096, -(-(args.input_len + args.output_len + 64) // 256) * 256)
            path = write_tiny_checkpoint(d, seed=args.seed, max_position_embeddings=max_pos)
            print(f"# wrote a tiny random-weight Qwen3.5 checkpoint to {path} (numbers are for that tiny model)",
                  file=sys.stderr)
            return _run(args, path)
    return _run(args, args.model)


def _run(args: argparse.Namespace, model: str | None) -> int:
    vocab = args.vocab_size or ordinary_vocab(model)
    prompts = random_prompts(args.num_prompts, args.input_len, vocab, args.dataset_seed)
    config: dict[str, Any] = {"backend": "offline" if args.url is None else "server", "model": model,
                              "url": args.url, "num_prompts": args.num_prompts, "input_len": args.input_len,
                              "output_len": args.output_len, "temperature": args.temperature,
                              "dataset_seed": args.dataset_seed, "vocab_size": vocab}
    metrics: dict[str, Any] | None = None
    if args.url is None:
        assert model is not None
        from hyserve.sampling_params import SamplingParams

        llm = make_llm(args, model)
        concurrency = args.concurrency or len(prompts)
        if args.warmup:
            llm.generate({"prompt_token_ids": _warmup_prompt(vocab)}, SamplingParams(max_tokens=4, ignore_eos=True),
                         use_tqdm=False)
        before = llm.get_metrics()
        bar = tqdm(total=len(prompts), desc="bench", unit="req", disable=None)
        try:
            timings, duration = bench_offline(llm, prompts, args.output_len, concurrency, args.temperature, bar)
        finally:
            bar.close()
        after = llm.get_metrics()
        metrics = {k: v - before.get(k, 0) for k, v in after.items()
                   if isinstance(v, (int, float)) and isinstance(before.get(k, 0), (int, float))}
        eng = llm.llm_engine
        config["engine"] = {"device": str(eng.device), "dtype": str(eng.dtype).removeprefix("torch."),
                            "max_num_seqs": eng.max_num_seqs,
                            "max_num_batched_tokens": eng.max_num_batched_tokens,
                            "enable_prefix_caching": args.enable_prefix_caching,
                            "speculative_config": args.speculative_config, "block_size": args.block_size}
    else:
        concurrency = args.concurrency or min(len(prompts), MAX_CLIENT_THREADS)
        client = CompletionsClient(args.url, args.served_model_name, timeout_s=args.timeout,
                                   max_connections=concurrency)
        if args.warmup:
            w = client.complete(_warmup_prompt(vocab), max_tokens=4, ignore_eos=True)
            if w.error is not None and w.finish_reason is None:  # failed (not merely without token ids)
                raise ValueError(f"the warm-up request to {args.url} failed: {w.error}")
        bar = tqdm(total=len(prompts), desc="bench", unit="req", disable=None)
        try:
            timings, duration = bench_server(client, prompts, args.output_len, concurrency, args.temperature, bar)
        finally:
            bar.close()
        config["served_model_name"] = client.model
        client.close()
    config["concurrency"] = concurrency
    result = build_result(timings, duration, **config)
    result["metrics"] = metrics
    print(format_result(result))
    errors = [e for e in result["errors"] if e]
    if errors:
        print(f"# {len(errors)} requests failed; first: {errors[0]}", file=sys.stderr)
    if args.result_json:
        with open(args.result_json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
        print(f"# results written to {args.result_json}")
    if args.plot and plot(result, args.plot):
        print(f"# plot written to {args.plot}")
    return 0 if not errors else 1

"""Prefix caching on a multi-turn agent workload: hyserve against what its snapshot policy allows, and against a
vLLM-style scheme with one recurrent-state checkpoint per request on inflated attention blocks.

    python benchmarks/prefix_cache_bench.py --scale cpu --out benchmarks/results
    python benchmarks/prefix_cache_bench.py --scale full --model /path/to/2b-shape --device cuda --dtype bfloat16

What is measured, and why:

1. The workload (``AgentTraceSpec`` of ``hyserve/tools/workload.py``): agent conversations sharing a system prefix,
   each turn's prompt extending the previous turn's prompt + actual output. It is driven closed-loop through
   ``LLMEngine.step()``: a conversation's next turn is submitted right after the step that finished its previous
   turn, with the tokens the engine really produced; ``concurrency`` conversations are in flight. The same
   workload runs with prefix caching ON and OFF. Greedy decoding with ``ignore_eos``: the outputs must be identical
   ON and OFF (a prefix hit must not change a single token), which is checked per (conversation, turn) and reported.
2. Per request: TTFT = wall time from ``add_request`` to the end of the ``step()`` that returned its first output
   token (it includes queueing behind other requests: that is what a client sees). Totals from ``get_metrics()``:
   ``prefix_cache_hits`` (prompt tokens served from the cache), ``prefix_cache_queries``, and the prefill tokens
   actually computed, defined as ``scheduled_tokens - (generation_tokens - num_requests)``: every scheduled token
   is either a prompt token or an output token fed back for the next decode step, and a request feeds back all of
   its outputs but the last. OFF, without preemption, this equals the sum of prompt lengths; ON, it is that minus
   the hits. Prefill tokens saved = computed OFF - computed ON.
3. The ideal (``ideal_hits``): a pure simulation over the ON run's trace with unlimited memory of the hit tokens
   hyserve's snapshot policy allows (see :class:`SnapshotPolicy`). It says how much of the gap to "everything
   cached" is policy and how much is implementation (eviction, timing, bugs).
4. The vLLM-style scheme (``vllm_style_hits``): attention blocks inflated until one attention page holds one
   recurrent state (:func:`vllm_style_block_size`), one state checkpoint per request at the last full inflated
   block of its prompt, a hit only at a multiple of that block. Same trace, same visibility rules.

Visibility (what a request may hit, in both simulations): engine steps are numbered from 1; a request submitted
after step ``s`` returned has ``submit_step = s``. What a request publishes at the end of its prefill (KV of its full
prompt blocks, end-of-prompt and branch-point snapshots, interval snapshots inside the prompt) is visible to requests
with ``submit_step >= prefill_step`` (the step that returned its first token); what it publishes at the end (KV of
its computed tokens, end-of-request snapshot, interval snapshots in the output) to those with ``submit_step >=
finish_step``. This is conservative: the engine looks a request up when it admits it, which is at the earliest
the next step and may be later (a full batch), and it may see snapshots published in between, so hyserve can in
principle score slightly above the "ideal". In this closed loop a turn is submitted in the step boundary right
after its predecessor finished, so the previous turn's end-of-request snapshot always counts.

Per-request hyserve hits: ``RequestOutput.num_cached_tokens`` when the engine provides it (vLLM's field); else the
per-step delta of ``prefix_cache_hits`` is given to the request(s) that first appear in that step's outputs: exact
when one request is new in the step, split in proportion to the ideal hits (an approximation, counted separately)
when several are. Totals always come from the metric itself.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hyserve.tools.workload import AgentTraceSpec, Conversation, make_conversations, workload_spec

if TYPE_CHECKING:
    from hyserve import LLM

__all__ = [
    "QWEN35_2B_STATE_SHAPE",
    "SnapshotPolicy",
    "StateShape",
    "TraceRequest",
    "ideal_hits",
    "run_workload",
    "sequential_trace",
    "simulate_hits",
    "vllm_style_block_size",
    "vllm_style_hits",
]


# ---------------------------------------------------------------------------------------------------------- trace


@dataclass(slots=True)
class TraceRequest:
    """One request of a run, as the simulations see it.

    Steps are engine-step indices (the first ``step()`` is 1): ``submit_step`` is the number of steps completed when
    ``add_request`` was called, ``prefill_step`` the step that returned the first output token (the prompt is fully
    computed), ``finish_step`` the step that returned it finished. ``submit_order`` / ``finish_order`` are ranks
    among all requests of the run (0-based).
    """

    prompt_ids: list[int]
    output_ids: list[int]
    submit_order: int
    finish_order: int
    submit_step: int
    prefill_step: int
    finish_step: int
    request_id: str = ""
    conv_id: int = -1
    turn: int = -1

    def validate(self) -> None:
        if not self.prompt_ids or not self.output_ids:
            raise ValueError(f"request {self.request_id!r}: prompt and output must be non-empty")
        if not self.submit_step < self.prefill_step <= self.finish_step:
            raise ValueError(f"request {self.request_id!r}: need submit_step < prefill_step <= finish_step "
                             f"(got {self.submit_step}, {self.prefill_step}, {self.finish_step})")


def sequential_trace(requests: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[TraceRequest]:
    """A trace of ``(prompt_ids, output_ids)`` pairs run one at a time: each is submitted when the previous one has
    finished, so it sees everything earlier requests published (for tests and hand-made examples)."""
    return [TraceRequest(list(p), list(o), submit_order=i, finish_order=i, submit_step=2 * i,
                         prefill_step=2 * i + 1, finish_step=2 * i + 2, request_id=f"r{i}")
            for i, (p, o) in enumerate(requests)]


# ---------------------------------------------------------------------------------------------------- simulations


@dataclass(frozen=True, slots=True)
class SnapshotPolicy:
    """Where recurrent-state snapshots are taken (positions = number of tokens the state has consumed).

    - ``end_of_prompt``: at ``floor(P / block) * block`` when a prompt of ``P`` tokens has been computed;
    - ``end_of_request``: at ``floor((P + O - 1) / block) * block`` when a request with ``O`` outputs finishes (its
      last output token is never computed);
    - ``branch_points``: a request whose prompt matches cached KV (``M`` tokens, block-aligned, within its first
      ``P - 1`` tokens) deeper than its hit snapshots at ``M`` while it recomputes up to there;
    - ``interval``: at every multiple of ``interval`` (itself a multiple of ``block_size``) a request computes.

    A hit of length ``L`` needs the KV of ``[0, L)`` and a snapshot at exactly ``L``; ``L <= P - 1`` (the last prompt
    token is always computed, to produce the first output's logits).
    """

    block_size: int = 16
    end_of_prompt: bool = True
    end_of_request: bool = True
    branch_points: bool = True
    interval: int | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive (got {self.block_size})")
        if self.interval is not None and (self.interval <= 0 or self.interval % self.block_size):
            raise ValueError(f"interval must be a positive multiple of block_size {self.block_size} "
                             f"(got {self.interval})")


class _PrefixTrie:
    """Exact ids for block-aligned prefixes: node ``(parent, block tokens)``; no hash collisions possible."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._nodes: dict[tuple[int, tuple[int, ...]], int] = {}

    def chain(self, tokens: Sequence[int], n_blocks: int) -> list[int]:
        """Node ids of the prefixes ``tokens[:B]``, ``tokens[:2B]``, ..., ``tokens[:n_blocks * B]``."""
        b = self.block_size
        out: list[int] = []
        parent = -1
        for k in range(n_blocks):
            key = (parent, tuple(tokens[k * b:(k + 1) * b]))
            node = self._nodes.get(key)
            if node is None:
                node = self._nodes[key] = len(self._nodes)
            out.append(node)
            parent = node
        return out


def simulate_hits(trace: Sequence[TraceRequest], policy: SnapshotPolicy) -> list[int]:
    """Prompt tokens each request of ``trace`` could be served from cache under ``policy``, with unlimited memory.

    Returns one count per request, in the order of ``trace``. Events are replayed in step order; at equal steps,
    publications come before submissions (a request submitted after step ``s`` sees what step ``s`` published), and
    submissions keep ``submit_order``. Deterministic and pure (no engine, no torch).
    """
    b = policy.block_size
    for r in trace:
        r.validate()
    trie = _PrefixTrie(b)
    kv: set[int] = set()
    snaps: set[int] = set()
    hits = [0] * len(trace)
    prompt_chain: dict[int, list[int]] = {}
    branch: dict[int, int] = {}
    events: list[tuple[int, int, int, int]] = []  # (step, phase, order, index); phase 0 publish, 1 submit
    for i, r in enumerate(trace):
        events.append((r.prefill_step, 0, 0, i))
        events.append((r.finish_step, 0, 1, i))
        events.append((r.submit_step, 1, r.submit_order, i))
    events.sort()

    def publish(chain: list[int], n_tokens_snapshot: int | None, computed: int, lo: int) -> None:
        kv.update(chain)
        if n_tokens_snapshot:
            snaps.add(chain[n_tokens_snapshot // b - 1])
        if policy.interval:
            for pos in range(policy.interval * (lo // policy.interval + 1), computed + 1, policy.interval):
                snaps.add(chain[pos // b - 1])

    for _step, phase, order, i in events:
        r = trace[i]
        p = len(r.prompt_ids)
        if phase == 1:  # submission: look the prompt up
            chain = prompt_chain.setdefault(i, trie.chain(r.prompt_ids, p // b))
            matched = 0  # KV blocks matched, within the first P - 1 tokens (the last one is always computed)
            while matched < (p - 1) // b and chain[matched] in kv:
                matched += 1
            best = 0
            for k in range(1, matched + 1):
                if chain[k - 1] in snaps:
                    best = k * b
            hits[i] = best
            if policy.branch_points and matched * b > best:
                branch[i] = chain[matched - 1]
        elif order == 0:  # prefill complete
            chain = prompt_chain.setdefault(i, trie.chain(r.prompt_ids, p // b))
            publish(chain, (p // b) * b if policy.end_of_prompt else None, p, 0)
            if i in branch:
                snaps.add(branch.pop(i))
        else:  # finished
            computed = p + len(r.output_ids) - 1
            full = [*r.prompt_ids, *r.output_ids]
            chain = trie.chain(full, computed // b)
            publish(chain, (computed // b) * b if policy.end_of_request else None, computed, p)
    return hits


def ideal_hits(trace: Sequence[TraceRequest], policy: SnapshotPolicy | None = None) -> list[int]:
    """Hit tokens per request that hyserve's snapshot policy allows on ``trace`` (default: 16-token blocks,
    end-of-prompt + end-of-request + branch-point snapshots, no interval snapshots)."""
    return simulate_hits(trace, policy or SnapshotPolicy())


def vllm_style_hits(trace: Sequence[TraceRequest], block_size: int, *, checkpoint_at_finish: bool = False
                    ) -> list[int]:
    """Hit tokens per request under the vLLM-style scheme: attention blocks of ``block_size`` tokens (see
    :func:`vllm_style_block_size`), one recurrent-state checkpoint per request at the last full block of its prompt
    (``floor(P / block_size) * block_size``), a hit only at a checkpointed multiple of ``block_size`` <= P - 1.
    ``checkpoint_at_finish`` adds a checkpoint at the last full block a finished request computed (a variant)."""
    policy = SnapshotPolicy(block_size=block_size, end_of_prompt=True, end_of_request=checkpoint_at_finish,
                            branch_points=False, interval=None)
    return simulate_hits(trace, policy)


# ----------------------------------------------------------------------------------------- vLLM-style block size


@dataclass(frozen=True, slots=True)
class StateShape:
    """The model dimensions that set cache page sizes (names follow ``hyserve.config.ModelConfig``)."""

    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int

    @property
    def conv_dim(self) -> int:
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    @classmethod
    def of(cls, cfg: Any) -> StateShape:
        """From a ``ModelConfig`` (or anything with the same attribute names)."""
        return cls(**{name: int(getattr(cfg, name)) for name in cls.__dataclass_fields__})

    def state_bytes_per_layer(self, conv_bytes: int, ssm_bytes: int = 4) -> int:
        """One GDN layer's recurrent state: conv window ``conv_dim x (K - 1)`` + SSM state ``Hv x Dk x Dv``."""
        return (self.conv_dim * (self.linear_conv_kernel_dim - 1) * conv_bytes
                + self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim * ssm_bytes)

    def kv_bytes_per_token_per_layer(self, kv_bytes: int) -> int:
        return 2 * self.num_key_value_heads * self.head_dim * kv_bytes


# Qwen3.5-2B: hidden 2048, 2 KV heads of 256, 16 key / 16 value GDN heads of 128, conv kernel 4.
QWEN35_2B_STATE_SHAPE = StateShape(num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                                   linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                                   linear_conv_kernel_dim=4)


def vllm_style_block_size(shape: StateShape, kv_bytes: int, ssm_bytes: int = 4, multiple: int = 16) -> int:
    """Attention block size (tokens) at which one attention page (per layer) holds one recurrent state: state bytes
    per GDN layer / KV bytes per token per layer, rounded up to a multiple of ``multiple``. The conv window is kept
    in the KV dtype (``kv_bytes``), the SSM state in ``ssm_bytes`` (hyserve keeps it in float32)."""
    tokens = math.ceil(shape.state_bytes_per_layer(kv_bytes, ssm_bytes) / shape.kv_bytes_per_token_per_layer(kv_bytes))
    return math.ceil(tokens / multiple) * multiple


# --------------------------------------------------------------------------------------------------------- driver


@dataclass(slots=True)
class RunResult:
    """One closed-loop run of the workload. ``trace[i]``, ``ttft_s[i]`` and ``hyserve_hits[i]`` are per request in
    submission order; ``metrics`` are deltas of ``get_metrics()`` over the run."""

    caching: bool
    trace: list[TraceRequest]
    ttft_s: list[float]
    hyserve_hits: list[float]
    hits_source: str
    hits_exact_tokens: int
    hits_split_tokens: int
    hits_unattributed_tokens: int
    metrics: dict[str, float]
    wall_s: float
    num_steps: int


@dataclass(slots=True)
class _Live:
    conv: Conversation
    turn: int
    prompt: list[int]
    submit_order: int
    submit_step: int
    submit_time: float
    seen: bool = False
    prefill_step: int = 0
    ttft_s: float = 0.0
    cached: int | None = None
    attributed: float = 0.0


_METRIC_KEYS = ("hyserve:prefix_cache_queries", "hyserve:prefix_cache_hits", "hyserve:scheduled_tokens",
                "hyserve:generation_tokens", "hyserve:prompt_tokens", "hyserve:num_requests",
                "hyserve:num_preemptions", "hyserve:step_time_seconds", "hyserve:num_steps")


def _metric(m: dict[str, float | list[float]], key: str) -> float:
    v = m.get(key, 0.0)
    return float(v) if isinstance(v, (int, float)) else 0.0


def _scalar_metrics(llm: LLM) -> dict[str, float]:
    m = llm.get_metrics()
    return {k: _metric(m, k) for k in _METRIC_KEYS}


def _warm_up(llm: LLM, vocab_size: int) -> None:
    """One short request before timing (first-call overheads), on tokens the workload never starts with."""
    from hyserve import SamplingParams

    eng = llm.llm_engine
    ids = [(7 * i + 3) % vocab_size for i in range(40)]
    eng.add_request("warmup", {"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()


def run_workload(llm: LLM, conversations: Sequence[Conversation], concurrency: int, *, caching: bool,
                 vocab_size: int) -> RunResult:
    """Drive ``conversations`` closed-loop through ``llm.llm_engine.step()`` with ``concurrency`` in flight."""
    from hyserve import SamplingParams

    eng = llm.llm_engine
    _warm_up(llm, vocab_size)
    base = _scalar_metrics(llm)
    todo = deque(conversations)
    live: dict[str, _Live] = {}
    lives: list[_Live] = []
    steps = 0
    unattributed = 0.0
    exact = split = 0.0
    has_cached_field = False

    def submit(conv: Conversation, turn: int, prompt: list[int]) -> None:
        rid = f"c{conv.conv_id}-t{turn}"
        params = SamplingParams(temperature=0.0, max_tokens=conv.output_lens[turn], ignore_eos=True)
        rec = _Live(conv, turn, prompt, submit_order=len(lives), submit_step=steps, submit_time=time.perf_counter())
        eng.add_request(rid, {"prompt_token_ids": prompt}, params)
        live[rid] = rec
        lives.append(rec)

    def start_next_conversation() -> None:
        if todo:
            conv = todo.popleft()
            submit(conv, 0, conv.first_prompt())

    t_start = time.perf_counter()
    for _ in range(concurrency):
        start_next_conversation()
    prev_hits = base["hyserve:prefix_cache_hits"]
    finished_trace: dict[int, TraceRequest] = {}
    while live:
        if not eng.has_unfinished_requests():
            raise RuntimeError(f"engine is idle with {len(live)} requests unfinished")
        outs = eng.step()
        now = time.perf_counter()
        steps += 1
        hits_now = _metric(llm.get_metrics(), "hyserve:prefix_cache_hits")
        new: list[_Live] = []
        done: list[tuple[str, list[int]]] = []
        for out in outs:
            rec = live.get(out.request_id)
            if rec is None:
                continue
            if not rec.seen:
                rec.seen = True
                new.append(rec)
                cached = getattr(out, "num_cached_tokens", None)
                if cached is not None:
                    has_cached_field = True
                    rec.cached = int(cached)
            token_ids = out.outputs[0].token_ids
            if rec.prefill_step == 0 and token_ids:
                rec.prefill_step = steps
                rec.ttft_s = now - rec.submit_time
            if out.finished:
                done.append((out.request_id, list(token_ids)))
        delta = hits_now - prev_hits
        prev_hits = hits_now
        if delta > 0:
            if len(new) == 1:
                new[0].attributed += delta
                exact += delta
            elif new:
                weights = [max(_ideal_guess(r), 1) for r in new]
                for r, w in zip(new, weights):
                    r.attributed += delta * w / sum(weights)
                split += delta
            else:
                unattributed += delta
        for rid, output in done:
            rec = live.pop(rid)
            finish_order = len(finished_trace)
            finished_trace[rec.submit_order] = TraceRequest(
                prompt_ids=rec.prompt, output_ids=output, submit_order=rec.submit_order, finish_order=finish_order,
                submit_step=rec.submit_step, prefill_step=rec.prefill_step, finish_step=steps, request_id=rid,
                conv_id=rec.conv.conv_id, turn=rec.turn)
            if rec.turn + 1 < rec.conv.num_turns:
                submit(rec.conv, rec.turn + 1, rec.conv.next_prompt(rec.turn + 1, rec.prompt, output))
            else:
                start_next_conversation()
    wall = time.perf_counter() - t_start
    end = _scalar_metrics(llm)
    metrics = {k: end[k] - base[k] for k in _METRIC_KEYS}
    trace = [finished_trace[i] for i in range(len(lives))]
    ttfts = [r.ttft_s for r in lives]
    if has_cached_field:
        hits = [float(r.cached or 0) for r in lives]
        source = "RequestOutput.num_cached_tokens"
    else:
        hits = [r.attributed for r in lives]
        source = "per-step delta of hyserve:prefix_cache_hits"
    return RunResult(caching=caching, trace=trace, ttft_s=ttfts, hyserve_hits=hits, hits_source=source,
                     hits_exact_tokens=int(exact), hits_split_tokens=int(split),
                     hits_unattributed_tokens=int(unattributed), metrics=metrics, wall_s=wall, num_steps=steps)


def _ideal_guess(rec: _Live) -> int:
    """Weight for splitting one step's hits among several newly admitted requests: what could at most be cached
    (the previous turn's computed tokens for a later turn, the shared prefix for a first turn)."""
    conv, t = rec.conv, rec.turn
    if t == 0:
        return len(conv.system_prefix)
    return conv.prompt_len(t - 1) + conv.output_lens[t - 1] - 1


# -------------------------------------------------------------------------------------------------------- report


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), ``q`` in [0, 100]."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _ttft_stats(ttfts: Sequence[float]) -> dict[str, float]:
    return {"mean_s": sum(ttfts) / max(len(ttfts), 1), "p50_s": percentile(ttfts, 50), "p90_s": percentile(ttfts, 90)}


def prefill_tokens_computed(metrics: dict[str, float]) -> float:
    """Prompt tokens the engine computed: scheduled tokens minus the output tokens fed back for decoding (all
    outputs of a request but its last)."""
    return metrics["hyserve:scheduled_tokens"] - (metrics["hyserve:generation_tokens"]
                                                  - metrics["hyserve:num_requests"])


def _per_turn(trace: Sequence[TraceRequest], series: dict[str, Sequence[float]]) -> list[dict[str, float]]:
    turns = sorted({r.turn for r in trace})
    rows = []
    for t in turns:
        idx = [i for i, r in enumerate(trace) if r.turn == t]
        prompt = sum(len(trace[i].prompt_ids) for i in idx)
        row: dict[str, float] = {"turn": t, "requests": len(idx), "prompt_tokens": prompt}
        for name, vals in series.items():
            row[name] = sum(vals[i] for i in idx)
        rows.append(row)
    return rows


def _machine(device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "torch": torch.__version__, "cpu_count": os.cpu_count(),
                            "torch_threads": torch.get_num_threads(), "device": device}
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _pct(a: float, b: float) -> float:
    return 100.0 * a / b if b else 0.0


def build_report(spec: AgentTraceSpec, on: RunResult, off: RunResult, *, model: dict[str, Any], machine: dict[str, Any],
                 policy: SnapshotPolicy, vllm_block: int, vllm_block_2b: int, args: dict[str, Any]) -> dict[str, Any]:
    """Everything the JSON holds (no token ids: the full-scale trace has millions)."""
    trace = on.trace
    prompt_tokens = sum(len(r.prompt_ids) for r in trace)
    ideal = ideal_hits(trace, policy)
    vllm = vllm_style_hits(trace, vllm_block)
    vllm_fin = vllm_style_hits(trace, vllm_block, checkpoint_at_finish=True)
    vllm_2b = vllm_style_hits(trace, vllm_block_2b)
    key = {(r.conv_id, r.turn): r.output_ids for r in off.trace}
    mismatches = [f"{r.request_id}" for r in trace if key.get((r.conv_id, r.turn)) != r.output_ids]
    computed_on, computed_off = prefill_tokens_computed(on.metrics), prefill_tokens_computed(off.metrics)
    hits_on = on.metrics["hyserve:prefix_cache_hits"]
    schemes = {
        "hyserve": hits_on,
        "ideal": float(sum(ideal)),
        "vllm_style": float(sum(vllm)),
        "vllm_style_with_finish_checkpoint": float(sum(vllm_fin)),
        "vllm_style_at_2b_block": float(sum(vllm_2b)),
    }
    off_ttft_by_key = {(r.conv_id, r.turn): off.ttft_s[i] for i, r in enumerate(off.trace)}
    per_request = []
    for i, r in enumerate(trace):
        per_request.append({
            "request_id": r.request_id, "conv_id": r.conv_id, "turn": r.turn, "prompt_tokens": len(r.prompt_ids),
            "output_tokens": len(r.output_ids), "submit_step": r.submit_step, "prefill_step": r.prefill_step,
            "finish_step": r.finish_step, "finish_order": r.finish_order, "ttft_on_s": on.ttft_s[i],
            "ttft_off_s": off_ttft_by_key.get((r.conv_id, r.turn)), "hits_hyserve": on.hyserve_hits[i],
            "hits_ideal": ideal[i], "hits_vllm_style": vllm[i], "hits_vllm_style_at_2b_block": vllm_2b[i],
        })
    per_turn = _per_turn(trace, {"hits_hyserve": on.hyserve_hits, "hits_ideal": ideal, "hits_vllm_style": vllm,
                                 "hits_vllm_style_at_2b_block": vllm_2b,
                                 "ttft_on_s": on.ttft_s,
                                 "ttft_off_s": [off_ttft_by_key.get((r.conv_id, r.turn), 0.0) for r in trace]})
    for row in per_turn:
        row["ttft_on_mean_s"] = row.pop("ttft_on_s") / row["requests"]
        row["ttft_off_mean_s"] = row.pop("ttft_off_s") / row["requests"]
    return {
        "workload": {"scale": spec.name, "spec": {k: getattr(spec, k) for k in spec.__dataclass_fields__},
                     "seed": args["seed"], "conversations": len({r.conv_id for r in trace}), "requests": len(trace),
                     "prompt_tokens": prompt_tokens, "output_tokens": sum(len(r.output_ids) for r in trace)},
        "model": model,
        "machine": machine,
        "args": args,
        "policy": {"block_size": policy.block_size, "end_of_prompt": policy.end_of_prompt,
                   "end_of_request": policy.end_of_request, "branch_points": policy.branch_points,
                   "interval": policy.interval},
        "vllm_style": {"block_size": vllm_block, "block_size_qwen35_2b_bf16": vllm_block_2b},
        "outputs_identical": not mismatches,
        "output_mismatches": mismatches,
        "hit_tokens": schemes,
        "hit_rate_pct": {k: _pct(v, prompt_tokens) for k, v in schemes.items()},
        "hyserve_vs_ideal_pct": _pct(hits_on, sum(ideal)),
        "per_request_hits": {"source": on.hits_source, "sum": sum(on.hyserve_hits),
                             "delta_attribution_exact_tokens": on.hits_exact_tokens,
                             "delta_attribution_split_tokens": on.hits_split_tokens,
                             "delta_attribution_unattributed_tokens": on.hits_unattributed_tokens},
        "runs": {
            name: {
                "metrics": run.metrics, "prefill_tokens_computed": prefill_tokens_computed(run.metrics),
                "ttft": _ttft_stats(run.ttft_s), "wall_s": run.wall_s, "num_steps": run.num_steps,
                "steps_to_first_token_mean": sum(r.prefill_step - r.submit_step for r in run.trace)
                / max(len(run.trace), 1),
            }
            for name, run in (("on", on), ("off", off))
        },
        "prefill_tokens_saved": computed_off - computed_on,
        "prefill_tokens_saved_pct": _pct(computed_off - computed_on, computed_off),
        "per_turn": per_turn,
        "per_request": per_request,
    }


def _hits_source_note(h: dict[str, Any]) -> str:
    if h["source"].startswith("RequestOutput"):
        return f"`{h['source']}` (sum {h['sum']:.0f})"
    return (f"{h['source']} ({h['delta_attribution_exact_tokens']} tokens exact, "
            f"{h['delta_attribution_split_tokens']} split among requests admitted in the same step, "
            f"{h['delta_attribution_unattributed_tokens']} unattributed)")


def _fmt_s(x: float) -> str:
    return f"{x * 1e3:.1f} ms" if x < 10 else f"{x:.1f} s"


def render_markdown(rep: dict[str, Any]) -> str:
    w, on, off = rep["workload"], rep["runs"]["on"], rep["runs"]["off"]
    hits, rate = rep["hit_tokens"], rep["hit_rate_pct"]
    vb = rep["vllm_style"]
    pol = rep["policy"]
    policy_desc = ", ".join(n for n, on_ in (("end of prompt", pol["end_of_prompt"]),
                                             ("end of request", pol["end_of_request"]),
                                             ("branch points", pol["branch_points"])) if on_)
    if pol["interval"]:
        policy_desc += f", every {pol['interval']} tokens"
    m = rep["model"]
    lines = [
        "# Prefix caching on a multi-turn agent workload",
        "",
        f"Workload `{w['scale']}` (seed {w['seed']}): {w['conversations']} conversations, {w['requests']} requests, "
        f"concurrency {w['spec']['concurrency']}, shared system prefix {w['spec']['system_prefix_len']} tokens, "
        f"prompts {min(r['prompt_tokens'] for r in rep['per_request'])}-"
        f"{max(r['prompt_tokens'] for r in rep['per_request'])} tokens, outputs {w['spec']['output_len'][0]}-"
        f"{w['spec']['output_len'][1]} tokens; closed loop (each turn extends the previous prompt + actual output).",
        f"Model: {m['description']}; dtype {m['dtype']}, device {m['device']}. Machine: "
        f"{rep['machine'].get('gpu') or rep['machine']['platform']}, {rep['machine']['cpu_count']} CPUs, "
        f"torch {rep['machine']['torch']}.",
        "",
        "## Hit tokens: hyserve vs its policy's ideal vs vLLM-style",
        "",
        f"Prompt tokens: {w['prompt_tokens']}. Ideal = hyserve's snapshot policy ({policy_desc}; "
        f"{pol['block_size']}-token blocks) with unlimited memory on this run's trace. vLLM-style = attention "
        f"blocks inflated to hold one recurrent state ({vb['block_size']} tokens for this model and dtype; "
        f"{vb['block_size_qwen35_2b_bf16']} for Qwen3.5-2B in bf16), one state checkpoint per request at the last "
        "full block of its prompt.",
        "",
        "| scheme | hit tokens | hit rate |",
        "| --- | ---: | ---: |",
        f"| hyserve (measured) | {hits['hyserve']:.0f} | {rate['hyserve']:.1f}% |",
        f"| ideal for hyserve's policy | {hits['ideal']:.0f} | {rate['ideal']:.1f}% |",
        f"| vLLM-style, {vb['block_size']}-token blocks | {hits['vllm_style']:.0f} | {rate['vllm_style']:.1f}% |",
        f"| vLLM-style, {vb['block_size']}-token blocks + checkpoint at request end | "
        f"{hits['vllm_style_with_finish_checkpoint']:.0f} | "
        f"{rate['vllm_style_with_finish_checkpoint']:.1f}% |",
        f"| vLLM-style, {vb['block_size_qwen35_2b_bf16']}-token blocks (2B shape) | "
        f"{hits['vllm_style_at_2b_block']:.0f} | {rate['vllm_style_at_2b_block']:.1f}% |",
        "",
        f"hyserve reaches {rep['hyserve_vs_ideal_pct']:.1f}% of the ideal. Outputs ON vs OFF: "
        + ("identical for every request." if rep["outputs_identical"]
           else f"**{len(rep['output_mismatches'])} requests differ** ({', '.join(rep['output_mismatches'][:8])})."),
        "",
        "## Caching ON vs OFF",
        "",
        "| | OFF | ON |",
        "| --- | ---: | ---: |",
        f"| requests | {off['metrics']['hyserve:num_requests']:.0f} | {on['metrics']['hyserve:num_requests']:.0f} |",
        f"| prompt tokens | {off['metrics']['hyserve:prompt_tokens']:.0f} | "
        f"{on['metrics']['hyserve:prompt_tokens']:.0f} |",
        f"| prefix-cache hit tokens | {off['metrics']['hyserve:prefix_cache_hits']:.0f} | "
        f"{on['metrics']['hyserve:prefix_cache_hits']:.0f} |",
        f"| prefill tokens computed | {off['prefill_tokens_computed']:.0f} | {on['prefill_tokens_computed']:.0f} |",
        f"| prefill tokens saved | | {rep['prefill_tokens_saved']:.0f} ({rep['prefill_tokens_saved_pct']:.1f}%) |",
        f"| preemptions | {off['metrics']['hyserve:num_preemptions']:.0f} | "
        f"{on['metrics']['hyserve:num_preemptions']:.0f} |",
        f"| TTFT mean | {_fmt_s(off['ttft']['mean_s'])} | {_fmt_s(on['ttft']['mean_s'])} |",
        f"| TTFT p50 | {_fmt_s(off['ttft']['p50_s'])} | {_fmt_s(on['ttft']['p50_s'])} |",
        f"| TTFT p90 | {_fmt_s(off['ttft']['p90_s'])} | {_fmt_s(on['ttft']['p90_s'])} |",
        f"| engine steps | {off['num_steps']} | {on['num_steps']} |",
        f"| steps from submit to first token (mean) | {off['steps_to_first_token_mean']:.2f} | "
        f"{on['steps_to_first_token_mean']:.2f} |",
        f"| wall time | {off['wall_s']:.2f} s | {on['wall_s']:.2f} s |",
        "",
        "Prefill tokens computed = scheduled tokens - (generation tokens - requests). TTFT = `add_request` to the "
        "end of the step that returned the first token (includes queueing). Steps from submit to first token: "
        "engine steps a request waits for its first token; more than 1 means its prefill was split (token budget, "
        "or chunks cut at snapshot points).",
        "",
        "The ideal and vLLM-style simulations count a request's end-of-prompt publications (KV, snapshots) as "
        "visible from the step that returned its first token and its end-of-request ones from the step that "
        "finished it, to requests submitted at or after that step; the engine looks a request up at admission and "
        "publishes snapshots as soon as a chunk reaches them, so it can score slightly above this ideal.",
        "",
        "## Per turn",
        "",
        "Hit rate per turn (% of that turn's prompt tokens); hyserve's per-request hits come from "
        + _hits_source_note(rep["per_request_hits"]) + ".",
        "",
        f"| turn | requests | prompt tokens | hyserve | ideal | vLLM-style {vb['block_size']} | "
        f"vLLM-style {vb['block_size_qwen35_2b_bf16']} | TTFT OFF | TTFT ON |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rep["per_turn"]:
        p = row["prompt_tokens"]
        lines.append(f"| {row['turn']} | {row['requests']} | {p} | {_pct(row['hits_hyserve'], p):.1f}% | "
                     f"{_pct(row['hits_ideal'], p):.1f}% | {_pct(row['hits_vllm_style'], p):.1f}% | "
                     f"{_pct(row['hits_vllm_style_at_2b_block'], p):.1f}% | "
                     f"{_fmt_s(row['ttft_off_mean_s'])} | {_fmt_s(row['ttft_on_mean_s'])} |")
    lines += ["", f"Command: `{rep['args']['command']}`", ""]
    return "\n".join(lines)


def plot(rep: dict[str, Any], path: str) -> bool:
    """Per-turn hit rate (hyserve, ideal, vLLM-style) and per-turn mean TTFT ON vs OFF. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the plot", file=sys.stderr)
        return False
    rows = rep["per_turn"]
    turns = [r["turn"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    vb = rep["vllm_style"]
    for key, label, style in (("hits_hyserve", "hyserve (measured)", "o-"),
                              ("hits_ideal", "ideal for hyserve's policy", "k--"),
                              ("hits_vllm_style", f"vLLM-style ({vb['block_size']}-token blocks)", "s-"),
                              ("hits_vllm_style_at_2b_block",
                               f"vLLM-style ({vb['block_size_qwen35_2b_bf16']}-token blocks, 2B shape)", "^:")):
        ax1.plot(turns, [_pct(r[key], r["prompt_tokens"]) for r in rows], style, label=label)
    ax1.set_xticks(turns)
    ax2.set_xticks(turns)
    ax1.set_xlabel("turn")
    ax1.set_ylabel("prefix-cache hit rate (% of prompt tokens)")
    ax1.set_ylim(0, 100)
    ax1.legend()
    ax1.grid(alpha=0.3)
    ax2.plot(turns, [r["ttft_off_mean_s"] * 1e3 for r in rows], "o-", label="caching OFF")
    ax2.plot(turns, [r["ttft_on_mean_s"] * 1e3 for r in rows], "o-", label="caching ON")
    ax2.set_xlabel("turn")
    ax2.set_ylabel("mean TTFT (ms)")
    ax2.set_ylim(bottom=0)
    ax2.legend()
    ax2.grid(alpha=0.3)
    fig.suptitle(f"Prefix caching, workload '{rep['workload']['scale']}' ({rep['workload']['requests']} requests, "
                 f"{rep['model']['description']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------------------------------------- main


def _make_llm(args: argparse.Namespace, model_dir: str, spec: AgentTraceSpec, caching: bool) -> LLM:
    from hyserve import LLM

    kwargs: dict[str, Any] = {
        "model": model_dir, "device": args.device, "dtype": args.dtype,
        "max_num_seqs": args.max_num_seqs or spec.concurrency,
        "max_num_batched_tokens": args.max_num_batched_tokens, "enable_prefix_caching": caching,
        "max_model_len": spec.max_prompt_len + spec.output_len[1] + 16, "block_size": 16, "seed": 0,
    }
    if args.snapshot_interval is not None:
        kwargs["recurrent_snapshot_interval"] = args.snapshot_interval
    if args.gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    return LLM(**kwargs)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--scale", choices=["cpu", "full"], default="cpu")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--model", default=None, help="checkpoint dir (default: write a tiny random one)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-conversations", type=int, default=None, help="override the scale's conversation count")
    ap.add_argument("--concurrency", type=int, default=None, help="override the scale's concurrency")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="default: the concurrency")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--gpu-memory-utilization", type=float, default=None)
    ap.add_argument("--snapshot-interval", type=int, default=None,
                    help="recurrent_snapshot_interval (passed to the engine and the ideal simulation only if given)")
    ap.add_argument("--allow-mismatch", action="store_true", help="exit 0 even if ON and OFF outputs differ")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)  # tiny models on few cores: the thread pool only adds overhead
    from hyserve.model.registry import load_model_config
    from hyserve.testing import write_tiny_checkpoint

    spec = workload_spec(args.scale)
    overrides = {k: v for k, v in (("num_conversations", args.num_conversations), ("concurrency", args.concurrency))
                 if v is not None}
    if overrides:
        spec = AgentTraceSpec(**{**{k: getattr(spec, k) for k in spec.__dataclass_fields__}, **overrides})
    os.makedirs(args.out, exist_ok=True)
    tmp = None
    model_dir = args.model
    if model_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="hyserve-bench-")
        model_dir = write_tiny_checkpoint(tmp.name, max_position_embeddings=16384)
    cfg = load_model_config(model_dir)
    conversations = make_conversations(spec, args.seed, cfg.vocab_size)

    runs: dict[bool, RunResult] = {}
    dtype_name = args.dtype
    interval = args.snapshot_interval
    for caching in (False, True):
        llm = _make_llm(args, model_dir, spec, caching)
        dtype = llm.llm_engine.dtype
        dtype_name = str(dtype).removeprefix("torch.")
        if caching and interval is None:  # the engine's default interval, for the ideal simulation
            interval = getattr(llm.llm_engine.config, "recurrent_snapshot_interval", None)
        print(f"running caching={'ON' if caching else 'OFF'}: {sum(c.num_turns for c in conversations)} requests",
              file=sys.stderr, flush=True)
        runs[caching] = run_workload(llm, conversations, spec.concurrency, caching=caching,
                                     vocab_size=cfg.vocab_size)
        print(f"  wall {runs[caching].wall_s:.1f} s, hits {runs[caching].metrics['hyserve:prefix_cache_hits']:.0f}",
              file=sys.stderr, flush=True)
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    kv_bytes = torch.finfo(getattr(torch, dtype_name)).bits // 8
    shape = StateShape.of(cfg)
    vllm_block = vllm_style_block_size(shape, kv_bytes)
    vllm_block_2b = vllm_style_block_size(QWEN35_2B_STATE_SHAPE, 2)
    policy = SnapshotPolicy(block_size=16, interval=interval)
    n_attn, n_gdn = len(cfg.attention_layer_ids), len(cfg.linear_layer_ids)
    model = {
        "dir": args.model or "(tiny random checkpoint written by the benchmark)",
        "description": (f"{'tiny random' if args.model is None else os.path.basename(os.path.normpath(model_dir))} "
                        f"Qwen3.5 ({cfg.num_hidden_layers} layers: {n_gdn} GDN + {n_attn} attention, hidden "
                        f"{cfg.hidden_size}, {cfg.num_parameters() / 1e6:.2f}M params)"),
        "dtype": dtype_name, "device": args.device, "vocab_size": cfg.vocab_size,
        "state_bytes_per_gdn_layer": shape.state_bytes_per_layer(kv_bytes),
        "kv_bytes_per_token_per_attention_layer": shape.kv_bytes_per_token_per_layer(kv_bytes),
    }
    cli: dict[str, Any] = dict(vars(args))
    cli["command"] = "python benchmarks/prefix_cache_bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
    rep = build_report(spec, runs[True], runs[False], model=model, machine=_machine(args.device), policy=policy,
                       vllm_block=vllm_block, vllm_block_2b=vllm_block_2b, args=cli)
    with open(os.path.join(args.out, "prefix_cache.json"), "w") as f:
        json.dump(rep, f, indent=1)
        f.write("\n")
    md = render_markdown(rep)
    with open(os.path.join(args.out, "prefix_cache.md"), "w") as f:
        f.write(md)
    plot(rep, os.path.join(args.out, "prefix_cache.png"))
    print(md)
    if tmp is not None:
        tmp.cleanup()
    if not rep["outputs_identical"]:
        print(f"ERROR: {len(rep['output_mismatches'])} requests produced different outputs with caching ON and OFF",
              file=sys.stderr)
        return 0 if args.allow_mismatch else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The seed's own deployment as a benchmark (issue 34, item 1): the second report's 27B Qwen3.5 VLM in FP8 W8A8 with
MTP 2 and prefix caching, serving 32 GUI agents, through hyserve and through vLLM with the report's own flags.

    python benchmarks/peer_bench.py write --shape 27b --vision 27b --fp8 ct_dynamic --no-weights --out /tmp/s27
    python benchmarks/seed_bench.py measure --engine hyserve --model /tmp/s27 --out $OUT/hyserve_seed.json
    PYTHONPATH=/tmp/vsite python benchmarks/seed_bench.py measure --engine vllm --model /tmp/s27 \\
        --out $OUT/vllm_seed.json
    python benchmarks/seed_bench.py report $OUT/hyserve_seed.json $OUT/vllm_seed.json --out DIR   # seed.md, seed.png

**The checkpoint** (``peer_bench.py write``): Qwen3.5-27B's text shape (``shapes.py`` ``SHAPE_27B``, its sources
there), the 27B class's vision tower (``VISION_27B``), one MTP layer, in the seed's compressed-tensors FP8_DYNAMIC
form (``peer_bench.SEED_FP8_IGNORE`` kept in bf16), config.json alone: both engines make the weights at load
(``--load-format dummy``; hyserve's dummy format makes FP8 weights and scales for the layers the
``quantization_config`` quantizes, vLLM's too), which saves writing 27 GB of random FP8 on the device's 64 GiB disk.

**The flags** (``SEED_FLAGS``): the report's ``vllm serve`` line, parsed by each engine's own command-line parser
(hyserve's ``engine_args``, vLLM's ``AsyncEngineArgs.add_cli_args``), as ``hyserve serve`` / ``vllm serve`` would:
``--max-model-len 62768 --max-num-seqs 32 --gpu-memory-utilization 0.95 --enable-chunked-prefill
--limit-mm-per-prompt.image 10 --enable-prefix-caching --mamba-cache-mode align --speculative-config
'{"method": "mtp", "num_speculative_tokens": 2}'``, plus ``--load-format dummy --dtype bfloat16``. hyserve takes
``--enable-chunked-prefill`` and ``--mamba-cache-mode align`` as vLLM's flags whose purpose it serves by
construction (an INFO line each). The MTP head of random weights accepts nothing, so each engine's acceptance is
drawn at ``--acceptance`` (0.8 per draft token, acceptance ending at the first rejection; 1 + 0.8 + 0.64 = 2.44
tokens a verify step): both engines take vLLM's synthetic rejection sampling in their speculative config
(``rejection_sample_method: "synthetic"`` at the same per-position rates, ``peer_bench.synthetic_mtp_config``;
hyserve draws the verdicts inside its verify graphs, in whatever process its worker runs). The head still drafts
every step: its cost is in the timing.

**The trace** (``SEED_TRACES["seed"]``, the report's workload): episodes of a GUI agent's steps. Every request is
the episode's conversation so far, rendered with the checkpoint's chat template: a system prompt shared by every
episode (1,700 random ids), then per step a user message (step 0: the task and first observation, 1,450-1,850 ids;
later steps: an observation, 250-550 ids) followed by that step's screenshot, and the assistant's actual output of
each earlier step (ids at or above the random text's range, which random weights emit, folded into it). A request
shows the current screenshot and the two before it as images (1, 2, then 3 images: the sliding two-screenshot
history); an older screenshot's place holds 8 ids of text instead. Screenshots are 1280x720 random-noise RGB images
(880 placeholder tokens each at patch 16, merge 2), one per episode and step. Each episode draws 3-10 steps and ends
before a step whose prompt would pass 12,000 tokens. On the 27B checkpoint (880 placeholder tokens a screenshot) the
default run of 256 requests spans 53 episodes (steps 0 / 1 / ... / 8 sent 53 / 50 / 45 / 34 / 26 / 20 / 16 / 9 / 3
times); its prompts (placeholders expanded) run from 4,060 to 10,299 tokens, mean 6,642, deciles 4,175 / 4,448 /
5,555 / 5,888 / 6,961 / 7,324 / 7,660 / 8,135 / 8,821 (1.70M prompt tokens in all), with 2.39 images a request
(with instant answers: the agents' interleaving moves these a little). Answers: ``max_tokens`` drawn in 20-100
per step, ``ignore_eos`` (random weights never stop), temperature 0. Consecutive steps of an episode share the
prefix up to the screenshot that left the window; every request shares the system prompt. All of it is a pure
function of ``--seed`` (the outputs alone come from the engine).

**The client** (``run_closed_loop``): a closed loop of ``--concurrency`` (32) agents on the engine's async API
(hyserve's ``AsyncEngine``, the one its server runs; vLLM's ``AsyncLLM``, the one ``vllm serve`` runs, engine core
in its own process): each agent takes the next episode and submits its steps one at a time, each when the previous
one's last output arrives, until ``--requests`` (256) requests have been submitted. Before it, a warm-up of
``concurrency`` first steps of other episodes (another system prompt: no cache hit for the timed run). Per request
the client records its submission, the arrival of its first output token and of its last (``time.perf_counter``),
its prompt tokens (``RequestOutput.prompt_token_ids``, placeholders expanded), prompt tokens served from the prefix
cache (``RequestOutput.num_cached_tokens``) and output tokens.

**Figures** (``figures``): requests/s and output tokens/s over the run (first submission to last answer); TTFT
(first token - submission) mean, p50, p99; time per output token ``(e2e - TTFT) / (n_out - 1)`` mean, p50, p99;
end-to-end latency p50 / p99; the prefix-cache hit rate (cached prompt tokens / prompt tokens), overall and for first
and later steps; prompt and output lengths; images per request. ``report`` pairs hyserve's and vLLM's files: one
table (both figures, hyserve better by: the ratio, higher- or lower-is-better per figure) and a plot.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import os
import random
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import peer_bench as pb  # benchmarks/ is on the path (above)
from shapes import SHAPE_27B, VISION_27B

# The report's `vllm serve` line (../shared/seeds/004_ad245c2ab18366d1.txt), less the model, name and port.
SEED_FLAGS = ["--max-model-len", "62768", "--max-num-seqs", "32", "--gpu-memory-utilization", "0.95",
              "--enable-chunked-prefill", "--limit-mm-per-prompt.image", "10", "--enable-prefix-caching",
              "--mamba-cache-mode", "align"]
SEED_SPEC = {"method": "mtp", "num_speculative_tokens": 2}


@dataclass(frozen=True)
class SeedTrace:
    """Sizes of the seed's GUI-agent trace; ranges inclusive, drawn uniformly; lengths in token ids."""

    prefix_len: int  # the system prompt every episode shares
    first_message_len: tuple[int, int]  # step 0's user message (the task, the first observation)
    message_len: tuple[int, int]  # a later step's user message (an observation)
    output_len: tuple[int, int]  # each step's max_tokens (ignore_eos: the answer's length)
    steps: tuple[int, int]  # steps an episode draws (fewer where a prompt would pass prompt_len[1])
    screen: tuple[int, int]  # width, height of every screenshot
    prompt_len: tuple[int, int]  # every prompt's length, placeholders expanded, lies in this range
    history: int = 2  # earlier screenshots shown as images beside the current one
    earlier_len: int = 8  # the text that stands in for an older screenshot
    concurrency: int = 32
    requests: int = 256


SEED_TRACES = {
    "seed": SeedTrace(prefix_len=1700, first_message_len=(1450, 1850), message_len=(250, 550), output_len=(20, 100),
                      steps=(3, 10), screen=(1280, 720), prompt_len=(4000, 12000)),
    # The same structure on the tiny test VLM (hyserve.testing: 48x32 screenshots are 24 placeholder tokens).
    "tiny": SeedTrace(prefix_len=60, first_message_len=(30, 40), message_len=(8, 16), output_len=(2, 6),
                      steps=(2, 5), screen=(48, 32), prompt_len=(120, 300), earlier_len=4, concurrency=4,
                      requests=20),
}


class Episode:
    """One episode of a ``SeedTrace``: its messages, answer lengths and stand-in texts, drawn from ``(seed, index)``
    alone; ``num_steps`` is set by ``SeedPrompts.episode`` (the steps whose prompts fit)."""

    def __init__(self, trace: SeedTrace, index: int, prefix: list[int], vocab: int, seed: int) -> None:
        rng = random.Random(f"seed-trace/{seed}/{index}")

        def ids(n: int) -> list[int]:
            return [rng.randrange(vocab) for _ in range(n)]

        self.trace, self.index, self.prefix, self.seed = trace, index, prefix, seed
        self.drawn_steps = rng.randint(*trace.steps)
        self.messages = [ids(rng.randint(*trace.first_message_len))]
        self.messages += [ids(rng.randint(*trace.message_len)) for _ in range(self.drawn_steps - 1)]
        self.output_lens = [rng.randint(*trace.output_len) for _ in range(self.drawn_steps)]
        self.earlier = [ids(trace.earlier_len) for _ in range(self.drawn_steps)]
        self.num_steps = self.drawn_steps

    def visible(self, step: int) -> list[int]:
        """The screenshots step ``step`` shows as images, oldest first: its own and the ``history`` before it."""
        return list(range(max(0, step - self.trace.history), step + 1))

    def chat(self, step: int, outputs: list[list[int]]) -> tuple[list[dict[str, Any]], dict[str, list[int]]]:
        """Step ``step``'s messages for a chat template (random text as sentinel strings) and the sentinels' ids:
        system, then per step ``j <= step`` a user message (its text, then screenshot ``j``: an image part if
        visible, else its stand-in text) and, before ``step``, the assistant's output ``outputs[j]``."""
        pieces: dict[str, list[int]] = {}

        def text(ids: list[int]) -> str:
            key = f"\x00{len(pieces)}\x00"
            pieces[key] = list(ids)
            return key

        shown = set(self.visible(step))
        messages: list[dict[str, Any]] = [{"role": "system", "content": text(self.prefix)}]
        for j in range(step + 1):
            shot: dict[str, Any] = {"type": "image"} if j in shown else {"type": "text", "text": text(self.earlier[j])}
            messages.append({"role": "user", "content": [{"type": "text", "text": text(self.messages[j])}, shot]})
            if j < step:
                messages.append({"role": "assistant", "content": text(outputs[j])})
        return messages, pieces


class SeedPrompts:
    """A ``SeedTrace`` on a checkpoint: its episodes, each step's prompt (token ids with one placeholder per image,
    and the images) and its length with the placeholders expanded as the checkpoint's processor files say."""

    def __init__(self, model: str, trace: SeedTrace, seed: int = 0) -> None:
        from hyserve.multimodal.chat import image_token_count
        from hyserve.multimodal.image import ImageProcessorSettings

        self.model, self.trace, self.seed = model, trace, seed
        self.builder = pb.PromptBuilder(model)
        self.vocab = pb.text_vocab(model)
        self.image_tokens = image_token_count(trace.screen, ImageProcessorSettings.from_checkpoint(model))
        rng = random.Random(f"seed-trace/{seed}/prefix")
        self.prefix = [rng.randrange(self.vocab) for _ in range(trace.prefix_len)]
        self._shots: dict[tuple[int, int], Any] = {}
        self._noise: Any = None

    def episode(self, index: int) -> Episode:
        """Episode ``index``, its steps cut before the first whose prompt would pass ``prompt_len[1]``."""
        ep = Episode(self.trace, index, self.prefix, self.vocab, self.seed)
        outputs = [[0] * n for n in ep.output_lens]
        lens = [self.expanded_len(ep, s, outputs) for s in range(ep.drawn_steps)]
        if lens[0] < self.trace.prompt_len[0] or lens[0] > self.trace.prompt_len[1]:
            raise ValueError(f"episode {index}'s first prompt has {lens[0]} tokens, outside {self.trace.prompt_len}: "
                             "the trace's sizes do not fit this checkpoint")
        ep.num_steps = next((s for s, n in enumerate(lens) if n > self.trace.prompt_len[1]), ep.drawn_steps)
        return ep

    def episodes(self, start: int = 0) -> Iterator[Episode]:
        index = start
        while True:
            yield self.episode(index)
            index += 1

    def ids(self, ep: Episode, step: int, outputs: list[list[int]]) -> list[int]:
        messages, pieces = ep.chat(step, outputs)
        return self.builder.ids(messages, pieces)

    def expanded_len(self, ep: Episode, step: int, outputs: list[list[int]]) -> int:
        return len(self.ids(ep, step, outputs)) + len(ep.visible(step)) * (self.image_tokens - 1)

    def screenshot(self, ep: Episode, index: int) -> Any:
        """Screenshot ``index`` of ``ep``: ``trace.screen`` of uniform RGB noise, a PIL image kept while its episode
        may still show it. The noise is a window of one buffer drawn once from the seed, starting at a pixel unique
        to (episode, index): every screenshot differs from every other (no image repeats across episodes, so no
        cache of either engine serves one screenshot for another), and one costs a copy, not a draw (the client
        builds it between two steps of an episode)."""
        key = (ep.index, index)
        if key not in self._shots:
            import numpy as np
            from PIL import Image

            w, h = self.trace.screen
            size = w * h * 3
            if self._noise is None:
                self._noise = np.random.default_rng([self.seed, 34]).integers(0, 256, 2 * size, dtype=np.uint8)
            start = 3 * ((ep.index * (self.trace.steps[1] + 1) + index) % (size // 3))
            self._shots[key] = Image.fromarray(self._noise[start : start + size].reshape(h, w, 3), "RGB")
            self._shots.pop((ep.index, index - self.trace.history - 1), None)
        return self._shots[key]

    def request(self, ep: Episode, step: int, outputs: list[list[int]]) -> dict[str, Any]:
        """Step ``step``'s prompt for either engine: ``prompt_token_ids`` and ``multi_modal_data``."""
        return {"prompt_token_ids": self.ids(ep, step, outputs),
                "multi_modal_data": {"image": [self.screenshot(ep, k) for k in ep.visible(step)]}}

    def history_ids(self, output: list[int]) -> list[int]:
        """An answer as the next step's history holds it: ids at or above the random text's range (special tokens,
        the vision tokens among them, which random weights can emit) folded into it."""
        return [t if t < self.vocab else t % self.vocab for t in output]


# ------------------------------------------------------------------------------------------------------ engines


CACHE_COUNTS = ("prefix_cache_snapshots_taken", "prefix_cache_snapshot_evictions", "prefix_cache_snapshot_hits",
                "prefix_cache_snapshot_misses", "prefix_cache_kv_evictions", "num_preemptions",
                "prefix_cache_snapshot_offloads", "prefix_cache_snapshot_host_hits")


class LoopClock:
    """Where a closed loop's host time goes in hyserve: seconds (and calls) of the engine's ``add_request`` and
    ``step`` (both on ``AsyncEngine``'s loop thread, every running request waiting meanwhile) and of
    ``prepare_prompt`` (a request's images processed, on a worker thread: summed over threads that may overlap),
    by wrapping those methods on the engine instance. ``reset`` after the warm-up."""

    NAMES = ("add_request", "step", "prepare_prompt")

    def __init__(self, engine: Any, profile: tuple[int, int] | None = None, profile_path: str | None = None) -> None:
        self._lock = threading.Lock()
        # ``profile`` = (a, b): a torch profiler (CPU and CUDA) on the loop thread from the a-th step result after
        # ``reset`` to the b-th; its trace goes to ``profile_path`` and its device gaps to ``profile_report``.
        self.profile, self.profile_path = profile, profile_path
        self.profile_report: dict[str, Any] | None = None
        self._profiler: Any = None
        self._frozen: list[tuple[float, int, int]] | None = None
        if profile is not None:  # the profiler's first use registers it with this (the main) thread
            import torch
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as start

            with start(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available()
                                                            else [])):
                torch.zeros(1)
        self.seconds = dict.fromkeys(self.NAMES, 0.0)
        self.calls = dict.fromkeys(self.NAMES, 0)
        self.steps: list[tuple[float, int, int]] = []
        # (seconds, tokens, prompt tokens) of each step as its worker timed it (on CUDA its device time): unlike the
        # interval between results, not lengthened by the host launching the next step before it read this one
        self.device_steps: list[tuple[float, int, int]] = []
        for name in self.NAMES:
            setattr(engine, name, self._timed(name, getattr(engine, name)))
        # Each step's result as the loop thread gets it: its arrival, its tokens and the prompt tokens among them.
        scheduled, apply = engine._on_scheduled, engine._on_result

        prompt_tokens: dict[int, int] = {}  # step id -> its prompt tokens, until its result

        def on_scheduled(so: Any) -> Any:
            prompt_tokens[so.step_id] = sum(
                max(0, min(row.end, req.num_prompt_tokens) - row.start) for row in so.rows
                if (req := engine.requests.get(row.req_id)) is not None)
            return scheduled(so)

        untimed: dict[int, tuple[int, int]] = {}  # step id -> (tokens, prompt tokens), until the worker's time of it

        def on_result(so: Any, ro: Any, t0: float) -> Any:
            prompt = prompt_tokens.pop(so.step_id, 0)
            self.steps.append((time.perf_counter(), so.num_tokens, prompt))
            if so.rows:
                untimed[so.step_id] = (so.num_tokens, prompt)
            for step_id, seconds in ro.step_seconds or ():  # the worker's own time of a step (StepTimer)
                if (known := untimed.pop(step_id, None)) is not None:
                    self.device_steps.append((seconds, *known))
            self._maybe_profile()
            return apply(so, ro, t0)
        engine._on_scheduled, engine._on_result = on_scheduled, on_result

    def _timed(self, name: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    self.seconds[name] += time.perf_counter() - t0
                    self.calls[name] += 1
        return timed

    def reset(self) -> None:
        with self._lock:
            self.seconds = dict.fromkeys(self.NAMES, 0.0)
            self.calls = dict.fromkeys(self.NAMES, 0)
            self.steps = []
            self.device_steps = []
            self._frozen = None

    def _maybe_profile(self) -> None:
        if self.profile is None or self.profile_report is not None:
            return
        n = len(self.steps)
        if n == self.profile[0] and self._profiler is None:
            import torch
            from torch.profiler import ProfilerActivity, profile

            cuda = [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
            self._profiler = profile(activities=[ProfilerActivity.CPU, *cuda])
            self._profiler.__enter__()
            self._profile_steps = n
        elif n == self.profile[1] and self._profiler is not None:
            import torch
            from trace_gaps import gaps_of_profile

            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self._profiler.__exit__(None, None, None)
            path = self.profile_path or "seed_profile.json.gz"
            report = gaps_of_profile(self._profiler, path)
            first = self._profile_steps
            report["steps"] = [(round(b[0] - a[0], 6), b[1], b[2]) for a, b in
                               itertools.pairwise(self.steps[first - 1 : n])]
            self.profile_report = report
            self._profiler = None

    def step_trace(self) -> list[tuple[float, int, int]]:
        """Each step after the first since ``reset``, up to ``figures``' call if made: (seconds since the previous
        result, tokens, prompt tokens)."""
        steps = self._frozen if self._frozen is not None else self.steps
        return [(round(b[0] - a[0], 6), b[1], b[2]) for a, b in itertools.pairwise(steps)]

    def figures(self) -> dict[str, float]:
        with self._lock:
            return {"loop_add_request_s": self.seconds["add_request"], "loop_step_s": self.seconds["step"],
                    "loop_steps": float(self.calls["step"]), "prepare_images_s": self.seconds["prepare_prompt"],
                    "prepare_images_calls": float(self.calls["prepare_prompt"]), **step_figures(self._freeze()),
                    **device_step_figures(list(self.device_steps))}

    def _freeze(self) -> list[tuple[float, int, int]]:
        """The steps so far, kept for ``step_trace``: the figures and the trace read the same steps."""
        self._frozen = list(self.steps)
        return self._frozen


def step_figures(steps: list[tuple[float, int, int]]) -> dict[str, float]:
    """What the steps' results say of where the time goes, from (arrival time, tokens, prompt tokens) of each step's
    result in order: the interval since the previous result is the step's time while the device is the bottleneck
    (a result waits for its step; the next step is already launched). A least-squares line through (tokens,
    interval) gives a step's fixed time and its time per token; the steps with no prompt tokens (verify and decode
    rows only) give the decode step's time; the rest is the steps that carry prompt chunks."""
    import numpy as np

    if len(steps) < 3:
        return {}
    t = np.array([s[0] for s in steps])
    dt, tokens = np.diff(t), np.array([s[1] for s in steps[1:]])
    decode = np.array([s[2] for s in steps[1:]]) == 0
    slope, fixed = np.polyfit(tokens, dt, 1) if len(set(tokens.tolist())) > 1 else (0.0, float(dt.mean()))
    return {"steps_timed": float(len(dt)), "step_tokens_mean": float(tokens.mean()),
            "step_fixed_ms": 1e3 * float(fixed), "step_us_per_token": 1e6 * float(slope),
            "steps_decode_only": float(decode.sum()),
            "step_decode_only_ms_p50": 1e3 * float(np.median(dt[decode])) if decode.any() else 0.0,
            "step_decode_only_s": float(dt[decode].sum()), "step_with_prompt_s": float(dt[~decode].sum()),
            "step_with_prompt_tokens_mean": float(tokens[~decode].mean()) if (~decode).any() else 0.0}


def device_step_figures(steps: list[tuple[float, int, int]]) -> dict[str, float]:
    """The steps as their worker timed them (``LoopClock.device_steps``: seconds, tokens, prompt tokens): how many,
    the seconds of those with prompt tokens and the rate they computed prompt tokens at, the seconds of the rest and
    their median."""
    import numpy as np

    if not steps:
        return {}
    sec = np.array([s[0] for s in steps])
    prompt = np.array([s[2] for s in steps])
    has = prompt > 0
    out = {"device_steps": float(len(steps)), "device_prompt_steps_s": float(sec[has].sum()),
           "device_prompt_tok_s": float(prompt[has].sum() / sec[has].sum()) if has.any() and sec[has].sum() else 0.0,
           "device_decode_steps_s": float(sec[~has].sum()),
           "device_decode_step_ms_p50": 1e3 * float(np.median(sec[~has])) if (~has).any() else 0.0}
    if len(set(prompt[has].tolist())) > 1:  # a prompt step's device time as a + b x its prompt tokens
        slope, fixed = np.polyfit(prompt[has], sec[has], 1)
        out.update(device_prompt_step_fixed_ms=1e3 * float(fixed), device_prompt_us_per_token=1e6 * float(slope))
    return out


class HyserveAsync:
    """hyserve's ``AsyncEngine`` (what ``hyserve serve`` runs) on an engine built from ``flags`` by hyserve's own
    parser (``engine_args``)."""

    name = "hyserve"

    def __init__(self, model: str, flags: list[str], layout: dict[str, int] | None = None,
                 profile: tuple[int, int] | None = None, profile_path: str | None = None) -> None:
        from hyserve.engine_args import engine_args, expand_dotted, make_llm
        from hyserve.server.async_engine import AsyncEngine

        parser = argparse.ArgumentParser()
        engine_args(parser, serving=True)
        self.args = parser.parse_args(expand_dotted(flags))
        # ``layout``: the cache's counts given (a replay of a card's layout on the CPU), not sized from memory
        self.llm = make_llm(self.args, model, **(layout or {}))
        lay = self.llm.llm_engine.layout
        self.layout = {"kv_blocks": lay.num_kv_blocks - 1, "state_slots": lay.num_state_slots,
                       "snapshots": lay.num_snapshots, "host_snapshots": lay.num_host_snapshots,
                       "state_bytes_per_slot": lay.state_bytes_per_slot, "kv_bytes_per_block": lay.kv_bytes_per_block}
        # before the loop thread starts calling the methods
        self.clock = LoopClock(self.llm.llm_engine, profile, profile_path)
        self.engine = AsyncEngine(self.llm.llm_engine)
        self.version = pb.git_commit()
        from hyserve import SamplingParams

        self.SamplingParams = SamplingParams

    def stream(self, request_id: str, prompt: dict[str, Any], max_tokens: int) -> AsyncIterator[Any]:
        params = self.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return self.engine.generate(request_id, prompt, params)

    def stats(self) -> dict[str, float]:
        m = self.engine.get_metrics()
        drafts = float(m.get("hyserve:spec_decode_num_drafts", 0) or 0)  # type: ignore[arg-type]
        accepted = float(m.get("hyserve:spec_decode_num_accepted_tokens", 0) or 0)  # type: ignore[arg-type]
        out = {"spec_mean_acceptance_length": 1 + accepted / drafts} if drafts else {}
        # the prefix cache's own counts (the warm-up's included): what its hit rate came from
        for key in CACHE_COUNTS:
            out[key] = float(m.get(f"hyserve:{key}", 0) or 0)  # type: ignore[arg-type]
        # what the prefix cache learned of each kind of resume point (how often one is resumed from)
        pc = self.llm.llm_engine.prefix_cache
        if pc is not None:
            out.update({f"prefix_cache_utility_{kind}": u for kind, u in pc.kind_utilities().items()})
        # the vision tower's work: screenshots encoded, and those brought back from the encoder cache's host tier
        enc = self.llm.llm_engine.executor.collective_rpc("encoder_cache_stats")[0]
        out.update({"images_encoded": float(enc["images_encoded"]), "tower_calls": float(enc["tower_calls"]),
                    "images_from_host": float(enc["images_from_host"])})
        return {**out, **self.clock.figures()}

    def after_warmup(self) -> None:
        self.clock.reset()

    def close(self) -> None:
        self.engine.shutdown()
        self.llm.shutdown()


class VllmAsync:
    """vLLM's ``AsyncLLM`` (what ``vllm serve`` runs; engine core in its own process unless
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) on engine args parsed from ``flags`` by vLLM's own parser, built in
    ``vllm serve``'s usage context (``OPENAI_API_SERVER``), whose defaults (tokens a step among them) it takes."""

    name = "vllm"

    def __init__(self, model: str, flags: list[str]) -> None:
        import vllm
        from vllm import SamplingParams
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        try:
            from vllm.utils.argparse_utils import FlexibleArgumentParser
        except ImportError:  # older releases
            from vllm.utils import FlexibleArgumentParser  # type: ignore[attr-defined,no-redef]
        from vllm.usage.usage_lib import UsageContext

        parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
        self.args = parser.parse_args(["--model", model, *flags])
        # ``vllm serve``'s usage context: its defaults follow it (on an H100 or H200, 8,192 tokens a step where
        # ``AsyncLLM.from_engine_args``'s own default context gets the scheduler's 2,048)
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs.from_cli_args(self.args),
                                                usage_context=UsageContext.OPENAI_API_SERVER)
        self.version = vllm.__version__
        self.SamplingParams = SamplingParams

    def stream(self, request_id: str, prompt: dict[str, Any], max_tokens: int) -> AsyncIterator[Any]:
        params = self.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return self.engine.generate(prompt, params, request_id)  # type: ignore[no-any-return]

    def stats(self) -> dict[str, float]:
        return {}

    def after_warmup(self) -> None:  # its engine core runs in another process: no loop clock here
        pass

    def close(self) -> None:
        self.engine.shutdown()


# ------------------------------------------------------------------------------------------------------- client


@dataclass
class RequestRecord:
    """One request as the client saw it: times in ``time.perf_counter`` seconds."""

    episode: int
    step: int
    submitted: float
    first: float | None = None
    finished: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    max_tokens: int = 0
    images: int = 0
    expected_prompt_tokens: int = 0
    output: list[int] = field(default_factory=list)


async def run_closed_loop(engine: Any, prompts: SeedPrompts, episodes: Iterator[Episode], concurrency: int,
                          requests: int, tag: str = "r", clock: Callable[[], float] = time.perf_counter,
                          deadline: float | None = None) -> list[RequestRecord]:
    """``concurrency`` agents, each taking the next episode of ``episodes`` and submitting its steps one at a time
    (a step when the previous one's last output has arrived), until ``requests`` requests have been submitted, or
    until ``clock()`` passes ``deadline`` (no request is submitted after it; those in flight finish). Each step's
    prompt is built off the event loop (its screenshot drawn, its chat rendered) before its submission time is
    taken."""
    records: list[RequestRecord] = []
    left = [requests]

    def build(ep: Episode, step: int, outputs: list[list[int]]) -> tuple[dict[str, Any], int]:
        return prompts.request(ep, step, outputs), prompts.expanded_len(ep, step, outputs)

    async def agent() -> None:
        while left[0] > 0:
            ep = next(episodes)
            outputs: list[list[int]] = []
            for step in range(ep.num_steps):
                if left[0] <= 0:
                    return
                left[0] -= 1
                prompt, expected = await asyncio.to_thread(build, ep, step, outputs)
                now = clock()
                if deadline is not None and now > deadline:
                    left[0] = 0
                    return
                rec = RequestRecord(ep.index, step, now, max_tokens=ep.output_lens[step],
                                    images=len(prompt["multi_modal_data"]["image"]), expected_prompt_tokens=expected)
                records.append(rec)
                last = None
                async for out in engine.stream(f"{tag}-{ep.index}-{step}", prompt, ep.output_lens[step]):
                    if rec.first is None and out.outputs and len(out.outputs[0].token_ids) > 0:
                        rec.first = clock()
                    last = out
                rec.finished = clock()
                assert last is not None
                rec.output = list(last.outputs[0].token_ids)
                rec.output_tokens = len(rec.output)
                rec.prompt_tokens = len(last.prompt_token_ids)
                rec.cached_tokens = int(getattr(last, "num_cached_tokens", 0) or 0)
                outputs.append(prompts.history_ids(rec.output))

    await asyncio.gather(*(agent() for _ in range(concurrency)))
    return records


def check_records(records: list[RequestRecord], concurrency: int) -> None:
    """What a closed loop's records must satisfy (AssertionError naming the first request that does not): each
    request answered, submitted before its first token and that before its last; an episode's steps in order, each
    submitted after the previous one's last output; never more than ``concurrency`` requests in flight."""
    by_episode: dict[int, list[RequestRecord]] = {}
    for r in records:
        if r.first is None or r.finished is None:
            raise AssertionError(f"episode {r.episode} step {r.step}: no answer")
        if not r.submitted <= r.first <= r.finished:
            raise AssertionError(f"episode {r.episode} step {r.step}: submitted {r.submitted}, first token "
                                 f"{r.first}, last {r.finished}")
        by_episode.setdefault(r.episode, []).append(r)
    for ep, rs in by_episode.items():
        rs.sort(key=lambda r: r.step)
        if [r.step for r in rs] != list(range(len(rs))):
            raise AssertionError(f"episode {ep}: steps {[r.step for r in rs]}")
        for a, b in itertools.pairwise(rs):
            assert a.finished is not None
            if b.submitted < a.finished:
                raise AssertionError(f"episode {ep} step {b.step} submitted at {b.submitted}, before step {a.step}'s "
                                     f"answer ended at {a.finished}")
    events = sorted([(r.submitted, 1) for r in records] + [(r.finished, -1) for r in records  # type: ignore[misc]
                                                           if r.finished is not None], key=lambda e: (e[0], e[1]))
    live = 0
    for _, d in events:
        live += d
        if live > concurrency:
            raise AssertionError(f"{live} requests in flight, more than {concurrency}")


def ideal_hit_rate(prompts: SeedPrompts, records: list[RequestRecord], block_size: int = 16) -> float:
    """The hit rate a prefix cache keeping every snapshot would reach on this run: each request's longest common
    prefix with a request submitted before it (prompt and output, screenshots keyed by image), at most its prompt
    less one token, rounded down to ``block_size`` (hyserve's block; vLLM's ``align`` mode rounds to its attention
    block, 416 tokens on the 27B). The same trace gives both engines nearly the same figure: their answers differ."""
    import numpy as np

    by_episode: dict[int, dict[int, RequestRecord]] = {}
    for r in records:
        by_episode.setdefault(r.episode, {})[r.step] = r
    pad = prompts.builder.image_token_id
    bound = pb.CacheBound()  # every earlier request's prompt and output, keyed, as one turn
    cached = total = 0
    for r in sorted(records, key=lambda r: r.submitted):
        ep = prompts.episode(r.episode)
        outputs = [prompts.history_ids(by_episode[r.episode][j].output) for j in range(r.step)]
        expanded: list[int] = []
        for t in prompts.ids(ep, r.step, outputs):
            expanded += [t] * prompts.image_tokens if t == pad else [t]
        keyed = pb.CacheBound.keys(expanded, pad, [r.episode * 1000 + k for k in ep.visible(r.step)])
        cached += bound.add(keyed) // block_size * block_size
        total += len(keyed)
        bound.turn[-1] = np.concatenate([bound.turn[-1], np.asarray(prompts.history_ids(r.output), dtype=np.int64)])
    return cached / max(total, 1)


def hit_rates_by_step(steps: list[tuple[int, int, int]]) -> dict[str, float]:
    """The hit rate (cached / prompt tokens) of the second steps, the third, and the fourth on, from (step, prompt
    tokens, cached tokens) per request: the second and third steps repeat their episode so far whole; from the
    fourth on, each prompt turned its oldest screenshot into text, and the cached prefix ends there."""
    def share(lo: int, hi: int) -> float:
        sel = [(p, c) for s, p, c in steps if lo <= s <= hi]
        return sum(c for _, c in sel) / max(sum(p for p, _ in sel), 1)

    return {"prefix_hit_rate_step_1": share(1, 1), "prefix_hit_rate_step_2": share(2, 2),
            "prefix_hit_rate_steps_3_on": share(3, 1 << 30)}


def figures(records: list[RequestRecord]) -> dict[str, float]:
    """The run's figures (module docstring) from its records."""
    done = [r for r in records if r.first is not None and r.finished is not None]
    start = min(r.submitted for r in done)
    duration = max(r.finished for r in done) - start  # type: ignore[type-var,operator]
    ttft = [r.first - r.submitted for r in done]  # type: ignore[operator]
    e2e = [r.finished - r.submitted for r in done]  # type: ignore[operator]
    tpot = [(r.finished - r.first) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]  # type: ignore[operator]
    prompt = sum(r.prompt_tokens for r in done)
    cached = sum(r.cached_tokens for r in done)
    first = [r for r in done if r.step == 0]
    later = [r for r in done if r.step > 0]
    out = sum(r.output_tokens for r in done)

    def share(rs: list[RequestRecord]) -> float:
        return sum(r.cached_tokens for r in rs) / max(sum(r.prompt_tokens for r in rs), 1)

    fig = {
        "requests": float(len(done)), "duration_s": duration, "requests_per_s": len(done) / duration,
        "output_tok_s": out / duration, "prompt_tok_s": prompt / duration,
        "ttft_mean_s": sum(ttft) / len(ttft), "ttft_p50_s": pb.percentile(ttft, 0.5),
        "ttft_p99_s": pb.percentile(ttft, 0.99),
        "e2e_p50_s": pb.percentile(e2e, 0.5), "e2e_p99_s": pb.percentile(e2e, 0.99),
        "prefix_hit_rate": cached / max(prompt, 1), "prefix_hit_rate_first_steps": share(first),
        "prefix_hit_rate_later_steps": share(later),
        **hit_rates_by_step([(r.step, r.prompt_tokens, r.cached_tokens) for r in done]),
        "prompt_tokens_mean": prompt / len(done), "prompt_tokens_min": float(min(r.prompt_tokens for r in done)),
        "prompt_tokens_max": float(max(r.prompt_tokens for r in done)),
        "output_tokens_mean": out / len(done), "images_per_request": sum(r.images for r in done) / len(done),
        "episodes": float(len({r.episode for r in done})),
    }
    if tpot:
        fig.update(tpot_mean_s=sum(tpot) / len(tpot), tpot_p50_s=pb.percentile(tpot, 0.5),
                   tpot_p99_s=pb.percentile(tpot, 0.99))
    # The opening burst: the requests submitted before any finished (every agent's first), from the first submission
    # to the last of their first tokens; its rate is the computed prompt tokens' (a pure prefill with a screenshot
    # per prompt, the engine's prefill measured inside the run).
    first_done = min(r.finished for r in done)  # type: ignore[type-var]
    burst = [r for r in done if r.submitted < first_done]  # type: ignore[operator]
    burst_s = max(r.first for r in burst) - start  # type: ignore[type-var,operator]
    if burst_s > 0:
        fig.update(burst_requests=float(len(burst)), burst_s=burst_s,
                   burst_prompt_tok_s=sum(r.prompt_tokens - r.cached_tokens for r in burst) / burst_s)
    return fig


# ------------------------------------------------------------------------------------------------------ measure


def engine_flags(args: argparse.Namespace, engine: str) -> list[str]:
    """The seed's flags for ``engine``, with the run's: load format, dtype, speculative config (planted acceptance),
    and any ``--engine-flags`` (later flags override earlier ones)."""
    flags = [*SEED_FLAGS, "--dtype", args.dtype]
    if args.load_format != "auto":
        flags += ["--load-format", args.load_format]
    if engine == "hyserve" and args.device != "cuda":
        flags += ["--device", args.device]
    if args.k:
        spec = dict(SEED_SPEC, num_speculative_tokens=args.k)
        if args.acceptance is not None:  # both engines: vLLM's synthetic rejection sampling, same rates
            spec = pb.synthetic_mtp_config(args.k, args.acceptance)
        flags += ["--speculative-config", json.dumps(spec)]
    if args.gdn_prefill_backend and engine == "vllm":
        flags += ["--gdn-prefill-backend", args.gdn_prefill_backend]
    return [*flags, *(args.engine_flags.split() if args.engine_flags else [])]


def cache_layout(text: str | None) -> dict[str, int] | None:
    """``--cache-layout BLOCKS,SLOTS,SNAPSHOTS[,HOST]`` as hyserve's engine config fields (the counts a card's run
    logged, replayed on the CPU with the tiny shape: the prefix cache's policy under the card's budget; HOST: the
    host tier's entries, 0 by default), or None."""
    if not text:
        return None
    try:
        counts = [int(x) for x in text.split(",")]
        blocks, slots, snaps = counts[:3]
        host = counts[3] if len(counts) == 4 else 0
        if len(counts) not in (3, 4):
            raise ValueError
    except ValueError:
        raise SystemExit(f"--cache-layout takes BLOCKS,SLOTS,SNAPSHOTS[,HOST] (three or four integers), got {text!r}"
                         ) from None
    if min(blocks, slots, snaps) < 1 or host < 0:
        raise SystemExit(f"--cache-layout counts must be positive (HOST: >= 0), got {text!r}")
    return {"num_kv_blocks": blocks + 1, "num_state_slots": slots, "num_snapshot_slots": snaps,
            "num_host_snapshot_slots": host}


@contextlib.contextmanager
def engine_log() -> Iterator[None]:
    """hyserve's INFO lines (its memory plan, cache layout, host tier) on stderr, as `hyserve serve` prints them,
    while a run lasts: the logger's level and handlers are put back after."""
    log = logging.getLogger("hyserve")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def measure(args: argparse.Namespace) -> int:
    """Build the engine, warm it up, run the trace; write the result file (figures, records, flags, notes)."""
    with engine_log() if args.engine == "hyserve" else contextlib.nullcontext():
        return _measure(args)


def _measure(args: argparse.Namespace) -> int:
    import torch

    started = time.perf_counter()
    trace = SEED_TRACES[args.scale]
    concurrency = args.concurrency or trace.concurrency
    requests = args.requests or trace.requests
    flags = engine_flags(args, args.engine)
    planted = None
    if args.k and args.acceptance is not None:
        planted = 1 + sum(args.acceptance ** (i + 1) for i in range(args.k))
    res: dict[str, Any] = {
        "engine": args.engine, "model": args.model, "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() and args.device == "cuda" else args.device,
        "torch": torch.__version__, "hyserve_commit": pb.git_commit(), "engine_flags": flags,
        "trace": {**asdict(trace), "scale": args.scale, "concurrency": concurrency, "requests": requests,
                  "seed": args.seed},
        "acceptance": {"rate_per_draft_token": args.acceptance, "k": args.k, "planted_acceptance_length": planted,
                       "how": ("both engines: speculative_config rejection_sample_method synthetic at rates "
                               f"{pb.synthetic_mtp_config(args.k, args.acceptance)['synthetic_acceptance_rates']}")
                       if planted else "the MTP head's own drafts, accepted by the tokens"},
    }
    if args.engine == "vllm":
        res["vllm_mode"] = "in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0)" \
            if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" else "default (engine core in its own process)"
    t0 = time.perf_counter()
    if args.engine == "hyserve":
        window = None
        if args.profile_steps:
            a, b = (int(x) for x in args.profile_steps.split(","))
            if not 1 <= a < b:
                raise SystemExit(f"--profile-steps takes A,B with 1 <= A < B, got {args.profile_steps!r}")
            window = (a, b)
        profile_path = os.path.splitext(args.out)[0] + "_profile.json.gz" if args.out else "seed_profile.json.gz"
        eng: Any = HyserveAsync(args.model, flags, cache_layout(args.cache_layout), window, profile_path)
        res["cache_layout"] = {**eng.layout, "given": bool(args.cache_layout)}
    else:
        if args.cache_layout:
            raise SystemExit("--cache-layout is hyserve's (a replay of its card layout); vLLM sizes its own cache")
        eng = VllmAsync(args.model, flags)
    res["version"], res["start_s"] = eng.version, time.perf_counter() - t0
    try:
        prompts = SeedPrompts(args.model, trace, args.seed)
        warm = SeedPrompts(args.model, trace, args.seed + 1)  # another system prompt: no hit for the timed run


        async def session() -> list[RequestRecord]:
            # One event loop for both: vLLM's AsyncLLM binds its output handler to the loop of its first request.
            if args.warmup:
                t0 = time.perf_counter()
                await run_closed_loop(eng, warm, warm.episodes(), concurrency, args.warmup, tag="warm")
                res["warmup_s"] = time.perf_counter() - t0
            eng.after_warmup()
            deadline = None if args.time_limit is None else started + args.time_limit
            return await run_closed_loop(eng, prompts, prompts.episodes(), concurrency, requests, deadline=deadline)

        records = asyncio.run(session())
        res["cut_by_time_limit"] = len(records) < requests
        if not records:
            raise RuntimeError(f"no request was submitted before --time-limit {args.time_limit} s")
        check_records(records, concurrency)
        res["figures"] = {**figures(records), **eng.stats(), "prefix_hit_rate_ideal": ideal_hit_rate(prompts, records)}
        if planted:
            res["figures"]["spec_planted_acceptance_length"] = planted
        res["records"] = [{k: v for k, v in asdict(r).items() if k != "output"} for r in records]
        if isinstance(eng, HyserveAsync):  # each step: (seconds since the previous result, tokens, prompt tokens)
            res["steps"] = eng.clock.step_trace()
            # each step as its worker timed it on the device: (seconds, tokens, prompt tokens)
            res["device_steps"] = [(round(sec, 6), tok, prompt) for sec, tok, prompt in eng.clock.device_steps]
            if eng.clock.profile_report is not None:  # the device's gaps over the profiled steps (trace_gaps.py)
                res["profile"], res["profile_trace"] = eng.clock.profile_report, profile_path
        res["notes"] = {"prompt_layout": prompts.builder.layout, "image_tokens_per_screenshot": prompts.image_tokens,
                        "text_ids_below": prompts.vocab,
                        "prompt_tokens_as_expected": all(r.prompt_tokens == r.expected_prompt_tokens for r in records)}
    finally:
        eng.close()
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        pb.write_json(args.out, res)
    print(json.dumps({k: v for k, v in res.items() if k not in ("records", "steps")}, indent=2))
    return 0


# ------------------------------------------------------------------------------------------------------- report

# figure -> (higher is better, label, with a ratio)
REPORT_FIGURES: dict[str, tuple[bool, str, bool]] = {
    "requests_per_s": (True, "requests/s", True),
    "output_tok_s": (True, "output tokens/s", True),
    "ttft_p50_s": (False, "TTFT p50, s", True),
    "ttft_p99_s": (False, "TTFT p99, s", True),
    "ttft_mean_s": (False, "TTFT mean, s", True),
    "tpot_mean_s": (False, "time per output token, mean, s", True),
    "tpot_p50_s": (False, "time per output token, p50, s", True),
    "tpot_p99_s": (False, "time per output token, p99, s", True),
    "e2e_p50_s": (False, "request latency p50, s", True),
    "e2e_p99_s": (False, "request latency p99, s", True),
    "prefix_hit_rate": (True, "prefix-cache hit rate (cached / prompt tokens)", True),
    "burst_prompt_tok_s": (True, "opening burst (every agent's first request): computed prompt tokens/s", True),
    "burst_s": (False, "opening burst: first submission to its last first token, s", False),
    "prefix_hit_rate_ideal": (True, "hit rate if every snapshot were kept (16-token blocks)", False),
    "prefix_hit_rate_first_steps": (True, "hit rate, first steps", False),
    "prefix_hit_rate_later_steps": (True, "hit rate, later steps", False),
    "prefix_hit_rate_step_1": (True, "hit rate, second steps", False),
    "prefix_hit_rate_step_2": (True, "hit rate, third steps", False),
    "prefix_hit_rate_steps_3_on": (True, "hit rate, fourth steps on (oldest screenshot now text)", False),
    "spec_mean_acceptance_length": (True, "MTP mean acceptance length (reached)", False),
    "spec_planted_acceptance_length": (True, "MTP acceptance length asked (planted)", False),
    "prompt_tokens_mean": (True, "prompt tokens per request (trace check)", False),
    "output_tokens_mean": (True, "output tokens per request (trace check)", False),
    "images_per_request": (True, "images per request (trace check)", False),
    "requests": (True, "requests", False),
    "duration_s": (False, "run, s", False),
    "loop_step_s": (False, "hyserve's loop thread stepping, s", False),
    "loop_add_request_s": (False, "hyserve's loop thread adding requests, s", False),
    "prepare_images_s": (False, "hyserve's image processing off the loop thread, s (threads summed)", False),
    "prefix_cache_snapshot_offloads": (False, "hyserve's snapshots moved to the host tier", False),
    "prefix_cache_snapshot_host_hits": (True, "hyserve's snapshot hits from the host tier", False),
    "images_encoded": (False, "hyserve's screenshots through the vision tower (the warm-up's included)", False),
    "tower_calls": (False, "hyserve's vision tower calls (a step's new screenshots go together)", False),
    "images_from_host": (True, "hyserve's screenshots' encoder rows brought back from the host tier", False),
    "step_with_prompt_s": (False, "hyserve's steps with prompt tokens, s (result to result)", False),
    "step_decode_only_s": (False, "hyserve's steps without prompt tokens, s", False),
    "steps_decode_only": (False, "hyserve's steps without prompt tokens", False),
    "step_decode_only_ms_p50": (False, "hyserve's step without prompt tokens, p50, ms", False),
    "step_with_prompt_tokens_mean": (True, "hyserve's tokens per step with prompt tokens, mean", False),
    "step_fixed_ms": (False, "hyserve's step time, fit a + b x tokens: a, ms", False),
    "step_us_per_token": (False, "the same fit: b, us per token", False),
    "device_prompt_steps_s": (False, "hyserve's steps with prompt tokens, device time, s", False),
    "device_prompt_tok_s": (True, "the prompt tokens they computed per device second", False),
    "device_decode_steps_s": (False, "hyserve's steps without prompt tokens, device time, s", False),
    "device_decode_step_ms_p50": (False, "hyserve's step without prompt tokens, device time p50, ms", False),
    "device_prompt_step_fixed_ms": (False, "hyserve's step with prompt tokens, device time fit a + b x prompt "
                                           "tokens: a, ms", False),
    "device_prompt_us_per_token": (False, "the same fit: b, us per prompt token", False),
}


def ratio(ours: float | None, theirs: float | None, higher: bool) -> float | None:
    """hyserve better by: ours / theirs where higher is better, theirs / ours where lower is; None without both."""
    if ours is None or theirs is None or ours <= 0 or theirs <= 0:
        return None
    return ours / theirs if higher else theirs / ours


def report(files: list[str], out: str) -> list[dict[str, Any]]:
    """``seed.md``, ``seed.json`` and ``seed.png`` under ``out`` from hyserve's and vLLM's result files (a later file
    of an engine replaces an earlier one's)."""
    runs = {pb.read_json(p)["engine"]: (p, pb.read_json(p)) for p in files}

    def figs(engine: str) -> dict[str, Any]:  # the by-step hit rates from the records where the file predates them
        res = runs.get(engine, ("", {}))[1]
        recs = [(r["step"], r["prompt_tokens"], r["cached_tokens"]) for r in res.get("records", [])]
        return {**(hit_rates_by_step(recs) if recs else {}), **res.get("figures", {})}

    ours, theirs = figs("hyserve"), figs("vllm")
    entries = []
    for key, (higher, label, rated) in REPORT_FIGURES.items():
        a, b = ours.get(key), theirs.get(key)
        if a is None and b is None:
            continue
        entries.append({"measure": key, "label": label, "hyserve": a, "vllm": b,
                        "ratio": ratio(a, b, higher) if rated else None})
    meta = {e: {k: r.get(k) for k in ("version", "device", "date", "torch", "vllm_mode", "engine_flags", "command",
                                      "acceptance", "start_s", "warmup_s")} | {"file": p}
            for e, (p, r) in runs.items()}
    trace: dict[str, Any] = next((r["trace"] for _, r in runs.values() if "trace" in r), {})
    os.makedirs(out, exist_ok=True)
    pb.write_json(os.path.join(out, "seed.json"), {"meta": meta, "trace": trace, "entries": entries})

    def fmt(x: Any) -> str:
        return "-" if x is None else (f"{x:,.3f}" if abs(x) < 10 else f"{x:,.0f}")

    lines = ["# Issue 34: the seed's deployment, hyserve against vLLM", "",
             "Qwen3.5-27B shape, compressed-tensors FP8_DYNAMIC (dummy weights), 27B-class vision tower, MTP k = 2 "
             "with drafts accepted at a planted rate, the report's flags; the GUI-agent trace (seed_bench.py).", "",
             f"- text shape (shapes.py SHAPE_27B; no verbatim config.json of the release was found, sources there): "
             f"{json.dumps(SHAPE_27B)}",
             f"- vision tower (shapes.py VISION_27B, the Qwen3.6-27B release's vision_config): "
             f"{json.dumps(VISION_27B)}",
             f"- kept in bf16 (peer_bench.py SEED_FP8_IGNORE): {json.dumps(pb.SEED_FP8_IGNORE)}",
             *(f"- {e}: {m.get('version')} on {m.get('device')} ({m.get('date')}), "
               f"{m.get('vllm_mode') or 'AsyncEngine'}; flags `{' '.join(m.get('engine_flags') or [])}`"
               for e, m in meta.items()),
             f"- trace: {json.dumps(trace)}", "",
             "| measure | hyserve | vLLM | hyserve better by |", "| --- | ---: | ---: | ---: |"]
    for e in entries:
        r = "-" if e["ratio"] is None else f"{e['ratio']:.2f}x"
        lines.append(f"| {e['label']} | {fmt(e['hyserve'])} | {fmt(e['vllm'])} | {r} |")
    with open(os.path.join(out, "seed.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(entries, os.path.join(out, "seed.png"))
    return entries


def plot(entries: list[dict[str, Any]], path: str) -> bool:
    """A bar of hyserve's ratio over vLLM for each rated figure (> 1: hyserve better)."""
    rated = [e for e in entries if e["ratio"] is not None]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    if not rated:
        return False
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(rated) + 1.4))
    ax.barh([e["label"] for e in rated], [e["ratio"] for e in rated],
            color=["tab:green" if e["ratio"] >= 1 else "tab:red" for e in rated])
    ax.axvline(1.0, color="grey", ls="--", lw=0.8)
    ax.set_xlabel("hyserve better by (x)")
    ax.set_title("The seed's deployment: 27B FP8, screenshots, MTP 2, 32 agents", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="one engine on the trace (a process of its own)")
    m.add_argument("--engine", choices=["hyserve", "vllm"], required=True)
    m.add_argument("--model", required=True, help="peer_bench.py write --shape 27b --vision 27b --fp8 ct_dynamic")
    m.add_argument("--out", default=None)
    m.add_argument("--scale", choices=sorted(SEED_TRACES), default="seed")
    m.add_argument("--requests", type=int, default=None, help="requests in the timed run (the scale's: 256)")
    m.add_argument("--concurrency", type=int, default=None, help="agents in flight (the scale's: 32)")
    m.add_argument("--warmup", type=int, default=None, help="warm-up requests (first steps of other episodes; "
                                                             "default: the concurrency; 0: none)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--k", type=int, default=2, help="MTP draft tokens (the seed's 2; 0: no speculation)")
    m.add_argument("--acceptance", type=float, default=0.8,
                   help="planted acceptance per draft token (drawn); a negative value: the head's own drafts")
    m.add_argument("--load-format", choices=["auto", "dummy"], default="dummy")
    m.add_argument("--dtype", default="bfloat16")
    m.add_argument("--device", default="cuda", help="hyserve's (cpu for the tests)")
    m.add_argument("--gdn-prefill-backend", choices=["flashinfer", "triton"], default=None,
                   help="vLLM's GDN prefill kernel (default: its own choice, FlashInfer on Hopper)")
    m.add_argument("--cache-layout", default=None, metavar="BLOCKS,SLOTS,SNAPSHOTS[,HOST]",
                   help="hyserve: these cache counts instead of the memory's split (the card's layout, from its "
                        "run's cache_layout, replayed on the CPU: benchmarks/results/h100/seed_2026-12-06b)")
    m.add_argument("--engine-flags", default="", help="more engine flags, after the seed's (they override them)")
    m.add_argument("--profile-steps", default=None, metavar="A,B",
                   help="hyserve: a torch profiler trace (CPU and CUDA) of the loop thread from the A-th step result "
                        "of the timed run to the B-th (OUT's name + _profile.json.gz), its device gaps in the result")
    m.add_argument("--time-limit", type=float, default=None,
                   help="seconds from the process's start after which no request is submitted (those in flight "
                        "finish; the figures are over the requests run, cut_by_time_limit says so)")
    r = sub.add_parser("report", help="hyserve against vLLM: seed.md, seed.json, seed.png")
    r.add_argument("files", nargs="+")
    r.add_argument("--out", required=True)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "report":
        report(args.files, args.out)
        return 0
    if args.acceptance is not None and args.acceptance < 0:
        args.acceptance = None
    if args.warmup is None:
        args.warmup = args.concurrency or SEED_TRACES[args.scale].concurrency
    if args.acceptance is not None and not 0 <= args.acceptance <= 1:
        raise SystemExit("--acceptance must lie in [0, 1]")
    return measure(args)


if __name__ == "__main__":
    raise SystemExit(main())

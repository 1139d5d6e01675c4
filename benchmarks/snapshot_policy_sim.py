"""The prefix cache's snapshot policy on the seed's agents, without a model: seconds where a CPU replay takes minutes.

``seed_bench.py measure --cache-layout`` replays the card's cache layout with the tiny model on the CPU (about 12
minutes for 256 requests); its answers are folded into the text range before the next prompt (random weights emit
ids the chat template rewrites), so answer-end resumes, the ones the card's third steps miss, are understated. This
drives ``PrefixCache`` as the scheduler does (a lookup at admission, snapshots reserved when a chunk is scheduled and
committed when its step ends, a verify row's candidate snapshot from a free or spare entry, blocks published as
computed, the host tier's moves taken every step) over the seed trace's shape (``seed_bench.SEED_TRACES["seed"]``:
1,700 shared system tokens, a first message of 1,450-1,850, later ones of 250-550, 880 placeholder tokens a
screenshot with the two before the current one shown, 8 tokens for an older one, answers of 20-100 tokens that come
back verbatim in the next prompt, 3-10 steps an episode cut at 12,000 prompt tokens), 32 agents in a closed loop
after a warm-up of 32 first steps under another system prompt, MTP 2 with each draft accepted at 0.8. A step takes
every decoding row (three tokens each) and prompt chunks up to the token budget, first come first served. No clock:
an agent's next step waits for the step after its answer's last.

Figures: the hit rate (cached prompt tokens over prompt tokens) overall and per step of an episode, and each step's
cached tokens over its best (the previous step's prompt and answer, or for fourth steps on the point before the
screenshot that turned into text), with the same run at unbounded snapshots beside it; the host tier's moves.

    python benchmarks/snapshot_policy_sim.py [--requests 256] [--layout 26571,32,57,55] [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hyserve import SamplingParams
from hyserve.cache.block_pool import BlockPool
from hyserve.cache.prefix_cache import PrefixCache
from hyserve.cache.state_slots import StateSlots
from hyserve.multimodal.spans import ImageSpan
from hyserve.request import Request, RequestStatus

BS = 16
SHOT = 880  # placeholder tokens a 1280x720 screenshot on the 27B (patch 16, merge 2)
TEMPLATE = 5  # a chat template's tokens around each message


@dataclass
class Trace:
    prefix_len: int = 1700
    first_message_len: tuple[int, int] = (1450, 1850)
    message_len: tuple[int, int] = (250, 550)
    output_len: tuple[int, int] = (20, 100)
    steps: tuple[int, int] = (3, 10)
    prompt_max: int = 12000
    history: int = 2
    earlier_len: int = 8


class Episode:
    def __init__(self, trace: Trace, index: int, system: list[int], seed: int) -> None:
        rng = random.Random(f"sim/{seed}/{index}")
        self.trace, self.index, self.system = trace, index, system
        self.rng = rng
        n = rng.randint(*trace.steps)
        self.messages = [self.ids(rng.randint(*trace.first_message_len))]
        self.messages += [self.ids(rng.randint(*trace.message_len)) for _ in range(n - 1)]
        self.output_lens = [rng.randint(*trace.output_len) for _ in range(n)]
        self.earlier = [self.ids(trace.earlier_len) for _ in range(n)]
        self.answers: list[list[int]] = []
        self.num_steps = n
        while self.num_steps > 1 and len(self.prompt(self.num_steps - 1, planned=True)[0]) > trace.prompt_max:
            self.num_steps -= 1

    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(100_000) for _ in range(n)]

    def prompt(self, step: int, planned: bool = False) -> tuple[list[int], tuple[ImageSpan, ...]]:
        tokens, spans = list(self.system), []
        for j in range(step + 1):
            tokens += [1] * TEMPLATE + self.messages[j]
            if j >= step - self.trace.history:
                spans.append(ImageSpan(len(tokens), SHOT, f"{self.index}/{j}"))
                tokens += [7] * SHOT
            else:
                tokens += self.earlier[j]
            tokens += [2] * TEMPLATE  # the assistant's header: the generation prompt's end
            if j < step:
                answer = [0] * self.output_lens[j] if planned else self.answers[j]
                tokens += answer + [3] * 2  # the answer comes back verbatim, then the turn's end
        return tokens, tuple(spans)


@dataclass
class Live:
    req: Request
    ep: Episode
    step: int
    max_tokens: int
    answer: list[int]
    reserved: list[tuple[int, int]] = field(default_factory=list)  # (position, entry) committed at the step's end
    candidate: tuple[int, int] | None = None


def run(cache: PrefixCache, trace: Trace, requests: int, seed: int, concurrency: int = 32, budget: int = 16384,
        accept: float = 0.8, on_step: Callable[[PrefixCache], None] | None = None,
        episodes: dict[int, Episode] | None = None) -> list[dict[str, int]]:
    rng = random.Random(f"sim/{seed}/accept")
    system = [random.Random(f"sim/{seed}/system").randrange(100_000) for _ in range(trace.prefix_len)]
    warm_system = [random.Random(f"sim/{seed}/warm").randrange(100_000) for _ in range(trace.prefix_len)]
    next_episode = 0
    submitted = 0
    waiting: list[Live] = []
    running: list[Live] = []
    records: list[dict[str, int]] = []
    arrival = 0

    def submit(ep: Episode, step: int, timed: bool) -> None:
        nonlocal arrival, submitted
        tokens, spans = ep.prompt(step)
        req = Request(f"{ep.index}-{step}", None, tokens, SamplingParams(max_tokens=ep.output_lens[step]), arrival)
        req.image_spans = spans
        arrival += 1
        answer = [ep.rng.randrange(100_000) for _ in range(ep.output_lens[step])]
        waiting.append(Live(req, ep, step, ep.output_lens[step], answer))
        if timed:
            submitted += 1

    def new_episode(timed: bool) -> None:
        nonlocal next_episode
        ep = Episode(trace, next_episode if timed else 10_000 + next_episode, system if timed else warm_system, seed)
        next_episode += 1
        if episodes is not None:  # the caller's record of every episode made, by index
            episodes[ep.index] = ep
        submit(ep, 0, timed)

    for _ in range(concurrency):  # the warm-up: first steps under another system prompt
        new_episode(False)
    warm = True
    while waiting or running:
        # schedule: every decoding row, then prompt chunks up to the budget, first come first served
        tokens_left = budget
        rows: list[tuple[Live, int, int]] = []  # (live, start, end) of a prompt chunk
        for live in running:
            req = live.req
            if req.is_decoding:
                tokens_left -= 3
                start = req.num_computed_tokens
                reach = min(start + 3, req.num_tokens - 1 + 3)
                boundary = (reach // BS) * BS
                if boundary > start:
                    entry = cache.reserve_entry(spare_only=True)
                    if entry is not None:
                        live.candidate = (boundary, entry)
        for live in running + waiting:
            req = live.req
            if req.is_decoding or req.num_output_tokens or tokens_left <= 0:
                continue
            if live in waiting:
                if len(running) >= concurrency:
                    continue
                hit = cache.lookup(req)
                req.share_points = [hit.branch_point] if hit.branch_point is not None else []
                req.num_computed_tokens = hit.num_tokens
                req.num_cached_tokens = hit.num_tokens
                need = -(-(req.num_prompt_tokens + live.max_tokens) // BS) - len(hit.blocks)
                req.block_table = hit.blocks + cache.block_pool.allocate(need)
                cache.unpin(hit.snapshot_entry)
                cache.unpin_host(hit.host_snapshot)
                waiting.remove(live)
                running.append(live)
            start = req.num_computed_tokens
            end = min(req.num_prompt_tokens, start + tokens_left)
            tokens_left -= end - start
            for p in cache.snapshot_points(req, start, end):
                entry = cache.reserve_snapshot(req, p)
                if entry is not None:
                    live.reserved.append((p, entry))
            rows.append((live, start, end))
        # the step's results
        for live, _start, end in rows:
            req = live.req
            req.num_computed_tokens = end
            if end == req.num_prompt_tokens:
                req.output_token_ids.append(live.answer[0])
        for live in running:
            req = live.req
            if live.candidate is None and not req.is_decoding:
                continue
            if any(r[0] is live for r in rows):
                continue
            n = 1
            while n < 3 and rng.random() < accept:
                n += 1
            n = min(n, live.max_tokens - req.num_output_tokens)
            for _ in range(n):
                req.num_computed_tokens += 1
                req.output_token_ids.append(live.answer[req.num_output_tokens])
            if live.candidate is not None:
                point, entry = live.candidate
                live.candidate = None
                if point <= min(req.num_computed_tokens, cache.keyable_tokens(req)):
                    cache.commit_snapshot(req, point, entry)
                else:
                    cache.release_entry(entry)
        for live in list(running):
            req = live.req
            computed = min(req.num_computed_tokens, cache.keyable_tokens(req))
            cache.publish_blocks(req, computed)
            for p, entry in live.reserved:
                if p <= computed:
                    cache.commit_snapshot(req, p, entry)
                else:
                    cache.release_entry(entry)
            live.reserved = []
            if req.num_output_tokens >= live.max_tokens:
                running.remove(live)
                req.status = RequestStatus.FINISHED
                cache.block_pool.free(req.block_table)
                ep = live.ep
                ep.answers.append(list(req.output_token_ids))
                if ep.index < 10_000:
                    records.append({"episode": ep.index, "step": live.step, "prompt": req.num_prompt_tokens,
                                    "cached": req.num_cached_tokens})
                if warm:
                    continue
                if live.step + 1 < ep.num_steps and submitted < requests:
                    submit(ep, live.step + 1, True)
                elif submitted < requests:
                    new_episode(True)
        cache.take_offloads()
        if on_step is not None:
            on_step(cache)
        if warm and not running and not waiting:
            warm = False
            for _ in range(concurrency):
                new_episode(True)
    return records


def best_depth(trace: Trace, rec: dict[str, int], eps: dict[int, Episode]) -> int:
    """The deepest prefix a step can resume from: the previous step's prompt and answer (second and third steps), or
    the point before the screenshot that turned into text (fourth on), block-aligned; the system prompt for a first
    step."""
    ep, step = eps[rec["episode"]], rec["step"]
    if step == 0:
        return (trace.prefix_len // BS) * BS
    prev, _ = ep.prompt(step - 1)
    cur, _ = ep.prompt(step)
    common = next((i for i, (a, b) in enumerate(zip(prev + ep.answers[step - 1], cur, strict=False)) if a != b),
                  min(len(prev) + len(ep.answers[step - 1]), len(cur)))
    return (min(common, len(cur) - 1) // BS) * BS


def figures(records: list[dict[str, int]], best: list[int]) -> dict[str, float]:
    out: dict[str, float] = {}
    prompt = sum(r["prompt"] for r in records)
    out["hit_rate"] = sum(r["cached"] for r in records) / prompt
    for name, lo, hi in (("first", 0, 0), ("second", 1, 1), ("third", 2, 2), ("fourth_on", 3, 99)):
        sel = [(r, b) for r, b in zip(records, best, strict=True) if lo <= r["step"] <= hi]
        if sel:
            out[f"{name}_of_best"] = statistics.mean(min(r["cached"] / b, 1.0) if b else 1.0 for r, b in sel)
    return out


def simulate(layout: tuple[int, int, int, int], requests: int, seed: int,
             cache_factory: Callable[..., PrefixCache] = PrefixCache) -> dict[str, float]:
    blocks, slots, snaps, host = layout
    trace = Trace()
    cache = cache_factory(BlockPool(blocks + 1, BS), StateSlots(slots, snaps), BS, 2048, lookahead=1,
                          num_host_snapshots=host)
    eps: dict[int, Episode] = {}
    records = run(cache, trace, requests, seed, episodes=eps)
    best = [best_depth(trace, r, eps) for r in records]
    out = figures(records, best)
    out["ideal_hit_rate"] = sum(best) / sum(r["prompt"] for r in records)
    out["offloads"] = cache.stats.offloads
    out["host_hits"] = cache.stats.host_hits
    out["evictions"] = cache.stats.evictions
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--layout", default="26571,32,57,55", help="KV blocks, slots, snapshot entries, host entries")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    layout = tuple(int(x) for x in args.layout.split(","))
    if len(layout) != 4:
        raise SystemExit("--layout takes four integers")
    rows = {s: simulate(layout, args.requests, s) for s in args.seeds}  # type: ignore[arg-type]
    for s, r in rows.items():
        print(s, json.dumps({k: round(v, 3) for k, v in r.items()}))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

"""A request's answer end is resumed from, if at all, right after the request ends; today's budget evicts it first
wherever its kind is resumed from less than half as often as the points before first images.

The seed benchmark's GUI agents (benchmarks/seed_bench.py) resume at the answer end of their first and second steps,
then before their first image (the oldest screenshot turned into text). On the card's layout (57 device entries, 32
agents) the third step of an episode missed its second step's answer end about half the time, the snapshot evicted
a few ms after it was taken: the answer kind was resumed from less than half as often as the first-image kind (and
counted once per boundary a decoding answer crossed), so its least recently used snapshot, the one just taken, went
first. These tests replay that on the cache's public API (reserve, commit, lookup), without a model: the mechanism as
it is today, and the behaviour wanted (strict xfail: protecting the fresh answer end, tried, moved the loss to the
points before first images on the seed's CPU replay, so no policy change is in; see the xfail's reason).
"""

from __future__ import annotations

import random

import pytest

from hyserve import SamplingParams
from hyserve.cache import prefix_cache
from hyserve.cache.block_pool import BlockPool
from hyserve.cache.state_slots import StateSlots
from hyserve.request import ImageSpan, Request

BS = 16


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


class Agent:
    """A GUI agent's episode in miniature: a system prompt shared by every agent (32 tokens), then per step a
    message (16 tokens) and a screenshot (16 placeholder tokens; the two before the current one stay images, an
    older one turns into 8 tokens of text), and the step's answer (40 tokens: two block boundaries)."""

    SYSTEM = ids(32, 0)

    def __init__(self, name: str, seed: int) -> None:
        self.name, self.seed = name, seed
        self.answers: list[list[int]] = []

    def prompt(self, step: int) -> tuple[list[int], tuple[ImageSpan, ...]]:
        tokens, spans = list(self.SYSTEM), []
        for j in range(step + 1):
            tokens += ids(16, self.seed * 1000 + j)
            if j >= step - 2:
                spans.append(ImageSpan(len(tokens), 16, f"{self.name}/{j}"))
                tokens += [7] * 16
            else:
                tokens += ids(8, self.seed * 1000 + 100 + j)
            if j < step:
                tokens += self.answers[j]
        return tokens, tuple(spans)


class Run:
    """The prefix cache driven as the scheduler drives it: a lookup at admission (its blocks and snapshot taken),
    a snapshot at each policy point of the prompt, then at each block boundary of the answer while decoding."""

    def __init__(self, entries: int) -> None:
        self.cache = prefix_cache.PrefixCache(BlockPool(1024, BS), StateSlots(2, entries), BS, snapshot_interval=1024)
        self.hits: dict[tuple[str, int], int] = {}

    def admit(self, agent: Agent, step: int) -> Request:
        tokens, spans = agent.prompt(step)
        req = Request(f"{agent.name}-{step}", None, tokens, SamplingParams(), 0)
        req.image_spans = spans
        hit = self.cache.lookup(req)
        self.hits[(agent.name, step)] = hit.num_tokens
        self.cache.unpin(hit.snapshot_entry)
        self.cache.unpin_host(hit.host_snapshot)
        req.block_table = hit.blocks + self.cache.block_pool.allocate(64 - len(hit.blocks))
        req.num_computed_tokens = hit.num_tokens
        return req

    def prefill(self, req: Request) -> None:
        for p in self.cache.snapshot_points(req, req.num_computed_tokens, req.num_tokens):
            entry = self.cache.reserve_snapshot(req, p)
            if entry is not None:
                self.cache.commit_snapshot(req, p, entry)
        req.num_computed_tokens = req.num_tokens
        self.cache.publish_blocks(req, req.num_computed_tokens)

    def decode(self, req: Request, agent: Agent, tokens: int) -> None:
        """``tokens`` more answer tokens, each computed by the step after the one that sampled it, a snapshot at
        each block boundary the computed ones reach (the latest one kept)."""
        answer = ids(40, agent.seed * 1000 + 200 + len(agent.answers))
        for _ in range(tokens):
            if req.num_output_tokens:
                req.num_computed_tokens += 1  # the token sampled last, computed now
            req.output_token_ids.append(answer[req.num_output_tokens])
            if req.num_computed_tokens % BS == 0 and req.num_computed_tokens > req.num_prompt_tokens:
                entry = self.cache.reserve_snapshot(req, req.num_computed_tokens)
                if entry is not None:
                    self.cache.commit_snapshot(req, req.num_computed_tokens, entry)
        self.cache.publish_blocks(req, req.num_computed_tokens)

    def finish(self, req: Request, agent: Agent) -> None:
        agent.answers.append(list(req.output_token_ids))
        self.cache.block_pool.free(req.block_table)

    def step(self, agent: Agent, step: int) -> None:
        req = self.admit(agent, step)
        self.prefill(req)
        self.decode(req, agent, 40)
        self.finish(req, agent)

    def answer_end(self, agent: Agent, step: int) -> int:
        """Where the agent's step ``step + 1`` resumes at best: the latest boundary of step ``step``'s answer."""
        tokens, _ = agent.prompt(step)
        return (len(tokens) + 40 - 1) // BS * BS


def teach(run: Run, agents: int = 4, steps: int = 8) -> list[Agent]:
    """Earlier episodes (the cache learns what each kind of point is worth): the second and third steps resume at
    the answer's end, the later ones before the first image (the point moves on with the window of screenshots)."""
    taught = [Agent(f"x{i}", 100 + i) for i in range(agents)]
    for agent in taught:
        for step in range(steps):
            run.step(agent, step)
    return taught


def third_step_after_a_busy_second(run: Run, busy: int = 4, after: int = 3) -> tuple[int, int]:
    """Agent a's second step decodes while ``busy`` other agents' steps run; it ends, and before its third step is
    admitted (a few ms later on the card) ``after`` more agents' steps are admitted and computed: the third step's
    hit and where a full hit would be."""
    a = Agent("a", 1)
    run.step(a, 0)
    req = run.admit(a, 1)
    run.prefill(req)
    run.decode(req, a, 20)
    for i in range(busy):
        run.step(Agent(f"b{i}", 20 + i), 0)
    run.decode(req, a, 20)
    run.finish(req, a)
    others = [Agent(f"o{i}", 10 + i) for i in range(after)]
    for o in others:
        run.prefill(run.admit(o, 0))
    run.admit(a, 2)
    return run.hits[("a", 2)], run.answer_end(a, 1)


def test_today_the_fresh_answer_end_goes_first_and_the_third_step_resumes_before_its_first_image() -> None:
    """The mechanism of the card's third-step misses: the earlier episodes' second and third steps resumed at the
    answer's end, the later ones before the first image, so the answer kind ranks below the first-image kind; agent
    a's second step's answer end, taken a few snapshots before its third step comes, is the answer kind's least
    recently used (the older answer ends went first) and is evicted; the third step resumes before its first image
    (48) or nowhere."""
    run = Run(entries=12)
    taught = teach(run)
    for x in taught:  # with room, the second and third steps resume at the answer's end
        assert [run.hits[(x.name, step)] for step in (1, 2)] == [run.answer_end(x, 0), run.answer_end(x, 1)]
    utility = run.cache.kind_utilities()
    assert utility["answer"] < 0.5 * utility["first_image"]
    evictions = run.cache.stats.evictions
    hit, full = third_step_after_a_busy_second(run)
    assert run.cache.stats.evictions > evictions
    assert hit <= 48 < full


@pytest.mark.xfail(strict=True, reason="today's budget evicts the fresh answer end first (its kind ranks below the "
                                       "first-image kind); the fix tried (keep a resume point while younger than its "
                                       "kind's learned resume delay) lowered the seed's CPU replay's hit rate "
                                       "(0.487 to 0.438 over its first 128 requests): the points before first images "
                                       "took the loss")
def test_the_third_step_resumes_at_the_second_steps_fresh_answer_end() -> None:
    """The behaviour wanted: agent a's third step finds its second step's answer end, taken a few snapshots before,
    though the answer kind is resumed from less than half as often as the first-image kind."""
    run = Run(entries=12)
    teach(run)
    hit, full = third_step_after_a_busy_second(run)
    assert hit == full

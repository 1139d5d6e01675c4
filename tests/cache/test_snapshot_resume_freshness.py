"""A request's answer end is resumed from, if at all, right after the request ends: the budget must not evict it
first just because most answer ends are never resumed from.

The seed benchmark's GUI agents (benchmarks/seed_bench.py) resume at the answer end of their first and second steps,
then before their first image (the oldest screenshot turned into text). On the card's layout (57 device entries, 32
agents) the third step of an episode missed its second step's answer end about half the time under the earlier
policy: the snapshot was evicted a few ms after it was taken, because the answer kind was resumed from less than
half as often as the first-image kind (and counted once per boundary a decoding answer crossed), so its least
recently used snapshot, the one just taken, went first. The cache now weighs each resume point by the chance it is
resumed from later given how long it has been unused (``KindModel.still``: an old answer end is dead, a fresh one
is not), and learns a decoding answer's moving boundary only once its request has ended. These tests replay the
agents' episodes in miniature on the cache's public API (reserve, commit, lookup), without a model.
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


def test_the_third_step_resumes_at_the_second_steps_fresh_answer_end() -> None:
    """Agent a's third step finds its second step's answer end, taken a few snapshots before, though the earlier
    episodes' answer ends beyond their third steps were never resumed from (the budget evicted the older ones)."""
    run = Run(entries=12)
    taught = teach(run)
    for x in taught:  # with room, the second and third steps resume at the answer's end
        assert [run.hits[(x.name, step)] for step in (1, 2)] == [run.answer_end(x, 0), run.answer_end(x, 1)]
    evictions = run.cache.stats.evictions
    hit, full = third_step_after_a_busy_second(run)
    assert run.cache.stats.evictions > evictions  # the budget was full: something else went
    assert hit == full


@pytest.mark.parametrize("sabotage", ["age_blind", "moving_boundary_dropped"])
def test_sabotaged_policies_evict_the_fresh_answer_end(monkeypatch: pytest.MonkeyPatch, sabotage: str) -> None:
    """Each of the two rules the third step needs, taken away, loses it: a point weighed by its kind alone (a fresh
    answer end ranks with the dead ones, below the points before first images), or a decoding answer's boundary
    counted as dropped when the budget takes it before the answer moves on (the answer kind learns it is never
    resumed from)."""
    if sabotage == "age_blind":
        monkeypatch.setattr(prefix_cache.KindModel, "still", lambda self, age: self.chance())
    else:
        monkeypatch.setattr(prefix_cache.PrefixCache, "_still_moving", lambda self, h: False)
    run = Run(entries=12)
    teach(run)
    hit, full = third_step_after_a_busy_second(run)
    assert hit < full

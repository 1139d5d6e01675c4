"""Deterministic multi-turn agent conversations for ``hyserve soak`` (adapted from ``benchmarks/workloads.py``).

The shape follows the reports in which prefix caching + speculative decoding corrupted outputs on hybrid models
(multi-step agent traces at temperature 0):

- every conversation starts with the same system prefix (tool definitions, instructions), so requests of different
  conversations share a long prefix;
- turn ``t``'s prompt is turn ``t-1``'s prompt + the tokens the engine actually generated for turn ``t-1`` + a new
  user/tool message, so every turn extends the previous turn's full sequence and the prefix-cache hit rate climbs
  through a run; a driver must therefore be closed-loop (the next turn is built from the real output);
- every ``fork_every``-th conversation repeats the previous conversation's first message (an agent retrying from
  the same state): its first prompt is identical to another one and the two diverge only later, which places
  snapshots at branch points and makes full-prompt hits.

Everything here is a pure function of the spec, the seed and ``vocab_size`` (no torch, no engine).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Conversation", "WorkloadSpec", "make_conversations"]


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """Sizes of a soak workload.

    Messages are drawn uniformly in ``[message_len // 2, message_len + message_len // 2]`` tokens; the first message
    is twice as long (an agent's first observation). Turn ``t``'s prompt is therefore about ``prefix_len +
    (t + 2) * message_len + t * max_tokens`` tokens long; :meth:`max_total_len` bounds every sequence.
    """

    num_conversations: int = 8
    turns: int = 4
    prefix_len: int = 100
    message_len: int = 24
    max_tokens: int = 16
    fork_every: int = 3

    def __post_init__(self) -> None:
        for name in ("num_conversations", "turns", "prefix_len", "message_len", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1 (got {getattr(self, name)})")
        if self.fork_every < 0:
            raise ValueError(f"fork_every must be >= 0 (0 = never; got {self.fork_every})")

    def message_range(self, first: bool) -> tuple[int, int]:
        m = 2 * self.message_len if first else self.message_len
        return max(1, m // 2), m + m // 2

    def max_total_len(self) -> int:
        """An upper bound on prompt + output of any request of the workload."""
        first_hi = self.message_range(True)[1]
        later_hi = self.message_range(False)[1]
        return self.prefix_len + first_hi + (self.turns - 1) * later_hi + self.turns * self.max_tokens


@dataclass(frozen=True, slots=True)
class Conversation:
    """One agent conversation: ``messages[t]`` is appended before turn ``t`` runs (after the shared prefix for
    ``t == 0``, after turn ``t-1``'s prompt and actual output otherwise)."""

    conv_id: int
    system_prefix: tuple[int, ...]
    messages: tuple[tuple[int, ...], ...]

    @property
    def num_turns(self) -> int:
        return len(self.messages)

    def first_prompt(self) -> list[int]:
        return [*self.system_prefix, *self.messages[0]]

    def next_prompt(self, turn: int, prev_prompt: Sequence[int], prev_output: Sequence[int]) -> list[int]:
        """Turn ``turn``'s prompt (``turn >= 1``) from turn ``turn - 1``'s prompt and its actual output tokens."""
        if not 1 <= turn < self.num_turns:
            raise IndexError(f"turn {turn} has no previous turn in a {self.num_turns}-turn conversation")
        return [*prev_prompt, *prev_output, *self.messages[turn]]


def _tokens(rng: random.Random, n: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(rng.randrange(vocab_size) for _ in range(n))


def make_conversations(spec: WorkloadSpec, seed: int = 0, vocab_size: int = 448) -> list[Conversation]:
    """The workload's conversations, a pure function of ``(spec, seed, vocab_size)``.

    Token ids are drawn uniformly from ``[0, vocab_size)``: pass the tokenizer's ordinary vocabulary (the default
    448 is the tiny test tokenizer's, whose special tokens come after it) so that prompts hold no EOS or chat
    markers. Each conversation has its own random stream: conversation ``i`` does not change with
    ``num_conversations``.
    """
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be at least 2 (got {vocab_size})")
    prefix = _tokens(random.Random(f"hyserve-soak/{seed}/prefix"), spec.prefix_len, vocab_size)
    convs: list[Conversation] = []
    for cid in range(spec.num_conversations):
        rng = random.Random(f"hyserve-soak/{seed}/conversation/{cid}")
        messages = [_tokens(rng, rng.randint(*spec.message_range(True)), vocab_size)]
        messages += [_tokens(rng, rng.randint(*spec.message_range(False)), vocab_size)
                     for _ in range(spec.turns - 1)]
        if spec.fork_every and cid % spec.fork_every == spec.fork_every - 1 and convs:
            messages[0] = convs[-1].messages[0]
        convs.append(Conversation(cid, prefix, tuple(messages)))
    return convs

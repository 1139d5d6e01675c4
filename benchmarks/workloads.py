"""Deterministic multi-turn agent workloads for the prefix-caching benchmark.

The shape follows a production report of agent traffic on a hybrid model:

- many agent conversations, all starting with the same system prefix (~1.7k tokens at full scale: tool definitions
  and instructions);
- each conversation has several turns; turn ``t``'s prompt is turn ``t-1``'s prompt, plus the tokens the engine
  actually generated for turn ``t-1``, plus a new user/tool message. Prompts therefore grow turn by turn (4k-12k
  tokens at full scale) and every turn after the first extends the previous turn's full sequence;
- short outputs (20-100 tokens per turn: tool calls), so prefill dominates and prefix caching is what matters;
- 32 conversations in flight. The next turn of a conversation is submitted when its previous turn finishes, with
  the previous turn's real output tokens, so a driver must be closed-loop.

Everything here is a pure function of ``(scale, seed, vocab_size)``: message contents, output lengths (drivers run
with ``ignore_eos`` and ``max_tokens`` = the output length, so every turn produces exactly that many tokens) and so
every prompt *length* are fixed in advance; only the output *contents* come from the engine. :meth:`Conversation.
prompt_len` gives turn ``t``'s prompt length without running anything, and the generator keeps every prompt within
the spec's ``max_prompt_len``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "SCALES",
    "Conversation",
    "WorkloadSpec",
    "make_conversations",
    "workload_spec",
]


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """Sizes of a workload. Ranges are inclusive ``(low, high)`` and drawn uniformly.

    ``first_message_len`` is the first user message, appended right after the shared system prefix (so turn 0's
    prompt is ``system_prefix_len + first_message_len`` tokens). Each later turn appends the previous output and a
    ``message_len`` message; turns stop early when the next prompt would exceed ``max_prompt_len``.
    """

    name: str
    system_prefix_len: int
    num_conversations: int
    concurrency: int
    turns: tuple[int, int]
    first_message_len: tuple[int, int]
    message_len: tuple[int, int]
    output_len: tuple[int, int]
    max_prompt_len: int

    def __post_init__(self) -> None:
        for name in ("turns", "first_message_len", "message_len", "output_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be a range 1 <= low <= high (got {(lo, hi)})")
        if self.system_prefix_len < 1 or self.num_conversations < 1 or self.concurrency < 1:
            raise ValueError("system_prefix_len, num_conversations and concurrency must be positive")
        first_max = self.system_prefix_len + self.first_message_len[1]
        if first_max > self.max_prompt_len:
            raise ValueError(f"the longest first prompt ({first_max}) exceeds max_prompt_len ({self.max_prompt_len})")


# Full scale: the production shape (run on a GPU with a 2B-shape checkpoint). Turn 0 is 4.0k-4.7k tokens; each
# later turn adds 20-100 output tokens and a 300-1500 token tool/user message, up to 12k.
FULL = WorkloadSpec(
    name="full", system_prefix_len=1700, num_conversations=64, concurrency=32, turns=(4, 10),
    first_message_len=(2300, 3000), message_len=(300, 1500), output_len=(20, 100), max_prompt_len=12288,
)
# CPU scale: the same structure shrunk ~16x so that a tiny model runs it in about a minute on two cores. The
# prefix (110 tokens) is deliberately not a multiple of the 16-token block: sharing it needs a snapshot at 96.
CPU = WorkloadSpec(
    name="cpu", system_prefix_len=110, num_conversations=12, concurrency=8, turns=(3, 6),
    first_message_len=(140, 220), message_len=(40, 160), output_len=(4, 12), max_prompt_len=750,
)
SCALES: dict[str, WorkloadSpec] = {"full": FULL, "cpu": CPU}


def workload_spec(scale: str | WorkloadSpec) -> WorkloadSpec:
    """The spec of a named scale (``"full"`` or ``"cpu"``); a spec passes through unchanged."""
    if isinstance(scale, WorkloadSpec):
        return scale
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; choose one of {sorted(SCALES)}")
    return SCALES[scale]


@dataclass(frozen=True, slots=True)
class Conversation:
    """One agent conversation.

    ``messages[t]`` is appended before turn ``t`` runs (``messages[0]`` is the first user message, after the shared
    ``system_prefix``); ``output_lens[t]`` is the number of tokens turn ``t`` generates. Turn ``t``'s prompt is
    ``system_prefix + messages[0] + out[0] + messages[1] + ... + out[t-1] + messages[t]`` where ``out`` are the
    tokens the engine actually produced.
    """

    conv_id: int
    system_prefix: tuple[int, ...]
    messages: tuple[tuple[int, ...], ...]
    output_lens: tuple[int, ...]

    @property
    def num_turns(self) -> int:
        return len(self.messages)

    def prompt_len(self, turn: int) -> int:
        """Turn ``turn``'s prompt length (known in advance: outputs have exactly ``output_lens`` tokens)."""
        if not 0 <= turn < self.num_turns:
            raise IndexError(f"turn {turn} out of range (conversation has {self.num_turns})")
        return (len(self.system_prefix) + sum(len(m) for m in self.messages[: turn + 1])
                + sum(self.output_lens[:turn]))

    def first_prompt(self) -> list[int]:
        """Turn 0's prompt: the shared system prefix and the first user message."""
        return [*self.system_prefix, *self.messages[0]]

    def next_prompt(self, turn: int, prev_prompt: Sequence[int], prev_output: Sequence[int]) -> list[int]:
        """Turn ``turn``'s prompt (``turn >= 1``) from turn ``turn - 1``'s prompt and its actual output tokens."""
        if not 1 <= turn < self.num_turns:
            raise IndexError(f"turn {turn} has no previous turn in a {self.num_turns}-turn conversation")
        return [*prev_prompt, *prev_output, *self.messages[turn]]

    def prompt(self, turn: int, outputs: Sequence[Sequence[int]]) -> list[int]:
        """Turn ``turn``'s prompt given the actual outputs of turns ``0 .. turn-1`` (``outputs[:turn]``)."""
        if len(outputs) < turn:
            raise ValueError(f"turn {turn} needs the outputs of {turn} earlier turns (got {len(outputs)})")
        ids = self.first_prompt()
        for t in range(1, turn + 1):
            ids = self.next_prompt(t, ids, outputs[t - 1])
        return ids


def _tokens(rng: random.Random, n: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(rng.choices(range(vocab_size), k=n))


def make_conversations(scale: str | WorkloadSpec, seed: int = 0, vocab_size: int = 448) -> list[Conversation]:
    """The workload's conversations, a pure function of ``(scale, seed, vocab_size)``.

    Token ids are drawn uniformly from ``[0, vocab_size)`` (pass the model's vocabulary size, or less to keep to
    ordinary ids: the default 448 is the tiny test tokenizer's vocabulary without its special tokens). Each
    conversation has its own random stream, so conversation ``i`` does not change when ``num_conversations`` does.
    """
    spec = workload_spec(scale)
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be at least 2 (got {vocab_size})")
    system_prefix = _tokens(random.Random(f"hyserve-workload/{seed}/system"), spec.system_prefix_len, vocab_size)
    convs: list[Conversation] = []
    for cid in range(spec.num_conversations):
        rng = random.Random(f"hyserve-workload/{seed}/conversation/{cid}")
        n_turns = rng.randint(*spec.turns)
        messages = [_tokens(rng, rng.randint(*spec.first_message_len), vocab_size)]
        output_lens: list[int] = []
        length = spec.system_prefix_len + len(messages[0])
        while True:
            out_len = rng.randint(*spec.output_len)
            output_lens.append(out_len)
            if len(messages) == n_turns:
                break
            msg_len = rng.randint(*spec.message_len)
            if length + out_len + msg_len > spec.max_prompt_len:
                msg_len = spec.max_prompt_len - length - out_len
                if msg_len < spec.message_len[0]:  # no room for another turn: this one is the last
                    break
            messages.append(_tokens(rng, msg_len, vocab_size))
            length += out_len + msg_len
        convs.append(Conversation(cid, system_prefix, tuple(messages), tuple(output_lens)))
    return convs

"""Deterministic multi-turn agent conversations: the workloads of ``hyserve soak`` and of the prefix-caching
benchmark (``benchmarks/prefix_cache_bench.py``).

Both follow agent traffic on hybrid models, the shape of the reports in which prefix caching + speculative decoding
corrupted outputs (multi-step agent traces at temperature 0):

- every conversation starts with the same system prefix (tool definitions, instructions), so requests of different
  conversations share a long prefix;
- turn ``t``'s prompt is turn ``t-1``'s prompt + the tokens the engine actually generated for turn ``t-1`` + a new
  user/tool message, so every turn extends the previous turn's full sequence and the prefix-cache hit rate climbs
  through a run; a driver must therefore be closed-loop (the next turn is built from the real output).

Two specs, one ``Conversation`` and one ``make_conversations``:

- ``WorkloadSpec`` (``hyserve soak``): a fixed number of turns of about ``message_len`` tokens each; every
  ``fork_every``-th conversation repeats the previous conversation's first message (an agent retrying from the same
  state): its first prompt is identical to another one and the two diverge only later, which places snapshots at
  branch points and makes full-prompt hits. With ``abort_fraction`` > 0, :func:`make_abort_plan` picks that share
  of its requests for the client to abandon mid-flight, each at an ``AbortPoint``.
- ``AgentTraceSpec`` (the benchmark), at named scales (``SCALES``: ``"full"``, the production shape, ~1.7k-token
  prefix, prompts growing from 4k to 12k tokens, 32 conversations in flight; ``"cpu"``, the same shrunk ~16x): short
  outputs (tool calls) of lengths fixed in advance (drivers run with ``ignore_eos`` and ``max_tokens`` = the output
  length), so prefill dominates, every prompt *length* is known before running (:meth:`Conversation.prompt_len`),
  and the generator keeps every prompt within the spec's ``max_prompt_len``.

Everything here is a pure function of the spec, the seed and ``vocab_size`` (no torch, no engine).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "ABORT_PHASES", "CPU", "FULL", "SCALES", "AbortPoint", "AgentTraceSpec", "Conversation", "WorkloadSpec",
    "make_abort_plan", "make_conversations", "workload_spec",
]


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """Sizes of a soak workload.

    Messages are drawn uniformly in ``[message_len // 2, message_len + message_len // 2]`` tokens; the first message
    is twice as long (an agent's first observation). Turn ``t``'s prompt is therefore about ``prefix_len +
    (t + 2) * message_len + t * max_tokens`` tokens long; :meth:`max_total_len` bounds every sequence.
    ``abort_fraction`` of the requests are abandoned by their client mid-flight (:func:`make_abort_plan`).
    """

    num_conversations: int = 8
    turns: int = 4
    prefix_len: int = 100
    message_len: int = 24
    max_tokens: int = 16
    fork_every: int = 3
    abort_fraction: float = 0.0

    def __post_init__(self) -> None:
        for name in ("num_conversations", "turns", "prefix_len", "message_len", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1 (got {getattr(self, name)})")
        if self.fork_every < 0:
            raise ValueError(f"fork_every must be >= 0 (0 = never; got {self.fork_every})")
        if not 0.0 <= self.abort_fraction <= 1.0:
            raise ValueError(f"abort_fraction must be in [0, 1] (got {self.abort_fraction})")

    def message_range(self, first: bool) -> tuple[int, int]:
        m = 2 * self.message_len if first else self.message_len
        return max(1, m // 2), m + m // 2

    def max_total_len(self) -> int:
        """An upper bound on prompt + output of any request of the workload."""
        first_hi = self.message_range(True)[1]
        later_hi = self.message_range(False)[1]
        return self.prefix_len + first_hi + (self.turns - 1) * later_hi + self.turns * self.max_tokens


ABORT_PHASES = ("queued", "prefill", "decode")


@dataclass(frozen=True, slots=True)
class AbortPoint:
    """Where a soak client abandons one request (``phase``, one of ``ABORT_PHASES``):

    - ``"queued"``: before the engine has scheduled any of it (offline: aborted right after it is added, before the
      next step; a server: a non-streamed request whose client hangs up ``delay_s`` seconds after sending it, before
      the response);
    - ``"prefill"``: after its prefill started (offline: ``lag_steps`` engine steps after ``prompt_fraction`` of the
      prompt is scheduled, computed or still in flight; a server: a stream closed ``delay_s`` seconds after its
      response headers, before any chunk is read);
    - ``"decode"``: once the client holds ``num_tokens`` output tokens (offline: ``lag_steps`` engine steps after the
      step output that brought them, as a client reacts after a while, by which time the request's next step is
      scheduled; a server: right after the chunks carrying them).

    A request that finishes before its point is reached is not aborted (the client got its answer).
    """

    phase: str
    prompt_fraction: float = 0.0
    num_tokens: int = 0
    delay_s: float = 0.0
    lag_steps: int = 0

    def __post_init__(self) -> None:
        if self.phase not in ABORT_PHASES:
            raise ValueError(f"phase must be one of {ABORT_PHASES} (got {self.phase!r})")


def make_abort_plan(spec: WorkloadSpec, seed: int = 0) -> dict[tuple[int, int], AbortPoint]:
    """The requests to abandon, ``(conversation id, turn) -> AbortPoint``: ``round(abort_fraction * requests)`` of
    them, drawn without replacement (seeded, a pure function of the spec and the seed), each at a phase drawn
    uniformly from ``ABORT_PHASES`` (``"decode"`` only when ``max_tokens >= 2``, so that a token is left to abort
    before), then a point within the phase: a prompt fraction in [0.05, 0.95], an output count in
    [1, max_tokens - 1], a delay in [0, 0.5] s, a lag of 0 to 2 steps."""
    keys = [(c, t) for c in range(spec.num_conversations) for t in range(spec.turns)]
    n = round(spec.abort_fraction * len(keys))
    if not n:
        return {}
    rng = random.Random(f"hyserve-soak/{seed}/aborts")
    phases = ABORT_PHASES if spec.max_tokens >= 2 else ABORT_PHASES[:2]
    plan: dict[tuple[int, int], AbortPoint] = {}
    for key in sorted(rng.sample(keys, n)):
        phase = rng.choice(phases)
        plan[key] = AbortPoint(phase, prompt_fraction=round(rng.uniform(0.05, 0.95), 3),
                               num_tokens=rng.randint(1, max(1, spec.max_tokens - 1)),
                               delay_s=round(rng.uniform(0.0, 0.5), 3), lag_steps=rng.randint(0, 2))
    return plan


@dataclass(frozen=True, slots=True)
class AgentTraceSpec:
    """Sizes of an agent-trace workload (the prefix-caching benchmark's). Ranges are inclusive ``(low, high)`` and
    drawn uniformly.

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
FULL = AgentTraceSpec(
    name="full", system_prefix_len=1700, num_conversations=64, concurrency=32, turns=(4, 10),
    first_message_len=(2300, 3000), message_len=(300, 1500), output_len=(20, 100), max_prompt_len=12288,
)
# CPU scale: the same structure shrunk ~16x so that a tiny model runs it in about a minute on two cores. The
# prefix (110 tokens) is deliberately not a multiple of the 16-token block: sharing it needs a snapshot at 96.
CPU = AgentTraceSpec(
    name="cpu", system_prefix_len=110, num_conversations=12, concurrency=8, turns=(3, 6),
    first_message_len=(140, 220), message_len=(40, 160), output_len=(4, 12), max_prompt_len=750,
)
SCALES: dict[str, AgentTraceSpec] = {"full": FULL, "cpu": CPU}


def workload_spec(scale: str | AgentTraceSpec) -> AgentTraceSpec:
    """The spec of a named scale (``"full"`` or ``"cpu"``); a spec passes through unchanged."""
    if isinstance(scale, AgentTraceSpec):
        return scale
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; choose one of {sorted(SCALES)}")
    return SCALES[scale]


@dataclass(frozen=True, slots=True)
class Conversation:
    """One agent conversation.

    ``messages[t]`` is appended before turn ``t`` runs (``messages[0]`` is the first user message, after the shared
    ``system_prefix``); ``output_lens[t]`` is the number of tokens turn ``t`` generates (agent-trace workloads; a
    soak workload's turns run to their ``max_tokens`` or EOS, and its ``output_lens`` is empty). Turn ``t``'s prompt is
    ``system_prefix + messages[0] + out[0] + messages[1] + ... + out[t-1] + messages[t]`` where ``out`` are the
    tokens the engine actually produced.
    """

    conv_id: int
    system_prefix: tuple[int, ...]
    messages: tuple[tuple[int, ...], ...]
    output_lens: tuple[int, ...] = ()

    @property
    def num_turns(self) -> int:
        return len(self.messages)

    def prompt_len(self, turn: int) -> int:
        """Turn ``turn``'s prompt length (known in advance: outputs have exactly ``output_lens`` tokens)."""
        if not 0 <= turn < self.num_turns:
            raise IndexError(f"turn {turn} out of range (conversation has {self.num_turns})")
        if not self.output_lens:
            raise ValueError("a conversation without output_lens has no prompt length known in advance")
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


def _randrange(rng: random.Random, n: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(rng.randrange(vocab_size) for _ in range(n))


def _choices(rng: random.Random, n: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(rng.choices(range(vocab_size), k=n))


def make_conversations(spec: WorkloadSpec | AgentTraceSpec | str, seed: int = 0,
                       vocab_size: int = 448) -> list[Conversation]:
    """The workload's conversations, a pure function of ``(spec, seed, vocab_size)``; a string names an
    ``AgentTraceSpec`` scale (``"full"`` or ``"cpu"``).

    Token ids are drawn uniformly from ``[0, vocab_size)``: pass the tokenizer's ordinary vocabulary (the default
    448 is the tiny test tokenizer's, whose special tokens come after it) so that prompts hold no EOS or chat
    markers. Each conversation has its own random stream: conversation ``i`` does not change with
    ``num_conversations``.
    """
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be at least 2 (got {vocab_size})")
    if isinstance(spec, WorkloadSpec):
        return _soak_conversations(spec, seed, vocab_size)
    return _trace_conversations(workload_spec(spec), seed, vocab_size)


def _soak_conversations(spec: WorkloadSpec, seed: int, vocab_size: int) -> list[Conversation]:
    prefix = _randrange(random.Random(f"hyserve-soak/{seed}/prefix"), spec.prefix_len, vocab_size)
    convs: list[Conversation] = []
    for cid in range(spec.num_conversations):
        rng = random.Random(f"hyserve-soak/{seed}/conversation/{cid}")
        messages = [_randrange(rng, rng.randint(*spec.message_range(True)), vocab_size)]
        messages += [_randrange(rng, rng.randint(*spec.message_range(False)), vocab_size)
                     for _ in range(spec.turns - 1)]
        if spec.fork_every and cid % spec.fork_every == spec.fork_every - 1 and convs:
            messages[0] = convs[-1].messages[0]
        convs.append(Conversation(cid, prefix, tuple(messages)))
    return convs


def _trace_conversations(spec: AgentTraceSpec, seed: int, vocab_size: int) -> list[Conversation]:
    system_prefix = _choices(random.Random(f"hyserve-workload/{seed}/system"), spec.system_prefix_len, vocab_size)
    convs: list[Conversation] = []
    for cid in range(spec.num_conversations):
        rng = random.Random(f"hyserve-workload/{seed}/conversation/{cid}")
        n_turns = rng.randint(*spec.turns)
        messages = [_choices(rng, rng.randint(*spec.first_message_len), vocab_size)]
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
            messages.append(_choices(rng, msg_len, vocab_size))
            length += out_len + msg_len
        convs.append(Conversation(cid, system_prefix, tuple(messages), tuple(output_lens)))
    return convs

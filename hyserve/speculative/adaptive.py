"""How many drafts a speculative step verifies: the step's speculation length ``k_step`` in {0, ..., k}.

The scheduler asks ``SpecLengthPolicy.choose(b)`` once per step, with ``b`` the number of decoding requests the step
will carry, and every verify row of the step takes at most ``k_step`` drafts (0: each decoding row feeds only its
last token, a plain decode step for it). The choice maximises the expected tokens per second of the step,

    score(k) = E(k) / T(b, k),   E(k) = 1 + sum_{i=1..k} prod_{j<=i} a_j,

where ``a_j`` is the acceptance rate of draft position j given that the drafts before it were accepted, and
``T(b, k)`` the duration of a decode step of batch bucket ``bucket(b)`` verifying k drafts per row (``E(0)`` = 1, one
token per row). Both are measured online:

- ``a_j``: exponentially decayed counts over verify steps (``observe_verify``): a row with d drafts and ``acc``
  accepted reached positions 1 .. min(acc + 1, d) and had positions 1 .. acc accepted. ``a_j`` = accepted_j /
  reached_j over the decayed counts, starting from a prior (``PRIOR_ACCEPTANCE`` weighted as ``PRIOR_WEIGHT`` rows).
- ``T(b, k)``: an EWMA of measured step durations (``observe_step``: steps whose rows all decode) per
  (bucket, k), which drops at once to a step under half of it (the estimate held a one-off: a compile, a pause).
  A pair not measured yet is chosen before any other (exploration): the first steps of each bucket try every k
  once.

Starvation: while k = 0 wins, no draft is verified and the ``T`` of the other k stop updating. Every
``probe_interval`` decisions at a bucket, a probe step takes the k whose ``T`` entry at that bucket is the oldest
(the largest k on ties): it refreshes that ``T`` and, when k > 0, the acceptance counts (the acceptance of the
positions a probe does not reach keeps its last value). The cost is one step in ``probe_interval`` at a k the
policy would not have chosen.

Drafting (``drafting``): the MTP head proposes the next step's drafts in this step, before the next choice. It drafts
``max(k_step, 1)``, or none where the next choice is expected to be 0 (``next_choice``: the same rules, one decision
ahead), so that a run of steps at k = 0 pays no draft LM head. A step is timed as ``T(b, k)`` only where it verified
and drafted k (the engine's ``_observe_spec``): a step between two lengths times neither.

Fixed rules: ``adaptive=False`` always chooses k (what benchmarks and tests that want a fixed k use);
``disable_by_batch_size`` (vLLM's field) chooses 0 from that many decoding requests on, whatever else says.
Tests script the choices (``script``): a list of k values taken in turn, cycled.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

# Batch buckets: the captured graph sizes (hyserve.worker.cuda_graphs.DEFAULT_CAPTURE_SIZES) a step pads to.
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
PRIOR_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 4.0  # the prior counts as this many rows reaching each position
ACCEPT_DECAY = 0.98  # per verify step: the counts of a step 35 steps back weigh half
TIME_ALPHA = 0.2  # EWMA weight of a new step duration
PROBE_INTERVAL = 64


def bucket(b: int) -> int:
    """The batch bucket of ``b`` decoding rows (the smallest bucket at least ``b``, else the largest)."""
    for s in BUCKETS:
        if s >= b:
            return s
    return BUCKETS[-1]


def expected_tokens(acceptance: list[float], k: int) -> float:
    """E(k): tokens a verify row emits on average with k drafts, ``acceptance[j - 1]`` being a_j."""
    total, p = 1.0, 1.0
    for a in acceptance[:k]:
        p *= a
        total += p
    return total


@dataclass
class _Timing:
    seconds: float
    last: int  # the bucket's decision count when it was last measured


@dataclass
class SpecLengthPolicy:
    """The per-step speculation length (module docstring). ``k``: the configured number of speculative tokens."""

    k: int
    adaptive: bool = True
    disable_by_batch_size: int | None = None
    probe_interval: int = PROBE_INTERVAL
    accepted: list[float] = field(default_factory=list)  # decayed counts per position (1-based j at index j - 1)
    reached: list[float] = field(default_factory=list)
    times: dict[tuple[int, int], _Timing] = field(default_factory=dict)  # (bucket, k) -> step duration
    decisions: Counter[int] = field(default_factory=Counter)  # per bucket: choices made
    histogram: Counter[int] = field(default_factory=Counter)  # k_step -> steps
    _script: list[int] | None = None
    _script_at: int = 0

    def __post_init__(self) -> None:
        self.reset_acceptance()

    def reset_acceptance(self) -> None:
        """The acceptance back to the prior (benchmarks: after a warm-up whose drafts say nothing of the run's)."""
        self.accepted = [PRIOR_ACCEPTANCE * PRIOR_WEIGHT] * self.k
        self.reached = [PRIOR_WEIGHT] * self.k

    # ------------------------------------------------------------------ decisions

    def script(self, values: list[int] | None) -> None:
        """Tests: the next choices are ``values`` in turn (cycled), whatever the policy would choose; None: stop."""
        if values is not None and not all(0 <= v <= self.k for v in values):
            raise ValueError(f"scripted speculation lengths must be in [0, {self.k}] (got {values})")
        self._script, self._script_at = (list(values) if values else None), 0

    def choose(self, b: int) -> int:
        """The speculation length of a step with ``b`` decoding requests (counted in ``histogram``)."""
        k = self._choose(b)
        self.histogram[k] += 1
        return k

    def _choose(self, b: int) -> int:
        if self._script is not None:
            k = self._script[self._script_at % len(self._script)]
            self._script_at += 1
            return k
        if self.disable_by_batch_size is not None and b >= self.disable_by_batch_size:
            return 0
        if not self.adaptive or b == 0:
            return self.k
        bk = bucket(b)
        n = self.decisions[bk]
        self.decisions[bk] = n + 1
        entries = {k: self.times.get((bk, k)) for k in range(self.k + 1)}
        missing = [k for k, t in entries.items() if t is None]
        if missing:  # explore: every k at this bucket measured once, the largest first
            return max(missing)
        best = self.best(bk)
        if self.probe_interval and n % self.probe_interval == self.probe_interval - 1:
            oldest = min(range(self.k, -1, -1), key=lambda k: entries[k].last)  # type: ignore[union-attr]
            return oldest
        return best

    def next_choice(self, b: int) -> int:
        """The choice ``choose(b)`` would make next, from what is known now (it does not count as a decision)."""
        if self._script is not None:
            return self._script[self._script_at % len(self._script)]
        if self.disable_by_batch_size is not None and b >= self.disable_by_batch_size:
            return 0
        if not self.adaptive or b == 0:
            return self.k
        bk = bucket(b)
        n = self.decisions[bk]
        entries = {k: self.times.get((bk, k)) for k in range(self.k + 1)}
        missing = [k for k, t in entries.items() if t is None]
        if missing:
            return max(missing)
        if self.probe_interval and n % self.probe_interval == self.probe_interval - 1:
            return min(range(self.k, -1, -1), key=lambda k: entries[k].last)  # type: ignore[union-attr]
        return self.best(bk)

    def drafting(self, b: int, k_step: int) -> int:
        """The drafts the MTP head proposes in a step at ``k_step`` (of ``b`` decoding requests) for the next step:
        0 where the next step is expected at k = 0 too (no draft would be verified: the head's first pass then
        only writes its KV entries, without its LM head), else ``max(k_step, 1)`` (a rise from 0 takes one step
        at one draft). A next step that chooses otherwise takes what there is."""
        return 0 if self.next_choice(b) == 0 else max(k_step, 1)

    def best(self, bk: int) -> int:
        """The k of the highest expected tokens per second at bucket ``bk`` among the measured ones (the smallest on
        ties)."""
        acc = self.acceptance
        best_k, best_score = 0, -1.0
        for k in range(self.k + 1):
            t = self.times.get((bk, k))
            if t is None or t.seconds <= 0:
                continue
            score = expected_tokens(acc, k) / t.seconds
            if score > best_score:
                best_k, best_score = k, score
        return best_k

    # ------------------------------------------------------------------ measurements

    @property
    def acceptance(self) -> list[float]:
        """a_j for j = 1 .. k: acceptance at position j given the positions before it accepted."""
        return [a / r if r > 0 else PRIOR_ACCEPTANCE for a, r in zip(self.accepted, self.reached, strict=True)]

    def observe_verify(self, num_drafts: list[int], num_accepted: list[int]) -> None:
        """One verify step: each row's drafts and accepted count (rows without drafts or that failed, -1, skipped)."""
        rows = [(d, a) for d, a in zip(num_drafts, num_accepted, strict=True) if d > 0 and a >= 0]
        if not rows:
            return
        for j in range(self.k):
            self.accepted[j] *= ACCEPT_DECAY
            self.reached[j] *= ACCEPT_DECAY
        for d, a in rows:
            for j in range(min(a + 1, d, self.k)):  # position j + 1 was reached
                self.reached[j] += 1.0
                if j < a:
                    self.accepted[j] += 1.0

    def observe_step(self, b: int, k: int, seconds: float) -> None:
        """A step of ``b`` decoding rows, every row decoding, at speculation length ``k`` took ``seconds``."""
        if b <= 0 or seconds <= 0 or not 0 <= k <= self.k:
            return
        bk = bucket(b)
        now = self.decisions[bk]
        t = self.times.get((bk, k))
        if t is None:
            self.times[(bk, k)] = _Timing(seconds, now)
        else:
            # Down at once when a step takes under half the estimate (the estimate held a one-off: a kernel compiled
            # in the step, a host pause), else the EWMA.
            t.seconds = seconds if seconds < 0.5 * t.seconds else t.seconds + TIME_ALPHA * (seconds - t.seconds)
            t.last = now

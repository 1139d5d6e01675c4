"""What crosses the boundary between the scheduler (ids and ints) and the worker (tensors), in both directions.

``SchedulerOutput`` is one step as plain data: which requests run, the tokens each row feeds, the KV block ids and
the state slot each row reads and writes, and the state operations (slot resets, snapshot copy-ins and copy-outs)
as entry numbers. ``RunnerOutput`` is what the worker learned by running it: per row, the sampled or verified
tokens, how many drafts were accepted, logprobs, errors and the next drafts. Both pickle (nothing here refers to a
live object), so a step can be sent to another process; ``step_id`` ties a result to the step it belongs to, and the
scheduler reads a result only through the rows of its own ``SchedulerOutput`` (docs/design.md invariant 13).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hyserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from hyserve.multimodal.inputs import MultimodalPrompt

# A row's input token that the worker takes from its own result of the request's previous step (async scheduling:
# the host does not know it yet).
PREVIOUS_SAMPLED = -1
# A verify row's draft that the worker's MTP head left on the device, in the drafts row of the request's state slot
# (one graph replay drafts and never copies the drafts to the host; the j-th such entry is the j-th draft). The host
# learns the accepted ones from the verify result. Only on a single rank: other ranks could not read it.
PREVIOUS_DRAFT = -2
# A row's prompt logprobs: per target position its logprob, its 1-based vocabulary rank and the top-N (id, logprob).
PromptLogprobRows = tuple[list[float], list[int], list[list[tuple[int, float]]]]


def candidate_point(start: int, num_tokens: int, block_size: int) -> int | None:
    """The snapshot point of a verify row of ``num_tokens`` tokens from ``start``: the last block boundary it
    reaches, or None where it reaches none (the worker derives the same on the device for a row behind another)."""
    point = ((start + num_tokens) // block_size) * block_size
    return point if point > start else None


@dataclass(slots=True)
class NewRequestData:
    """A request the worker has not seen (or has forgotten): what sampling needs for all of its steps."""

    req_id: str
    sampling_params: SamplingParams
    # A prompt with images: their pixels and spans, and its M-RoPE positions (hyserve.multimodal.inputs).
    mm: MultimodalPrompt | None = None
    # The prompt's token ids, for requests whose sampling reads them (repetition penalty, bad words: the worker
    # keeps the request's tokens on the device; a prefix-cache hit never feeds the prompt's cached part).
    prompt_token_ids: list[int] | None = None


@dataclass(slots=True)
class ScheduledRow:
    """One request's part of a step: positions [start, start + len(token_ids)).

    - ``token_ids``: the tokens fed; for a verify row its last known token followed by the drafts; an entry
      ``PREVIOUS_SAMPLED`` is the token the worker sampled for this request in its previous step, an entry
      ``PREVIOUS_DRAFT`` a draft the worker's MTP head left on the device.
    - ``block_table``, ``state_slot``: where the row's KV and recurrent state live (the request's own).
    - ``reset_state``: zero the slot before the forward (the request's first chunk); ``load_snapshot``: copy that
      snapshot entry into the slot before the forward (a prefix hit); ``load_host_snapshot``: copy that host entry
      of the prefix cache's host tier into the slot instead.
    - ``snapshot_entry``: copy the slot into this entry right after the forward (the chunk ends on a snapshot
      point); ``interior_snapshots``: (p, entry) of each snapshot point p strictly inside the row (a chunk of known
      tokens, where every recurrent layer can take its state inside a row): the layers write their state after
      position p into entry during the forward (``hyserve.model.metadata.RowSnapshots``).
    - ``candidate_snapshot`` (verify rows) = (p, entry): if the accepted length reaches position p, copy the
      verified candidate state after p tokens into entry.
    - ``output_index``: the index in the output of the first token this row samples (seeds, min_tokens bans);
      ``banned_token_ids``: the ids banned while the output is shorter than ``min_tokens``.
    - ``grammar_bitmask``: structured output: the allowed tokens of each position the row samples (one, or a
      verify row's k + 1), packed as ``hyserve.structured_output.bitmask`` describes; None: no constraint.
    - ``next_token_id``: the request's token at position ``end`` when the host knows it (the MTP head consumes it).
    - ``draft_limit``: MTP drafting may propose tokens up to this many tokens in all (max_tokens, max_model_len).
    - ``prompt_logprob_targets``: prompt logprobs (``SamplingParams.prompt_logprobs``): the prompt tokens at
      positions start + 1, start + 2, ...: the row's first ``len`` positions each return the logprob of its target
      and the top-N (``RunnerOutput.prompt_logprobs``); empty: none.
    - ``start_on_device``: a verify row scheduled behind its request's verify row still in flight (async
      scheduling): its position depends on that row's accepted count, which the host learns later. ``start`` is
      then a lower bound and ``max_start`` the upper one until the scheduler learns the count (it sets ``start``
      then); the worker takes the start, the last token (``PREVIOUS_SAMPLED``) and the drafts (``PREVIOUS_DRAFT``)
      from what the earlier row's acceptance left on the device. ``candidate_snapshot`` is then ``(-1, entry)``:
      the point is the last block boundary the row reaches, known with its start.
    """

    req_id: str
    start: int
    token_ids: list[int]
    block_table: list[int]
    state_slot: int
    samples: bool
    reset_state: bool = False
    load_snapshot: int | None = None
    load_host_snapshot: int | None = None
    snapshot_entry: int | None = None
    interior_snapshots: list[tuple[int, int]] = field(default_factory=list)
    is_verify: bool = False
    candidate_snapshot: tuple[int, int] | None = None
    output_index: int = 0
    banned_token_ids: list[int] = field(default_factory=list)
    grammar_bitmask: bytes | None = None
    next_token_id: int | None = None
    draft_limit: int = 0
    start_on_device: bool = False
    max_start: int = 0
    prompt_logprob_targets: list[int] = field(default_factory=list)

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    @property
    def latest_start(self) -> int:
        """The start, or for a row whose start is on the device the latest it can be."""
        return self.max_start if self.start_on_device else self.start

    @property
    def num_drafts(self) -> int:
        return len(self.token_ids) - 1 if self.is_verify else 0


@dataclass(slots=True)
class SchedulerOutput:
    step_id: int
    rows: list[ScheduledRow] = field(default_factory=list)  # verify rows first
    new_requests: list[NewRequestData] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)  # the worker forgets them before this step
    preempted_req_ids: list[str] = field(default_factory=list)
    # Requests that can never be admitted, with the reason: the engine finishes them with an error.
    failed: list[tuple[str, str]] = field(default_factory=list)
    # Pipeline parallelism: (step id, accepted count of each of that step's verify rows) of earlier steps whose
    # results are in. A stage before the last applies them, through that step's own rows, before this step.
    verify_commits: list[tuple[int, list[int]]] = field(default_factory=list)
    # Speculative decoding: the step's speculation length k_step (hyserve.speculative.adaptive): every verify row
    # holds at most this many drafts (a row behind one in flight exactly this many); 0 when not speculating.
    num_spec_tokens: int = 0
    # The drafts the MTP head proposes in this step for the next (DraftManager.drafting_length; 0: its first pass
    # writes its KV entries only); None: max(num_spec_tokens, 1).
    num_drafting: int | None = None
    # The prefix cache's host tier: (state-pool entry, host entry) of each snapshot the budget moved to the host
    # while scheduling this step. Every worker copies them out first: the step may write those entries.
    snapshot_offloads: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.rows)

    @property
    def is_empty(self) -> bool:
        """Nothing for the workers: no rows, no verify commits to apply, no finished requests to forget (a step that
        carries only those still goes to them, or the workers would keep those requests forever)."""
        return not self.rows and not self.verify_commits and not self.finished_req_ids \
            and not self.snapshot_offloads


@dataclass(slots=True)
class RunnerOutput:
    """A step's results, one entry per row of its ``SchedulerOutput`` (same order).

    - ``token_ids[i]``: the sampled token (plain rows that sample), the accepted drafts and the correction or bonus
      token (verify rows), ``[]`` for rows that do not sample and for error rows.
    - ``num_accepted[i]``: drafts accepted by a verify row (the live state took that candidate), -1 otherwise.
    - ``logprobs`` / ``ranks`` / ``top_logprobs``: ``None`` if no row asked; else per row, parallel to token_ids.
    - ``prompt_logprobs``: row index -> (logprobs, ranks, top-N lists) of the targets of the row's
      ``prompt_logprob_targets``, one entry per target (the row's positions start, start + 1, ...).
    - ``errors``: row index -> why the row produced nothing (non-finite logits, its sampling inputs failed).
    - ``next_draft_token_ids[i]``: the MTP head's drafts for the row's next step (``[]``: none); entries
      ``PREVIOUS_DRAFT`` when they stayed on the device (their number is right, their values are the worker's).
    - ``step_seconds``: (step id, seconds) of this or earlier steps whose own device time became known
      (``hyserve.worker.step_timer``); ``None`` where the worker does not time its steps (a pipeline).
    """

    step_id: int
    token_ids: list[list[int]]
    num_accepted: list[int]
    logprobs: list[list[float]] | None = None
    ranks: list[list[int | None]] | None = None
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None
    errors: dict[int, str] = field(default_factory=dict)
    prompt_logprobs: dict[int, PromptLogprobRows] = field(default_factory=dict)
    next_draft_token_ids: list[list[int]] = field(default_factory=list)
    step_seconds: list[tuple[int, float]] | None = None

    def logprob_lists(self) -> tuple[list[list[float]], list[list[int | None]], list[list[list[tuple[int, float]]]]]:
        """``logprobs``, ``ranks`` and ``top_logprobs``, made (empty for every row) the first time a row asks."""
        if self.logprobs is None or self.ranks is None or self.top_logprobs is None:
            n = len(self.token_ids)
            self.logprobs, self.ranks, self.top_logprobs = [[] for _ in range(n)], [[] for _ in range(n)], \
                [[] for _ in range(n)]
        return self.logprobs, self.ranks, self.top_logprobs

"""A request's life in the engine: its tokens, what has been computed, and the memory it owns.

    all_token_ids:  | prompt ................ | output ......... |
                    |<-- num_computed_tokens -->|<- to compute ->|

``num_computed_tokens`` tokens have their KV in the request's blocks and are folded into its recurrent state slot.
A request is sampled from when a step brings ``num_computed_tokens`` up to ``num_tokens``. Preemption (by recompute)
drops the blocks and the slot and sets ``num_computed_tokens`` back to 0; the output so far is kept and recomputed as
part of the prompt, and sampling seeds depend only on the output index, so the resumed output is unchanged.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hyserve.multimodal.spans import ImageSpan
from hyserve.sampling_params import SamplingParams
from hyserve.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from hyserve.multimodal.inputs import MultimodalPrompt
    from hyserve.structured_output.matcher import GrammarMatcher


@dataclass(slots=True)
class OutputCursor:
    """How much of the output DELTA outputs have sent: token ids, logprob entries, text characters."""

    num_ids: int = 0
    num_logprobs: int = 0
    num_chars: int = 0
    prompt_logprobs_sent: bool = False


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_index: int
    detokenizer: IncrementalDetokenizer | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    sampled_logprobs: list[float] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Async scheduling: tokens of steps scheduled and not yet reported, and how many of those steps sample.
    num_inflight_tokens: int = 0
    num_inflight_samples: int = 0
    block_table: list[int] = field(default_factory=list)
    state_slot: int | None = None
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    output_text: str = ""
    num_preemptions: int = 0
    error: str | None = None
    # Prefix caching (see cache/prefix_cache.py): keys of the full blocks of known tokens, how many of the request's
    # blocks are published, the aligned positions where this request should leave a snapshot for its siblings (where
    # its prefix leaves a cached one's, and where a waiting request shares its prefix), and its latest
    # decode-boundary snapshot (retired when a newer one is taken).
    block_hashes: list[bytes] = field(default_factory=list)
    image_spans: tuple[ImageSpan, ...] = ()
    # Image input: the images' pixels and spans, the prompt's M-RoPE positions (hyserve.multimodal.inputs).
    mm: MultimodalPrompt | None = None
    num_published_blocks: int = 0
    share_points: list[int] = field(default_factory=list)
    rolling_snapshot_hash: bytes | None = None
    num_cached_tokens: int = 0
    # Speculative decoding: tokens proposed to follow the known tokens, verified in the next step.
    draft_token_ids: list[int] = field(default_factory=list)
    # Logprobs: the 1-based vocabulary rank of each output token (parallel to output_logprobs).
    output_ranks: list[int | None] = field(default_factory=list)
    # Timestamps (time.time()) for RequestOutput.metrics.
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # What DELTA outputs have sent so far (the output processor's cursor).
    sent: OutputCursor = field(default_factory=OutputCursor)
    # Structured output: the grammar's state after the accepted output tokens (hyserve.structured_output).
    grammar: GrammarMatcher | None = None
    # Prompt logprobs (SamplingParams.prompt_logprobs): entry p is (logprob, rank, top-N pairs) of prompt token
    # p + 1 given the tokens before it; None until the step computing position p reports it.
    prompt_logprob_rows: list[tuple[float, int, list[tuple[int, float]]] | None] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def is_decoding(self) -> bool:
        """Every known token but the last is computed: the next step feeds the last token (plus any drafts)."""
        return self.num_computed_tokens == self.num_tokens - 1 and self.num_output_tokens > 0

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

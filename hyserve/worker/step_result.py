"""A step's result as the host reads it: the sampled and verified tokens written into the step's ``RunnerOutput``,
row by row in the step's order (docs/design.md invariant 13), once the device's results are on the host."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from hyserve.layers.sampler import PendingSample, SamplerOutput
from hyserve.scheduler.output import RunnerOutput

if TYPE_CHECKING:  # the type only: acceptance sits above this module (spec_decode)
    from hyserve.worker.spec_decode.rejection_sampler import SpecOutput


def take_samples(out: RunnerOutput, idx: list[int], samp: SamplerOutput) -> None:
    """Rows ``idx`` of the step take their sampled token (non-finite logits: an error, invariant 8)."""
    errors = set(samp.error_rows)
    for j, i in enumerate(idx):
        if i in out.errors:
            continue
        if j in errors:
            out.errors[i] = "non-finite logits (NaN/inf)"
            continue
        out.token_ids[i] = [int(samp.token_ids[j])]
        if samp.logprobs is not None:
            lps, ranks, tops = out.logprob_lists()
            lps[i] = [float(samp.logprobs[j])]
            ranks[i] = [samp.ranks[j]] if samp.ranks is not None else [None]
            tops[i] = [samp.top_logprobs[j]] if samp.top_logprobs is not None else [[]]


def take_verified(out: RunnerOutput, idx: list[int], spec: SpecOutput) -> None:
    """Verify rows ``idx`` of the step take their accepted count and emitted tokens."""
    errors = set(spec.error_rows)
    for j, i in enumerate(idx):
        if j in errors:
            out.errors.setdefault(i, "non-finite logits (NaN/inf) while verifying drafts")
            continue  # the live state is left as it was (-1)
        out.num_accepted[i] = spec.num_accepted[j]
        if i in out.errors:
            continue  # its state advances (the batch ran), its tokens are dropped
        tokens = out.token_ids[i] = [int(t) for t in spec.token_ids[j]]
        if spec.logprobs is not None:
            lps, ranks, tops = out.logprob_lists()
            lps[i] = [float(x) for x in spec.logprobs[j]]
            ranks[i] = list(spec.ranks[j]) if spec.ranks is not None else [None] * len(tokens)
            tops[i] = list(spec.top_logprobs[j]) if spec.top_logprobs is not None else [[] for _ in tokens]


class StepResult:
    """A step enqueued on the device (``ModelRunner.execute_model_async``); ``result()`` is its ``RunnerOutput``."""

    def __init__(self, out: RunnerOutput, plain: list[int] | None = None, samp: PendingSample | None = None,
                 finish: Callable[[], None] | None = None) -> None:
        self._out = out
        self._plain = plain or []
        self._samp = samp
        self._finish = finish  # what fills the rest of ``out`` once the device's results are on the host

    def result(self) -> RunnerOutput:
        if self._samp is not None:
            take_samples(self._out, self._plain, self._samp.result())
            self._samp = None
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return self._out

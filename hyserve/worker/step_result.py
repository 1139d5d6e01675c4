"""A step's result as the host reads it: the sampled tokens written into the step's ``RunnerOutput``, row by row in
the step's order (docs/design.md invariant 13), once the device's results are on the host (verified tokens:
``spec_decode.verifier.take_verified``)."""

from __future__ import annotations

from collections.abc import Callable

from hyserve.layers.sampler import PendingSample, SamplerOutput
from hyserve.scheduler.output import RunnerOutput


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

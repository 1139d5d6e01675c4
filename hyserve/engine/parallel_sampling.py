"""``n`` > 1: one request's n completions as n child requests of the engine, and their outputs as the parent's.

A request with ``SamplingParams.n == n`` becomes n requests ``"{i}_{request_id}"`` (vLLM's child ids) with ``n == 1``
and, when the parent has a seed, the seed ``seed + i`` (vLLM's rule: children draw independently, and the same
request gives the same n completions again); without a seed each child draws from the engine's generator. The
children share the prompt, so the prefix cache shares its KV blocks and snapshots among them as among any requests
(a child admitted after another computed the prompt takes a hit). Aborting the parent aborts every child.

The parent's outputs (``RequestOutput.request_id`` is the parent's, ``outputs[j].index`` the child's ``i``):
CUMULATIVE: after every step a child reports in, the latest completion of every child that has reported so far,
by index; FINAL_ONLY: one output with all n completions once every child has finished; DELTA: per step, what each
child that reported in it has new. ``finished`` is true once every child has finished.
"""

from __future__ import annotations

import dataclasses

from hyserve.outputs import CompletionOutput, RequestOutput
from hyserve.sampling_params import MAX_SEED, RequestOutputKind, SamplingParams


def child_request_id(request_id: str, index: int) -> str:
    return f"{index}_{request_id}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Child ``index``'s parameters: ``n == 1``, its own seed ``seed + index`` (wrapping inside the seed range)."""
    seed = None if params.seed is None else (params.seed + index) % (MAX_SEED + 1)
    return dataclasses.replace(params, n=1, seed=seed)


class ParentRequest:
    """The children of one request with ``n`` > 1 and what they have reported."""

    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.kind = params.output_kind
        self.child_ids = [child_request_id(request_id, i) for i in range(params.n)]
        self.index = {cid: i for i, cid in enumerate(self.child_ids)}
        self.latest: dict[int, CompletionOutput] = {}
        self.unfinished = set(self.child_ids)
        self.template: RequestOutput | None = None  # a child's output: the prompt's fields, metrics

    def take(self, outs: list[RequestOutput]) -> RequestOutput | None:
        """The parent's output for its children's outputs ``outs`` of one step (None: nothing to show yet)."""
        step: list[CompletionOutput] = []
        for out in outs:
            i = self.index[out.request_id]
            c = dataclasses.replace(out.outputs[0], index=i)
            self.latest[i] = c
            step.append(c)
            if out.finished:
                self.unfinished.discard(out.request_id)
            if self.template is None or out.prompt_logprobs is not None:
                self.template = out
        finished = not self.unfinished
        if self.kind is RequestOutputKind.DELTA:
            completions = sorted(step, key=lambda c: c.index)
        elif self.kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        else:
            completions = [self.latest[i] for i in sorted(self.latest)]
        assert self.template is not None
        t = self.template
        prompt_logprobs = next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None),
                               None if self.kind is RequestOutputKind.DELTA else t.prompt_logprobs)
        return RequestOutput(request_id=self.request_id, prompt=t.prompt, prompt_token_ids=t.prompt_token_ids,
                             outputs=completions, finished=finished, metrics=t.metrics,
                             prompt_logprobs=prompt_logprobs, num_cached_tokens=t.num_cached_tokens)


class ParentRequests:
    """The engine's requests with ``n`` > 1, by parent id and by child id."""

    def __init__(self) -> None:
        self.parents: dict[str, ParentRequest] = {}
        self.of_child: dict[str, ParentRequest] = {}

    def add(self, parent: ParentRequest) -> None:
        self.parents[parent.request_id] = parent
        for cid in parent.child_ids:
            self.of_child[cid] = parent

    def remove(self, request_id: str) -> list[str]:
        """Forget parent ``request_id``; its child ids ([] if it is no parent)."""
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return []
        for cid in parent.child_ids:
            self.of_child.pop(cid, None)
        return list(parent.child_ids)

    def outputs(self, outs: list[RequestOutput]) -> list[RequestOutput]:
        """A step's outputs with the children's replaced by their parents' (in the order each parent first
        appears); a parent whose children have all finished is forgotten."""
        if not self.parents:
            return outs
        result: list[RequestOutput | ParentRequest] = []
        grouped: dict[str, list[RequestOutput]] = {}
        for out in outs:
            parent = self.of_child.get(out.request_id)
            if parent is None:
                result.append(out)
                continue
            if parent.request_id not in grouped:
                grouped[parent.request_id] = []
                result.append(parent)
            grouped[parent.request_id].append(out)
        final: list[RequestOutput] = []
        for item in result:
            if isinstance(item, RequestOutput):
                final.append(item)
                continue
            parent_out = item.take(grouped[item.request_id])
            if parent_out is not None:
                final.append(parent_out)
            if not item.unfinished:
                self.remove(item.request_id)
        return final

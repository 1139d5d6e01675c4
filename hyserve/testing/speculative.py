"""Speculative decoding in tests: a proposer that plants errors at chosen positions of the known continuation, the
outputs of each prompt run alone without speculation, and a recorder of the drafts every verify step compared."""

from __future__ import annotations

import copy
from typing import Any

from hyserve import SamplingParams
from hyserve.engine.llm_engine import LLMEngine
from hyserve.outputs import RequestOutput
from hyserve.request import Request
from hyserve.scheduler.output import PREVIOUS_DRAFT
from hyserve.speculative.proposer import Proposer
from hyserve.testing.engine import greedy, make_llm, run_key


class OracleProposer(Proposer):
    """Test-only: proposes the known greedy continuation of each request, with errors planted where asked.

    ``plan[request_id]`` is a list of acceptance lengths to force at successive verify steps (cycled): a value
    a < k proposes the right tokens up to a and a wrong token at a; a value k proposes all k right.
    """

    def __init__(self, continuations: dict[str, list[int]], plan: dict[str, list[int]], vocab: int) -> None:
        self.continuations = continuations
        self.plan = plan
        self.vocab = vocab
        self.calls: dict[str, int] = {}
        self.forced: list[tuple[str, int, int]] = []  # (request, forced acceptance, proposed k)

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        out = []
        for req, k in zip(requests, num_tokens, strict=True):
            rid = req.request_id
            cont = self.continuations[rid]
            done = req.num_output_tokens
            right = cont[done : done + k]
            i = self.calls.get(rid, 0)
            self.calls[rid] = i + 1
            steps = self.plan.get(rid, [k])
            a = min(steps[i % len(steps)], len(right))
            drafts = list(right)
            if a < len(drafts):
                drafts[a] = (drafts[a] + 1) % self.vocab  # a wrong token at position a
            self.forced.append((rid, a, len(drafts)))
            out.append(drafts)
        return out


_PLAIN: dict[tuple, Any] = {}  # (path, device, run_key()) -> a plain engine's LLM
_SOLO: dict[tuple, RequestOutput] = {}  # (path, prompt, params, device, run_key()) -> its output


def solo_output(path: str, prompt: list[int], params: SamplingParams, device: str = "cpu") -> RequestOutput:
    """A plain engine's output (no speculation, no prefix caching) for ``prompt`` alone. Deterministic, so computed
    once per session for the same checkpoint, prompt, parameters, device and switches (``run_key``: the emulated
    graphs and the ``HYSERVE_*`` variables), each caller getting a copy. Callers ask before they plant a sabotage
    (the engine runs in this process, on the classes as they are then)."""
    key = (path, tuple(prompt), repr(params), device, run_key())
    if key not in _SOLO:
        llm_key = (path, device, run_key())
        if llm_key not in _PLAIN:
            _PLAIN[llm_key] = make_llm(path, enable_prefix_caching=False, device=device)
        _SOLO[key] = _PLAIN[llm_key].generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    return copy.deepcopy(_SOLO[key])


def solo_outputs(path: str, prompts: dict[str, list[int]], n: int) -> dict[str, list[int]]:
    """Each prompt's ``n`` greedy tokens, alone without speculation (``solo_output``)."""
    return {rid: list(solo_output(path, p, greedy(n)).outputs[0].token_ids) for rid, p in prompts.items()}


def resolve_drafts(engine: LLMEngine, req: Request) -> list[int]:
    """``req``'s next drafts as values: those the MTP head left on the device (``PREVIOUS_DRAFT`` placeholders in
    the scheduler) read from its state slot's row of the worker's ``draft_slots``."""
    drafts = list(req.draft_token_ids)
    if PREVIOUS_DRAFT not in drafts:
        return drafts
    verifier = engine.runner.verifier
    assert verifier is not None
    slots = verifier.draft_slots
    assert slots is not None and req.state_slot is not None
    row = slots[req.state_slot].tolist()
    return [row[j] if t == PREVIOUS_DRAFT else t for j, t in enumerate(drafts)]


def record_drafts(engine: LLMEngine) -> dict[str, list]:
    """Record each request's drafts and the MTP layer's output (float) that proposed the first of them."""
    seen: dict[str, list] = {}
    proposer = engine.runner.mtp_proposer
    drafts = engine.drafts
    assert proposer is not None and drafts is not None
    original = engine.scheduler.update_from_output

    def update(so, ro, sink):  # type: ignore[no-untyped-def]
        ran = original(so, ro, sink)
        for req in ran:
            if not req.is_finished and req.is_decoding and drafts.num_drafts(req, engine.max_model_len) > 0:
                hidden = proposer.first_hidden.get(req.request_id)
                seen.setdefault(req.request_id, []).append(
                    (resolve_drafts(engine, req), None if hidden is None else hidden.clone()))
        return ran

    engine.scheduler.update_from_output = update  # type: ignore[method-assign]
    return seen

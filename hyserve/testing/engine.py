"""Driving the engine in tests, and comparing its outputs with a reference.

``make_llm`` builds a small CPU float32 ``LLM``; ``drive`` steps an engine through staggered arrivals and aborts;
``assert_matches_reference`` checks greedy tokens and log-probabilities against a teacher-forced reference forward;
``SlotRecorder`` records the row-to-slot mapping of every step (tests assert it was not the identity);
``run_conversations`` runs closed-loop multi-turn conversations (each turn's prompt carries the previous outputs).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable

import torch

from hyserve import LLM, SamplingParams
from hyserve.engine.llm_engine import LLMEngine
from hyserve.outputs import RequestOutput
from hyserve.testing.qwen3_5 import reference_logits

# Tolerances in float32. On these checkpoints (logits up to ~25) transformers' own float32 forward differs from its
# float64 forward by up to 1.3e-3 on a logit, so closer agreement than that is not meaningful; any real bug (a wrong
# slot, a stale state, a missed norm) moves logits by whole units.
GREEDY_TOL = 2e-3  # logit gap allowed between hyserve's greedy token and the reference argmax


LOGPROB_TOL = 3e-3


def make_llm(path: str, **kw: object) -> LLM:
    args: dict[str, object] = dict(device="cpu", dtype="float32", max_num_batched_tokens=2048, max_num_seqs=8,
                                   num_kv_blocks=256, num_state_slots=8)
    args.update(kw)
    return LLM(model=path, **args)  # type: ignore[arg-type]


def random_prompts(n: int, lengths: list[int], vocab: int = 440, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


def assert_matches_reference(ref: object, prompt: list[int], out: RequestOutput, check_logprobs: bool = True) -> None:
    toks = out.outputs[0].token_ids
    assert toks, "no tokens generated"
    logits = reference_logits(ref, prompt + toks)  # type: ignore[arg-type]
    logp = torch.log_softmax(logits.double(), dim=-1)
    for i, tok in enumerate(toks):
        row = logits[len(prompt) - 1 + i]
        gap = float(row.max() - row[tok])
        assert gap <= GREEDY_TOL, f"output token {i}: chose {tok}, reference argmax {int(row.argmax())} (gap {gap})"
        if check_logprobs:
            got = out.outputs[0].logprobs[i][tok].logprob  # type: ignore[index]
            want = float(logp[len(prompt) - 1 + i, tok])
            assert abs(got - want) <= LOGPROB_TOL, f"output token {i}: logprob {got} vs reference {want}"


class SlotRecorder:
    """Wraps the runner's ``prepare`` to record (row, slot, request) of every step."""

    def __init__(self, engine: LLMEngine) -> None:
        self.rows: list[tuple[int, int, str]] = []
        runner = engine.runner
        original: Callable = runner.prepare

        def prepare(rows, **kw):
            for i, r in enumerate(rows):
                self.rows.append((i, int(r.state_slot), r.req_id))
            return original(rows, **kw)

        runner.prepare = prepare  # type: ignore[method-assign,assignment]

    def saw_non_identity(self) -> bool:
        return any(row != slot for row, slot, _ in self.rows)

    def saw_slot_reuse(self) -> bool:
        owners: dict[int, set[str]] = {}
        for _, slot, rid in self.rows:
            owners.setdefault(slot, set()).add(rid)
        return any(len(o) > 1 for o in owners.values())


def drive(engine: LLMEngine, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]],
          aborts: dict[int, list[str]] | None = None, max_steps: int = 10_000) -> dict[str, RequestOutput]:
    """Step the engine, adding requests and aborting them at the given step numbers; returns final outputs."""
    aborts = aborts or {}
    final: dict[str, RequestOutput] = {}
    step = 0
    last_arrival = max(arrivals) if arrivals else 0
    while step <= last_arrival or engine.has_unfinished_requests():
        for rid, prompt, params in arrivals.get(step, []):
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        for rid in aborts.get(step, []):
            engine.abort_request(rid)
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        step += 1
        assert step < max_steps, "engine did not finish"
    return final


def toks(n: int, seed: int, vocab: int = 440) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def run_conversations(engine: LLMEngine, convs: list[list[list[int]]], out_len: int,
                      stagger: bool = True) -> dict[str, list[int]]:
    """Closed loop: turn t of a conversation is submitted when turn t-1 finished (prompt grows by output + message).

    Conversations are interleaved (their turns overlap in time) when ``stagger``; returns outputs by id.
    """
    results: dict[str, list[int]] = {}
    prompts = {c: list(turns[0]) for c, turns in enumerate(convs)}
    turn = dict.fromkeys(range(len(convs)), 0)
    step = 0
    pending = set()
    start_step = {c: (c * 3 if stagger else 0) for c in range(len(convs))}
    while True:
        for c in range(len(convs)):
            if c not in pending and turn[c] < len(convs[c]) and step >= start_step[c]:
                engine.add_request(f"c{c}t{turn[c]}", {"prompt_token_ids": prompts[c]}, greedy(out_len))
                pending.add(c)
        if not pending:
            break
        for out in engine.step():
            if out.finished:
                c = int(out.request_id[1:].split("t")[0])
                results[out.request_id] = out.outputs[0].token_ids
                pending.discard(c)
                turn[c] += 1
                if turn[c] < len(convs[c]):
                    prompts[c] = prompts[c] + out.outputs[0].token_ids + convs[c][turn[c]]
        step += 1
        assert step < 5000
    return results


def make_convs(n_conv: int, n_turns: int, system: list[int], seed: int) -> list[list[list[int]]]:
    rng = random.Random(seed)
    return [[(system if t == 0 else []) + toks(rng.randrange(5, 40), seed * 100 + c * 10 + t) for t in range(n_turns)]
            for c in range(n_conv)]


def greedy(n: int) -> SamplingParams:
    """``n`` greedy tokens past eos, with the chosen token's log-probability."""
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1)


def run_key() -> tuple:
    """What a one-process run depends on besides its checkpoint and its arguments: the ``HYSERVE_*`` switches the
    engine reads as it runs and whether this process emulates CUDA graphs (``cuda_graphs.EMULATE``, read from
    ``HYSERVE_EMULATE_CUDA_GRAPHS`` at import: a test that sets the variable changes only its worker processes)."""
    from hyserve.worker import cuda_graphs

    switches = sorted((k, v) for k, v in os.environ.items()
                      if k.startswith("HYSERVE_") and k != "HYSERVE_EMULATE_CUDA_GRAPHS")
    return cuda_graphs.EMULATE, tuple(switches)

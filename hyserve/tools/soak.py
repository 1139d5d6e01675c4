"""``hyserve soak``: run a multi-turn agent workload with prefix caching and speculative decoding on, and check every
response for the silent corruption other engines show on hybrid models (constant-token loops, ``!!!!``, empty
output, all with a normal ``finish_reason``).

    hyserve soak                                   # the packaged default model (trained MTP head), every feature on
    hyserve soak MODEL_DIR --conversations 64 --turns 8 --concurrency 32 --prefix-len 1700 --max-tokens 64
    hyserve soak MODEL_DIR --url http://127.0.0.1:8000     # a running server; replay on a local clean engine
    hyserve soak --pipeline-parallel-size 2 --async-scheduling --concurrency 16 --abort-fraction 0.3

The workload (:mod:`hyserve.tools.workload`): ``--conversations`` conversations of ``--turns`` turns, all sharing a
``--prefix-len``-token system prefix, each turn's prompt = the previous prompt + the tokens actually generated + a
new message; ``--concurrency`` conversations in flight, closed loop; greedy (temperature 0), token-id prompts.
Offline it runs through ``LLMEngine.step()``; with ``--url`` through ``/v1/completions`` (one thread per
conversation in flight).

``--abort-fraction F`` (default 0: no aborts) has clients abandon a seeded random share F of the requests mid-flight
(:func:`hyserve.tools.workload.make_abort_plan`), each at one of three points drawn at random: before the engine
schedules any of it, mid-prefill (once part of its prompt is scheduled; before its first token) or mid-decode (once
the client holds some output tokens). Offline the driver calls ``LLMEngine.abort_request`` between two ``step()``
calls, 0 to 2 steps after the point is reached (as a client reacts after a while: by then a decoding request's next
step is scheduled): with async scheduling or pipeline parallelism the steps launched before are still in flight
then, some of them naming the aborted request, while the other ``--concurrency - 1`` conversations keep running and
the next turn takes the freed memory. With ``--url`` the client closes its connection (a plain request given up on
before the response, a stream closed before its first chunk or after some of them), so the server must abort the
request. An aborted request is counted and reported (by the point it reached, and how many the engine itself
aborted: a request given up on before it reached the engine, or that had finished there, is not one) and not
checked, its output being partial; its conversation goes on, the next turn's prompt built from the tokens received
(none before the first token). Every other request is checked as below, so that corruption of the others by the
aborts is found. A request that finishes before its abort point is reached is an ordinary one, checked.

Every response gets three checks:

1. **Degenerate output** (:mod:`hyserve.tools.detectors`): a token repeated to the end, a short cycle repeated to
   the end, a punctuation run, empty output with a normal finish reason.
2. **Replay**: every request not aborted (the same prompt ids) again on a separate engine with prefix caching and
   speculation off (and the default prefill budget); the first differing output position is reported. A divergence
   at a near-tie (the soak's token within ``--tol`` logprob of the replay's, per the replay's top-2 logprobs) is
   excused: another batch shape may flip such a tie without anything being wrong.
3. **Reference** (``--reference``; on by default for checkpoints under 50M parameters): one uncached float32
   transformers forward over prompt + output (teacher forcing); every output token must be within ``--tol`` logit
   units of the reference argmax.

A degenerate finding is *explained* (the model's own greedy behaviour, not corruption) when the replay produced the
identical output or the output passed the reference check; otherwise it counts. A request is corrupt when it has an
unexplained finding, an unexcused divergence or a reference failure; a request that errored counts too. The exit
code is 0 when no request is corrupt, 1 otherwise (2 for usage errors). ``--report PATH`` writes everything as
JSON: the configuration, the summary (the table's numbers) and one entry per request (an aborted one with where it
was aborted: ``abort``).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import logging
import os
import struct
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from hyserve.engine_args import engine_args, make_llm
from hyserve.tools import add_missing_defaults
from hyserve.tools.client import NO_TOKEN_IDS, Completion, CompletionsClient
from hyserve.tools.soak_checks import (
    ReferenceFn,
    RequestCheck,
    TurnRecord,
    check_requests,
    format_table,
    make_reference_check,
    summarize,
)
from hyserve.tools.workload import (
    AbortPoint,
    Conversation,
    WorkloadSpec,
    make_abort_plan,
    make_conversations,
)

if TYPE_CHECKING:
    from hyserve.llm import LLM

logger = logging.getLogger("hyserve.soak")

__all__ = ["RequestCheck", "TurnRecord", "build_llm", "check_requests", "format_table", "register", "run", "summarize"]

DEFAULT_MTP = {"method": "mtp", "num_speculative_tokens": 2}
DEFAULT_NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
REFERENCE_MAX_PARAMS = 50_000_000
TOL_FLOAT32 = 2e-3  # transformers' own float32 forward differs from float64 by up to 1.3e-3 on the tiny checkpoints
TOL_LOW_PRECISION = 0.25  # bf16/fp16 engines (or an unknown server dtype): near-ties flip at this scale
DEFAULT_VOCAB = 448  # the tiny tokenizer's ordinary ids; byte-level tokens in every Qwen vocabulary


class _Auto:
    """The value of a flag left to be decided once the checkpoint is known."""

    def __repr__(self) -> str:
        return "auto"


AUTO: Any = _Auto()


_METRIC_KEYS = ("hyserve:prefix_cache_hits", "hyserve:prefix_cache_queries", "hyserve:spec_decode_num_drafts",
                "hyserve:spec_decode_num_accepted_tokens", "hyserve:request_aborted")


def _scalar(m: dict[str, Any], key: str) -> float:
    v = m.get(key, 0.0)
    return float(v) if isinstance(v, (int, float)) else 0.0


def _metric_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict[str, float] | None:
    if before is None or after is None:
        return None
    return {k: _scalar(after, k) - _scalar(before, k) for k in _METRIC_KEYS if k in after}


def _completion_from_output(out: Any) -> Completion:
    c = out.outputs[0]
    top = None
    if c.logprobs is not None:
        top = [{tid: lp.logprob for tid, lp in entry.items()} for entry in c.logprobs]
    return Completion(list(c.token_ids), c.text, c.finish_reason, top, num_cached_tokens=out.num_cached_tokens)


def _request_id(conv: Conversation, turn: int) -> str:
    return f"soak-c{conv.conv_id}-t{turn}"


@dataclass(slots=True)
class _Live:
    """A soak request in the offline engine: its turn, prompt, abort point (if any) and the latest output."""

    conv: Conversation
    turn: int
    prompt: list[int]
    abort_at: AbortPoint | None
    latest: Completion | None = None
    reached_at: int | None = None  # the engine step count when its abort point was reached


def run_offline(llm: LLM, convs: Sequence[Conversation], concurrency: int, params: Any,
                bar: tqdm | None = None, aborts: Mapping[tuple[int, int], AbortPoint] | None = None
                ) -> list[TurnRecord]:
    """Drive the conversations closed-loop through ``llm.llm_engine.step()``, ``concurrency`` in flight; the requests
    named in ``aborts`` (``(conversation id, turn)`` -> point) are aborted between two steps when their point is
    reached, and their conversation goes on from the tokens received (see the module docstring)."""
    eng = llm.llm_engine
    aborts = aborts or {}
    todo = deque(convs)
    live: dict[str, _Live] = {}
    records: list[TurnRecord] = []
    steps = 0

    def submit(conv: Conversation, turn: int, prompt: list[int]) -> None:
        rid = _request_id(conv, turn)
        eng.add_request(rid, {"prompt_token_ids": prompt}, params)
        live[rid] = _Live(conv, turn, prompt, aborts.get((conv.conv_id, turn)))

    def done(rid: str, comp: Completion, abort: dict[str, Any] | None) -> None:
        r = live.pop(rid)
        records.append(TurnRecord(rid, r.conv.conv_id, r.turn, r.prompt, comp, r.abort_at, abort))
        if bar is not None:
            bar.update(1)
        if r.turn + 1 < r.conv.num_turns and comp.finish_reason != "error" and comp.token_ids is not None:
            submit(r.conv, r.turn + 1, r.conv.next_prompt(r.turn + 1, r.prompt, comp.token_ids))
        elif todo:
            nxt = todo.popleft()
            submit(nxt, 0, nxt.first_prompt())

    def abort_due() -> None:
        """Abort every live request whose point is reached (a new turn submitted here may be due at once)."""
        while True:
            for rid, r in live.items():
                if r.abort_at is not None and r.reached_at is None and _abort_reached(eng, rid, r):
                    r.reached_at = steps
            due = [(rid, r) for rid, r in live.items() if r.abort_at is not None and r.reached_at is not None
                   and (r.abort_at.phase == "queued" or steps - r.reached_at >= r.abort_at.lag_steps)]
            if not due:
                return
            for rid, r in due:
                abort = _abort_state(eng, rid, r)
                eng.abort_request(rid)
                got = r.latest or Completion([], "", None)
                done(rid, Completion(list(got.token_ids or []), got.text or "", "abort",
                                     num_cached_tokens=got.num_cached_tokens), abort)

    for _ in range(min(concurrency, len(todo))):
        conv = todo.popleft()
        submit(conv, 0, conv.first_prompt())
    abort_due()
    while live:
        if not eng.has_unfinished_requests():
            raise RuntimeError(f"the engine is idle with {len(live)} soak requests unfinished")
        outs = eng.step()
        steps += 1
        for out in outs:
            r = live.get(out.request_id)
            if r is None or not (out.finished or r.abort_at is not None):
                continue
            comp = _completion_from_output(out)
            if out.finished:
                done(out.request_id, comp, None)
            elif r.abort_at is not None:
                r.latest = comp
        abort_due()
    for _ in range(64):  # the steps of aborted requests still in flight: let them land (bounded: never hang here)
        if not eng.has_unfinished_requests():
            break
        eng.step()
    return records


def _abort_reached(eng: Any, rid: str, r: _Live) -> bool:
    point = r.abort_at
    assert point is not None
    if point.phase == "queued":
        return True
    received = len(r.latest.token_ids or []) if r.latest is not None else 0
    if point.phase == "decode":
        return received >= point.num_tokens
    # prefill: once that share of the prompt is scheduled (a prefix-cache hit counts), or past it already
    return received > 0 or _scheduled(eng, rid) >= max(1, int(point.prompt_fraction * len(r.prompt)))


def _scheduled(eng: Any, rid: str) -> int:
    """Tokens of ``rid`` computed or scheduled (in flight)."""
    req = eng.requests.get(rid)
    return 0 if req is None else int(req.num_computed_tokens + req.num_inflight_tokens)


def _abort_state(eng: Any, rid: str, r: _Live) -> dict[str, Any]:
    """Where ``rid`` stands as it is aborted: the point reached, and the engine's steps in flight."""
    received = len(r.latest.token_ids or []) if r.latest is not None else 0
    scheduled = _scheduled(eng, rid)
    in_flight = [step[0] for step in getattr(eng, "_in_flight", ())]
    return {"phase": "decode" if received else "prefill" if scheduled else "queued", "output_tokens": received,
            "prompt_scheduled": min(scheduled, len(r.prompt)), "steps_in_flight": len(in_flight),
            "steps_naming_it": sum(any(row.req_id == rid for row in getattr(so, "rows", ())) for so in in_flight)}


def run_server(client: CompletionsClient, convs: Sequence[Conversation], concurrency: int, *, max_tokens: int,
               ignore_eos: bool, bar: tqdm | None = None, aborts: Mapping[tuple[int, int], AbortPoint] | None = None
               ) -> list[TurnRecord]:
    """Drive the conversations through ``/v1/completions``: one thread per conversation in flight. The requests
    named in ``aborts`` are abandoned by their client (``CompletionsClient.abandon``): a ``"queued"`` point is a plain
    request given up on before the response, a ``"prefill"`` one a stream closed before its first chunk, a
    ``"decode"`` one a stream closed after ``num_tokens`` tokens."""
    aborts = aborts or {}
    lock = threading.Lock()
    records: list[TurnRecord] = []

    def run_conversation(conv: Conversation) -> None:
        prompt = conv.first_prompt()
        for turn in range(conv.num_turns):
            point = aborts.get((conv.conv_id, turn))
            abort: dict[str, Any] | None = None
            if point is None:
                comp = client.complete(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
            else:
                comp, abandoned = client.abandon(
                    prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos,
                    stream=point.phase != "queued", after_tokens=point.num_tokens if point.phase == "decode" else 0,
                    delay_s=point.delay_s)
                if abandoned:
                    n = len(comp.token_ids or [])
                    abort = {"phase": "decode" if n else point.phase, "output_tokens": n}
            with lock:
                records.append(TurnRecord(_request_id(conv, turn), conv.conv_id, turn, prompt, comp, point, abort))
                if bar is not None:
                    bar.update(1)
            if comp.error is not None or comp.token_ids is None or turn + 1 == conv.num_turns:
                return
            prompt = conv.next_prompt(turn + 1, prompt, comp.token_ids)

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        list(pool.map(run_conversation, convs))
    return records


def replay_offline(llm: LLM, records: Sequence[TurnRecord], params: Any) -> list[Completion]:
    outs = llm.generate([{"prompt_token_ids": r.prompt_ids} for r in records], params, use_tqdm=False)
    return [_completion_from_output(o) for o in outs]


def replay_server(client: CompletionsClient, records: Sequence[TurnRecord], concurrency: int, *, max_tokens: int,
                  ignore_eos: bool) -> list[Completion]:
    def one(r: TurnRecord) -> Completion:
        return client.complete(r.prompt_ids, max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos,
                               logprobs=2)

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(one, records))


def build_llm(args: argparse.Namespace, model: str, role: str) -> LLM:
    """The engine for ``role`` ``"main"`` (the soak's flags) or ``"replay"`` (the same flags with prefix caching
    and speculation off and the default prefill budget). Tests replace this to sabotage the main engine."""
    if role == "replay":
        args = copy.copy(args)
        args.enable_prefix_caching = False
        args.speculative_config = None
        args.max_num_batched_tokens = None
    return make_llm(args, model)


def _release_memory() -> None:
    """Collect a dropped engine (its caller deletes its last reference first) so that the next one fits."""
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # pragma: no cover
        pass


# ------------------------------------------------------------------------------------------------------ checkpoint


def checkpoint_tensors(model_dir: str) -> dict[str, list[int]]:
    """Tensor name -> shape for every safetensors file of a checkpoint, read from the headers only."""
    shapes: dict[str, list[int]] = {}
    for name in sorted(os.listdir(model_dir)):
        if not name.endswith(".safetensors"):
            continue
        with open(os.path.join(model_dir, name), "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        shapes.update({k: list(v["shape"]) for k, v in header.items() if k != "__metadata__"})
    return shapes


def num_params(model_dir: str) -> int:
    """Parameters of the text model and MTP head (a vision tower is not counted)."""
    total = 0
    for name, shape in checkpoint_tensors(model_dir).items():
        if ".visual." in name or name.startswith("visual."):
            continue
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def ordinary_vocab(model_dir: str | None) -> int:
    """Token ids that are safe in a random prompt: the tokenizer's vocabulary without its added tokens."""
    if model_dir is None:
        return DEFAULT_VOCAB
    from hyserve.model.registry import load_model_config
    from hyserve.tokenizer import Tokenizer

    vocab = load_model_config(model_dir).vocab_size
    try:
        tok = Tokenizer.from_model_dir(model_dir)
        return min(vocab, int(tok.hf_tokenizer.backend_tokenizer.get_vocab_size(with_added_tokens=False)))
    except FileNotFoundError:
        return min(vocab, DEFAULT_VOCAB)


def _has_mtp(model_dir: str) -> bool:
    from hyserve.model.registry import load_model_config

    return load_model_config(model_dir).mtp_num_hidden_layers >= 1 and any(
        k.startswith("mtp.") for k in checkpoint_tensors(model_dir))


# ------------------------------------------------------------------------------------------------------ command


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``hyserve soak`` to a ``hyserve`` sub-command parser set."""
    p = subparsers.add_parser(
        "soak", help="corruption soak: prefix caching + speculation on multi-turn agent traffic, every response "
                     "checked", description=(__doc__ or "").replace("``", "").replace(":mod:", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint directory (default: the packaged default model, hyserve/default_model; a "
                        "tiny random checkpoint with an MTP head if the package lacks it)")
    p.add_argument("--url", default=None,
                   help="soak a running server at this base URL, e.g. http://127.0.0.1:8000 (default: none, the "
                        "offline engine)")
    p.add_argument("--served-model-name", default=None,
                   help="--url: the model name to send (default: the first one /v1/models lists)")
    p.add_argument("--replay-url", default=None,
                   help="--url: replay on this server, started with prefix caching and speculation off (default: "
                        "none: replay on a local engine built from MODEL_DIR with the engine flags)")
    p.add_argument("--conversations", type=int, default=8, help="agent conversations (default: 8)")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation (default: 4)")
    p.add_argument("--concurrency", type=int, default=4, help="conversations in flight (default: 4)")
    p.add_argument("--prefix-len", type=int, default=100, help="shared system prefix, in tokens (default: 100)")
    p.add_argument("--message-len", type=int, default=24,
                   help="mean new message per turn, in tokens; the first is twice as long (default: 24)")
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens per turn (default: 16)")
    p.add_argument("--abort-fraction", type=float, default=0.0, metavar="F",
                   help="share of the requests their client abandons mid-flight (offline: LLMEngine.abort_request; "
                        "--url: the connection closed), before scheduling, mid-prefill or mid-decode at random; "
                        "seeded by --workload-seed; aborted requests are counted, not checked (default: 0)")
    p.add_argument("--ignore-eos", action="store_true", help="generate --max-tokens every turn (default: off)")
    p.add_argument("--workload-seed", type=int, default=0, help="seed of the workload's token ids (default: 0)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="draw prompt ids from [0, N) (default: the tokenizer's ordinary vocabulary; 448 without "
                        "MODEL_DIR)")
    p.add_argument("--replay", action=argparse.BooleanOptionalAction, default=True,
                   help="replay every request on a clean engine and compare (default: on)")
    p.add_argument("--reference", action=argparse.BooleanOptionalAction, default=None,
                   help="teacher-forced check against transformers (default: on for checkpoints under 50M "
                        "parameters)")
    p.add_argument("--tol", type=float, default=None,
                   help="logit-gap tolerance for the reference check and for excusing a replay divergence at a "
                        f"near-tie (default: {TOL_FLOAT32} for a float32 engine, {TOL_LOW_PRECISION} otherwise)")
    p.add_argument("--loop-min-run", type=int, default=8,
                   help="detector: a loop or cycle covers at least this many tokens (default: 8)")
    p.add_argument("--loop-min-fraction", type=float, default=0.5,
                   help="detector: ... and at least this share of the output (default: 0.5)")
    p.add_argument("--punctuation-min-run", type=int, default=8,
                   help="detector: a punctuation run has at least this many characters (default: 8)")
    p.add_argument("--report", default=None, help="write the JSON report here (default: none)")
    p.add_argument("--timeout", type=float, default=600.0, help="--url: seconds per HTTP request (default: 600)")
    engine_args(p)
    for action in p._actions:
        if action.dest == "speculative_config":
            action.default = AUTO
            action.help = (f"JSON (default: {json.dumps(DEFAULT_MTP)} when the checkpoint has MTP weights, else "
                           f"n-gram with k=2; 'null' turns speculation off)").replace("%", "%%")
        elif action.dest == "max_num_batched_tokens":
            action.default = AUTO
            action.help = ("token budget per step (default: half the shared prefix, 32 to 2048, so that every "
                           "prompt is prefilled in chunks)")
        elif action.dest == "recurrent_snapshot_interval":
            action.default = AUTO
            action.help = ("prefix caching: also snapshot recurrent state every N tokens (default: half the shared "
                           "prefix rounded down to a block, 1 block to 2048, so that snapshots also fall inside "
                           "outputs and accepted drafts)")
    add_missing_defaults(p)
    p.set_defaults(func=run)


def _resolve_engine_defaults(args: argparse.Namespace, model: str) -> None:
    if args.speculative_config is AUTO:
        args.speculative_config = dict(DEFAULT_MTP) if _has_mtp(model) else dict(DEFAULT_NGRAM)
    if args.max_num_batched_tokens is AUTO:
        args.max_num_batched_tokens = max(32, min(2048, args.prefix_len // 2))
    if args.recurrent_snapshot_interval is AUTO:
        bs = args.block_size
        args.recurrent_snapshot_interval = max(bs, min(2048, (args.prefix_len // 2) // bs * bs))


def _validate(args: argparse.Namespace) -> None:
    for name in ("conversations", "turns", "concurrency", "prefix_len", "message_len", "max_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)})")
    if args.url is None and args.replay_url is not None:
        raise ValueError("--replay-url only applies with --url")
    if not 0.0 <= args.abort_fraction <= 1.0:
        raise ValueError(f"--abort-fraction must be in [0, 1] (got {args.abort_fraction})")


def run(args: argparse.Namespace) -> int:
    """``hyserve soak``: 0 when no request is corrupt, 1 otherwise."""
    _validate(args)
    spec = WorkloadSpec(num_conversations=args.conversations, turns=args.turns, prefix_len=args.prefix_len,
                        message_len=args.message_len, max_tokens=args.max_tokens,
                        abort_fraction=args.abort_fraction)
    if args.model is None and args.url is None:
        from hyserve.llm import DEFAULT_MODEL_DIR

        if os.path.isfile(os.path.join(DEFAULT_MODEL_DIR, "config.json")):
            # The packaged model has a trained MTP head: drafts are accepted (~2 tokens per step), so the soak
            # exercises accepted drafts, rejected ones and prefix hits together, as in the field.
            print(f"# soaking the packaged default model {DEFAULT_MODEL_DIR}", file=sys.stderr)
            return _run(args, spec, DEFAULT_MODEL_DIR)
        from hyserve.testing import write_tiny_checkpoint

        with tempfile.TemporaryDirectory(prefix="hyserve-soak-") as d:
            max_pos = max(4096, -(-(spec.max_total_len() + 64) // 256) * 256)
            path = write_tiny_checkpoint(d, with_mtp=True, seed=args.seed, max_position_embeddings=max_pos)
            print(f"# wrote a tiny random-weight Qwen3.5 checkpoint with an MTP head to {path}", file=sys.stderr)
            return _run(args, spec, path)
    return _run(args, spec, args.model)


def _run(args: argparse.Namespace, spec: WorkloadSpec, model: str | None) -> int:
    from hyserve.sampling_params import SamplingParams

    t_start = time.perf_counter()
    if model is not None:
        _resolve_engine_defaults(args, model)
    vocab = args.vocab_size or ordinary_vocab(model)
    convs = make_conversations(spec, seed=args.workload_seed, vocab_size=vocab)
    aborts = make_abort_plan(spec, seed=args.workload_seed)
    params = SamplingParams(temperature=0.0, max_tokens=spec.max_tokens, ignore_eos=args.ignore_eos)
    replay_params = SamplingParams(temperature=0.0, max_tokens=spec.max_tokens, ignore_eos=args.ignore_eos,
                                   logprobs=2)
    total = spec.num_conversations * spec.turns
    engine_dtype: str | None = None
    metrics: dict[str, float] | None
    config: dict[str, Any] = {"model": model, "url": args.url, "workload": asdict(spec), "vocab_size": vocab,
                              "concurrency": args.concurrency, "ignore_eos": args.ignore_eos,
                              "workload_seed": args.workload_seed}
    bar = tqdm(total=total, desc="soak", unit="req", disable=None)
    try:
        if args.url is None:
            assert model is not None
            llm = build_llm(args, model, "main")
            engine_dtype = str(llm.llm_engine.dtype).removeprefix("torch.")
            limit = llm.llm_engine.max_model_len
            if spec.max_total_len() > limit:
                raise ValueError(f"the workload's longest sequence may reach {spec.max_total_len()} tokens, more than "
                                 f"max_model_len={limit}: lower --prefix-len, --message-len, --turns or --max-tokens")
            config.update(enable_prefix_caching=args.enable_prefix_caching,
                          speculative_config=args.speculative_config,
                          max_num_batched_tokens=llm.llm_engine.max_num_batched_tokens,
                          recurrent_snapshot_interval=args.recurrent_snapshot_interval, dtype=engine_dtype)
            before = llm.get_metrics()
            records = run_offline(llm, convs, args.concurrency, params, bar, aborts)
            metrics = _metric_delta(before, llm.get_metrics())
            del llm
            _release_memory()
        else:
            client = CompletionsClient(args.url, args.served_model_name, timeout_s=args.timeout,
                                       max_connections=max(args.concurrency, 8))
            before_m = client.metrics()
            records = run_server(client, convs, args.concurrency, max_tokens=spec.max_tokens,
                                 ignore_eos=args.ignore_eos, bar=bar, aborts=aborts)
            metrics = _metric_delta(before_m, client.metrics())
            config["served_model_name"] = client.model
            client.close()
            if any(r.completion.error == NO_TOKEN_IDS for r in records):
                raise ValueError(f"{args.url}: {NO_TOKEN_IDS}")
    finally:
        bar.close()
    records.sort(key=lambda r: (r.conv_id, r.turn))
    run_s = time.perf_counter() - t_start

    replays: list[Completion | None] | None = None
    # Aborted requests are not replayed (not checked), nor are those that errored (counted as errors, not compared):
    # a prompt the server refused (a 400) would stop the replay engine with the same error.
    def replayable(r: TurnRecord) -> bool:
        return r.abort is None and r.completion.error is None and r.completion.token_ids is not None

    finished = [r for r in records if replayable(r)]
    if args.replay:
        done: list[Completion] | None = None
        if args.replay_url is not None:
            rc = CompletionsClient(args.replay_url, args.served_model_name, timeout_s=args.timeout,
                                   max_connections=max(args.concurrency, 8))
            done = replay_server(rc, finished, args.concurrency, max_tokens=spec.max_tokens,
                                 ignore_eos=args.ignore_eos)
            rc.close()
        elif model is not None:
            clean = build_llm(args, model, "replay")
            engine_dtype = engine_dtype or str(clean.llm_engine.dtype).removeprefix("torch.")
            done = replay_offline(clean, finished, replay_params) if finished else []
            del clean
            _release_memory()
        else:
            logger.warning("no MODEL_DIR and no --replay-url: requests are not replayed, so any degenerate output "
                           "counts as corruption")
        if done is not None:
            it = iter(done)
            replays = [next(it) if replayable(r) else None for r in records]
    tol = args.tol if args.tol is not None else (TOL_FLOAT32 if engine_dtype == "float32" else TOL_LOW_PRECISION)

    reference: ReferenceFn | None = None
    want_ref = args.reference
    if model is not None and want_ref is None:
        n = num_params(model)
        want_ref = n < REFERENCE_MAX_PARAMS
        config["num_params"] = n
    if want_ref:
        if model is None:
            raise ValueError("--reference needs MODEL_DIR (transformers loads the checkpoint locally)")
        reference = make_reference_check(model, tol)

    detector_kwargs = {"min_run": args.loop_min_run, "min_fraction": args.loop_min_fraction,
                       "min_punctuation_run": args.punctuation_min_run}
    checks = check_requests(records, replays, reference, tol=tol, detector_kwargs=detector_kwargs)
    summary = summarize(checks, metrics)
    config.update(tol=tol, reference=bool(reference), replay=replays is not None, detectors=detector_kwargs)
    summary["run_seconds"] = round(run_s, 3)
    summary["total_seconds"] = round(time.perf_counter() - t_start, 3)

    _print_result(config, summary, checks, total)
    if args.report:
        report = {"config": config, "summary": summary, "requests": [c.to_json() for c in checks]}
        with open(args.report, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2, ensure_ascii=False)
            f.write("\n")
        print(f"# report written to {args.report}")
    return 0 if summary["ok"] else 1


def _print_result(config: dict[str, Any], summary: dict[str, Any], checks: Sequence[RequestCheck], total: int) -> None:
    where = config["url"] or "offline engine"
    spec = config.get("speculative_config")
    features = []
    if config["url"] is None:
        features.append(f"prefix caching {'on' if config.get('enable_prefix_caching') else 'off'}")
        features.append(f"speculation {json.dumps(spec) if spec else 'off'}")
        features.append(f"max_num_batched_tokens {config.get('max_num_batched_tokens')}")
        features.append(f"snapshot interval {config.get('recurrent_snapshot_interval')}")
    print(f"hyserve soak: {summary['requests']} of {total} requests on the {where}"
          + (f" ({', '.join(features)})" if features else "") + f" in {summary['run_seconds']:.1f} s")
    print(format_table(summary))
    bad = [c for c in checks if c.corrupt]
    for c in bad[:20]:
        parts = [f"{c.record.request_id}: {', '.join(c.reasons)}"]
        if c.record.completion.error:
            parts.append(c.record.completion.error)
        if c.divergence is not None and "divergence" in c.reasons:
            parts.append(f"first differs from the replay at output position {c.divergence}")
        if c.reference is not None and not c.reference["ok"]:
            r = c.reference
            parts.append(f"reference: token {r['token']} at {r['position']}, argmax {r['reference_token']}, "
                         f"gap {r['gap']:.3g}")
        parts += c.findings[:2]
        print("  " + "; ".join(parts))
    if len(bad) > 20:
        print(f"  ... and {len(bad) - 20} more (see --report)")

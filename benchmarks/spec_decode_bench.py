"""Speculative decoding throughput at controlled acceptance rates.

A test-only proposer knows each request's greedy continuation (from a run without speculation) and proposes it
with each draft token replaced by a wrong one with probability 1 - rate, so acceptance is controlled (0 %, 50 %,
90 %) whatever the weights. With ``--method mtp`` (the default when the checkpoint has ``mtp.*`` weights) the
MTP head still drafts every step, so its cost is in the timing, and the controlled tokens replace its drafts.
Decode tokens/s at batch 1 and 32 (only steps in which every row decodes are timed), against the same engine
without speculation, in the same run; greedy outputs must be identical.

    python benchmarks/spec_decode_bench.py --out benchmarks/results            # tiny model, CPU
    python benchmarks/shapes.py --shape 2b --mtp --out /tmp/m2b                                      # H200
    python benchmarks/spec_decode_bench.py --model /tmp/m2b --device cuda --dtype bfloat16 --out $OUT

A shape written config-only (``shapes.py --shape 35b-a3b --config-only``) runs with ``--load-format dummy``: both
engines of a run (plain and speculative) make the same seeded random weights and MTP head at load, so the plain
run's greedy continuation is what the speculative run's target computes, up to rounding (random weights leave
near-ties; where the two runs part, the drafts planted from the plain run stop matching and the acceptance reached
falls below the planted rate: ``draft_acceptance`` and ``outputs_identical`` say so). ``--shared-engines`` builds one
plain engine for every batch and one speculative engine per rate (a large shape's start is a minute or more).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hyserve import LLM, SamplingParams
from hyserve.request import Request
from hyserve.speculative.proposer import Proposer
from hyserve.testing import write_tiny_checkpoint


class ControlledProposer(Proposer):
    def __init__(self, continuations: dict[str, list[int]], rate: float, vocab: int, seed: int = 0) -> None:
        self.continuations = continuations
        self.rate = rate
        self.vocab = vocab
        self.rng = random.Random(seed)

    def propose(self, requests: list[Request], num_tokens: list[int]) -> list[list[int]]:
        out = []
        for req, k in zip(requests, num_tokens, strict=True):
            cont = self.continuations.get(req.request_id)
            if cont is None:  # a warm-up request: any k tokens (verify rows of full length compile the kernels)
                out.append([(req.num_tokens + j) % self.vocab for j in range(k)])
                continue
            right = cont[req.num_output_tokens : req.num_output_tokens + k]
            out.append([t if self.rng.random() < self.rate else (t + 1) % self.vocab for t in right])
        return out


def control(llm: LLM, proposer: ControlledProposer) -> None:
    """Make ``llm``'s drafts the controlled ones: replace its MTP head's drafts (the head still runs), or its
    n-gram proposer."""
    eng = llm.llm_engine
    if not eng.use_mtp:
        eng.proposer = proposer
        return
    assert eng.drafts is not None
    mtp_propose = eng.drafts.propose

    def propose(req: Request, proposal: list[int], max_model_len: int) -> list[int]:
        drafts = mtp_propose(req, proposal, max_model_len)
        return proposer.propose([req], [len(drafts)])[0] if drafts else []

    eng.drafts.propose = propose  # type: ignore[method-assign]


def control_on_device(llm: LLM, proposer: ControlledProposer, prompt_lens: dict[str, int]) -> None:
    """The controlled drafts for verify rows scheduled behind one in flight too, which read their drafts on the
    device (``draft_slots``) without the host seeing them: after each step is enqueued, each of its rows' drafts
    row is overwritten on the device from a table of the controlled continuation (each token replaced by a wrong
    one with probability 1 - rate, drawn once), at the position its acceptance left there. No host wait."""
    eng = llm.llm_engine
    runner = eng.runner
    verifier = runner.verifier
    if verifier is None or verifier.draft_slots is None or not eng.scheduler.async_verify:
        return
    k = runner.num_speculative_tokens
    ids = sorted(proposer.continuations)
    width = max(len(c) for c in proposer.continuations.values()) + 2 * k + 2
    table = torch.zeros((len(ids) + 1, width), dtype=torch.long)  # the last row: requests not controlled
    for n, rid in enumerate(ids):
        cont = proposer.continuations[rid]
        table[n, : len(cont)] = torch.tensor([t if proposer.rng.random() < proposer.rate else (t + 1) % proposer.vocab
                                              for t in cont])
    table = table.to(runner.device)
    index = {rid: n for n, rid in enumerate(ids)}
    execute = runner.execute_model_async
    j = torch.arange(k, device=runner.device)

    def execute_and_plant(so: Any) -> Any:
        handle = execute(so)
        rows = [r for r in so.rows if r.samples and r.req_id in index]
        if rows and verifier.verify_next_start is not None:
            slots = torch.tensor([r.state_slot for r in rows], dtype=torch.long).to(runner.device, non_blocking=True)
            meta = torch.tensor([[index[r.req_id], prompt_lens[r.req_id], int(r.is_verify), r.end]
                                 for r in rows], dtype=torch.long).to(runner.device, non_blocking=True)
            # The next row's first position: where the acceptance put it (verify rows), else the row's end.
            start = torch.where(meta[:, 2] == 1, verifier.verify_next_start.index_select(0, slots), meta[:, 3])
            col = (start + 1 - meta[:, 1]).unsqueeze(1) + j  # the drafts' output indices
            verifier.draft_slots.index_copy_(0, slots, table[meta[:, 0].unsqueeze(1), col.clamp(0, width - 1)])
        return handle

    runner.execute_model_async = execute_and_plant  # type: ignore[method-assign]


def has_mtp(model: str) -> bool:
    with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    return bool(cfg.get("mtp_num_hidden_layers") or cfg.get("text_config", {}).get("mtp_num_hidden_layers"))


def run_all(llm: LLM, prompts: dict[str, list[int]], params: SamplingParams) -> dict[str, Any]:
    eng = llm.llm_engine
    for rid, p in prompts.items():
        eng.add_request(rid, {"prompt_token_ids": p}, params)
    outs: dict[str, Any] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0]
    return outs


def warm_up(llm: LLM, prompts: dict[str, list[int]]) -> None:
    """Compile every kernel the timed run uses (Triton JIT) outside the timing: the same batch, a few tokens. The
    warm-up's drafts are not the controlled ones: the speculation-length policy forgets the acceptance they showed
    (its step times stay, measured past the compiles)."""
    run_all(llm, {f"warm-{rid}": p for rid, p in prompts.items()},
            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    drafts = llm.llm_engine.drafts
    if drafts is not None:
        drafts.policy.reset_acceptance()


def first_divergence(want: list[int], got: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), None)


def diagnose(common: dict[str, Any], spec: dict[str, Any], prompt: list[int], n: int, rate: float,
             vocab: int) -> dict[str, Any]:
    """Where a speculative run's greedy output leaves the plain one: the plain run's top-2 logprob margin there,
    and both runs' logprobs of both tokens. A margin that is small next to the logprob change says the two
    (mathematically equal) paths differ by rounding, not by a wrong state."""
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2)
    base = LLM(**common)
    ref = run_all(base, {"d": prompt}, params)["d"]
    del base
    release()
    llm = LLM(**common, speculative_config=spec)
    control(llm, ControlledProposer({"d": ref.token_ids}, rate, vocab))  # the plain greedy continuation
    out = run_all(llm, {"d": prompt}, params)["d"]
    del llm
    release()
    i = first_divergence(ref.token_ids, out.token_ids)
    if i is None:
        return {"diverges_at": None}
    a, b = ref.token_ids[i], out.token_ids[i]
    lp_ref = {t: v.logprob for t, v in ref.logprobs[i].items()}
    lp_out = {t: v.logprob for t, v in out.logprobs[i].items()}
    top = sorted(lp_ref.values(), reverse=True)
    return {"diverges_at": i, "plain_token": a, "spec_token": b,
            "plain_top2_margin": top[0] - top[1] if len(top) > 1 else None,
            "plain_logprobs": {str(t): v for t, v in lp_ref.items()},
            "spec_logprobs": {str(t): v for t, v in lp_out.items()},
            "max_logprob_change_before": max((abs(ref.logprobs[j][ref.token_ids[j]].logprob
                                                  - out.logprobs[j][ref.token_ids[j]].logprob)
                                              for j in range(i)), default=0.0)}


def timed_decode(llm: LLM, prompts: dict[str, list[int]], n: int, sync: bool) -> tuple[float, dict[str, list[int]]]:
    eng = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    for rid, p in prompts.items():
        eng.add_request(rid, {"prompt_token_ids": p}, params)
    tokens = 0
    seconds = 0.0
    outs: dict[str, list[int]] = {}
    shown: dict[str, int] = {}  # output tokens of each request seen so far (a step may return an earlier one's)
    while eng.has_unfinished_requests():
        decoding = not eng.scheduler.waiting and all(r.is_decoding for r in eng.scheduler.running)
        if sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step = eng.step()
        if sync:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        for o in step:
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
        new = 0
        for o in step:
            n = len(o.outputs[0].token_ids)
            new += n - shown.get(o.request_id, 0)
            shown[o.request_id] = n
        if decoding:
            tokens += new
            seconds += dt
    return tokens / max(seconds, 1e-9), outs


def steps_per_k(llm: LLM) -> list[int]:
    """Steps with verify rows so far, by their speculation length (``hyserve:spec_decode_steps_per_k``)."""
    per_k = llm.get_metrics().get("hyserve:spec_decode_steps_per_k", [])
    return [int(x) for x in per_k] if isinstance(per_k, list) else []


def k_histogram(before: list[int], after: list[int]) -> dict[str, int]:
    """The steps at each k_step between two ``steps_per_k`` readings (k as a string: a JSON key)."""
    return {str(k): n - (before[k] if k < len(before) else 0) for k, n in enumerate(after)
            if n - (before[k] if k < len(before) else 0)}


def spec_counts(llm: LLM) -> tuple[int, int, int]:
    m = llm.get_metrics()
    return tuple(int(m[f"hyserve:spec_decode_num_{k}"]) for k in ("drafts", "draft_tokens", "accepted_tokens"))  # type: ignore[return-value,arg-type]


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def plot(runs: list[tuple[str, list[dict[str, Any]]]], path: str, title: str) -> bool:
    """Speedup over plain decoding against the drafts actually accepted, one line per (run, batch). False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for label, rows in runs:
        for batch in sorted({r["batch"] for r in rows}):
            pts = sorted((r["draft_acceptance"] * 100, r["speedup"]) for r in rows if r["batch"] == batch)
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=f"{label}, batch {batch}")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("draft tokens accepted (%)")
    ax.set_ylabel("decode tokens/s vs no speculation")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def controlled_engine(args: argparse.Namespace, common: dict[str, Any], spec: dict[str, Any],
                      want: dict[str, list[int]], rate: float, vocab: int,
                      prompt_lens: dict[str, int]) -> LLM:
    """A speculative engine whose drafts are the known outputs ``want``, each token wrong with probability
    ``1 - rate`` (host and device drafts alike), with the command line's verify-path switches."""
    if args.synthetic:
        spec = synthetic_spec(spec, rate)
    llm = LLM(**common, speculative_config=spec)
    llm.llm_engine.runner.verifier.use_device_chain = not args.no_device_chain
    llm.llm_engine.scheduler.async_verify &= not args.no_rows_behind
    if args.synthetic:
        return llm
    proposer = ControlledProposer(want, rate, vocab)
    control(llm, proposer)
    control_on_device(llm, proposer, prompt_lens)
    return llm


def synthetic_spec(spec: dict[str, Any], rate: float) -> dict[str, Any]:
    """``--synthetic``: ``spec`` with vLLM's synthetic rejection sampling (``rejection_sample_method: "synthetic"``,
    ``hyserve.speculative.config``): each draft token's verdict drawn, true with probability ``rate`` and the walk
    ending at the first false, so drafts 1 .. i are all kept with probability ``rate ** i`` (drawn on the device,
    inside the verify graphs). The drafts are the MTP head's own, so the outputs are not the model's greedy ones;
    the timing is the engine's at that acceptance, as vLLM's synthetic method measures its own."""
    k = spec["num_speculative_tokens"]
    return {**spec, "rejection_sample_method": "synthetic",
            "synthetic_acceptance_rates": [rate ** (i + 1) for i in range(k)]}


def row(batch: int, rate: float, k: int, counts: tuple[int, int, int], tps: float, base_tps: float,
        identical: bool | None, k_steps: dict[str, int] | None = None) -> dict[str, Any]:
    """One table row; ``identical`` None where outputs are not comparable (``--synthetic``); ``k_steps``: the timed
    run's steps by their speculation length k_step."""
    drafts, draft_tokens, accepted = counts
    return {"batch": batch, "acceptance_target": rate, "k": k, "draft_acceptance": accepted / max(draft_tokens, 1),
            "mean_tokens_per_step": 1 + accepted / max(drafts, 1), "decode_tok_s": tps, "no_spec_tok_s": base_tps,
            "speedup": tps / base_tps, "outputs_identical": identical, "k_steps": k_steps or {}}


def shared_engine_rows(args: argparse.Namespace, common: dict[str, Any], spec: dict[str, Any], sync: bool,
                       batches: list[int], rates: list[float]) -> tuple[list[dict[str, Any]], int]:
    """``--shared-engines``: one plain engine times every batch (its greedy continuations kept under request ids
    ``b{batch}-r{i}``), then one speculative engine per rate times every batch with the drafts planted from them."""
    base = LLM(**common)
    vocab = base.llm_engine.model_config.vocab_size
    prompts: dict[int, dict[str, list[int]]] = {}
    for batch in batches:
        rng = random.Random(batch)  # the prompts of the per-batch engines (``r0`` is the diagnosis prompt)
        prompts[batch] = {f"b{batch}-r{i}": [rng.randrange(vocab) for _ in range(args.prompt_len)]
                          for i in range(batch)}
    base_tps: dict[int, float] = {}
    want: dict[str, list[int]] = {}
    for batch in batches:
        warm_up(base, prompts[batch])
        base_tps[batch], outs = timed_decode(base, prompts[batch], args.max_tokens, sync)
        want.update(outs)
    base.shutdown()  # a 35B shape's weights take most of the card: freed before the next engine is built
    del base
    release()
    lens = {rid: len(p) for ps in prompts.values() for rid, p in ps.items()}
    rows = []
    for rate in rates:
        llm = controlled_engine(args, common, spec, want, rate, vocab, lens)
        for batch in batches:
            warm_up(llm, prompts[batch])
            m0, h0 = spec_counts(llm), steps_per_k(llm)
            tps, got = timed_decode(llm, prompts[batch], args.max_tokens, sync)
            counts = tuple(b - a for a, b in zip(m0, spec_counts(llm), strict=True))
            same = None if args.synthetic else got == {rid: want[rid] for rid in prompts[batch]}
            rows.append(row(batch, rate, args.k, counts, tps, base_tps[batch], same,  # type: ignore[arg-type]
                            k_histogram(h0, steps_per_k(llm))))
            print(json.dumps(rows[-1]), flush=True)
        llm.shutdown()
        del llm
        release()
    return rows, vocab


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--rates", default="0,0.5,0.8,0.9", help="planted draft-token correctness rates")
    ap.add_argument("--sync-steps", action="store_true",
                    help="synchronize the device around every step (default: time the steps as they run, async "
                         "scheduling overlapping them, which is what a user sees)")
    ap.add_argument("--no-device-chain", action="store_true",
                    help="MTP: wait for the accepted counts on the host before the commit and the drafting (the path "
                         "before verify steps were enqueued whole), to compare the two")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="async scheduling on the CPU too (on CUDA it is on by default)")
    ap.add_argument("--no-rows-behind", action="store_true",
                    help="MTP under async scheduling: a verify row waits for the accepted count of its request's "
                         "row in flight (the path before rows were scheduled behind rows in flight)")
    ap.add_argument("--method", choices=("auto", "mtp", "ngram"), default="auto",
                    help="auto: mtp when the checkpoint has mtp.* weights, else ngram")
    ap.add_argument("--load-format", choices=("auto", "safetensors", "dummy"), default="auto",
                    help="dummy: seeded random weights (and MTP head) from config.json alone, the same in every "
                         "engine of the run (a shapes.py --config-only model)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5,
                    help="CUDA: the engines' memory share (0.5 leaves room for a late free; a 35B shape needs more)")
    ap.add_argument("--shared-engines", action="store_true",
                    help="one plain engine for all batches, one speculative engine per rate (request ids carry the "
                         "batch), instead of fresh engines for each batch")
    ap.add_argument("--synthetic", action="store_true",
                    help="draw each draft token's verdict (accepted w.p. the rate) instead of planting drafts: for "
                         "random weights, where the speculative run's greedy output parts from the plain one and "
                         "planted drafts stop matching (the outputs are then not compared)")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="both engines with prefix caching on (its bookkeeping and state snapshots; random prompts)")
    ap.add_argument("--adaptive", choices=("off", "on", "default"), default="off",
                    help="the speculation length per step (speculative_config's \"adaptive\"): off = every step "
                         "verifies k (the fixed-k measurements), on = chosen per step by the batch size and the "
                         "acceptance, default = the engine's default on the device (on for CUDA); each row reports "
                         "the timed steps by k (k_steps)")
    ap.add_argument("--no-diagnosis", action="store_true",
                    help="where outputs differ, skip the batch-1 diagnosis (two more engine starts)")
    return ap


def main() -> int:
    args = build_parser().parse_args()
    torch.set_num_threads(1) if args.device == "cpu" else None
    model = args.model or write_tiny_checkpoint(tempfile.mkdtemp(), max_position_embeddings=8192, with_mtp=True)
    method = args.method if args.method != "auto" else ("mtp" if has_mtp(model) else "ngram")
    spec: dict[str, Any] = {"method": method, "num_speculative_tokens": args.k}
    if args.adaptive != "default":
        spec["adaptive"] = args.adaptive == "on"
    sync = args.device == "cuda" and args.sync_steps
    common: dict[str, Any] = dict(model=model, device=args.device, dtype=args.dtype,
                                  enable_prefix_caching=args.prefix_caching,
                                  max_num_seqs=64, max_model_len=args.prompt_len + args.max_tokens + 64)
    if args.async_scheduling:
        common["async_scheduling"] = True
    if args.load_format != "auto":
        common["load_format"] = args.load_format
    if args.device == "cuda":
        common["gpu_memory_utilization"] = args.gpu_memory_utilization  # the KV these runs need is tiny
    else:
        common["cpu_cache_memory_bytes"] = 1 << 30  # 64 sequences' verify scratch on wider models
    batches = [int(b) for b in args.batches.split(",")]
    rates = [float(r) for r in args.rates.split(",")]
    if args.shared_engines:
        rows, vocab = shared_engine_rows(args, common, spec, sync, batches, rates)
    else:
        rows, vocab = [], 0
    for batch in [] if args.shared_engines else batches:
        rng = random.Random(batch)
        base = LLM(**common)
        vocab = base.llm_engine.model_config.vocab_size
        prompts = {f"r{i}": [rng.randrange(vocab) for _ in range(args.prompt_len)] for i in range(batch)}
        warm_up(base, prompts)
        base_tps, want = timed_decode(base, prompts, args.max_tokens, sync)
        del base
        release()
        for rate in rates:
            llm = controlled_engine(args, common, spec, want, rate, vocab,
                                  {rid: len(p) for rid, p in prompts.items()})
            warm_up(llm, prompts)
            m0, h0 = spec_counts(llm), steps_per_k(llm)
            tps, got = timed_decode(llm, prompts, args.max_tokens, sync)
            counts = tuple(b - a for a, b in zip(m0, spec_counts(llm), strict=True))
            rows.append(row(batch, rate, args.k, counts, tps, base_tps,  # type: ignore[arg-type]
                            None if args.synthetic else got == want, k_histogram(h0, steps_per_k(llm))))
            print(json.dumps(rows[-1]), flush=True)
            del llm
            release()
    diagnosis = None
    bad = next((r for r in rows if r["outputs_identical"] is False), None)
    if bad is not None and not args.no_diagnosis:
        rng = random.Random(bad["batch"])
        prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
        try:
            diagnosis = diagnose(common, spec, prompt, args.max_tokens, bad["acceptance_target"], vocab)
        except Exception as e:  # the table above is the result; a failed diagnosis must not lose it
            diagnosis = {"error": repr(e)}
        print("diagnosis (batch 1):", json.dumps(diagnosis), flush=True)
    os.makedirs(args.out, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu (2 cores)",
            "synchronized_steps": sync, "device_chain": not args.no_device_chain,
            "rows_behind": not args.no_rows_behind, "torch": torch.__version__,
            "acceptance": "synthetic (drawn verdicts)" if args.synthetic else "planted drafts",
            "model": model, "method": method, "adaptive": args.adaptive, "dtype": args.dtype,
            "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens, "load_format": args.load_format, "shared_engines": args.shared_engines,
            "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d")}
    with open(os.path.join(args.out, "spec_decode.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows, "diagnosis": diagnosis}, f, indent=2)
    lines = ["| batch | draft token correct w.p. | drafts accepted | tokens/step | decode tok/s | no spec tok/s "
             "| speedup | outputs identical | steps by k |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    lines += [f"| {r['batch']} | {r['acceptance_target']:.0%} | {r['draft_acceptance']:.0%} | "
              f"{r['mean_tokens_per_step']:.2f} | {r['decode_tok_s']:.1f} | {r['no_spec_tok_s']:.1f} | "
              f"{r['speedup']:.2f}x | {r['outputs_identical']} | "
              f"{', '.join(f'{k}: {n}' for k, n in sorted(r['k_steps'].items())) or '-'} |" for r in rows]
    with open(os.path.join(args.out, "spec_decode.md"), "w") as f:
        f.write(f"# Speculative decoding at controlled acceptance\n\nMachine: {meta['device']}, torch "
                f"{meta['torch']}; drafts: {method} ("
                f"{'verdicts drawn at the rate' if args.synthetic else 'tokens replaced by the controlled ones'}); "
                f"k = {args.k} (speculation length per step: {args.adaptive}), "
                f"prompt {args.prompt_len}, {args.max_tokens} greedy tokens.\n\n")
        f.write("\n".join(lines) + "\n\n![speedup against accepted drafts](spec_decode.png)\n")
    print("\n".join(lines))
    plot([(f"{meta['device']}, {args.dtype}", rows)], os.path.join(args.out, "spec_decode.png"),
         f"MTP k={args.k} with controlled drafts ({meta['device']})")
    return 0 if all(r["outputs_identical"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Speculative decoding throughput at controlled acceptance rates.

A test-only proposer knows each request's greedy continuation (from a run without speculation) and proposes it
with each draft token replaced by a wrong one with probability 1 - rate, so acceptance is controlled (0 %, 50 %,
90 %) whatever the weights. Decode tokens/s at batch 1 and 32 (only steps in which every row decodes are timed),
against the same engine without speculation, in the same run; greedy outputs must be identical.

    python benchmarks/spec_decode_bench.py --out benchmarks/results            # tiny model, CPU
    python benchmarks/spec_decode_bench.py --model DIR --device cuda --dtype bfloat16 --out $OUT   # H200
"""

from __future__ import annotations

import argparse
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
from hyserve.engine.request import Request
from hyserve.spec.proposer import Proposer
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
            cont = self.continuations[req.request_id]
            right = cont[req.num_output_tokens : req.num_output_tokens + k]
            out.append([t if self.rng.random() < self.rate else (t + 1) % self.vocab for t in right])
        return out


def timed_decode(llm: LLM, prompts: dict[str, list[int]], n: int, sync: bool) -> tuple[float, dict[str, list[int]]]:
    eng = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    for rid, p in prompts.items():
        eng.add_request(rid, {"prompt_token_ids": p}, params)
    tokens = 0
    seconds = 0.0
    outs: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        decoding = not eng.scheduler.waiting and all(r.is_decoding for r in eng.scheduler.running)
        before = sum(len(r.output_token_ids) for r in eng.scheduler.running)
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
        if decoding:
            after = sum(len(o.outputs[0].token_ids) for o in step)
            tokens += after - before
            seconds += dt
    return tokens / max(seconds, 1e-9), outs


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,32")
    args = ap.parse_args()
    torch.set_num_threads(1) if args.device == "cpu" else None
    model = args.model or write_tiny_checkpoint(tempfile.mkdtemp(), max_position_embeddings=8192)
    sync = args.device == "cuda"
    common: dict[str, Any] = dict(model=model, device=args.device, dtype=args.dtype, enable_prefix_caching=False,
                                  max_num_seqs=64, max_model_len=args.prompt_len + args.max_tokens + 64)
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        rng = random.Random(batch)
        base = LLM(**common)
        vocab = base.llm_engine.model_config.vocab_size
        prompts = {f"r{i}": [rng.randrange(vocab) for _ in range(args.prompt_len)] for i in range(batch)}
        base_tps, want = timed_decode(base, prompts, args.max_tokens, sync)
        del base
        for rate in (0.0, 0.5, 0.9):
            llm = LLM(**common, speculative_config={"method": "ngram", "num_speculative_tokens": args.k})
            llm.llm_engine.proposer = ControlledProposer(want, rate, vocab)
            tps, got = timed_decode(llm, prompts, args.max_tokens, sync)
            m = llm.get_metrics()
            drafts = max(int(m["hyserve:spec_decode_num_drafts"]), 1)  # type: ignore[arg-type]
            rows.append({"batch": batch, "acceptance_target": rate, "k": args.k,
                         "draft_acceptance": m["hyserve:spec_decode_num_accepted_tokens"]  # type: ignore[operator]
                         / max(int(m["hyserve:spec_decode_num_draft_tokens"]), 1),  # type: ignore[arg-type]
                         "mean_tokens_per_step": 1 + int(m["hyserve:spec_decode_num_accepted_tokens"]) / drafts,
                         "decode_tok_s": tps, "no_spec_tok_s": base_tps, "speedup": tps / base_tps,
                         "outputs_identical": got == want})
            print(json.dumps(rows[-1]), flush=True)
            del llm
    os.makedirs(args.out, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name() if sync else "cpu (2 cores)", "torch": torch.__version__,
            "model": model, "dtype": args.dtype, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens}
    with open(os.path.join(args.out, "spec_decode.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    lines = ["| batch | draft token correct w.p. | drafts accepted | tokens/step | decode tok/s | no spec tok/s "
             "| speedup | outputs identical |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    lines += [f"| {r['batch']} | {r['acceptance_target']:.0%} | {r['draft_acceptance']:.0%} | "
              f"{r['mean_tokens_per_step']:.2f} | {r['decode_tok_s']:.1f} | {r['no_spec_tok_s']:.1f} | "
              f"{r['speedup']:.2f}x | {r['outputs_identical']} |" for r in rows]
    with open(os.path.join(args.out, "spec_decode.md"), "w") as f:
        f.write(f"# Speculative decoding at controlled acceptance\n\nMachine: {meta['device']}, torch "
                f"{meta['torch']}; k = {args.k}, prompt {args.prompt_len}, {args.max_tokens} greedy tokens.\n\n")
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["outputs_identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

"""FP8 against bf16 on a real shape: greedy outputs of an FP8 variant (FP8 weights, or the FP8 KV cache) against the
bf16 model's, checked where the bf16 model's choice is clear.

    python benchmarks/fp8_check.py --bf16 /tmp/p2b --variant weights=/tmp/p2b_ct --variant kv=/tmp/p2b:fp8 \
        --out $OUT/fp8_check.json

Each variant generates greedily from the same prompts as the bf16 model. Along each prompt, as long as the two
outputs agree, the contexts are the same, so the distributions are comparable: the variant's chosen-token logprob
against bf16's, and at the first position where they part, bf16's margin between its top two tokens. A parting
where that margin exceeds ``--clear-margin`` nats fails the check (FP8 changed a choice bf16 was sure of); a
parting on a near tie is expected and counted. Writes the per-variant figures and ``pass``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hyserve import LLM, SamplingParams


def run(model: str, kv_cache_dtype: str, prompts: list[list[int]], max_tokens: int,
        max_model_len: int) -> list[tuple[list[int], list[dict[int, float]]]]:
    llm = LLM(model=model, dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, max_model_len=max_model_len,
              enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    res = [(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
           for o in outs]
    llm.shutdown()
    return res


def compare(base: list[tuple[list[int], list[dict[int, float]]]], other: list[tuple[list[int], list[dict[int, float]]]],
            clear_margin: float) -> dict[str, Any]:
    agreed = total = clear_partings = near_tie_partings = 0
    lp_err: list[float] = []
    for (bt, blp), (vt, vlp) in zip(base, other, strict=True):
        total += len(bt)
        for i, (a, b) in enumerate(zip(bt, vt, strict=True)):
            if a != b:
                top = sorted(blp[i].values(), reverse=True)
                margin = top[0] - top[1] if len(top) > 1 else float("inf")
                if margin > clear_margin:
                    clear_partings += 1
                else:
                    near_tie_partings += 1
                break
            agreed += 1
            lp_err.append(abs(blp[i][a] - vlp[i][a]))
    return {"tokens_agreed_before_parting": agreed / max(total, 1), "clear_margin_partings": clear_partings,
            "near_tie_partings": near_tie_partings, "chosen_logprob_mean_abs_diff": sum(lp_err) / max(len(lp_err), 1),
            "chosen_logprob_max_abs_diff": max(lp_err, default=0.0), "pass": clear_partings == 0}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bf16", required=True, help="the bf16 checkpoint")
    ap.add_argument("--variant", action="append", required=True, metavar="NAME=DIR[:fp8]",
                    help="a checkpoint to compare; ':fp8' runs it with the FP8 KV cache")
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--clear-margin", type=float, default=0.5)
    ap.add_argument("--max-model-len", type=int, default=4096)
    args = ap.parse_args()
    with open(os.path.join(args.bf16, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    vocab = int(cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size"))
    rng = random.Random(0)
    prompts = [[rng.randrange(min(vocab, 150_000)) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    base = run(args.bf16, "auto", prompts, args.max_tokens, args.max_model_len)
    results: dict[str, Any] = {"command": " ".join(sys.argv), "clear_margin": args.clear_margin, "variants": {}}
    for spec in args.variant:
        name, _, where = spec.partition("=")
        model, _, kv = where.partition(":")
        got = run(model, kv or "auto", prompts, args.max_tokens, args.max_model_len)
        results["variants"][name] = compare(base, got, args.clear_margin)
        print(name, json.dumps(results["variants"][name]))
    results["pass"] = all(v["pass"] for v in results["variants"].values())
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)
    return 0 if results["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""The side-by-side agent trace (``peer_bench.measure_agent``: 8 conversations x 4 turns, a 1.7k-token shared
system prompt) replayed on any device with the GPU's step size, reporting every request's cached tokens against the
ideal (all of its prompt that an earlier request computed, aligned to 16-token blocks).

The hit rate depends on the outputs only through their lengths (fixed by the trace), so a tiny checkpoint on the
CPU gives the figure an H200 run gives, in minutes:

    python benchmarks/peer_bench.py write --shape tiny --out /tmp/ptiny --device cpu
    python benchmarks/agent_replay.py --model /tmp/ptiny --out benchmarks/results/cpu/agent_replay.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hyserve import LLM, SamplingParams
from hyserve.tools.workload import AgentTraceSpec, make_conversations

SPEC = AgentTraceSpec(name="peer", system_prefix_len=1700, num_conversations=8, concurrency=8, turns=(4, 4),
                      first_message_len=(600, 900), message_len=(200, 400), output_len=(32, 64),
                      max_prompt_len=8192)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384, help="default: the CUDA default step")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    with open(os.path.join(args.model, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    vocab = int(cfg.get("vocab_size") or cfg["text_config"]["vocab_size"])
    extra = {"kv_cache_dtype": args.kv_cache_dtype} if args.kv_cache_dtype != "auto" else {}  # (older trees: no field)
    llm = LLM(model=args.model, device=args.device, dtype=args.dtype, enable_prefix_caching=True,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=8192, max_num_seqs=64, **extra)
    convs = make_conversations(SPEC, seed=0, vocab_size=min(vocab - 16, 2000))
    outputs: dict[int, list[list[int]]] = {c.conv_id: [] for c in convs}
    turns = []
    total = cached = ideal = 0
    t0 = time.perf_counter()
    for turn in range(4):
        prompts = [c.prompt(turn, outputs[c.conv_id]) for c in convs]
        params = [SamplingParams(temperature=0.0, max_tokens=c.output_lens[turn], ignore_eos=True) for c in convs]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        rows = []
        for i, (c, p, o) in enumerate(zip(convs, prompts, outs, strict=True)):
            # What an earlier request computed of this prompt: the system prompt (every request of turn 0 but the
            # first), or the conversation's previous prompt and output (the last output token is never computed).
            known = SPEC.system_prefix_len if turn == 0 else len(prompts[i]) - len(c.messages[turn]) - 1
            want = (min(known, len(p) - 1) // 16) * 16 if (turn or i) else 0
            outputs[c.conv_id].append(list(o.outputs[0].token_ids))
            total += len(p)
            cached += o.num_cached_tokens
            ideal += want
            rows.append({"prompt": len(p), "cached": o.num_cached_tokens, "ideal": want})
        turns.append(rows)
    res = {"command": " ".join(sys.argv), "hyserve_commit": subprocess.run(
               ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
               cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip(),
           "device": args.device, "max_num_batched_tokens": args.max_num_batched_tokens,
           "kv_cache_dtype": args.kv_cache_dtype, "wall_s": time.perf_counter() - t0,
           "cached_share": cached / total, "ideal_share": ideal / total, "turns": turns}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(res, f, indent=2)
    print(f"cached {cached / total:.3f} of prompt tokens (ideal {ideal / total:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

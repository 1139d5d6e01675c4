"""Multi-GPU check in one call: tensor and pipeline parallelism against the single-GPU engine, and throughput.

    python benchmarks/multi_gpu_check.py --tp 2 --pp 2 --out $OUT   # two GPUs (NCCL), the 2B shape in bf16

Runs one GPU, then T = ``--tp`` (tensor parallel, one stage), then P = ``--pp`` (pipeline parallel, one rank per
stage); a size of 1 skips that configuration.

1. Correctness: greedy outputs of 4 prompts in each configuration against one GPU, on the same random-weight
   checkpoint (Qwen3.5-2B shape unless ``--model``). In bf16 the two may part at a near tie: a run passes when every
   prompt agrees up to its end or up to a position where the single-GPU run's top-2 logprob margin is below
   ``--margin``.
2. Throughput in each configuration: prefill tokens/s (8 prompts of 2048 tokens) and decode tokens/s at each batch
   of ``--batches`` (prompts of 512 tokens, async scheduling as by default).

On the CPU (``--device cpu --model DIR``) the same script runs with gloo, which is how CI checks it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

# The lent multi-GPU machines must never use NVLink multicast (it can put the host's shared GPUs out of service):
# off in NCCL, PyTorch's symmetric memory and NVSHMEM, here and in every worker process (they inherit this
# environment), whatever the caller's environment says.
os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")

import torch
from decode_window import decode_window

from hyserve import LLM, SamplingParams


def greedy_outputs(llm: LLM, prompts: list[list[int]], n: int) -> list[dict[str, Any]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    rows = []
    for out in outs:
        c = out.outputs[0]
        margins = []
        for lp in c.logprobs or []:
            vals = sorted((v.logprob for v in lp.values()), reverse=True)
            margins.append(vals[0] - vals[1] if len(vals) > 1 else float("inf"))
        rows.append({"token_ids": c.token_ids, "margins": margins})
    return rows


def compare(one: list[dict[str, Any]], many: list[dict[str, Any]], margin: float) -> dict[str, Any]:
    per_prompt = []
    ok = True
    for a, b in zip(one, many, strict=True):
        first = next((i for i, (x, y) in enumerate(zip(a["token_ids"], b["token_ids"], strict=True)) if x != y), None)
        near_tie = first is not None and a["margins"][first] < margin
        ok &= first is None or near_tie
        per_prompt.append({"agree_tokens": len(a["token_ids"]) if first is None else first, "of": len(a["token_ids"]),
                           "parted_at_near_tie": near_tie})
    return {"pass": ok, "prompts": per_prompt}


def throughput(llm: LLM, vocab: int, batches: list[int], prefill_len: int, n_prefill: int,
               g: torch.Generator) -> dict[str, float]:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    long = [torch.randint(0, vocab, (prefill_len,), generator=g).tolist() for _ in range(n_prefill)]
    llm.generate([{"prompt_token_ids": p} for p in long[:1]], one, use_tqdm=False)  # warm-up
    sync()
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in long], one, use_tqdm=False)
    sync()
    out = {"prefill_tok_s": n_prefill * prefill_len / (time.perf_counter() - t0)}
    for batch in batches:
        wall, tokens = decode_window(llm.llm_engine, batch, 64, g)
        out[f"decode_bs{batch}_tok_s"] = tokens / wall
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks to check (1: skip)")
    ap.add_argument("--pp", type=int, default=2, help="pipeline stages to check (1: skip)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--model", default=None, help="checkpoint (default: a random Qwen3.5-2B shape)")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prefill-len", type=int, default=2048)
    ap.add_argument("--num-prefill", type=int, default=8)
    ap.add_argument("--margin", type=float, default=0.25)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    model = args.model
    if model is None:
        from shapes import SHAPE_2B, write_random_checkpoint

        model = os.path.join(tempfile.mkdtemp(), "qwen35-2b-shape")
        write_random_checkpoint(model, SHAPE_2B)
    batches = [int(b) for b in args.batches.split(",")]
    kw: dict[str, Any] = dict(model=model, device=args.device, dtype=args.dtype, max_num_seqs=max(batches),
                              max_model_len=4096, max_num_batched_tokens=8192)
    if args.device == "cuda":
        kw["gpu_memory_utilization"] = 0.8
    results: dict[str, Any] = {"command": " ".join(sys.argv), "tp": args.tp, "pp": args.pp,
                               "python": platform.python_version(), "torch": torch.__version__,
                               "date": time.strftime("%Y-%m-%d"),
                               "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    g = torch.Generator().manual_seed(0)
    configs = {"tp1": {}}
    if args.tp > 1:
        configs[f"tp{args.tp}"] = {"tensor_parallel_size": args.tp}
    if args.pp > 1:
        configs[f"pp{args.pp}"] = {"pipeline_parallel_size": args.pp}
    outputs: dict[str, list[dict[str, Any]]] = {}
    for name, parallel in configs.items():
        llm = LLM(**parallel, **kw)
        vocab = llm.llm_engine.model_config.vocab_size
        prompts = [torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()
                   for n in (300, 17, 1000, 64)]
        outputs[name] = greedy_outputs(llm, prompts, args.max_tokens)
        results[name] = throughput(llm, vocab, batches, args.prefill_len, args.num_prefill, g)
        print(f"{name}: {results[name]}", flush=True)
        llm.shutdown()
    results["correctness"] = {name: compare(outputs["tp1"], outputs[name], args.margin)
                              for name in configs if name != "tp1"}
    print(f"correctness: {results['correctness']}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "multi_gpu_check.json"), "w") as f:
        json.dump(results, f, indent=2)
    return 0 if all(c["pass"] for c in results["correctness"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())

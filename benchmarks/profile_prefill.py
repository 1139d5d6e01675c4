"""Where a prefill step's time goes: prompts of ``--prompt-len`` tokens, ``--max-num-batched-tokens`` per step.

Measures prefill tokens/s over ``--num-prompts`` prompts (one output token each), then profiles the same once with
the torch profiler and prints the kernels by their share of device time, grouped into families (GEMM, attention,
GDN, conv, norms, elementwise), and the device's idle gaps by cause (``trace_gaps.py``: host, sync, device), as
JSON under ``--out``.

    python benchmarks/shapes.py --shape 2b --out /tmp/m2b
    python benchmarks/profile_prefill.py --model /tmp/m2b --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from trace_gaps import format_gaps, gaps_of_profile  # benchmarks/ is on the path (above)

from hyserve import LLM, SamplingParams

FAMILIES = (("gemm", ("gemm", "gemv", "cutlass", "sm90_xmma", "nvjet", "cublas")),
            ("attention", ("attn", "flash", "fmha")),
            ("gdn", ("chunk", "fused_recurrent", "gated_delta", "fwd_kernel", "solve_tril", "l2norm", "cumsum",
                     "wy", "kkt")),
            ("conv", ("conv",)),
            ("norm", ("norm", "rms")),
            ("copy", ("copy", "memcpy", "memset", "cat", "index")),
            ("elementwise", ("elementwise", "vectorized", "silu", "sigmoid", "mul", "add")))


def family(name: str) -> str:
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k in low for k in keys):
            return fam
    return "other"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: the engine's")
    ap.add_argument("--load-format", default="auto", help="dummy: weights made at load (a config-only checkpoint)")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    llm = LLM(model=args.model, device="cuda", dtype=args.dtype, max_model_len=max(4096, args.prompt_len + 16),
              load_format=args.load_format,
              max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=0.8)
    eng = llm.llm_engine
    vocab = eng.model_config.vocab_size
    g = torch.Generator().manual_seed(0)

    def fresh() -> list[dict[str, list[int]]]:  # new random prompts each time: no prefix-cache hits
        return [{"prompt_token_ids": torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist()}
                for _ in range(args.num_prompts)]

    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate(fresh(), one, use_tqdm=False)  # warm-up: compiles and autotunes every shape the timed run meets
    torch.cuda.synchronize()
    prompts = fresh()
    t0 = time.perf_counter()
    llm.generate(prompts, one, use_tqdm=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    from torch.profiler import ProfilerActivity, profile

    prompts = fresh()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], acc_events=True) as prof:
        llm.generate(prompts, one, use_tqdm=False)
        torch.cuda.synchronize()
    gaps = gaps_of_profile(prof, os.path.join(tempfile.mkdtemp(), "trace.json"))
    kernels: dict[str, float] = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and e.self_device_time_total > 0:
            kernels[e.key] = kernels.get(e.key, 0.0) + e.self_device_time_total / 1e3
    total = sum(kernels.values())
    fams: dict[str, float] = {}
    for name, ms in kernels.items():
        fams[family(name)] = fams.get(family(name), 0.0) + ms
    result: dict[str, Any] = {
        "command": " ".join(sys.argv), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "max_num_batched_tokens": eng.max_num_batched_tokens, "prompt_len": args.prompt_len,
        "num_prompts": args.num_prompts, "prefill_tok_s": args.num_prompts * args.prompt_len / wall,
        "wall_s": wall, "kernel_ms": total,
        "families_ms": dict(sorted(fams.items(), key=lambda kv: -kv[1])),
        "top_kernels_ms": dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:25]),
        "gaps": gaps,
    }
    print(json.dumps({k: v for k, v in result.items() if k not in ("top_kernels_ms", "gaps")}, indent=1))
    print(format_gaps(gaps))
    for name, ms in list(result["top_kernels_ms"].items()):
        print(f"{ms:9.2f} ms  {100 * ms / total:5.1f} %  {family(name):11s} {name[:110]}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "profile_prefill.json"), "w") as f:
        json.dump(result, f, indent=1)
    llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

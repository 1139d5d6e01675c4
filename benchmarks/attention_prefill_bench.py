"""Prefill attention kernels on one GPU: hyserve's Triton paged kernel against torch's varlen FlashAttention
(``torch.nn.attention.varlen.varlen_attn``, contiguous and paged when this torch has ``block_table``) and SDPA, and
hyserve's split of a step's rows (``paged_attention_rows``: each long row one SDPA call; ``rows_*``: the fresh
prompts as given, and ``rows_ctx_*`` with the first half of each prompt a cached context read back from the pages).

    python benchmarks/attention_prefill_bench.py --out $OUT      # 2B shape: 8 query heads, 2 KV heads, D = 256

Each kernel runs causal attention for ``--seqs`` fresh prompts of ``--len`` tokens; the outputs are compared with
the Triton kernel's (max abs difference), and the median time of 20 runs is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hyserve.kernels.attention import paged_attention_triton, store_kv_triton
from hyserve.kernels.attention.sdpa import paged_attention_rows


def timed(fn: Callable[[], torch.Tensor]) -> tuple[float, torch.Tensor]:
    out = fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3, out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--len", type=int, default=2048)
    ap.add_argument("--hq", type=int, default=8)
    ap.add_argument("--hkv", type=int, default=2)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    n, L, bs = args.seqs, args.len, args.block_size
    t = n * L
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(t, args.hq, args.d, device=dev, dtype=dt, generator=g)
    k = torch.randn(t, args.hkv, args.d, device=dev, dtype=dt, generator=g)
    v = torch.randn(t, args.hkv, args.d, device=dev, dtype=dt, generator=g)
    blocks_per = L // bs
    nblk = n * blocks_per + 1
    k_cache = torch.zeros(nblk, bs, args.hkv, args.d, device=dev, dtype=dt)
    v_cache = torch.zeros_like(k_cache)
    perm = torch.randperm(n * blocks_per, generator=torch.Generator().manual_seed(1)).to(dev) + 1
    tables = perm.view(n, blocks_per).to(torch.int32)
    pos = torch.arange(L, device=dev)
    slots = (tables.long()[:, pos // bs] * bs + pos % bs).reshape(-1)
    store_kv_triton(k, v, k_cache, v_cache, slots)
    cu = torch.arange(0, t + 1, L, device=dev, dtype=torch.int32)
    lens = torch.full((n,), L, device=dev, dtype=torch.int32)
    scale = args.d ** -0.5
    res: dict[str, Any] = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(),
                           "torch": torch.__version__, "shape": vars(args)}
    tri_ms, ref = timed(lambda: paged_attention_triton(q, k_cache, v_cache, tables, cu, lens, scale, L, L))
    res["triton_paged_ms"] = tri_ms
    flops = 4 * n * (L * L / 2) * args.hq * args.d
    res["triton_tflops"] = flops / tri_ms / 1e9
    try:
        import inspect

        from torch.nn.attention.varlen import varlen_attn

        params = inspect.signature(varlen_attn).parameters
        res["varlen_signature"] = list(params)
        if "enable_gqa" in params:
            def fresh() -> torch.Tensor:
                return varlen_attn(q, k, v, cu, cu, L, L, scale=scale, window_size=(-1, 0), enable_gqa=True)
        else:  # an older varlen_attn: K/V repeated to the query heads (the copy is timed too)
            rep = args.hq // args.hkv

            def fresh() -> torch.Tensor:
                kr, vr = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
                kw = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
                return varlen_attn(q, kr, vr, cu, cu, L, L, scale=scale, **kw)
        ms, out = timed(fresh)
        res["varlen_ms"], res["varlen_tflops"] = ms, flops / ms / 1e9
        res["varlen_max_abs_diff"] = float((out.float() - ref.float()).abs().max())
        try:
            ms, out = timed(lambda: varlen_attn(q, k_cache, v_cache, cu, None, L, L, scale=scale,
                                                window_size=(-1, 0), enable_gqa=True, seqused_k=lens,
                                                block_table=tables))
            res["varlen_paged_ms"], res["varlen_paged_tflops"] = ms, flops / ms / 1e9
            res["varlen_paged_max_abs_diff"] = float((out.float() - ref.float()).abs().max())
        except Exception as e:  # reported: this torch's varlen_attn may lack paging
            res["varlen_paged_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    except Exception as e:
        res["varlen_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    qsl_cpu, lens_cpu = cu.tolist(), lens.tolist()
    ms, out = timed(lambda: paged_attention_rows(q, k, v, k_cache, v_cache, tables, lens, scale, qsl_cpu, lens_cpu))
    res["rows_ms"], res["rows_tflops"] = ms, flops / ms / 1e9
    res["rows_max_abs_diff"] = float((out.float() - ref.float()).abs().max())
    # the second half of each prompt as this step's queries after the first half cached (lower-right mask)
    half = L // 2
    qh = q.view(n, L, args.hq, args.d)[:, half:].reshape(-1, args.hq, args.d)
    kh = k.view(n, L, args.hkv, args.d)[:, half:].reshape(-1, args.hkv, args.d)
    vh = v.view(n, L, args.hkv, args.d)[:, half:].reshape(-1, args.hkv, args.d)
    cuh = torch.arange(0, n * (L - half) + 1, L - half, device=dev, dtype=torch.int32)
    want_h = ref.view(n, L, args.hq, args.d)[:, half:].reshape(-1, args.hq, args.d)
    ms, out = timed(lambda: paged_attention_rows(qh, kh, vh, k_cache, v_cache, tables, lens, scale, cuh.tolist(),
                                                 lens_cpu))
    flops_h = 4 * n * ((L - half) * half + (L - half) ** 2 / 2) * args.hq * args.d
    res["rows_ctx_ms"], res["rows_ctx_tflops"] = ms, flops_h / ms / 1e9
    res["rows_ctx_max_abs_diff"] = float((out.float() - want_h.float()).abs().max())
    ms, _ = timed(lambda: paged_attention_triton(qh, k_cache, v_cache, tables, cuh, lens, scale, L - half, L))
    res["triton_ctx_ms"], res["triton_ctx_tflops"] = ms, flops_h / ms / 1e9
    qs = q.view(n, L, args.hq, args.d).transpose(1, 2)
    ks = k.view(n, L, args.hkv, args.d).transpose(1, 2)
    vs = v.view(n, L, args.hkv, args.d).transpose(1, 2)
    ms, out = timed(lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                                               enable_gqa=True))
    res["sdpa_ms"], res["sdpa_tflops"] = ms, flops / ms / 1e9
    out = out.transpose(1, 2).reshape(t, args.hq, args.d)
    res["sdpa_max_abs_diff"] = float((out.float() - ref.float()).abs().max())
    print(json.dumps(res, indent=1))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "attention_prefill.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

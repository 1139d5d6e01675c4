# ruff: noqa: B023 (every closure over the loop variables is benchmarked before the loop moves on)
"""FP8 GEMMs at the linear layers' shapes of the 2B, 9B and 27B models: which kernel is faster where (issue 15).

For every projection of a layer (its (N, K) as hyserve builds it: merged GDN in_proj, merged q/k/v with the output
gate, merged gate/up, the two output projections) and every row count M of decode (1, 8, 32, 64) and prefill
(2048, 16384), the time of:

* ``bf16``: ``F.linear`` on bf16 weights (the unquantized model);
* ``scaled_mm``: cuBLASLt's rowwise-scaled FP8 GEMM (``torch._scaled_mm``) after hyserve's one-launch quantization;
* ``scaled_mm_torchq``: the same GEMM after torch's six-op quantization (the path before the Triton quantization);
* ``triton``: hyserve's Triton FP8 GEMM with channel scales at the shipped tile choice, and the best of a sweep;
* ``triton_block``: the same kernel with 128x128 block scales and per-128-group activations (Qwen's block FP8),
  shipped choice and best of the sweep; ``dequant_block``: the block path before it (dequantize, bf16 GEMM);
  ``scaled_mm_block``: cuBLASLt's block-scaled GEMM (``fp8.blockwise_scaled_mm``, its quantization included), where
  it takes the shape;
* ``triton_fused`` / ``triton_block_fused`` (decode row counts): the GEMM quantizing the bf16 activation itself,
  no separate quantization launch (``quant_us`` is not added to these).

Each time is a CUDA-graph replay (``triton.testing.do_bench_cudagraph``) over enough copies of the weights that they
do not fit the L2 cache, as in a decode step where every layer's weights are read once. The weights' bandwidth
(FP8 bytes / time) is shown beside the copy bandwidth measured in the same run. Run on the GPU machine:

    python benchmarks/fp8_gemm_bench.py --out $OUT/fp8_gemm.json
    python benchmarks/fp8_gemm_bench.py --shapes 27b --rows 1024 2541 4096 9330 --out $OUT/fp8_gemm_rows.json

``--rows``: those row counts alone, each with the Triton tiles swept; each row also gives cuBLASLt's rate
(``scaled_mm_tflops``) and time per row. The seed's prompt steps spent 45.7 us a prompt token in the FP8 GEMMs at
2,541 tokens and 35.8 at 9,330, the same cuBLASLt kernel at both (``results/h100/seed_2026-12-07c``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hyserve.kernels import fp8

L2_BYTES = 256 << 20  # weights cycled per measurement: well past the H200's 60 MB L2
DECODE_M = (1, 8, 32, 64)
PREFILL_M = (2048, 16384)
SWEEP_M = (1, 32, 16384)  # row counts at which the tile choices are swept (the others take the shipped choice)


def layer_shapes(shape: dict[str, int]) -> dict[str, tuple[int, int, int]]:
    """``{name: (N, K, layers)}``: each projection's output and input width and how many the model has."""
    h, i = shape["hidden_size"], shape["intermediate_size"]
    nk, nv = shape["linear_num_key_heads"], shape["linear_num_value_heads"]
    dk, dv = shape["linear_key_head_dim"], shape["linear_value_head_dim"]
    layers = shape["num_hidden_layers"]
    attn = layers // 4  # 3 GDN layers to 1 attention layer
    q = shape["num_attention_heads"] * shape["head_dim"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    return {
        "gdn_in_proj": (2 * nk * dk + 2 * nv * dv + 2 * nv, h, layers - attn),
        "gdn_out_proj": (h, nv * dv, layers - attn),
        "attn_qkv": (2 * q + 2 * kv, h, attn),
        "attn_o_proj": (h, q, attn),
        "mlp_gate_up": (2 * i, h, layers),
        "mlp_down": (h, i, layers),
    }


SHAPES = {
    "2b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=8,
               num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
               linear_key_head_dim=128, linear_value_head_dim=128),
    "9b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16,
               num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
               linear_key_head_dim=128, linear_value_head_dim=128),
    # Qwen3.5-27B (benchmarks/shapes.py SHAPE_27B): the seed deployment's FP8_DYNAMIC GEMMs
    "27b": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
                num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
                linear_key_head_dim=128, linear_value_head_dim=128),
}


def sweep_configs(m: int, block: bool) -> list[fp8.GemmConfig]:
    if m <= 64:
        bm = 16 if m <= 16 else (32 if m <= 32 else 64)
        out = [fp8.GemmConfig(bm, bn, 128, split, 1, warps, stages)
               for bn in (32, 64, 128) for split in (1, 2, 4, 8) for warps, stages in ((4, 4),)]
        if not block:
            out += [fp8.GemmConfig(bm, 64, 256, split, 1, 4, 3) for split in (1, 2, 4)]
        return out
    return [fp8.GemmConfig(bm, bn, 128, 1, 8, warps, stages)
            for bm, bn in ((64, 128), (128, 128), (128, 256)) for warps, stages in ((4, 3), (8, 3), (8, 4))]


def bench(fn: Callable[[int], Any], copies: int) -> float:
    """Microseconds per call of ``fn(i)`` cycled over ``copies`` weights, from a CUDA-graph replay."""
    import triton.testing

    def all_copies() -> None:
        for i in range(copies):
            fn(i)

    ms = triton.testing.do_bench_cudagraph(all_copies, rep=30)
    return ms * 1e3 / copies


def _wall_bench(fn: Callable[[int], Any], copies: int) -> float:
    t = time.perf_counter()
    for i in range(copies):
        fn(i)
    return (time.perf_counter() - t) * 1e6 / copies


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    import triton.testing

    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = triton.testing.do_bench_cudagraph(lambda: b.copy_(a), rep=50)
    return 2 * a.numel() / (ms * 1e-3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="2b,9b")
    ap.add_argument("--no-sweep", action="store_true", help="only the shipped tile choices")
    ap.add_argument("--budget-s", type=float, default=1e9, help="no more sweeps once this many seconds have passed")
    ap.add_argument("--rows", type=int, nargs="+", default=None,
                    help="only these row counts M, each swept (e.g. the seed's prompt steps: 1024 2541 4096 9330)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny shapes under TRITON_INTERPRET=1 with wall-clock timing: checks the script, not speed")
    args = ap.parse_args()
    global bench, copy_bandwidth, SHAPES, DECODE_M, PREFILL_M, SWEEP_M, L2_BYTES
    if args.cpu_smoke:
        from hyserve.testing.triton_interpreter import patch_triton_interpreter

        patch_triton_interpreter()  # numpy >= 2.3 beside triton 3.6's interpreter (its docstring)
        bench, copy_bandwidth = _wall_bench, lambda: 1e11
        SHAPES = {"2b": dict(SHAPES["2b"], hidden_size=256, intermediate_size=384, linear_num_key_heads=2,
                             linear_num_value_heads=2, num_attention_heads=2, num_key_value_heads=1)}
        DECODE_M, PREFILL_M, SWEEP_M, L2_BYTES = (1, 17), (70,), (1,), 1
        args.shapes = "2b"
    if args.rows:
        DECODE_M, PREFILL_M, SWEEP_M = (), tuple(args.rows), tuple(args.rows)
    dev = torch.device("cpu" if args.cpu_smoke else "cuda")
    fp8.check_fp8_device(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    bw = copy_bandwidth()
    start = time.monotonic()
    rows: list[dict[str, Any]] = []
    for shape_name in args.shapes.split(","):
        for layer, (n, k, count) in layer_shapes(SHAPES[shape_name]).items():
            wbytes = n * k
            copies = max(2, -(-L2_BYTES // wbytes))
            w = [torch.randn(n, k, device=dev, generator=gen, dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
            ws = [x.float().abs().amax(1, keepdim=True) / fp8.FP8_MAX for x in w]
            wq = [(x.float() / s).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8_DTYPE) for x, s in zip(w, ws)]
            bs = [torch.rand(-(-n // 128), -(-k // 128), device=dev, generator=gen) / 448 + 1e-3 for _ in w]
            for m in (*DECODE_M, *PREFILL_M):
                x = torch.randn(m, k, device=dev, generator=gen, dtype=torch.bfloat16)
                row: dict[str, Any] = dict(shape=shape_name, layer=layer, n=n, k=k, layers=count, m=m)
                q, qs = fp8.quantize_rows(x)
                qg, qgs = fp8.quantize_rows(x, group=128)
                # correctness at this shape, against the float32 reference
                ref = fp8.fp8_linear_ref(x, wq[0], ws[0]).float()
                got = fp8.triton_fp8_gemm(q, qs, wq[0], ws[0], None, torch.bfloat16).float()
                row["triton_rel_err"] = float((got - ref).abs().max() / ref.abs().max())
                refb = fp8.fp8_block_linear_ref(x, wq[0], bs[0], (128, 128), 128).float()
                gotb = fp8.fp8_block_linear(x, wq[0], bs[0], (128, 128), 128).float()
                row["triton_block_rel_err"] = float((gotb - refb).abs().max() / refb.abs().max())
                row["quant_us"] = bench(lambda i: fp8.quantize_rows(x), 1)
                row["quant_torch_us"] = bench(lambda i: fp8.quantize_per_token(x), 1)
                row["quant_group_us"] = bench(lambda i: fp8.quantize_rows(x, group=128), 1)
                row["bf16_us"] = bench(lambda i: F.linear(x, w[i]), copies)
                row["scaled_mm_us"] = bench(lambda i: torch._scaled_mm(
                    q, wq[i].t(), scale_a=qs, scale_b=ws[i].view(1, n), out_dtype=torch.bfloat16), copies)
                row["scaled_mm_torchq_us"] = bench(lambda i: _scaled_mm_torch_quant(x, wq[i], ws[i]), copies)
                row["triton_us"] = bench(lambda i: fp8.triton_fp8_gemm(q, qs, wq[i], ws[i], None, torch.bfloat16),
                                         copies)
                row["triton_block_us"] = bench(lambda i: fp8.triton_fp8_gemm(qg, qgs, wq[i], bs[i], (128, 128),
                                                                             torch.bfloat16), copies)
                if dev.type == "cuda" and fp8.blockwise_scaled_mm_fits(wq[0], bs[0], (128, 128)):
                    # cuBLASLt's block-scaled GEMM, its quantization (token-major scales) included
                    gotc = fp8.blockwise_scaled_mm(x, wq[0], bs[0], torch.bfloat16).float()
                    row["scaled_mm_block_rel_err"] = float((gotc - refb).abs().max() / refb.abs().max())
                    row["scaled_mm_block_us"] = bench(lambda i: fp8.blockwise_scaled_mm(x, wq[i], bs[i],
                                                                                        torch.bfloat16), copies)
                if m <= 64:  # the GEMM quantizing the activation itself (what decode runs)
                    row["triton_fused_us"] = bench(lambda i: fp8.triton_fp8_gemm(
                        x, None, wq[i], ws[i], None, torch.bfloat16, quantize="token"), copies)
                    row["triton_block_fused_us"] = bench(lambda i: fp8.triton_fp8_gemm(
                        x, None, wq[i], bs[i], (128, 128), torch.bfloat16, quantize="group"), copies)
                row["dequant_block_us"] = bench(lambda i: fp8.fp8_block_linear_dequant(x, wq[i], bs[i], (128, 128),
                                                                                      128), min(copies, 4))
                row["config"] = list(fp8.gemm_config(m, n, k))
                if not args.no_sweep and m in SWEEP_M and time.monotonic() - start < args.budget_s:
                    for key, block in (("triton", False), ("triton_block", True)):
                        best = (row[f"{key}_us"], row["config"])
                        for cfg in sweep_configs(m, block):
                            try:
                                t = bench(lambda i, cfg=cfg: fp8.triton_fp8_gemm(
                                    qg if block else q, qgs if block else qs, wq[i], bs[i] if block else ws[i],
                                    (128, 128) if block else None, torch.bfloat16, cfg), copies)
                            except Exception as e:  # a tile that does not fit shared memory: record and go on
                                row.setdefault("sweep_errors", []).append(f"{list(cfg)}: {type(e).__name__}")
                                continue
                            if t < best[0]:
                                best = (t, list(cfg))
                        row[f"{key}_best_us"], row[f"{key}_best_config"] = best
                row["fp8_weight_gb_s"] = wbytes / (min(row["scaled_mm_us"], row["triton_us"]) * 1e-6) / 1e9
                # the GEMM's rate (2 M N K) and its time per row, the figure a prompt step's size changes
                row["scaled_mm_tflops"] = 2 * m * n * k / (row["scaled_mm_us"] * 1e-6) / 1e12
                row["scaled_mm_us_per_row"] = row["scaled_mm_us"] / m
                rows.append(row)
                print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}),
                      flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    device = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (smoke)"
    result = dict(command=" ".join(sys.argv), device=device, torch=torch.__version__,
                  triton=__import__("triton").__version__, python=platform.python_version(),
                  hyserve_commit=commit or os.environ.get("HYSERVE_COMMIT", ""), copy_bandwidth_bytes_s=bw,
                  rows=rows, summary=summarize(rows, bw))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["summary"], indent=1))


def _scaled_mm_torch_quant(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    q, s = fp8.quantize_per_token(x)
    return torch._scaled_mm(q, wq.t(), scale_a=s, scale_b=ws.view(1, -1), out_dtype=torch.bfloat16)


def summarize(rows: list[dict[str, Any]], bw: float) -> dict[str, Any]:
    """Per model and M: the linear layers' time of one forward (each projection times its layer count) per kernel,
    and the FP8 weights' read time at the copy bandwidth (half of it: a copy reads and writes)."""
    out: dict[str, Any] = {}
    keys = ("bf16_us", "scaled_mm_us", "scaled_mm_torchq_us", "triton_us", "triton_best_us", "triton_block_us",
            "triton_block_best_us", "scaled_mm_block_us", "triton_fused_us", "triton_block_fused_us",
            "dequant_block_us", "quant_us", "quant_torch_us")
    for r in rows:
        s = out.setdefault(r["shape"], {}).setdefault(str(r["m"]), {k: 0.0 for k in (*keys, "fp8_bound_us")})
        for k in keys:
            s[k] += r.get(k, r.get(k.replace("_best", ""), 0.0)) * r["layers"]
        s["fp8_bound_us"] += r["n"] * r["k"] / bw * 1e6 * r["layers"]
    return out


if __name__ == "__main__":
    main()

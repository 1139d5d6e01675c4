"""The per-token FP8 quantization of a decode step on one GPU, at Qwen3.5-27B's widths: each producer that
quantizes in its own launch (``HYSERVE_FP8_FUSED_QUANT=1``) against its plain launch followed by the quantization
an FP8 GEMM makes for itself (``quantize_rows``, what ``=0`` runs), and the passes' block and warp counts swept.

    python benchmarks/fp8_quant_bench.py --out $OUT                  # rows 1, 8, 32, 64
    python benchmarks/fp8_quant_bench.py --rows 1 64 --out $OUT

Why: on an H100 the 27B FP8_DYNAMIC decode ran 2-5 % slower with the producers quantizing than without
(``results/h100/issue34_2026-12-05``). Every quantizing launch reads its row in one program, twice (the amax,
then the values), ``BLOCK`` columns at a time: at batch 1 that is a chain of dependent loads on one SM.

Per row count M, each line is one way of producing the FP8 input of a GEMM (microseconds, a CUDA graph of 20 calls
replayed, median of 10 replays):

* ``quant_rows K=... block=B warps=W``: ``quantize_rows`` alone over a ``(M, K)`` bf16 activation (K = 5120, the
  hidden size; 6144, the GDN and attention outputs; 17408, the SwiGLU), the shipped choice and the sweep;
* ``rms_norm`` / ``add_rms_norm`` (5120): the norm quantizing against the plain norm + ``quantize_rows``;
* ``silu_mul`` (17408) and ``sigmoid_mul`` (24 heads x 256, read per head as ``q_proj`` writes the gate): the
  quantizing launch per ``(BLOCK_F, warps)`` against the plain launch + ``quantize_rows``;
* ``gdn_decode`` (16 key / 48 value heads, float32 state): the fused decode launch with ``quant="fp8"`` per
  quantization block against the plain launch + ``quantize_rows``.

The quantized bytes and scales of every variant are compared with the unfused path's (they must be equal: the
sweep changes the order of loads, not the arithmetic). ``--check`` runs those comparisons alone, at one row, on the
CPU under ``TRITON_INTERPRET=1`` (no timing): ``TRITON_INTERPRET=1 python benchmarks/fp8_quant_bench.py --check``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from gdn_decode_bench import graph_time

from hyserve.kernels.fp8 import Fp8Activation, quantize_rows, token_quant_launch
from hyserve.kernels.gdn.decode import arrivals_for, gdn_decode_fused_triton, row_counters_for
from hyserve.kernels.norm import (
    add_rms_norm_triton as add_rms_norm,
)
from hyserve.kernels.norm import (
    gated_quant_launch,
    silu_mul_triton,
)
from hyserve.kernels.norm import (
    rms_norm_triton as rms_norm,
)
from hyserve.kernels.norm import (
    sigmoid_mul_triton as sigmoid_mul,
)

HIDDEN, GDN_OUT, INTER, ATTN_HEADS, ATTN_DIM = 5120, 6144, 17408, 24, 256
HK, HV, D, CONV_K = 16, 48, 128, 4
TOKEN_SWEEP = [(1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16), (16384, 16), (32768, 32)]
GATED_SWEEP = [(2048, 4), (1024, 4), (4096, 8), (8192, 16)]
QBLOCK_SWEEP = [1024, 2048, 4096]


def same(a: Any, b: tuple[torch.Tensor, torch.Tensor]) -> bool | tuple[int, int, int]:
    """True where the FP8 bytes and scales equal the unfused path's; else ``(bytes differing, scales differing,
    elements)`` for the record."""
    q, s = (a.q, a.scale) if isinstance(a, Fp8Activation) else a
    if torch.equal(q.view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(s, b[1]):
        return True
    return (int((q.view(torch.uint8) != b[0].view(torch.uint8)).sum()), int((s != b[1]).sum()), q.numel())


DEVICE = "cuda"
TIMED = True


def timed(fn: Callable[[], Any]) -> float:
    """``graph_time``'s microseconds on the card; with ``--check``, one call and no time."""
    if TIMED:
        return graph_time(fn)
    fn()
    return 0.0


def gdn_problem(m: int, g: torch.Generator) -> dict[str, Any]:
    conv_dim = 2 * HK * D + HV * D
    pool = m + 8

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, device=DEVICE, generator=g) * scale

    return dict(x=rnd(m, conv_dim).bfloat16(), z=rnd(m, HV * D).bfloat16(), b=rnd(m, HV).bfloat16(),
                a=rnd(m, HV).bfloat16(), conv_weight=rnd(conv_dim, CONV_K, scale=0.5).bfloat16(),
                a_log=torch.rand(HV, device=DEVICE, generator=g).log1p(),
                dt_bias=torch.rand(HV, device=DEVICE, generator=g) + 0.5,
                norm_weight=torch.ones(D, device=DEVICE, dtype=torch.bfloat16), eps=1e-6,
                conv_state=rnd(pool, conv_dim, CONV_K - 1).bfloat16(), ssm_state=rnd(pool, HV, D, D, scale=0.3),
                state_slots=torch.randperm(pool, device=DEVICE, generator=g)[:m],
                query_start_loc=torch.arange(m + 1, device=DEVICE, dtype=torch.int32), num_k_heads=HK)


def rows_for(m: int) -> list[dict[str, Any]]:
    g = torch.Generator(device=DEVICE).manual_seed(m)
    out: list[dict[str, Any]] = []

    def add(what: str, us: float, exact: bool | tuple[int, int, int] | None = None, **extra: Any) -> None:
        if isinstance(exact, tuple):  # how far apart: bytes and scales differing, of the elements
            extra["differing"] = dict(zip(("bytes", "scales", "of"), exact, strict=True))
        out.append({"rows": m, "what": what, "us": round(us, 3), **extra,
                    **({} if exact is None else {"same_bytes": exact is True})})
        print(json.dumps(out[-1]), flush=True)

    for k in (HIDDEN, GDN_OUT, INTER):
        x = torch.randn(m, k, device=DEVICE, generator=g).bfloat16()
        want = quantize_rows(x)
        shipped = token_quant_launch(k)
        for block, warps in TOKEN_SWEEP:
            if block > 2 * k and (block, warps) != shipped:
                continue
            launch = (block, warps)
            add(f"quant_rows K={k} block={block} warps={warps}", timed(lambda x=x, la=launch: quantize_rows(
                x, launch=la)), same(quantize_rows(x, launch=launch), want), shipped=launch == shipped)

    x, d = (torch.randn(m, HIDDEN, device=DEVICE, generator=g).bfloat16() for _ in range(2))
    w = torch.randn(HIDDEN, device=DEVICE, generator=g).bfloat16() * 0.1
    plain = rms_norm(x, w, 1e-6)
    assert isinstance(plain, torch.Tensor)
    add("rms_norm fused", timed(lambda: rms_norm(x, w, 1e-6, "fp8")), same(rms_norm(x, w, 1e-6, "fp8"),
                                                                                 quantize_rows(plain)))
    add("rms_norm + quant_rows", timed(lambda: quantize_rows(rms_norm(x, w, 1e-6))))  # type: ignore[arg-type]
    add("add_rms_norm fused", timed(lambda: add_rms_norm(x, d, w, 1e-6, "fp8")))
    add("add_rms_norm + quant_rows", timed(lambda: quantize_rows(add_rms_norm(x, d, w, 1e-6)[1])))  # type: ignore[arg-type]

    y = torch.randn(m, 2 * INTER, device=DEVICE, generator=g).bfloat16()
    gate, up = y.split(INTER, dim=-1)
    want = quantize_rows(silu_mul_triton(gate, up))  # type: ignore[arg-type]
    shipped = gated_quant_launch(INTER)
    for launch in GATED_SWEEP:
        add(f"silu_mul fused block={launch[0]} warps={launch[1]}",
            timed(lambda la=launch: silu_mul_triton(gate, up, "fp8", launch=la)),
            same(silu_mul_triton(gate, up, "fp8", launch=launch), want), shipped=launch == shipped)
    add("silu_mul + quant_rows", timed(lambda: quantize_rows(silu_mul_triton(gate, up))))  # type: ignore[arg-type]

    qg = torch.randn(m, ATTN_HEADS, 2 * ATTN_DIM, device=DEVICE, generator=g).bfloat16()  # (q, gate) per head
    gate_h = qg[:, :, ATTN_DIM:]
    o = torch.randn(m, ATTN_HEADS * ATTN_DIM, device=DEVICE, generator=g).bfloat16()
    add("sigmoid_mul fused", timed(lambda: sigmoid_mul(o, gate_h, "fp8")),
        same(sigmoid_mul(o, gate_h, "fp8"), quantize_rows(sigmoid_mul(o, gate_h))))  # type: ignore[arg-type]
    add("sigmoid_mul + quant_rows", timed(lambda: quantize_rows(sigmoid_mul(o, gate_h))))  # type: ignore[arg-type]

    p = gdn_problem(m, g)
    arr = arrivals_for(p["ssm_state"].shape[0], HK, HV, p["x"].device)
    counts = row_counters_for(p["ssm_state"].shape[0], p["x"].device)
    # the states advance on every call; outputs are compared on one launch from the same pools
    pools = {n: p[n].clone() for n in ("conv_state", "ssm_state")}
    want_out = gdn_decode_fused_triton(**{**p, **{n: t.clone() for n, t in pools.items()}}, arrivals=arr)
    want = quantize_rows(want_out)  # type: ignore[arg-type]
    for qb in QBLOCK_SWEEP:
        got = gdn_decode_fused_triton(**{**p, **{n: t.clone() for n, t in pools.items()}}, arrivals=arr,
                                      quant="fp8", row_counts=counts, qblock=qb)
        add(f"gdn_decode fused quant qblock={qb}", timed(lambda qb=qb: gdn_decode_fused_triton(
            **p, arrivals=arr, quant="fp8", row_counts=counts, qblock=qb)), same(got, want),
            shipped=False)
    add("gdn_decode plain", timed(lambda: gdn_decode_fused_triton(**p, arrivals=arr)))
    # what the layer runs unless HYSERVE_GDN_FUSED_QUANT=1 (the fused quantization lost at every row count here)
    add("gdn_decode plain + quant_rows", timed(lambda: quantize_rows(
        gdn_decode_fused_triton(**p, arrivals=arr))), shipped=True)  # type: ignore[arg-type]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 8, 32, 64])
    ap.add_argument("--out", default=None, help="a directory for fp8_quant_bench.json")
    ap.add_argument("--check", action="store_true", help="the comparisons alone, one row, on the CPU (interpreter)")
    args = ap.parse_args()
    if args.check:
        global DEVICE, TIMED
        assert os.environ.get("TRITON_INTERPRET") == "1", "--check runs the kernels under TRITON_INTERPRET=1"
        from hyserve.testing.triton_interpreter import patch_triton_interpreter

        patch_triton_interpreter()
        DEVICE, TIMED, args.rows = "cpu", False, [1]
    rows = [r for m in args.rows for r in rows_for(m)]
    bad = [r["what"] for r in rows if r.get("same_bytes") is False]
    print(f"\n{'rows':>4} {'us':>8}  what")
    for r in rows:
        print(f"{r['rows']:>4} {r['us']:>8.2f}  {r['what']}{' (shipped)' if r.get('shipped') else ''}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fp8_quant_bench.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if TIMED else "cpu", "torch": torch.__version__,
                       "rows": rows}, f, indent=1)
    if bad:
        print(f"FP8 bytes or scales differ from the unfused path: {bad}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

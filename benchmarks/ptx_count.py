"""Instructions a Triton kernel issues per output element, read from the PTX it compiles to for the H200 (sm_90) on a
machine without a GPU: a first look at a kernel's cost before a card times it (``conv_prefill_bench.py`` does).

The kernel is compiled as a launch with the given argument values would specialize it (Triton's launcher treats an
integer equal to 1 as a constant and marks pointers, and integers divisible by 16, as such, which is what lets it
vectorize loads), so the count is the launch's. Reported: PTX instructions per thread, warp instructions per output
element, and the global / shared memory instructions by width.

    python benchmarks/ptx_count.py            # the conv's prefill program: a block inside a row, a row's first block

The conv case compiles ``_conv1d_fwd_kernel`` twice, every block taking one of its two paths (``_taps_inside_row``,
``_taps_at_row_start``), at the 2B shape's widths (D = 6144, the input projection's rows 8224 wide), bf16, for the
block sizes given.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import sys
from collections import Counter
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hyserve.testing.triton_interpreter import mutated_module

_CONV = "hyserve.kernels.conv._triton"

_MEM = re.compile(r"(ld\.global[.a-z0-9]*|st\.global[.a-z0-9]*|ld\.shared[.a-z0-9]*|st\.shared[.a-z0-9]*)")


def compile_as_launched(fn: Any, types: dict[str, str], values: dict[str, int], consts: dict[str, Any],
                        num_warps: int) -> Any:
    """``fn`` compiled for sm_90 as a launch with ``values`` (the integer arguments) specializes it."""
    params = list(inspect.signature(fn.fn).parameters)
    consts = dict(consts)
    sig: dict[str, str] = {}
    attrs: dict[tuple[int], list[list[Any]]] = {}
    for i, p in enumerate(params):
        if p in consts:
            sig[p] = "constexpr"
        elif types[p].startswith("*"):
            sig[p] = types[p]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif values[p] == 1:
            consts[p] = 1
            sig[p] = "constexpr"
        else:
            sig[p] = types[p]
            if values[p] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def ptx_counts(kernel: Any, outputs_per_program: int, num_warps: int) -> dict[str, Any]:
    ptx = kernel.asm["ptx"]
    lines = [ln.strip() for ln in ptx.splitlines()]
    instrs = [ln for ln in lines if ln and not ln.startswith(("//", ".", "{", "}", "$"))]
    return {"ptx_per_thread": len(instrs),
            "warp_instr_per_output": round(len(instrs) * num_warps / outputs_per_program, 3),
            "memory": dict(sorted(Counter(_MEM.findall(ptx)).items()))}


def conv_report(blocks: list[tuple[int, int, int]]) -> list[dict[str, Any]]:
    """``_conv1d_fwd_kernel`` (GDN's: no bias, the window rolled by its own launch) compiled with one of its two paths
    taken by every block: its source with the branch's condition made constant
    (:func:`hyserve.testing.triton_interpreter.mutated_module`)."""
    act = "bf16"
    types = dict(x_ptr=f"*{act}", w_ptr=f"*{act}", b_ptr=f"*{act}", state_ptr=f"*{act}", slots_ptr="*i64",
                 qsl_ptr="*i32", out_ptr=f"*{act}", out2_ptr=f"*{act}", D="i32", SPLIT="i32", PART="i32", sx_t="i32",
                 sx_d="i32", sw_d="i32", sw_k="i32", ss_s="i32", ss_d="i32", ss_k="i32", so_t="i32", so2_t="i32",
                 so_p="i32")
    values = dict(D=6144, SPLIT=0, PART=6144, sx_t=8224, sx_d=1, sw_d=4, sw_k=1, ss_s=6144 * 3, ss_d=3, ss_k=1,
                  so_t=6144, so2_t=6144, so_p=0)
    kernels = {inside: mutated_module(_CONV, [("if tb * BLOCK_T >= K - 1:", f"if {inside}:")])._conv1d_fwd_kernel
               for inside in (True, False)}
    out = []
    for block_t, block_d, warps in blocks:
        for inside in (True, False):
            k = compile_as_launched(kernels[inside], types, values,
                                    dict(K=4, KM1_PAD=4, BLOCK_T=block_t, BLOCK_D=block_d, FUSE_STATE=False,
                                         HAS_BIAS=False, SPLIT_OUT=False, NORM_FIRST=False), warps)
            row = {"path": "inside a row" if inside else "a row's first block (the window read)",
                   "block": [block_t, block_d], "num_warps": warps,
                   **ptx_counts(k, block_t * block_d, warps)}
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", default="16x128x4,32x128x4", help="BLOCK_T x BLOCK_D x num_warps, comma-separated")
    ap.add_argument("--out", default=None, help="directory for ptx_count.json")
    args = ap.parse_args()
    blocks = [tuple(int(v) for v in b.split("x")) for b in args.blocks.split(",")]
    result = conv_report(blocks)  # type: ignore[arg-type]
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "ptx_count.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

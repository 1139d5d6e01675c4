"""Instructions a Triton kernel issues per output element, read from the PTX it compiles to for the H200 (sm_90) on a
machine without a GPU: a first look at a kernel's cost before a card times it (``conv_prefill_bench.py`` does).

The kernel is compiled as a launch with the given argument values would specialize it (Triton's launcher treats an
integer equal to 1 as a constant and marks pointers, and integers divisible by 16, as such, which is what lets it
vectorize loads), so the count is the launch's. Reported: PTX instructions per thread, warp instructions per output
element, and the global / shared memory instructions by width.

    python benchmarks/ptx_count.py            # the conv's prefill program: a block inside a row, a row's first block
    python benchmarks/ptx_count.py --gdn-decode   # the 9B's GDN decode launches: registers, spills, buffered tiles
    python benchmarks/ptx_count.py --gdn-verify   # the 9B's fused GDN verify: registers and spills

The conv case compiles ``_conv1d_fwd_kernel`` twice, every block taking one of its two paths (``_taps_inside_row``,
``_taps_at_row_start``), at the 2B shape's widths (D = 6144, the input projection's rows 8224 wide), bf16, for the
block sizes given.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import Counter
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hyserve.testing.triton_compile import compile_for_sm90, ptxas_usage
from hyserve.testing.triton_interpreter import mutated_module

_CONV = "hyserve.kernels.conv._triton"

_MEM = re.compile(r"(ld\.global[.a-z0-9]*|st\.global[.a-z0-9]*|ld\.shared[.a-z0-9]*|st\.shared[.a-z0-9]*)")


def compile_as_launched(fn: Any, types: dict[str, str], values: dict[str, int], consts: dict[str, Any],
                        num_warps: int) -> Any:
    """``fn`` compiled for sm_90 as a launch with ``values`` (the integer arguments) specializes it."""
    return compile_for_sm90(fn, types, consts, values, num_warps)


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


# The GDN decode's launches, as the engine picks them or as the switches force them: (name, compile variant, the
# value block, warps, extra constexprs)
GDN_LAUNCHES = [
    ("walk 64 x 4", "gdn_decode_fused_g2_bf16_bf16_state", 64, 4, {}),
    ("walk 128 x 4", "gdn_decode_fused_g2_bf16_bf16_state", 128, 4, {}),
    ("UPFRONT 128 x 4", "gdn_decode_fused_g2_bf16_bf16_state", 128, 4, {"UPFRONT": True}),
    ("UPFRONT 128 x 8", "gdn_decode_fused_g2_bf16_bf16_state", 128, 8, {"UPFRONT": True}),
    ("persistent 128 x 4, 3 stages", "gdn_decode_persist_g2_bf16_bf16_state", 128, 4, {"STAGES": 3}),
    ("persistent 128 x 4, 2 stages", "gdn_decode_persist_g2_bf16_bf16_state", 128, 4, {"STAGES": 2}),
    ("persistent 128 x 4, 1 stage (the rule)", "gdn_decode_persist_g2_bf16_bf16_state", 128, 4, {"STAGES": 1}),
    ("persistent 128 x 4, 1 stage, windows rolled inside", "gdn_decode_persist_g2_bf16_bf16_state_roll", 128, 4,
     {"STAGES": 1, "ROLL": True}),
    ("persistent 128 x 8, 3 stages", "gdn_decode_persist_g2_bf16_bf16_state", 128, 8, {"STAGES": 3}),
    ("split 64 x 4", "gdn_decode_split_g2_bf16_bf16_state", 64, 4, {}),
]
_STAGE_BUFFERS = re.compile(r"local_alloc : \(\) -> !ttg.memdesc<(\d+)x(\d+)x(\d+)xbf16")


def gdn_decode_report(names: list[str] | None = None) -> list[dict[str, Any]]:
    """The 9B's GDN decode launches (bf16 model and state, value-major pool rows) compiled for sm_90 as the card's
    launcher specializes them (``hyserve.kernels.gdn.decode.card_values``): registers a thread and spills (ptxas), the
    programs an SM the registers allow, shared memory, and the state tiles the compiler buffers in shared memory
    ahead of their use (a pipelined loop's stages)."""
    from hyserve.kernels.gdn import decode

    variants = {n: (fn, sig, consts) for n, fn, sig, consts in decode.compile_variants()}
    out = []
    for name, variant, bv, warps, extra in GDN_LAUNCHES:
        if names is not None and name not in names:
            continue
        fn, sig, consts = variants[variant]
        k = compile_as_launched(fn, sig, decode.card_values(), {**consts, "BV": bv, **extra}, warps)
        usage = ptxas_usage(k)
        row = {"launch": name, **usage, "num_warps": warps,
               "programs_an_sm_by_registers": 65536 // (max(usage["registers"], 1) * 32 * warps),
               "shared_bytes": k.metadata.shared,
               "state_tiles_buffered": [int(m[0]) for m in _STAGE_BUFFERS.findall(k.asm["ttgir"])
                                        if int(m[1]) >= 64 and int(m[2]) >= 64]}
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


# The fused GDN verify (MTP's verify rows) by state dtype, value block and warps (the engine's launch: 32 x 4)
GDN_VERIFY_LAUNCHES = [(state, bv, warps) for state in ("fp32", "bf16") for bv, warps in ((32, 4), (64, 4), (32, 2))]


def gdn_verify_report(launches: list[tuple[str, int, int]] | None = None) -> list[dict[str, Any]]:
    """The 9B's fused GDN verify (three positions a row) compiled as the card specializes it
    (``hyserve.kernels.gdn.verify.card_values``): registers a thread, spills and the programs an SM they allow."""
    from hyserve.kernels.gdn import verify

    variants = {n: (fn, sig, consts) for n, fn, sig, consts in verify.compile_variants()}
    out = []
    for state, bv, warps in launches or GDN_VERIFY_LAUNCHES:
        fn, sig, consts = variants[f"gdn_verify_fused_g2_{state}_state"]
        usage = ptxas_usage(compile_as_launched(fn, sig, verify.card_values(), {**consts, "BV": bv}, warps))
        row = {"launch": f"verify {state} state, {bv} x {warps}", **usage, "num_warps": warps,
               "programs_an_sm_by_registers": 65536 // (max(usage["registers"], 1) * 32 * warps)}
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", default="16x128x4,32x128x4", help="BLOCK_T x BLOCK_D x num_warps, comma-separated")
    ap.add_argument("--gdn-decode", action="store_true",
                    help="the 9B's GDN decode launches instead: registers, spills, shared memory, buffered tiles")
    ap.add_argument("--gdn-verify", action="store_true",
                    help="the 9B's fused GDN verify instead: registers and spills by state dtype, block and warps")
    ap.add_argument("--out", default=None, help="directory for ptx_count.json")
    args = ap.parse_args()
    blocks = [tuple(int(v) for v in b.split("x")) for b in args.blocks.split(",")]
    result = (gdn_decode_report() if args.gdn_decode else gdn_verify_report() if args.gdn_verify
              else conv_report(blocks))  # type: ignore[arg-type]
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "ptx_count.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

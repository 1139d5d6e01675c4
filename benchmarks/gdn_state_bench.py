"""How fast a decode step's delta rule can read and write the Gated DeltaNet state, in the state's two layouts, on one
GPU: the question under issue 34's batch-64 gap (the shipped fused decode moved a 9B layer's bf16 state at 1.37 TB/s
on an H100, the card copies at about 2.95).

    python benchmarks/gdn_state_bench.py --out $OUT                  # 9B and 27B heads, batch 1, 8, 32, 64
    python benchmarks/gdn_state_bench.py --check                     # CPU, TRITON_INTERPRET=1: against the reference

Every variant is one program per (row, value head, value block of ``BV`` channels), as the shipped split launch
(``_gdn_decode_split_kernel``), on rows at shuffled slots of a pool, captured in a CUDA graph of 20 calls:

* ``copy``: the program reads its ``Dk x BV`` tile of the state and writes it back unchanged: the rate this access
  pattern allows (the bound of the rows below).
* ``delta``: the delta rule alone on that tile (decay, the key reduction ``k^T S``, the rank-one update, the query
  reduction ``q^T S``), its inputs ready-made (q, k normalized, gates computed): the rule's own cost over the copy.
* layout ``k``: the state as hyserve stores it, ``[slot, head, Dk, Dv]`` (a tile row is ``BV`` contiguous values;
  both reductions run across the tile's rows). Layout ``v``: value-major, ``[slot, head, Dv, Dk]`` (as vLLM's decode
  kernel and fla's ``state_v_first`` keep it: a tile row is a whole 128-key row, the reductions run along it).
* ``delta1``: the same rule with both reductions read from the decayed state before the update (``ONEPASS``).
* ``fused``: the shipped fused decode (conv, gates, rule, gated norm, one launch) at its split launches, for the
  overhead of everything the rule alone leaves out.

What it answers: whether the rule reaches the copy rate in either layout; if only the value-major layout does, the
state's layout is what to change (fla's prefill takes ``state_v_first``); if neither, the rule's arithmetic is.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

HEADS = {"9b": (16, 32), "27b": (16, 48)}  # (key heads, value heads) of one rank; Dk = Dv = 128
D = 128


@triton.jit
def _state_tile_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, state_ptr, slots_ptr, out_ptr,
                       ss_s, ss_h, ss_a, ss_b,
                       HK, HV, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                       VFIRST: tl.constexpr, COPY: tl.constexpr, ONEPASS: tl.constexpr = False):  # fmt: skip
    """Program ``(r, h * NVB + j)``: row ``r``'s value block ``j`` of head ``h``. The state's axes 2 and 3 are
    (key, value) (``VFIRST`` false, strides ``ss_a``, ``ss_b``) or (value, key) (``VFIRST``).

    ``ONEPASS``: both reductions over the decayed state read before the update, ``a = (gS)^T k`` and
    ``b = (gS)^T q``, then ``o = b + (k . q) delta`` (equal to ``S'^T q`` in exact arithmetic, not bit for bit): two
    independent reductions in place of reduce, update, reduce."""
    r = tl.program_id(0)
    hj = tl.program_id(1)
    NVB: tl.constexpr = DV // BV
    h = hj // NVB
    vb = (hj % NVB) * BV
    hk = h // (HV // HK)
    slot = tl.load(slots_ptr + r).to(tl.int64)
    ok = tl.arange(0, DK)
    ov = vb + tl.arange(0, BV)
    base = state_ptr + slot * ss_s + h * ss_h
    if VFIRST:
        ptrs = base + ov[:, None] * ss_a + ok[None, :] * ss_b  # [BV, DK]: a row is DK contiguous keys
    else:
        ptrs = base + ok[:, None] * ss_a + ov[None, :] * ss_b  # [DK, BV]: a row is BV contiguous values
    S = tl.load(ptrs).to(tl.float32)
    if not COPY:
        qv = tl.load(q_ptr + (r * HK + hk) * DK + ok).to(tl.float32)
        kv = tl.load(k_ptr + (r * HK + hk) * DK + ok).to(tl.float32)
        vv = tl.load(v_ptr + (r * HV + h) * DV + ov).to(tl.float32)
        gt = tl.load(g_ptr + r * HV + h)
        bt = tl.load(b_ptr + r * HV + h)
        S = S * tl.exp(gt)
        if ONEPASS:
            kq = tl.sum(kv * qv, axis=0)
            if VFIRST:
                delta = (vv - tl.sum(S * kv[None, :], axis=1)) * bt
                o = tl.sum(S * qv[None, :], axis=1) + kq * delta
                S = S + delta[:, None] * kv[None, :]
            else:
                delta = (vv - tl.sum(S * kv[:, None], axis=0)) * bt
                o = tl.sum(S * qv[:, None], axis=0) + kq * delta
                S = S + kv[:, None] * delta[None, :]
        elif VFIRST:
            delta = (vv - tl.sum(S * kv[None, :], axis=1)) * bt
            S = S + delta[:, None] * kv[None, :]
            o = tl.sum(S * qv[None, :], axis=1)
        else:
            delta = (vv - tl.sum(S * kv[:, None], axis=0)) * bt
            S = S + kv[:, None] * delta[None, :]
            o = tl.sum(S * qv[:, None], axis=0)
        tl.store(out_ptr + (r * HV + h) * DV + ov, o.to(out_ptr.dtype.element_ty))
    tl.store(ptrs, S.to(state_ptr.dtype.element_ty))


def problem(batch: int, hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype, state_dtype: torch.dtype,
            device: str) -> dict[str, Any]:
    """Decode inputs of ``batch`` rows on shuffled slots of a pool with room for 8 more; the state key-major."""
    g = torch.Generator(device=device).manual_seed(batch * 131 + hv)
    pool = batch + 8

    def unit(*shape: int) -> torch.Tensor:
        x = torch.randn(*shape, device=device, generator=g)
        return (x / x.norm(dim=-1, keepdim=True)).to(dtype)

    return dict(q=unit(batch, hk, dk) * dk**-0.5, k=unit(batch, hk, dk),
                v=torch.randn(batch, hv, dv, device=device, generator=g).to(dtype),
                g=-torch.rand(batch, hv, device=device, generator=g), beta=torch.rand(batch, hv, device=device,
                                                                                      generator=g),
                state=(torch.randn(pool, hv, dk, dv, device=device, generator=g) * 0.3).to(state_dtype),
                slots=torch.randperm(pool, device=device, generator=g)[:batch].to(torch.int32))


def reference(p: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(output ``[B, Hv, Dv]``, the pool after the step, key-major), float32 from the same inputs."""
    q, k, v = (p[n].float() for n in "qkv")
    group = v.shape[1] // q.shape[1]
    q, k = q.repeat_interleave(group, 1), k.repeat_interleave(group, 1)
    slots = p["slots"].long()
    s = p["state"][slots].float() * p["g"].exp()[..., None, None]
    delta = (v - torch.einsum("bhkv,bhk->bhv", s, k)) * p["beta"][..., None]
    s = s + k[..., :, None] * delta[..., None, :]
    pool = p["state"].float().clone()
    pool[slots] = s
    return torch.einsum("bhkv,bhk->bhv", s, q), pool


def launch(p: dict[str, Any], state: torch.Tensor, out: torch.Tensor, bv: int, warps: int, vfirst: bool,
           copy: bool, onepass: bool = False) -> torch.Tensor:
    """One launch over ``state`` (``p["state"]``'s shape in the layout ``vfirst`` says)."""
    batch, hk, dk = p["q"].shape
    hv, dv = p["v"].shape[1:]
    _state_tile_kernel[(batch, hv * (dv // bv))](
        p["q"], p["k"], p["v"], p["g"], p["beta"], state, p["slots"], out, *state.stride(),
        HK=hk, HV=hv, DK=dk, DV=dv, BV=bv, VFIRST=vfirst, COPY=copy, ONEPASS=onepass, num_warps=warps)
    return out


def check() -> int:
    """Both layouts' rule against :func:`reference` (and the copy leaving the pool as it was), small heads, every
    value block; run under ``TRITON_INTERPRET=1`` on the CPU. Exit 1 on a mismatch."""
    bad = 0
    for hk, hv, bv in ((2, 4, 8), (2, 2, 16), (1, 3, 4)):
        p = problem(3, hk, hv, 16, 16, torch.float32, torch.float32, "cpu")
        want_out, want_pool = reference(p)
        for vfirst in (False, True):
            errs = []
            for onepass in (False, True):
                state = p["state"].transpose(2, 3).contiguous() if vfirst else p["state"].clone()
                out = torch.zeros(p["v"].shape)
                launch(p, state, out, bv, 1, vfirst, copy=False, onepass=onepass)
                pool = state.transpose(2, 3) if vfirst else state
                errs.append(max(float((out - want_out).abs().max()), float((pool - want_pool).abs().max())))
            copied = p["state"].transpose(2, 3).contiguous() if vfirst else p["state"].clone()
            launch(p, copied, torch.zeros(p["v"].shape), bv, 1, vfirst, copy=True)
            same = torch.equal(copied.transpose(2, 3) if vfirst else copied, p["state"])
            print(f"heads {hk}/{hv} BV {bv} layout {'v' if vfirst else 'k'}: max diff {errs[0]:.2e}, one pass "
                  f"{errs[1]:.2e}, copy intact {same}")
            bad += max(errs) > 1e-5 or not same
    return 1 if bad else 0


def main() -> int:
    from gdn_decode_bench import graph_time
    from gdn_decode_bench import problem as fused_problem

    from hyserve.kernels.gdn.decode import arrivals_for, gdn_decode_fused_triton, head_counters_for

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="CPU, TRITON_INTERPRET=1: both layouts against the reference")
    ap.add_argument("--shapes", nargs="+", default=list(HEADS), choices=list(HEADS))
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8, 32, 64])
    ap.add_argument("--block-v", nargs="+", type=int, default=[32, 64, 128])
    ap.add_argument("--warps", nargs="+", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--state-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default=None, help="a directory for gdn_state_bench.json")
    args = ap.parse_args()
    if args.check:
        return check()
    dtype, state_dtype = torch.bfloat16, getattr(torch, args.state_dtype)
    rows = []
    for shape in args.shapes:
        hk, hv = HEADS[shape]
        for batch in args.batch:
            p = problem(batch, hk, hv, D, D, dtype, state_dtype, "cuda")
            want_out, _ = reference(p)
            state_bytes = 2 * batch * hv * D * D * p["state"].element_size()
            row: dict[str, Any] = {"shape": shape, "batch": batch, "state_MB": state_bytes / 1e6}
            out = torch.empty(p["v"].shape, device="cuda", dtype=dtype)
            for vfirst in (False, True):
                lay = "v" if vfirst else "k"
                state = p["state"].transpose(2, 3).contiguous() if vfirst else p["state"].clone()
                for bv in args.block_v:
                    for w in args.warps:
                        for kind in ("copy", "delta", "delta1"):
                            row[f"{kind}_{lay}_bv{bv}w{w}_us"] = graph_time(
                                lambda p=p, s=state, o=out, bv=bv, w=w, vf=vfirst, c=kind == "copy",
                                one=kind == "delta1": launch(p, s, o, bv, w, vf, c, one))
                # once more from the untouched pool: the rule's output against the reference
                fresh = p["state"].transpose(2, 3).contiguous() if vfirst else p["state"].clone()
                launch(p, fresh, out, 32, 4, vfirst, copy=False)
                row[f"max_diff_{lay}"] = float((out.float() - want_out).abs().max())
                fresh = p["state"].transpose(2, 3).contiguous() if vfirst else p["state"].clone()
                launch(p, fresh, out, 32, 4, vfirst, copy=False, onepass=True)
                row[f"max_diff_{lay}_onepass"] = float((out.float() - want_out).abs().max())
            fp = fused_problem(batch, hk, hv, dtype, state_dtype)
            arrivals = arrivals_for(fp["ssm_state"].shape[0], hk, hv, fp["x"].device, split=True)
            heads = head_counters_for(fp["ssm_state"].shape[0], hv, fp["x"].device)
            for bv, w in ((32, 1), (32, 2), (64, 4)):
                row[f"fused_bv{bv}w{w}s_us"] = graph_time(
                    lambda fp=fp, a=arrivals, hc=heads, bv=bv, w=w: gdn_decode_fused_triton(
                        **fp, arrivals=a, block_v=bv, num_warps=w, split=True, head_counts=hc))
            for kind in ("copy_k", "copy_v", "delta_k", "delta_v", "delta1_k", "delta1_v", "fused"):
                best = min((v, k) for k, v in row.items() if k.startswith(kind + "_") and k.endswith("_us"))
                row[f"best_{kind}"] = {"us": best[0], "launch": best[1], "TBps": state_bytes / best[0] / 1e6}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if not k.endswith("_us")}), flush=True)
    kinds = ("copy_k", "copy_v", "delta_k", "delta_v", "delta1_k", "delta1_v", "fused")
    print(f"\n{'shape':>6} {'batch':>5} {'state MB':>8} " + " ".join(f"{k + ' us (TB/s)':>22}" for k in kinds))
    for row in rows:
        print(f"{row['shape']:>6} {row['batch']:>5} {row['state_MB']:>8.1f} " + " ".join(
            f"{row[f'best_{k}']['us']:>12.2f} ({row[f'best_{k}']['TBps']:5.2f})   " for k in kinds))
    for row in rows:
        print(f"{row['shape']} b{row['batch']}: " + ", ".join(
            f"{k} {row[f'best_{k}']['launch'].removeprefix(k + '_').removesuffix('_us')}" for k in kinds))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gdn_state_bench.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "state_dtype": args.state_dtype, "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

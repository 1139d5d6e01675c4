"""Qwen4-Exp's Triton kernels (QSA scores, pooled scores, lanes, index-key store and attention; the
hyper-connections; the PLE n-grams)
compiled for the H200 (sm_90) on the CPU, with no GPU: Triton's front end and its bundled ptxas see type and
constexpr errors the interpreter (which runs the kernels' Python, ``tests/model/test_qsa.py`` and the others) does
not. One compile per variant the launchers make for bf16 models (an FP8 KV cache too, and a split and a single
program); the same in float32 for QSA's attention, whose tiles are the largest.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest

triton = pytest.importorskip("triton")


def _compile(fn: Any, sig: dict[str, str], consts: dict[str, Any]) -> Any:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    params = list(inspect.signature(fn.fn).parameters)
    missing = [p for p in params if p not in sig and p not in consts]
    assert not missing, f"no type given for {missing}"
    signature = {p: "constexpr" if p in consts else sig[p] for p in params}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=consts), target=GPUTarget("cuda", 90, 32))


def _variants() -> list[tuple[str, Any, dict[str, str], dict[str, Any]]]:
    from hyserve.kernels.attention import _triton as at
    from hyserve.kernels.hyper_connection import _triton as hc
    from hyserve.kernels.ple import _triton as pl

    out = []
    bf = "*bf16"
    i32 = "i32"
    out.append(("qsa_scores", at._qsa_scores_kernel,
                dict(iq_ptr=bf, bk_ptr=bf, rows_ptr="*i64", vis_ptr="*i64", out_ptr="*fp32", siq_t=i32, siq_h=i32,
                     sbk_r=i32, sbk_j=i32, so_t=i32, sqrt_d="fp32", NBK=i32),
                dict(HI=16, HI_PAD=16, DI=128, BLOCK_DI=128, BLOCK_J=64, PRECISION="tf32")))
    out.append(("qsa_pool_scores", at._qsa_pool_scores_kernel,
                dict(iq_ptr=bf, ic_ptr=bf, bt_ptr="*i32", rows_ptr="*i64", vis_ptr="*i64", kw_ptr=bf,
                     invf_ptr="*fp32", out_ptr="*fp32", siq_t=i32, siq_h=i32, sic_b=i32, sic_o=i32, sbt_r=i32,
                     so_t=i32, sqrt_d="fp32", eps="fp32", NBK=i32),
                dict(HI=16, HI_PAD=16, DI=128, BLOCK_DI=128, R2=32, C=4, BS=16, BLOCK_J=16, PRECISION="tf32")))
    out.append(("qsa_positions", at._qsa_positions_kernel,
                dict(best_ptr="*i64", qpos_ptr="*i64", vis_ptr="*i64", pos_ptr="*i32", sb_t=i32, sp_t=i32, S=i32),
                dict(TOP=512, C=4, SPARSE=True, BLOCK_S=1024)))
    out.append(("store_index_keys", at._store_index_keys_kernel,
                dict(k_ptr=bf, c_ptr=bf, slot_ptr="*i64", sk_t=i32, sc_b=i32, sc_o=i32),
                dict(D=128, BLOCK_D=128, BS=16)))
    attend = dict(bt_ptr="*i32", rows_ptr="*i64", pos_ptr="*i32", po_ptr="*fp32", pml_ptr="*fp32", ks_ptr="*fp32",
                  vs_ptr="*fp32", qk_scale="fp32", S=i32,
                  **{k: i32 for k in ("sq_t", "sq_h", "so_t", "so_h", "sp_t", "sbt_r", "skc_b", "skc_o", "skc_h",
                                      "svc_b", "svc_o", "svc_h", "spo_r", "spo_h", "spo_s", "spml_r", "spml_h",
                                      "spml_s")})
    for q, kv, single in (("bf16", "bf16", True), ("bf16", "bf16", False), ("bf16", "fp8e4nv", False),
                          ("fp32", "fp32", True)):
        out.append((f"qsa_attend_{q}_{kv}_{'single' if single else 'splits'}", at._qsa_attend_kernel,
                    dict(attend, q_ptr=f"*{q}", kc_ptr=f"*{kv}", vc_ptr=f"*{kv}", out_ptr=f"*{q}"),
                    dict(GROUP=8, G_PAD=16, D=256, BLOCK_D=256, BS=16, BLOCK_N=32, PART=160, SINGLE=single,
                         PRECISION="ieee" if q == "fp32" else "tf32", FP8=kv == "fp8e4nv")))
    for inject, norm in ((True, True), (False, True), (True, False)):
        out.append((f"hc_inject_norm_{inject}_{norm}", hc._hc_inject_norm_kernel,
                    dict(x_ptr=bf, o_ptr=bf, w_ptr=bf, xo_ptr=bf, y_ptr=bf, nw_ptr=bf, sx_t=i32, so_t=i32, sw_t=i32,
                         sxo_t=i32, sy_t=i32, eps="fp32"),
                    dict(H=2048, BLOCK_H=2048, INJECT=inject, NORM=norm)))
    for has in (True, False):
        out.append((f"hc_gates_{has}", hc._hc_gates_kernel,
                    dict(d_ptr=bf, i_ptr=bf, g_ptr=bf, iw_ptr=bf, sd_t=i32, si_t=i32, sg_t=i32, siw_t=i32, S="fp32"),
                    dict(R=128, BLOCK_R=128, NS=4, BLOCK_S=4, HAS_INJECT=has)))
    out.append(("hc_mix", hc._hc_mix_kernel, dict(u_ptr=bf, n_ptr=bf, m_ptr=bf, su_t=i32, sn_t=i32, sm_t=i32),
                dict(NS=4, H=2048, BLOCK=1024)))
    out.append(("ngram_embed", pl._ngram_embed_kernel,
                dict(tok_ptr="*i64", mult_ptr="*i64", size_ptr="*i64", off_ptr="*i64", table_ptr=bf, out_ptr=bf,
                     stok_t=i32, stab_r=i32, sout_t=i32, eos=i32),
                dict(N=3, HPN=4, D=256, BLOCK_D=256)))
    return out


def test_qwen4_exp_kernels_compile_for_sm90() -> None:
    failures = {}
    for name, fn, sig, consts in _variants():
        try:
            kernel = _compile(fn, sig, consts)
            assert kernel.asm.get("cubin"), "no cubin"
        except Exception as e:  # report every variant, not the first
            failures[name] = f"{type(e).__name__}: {str(e)[:400]}"
    assert not failures, failures


def test_a_broken_kernel_does_not_compile() -> None:
    """The check can fail: a kernel adding a pointer to a float does not compile."""
    import triton.language as tl

    @triton.jit
    def broken(x_ptr, y):
        tl.store(x_ptr + y, 1.0)

    with pytest.raises(Exception):  # Triton's compile error types vary by version
        _compile(broken, dict(x_ptr="*fp32", y="fp32"), {})

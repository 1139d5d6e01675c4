"""The producers that quantize for an FP8 GEMM in their own launch (``hyserve.kernels.norm``: the zero-centred RMSNorm,
its residual add, the SwiGLU, the attention output's sigmoid gate read per head where q_proj wrote it, each with
``quant="fp8"`` or ``"fp8+plain"``), under the Triton interpreter
(``TRITON_INTERPRET=1``, one subprocess: the variable must be set before any kernel is decorated).

The claim checked: the fused launch writes the bits the unfused path writes on the card, that is the producer's own
kernel (its plain output) followed by the per-token quantization whose arithmetic is
``hyserve.kernels.fp8.quantize_per_token`` (``max(amax, eps) / 448``, a correctly rounded division, round to nearest
even on the cast). So the FP8 values (as bytes) and the float32 scales must be equal exactly, and the plain output
(``fp8+plain``) and the residual equal to the unfused kernel's bit for bit. The dequantized values are also compared
with the plain-torch reference (norm or SwiGLU in float32, then quantized) within one e4m3 step.

Problems: bf16, fp16 and float32 rows; widths 37 and 64 (several rows a program), 1100 and 5120 (one row a
program); T = 0, 1 and 7; the SwiGLU at 37 and 3000 columns (two 2048-column passes) on strided views of one merged
projection output, its largest element in the second pass. Each sabotaged check must disagree with what the kernel
wrote: the scale taken from the norm before its rounding to the row dtype, one scale for the whole batch instead of
one a token, the SwiGLU's amax over its first pass only, and the norm of the residual stream without the add.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch

from hyserve.kernels.fp8 import FP8_MAX, Fp8Activation, quantize_fp8, quantize_per_token
from hyserve.kernels.norm import add_rms_norm_ref, rms_norm_ref, silu_mul_ref
from hyserve.testing.triton_interpreter import interpreter_subprocess_results, print_results, record_check

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
DTYPES = {"float32": F32, "bfloat16": BF16, "float16": F16}
EPS = 1e-6
WIDTHS = (37, 64, 1100, 5120)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _same(act: Any, q: torch.Tensor, s: torch.Tensor) -> tuple[bool, str]:
    """``act`` an Fp8Activation holding exactly ``(q, s)``."""
    if not isinstance(act, Fp8Activation):
        return False, f"not an Fp8Activation: {type(act).__name__}"
    if act.q.shape != q.shape or act.scale.shape != s.shape:
        return False, f"shapes {tuple(act.q.shape)} {tuple(act.scale.shape)} != {tuple(q.shape)} {tuple(s.shape)}"
    if q.numel() == 0:
        return True, "empty"
    nq = int((_bits(act.q) != _bits(q)).sum())
    ns = int((act.scale != s).sum())
    return nq == 0 and ns == 0, f"{nq} fp8 values and {ns} scales differ"


def _near_reference(act: Fp8Activation, want: torch.Tensor) -> tuple[bool, str]:
    """The dequantized activation within one e4m3 step (1/8 relative, plus the scale) of the torch reference."""
    if want.numel() == 0:
        return True, "empty"
    deq = act.q.float() * act.scale
    tol = want.float().abs() / 8 + act.scale
    ok = bool(((deq - want.float()).abs() <= tol).all())
    return ok, f"max err {float((deq - want.float()).abs().max()):.3g}"


def _rows(t: int, d: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    scale = torch.rand(t, 1, generator=gen) * 4 + 0.1  # tokens of different magnitudes
    return (torch.randn(t, d, generator=gen) * scale).to(dtype)


def _interp_norm(dtype: torch.dtype, d: int, add: bool, keep: bool, sabotage: str = "") -> tuple[bool, str]:
    """The (residual-add) norm quantizing at T = 0, 1, 7 against the unfused kernel + quantize_per_token, bit for
    bit. ``sabotage``: ``"unrounded"`` (the expected scale from the float32 norm before its rounding),
    ``"tensor"`` (one scale for the batch), ``"no_add"`` (the norm of ``x`` alone)."""
    from hyserve.kernels.norm import add_rms_norm_triton, rms_norm_triton

    gen = torch.Generator().manual_seed(d * 7 + (3 if add else 0))
    goods, msgs = [], []
    for t in (0, 1, 7):
        x, delta = _rows(t, d, dtype, gen), _rows(t, d, dtype, gen)
        w = (torch.randn(d, generator=gen) * 0.2).to(dtype)
        quant = "fp8+plain" if keep else "fp8"
        if add:
            res, act = add_rms_norm_triton(x, delta, w, EPS, quant)
            res0, plain = add_rms_norm_triton(x, delta, w, EPS)
            ok_res = torch.equal(res, res0) and torch.equal(res, x + delta)
            ref = add_rms_norm_ref(x, delta, w, EPS)[1]
        else:
            act = rms_norm_triton(x, w, EPS, quant)
            plain = rms_norm_triton(x, w, EPS)
            ok_res = True
            ref = rms_norm_ref(x, w, EPS)
        assert isinstance(plain, torch.Tensor)
        basis = plain
        if sabotage == "unrounded":  # the norm in float32, not rounded to the row dtype
            xs = (x + delta).float() if add else x.float()
            basis = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + EPS) * (1.0 + w.float())
        elif sabotage == "no_add":
            basis = rms_norm_triton(x, w, EPS)  # type: ignore[assignment]
        if sabotage == "tensor" and t:
            s = basis.float().abs().amax().clamp(min=1e-10).reshape(1, 1).expand(t, 1) / FP8_MAX
            q = quantize_fp8(basis, s)
        else:
            q, s = quantize_per_token(basis.reshape(t, d))
        ok, msg = _same(act, q, s)
        if keep and isinstance(act, Fp8Activation):
            ok = ok and act.plain is not None and torch.equal(act.plain.reshape(plain.shape), plain)
        elif isinstance(act, Fp8Activation):
            ok = ok and act.plain is None
        near, nmsg = _near_reference(act, ref) if isinstance(act, Fp8Activation) else (False, "")
        goods.append(ok and ok_res and (near or bool(sabotage)))
        msgs.append(f"T={t}: {msg}, residual {ok_res}, reference {nmsg}")
    return all(goods) != bool(sabotage), "; ".join(msgs)


def _interp_silu(dtype: torch.dtype, f: int, keep: bool, sabotage: str = "",
                 launch: tuple[int, int] | None = None) -> tuple[bool, str]:
    """The SwiGLU quantizing, on gate/up views of one (T, 2F) projection output, against the unfused kernel +
    quantize_per_token. ``sabotage="first_pass"``: the expected amax over the first 2048 columns only. ``launch``:
    the quantizing pass's ``(BLOCK_F, num_warps)`` (the benchmark's sweep) instead of the default."""
    from hyserve.kernels.norm import silu_mul_triton

    gen = torch.Generator().manual_seed(f)
    goods, msgs = [], []
    for t in (0, 1, 7):
        y = _rows(t, 2 * f, dtype, gen)
        if t and f > 2048:
            y[:, f - 5] = 9.0  # each token's largest product sits in the second pass (the gate's column f - 5)
            y[:, 2 * f - 5] = 9.0
        gate, up = y.split(f, dim=-1)
        act = silu_mul_triton(gate, up, "fp8+plain" if keep else "fp8", launch=launch)
        plain = silu_mul_triton(gate, up)
        assert isinstance(plain, torch.Tensor)
        if sabotage == "first_pass" and t:
            s = plain[:, :2048].float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-10) / FP8_MAX
            q = quantize_fp8(plain, s)
        else:
            q, s = quantize_per_token(plain)
        ok, msg = _same(act, q, s)
        if keep and isinstance(act, Fp8Activation):
            ok = ok and act.plain is not None and torch.equal(act.plain, plain)
        near, nmsg = _near_reference(act, silu_mul_ref(gate, up)) if isinstance(act, Fp8Activation) else (False, "")
        goods.append(ok and (near or bool(sabotage)))
        msgs.append(f"T={t}: {msg}, reference {nmsg}")
    return all(goods) != bool(sabotage), "; ".join(msgs)


def _interp_sigmoid_read_plain() -> tuple[bool, str]:
    """The gate kernels told the per-head gate is a plain row (``PER_HEAD`` off: the launch's flag mutated, plain
    and quantizing), which must read the wrong columns: the check passes when both disagree with torch's formula."""
    from hyserve.testing.triton_interpreter import mutated_module

    norm = mutated_module("hyserve.kernels.norm", [("PER_HEAD=sgh != 0, num_warps=4)", "PER_HEAD=False, num_warps=4)"),
                                                   ("PER_HEAD=sgh != 0,\n", "PER_HEAD=False,\n")])
    gen = torch.Generator().manual_seed(22)
    qg = _rows(5, 3 * 2 * 40, BF16, gen).view(5, 3, 80)
    gate, x = qg[:, :, 40:], _rows(5, 120, BF16, gen)
    want = x * torch.sigmoid(gate.reshape(5, 120))
    plain = norm.sigmoid_mul_triton(x, gate)
    act = norm.sigmoid_mul_triton(x, gate, "fp8")
    deq = act.q.float() * act.scale
    wrong_plain = float((plain.float() - want.float()).abs().max()) > 0.05
    wrong_fp8 = float((deq - want.float()).abs().max()) > 0.1
    return wrong_plain and wrong_fp8, f"plain wrong {wrong_plain}, fp8 wrong {wrong_fp8}"


def _interp_sigmoid(dtype: torch.dtype, quant: str | None, sabotage: bool = False) -> tuple[bool, str]:
    """The attention output's gate, ``x * sigmoid(gate)`` with the gate read per head from q_proj's (T, H, 2D)
    output, against torch's formula (within one unit in the last place, in at most 2 % of the elements) and, with
    ``quant``, its FP8 form against the plain kernel + quantize_per_token bit for bit. ``sabotage``: the expected
    values from the gate read as if its heads were contiguous."""
    from hyserve.kernels.norm import sigmoid_mul_triton

    gen = torch.Generator().manual_seed(21)
    goods, msgs = [], []
    heads, d = 3, 40
    for t in (0, 1, 7):
        qg = _rows(t, heads * 2 * d, dtype, gen).view(t, heads, 2 * d)
        gate = qg[:, :, d:]
        x = _rows(t, heads * d, dtype, gen)
        g_seen = qg[:, :, :d] if sabotage else gate
        want = x * torch.sigmoid(g_seen.reshape(t, heads * d))
        plain = sigmoid_mul_triton(x, gate)
        assert isinstance(plain, torch.Tensor)
        n = int((plain != want).sum())
        err = float(((plain.float() - want.float()).abs() / want.float().abs().clamp(min=1e-30)).max()) if t else 0.0
        if dtype == F32:  # exp's float32 implementations differ in the last bits: a relative bound
            ok = err <= 1e-6
        else:
            ulp = 2.0 ** (-7 if dtype == BF16 else -10)
            ok = err <= ulp * 1.01 and n <= max(1, plain.numel() // 50)
        msg = f"T={t}: {n} differ from torch (max rel {err:.3g})"
        if quant is not None:
            ok2, msg2 = _same(sigmoid_mul_triton(x, gate, quant), *quantize_per_token(plain))
            ok, msg = ok and ok2, f"{msg}, quantized: {msg2}"
        goods.append(ok)
        msgs.append(msg)
    return all(goods) != sabotage, "; ".join(msgs)


def run_interpreter_checks() -> dict[str, list[Any]]:
    """Every check under the interpreter; {name: [ok, message]}. Needs TRITON_INTERPRET=1."""
    from hyserve.testing.triton_interpreter import patch_triton_interpreter

    assert os.environ.get("TRITON_INTERPRET") == "1"
    patch_triton_interpreter()
    res: dict[str, list[Any]] = {}
    for n, dt in DTYPES.items():
        for d in WIDTHS:
            record_check(res, f"norm_{d}_{n}", lambda dt=dt, d=d: _interp_norm(dt, d, add=False, keep=False))
            record_check(res, f"add_norm_{d}_{n}", lambda dt=dt, d=d: _interp_norm(dt, d, add=True, keep=False))
        record_check(res, f"norm_keep_{n}", lambda dt=dt: _interp_norm(dt, 64, add=False, keep=True))
        record_check(res, f"add_norm_keep_{n}", lambda dt=dt: _interp_norm(dt, 1100, add=True, keep=True))
        for f in (37, 3000):
            record_check(res, f"silu_{f}_{n}", lambda dt=dt, f=f: _interp_silu(dt, f, keep=False))
        record_check(res, f"silu_keep_{n}", lambda dt=dt: _interp_silu(dt, 3000, keep=True))
        record_check(res, f"silu_3000_block256_{n}", lambda dt=dt: _interp_silu(dt, 3000, keep=False,
                                                                                 launch=(256, 2)))
        record_check(res, f"sigmoid_gate_{n}", lambda dt=dt: _interp_sigmoid(dt, None))
        record_check(res, f"sigmoid_gate_fp8_{n}", lambda dt=dt: _interp_sigmoid(dt, "fp8"))
    record_check(res, "scale_before_rounding_caught",
                 lambda: _interp_norm(BF16, 64, add=False, keep=False, sabotage="unrounded"))
    record_check(res, "one_scale_for_the_batch_caught",
                 lambda: _interp_norm(BF16, 1100, add=True, keep=False, sabotage="tensor"))
    record_check(res, "norm_without_the_add_caught",
                 lambda: _interp_norm(BF16, 64, add=True, keep=False, sabotage="no_add"))
    record_check(res, "sigmoid_gate_heads_contiguous_caught", lambda: _interp_sigmoid(BF16, None, sabotage=True))
    record_check(res, "sigmoid_gate_read_as_plain_rows_caught", _interp_sigmoid_read_plain)
    record_check(res, "silu_first_pass_amax_caught", lambda: _interp_silu(BF16, 3000, keep=False,
                                                                          sabotage="first_pass"))
    return res


INTERP_CHECKS = [
    *[f"{k}_{d}_{n}" for n in DTYPES for d in WIDTHS for k in ("norm", "add_norm")],
    *[f"{k}_{n}" for n in DTYPES for k in ("norm_keep", "add_norm_keep", "silu_37", "silu_3000", "silu_keep",
                                          "silu_3000_block256", "sigmoid_gate", "sigmoid_gate_fp8")],
    "sigmoid_gate_heads_contiguous_caught", "sigmoid_gate_read_as_plain_rows_caught", "scale_before_rounding_caught",
    "one_scale_for_the_batch_caught",
    "norm_without_the_add_caught", "silu_first_pass_amax_caught",
]


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, list[Any]]:
    pytest.importorskip("triton")
    return interpreter_subprocess_results(__file__, "--interpreter-checks")


def test_every_check_ran(interpreter_results: dict[str, list[Any]]) -> None:
    assert sorted(interpreter_results) == sorted(INTERP_CHECKS)


@pytest.mark.parametrize("name", INTERP_CHECKS)
def test_fp8_producer_kernels_under_the_interpreter(interpreter_results: dict[str, list[Any]], name: str) -> None:
    ok, msg = interpreter_results[name]
    assert ok, f"{name}: {msg}"


def test_cpu_producers_are_the_reference_quantized() -> None:
    """Off CUDA the producers' quantized forms are the references' outputs quantized per token, bit for bit."""
    from hyserve.kernels.norm import add_rms_norm, rms_norm, silu_mul

    gen = torch.Generator().manual_seed(4)
    x, delta, w = _rows(5, 40, BF16, gen), _rows(5, 40, BF16, gen), torch.randn(40, generator=gen).to(BF16)
    for act, want in ((rms_norm(x, w, EPS, "fp8"), rms_norm_ref(x, w, EPS)),
                      (add_rms_norm(x, delta, w, EPS, "fp8+plain")[1], add_rms_norm_ref(x, delta, w, EPS)[1]),
                      (silu_mul(x, delta, "fp8"), silu_mul_ref(x, delta))):
        ok, msg = _same(act, *quantize_per_token(want))
        assert ok, msg
    assert torch.equal(add_rms_norm(x, delta, w, EPS, "fp8+plain")[1].plain, add_rms_norm_ref(x, delta, w, EPS)[1])
    with pytest.raises(AssertionError):
        rms_norm(x, w, EPS, "int8")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_producers_write_the_unfused_bits() -> None:
    """On the card: each fused producer's FP8 values and scales are those of its plain kernel followed by the
    quantization kernel the FP8 GEMM would launch (``quantize_rows``), at Qwen3.5-27B's widths."""
    from hyserve.kernels.fp8 import quantize_rows
    from hyserve.kernels.norm import add_rms_norm, rms_norm, silu_mul

    gen = torch.Generator().manual_seed(9)
    for t in (1, 8, 64, 300):
        x, delta = _rows(t, 5120, BF16, gen).cuda(), _rows(t, 5120, BF16, gen).cuda()
        w = (torch.randn(5120, generator=gen) * 0.2).to(BF16).cuda()
        y = _rows(t, 2 * 17408, BF16, gen).cuda()
        gate, up = y.split(17408, dim=-1)
        for name, act, kept, plain in (
                ("rms_norm", rms_norm(x, w, EPS, "fp8"), rms_norm(x, w, EPS, "fp8+plain"), rms_norm(x, w, EPS)),
                ("add_rms_norm", add_rms_norm(x, delta, w, EPS, "fp8")[1],
                 add_rms_norm(x, delta, w, EPS, "fp8+plain")[1], add_rms_norm(x, delta, w, EPS)[1]),
                ("silu_mul", silu_mul(gate, up, "fp8"), silu_mul(gate, up, "fp8+plain"), silu_mul(gate, up))):
            ok, msg = _same(act.__class__(act.q.cpu(), act.scale.cpu(), act.dtype),
                            *(v.cpu() for v in quantize_rows(plain.contiguous())))
            # (where they differ: does the producer's own rounding of its output differ from its plain kernel's?)
            n_plain = int((kept.plain.reshape(plain.shape) != plain).sum())
            where = ""
            if not ok:
                qr = quantize_rows(plain.contiguous())[0]
                bad = (act.q.view(torch.uint8) != qr.view(torch.uint8)).nonzero()[:2].tolist()
                where = "; at " + ", ".join(
                    f"{tuple(i)}: {float(act.q[i[0], i[1]].float())} vs {float(qr[i[0], i[1]].float())} (plain "
                    f"{float(plain.reshape(act.q.shape)[i[0], i[1]])}, scale {float(act.scale[i[0]])})" for i in bad)
            assert ok, (f"T={t} {name}: {msg}; its kept plain output differs from the plain kernel's in {n_plain}"
                        f"{where}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--interpreter-checks"]:
        results = run_interpreter_checks()
        print_results(results)

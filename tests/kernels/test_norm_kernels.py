"""The Mamba2 families' norm kernels (hyserve.kernels.norm: the scaled-weight RMSNorm, its residual add with and
without Granite's multiplier, Mamba2's grouped gated norm in both gate orders, its sum-of-squares form for a group
spanning ranks, the gate without a norm; and the gated attention's output gate ``sigmoid_mul``) under the Triton
interpreter (``TRITON_INTERPRET=1``, one subprocess: the variable must be set before any kernel is decorated),
against the plain-torch references.

Problems: float32, bf16 and fp16; odd widths, a row wider than 2048 (one row a program), inputs as strided views
(rows wider than the norm, as the mixer's split of its projection), T = 0 and T = 1; group sizes from 1 group to
several, odd ones; a float32 weight under bf16 rows (the promoted output dtype). 16-bit results must agree within one
unit in the last place and bit for bit in all but a few elements (the reduction order may move a rounding); residual
streams bit for bit. Sabotaged (each must disagree with the reference): the weight multiplied before the norm's
rounding, Granite's multiplier dropped, the multiplied delta left unrounded before the add, groups starting one
channel late, the gate on the wrong side of the norm, a group spanning ranks normalised by this rank's squares
alone, the gate alone without rounding ``silu(z)`` to ``z``'s dtype, the attention gate without rounding its
sigmoid. The layers take the kernels under the interpreter. Whole models: Nemotron-H's run on these kernels against
transformers in the default suite
(``tests/kernels/test_moe_engine.py`` runs its tests under the interpreter, where every norm takes them); Granite-4.0-H
and Falcon-H1 (both gate orders, the gate alone, two pipeline stages, the dropped multiplier caught) and Nemotron-H
at TP 2 with a gated-norm group spanning the ranks in a slow test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hyserve.kernels.norm import (
    add_scaled_rms_norm,
    add_scaled_rms_norm_ref,
    grouped_gated_rms_norm,
    grouped_gated_rms_norm_ref,
    scaled_rms_norm,
    scaled_rms_norm_ref,
)
from hyserve.testing.triton_interpreter import interpreter_subprocess_results, print_results, record_check

REPO_ROOT = Path(__file__).resolve().parents[2]
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
DTYPES = {"float32": F32, "bfloat16": BF16, "float16": F16}
EPS = 1e-5


def _agree(got: torch.Tensor, want: torch.Tensor, ulps: int = 1) -> tuple[bool, str]:
    """Same dtype and shape; float32 within 2e-6 relative; 16-bit within ``ulps`` units in the last place and
    unequal in at most 2 % of the elements (or one)."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return False, f"{got.dtype}{tuple(got.shape)} != {want.dtype}{tuple(want.shape)}"
    if got.numel() == 0:
        return True, "empty"
    g, w = got.float(), want.float()
    err = (g - w).abs()
    if want.dtype == F32:
        ok = bool((err <= 2e-6 * (w.abs() + 1)).all())
        return ok, f"max err {float(err.max()):.3g}"
    ulp = ulps * 2.0 ** (-7 if want.dtype == BF16 else -10)
    within = bool((err <= ulp * torch.maximum(g.abs(), w.abs()) + 1e-6).all())
    unequal = int((got != want).sum())
    return within and unequal <= max(1, 0.02 * got.numel()), \
        f"max err {float(err.max()):.3g}, unequal {unequal} of {got.numel()}"


def _rows(t: int, d: int, dtype: torch.dtype, gen: torch.Generator, pad: int = 3) -> torch.Tensor:
    """(t, d) as a strided view of wider rows."""
    return (torch.randn(t, d + pad, generator=gen) * 2).to(dtype)[:, 1 : 1 + d]


def _weight(d: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return (1 + 0.3 * torch.randn(d, generator=gen)).to(dtype)


def _interp_scaled(dtype: torch.dtype, d: int, w_dtype: torch.dtype | None = None,
                   sabotage: bool = False) -> tuple[bool, str]:
    """The scaled norm at T = 0, 1, 7 against the reference. ``sabotage``: the zero-centred kernel given ``w - 1``,
    i.e. the weight multiplied into the float32 norm before its rounding, which must disagree."""
    from hyserve.kernels.norm import rms_norm_triton, scaled_rms_norm_triton

    gen = torch.Generator().manual_seed(31 + d)
    goods, msgs = [], []
    for t in (0, 1, 7):
        x, w = _rows(t, d, dtype, gen), _weight(d, w_dtype or dtype, gen)
        want = scaled_rms_norm_ref(x, w, EPS)
        got = rms_norm_triton(x, w - 1, EPS) if sabotage else scaled_rms_norm_triton(x, w, EPS)
        good, msg = _agree(got, want)
        goods.append(good)
        msgs.append(f"T={t}: {msg}")
    return all(goods) != sabotage, "; ".join(msgs)


def _interp_add(dtype: torch.dtype, d: int, scale: float, sabotage: str = "") -> tuple[bool, str]:
    """The residual add fused into the scaled norm, at T = 0, 1, 6: the residual bit for bit, the norm as
    ``_agree``. ``sabotage="dropped"``: the kernel given scale 1; ``"unrounded"``: the check run against
    ``x + d * s`` with the product left in float32 (a single rounding); each must disagree."""
    from hyserve.kernels.norm import add_scaled_rms_norm_triton

    gen = torch.Generator().manual_seed(41 + d)
    goods, msgs = [], []
    for t in (0, 1, 6):
        x, delta, w = _rows(t, d, dtype, gen), _rows(t, d, dtype, gen, pad=1) * 4, _weight(d, dtype, gen)
        res_want, out_want = add_scaled_rms_norm_ref(x, delta, w, EPS, scale)
        if sabotage == "unrounded":
            res_want = (x.float() + delta.float() * scale).to(dtype)
        res, out = add_scaled_rms_norm_triton(x, delta, w, EPS, 1.0 if sabotage == "dropped" else scale)
        good_res = res.dtype == res_want.dtype and torch.equal(res, res_want)
        good_out, msg = _agree(out, out_want)
        goods.append(good_res and good_out)
        msgs.append(f"T={t}: residual equal {good_res}, norm {msg}")
    return all(goods) != bool(sabotage), "; ".join(msgs)


def _gate_problem(t: int, width: int, z_dtype: torch.dtype, w_dtype: torch.dtype,
                  seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The scan's float32 output (contiguous) and the gate as a view of a wider projection output, as the mixer
    splits them."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(t, width, generator=gen) * 1.5
    z = (torch.randn(t, width + 11, generator=gen) * 2).to(z_dtype)[:, 4 : 4 + width]
    return y, z, _weight(width, w_dtype, gen)


def _interp_gated(dtype: torch.dtype, width: int, group: int, norm_before_gate: bool,
                  sabotage: str = "") -> tuple[bool, str]:
    """The grouped gated norm at T = 0, 1, 5 against the reference, written in ``dtype`` (the model's: ``z``, the
    weight and the output). ``sabotage="boundary"``: groups starting one channel late (the kernel run on the rows
    turned by one channel, its output turned back); ``"gate_side"``: the other gate order; each must disagree."""
    from hyserve.kernels.norm import grouped_gated_rms_norm_triton

    goods, msgs = [], []
    for t in (0, 1, 5):
        y, z, w = _gate_problem(t, width, dtype, dtype, seed=51 + width + group + t)
        want = grouped_gated_rms_norm_ref(y, z, w, group, EPS, norm_before_gate, dtype)
        if sabotage == "boundary":
            y1, z1, w1 = (v.roll(1, -1) for v in (y, z, w))
            got = grouped_gated_rms_norm_triton(y1, z1, w1, group, EPS, norm_before_gate, dtype).roll(-1, -1)
        else:
            nbg = not norm_before_gate if sabotage == "gate_side" else norm_before_gate
            got = grouped_gated_rms_norm_triton(y, z, w, group, EPS, nbg, dtype)
        good, msg = _agree(got, want)
        goods.append(good)
        msgs.append(f"T={t}: {msg}")
    return all(goods) != bool(sabotage), "; ".join(msgs)


def _interp_spanning(dtype: torch.dtype, norm_before_gate: bool, sabotage: bool = False) -> tuple[bool, str]:
    """A group spanning ranks: this rank's 24 channels of 3 ranks' 72, the other ranks' squares given as a sum. The
    sum-of-squares kernel against its reference, then the norm with the all-reduced sums. ``sabotage``: the norm
    over this rank's channels alone (its own squares, its own width), which must disagree."""
    from hyserve.kernels.norm import gated_sum_squares_ref, gated_sum_squares_triton, grouped_gated_rms_norm_triton

    y, z, w = _gate_problem(6, 24, dtype, dtype, seed=61)
    others = torch.rand(6, generator=torch.Generator().manual_seed(62)) * 60
    ss, ss_want = gated_sum_squares_triton(y, z, norm_before_gate), gated_sum_squares_ref(y, z, norm_before_gate)
    ok1 = ss.dtype == F32 and ss.shape == (6,) and bool(torch.allclose(ss, ss_want, rtol=1e-6, atol=1e-6))
    want = grouped_gated_rms_norm_ref(y, z, w, 72, EPS, norm_before_gate, dtype, ss_want + others)
    if sabotage:
        got = grouped_gated_rms_norm_triton(y, z, w, 24, EPS, norm_before_gate, dtype)
    else:
        got = grouped_gated_rms_norm_triton(y, z, w, 72, EPS, norm_before_gate, dtype, ss + others)
    ok2, msg = _agree(got, want)
    return (ok1 and ok2) != sabotage, f"sums close {ok1}, norm {msg}"


def _interp_silu_gate(dtype: torch.dtype, sabotage: bool = False) -> tuple[bool, str]:
    """``y * silu(z)`` without a norm (Falcon-H1's default), T = 0, 1, 5, odd width; within two units in the last
    place (the exponentials' last bits may move ``silu(z)``'s rounding by one unit, which ``y`` scales).
    ``sabotage``: the check run against ``silu(z)`` kept in float32, which must disagree (for a 16-bit ``z``)."""
    from hyserve.kernels.norm import silu_gate_ref, silu_gate_triton

    goods, msgs = [], []
    for t in (0, 1, 5):
        y, z, _ = _gate_problem(t, 37, dtype, dtype, seed=71 + t)
        want = (y * torch.nn.functional.silu(z.float())).to(dtype) if sabotage else silu_gate_ref(y, z, dtype)
        good, msg = _agree(silu_gate_triton(y, z, dtype), want, ulps=2)
        goods.append(good)
        msgs.append(f"T={t}: {msg}")
    return all(goods) != sabotage, "; ".join(msgs)


def _interp_sigmoid_mul(dtype: torch.dtype, sabotage: bool = False) -> tuple[bool, str]:
    """The gated attention's output gate ``x * sigmoid(gate)``: the gate a strided ``(T, H, D)`` view of the query
    projection's [q | gate] heads, T = 0, 1, 5; within one unit in the last place of torch's (the sigmoid rounded to
    the dtype first). ``sabotage``: the check run against the sigmoid kept in float32, which must disagree (16-bit)."""
    from hyserve.kernels.norm import sigmoid_mul_ref, sigmoid_mul_triton

    goods, msgs = [], []
    for t in (0, 1, 5):
        gen = torch.Generator().manual_seed(91 + t)
        qg = (torch.randn(t, 3, 2 * 24, generator=gen) * 3).to(dtype)
        gate, x = qg[..., 24:], (torch.randn(t, 3, 24, generator=gen) * 2).to(dtype)
        want = (x.float() * torch.sigmoid(gate.float())).to(dtype) if sabotage else sigmoid_mul_ref(gate, x)
        good, msg = _agree(sigmoid_mul_triton(x.reshape(t, 72), gate), want.reshape(t, 72))
        goods.append(good)
        msgs.append(f"T={t}: {msg}")
    return all(goods) != sabotage, "; ".join(msgs)


def _interp_layers() -> tuple[bool, str]:
    """Under the interpreter the layers take the kernels (each ``*_triton`` launcher called) and agree with the
    references; a ``spans_ranks`` norm (its all-reduce the identity with one rank) equals one group over the width."""
    from hyserve.kernels import norm as kernels

    calls: list[str] = []
    names = ("scaled_rms_norm_triton", "add_scaled_rms_norm_triton", "grouped_gated_rms_norm_triton",
             "gated_sum_squares_triton")
    real = {name: getattr(kernels, name) for name in names}
    for name in names:
        setattr(kernels, name, lambda *a, _n=name, **k: (calls.append(_n), real[_n](*a, **k))[1])
    try:
        return _layers_agree(calls)
    finally:
        for name in names:
            setattr(kernels, name, real[name])


def _layers_agree(calls: list[str]) -> tuple[bool, str]:
    from hyserve.layers.mamba2 import GroupedGatedRMSNorm
    from hyserve.layers.norm import ScaledRMSNorm

    gen = torch.Generator().manual_seed(91)
    norm = ScaledRMSNorm(40, EPS).to(BF16)
    with torch.no_grad():
        norm.weight.copy_(_weight(40, BF16, gen))
    x, delta = _rows(3, 40, BF16, gen), _rows(3, 40, BF16, gen)
    ok1 = _agree(norm(x), scaled_rms_norm_ref(x, norm.weight, EPS))[0]
    res, out = norm.add(x, delta, 1.6)
    want_res, want_out = add_scaled_rms_norm_ref(x, delta, norm.weight, EPS, 1.6)
    ok2 = torch.equal(res, want_res) and _agree(out, want_out)[0]
    y, z, w = _gate_problem(3, 48, BF16, BF16, seed=92)
    grouped, spanning = GroupedGatedRMSNorm(48, 16, EPS), GroupedGatedRMSNorm(48, 48, EPS, spans_ranks=True)
    whole = GroupedGatedRMSNorm(48, 48, EPS)
    with torch.no_grad():
        for m in (grouped, spanning, whole):
            m.weight.copy_(w)
    ok3 = _agree(grouped(y, z, BF16), grouped_gated_rms_norm_ref(y, z, w, 16, EPS, False, BF16))[0]
    ok4 = _agree(spanning(y, z, BF16), whole(y, z, BF16))[0]
    ran = sorted(set(calls))
    ok5 = ran == ["add_scaled_rms_norm_triton", "gated_sum_squares_triton", "grouped_gated_rms_norm_triton",
                  "scaled_rms_norm_triton"]
    return ok1 and ok2 and ok3 and ok4 and ok5, f"agree {[ok1, ok2, ok3, ok4]}, kernels run {ran}"


def run_interpreter_checks() -> dict[str, list[Any]]:
    """Every check under the interpreter; {name: [ok, message]}. Needs TRITON_INTERPRET=1."""
    from hyserve.testing.triton_interpreter import patch_triton_interpreter

    assert os.environ.get("TRITON_INTERPRET") == "1"
    patch_triton_interpreter()
    res: dict[str, list[Any]] = {}
    for n, dt in DTYPES.items():
        for d in (37, 64, 2100):
            record_check(res, f"scaled_{d}_{n}", lambda dt=dt, d=d: _interp_scaled(dt, d))
        for scale in (1.0, 0.37):
            record_check(res, f"add_scaled_{scale}_{n}", lambda dt=dt, s=scale: _interp_add(dt, 37, s))
        for width, group in ((48, 8), (48, 48), (39, 13), (1100, 550)):
            for nbg in (False, True):
                order = "norm_first" if nbg else "gate_first"
                record_check(res, f"gated_{width}_{group}_{order}_{n}",
                       lambda dt=dt, w=width, g=group, nbg=nbg: _interp_gated(dt, w, g, nbg))
        record_check(res, f"spanning_{n}", lambda dt=dt: _interp_spanning(dt, False))
        record_check(res, f"silu_gate_{n}", lambda dt=dt: _interp_silu_gate(dt))
        record_check(res, f"sigmoid_mul_{n}", lambda dt=dt: _interp_sigmoid_mul(dt))
    record_check(res, "layers_take_the_kernels", _interp_layers)
    record_check(res, "scaled_f32_weight_bf16_rows", lambda: _interp_scaled(BF16, 64, w_dtype=F32))
    record_check(res, "add_scaled_wide_bf16", lambda: _interp_add(BF16, 2100, 0.37))
    record_check(res, "spanning_norm_first_bf16", lambda: _interp_spanning(BF16, True))
    record_check(res, "scaled_weight_before_rounding_caught", lambda: _interp_scaled(BF16, 64, sabotage=True))
    record_check(res, "add_multiplier_dropped_caught", lambda: _interp_add(BF16, 64, 0.37, sabotage="dropped"))
    record_check(res, "add_product_unrounded_caught", lambda: _interp_add(BF16, 64, 0.37, sabotage="unrounded"))
    record_check(res, "gated_boundary_off_by_one_caught",
                 lambda: _interp_gated(BF16, 48, 8, False, sabotage="boundary"))
    record_check(res, "gated_gate_side_caught", lambda: _interp_gated(BF16, 48, 8, False, sabotage="gate_side"))
    record_check(res, "gated_norm_first_gate_side_caught",
                 lambda: _interp_gated(F32, 48, 16, True, sabotage="gate_side"))
    record_check(res, "spanning_local_squares_caught", lambda: _interp_spanning(BF16, False, sabotage=True))
    record_check(res, "silu_gate_unrounded_caught", lambda: _interp_silu_gate(BF16, sabotage=True))
    record_check(res, "sigmoid_mul_unrounded_caught", lambda: _interp_sigmoid_mul(BF16, sabotage=True))
    return res


INTERP_CHECKS = [
    *[f"scaled_{d}_{n}" for n in DTYPES for d in (37, 64, 2100)],
    *[f"add_scaled_{s}_{n}" for n in DTYPES for s in (1.0, 0.37)],
    *[f"gated_{w}_{g}_{o}_{n}" for n in DTYPES for w, g in ((48, 8), (48, 48), (39, 13), (1100, 550))
      for o in ("gate_first", "norm_first")],
    *[f"{k}_{n}" for n in DTYPES for k in ("spanning", "silu_gate", "sigmoid_mul")],
    "layers_take_the_kernels", "scaled_f32_weight_bf16_rows", "add_scaled_wide_bf16", "spanning_norm_first_bf16",
    "scaled_weight_before_rounding_caught", "add_multiplier_dropped_caught", "add_product_unrounded_caught",
    "gated_boundary_off_by_one_caught", "gated_gate_side_caught", "gated_norm_first_gate_side_caught",
    "spanning_local_squares_caught", "silu_gate_unrounded_caught", "sigmoid_mul_unrounded_caught",
]


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, list[Any]]:
    pytest.importorskip("triton")
    return interpreter_subprocess_results(__file__, "--interpreter-checks")


def test_every_check_ran(interpreter_results: dict[str, list[Any]]) -> None:
    assert sorted(interpreter_results) == sorted(INTERP_CHECKS)


@pytest.mark.parametrize("name", INTERP_CHECKS)
def test_triton_kernel_interpreter(interpreter_results: dict[str, list[Any]], name: str) -> None:
    ok, msg = interpreter_results[name]
    assert ok, f"{name}: {msg}"


# Granite-4.0-H (dense, residual multiplier 1.6) and Falcon-H1 (the gate alone, the norm before and after the gate,
# two pipeline stages handing over the residual with the last layer's output added) against transformers with every
# norm on the kernels, and Granite's dropped multiplier still caught there; Nemotron-H at TP 2 with one gated-norm
# group spanning both ranks (the sum-of-squares launch, the all-reduce, the norm's launch). About 40 s under the
# interpreter (the fused MoE kernels do not run in TP / PP worker processes under it: MoE-free checkpoints there).
FAMILY_TESTS = ["tests/distributed/test_mamba2_tensor_parallel.py::"
                "test_tp2_matches_transformers[nemotron_h_shared_group]",
                "tests/model/test_granitemoehybrid.py::test_matches_transformers[dense_untied_biases]",
                "tests/model/test_granitemoehybrid.py::test_sabotage_is_caught[_drop_residual_multiplier]",
                "tests/model/test_falcon_h1.py::test_matches_transformers",
                "tests/model/test_falcon_h1.py::test_two_uneven_pipeline_stages_with_a_tied_head_match_transformers"]


@pytest.mark.slow  # about 40 s on one worker
def test_the_mamba2_families_match_transformers_on_the_norm_kernels() -> None:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *FAMILY_TESTS], env=env,
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "7 passed" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_cuda_sigmoid_mul_matches_torch(dtype: torch.dtype) -> None:
    """The gated attention's output gate on the card against torch's two launches, the gate a strided view."""
    from hyserve.kernels.norm import sigmoid_mul

    qg = (torch.randn(7, 4, 256, device="cuda") * 3).to(dtype)
    gate, x = qg[..., 128:], torch.randn(7, 4, 128, device="cuda").to(dtype)
    ok, msg = _agree(sigmoid_mul(x.reshape(7, -1), gate), (x * torch.sigmoid(gate)).reshape(7, -1))
    assert ok, msg


def test_cpu_dispatch_is_the_reference() -> None:
    """Off CUDA and the interpreter the entry points are the references, bit for bit; the scaled norm is what
    ``ScaledRMSNorm`` computed in plain torch before the kernels (transformers' ``NemotronHRMSNorm``)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the entry points take the kernels under the interpreter")
    gen = torch.Generator().manual_seed(81)
    x, delta, w = _rows(5, 40, BF16, gen), _rows(5, 40, BF16, gen), _weight(40, BF16, gen)
    xf = x.float()
    legacy = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(BF16)
    assert torch.equal(scaled_rms_norm(x, w, EPS), legacy)
    assert torch.equal(scaled_rms_norm(x, w, EPS), scaled_rms_norm_ref(x, w, EPS))
    for got, want in zip(add_scaled_rms_norm(x, delta, w, EPS, 0.37),
                         add_scaled_rms_norm_ref(x, delta, w, EPS, 0.37), strict=True):
        assert torch.equal(got, want)
    assert torch.equal(add_scaled_rms_norm(x, delta, w, EPS, 0.37)[0], x + delta * 0.37)
    y, z, wg = _gate_problem(4, 48, BF16, BF16, seed=82)
    for nbg in (False, True):
        assert torch.equal(grouped_gated_rms_norm(y, z, wg, 16, EPS, nbg, BF16),
                           grouped_gated_rms_norm_ref(y, z, wg, 16, EPS, nbg, BF16))


if __name__ == "__main__":
    if sys.argv[1:] == ["--interpreter-checks"]:
        results = run_interpreter_checks()
        print_results(results)

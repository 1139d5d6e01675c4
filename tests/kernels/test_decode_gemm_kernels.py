"""The decode GEMM with the previous op in its prologue (``hyserve.kernels.gemv``), under the Triton interpreter
(``TRITON_INTERPRET=1``, one subprocess), against the unfused kernels and plain-torch matmuls.

What is checked:

* the prologue's activation: with an identity weight the GEMM writes its A exactly, which must equal what the unfused
  kernel writes (the RMSNorm kernel, its residual-add form, the SwiGLU kernel) bit for bit, but for the norms' sum
  of squares taken in another order (within one unit in the last place, in at most 2 % of the elements);
* the residual stream written by the add-norm prologue equals ``x + delta`` bit for bit, every column of it, with
  several column tiles and K split over programs (the buffer starts as NaN);
* the GEMM itself against a float32 matmul of the unfused activation (bf16 / fp16 rounding of the output), with K
  split over 1 and 3 programs, M = 0, 1, 3 and 16, K not a multiple of the tile; two launches give the same bits;
  the split-K locks are zero after each launch;
* the engine: a tiny bf16 Qwen3.5 checkpoint (GDN and attention layers, its MTP head: verify rows too) decodes with
  ``HYSERVE_DECODE_GEMM=on`` to the tokens of ``off``, log-probs within bf16 noise, and the deferred GEMMs ran
  (``gate_up``, ``down`` and the GDN ``in_proj`` of every decode step).

Each sabotaged check must disagree with what the kernel wrote: the norm's weight taken as ``w`` (not ``1 + w``), the
residual compared with ``x`` alone (the add dropped), the SwiGLU's ``silu`` left unrounded, and the GEMM compared with
a matmul missing its last K tile (a split's partial dropped).
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import pytest
import torch

from hyserve.testing.triton_interpreter import interpreter_subprocess_results, print_results, record_check

BF16, F16 = torch.bfloat16, torch.float16
DTYPES = {"bfloat16": BF16, "float16": F16}
EPS = 1e-6
PROLOGUES = ("plain", "norm", "add_norm", "swiglu")


def _ulp_agree(got: torch.Tensor, want: torch.Tensor, exact: bool) -> tuple[bool, str]:
    if got.shape != want.shape or got.dtype != want.dtype:
        return False, f"{got.dtype}{tuple(got.shape)} != {want.dtype}{tuple(want.shape)}"
    if got.numel() == 0:
        return True, "empty"
    diff = got != want
    n = int(diff.sum())
    if exact:
        return n == 0, f"{n} differ"
    ulp = 2.0 ** (-7 if want.dtype == BF16 else -10)
    err = ((got.float() - want.float()).abs() / want.float().abs().clamp(min=1e-30)).max()
    ok = bool(err <= ulp * 1.01) and n <= max(1, got.numel() // 50)
    return ok, f"{n} differ, max rel {float(err):.3g}"


def _problem(prologue: str, m: int, k: int, dtype: torch.dtype, gen: torch.Generator,
             device: str = "cpu") -> tuple[Any, torch.Tensor, torch.Tensor | None]:
    """(deferred input, unfused activation (the Triton kernels: under the interpreter on the CPU, the entry points
    on CUDA), expected residual or None)."""
    from hyserve.kernels.gemv import NormedInput, SwigluInput
    from hyserve.kernels.norm import add_rms_norm_triton, rms_norm_triton, silu_mul_triton

    x = (torch.randn(m, k, generator=gen) * (torch.rand(m, 1, generator=gen) * 3 + 0.2)).to(dtype).to(device)
    if prologue == "plain":
        return x, x, None
    if prologue == "swiglu":
        y = torch.randn(m, 2 * k, generator=gen).to(dtype).to(device)
        gate, up = y.split(k, dim=-1)
        plain = silu_mul_triton(gate, up)
        assert isinstance(plain, torch.Tensor)
        return SwigluInput(gate, up), plain, None
    w = (torch.randn(k, generator=gen) * 0.3).to(dtype).to(device)
    if prologue == "norm":
        plain = rms_norm_triton(x, w, EPS)
        assert isinstance(plain, torch.Tensor)
        return NormedInput(x, w, EPS), plain, None
    delta = torch.randn(m, k, generator=gen).to(dtype).to(device)
    residual = torch.full_like(x, float("nan"))
    res, plain = add_rms_norm_triton(x, delta, w, EPS)
    assert isinstance(plain, torch.Tensor)
    return NormedInput(x, w, EPS, delta, residual), plain, res


def _interp_prologue(prologue: str, dtype: torch.dtype, sabotage: str = "") -> tuple[bool, str]:
    """Identity weight: the GEMM's output is its A. ``sabotage``: ``"weight"`` (expected norm with ``w``),
    ``"no_add"`` (the residual expected to be ``x``), ``"unrounded"`` (the SwiGLU's silu kept in float32)."""
    from hyserve.kernels.gemv import DecodeGemmConfig, decode_linear_triton
    from hyserve.kernels.norm import rms_norm_ref

    gen = torch.Generator().manual_seed(len(prologue) * 31)
    k = 300
    eye = torch.eye(k, dtype=dtype)
    goods, msgs = [], []
    for m in (1, 3, 16):
        a, plain, res = _problem(prologue, m, k, dtype, gen)
        want = plain
        if sabotage == "weight":  # the scaled form, w * norm(x)
            want = rms_norm_ref(a.x, a.weight - 1, EPS)
        elif sabotage == "unrounded":
            want = (torch.nn.functional.silu(a.gate.float()) * a.up.float()).to(dtype)
        got = decode_linear_triton(a, eye, DecodeGemmConfig(64, 128, 2, 4, 1))
        ok, msg = _ulp_agree(got, want, exact=prologue in ("plain", "swiglu"))
        if res is not None:
            expect = a.x if sabotage == "no_add" else res
            ok_res = torch.equal(a.residual, expect)
            ok, msg = ok and ok_res, f"{msg}, residual {'equal' if ok_res else 'differs'}"
        goods.append(ok)
        msgs.append(f"M={m}: {msg}")
    return all(goods) != bool(sabotage), "; ".join(msgs)


def _interp_gemm(prologue: str, dtype: torch.dtype, sabotage: bool = False) -> tuple[bool, str]:
    """A random weight (N = 72: two column tiles, the last partial; K = 300: three tiles, the last partial) against a
    float32 matmul of the unfused activation, split 1 and 3, M = 0, 1 and 16 (the kernel's row block: one row of it,
    all of it); repeat launches bit-identical; locks zero after. ``sabotage``: the matmul without the last K tile."""
    from hyserve.kernels.fp8 import split_locks
    from hyserve.kernels.gemv import DecodeGemmConfig, decode_linear_triton

    gen = torch.Generator().manual_seed(7 + len(prologue))
    n, k = 72, 300
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    goods, msgs = [], []
    for m in (0, 1, 16):
        for split in (1, 3):
            a, plain, res = _problem(prologue, m, k, dtype, gen)
            cfg = DecodeGemmConfig(64, 128, split, 4, 1)
            got = decode_linear_triton(a, weight, cfg)
            kk = 256 if sabotage else k
            want = (plain[:, :kk].float() @ weight[:, :kk].float().t())
            if m == 0:
                goods.append(got.shape == (0, n))
                continue
            tol = 2.0 ** (-7 if dtype == BF16 else -10) * 2
            err = float(((got.float() - want).abs() / (want.abs() + want.abs().max() * 1e-2)).max())
            again = decode_linear_triton(a, weight, cfg)
            same = torch.equal(got, again)
            locks = int(split_locks(got.device).count_nonzero()) == 0
            ok = err <= tol and same and locks and (res is None or torch.equal(a.residual, res))
            goods.append(ok)
            msgs.append(f"M={m} split={split}: err {err:.3g}, repeat {same}, locks {locks}")
    return all(goods) != sabotage, "; ".join(msgs)


def _interp_engine() -> tuple[bool, str]:
    """A tiny bf16 Qwen3.5 (3 GDN : 1 attention, MTP head, async) decoding with the deferred GEMMs against without."""
    from hyserve import LLM, SamplingParams
    from hyserve.kernels import gemv
    from hyserve.layers import linear
    from hyserve.testing import write_tiny_checkpoint

    path = write_tiny_checkpoint(tempfile.mkdtemp(), with_mtp=True, seed=3, dtype=torch.bfloat16,
                                 layer_types=["linear_attention"] * 3 + ["full_attention"])
    prompts = [{"prompt_token_ids": list(range(5 + i, 30 + 3 * i))} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    runs: dict[str, Any] = {}
    seen: dict[str, int] = {}
    real = linear.decode_linear

    def counting(a: Any, w: torch.Tensor) -> torch.Tensor:
        seen[type(a).__name__] = seen.get(type(a).__name__, 0) + 1
        return real(a, w)

    linear.decode_linear = counting  # type: ignore[assignment]
    for mode in ("off", "on"):
        os.environ["HYSERVE_DECODE_GEMM"] = mode
        llm = LLM(model=path, device="cpu", dtype="bfloat16", async_scheduling=True, enable_prefix_caching=True,
                  speculative_config={"method": "mtp", "num_speculative_tokens": 2})
        runs[mode] = llm.generate(prompts, params, use_tqdm=False)
        if mode == "off":
            assert not seen, seen
    os.environ.pop("HYSERVE_DECODE_GEMM")
    assert gemv.decode_gemm_enabled() is False
    same = all(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(runs["off"], runs["on"], strict=True))
    diff = max(abs(la[t].logprob - lb[t].logprob)
               for a, b in zip(runs["off"], runs["on"], strict=True)
               for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True)
               for t in la if t in lb)
    ran = seen.get("NormedInput", 0) > 0 and seen.get("SwigluInput", 0) > 0
    return same and diff < 0.05 and ran, f"tokens same {same}, max logprob diff {diff:.3g}, deferred GEMMs {seen}"


def run_interpreter_checks(names: list[str]) -> dict[str, list[Any]]:
    """The checks ``names`` (one of the two groups) under the interpreter. Needs TRITON_INTERPRET=1."""
    from hyserve.testing.triton_interpreter import patch_triton_interpreter

    assert os.environ.get("TRITON_INTERPRET") == "1"
    patch_triton_interpreter()
    res: dict[str, list[Any]] = {}

    def check(name: str, fn: Callable[[], tuple[bool, str]]) -> None:
        if name in names:
            record_check(res, name, fn)

    for n, dt in DTYPES.items():
        for p in PROLOGUES:
            check(f"prologue_{p}_{n}", lambda p=p, dt=dt: _interp_prologue(p, dt))
            check(f"gemm_{p}_{n}", lambda p=p, dt=dt: _interp_gemm(p, dt))
    check("norm_weight_w_caught", lambda: _interp_prologue("norm", BF16, sabotage="weight"))
    check("residual_without_add_caught", lambda: _interp_prologue("add_norm", BF16, sabotage="no_add"))
    check("swiglu_unrounded_caught", lambda: _interp_prologue("swiglu", BF16, sabotage="unrounded"))
    check("dropped_k_tile_caught", lambda: _interp_gemm("plain", BF16, sabotage=True))
    return res


INTERP_CHECKS = [
    *[f"{kind}_{p}_{n}" for n in DTYPES for p in PROLOGUES for kind in ("prologue", "gemm")],
    "norm_weight_w_caught", "residual_without_add_caught", "swiglu_unrounded_caught", "dropped_k_tile_caught",
]
# The slow group (scripts/test.sh -m slow; the default suite's budget): the float16 twins of the bf16 checks (about 7 s
# in all), and, the GEMM being off by default (HYSERVE_DECODE_GEMM), the bf16 prologues alone and two of the four
# sabotages (the bf16 GEMMs with each prologue, the residual without its add and the dropped key tile stay).
SLOW_INTERP_CHECKS = [*[f"{kind}_{p}_float16" for p in PROLOGUES for kind in ("prologue", "gemm")],
                      *[f"prologue_{p}_bfloat16" for p in PROLOGUES], "norm_weight_w_caught", "swiglu_unrounded_caught"]
DEFAULT_INTERP_CHECKS = [name for name in INTERP_CHECKS if name not in SLOW_INTERP_CHECKS]


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, list[Any]]:
    pytest.importorskip("triton")
    return interpreter_subprocess_results(__file__, "--interpreter-checks", timeout=600)


@pytest.fixture(scope="module")
def slow_interpreter_results() -> dict[str, list[Any]]:
    pytest.importorskip("triton")
    return interpreter_subprocess_results(__file__, "--interpreter-checks-slow", timeout=600)


def test_the_two_groups_hold_every_check_once() -> None:
    assert sorted(DEFAULT_INTERP_CHECKS + SLOW_INTERP_CHECKS) == sorted(INTERP_CHECKS)
    assert not set(DEFAULT_INTERP_CHECKS) & set(SLOW_INTERP_CHECKS)


def test_every_check_ran(interpreter_results: dict[str, list[Any]]) -> None:
    assert sorted(interpreter_results) == sorted(DEFAULT_INTERP_CHECKS)


@pytest.mark.parametrize("name", DEFAULT_INTERP_CHECKS)
def test_decode_gemm_under_the_interpreter(interpreter_results: dict[str, list[Any]], name: str) -> None:
    ok, msg = interpreter_results[name]
    assert ok, f"{name}: {msg}"


@pytest.mark.slow  # about 10 s under the interpreter
def test_every_slow_check_ran(slow_interpreter_results: dict[str, list[Any]]) -> None:
    assert sorted(slow_interpreter_results) == sorted(SLOW_INTERP_CHECKS)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW_INTERP_CHECKS)
def test_decode_gemm_under_the_interpreter_slow(slow_interpreter_results: dict[str, list[Any]], name: str) -> None:
    ok, msg = slow_interpreter_results[name]
    assert ok, f"{name}: {msg}"


def test_decode_gemm_compiles_for_sm90() -> None:
    pytest.importorskip("triton")
    from hyserve.kernels import gemv
    from hyserve.testing.triton_compile import compile_failures

    variants = gemv.compile_variants()
    assert len(variants) == 8
    failures = compile_failures(variants)
    assert not failures, failures


def test_the_switch_is_refused_unless_on_or_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from hyserve.kernels import gemv

    monkeypatch.setenv("HYSERVE_DECODE_GEMM", "yes")
    with pytest.raises(ValueError, match="HYSERVE_DECODE_GEMM"):
        gemv.decode_gemm_enabled()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("prologue", PROLOGUES)
def test_cuda_decode_gemm_against_the_unfused_path(prologue: str) -> None:
    """On the card at Qwen3.5-9B's shapes: each prologue's GEMM against the unfused kernel + cuBLAS (bf16), the
    residual bit for bit, repeat launches and a graph replay bit-identical."""
    from hyserve.kernels.gemv import decode_linear

    gen = torch.Generator().manual_seed(11)
    n, k = (4096, 12288) if prologue == "swiglu" else (8192, 4096)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(BF16).cuda()
    for m in (1, 4, 16):
        a, plain, res = _problem(prologue, m, k, BF16, gen, device="cuda")
        got = decode_linear(a, weight)
        want = plain @ weight.t()
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2 * float(want.abs().max()))
        assert torch.equal(got, decode_linear(a, weight))
        if res is not None:
            assert torch.equal(a.residual, res)
        static = decode_linear(a, weight)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = decode_linear(a, weight)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static, got)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_with_the_decode_gemm_matches_without(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the card with CUDA graphs: a tiny bf16 Qwen3.5 (GDN and attention layers, MTP, async, prefix caching)
    decodes with ``HYSERVE_DECODE_GEMM=on`` to the greedy tokens of ``off``, log-probs within bf16 noise."""
    from hyserve import LLM, SamplingParams
    from hyserve.testing import write_tiny_checkpoint

    path = write_tiny_checkpoint(tempfile.mkdtemp(), with_mtp=True, seed=3, dtype=torch.bfloat16,
                                 layer_types=["linear_attention"] * 3 + ["full_attention"])
    prompts = [{"prompt_token_ids": list(range(5 + i, 30 + 3 * i))} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
    runs = {}
    for mode in ("off", "on"):
        monkeypatch.setenv("HYSERVE_DECODE_GEMM", mode)
        llm = LLM(model=path, device="cuda", dtype="bfloat16", enable_prefix_caching=True,
                  speculative_config={"method": "mtp", "num_speculative_tokens": 2})
        runs[mode] = llm.generate(prompts, params, use_tqdm=False)
        del llm
    for a, b in zip(runs["off"], runs["on"], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert all(abs(la[t].logprob - lb[t].logprob) < 0.05 for t in la if t in lb)


def run_engine_check() -> dict[str, list[Any]]:
    """The engine check alone (the slow test's subprocess). Needs TRITON_INTERPRET=1."""
    from hyserve.testing.triton_interpreter import patch_triton_interpreter

    assert os.environ.get("TRITON_INTERPRET") == "1"
    patch_triton_interpreter()
    res: dict[str, list[Any]] = {}
    record_check(res, "engine_on_matches_off", _interp_engine)
    return res


@pytest.mark.slow  # the whole engine under the interpreter: about half a minute
def test_engine_on_matches_off_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    ok, msg = interpreter_subprocess_results(__file__, "--engine-check", timeout=600)["engine_on_matches_off"]
    assert ok, msg


if __name__ == "__main__":
    if sys.argv[1:] == ["--engine-check"]:
        results = run_engine_check()
        print_results(results)
    if sys.argv[1:] == ["--interpreter-checks"]:
        results = run_interpreter_checks(DEFAULT_INTERP_CHECKS)
        print_results(results)
    if sys.argv[1:] == ["--interpreter-checks-slow"]:
        results = run_interpreter_checks(SLOW_INTERP_CHECKS)
        print_results(results)

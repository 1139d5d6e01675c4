"""Prefix-cache snapshots inside prefill rows (``StepMetadata.row_snapshots``): the conv window and SSM state a GDN
layer writes at a position inside a row equal a from-scratch computation over the row's tokens up to that position.

The yardsticks are independent of the code under test: transformers' ``torch_recurrent_gated_delta_rule`` /
``torch_chunk_gated_delta_rule`` run on the row's first L tokens from the row's starting state, and the conv window
built as the last K - 1 of (window before the row ++ the row's first L inputs). Rows are several, with different
lengths, slots permuted with gaps, snapshots at several offsets per row (on and off 64-token chunk boundaries, inside
the conv window's reach of the row start), entries distinct from every slot; float32 and bf16 stored state.

The CUDA path's own part (fla's per-chunk states ``h`` taken at ``RowSnapshots.tails(64).chunk_index``, then the
recurrent kernel over the tail) runs here under the Triton interpreter on an ``h`` laid out as fla lays it out (the
reference's states before every 64-token chunk of each row, rounded to the model dtype as fla stores them); the
fla kernels themselves run in the CUDA test at the end. Sabotages: the state taken one token late, one chunk late,
and the conv window taken one position late, are each caught.

Run the CUDA test on a GPU machine with:
``python -m pytest -q tests/kernels/test_row_snapshots.py -k cuda``
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import replace
from typing import Any

import pytest
import torch

from hyserve.kernels.conv import snapshot_conv_windows
from hyserve.kernels.gdn import FLA_CHUNK, advance_snapshots, gdn_forward
from hyserve.kernels.gdn.decode import as_value_major
from hyserve.kernels.mamba2 import advance_snapshots as mamba2_advance_snapshots
from hyserve.kernels.mamba2 import mamba2_scan
from hyserve.model.metadata import ConvWindowIndex, RowSnapshots
from hyserve.testing.triton_interpreter import interpreter_subprocess_results, patch_triton_interpreter, record_check

LENS = [70, 5, 0, 130, 33]  # prefill rows (one empty: no chunk, no tokens)
# (row, offset): on a chunk boundary (64), off it, short of the conv window (1, 2), several in one row.
SNAPS = [(0, 1), (0, 64), (0, 69), (1, 2), (3, 64), (3, 100), (3, 128), (3, 129), (4, 17)]
# The row-start path's points (chunk 0: each tail from the row's start): those short of the first chunk, the conv
# window's reach and a 17-token tail in three rows (the interpreter runs a tail token by token: the points at 64 and
# 69 tokens were 133 of its 153 tail tokens; the chunked path takes them from fla's h).
ROW_START_SNAPS = [s for s in SNAPS if s[1] < 64]
HK, HV, DK, DV, K = 1, 2, 16, 16, 4
POOL = 24


def _problem(dtype: torch.dtype, state_dtype: torch.dtype, seed: int = 3, device: str = "cpu") -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    t = sum(LENS)
    qsl = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)
    slots = torch.tensor([11, 3, 20, 7, 15])  # permuted, with gaps
    entries = [22, 0, 19, 5, 9, 2, 17, 13, 23]  # no row's slot
    conv_dim = 2 * HK * DK + HV * DV
    p = {
        "q": torch.randn(t, HK, DK, generator=gen).to(dtype),
        "k": torch.randn(t, HK, DK, generator=gen).to(dtype),
        "v": torch.randn(t, HV, DV, generator=gen).to(dtype),
        "g": -torch.rand(t, HV, generator=gen) * 0.3 - 0.01,
        "beta": torch.rand(t, HV, generator=gen),
        "ssm_state": (torch.randn(POOL, HV, DK, DV, generator=gen) * 0.2).to(state_dtype),
        "x": torch.randn(t, conv_dim, generator=gen).to(dtype),
        "conv_state": torch.randn(POOL, conv_dim, K - 1, generator=gen).to(dtype),
        "qsl": qsl, "slots": slots, "entries": entries,
    }
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in p.items()}


def _snapshots(p: dict[str, Any], snaps: list[tuple[int, int]] = SNAPS) -> RowSnapshots:
    slots = p["slots"].tolist()
    return RowSnapshots.build([r for r, _ in snaps], [o for _, o in snaps], p["entries"][: len(snaps)],
                              [slots[r] for r, _ in snaps], LENS, p["slots"].device)


def _hf(name: str) -> Any:
    """transformers' plain-torch function (``inspect.unwrap``: not the fla kernel it dispatches to where installed)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return inspect.unwrap(getattr(modeling_qwen3_5, name))


def scratch_states(p: dict[str, Any], state0: torch.Tensor, chunked: bool = False
                   ) -> dict[tuple[int, int], torch.Tensor]:
    """Each snapshot's state from scratch: transformers' rule on the row's first ``offset`` tokens from the row's
    starting state (``state0``: the pool before the call), float32."""
    fn = _hf("torch_chunk_gated_delta_rule" if chunked else "torch_recurrent_gated_delta_rule")
    qsl = p["qsl"].tolist()
    grp = HV // HK
    cpu = {name: p[name].float().cpu() for name in ("q", "k", "v", "g", "beta")}
    out = {}
    for r, off in SNAPS:
        a = qsl[r]
        q = cpu["q"][a : a + off].repeat_interleave(grp, dim=1)
        k = cpu["k"][a : a + off].repeat_interleave(grp, dim=1)
        slot = int(p["slots"][r])
        _, final = fn(q[None], k[None], cpu["v"][None, a : a + off], g=cpu["g"][None, a : a + off],
                      beta=cpu["beta"][None, a : a + off], initial_state=state0[slot : slot + 1].float().cpu(),
                      output_final_state=True, use_qk_l2norm_in_kernel=True)
        out[(r, off)] = final[0]
    return out


def scratch_windows(p: dict[str, Any], conv0: torch.Tensor, width: int = K - 1
                    ) -> dict[tuple[int, int], torch.Tensor]:
    """Each snapshot's conv window from scratch: the last ``width`` (K - 1) of (the slot's window before the row ++
    the row's first ``offset`` inputs), oldest first."""
    qsl = p["qsl"].tolist()
    out = {}
    for r, off in SNAPS:
        slot = int(p["slots"][r])
        seq = torch.cat([conv0[slot].t(), p["x"][qsl[r] : qsl[r] + off].cpu()])
        out[(r, off)] = seq[-width:].t()
    return out


def _state_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float().cpu() - want).abs().max() / want.abs().max().clamp(min=1e-6))


def check_states(pool: torch.Tensor, p: dict[str, Any], want: dict[tuple[int, int], torch.Tensor], tol: float,
                 snaps: list[tuple[int, int]] = SNAPS) -> tuple[bool, str]:
    errs = [_state_err(pool[e], want[s]) for s, e in zip(snaps, p["entries"], strict=False)]
    return max(errs) <= tol, f"max relative state error {max(errs):.3g} (tol {tol})"


# ---------------------------------------------------------------------------------------------- CPU reference


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunked_yardstick", [False, True])
def test_reference_writes_the_state_at_each_interior_position(state_dtype: torch.dtype,
                                                              chunked_yardstick: bool) -> None:
    p = _problem(torch.float32, state_dtype)
    state0 = p["ssm_state"].clone()
    want = scratch_states(p, state0, chunked_yardstick)
    pool = p["ssm_state"]
    plain = pool.clone()
    out = gdn_forward(p["q"], p["k"], p["v"], p["g"], p["beta"], pool, p["slots"], p["qsl"], max(LENS),
                      snapshots=_snapshots(p))
    out_plain = gdn_forward(p["q"], p["k"], p["v"], p["g"], p["beta"], plain, p["slots"], p["qsl"], max(LENS))
    tol = 1e-5 if state_dtype == torch.float32 else 8e-3  # a bf16 state: one rounding
    ok, msg = check_states(pool, p, want, tol)
    assert ok, msg
    # The snapshots change nothing else: outputs, the rows' own slots and every other entry are those of a call
    # without them.
    assert torch.equal(out, out_plain)
    others = [i for i in range(POOL) if i not in p["entries"][: len(SNAPS)]]
    assert torch.equal(pool[others], plain[others])


def test_reference_sabotage_one_token_late_is_caught() -> None:
    p = _problem(torch.float32, torch.float32)
    want = scratch_states(p, p["ssm_state"].clone())
    late = [(r, min(o + 1, LENS[r] - 1)) for r, o in SNAPS]  # one token past its position (inside the row)
    gdn_forward(p["q"], p["k"], p["v"], p["g"], p["beta"], p["ssm_state"], p["slots"], p["qsl"], max(LENS),
                snapshots=_snapshots(p, late))
    ok, msg = check_states(p["ssm_state"], p, want, 1e-3)
    assert not ok, f"a state one token late went unnoticed ({msg})"


@pytest.mark.parametrize("sabotage", [False, True])
def test_conv_windows_inside_rows(sabotage: bool) -> None:
    """Windows at offsets short of K - 1 take their older part from the slot's window before the row; sabotaged,
    every window is taken one position late."""
    p = _problem(torch.bfloat16, torch.float32)
    conv0 = p["conv_state"].clone()
    want = scratch_windows(p, conv0)
    snaps = _snapshots(p)
    if sabotage:
        snaps = replace(snaps, ends=snaps.ends + 1, offsets_t=snaps.offsets_t + 1, _windows={})
    snapshot_conv_windows(p["x"], p["conv_state"], snaps)
    got_ok = all(torch.equal(p["conv_state"][e], want[s]) for s, e in zip(SNAPS, p["entries"], strict=False))
    assert got_ok != sabotage
    others = [i for i in range(POOL) if i not in p["entries"][: len(SNAPS)]]
    assert torch.equal(p["conv_state"][others], conv0[others])  # the rows' own windows are the conv's to roll


@pytest.mark.parametrize("sabotage", [False, True])
def test_conv_window_index_built_once_a_step_and_width(monkeypatch: pytest.MonkeyPatch, sabotage: bool) -> None:
    """A step's layers take one gather index per window width (``RowSnapshots.conv_windows``): three layers of
    width K - 1 and one of width K - 2 (a family with another conv kernel) build it twice, and every layer's
    windows are right. Sabotaged, the index is kept whatever the width: the narrower layer's windows come out
    wrong (the cache is caught keyed on too little)."""
    p = _problem(torch.bfloat16, torch.float32)
    snaps = _snapshots(p)
    built: list[int] = []
    of = ConvWindowIndex.of

    def counted(ends: torch.Tensor, offsets: torch.Tensor, w: int) -> ConvWindowIndex:
        built.append(w)
        return of(ends, offsets, w)

    monkeypatch.setattr(ConvWindowIndex, "of", staticmethod(counted))
    if sabotage:
        def any_width(self: RowSnapshots, w: int) -> ConvWindowIndex:
            if not self._windows:
                self._windows[0] = ConvWindowIndex.of(self.ends, self.offsets_t, w)
            return self._windows[0]
        monkeypatch.setattr(RowSnapshots, "conv_windows", any_width)
    pools = [p["conv_state"].clone() for _ in range(3)] + [p["conv_state"][..., 1:].clone()]
    wants = [scratch_windows(p, pool, width=pool.shape[-1]) for pool in pools]
    right = []
    for pool, want in zip(pools, wants, strict=True):
        try:
            snapshot_conv_windows(p["x"], pool, snaps)
        except RuntimeError:  # an index of another width may not even fit the layer's window
            right.append(False)
            continue
        right.append(all(torch.equal(pool[e], want[s]) for s, e in zip(SNAPS, p["entries"], strict=False)))
    assert right[:3] == [True] * 3
    assert right[3] != sabotage
    assert built == ([K - 1] if sabotage else [K - 1, K - 2])


def test_tails_follow_fla_chunk_layout() -> None:
    """RowSnapshots.tails: the chunk index counts the chunks of the rows before (an empty row has none) and the tail
    runs from the last 64-token boundary; chunk 0 runs from the row's start."""
    p = _problem(torch.float32, torch.float32)
    snaps = _snapshots(p)
    t64 = snaps.tails(FLA_CHUNK)
    # rows' chunk counts: 70 -> 2, 5 -> 1, 0 -> 0, 130 -> 3, 33 -> 1
    assert t64.chunk_index.tolist() == [0, 1, 1, 2, 4, 4, 5, 5, 6]
    lens = (t64.query_start_loc[1:] - t64.query_start_loc[:-1]).tolist()
    assert lens == [o % 64 for _, o in SNAPS]
    t0 = snaps.tails(0)
    assert (t0.query_start_loc[1:] - t0.query_start_loc[:-1]).tolist() == [o for _, o in SNAPS]
    assert t0.tokens[:1].tolist() == [0] and snaps.ends.tolist()[4] == 75 + 64


# ---------------------------------------------------------------------------------------------- Mamba2

MH, MP, MN, MG = 4, 8, 16, 2
DT_LIMIT = (0.0, float("inf"))


def _m_problem(dtype: torch.dtype, state_dtype: torch.dtype, seed: int = 5, device: str = "cpu") -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    t = sum(LENS)
    p = {
        "x": torch.randn(t, MH, MP, generator=gen).to(dtype), "dt": (torch.randn(t, MH, generator=gen) * 0.5).to(dtype),
        "A_log": (torch.rand(MH, generator=gen) * 0.5).to(dtype), "B": torch.randn(t, MG, MN, generator=gen).to(dtype),
        "C": torch.randn(t, MG, MN, generator=gen).to(dtype), "D": torch.randn(MH, generator=gen).to(dtype),
        "dt_bias": (torch.randn(MH, generator=gen) * 0.1).to(dtype),
        "ssm_state": (torch.randn(POOL, MH, MP, MN, generator=gen) * 0.2).to(state_dtype),
        "qsl": torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32),
        "slots": torch.tensor([11, 3, 20, 7, 15]), "entries": [22, 0, 19, 5, 9, 2, 17, 13, 23],
    }
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in p.items()}


def mamba2_scratch_states(p: dict[str, Any], state0: torch.Tensor, snaps: list[tuple[int, int]] = SNAPS
                          ) -> dict[tuple[int, int], torch.Tensor]:
    """Each snapshot's state from scratch, token by token from Mamba2's rule (float32): S = exp(dt A) S + dt x B^T
    with dt = softplus(dt + dt_bias), head h reading group h // (H / G)."""
    qsl = p["qsl"].tolist()
    a = -torch.exp(p["A_log"].float().cpu())
    out = {}
    for r, off in snaps:
        s = state0[int(p["slots"][r])].float().cpu().clone()
        for t in range(qsl[r], qsl[r] + off):
            step = torch.nn.functional.softplus(p["dt"][t].float().cpu() + p["dt_bias"].float().cpu())
            for h in range(MH):
                b = p["B"][t, h // (MH // MG)].float().cpu()
                s[h] = torch.exp(step[h] * a[h]) * s[h] + step[h] * torch.outer(p["x"][t, h].float().cpu(), b)
        out[(r, off)] = s
    return out


def _mamba2_call(p: dict[str, Any], snaps: RowSnapshots | None, pool: torch.Tensor | None = None,
                 qsl_cpu: torch.Tensor | None = None) -> torch.Tensor:
    return mamba2_scan(p["x"], p["dt"], p["A_log"], p["B"], p["C"], p["D"], p["dt_bias"], DT_LIMIT,
                       p["ssm_state"] if pool is None else pool, p["slots"], p["qsl"], max(LENS),
                       query_start_loc_cpu=qsl_cpu, snapshots=snaps)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("late", [False, True], ids=["intact", "one_token_late"])
def test_mamba2_reference_writes_the_state_at_each_interior_position(state_dtype: torch.dtype, late: bool) -> None:
    p = _m_problem(torch.float32, state_dtype)
    want = mamba2_scratch_states(p, p["ssm_state"].clone())
    plain = p["ssm_state"].clone()
    snaps = [(r, min(o + 1, LENS[r] - 1)) for r, o in SNAPS] if late else SNAPS
    out = _mamba2_call(p, _snapshots(p, snaps))
    out_plain = _mamba2_call(p, None, plain)
    tol = 1e-5 if state_dtype == torch.float32 else 8e-3
    ok, msg = check_states(p["ssm_state"], p, want, tol)
    assert ok != late, msg
    assert torch.equal(out, out_plain)
    others = [i for i in range(POOL) if i not in p["entries"][: len(SNAPS)]]
    assert torch.equal(p["ssm_state"][others], plain[others])


def _interp_mamba2_advance(dtype: torch.dtype, state_dtype: torch.dtype, chunk: int, shift: int = 0
                           ) -> tuple[bool, str]:
    """Mamba2's CUDA snapshot step on the CPU: fla's ``h`` (state before every 64-token chunk of each row, rows back
    to back, the pool's (P, N) layout, in the model dtype) from the independent rule, or the rows' starting states,
    advanced by the recurrent Triton kernel over the tails."""
    p = _m_problem(dtype, state_dtype)
    state0 = p["ssm_state"].clone()
    snap_list = SNAPS if chunk else ROW_START_SNAPS
    want = mamba2_scratch_states(p, state0, snap_list)
    snaps = _snapshots(p, snap_list)
    if chunk:
        starts = [(r, c) for r, n in enumerate(LENS) for c in range(0, n, chunk)]
        at = mamba2_scratch_states(p, state0, [(r, c) for r, c in starts if c]) if len(starts) else {}
        h = torch.stack([(state0[int(p["slots"][r])].float() if c == 0 else at[(r, c)]).to(dtype)
                         for r, c in starts])
        index = (snaps.tails(chunk).chunk_index + shift).clamp(max=h.shape[0] - 1)
        base = h.index_select(0, index).float()
    else:
        base = state0.index_select(0, snaps.slots).float()
    mamba2_advance_snapshots(p["x"], p["dt"], p["A_log"], p["B"], p["C"], p["D"], p["dt_bias"], DT_LIMIT, base,
                             snaps, chunk, p["ssm_state"])
    tol = 1e-4 if dtype == torch.float32 and state_dtype == torch.float32 else 2e-2
    return check_states(p["ssm_state"], p, want, tol, snap_list)


# ---------------------------------------------------------------------------------------------- CUDA path, emulated


def emulated_fla_h(p: dict[str, Any], state0: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fla's ``h`` for the call's non-empty rows: each row's state before every 64-token chunk, rows back to back,
    ``(1, NT, Hv, Dk, Dv)`` in the model dtype (as fla stores it), from transformers' recurrent rule."""
    fn = _hf("torch_recurrent_gated_delta_rule")
    qsl = p["qsl"].tolist()
    grp = HV // HK
    hs = []
    for r, n in enumerate(LENS):
        slot = int(p["slots"][r])
        s = state0[slot : slot + 1].float()
        a = qsl[r]
        for c in range(0, n, FLA_CHUNK):
            hs.append(s[0].to(dtype))
            b = a + min(c + FLA_CHUNK, n)
            q = p["q"][a + c : b].float().repeat_interleave(grp, dim=1)
            k = p["k"][a + c : b].float().repeat_interleave(grp, dim=1)
            _, s = fn(q[None], k[None], p["v"][None, a + c : b].float(), g=p["g"][None, a + c : b].float(),
                      beta=p["beta"][None, a + c : b].float(), initial_state=s, output_final_state=True,
                      use_qk_l2norm_in_kernel=True)
    return torch.stack(hs)[None]


def _interp_advance(dtype: torch.dtype, state_dtype: torch.dtype, chunk: int, shift: int = 0) -> tuple[bool, str]:
    """The CUDA path's snapshot step on the CPU: the starting states (fla's ``h`` at ``chunk_index`` + ``shift``, or
    the rows' starting states for chunk 0) advanced by the recurrent Triton kernel over the tails (from the row's
    start, only the points short of the first chunk: ``ROW_START_SNAPS``)."""
    p = _problem(dtype, state_dtype)
    state0 = p["ssm_state"].clone()
    want = scratch_states(p, state0)
    snaps = _snapshots(p, SNAPS if chunk else ROW_START_SNAPS)
    if chunk:
        h = emulated_fla_h(p, state0, dtype)
        index = (snaps.tails(chunk).chunk_index + shift).clamp(max=h.shape[1] - 1)
        base = h[0].index_select(0, index).float()
    else:
        base = state0.index_select(0, snaps.slots).float()
    advance_snapshots(p["q"], p["k"], p["v"], p["g"], p["beta"], base, snaps, chunk, p["ssm_state"])
    # A bf16 h (fla's) or bf16 inputs / state: one or two roundings of the state.
    tol = 1e-4 if dtype == torch.float32 and state_dtype == torch.float32 else 2e-2
    return check_states(p["ssm_state"], p, want, tol, list(zip(snaps.rows, snaps.offsets, strict=True)))


def run_interpreter_checks() -> dict[str, list[Any]]:
    patch_triton_interpreter()
    f32, bf16 = torch.float32, torch.bfloat16
    res: dict[str, list[Any]] = {}
    # The chunked path runs bf16 models (fla), the row-start path float32 ones (the recurrent kernel for whole rows).
    record_check(res, "fla_h_bf16", lambda: _interp_advance(bf16, f32, FLA_CHUNK))
    record_check(res, "fla_h_bf16_state", lambda: _interp_advance(bf16, bf16, FLA_CHUNK))
    record_check(res, "row_start_f32", lambda: _interp_advance(f32, f32, 0))
    ok, msg = _interp_advance(bf16, f32, FLA_CHUNK, shift=1)  # one chunk late: must fail
    res["fla_h_one_chunk_late_caught"] = [not ok, msg]
    record_check(res, "mamba2_fla_h_bf16", lambda: _interp_mamba2_advance(bf16, f32, FLA_CHUNK))
    record_check(res, "mamba2_row_start_f32", lambda: _interp_mamba2_advance(f32, f32, 0))
    ok, msg = _interp_mamba2_advance(bf16, f32, FLA_CHUNK, shift=1)
    res["mamba2_fla_h_one_chunk_late_caught"] = [not ok, msg]
    return res


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, list[Any]]:
    pytest.importorskip("triton")
    return interpreter_subprocess_results(__file__, "--interpreter-checks")


@pytest.mark.parametrize("name", ["fla_h_bf16", "fla_h_bf16_state", "row_start_f32", "fla_h_one_chunk_late_caught",
                                  "mamba2_fla_h_bf16", "mamba2_row_start_f32", "mamba2_fla_h_one_chunk_late_caught"])
def test_cuda_path_snapshot_step_under_interpreter(interpreter_results: dict[str, list[Any]], name: str) -> None:
    ok, msg = interpreter_results[name]
    assert ok, msg


# ---------------------------------------------------------------------------------------------- CUDA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("dtype", "state_dtype"), [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                    (torch.float32, torch.float32)])
def test_cuda_snapshots_inside_rows_match_from_scratch(dtype: torch.dtype, state_dtype: torch.dtype) -> None:
    """On the card: bf16 rows take fla's chunked path (its per-chunk states through fla-core 0.6.0's internal
    stages), float32 rows the recurrent kernel; every snapshot against transformers' rule from scratch, the rows'
    outputs and final states against the path without snapshots."""
    if dtype == torch.bfloat16:
        pytest.importorskip("fla")
    p = _problem(dtype, state_dtype, device="cuda")
    state0 = p["ssm_state"].clone()
    want = scratch_states(p, state0.cpu())
    plain = p["ssm_state"].clone()
    qsl_cpu = p["qsl"].cpu()
    out = gdn_forward(p["q"], p["k"], p["v"], p["g"], p["beta"], p["ssm_state"], p["slots"], p["qsl"], max(LENS),
                      qsl_cpu, snapshots=_snapshots(p))
    out_plain = gdn_forward(p["q"], p["k"], p["v"], p["g"], p["beta"], plain, p["slots"], p["qsl"], max(LENS),
                            qsl_cpu)
    torch.cuda.synchronize()
    tol = 1e-4 if dtype == torch.float32 else 2.5e-2
    ok, msg = check_states(p["ssm_state"], p, want, tol)
    assert ok, msg
    assert torch.allclose(out.float(), out_plain.float(), atol=1e-2, rtol=1e-2)
    rows = p["slots"].tolist()
    assert torch.allclose(p["ssm_state"][rows].float(), plain[rows].float(), atol=1e-3, rtol=1e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("dtype", "state_dtype"), [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)])
def test_cuda_prefill_on_a_value_major_pool_matches_the_key_major_one(dtype: torch.dtype,
                                                                       state_dtype: torch.dtype) -> None:
    """``HYSERVE_GDN_STATE_LAYOUT=value``'s pool (each head's state stored transposed) through the prefill with
    snapshots inside rows (bf16: fla's chunked path, which reads and writes key-major copies; float32: the recurrent
    kernel on the pool's strides): outputs, states and snapshots bit for bit the key-major pool's on fla's path, within
    float32 rounding on the recurrent kernel's (its reductions over keys add up in the order the tile's layout sets:
    on an H100 the two differed, 2026-12-06)."""
    if dtype == torch.bfloat16:
        pytest.importorskip("fla")
    p = _problem(dtype, state_dtype, device="cuda")
    key = p["ssm_state"].clone()
    val = as_value_major(p["ssm_state"])
    qsl_cpu = p["qsl"].cpu()
    outs = [gdn_forward(p["q"], p["k"], p["v"], p["g"], p["beta"], pool, p["slots"], p["qsl"], max(LENS), qsl_cpu,
                        snapshots=_snapshots(p)) for pool in (key, val)]
    torch.cuda.synchronize()
    assert val.stride()[2:] == (1, val.shape[2])
    if dtype == torch.bfloat16:
        assert torch.equal(outs[0], outs[1])
        assert torch.equal(key, val)  # every entry: the rows' slots, the snapshots', the untouched ones
    else:
        assert torch.allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6)
        assert torch.allclose(key, val, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("dtype", "state_dtype"), [(torch.bfloat16, torch.float32), (torch.float32, torch.float32)])
def test_cuda_mamba2_snapshots_inside_rows_match_from_scratch(dtype: torch.dtype, state_dtype: torch.dtype) -> None:
    """Mamba2 on the card: bf16 rows through fla's ``chunk_simple_gla`` stages (fla-core 0.6.0), float32 rows the
    recurrent kernel; every snapshot against the rule from scratch, outputs and final states against the path
    without snapshots."""
    if dtype == torch.bfloat16:
        pytest.importorskip("fla")
    p = _m_problem(dtype, state_dtype, device="cuda")
    want = mamba2_scratch_states(p, p["ssm_state"].clone())
    plain = p["ssm_state"].clone()
    qsl_cpu = p["qsl"].cpu()
    out = _mamba2_call(p, _snapshots(p), qsl_cpu=qsl_cpu)
    out_plain = _mamba2_call(p, None, plain, qsl_cpu)
    torch.cuda.synchronize()
    tol = 1e-4 if dtype == torch.float32 else 2.5e-2
    ok, msg = check_states(p["ssm_state"], p, want, tol)
    assert ok, msg
    assert torch.allclose(out, out_plain, atol=1e-2, rtol=1e-2)
    rows = p["slots"].tolist()
    assert torch.allclose(p["ssm_state"][rows].float(), plain[rows].float(), atol=1e-3, rtol=1e-3)


if __name__ == "__main__" and "--interpreter-checks" in sys.argv:
    import json

    print("RESULTS " + json.dumps(run_interpreter_checks()))

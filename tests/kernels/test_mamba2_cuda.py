"""The Mamba2 mixer's kernels and the mixer itself on CUDA against the CPU (skipped without a GPU).

* ``mamba2_scan`` on CUDA against ``mamba2_scan_ref`` on the CPU, Nemotron-H's head shapes (P = 64, N = 128, 4
  heads a group): float32 (the recurrent kernel for every row) and bf16 (prefill rows through fla-core's chunked
  scan, with and without the host's offsets), decode (the recurrent kernel) and verify (the verify kernel, scratch
  NaN-poisoned), float32 and bf16 stored states; rows on permuted slots with an empty row, unnamed slots unchanged.
* The fla path's passes before and after fla (``hyserve.kernels.mamba2.chunked``) against their torch formulation on
  CUDA, without a host sync: B / C expanded and the states gathered exactly, ``g`` and ``v`` within float32 ulps
  (``v`` rounded), the skip within an FMA's rounding, the states stored exactly; the fla path writing into a slice of
  a NaN-poisoned buffer (a verify step's rest rows); with the step's rows worked out once and the pinned fla-core,
  fla's stages run without a host sync and equal fla's public entry bit for bit.
* The conv with its bias (varlen and verify) on CUDA against its CPU reference.
* The whole ``Mamba2Mixer``: prefill chunks, then one decode and one verify step eager under
  ``torch.cuda.set_sync_debug_mode("error")``, then a decode step and a verify step captured in CUDA graphs and
  replayed with new inputs, against the same layer on the CPU (same weights, same states): outputs, live states and
  verify candidates.

Every comparison prints its largest error, where it is, and the reference's scale when it fails.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from hyserve.kernels.conv import causal_conv1d_varlen
from hyserve.kernels.conv.reference import causal_conv1d_varlen_ref, causal_conv1d_verify_ref
from hyserve.kernels.conv.verify import causal_conv1d_verify
from hyserve.kernels.mamba2 import (
    MAMBA2_STASH_NAMES,
    mamba2_replay,
    mamba2_scan,
    mamba2_scan_fla,
    mamba2_scan_ref,
    mamba2_stash_shapes,
)
from hyserve.kernels.mamba2.chunked import mamba2_chunked_inputs, mamba2_chunked_output
from hyserve.kernels.mamba2.reference import (
    mamba2_chunked_inputs_ref,
    mamba2_chunked_output_ref,
    mamba2_verify_ref,
)
from hyserve.layers.mamba2 import Mamba2Mixer
from hyserve.model.metadata import StepMetadata, VerifyMetadata
from hyserve.testing.cuda import capture, no_sync

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CPU = torch.device("cpu")
F32, BF16 = torch.float32, torch.bfloat16
POOL = 10
PREFILL_LENS = [37, 0, 5, 130, 1, 64]
DECODE_LENS = [1, 1, 0, 1]
VERIFY_LENS = [4, 0, 3, 1]


def close(name: str, got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    """``|got - want| <= rel * (max|want| + 1e-6)`` elementwise, NaNs (unwritten entries) in the same places."""
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    nan_g, nan_w = torch.isnan(got), torch.isnan(want)
    assert torch.equal(nan_g, nan_w), (f"{name}: NaN pattern differs ({int(nan_g.sum())} NaNs got, "
                                       f"{int(nan_w.sum())} want; first mismatch at "
                                       f"{(nan_g != nan_w).nonzero()[:4].tolist()})")
    got, want = torch.nan_to_num(got), torch.nan_to_num(want)
    if got.numel() == 0:
        return
    err = (got - want).abs()
    scale = float(want.abs().max()) + 1e-6
    worst = int(err.argmax())
    idx = list(torch.unravel_index(torch.tensor(worst), err.shape))
    msg = (f"{name}: max err {float(err.max()):.4g} at {[int(i) for i in idx]} (got {float(got.flatten()[worst]):.5g},"
           f" want {float(want.flatten()[worst]):.5g}), mean err {float(err.mean()):.3g}, scale {scale:.4g}, "
           f"allowed {rel * scale:.4g}")
    assert float(err.max()) <= rel * scale, msg


def _qsl(lens: list[int], device: torch.device) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


# --------------------------------------------------------------------------------------------------------------------
# The kernels
# --------------------------------------------------------------------------------------------------------------------


def scan_problem(lens: list[int], dtype: torch.dtype, state_dtype: torch.dtype, seed: int,
                 h: int = 8, p: int = 64, g: int = 2, n: int = 128) -> dict[str, Any]:
    """CPU tensors; x, B, C strided views of one conv output, dt of one projection output, as the mixer has them."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    mixed = torch.randn(t, h * p + 2 * g * n, generator=gen).to(dtype)
    xs, bs, cs = mixed.split([h * p, g * n, g * n], dim=-1)
    proj = (torch.randn(t, h + 3, generator=gen) * 1.5).to(dtype)
    return {
        "x": xs.reshape(t, h, p), "dt": proj[:, 1 : 1 + h], "A_log": torch.log(torch.rand(h, generator=gen) * 2 + 0.1),
        "B": (bs * 0.3).reshape(t, g, n), "C": (cs * 0.3).reshape(t, g, n),
        "D": torch.randn(h, generator=gen).to(dtype), "dt_bias": (torch.randn(h, generator=gen) - 2).to(dtype),
        "dt_limit": (1e-3, float("inf")),
        "ssm_state": (torch.randn(POOL, h, p, n, generator=gen) * 0.5).to(state_dtype),
        "state_slots": torch.randperm(POOL, generator=gen)[: len(lens)], "query_start_loc": _qsl(lens, CPU),
        "max_query_len": max(lens),
    }


def to(p: dict[str, Any], device: str | torch.device) -> dict[str, Any]:
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in p.items()}


def _untouched(name: str, before: torch.Tensor, after: torch.Tensor, slots: torch.Tensor, lens: list[int]) -> None:
    touched = {int(s) for s, n in zip(slots.tolist(), lens, strict=True) if n > 0}
    for s in range(before.shape[0]):
        if s not in touched:
            assert torch.equal(before[s], after[s].cpu()), f"{name}: slot {s}, named by no non-empty row, changed"


# (lens, model dtype, state dtype, relative tolerance of y, of the state). bf16 prefill goes through fla (v = x * dt
# and its output rounded to bf16); float32 and decode through the exact recurrent kernel.
SCAN_CASES = [
    ("prefill_f32", PREFILL_LENS, F32, F32, 1e-4, 1e-4),
    ("prefill_bf16_fla", PREFILL_LENS, BF16, F32, 2e-2, 1e-2),
    ("prefill_bf16_fla_bf16_state", PREFILL_LENS, BF16, BF16, 2e-2, 1.6e-2),
    ("decode_f32", DECODE_LENS, F32, F32, 1e-5, 1e-5),
    ("decode_bf16", DECODE_LENS, BF16, F32, 1e-4, 1e-5),
    ("decode_bf16_bf16_state", DECODE_LENS, BF16, BF16, 1e-4, 8e-3),
]


@pytest.mark.parametrize("name,lens,dtype,state_dtype,rel,srel", SCAN_CASES, ids=[c[0] for c in SCAN_CASES])
@pytest.mark.parametrize("host_offsets", [True, False], ids=["qsl_cpu", "no_qsl_cpu"])
def test_scan_matches_the_cpu_reference(name: str, lens: list[int], dtype: torch.dtype, state_dtype: torch.dtype,
                                        rel: float, srel: float, host_offsets: bool) -> None:
    p = scan_problem(lens, dtype, state_dtype, seed=31)
    want_state = p["ssm_state"].clone()
    want = mamba2_scan_ref(**{**p, "ssm_state": want_state})
    dev = to(p, "cuda")
    qsl_cpu = p["query_start_loc"] if host_offsets else None
    if max(lens) == 1:  # decode: the recurrent kernel makes no host sync
        with no_sync():
            got = mamba2_scan(**dev, query_start_loc_cpu=qsl_cpu)
    else:
        got = mamba2_scan(**dev, query_start_loc_cpu=qsl_cpu)
    torch.cuda.synchronize()
    assert got.dtype == F32 and dev["ssm_state"].dtype == state_dtype
    close(f"{name} y", got, want, rel)
    close(f"{name} state", dev["ssm_state"], want_state, srel)
    _untouched(name, p["ssm_state"], dev["ssm_state"], p["state_slots"], lens)


def test_fla_path_alone_matches_the_reference() -> None:
    """``mamba2_scan_fla`` called directly (bf16, rows of 1 to 130 tokens, an empty row), so a dispatch change
    cannot hide it."""
    lens = [1, 130, 0, 17]
    p = scan_problem(lens, BF16, F32, seed=32)
    want_state = p["ssm_state"].clone()
    want = mamba2_scan_ref(**{**p, "ssm_state": want_state})
    dev = to(p, "cuda")
    dev.pop("max_query_len")
    got = mamba2_scan_fla(**dev, query_start_loc_cpu=p["query_start_loc"])
    close("fla y", got, want, 2e-2)
    close("fla state", dev["ssm_state"], want_state, 1e-2)
    _untouched("fla", p["ssm_state"], dev["ssm_state"], p["state_slots"], lens)


@pytest.mark.parametrize("dtype,state_dtype", [(BF16, F32), (BF16, BF16), (torch.float16, torch.float16)],
                         ids=["bf16", "bf16_st", "fp16_st"])
def test_chunked_passes_match_the_torch_formulation_without_sync(dtype: torch.dtype, state_dtype: torch.dtype) -> None:
    p = to(scan_problem(PREFILL_LENS, dtype, state_dtype, seed=38), "cuda")
    args = {k: p[k] for k in ("x", "dt", "A_log", "B", "C", "dt_bias", "dt_limit", "ssm_state")}
    args["slots"] = p["state_slots"]
    want = mamba2_chunked_inputs_ref(**args)
    with no_sync():
        got = mamba2_chunked_inputs(**args)
    torch.cuda.synchronize()
    for name, g, w in zip(("q", "k", "h0"), (got[0], got[1], got[4]), (want[0], want[1], want[4]), strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w), f"{name} differs from the torch formulation"
    close("g", got[3], want[3], 1e-5)
    close("v", got[2], want[2], 1e-2)  # one ulp of the largest at most
    gen = torch.Generator().manual_seed(39)
    t, h, hp = p["x"].shape
    r, n = len(PREFILL_LENS), p["ssm_state"].shape[3]
    o = torch.randn(t, h, hp, generator=gen).to(dtype).cuda()
    final = torch.randn(r, h, hp, n, generator=gen).cuda()
    want_state = p["ssm_state"].clone()
    want_y = mamba2_chunked_output_ref(o, p["x"], p["D"], final, want_state, p["state_slots"])
    with no_sync():
        got_y = mamba2_chunked_output(o, p["x"], p["D"], final, p["ssm_state"], p["state_slots"])
    torch.cuda.synchronize()
    close("y", got_y, want_y, 1e-6)
    assert torch.equal(p["ssm_state"], want_state), "the stored states differ from the torch formulation's"


def test_fla_stages_with_the_steps_rows_take_no_sync_and_equal_the_public_entry(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With the step's rows worked out once (``ChunkedRows``, host offsets) and the pinned fla-core, the fla path runs
    fla's stages itself, ``chunk_fwd_h``'s kernel launched with the host's chunk count: no host sync (the public
    entry's ``.item()`` gone), and outputs and states bit for bit those of fla's public entry."""
    from hyserve.kernels.fla_stages import fla_row_snapshots_unavailable
    from hyserve.kernels.mamba2 import chunked
    from hyserve.kernels.varlen import ChunkedRows

    reason = fla_row_snapshots_unavailable()
    if reason is not None:
        pytest.skip(reason)
    lens = [1, 130, 0, 17, 64, 65]
    p = scan_problem(lens, BF16, F32, seed=33)
    want_state = p["ssm_state"].clone()
    want = mamba2_scan_ref(**{**p, "ssm_state": want_state})
    runs = {}
    for way in ("stages", "public"):
        dev = to(p, "cuda")
        dev.pop("max_query_len")
        rows = ChunkedRows.of(dev["state_slots"], dev["query_start_loc"], p["query_start_loc"])
        assert rows.num_chunks(64) == 1 + 3 + 1 + 1 + 2
        from fla.ops.utils import prepare_chunk_indices

        want_idx = prepare_chunk_indices(rows.cu_seqlens, 64, cu_seqlens_cpu=rows.cu_seqlens_cpu)
        assert torch.equal(rows.chunk_indices(64), want_idx), "the chunk indices are not fla's"
        if way == "public":
            monkeypatch.setattr(chunked, "fla_row_snapshots_unavailable", lambda: "the public entry, for the test")
        chunked.mamba2_scan_fla(**dev, query_start_loc_cpu=p["query_start_loc"], rows=rows)  # compiles, autotunes
        dev = to(p, "cuda")
        dev.pop("max_query_len")
        rows = ChunkedRows.of(dev["state_slots"], dev["query_start_loc"], p["query_start_loc"])
        torch.cuda.synchronize()
        if way == "stages":
            with no_sync():
                got = chunked.mamba2_scan_fla(**dev, query_start_loc_cpu=p["query_start_loc"], rows=rows)
        else:
            got = chunked.mamba2_scan_fla(**dev, query_start_loc_cpu=p["query_start_loc"], rows=rows)
        torch.cuda.synchronize()
        runs[way] = (got, dev["ssm_state"])
    monkeypatch.undo()
    close("fla stages y", runs["stages"][0], want, 2e-2)
    close("fla stages state", runs["stages"][1], want_state, 1e-2)
    assert torch.equal(runs["stages"][0], runs["public"][0]), "the stages' y differs from fla's public entry's"
    assert torch.equal(runs["stages"][1], runs["public"][1]), "the stages' states differ from fla's public entry's"


def test_fla_path_into_a_buffer() -> None:
    """``mamba2_scan_fla`` with ``out`` a slice of a NaN-poisoned buffer (a verify step's rest rows): the slice holds
    the reference's y, the rest of the buffer stays NaN."""
    lens = [5, 0, 33]
    p = scan_problem(lens, BF16, F32, seed=40)
    want_state = p["ssm_state"].clone()
    want = mamba2_scan_ref(**{**p, "ssm_state": want_state})
    dev = to(p, "cuda")
    dev.pop("max_query_len")
    buf = torch.full((sum(lens) + 3, *p["x"].shape[1:]), float("nan"), device="cuda")
    got = mamba2_scan_fla(**dev, query_start_loc_cpu=p["query_start_loc"], out=buf[2:-1])
    assert got.data_ptr() == buf[2:-1].data_ptr()
    close("fla y in a buffer", got, want, 2e-2)
    assert bool(buf[[0, 1, -1]].isnan().all()), "fla path wrote outside its slice"
    close("fla state", dev["ssm_state"], want_state, 1e-2)


@pytest.mark.parametrize("dtype,state_dtype", [(F32, F32), (BF16, F32), (BF16, BF16)], ids=["f32", "bf16", "bf16_st"])
def test_verify_matches_the_cpu_reference_without_sync(dtype: torch.dtype, state_dtype: torch.dtype) -> None:
    p = scan_problem(VERIFY_LENS, dtype, state_dtype, seed=33)
    r, npos = len(VERIFY_LENS), max(VERIFY_LENS)
    shapes = mamba2_stash_shapes(*p["x"].shape[1:], *p["B"].shape[1:])
    stash = {n: torch.full((r + 2, npos, *shapes[n]), float("nan")) for n in MAMBA2_STASH_NAMES}
    want_stash = {n: v.clone() for n, v in stash.items()}
    cands = torch.full((r + 2, npos, *p["ssm_state"].shape[1:]), float("nan"), dtype=state_dtype)
    want = mamba2_scan_ref(**p, scratch=cands)  # the candidate states, the replay's yardstick
    mamba2_verify_ref(**p, stash=want_stash)
    dev = to(p, "cuda")
    dstash = {n: v.cuda() for n, v in stash.items()}
    with no_sync():
        got = mamba2_scan(**dev, stash=dstash)
    torch.cuda.synchronize()
    srel = 1e-5 if state_dtype == F32 else 8e-3
    close("verify y", got, want, 1e-4 if dtype == BF16 else 1e-5)
    for n in MAMBA2_STASH_NAMES:
        close(f"verify stash {n}", dstash[n], want_stash[n], 1e-5)
    assert torch.equal(dev["ssm_state"].cpu(), p["ssm_state"]), "verify wrote the live state"
    # every candidate replayed into a spare entry, then the commit, with no host sync
    pairs = [(row, j) for row in reversed(range(r)) for j in range(VERIFY_LENS[row])]
    slots = dev["state_slots"]
    pool = torch.cat([dev["ssm_state"], torch.zeros((len(pairs), *dev["ssm_state"].shape[1:]), dtype=state_dtype,
                                                    device="cuda")])
    rows = torch.tensor([row for row, _ in pairs], device="cuda")
    counts = torch.tensor([j for _, j in pairs], device="cuda")
    entries = torch.arange(pool.shape[0] - len(pairs), pool.shape[0], device="cuda")
    acc = torch.tensor([n - 1 for n in VERIFY_LENS], device="cuda")
    with no_sync():
        mamba2_replay(pool, dev["A_log"], dstash, rows, slots.index_select(0, rows), entries, counts)
        mamba2_replay(pool, dev["A_log"], dstash, None, slots, slots, acc)
    torch.cuda.synchronize()
    close("replayed candidates", pool[entries], torch.stack([cands[row, j] for row, j in pairs]), srel)
    for row, n in enumerate(VERIFY_LENS):
        slot = int(p["state_slots"][row])
        close(f"committed row {row}", pool[slot], cands[row, n - 1] if n else p["ssm_state"][slot], srel)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("lens", [[1, 0, 1, 1], [3, 0, 40, 2]], ids=["decode", "prefill"])
def test_conv_with_bias_matches_the_cpu_reference(dtype: torch.dtype, lens: list[int]) -> None:
    gen = torch.Generator().manual_seed(34)
    d, k = 96, 4
    wide = torch.randn(sum(lens), d + 7, generator=gen).to(dtype)
    x, w = wide[:, 3 : 3 + d], (torch.randn(d, k, generator=gen) * 0.5).to(dtype)
    bias = torch.randn(d, generator=gen).to(dtype)
    state = torch.randn(POOL, d, k - 1, generator=gen).to(dtype)
    slots = torch.randperm(POOL, generator=gen)[: len(lens)]
    qsl = _qsl(lens, CPU)
    rel = 1e-5 if dtype == F32 else 8e-3
    want_state = state.clone()
    want = causal_conv1d_varlen_ref(x, w, want_state, slots, qsl, bias)
    xd, wd, bd, sd, qd = x.cuda(), w.cuda(), bias.cuda(), slots.cuda(), qsl.cuda()
    dstate = state.cuda()
    with no_sync():
        got = causal_conv1d_varlen(xd, wd, dstate, sd, qd, max(lens), bd)
    torch.cuda.synchronize()
    close("conv y", got, want, rel)
    close("conv state", dstate, want_state, 0.0)
    scratch = torch.full((len(lens) + 1, max(lens), d, k - 1), float("nan"), dtype=dtype)
    want_scratch = scratch.clone()
    want_v = causal_conv1d_verify_ref(x, w, state, slots, qsl, want_scratch, bias)
    dscratch, dstate = scratch.cuda(), state.cuda()
    with no_sync():
        got_v = causal_conv1d_verify(xd, wd, dstate, sd, qd, dscratch, max(lens), bd)
    torch.cuda.synchronize()
    close("conv verify y", got_v, want_v, rel)
    close("conv verify scratch", dscratch, want_scratch, 0.0)
    assert torch.equal(dstate.cpu(), state), "conv verify wrote the live windows"


# --------------------------------------------------------------------------------------------------------------------
# The mixer: eager without a sync, then graphs
# --------------------------------------------------------------------------------------------------------------------

HIDDEN, H, P, G, N, K = 128, 8, 32, 2, 64, 4
SLOTS = 8
DRAFTS = 3


class Cfg:
    hidden_size = HIDDEN
    mamba_num_heads = H
    mamba_head_dim = P
    n_groups = G
    ssm_state_size = N
    conv_kernel = K
    use_conv_bias = True
    use_bias = False
    layer_norm_epsilon = 1e-5
    time_step_limit = (1e-3, float("inf"))
    quantization = None

    def __init__(self, ssm_state_dtype: str) -> None:
        self.ssm_state_dtype = ssm_state_dtype


def make_mixers(dtype: torch.dtype, state_dtype: str) -> tuple[Mamba2Mixer, Mamba2Mixer]:
    """The same mixer on the CPU and on CUDA (model dtype ``dtype``), zeroed states and scratch bound to both."""
    torch.manual_seed(35)
    cpu = Mamba2Mixer(Cfg(state_dtype), "backbone.layers.0.mixer")
    gen = torch.Generator().manual_seed(36)
    with torch.no_grad():
        for name, prm in cpu.named_parameters():
            if name == "A_log":
                prm.copy_(torch.rand(prm.shape, generator=gen) * 1.5 - 0.5)
            elif name in ("dt_bias", "D"):
                prm.copy_(torch.randn(prm.shape, generator=gen) * 0.5)
            elif name == "norm.weight":
                prm.copy_(1 + 0.2 * torch.randn(prm.shape, generator=gen))
            else:
                prm.copy_(torch.randn(prm.shape, generator=gen) / prm.shape[-1] ** 0.5)
    cpu = cpu.to(dtype).eval()
    gpu = copy.deepcopy(cpu).cuda()
    for layer, dev in ((cpu, CPU), (gpu, torch.device("cuda"))):
        spec = layer.cache_spec(dtype)
        layer.bind_state({s.name: torch.zeros((SLOTS, *s.shape), dtype=s.dtype, device=dev) for s in spec.tensors})
        scratch = layer.verify_scratch_spec(dtype)  # the candidate conv window and the SSM update's inputs (stash)
        layer.bind_verify_scratch({s.name: torch.full((4, DRAFTS + 1, *s.shape), float("nan"), dtype=s.dtype,
                                                      device=dev) for s in scratch.tensors})
    return cpu, gpu


def meta_of(lens: list[int], slots: list[int], device: torch.device, verify_rows: int = 0,
            graph: bool = False) -> StepMetadata:
    qsl = _qsl(lens, CPU)
    sl = torch.tensor(slots, dtype=torch.int64)
    verify = None
    if verify_rows:
        nv = int(qsl[verify_rows])
        rest = qsl[verify_rows:] - nv
        verify = VerifyMetadata(num_rows=verify_rows, num_tokens=nv, max_query_len=max(lens[:verify_rows]),
                                query_start_loc=qsl[: verify_rows + 1].to(device),
                                state_slots=sl[:verify_rows].to(device), rest_query_start_loc=rest.to(device),
                                rest_state_slots=sl[verify_rows:].to(device),
                                rest_max_query_len=max(lens[verify_rows:], default=0),
                                rest_query_start_loc_cpu=None if graph else rest)
    t = int(qsl[-1])
    return StepMetadata(positions=torch.zeros(t, dtype=torch.int64, device=device), query_start_loc=qsl.to(device),
                        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device), state_slots=sl.to(device),
                        block_tables=torch.zeros(len(lens), 1, dtype=torch.int32, device=device),
                        slot_mapping=torch.zeros(t, dtype=torch.int64, device=device), max_query_len=max(lens),
                        max_seq_len=max(lens), verify=verify, query_start_loc_cpu=None if graph else qsl)


def compare_states(tag: str, cpu: Mamba2Mixer, gpu: Mamba2Mixer, srel: float) -> None:
    close(f"{tag} conv_state", gpu.state["conv_state"], cpu.state["conv_state"], 1e-2 if srel > 1e-4 else 1e-5)
    close(f"{tag} ssm_state", gpu.state["ssm_state"], cpu.state["ssm_state"], srel)


def compare_scratch(tag: str, cpu: Mamba2Mixer, gpu: Mamba2Mixer, rows: slice, srel: float) -> None:
    """The verify scratch's rows: the candidate conv windows and the stash of the SSM update's inputs (the conv's
    outputs and the projection's dt: one unit in the last place of a bf16 model apart)."""
    assert cpu.verify_scratch is not None and gpu.verify_scratch is not None
    for key, want in cpu.verify_scratch.items():
        tol = 1e-2 if srel > 1e-4 else 1e-4
        close(f"{tag} {key} scratch", gpu.verify_scratch[key][rows], want[rows], tol)


MIXER_CASES = [("f32", F32, "float32", 2e-4, 2e-4), ("bf16", BF16, "float32", 4e-2, 2e-2),
               ("bf16_bf16_state", BF16, "bfloat16", 4e-2, 3e-2)]


@pytest.mark.parametrize("name,dtype,state_dtype,rel,srel", MIXER_CASES, ids=[c[0] for c in MIXER_CASES])
def test_mixer_eager_without_sync_then_decode_and_verify_graphs(name: str, dtype: torch.dtype, state_dtype: str,
                                                                rel: float, srel: float) -> None:
    cpu, gpu = make_mixers(dtype, state_dtype)
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(37)

    def x_of(n: int) -> torch.Tensor:
        return torch.randn(n, HIDDEN, generator=gen).to(dtype)

    def both(tag: str, lens: list[int], slots: list[int], verify_rows: int = 0, sync_free: bool = True) -> None:
        x = x_of(sum(lens))
        # The inputs and metadata reach the device first (a copy from pageable host memory waits for it).
        xd, meta = x.to(dev), meta_of(lens, slots, dev, verify_rows)
        with torch.no_grad():
            want = cpu(x, meta_of(lens, slots, CPU, verify_rows))
            if sync_free:
                with no_sync():
                    got = gpu(xd, meta)
            else:
                got = gpu(xd, meta)
        torch.cuda.synchronize()
        close(f"{name} {tag} y", got, want, rel)
        compare_states(f"{name} {tag}", cpu, gpu, srel)

    # Prefill chunks (bf16: fla's chunked scan, which reads its chunk count on the host; float32: the recurrent
    # kernel, no sync), an empty row on slot 7, then a second chunk of one row with a decode row beside it.
    both("prefill", [40, 0, 23, 9], [5, 7, 1, 3], sync_free=dtype == F32)
    both("chunk2", [17, 1, 1], [5, 1, 3], sync_free=dtype == F32)
    both("decode", [1, 1, 1, 0], [5, 1, 3, 7])
    both("verify", [DRAFTS + 1, 0, 2, 1], [5, 7, 1, 3], verify_rows=4)
    compare_scratch(f"{name} verify", cpu, gpu, slice(None), srel)
    # A candidate snapshot (row 0 after its second token into pool entry 6), then the commit: row 0 keeps two
    # tokens, the empty row nothing, the others their first (both replay the stash into the slots).
    for layer, d in ((cpu, CPU), (gpu, dev)):
        slots_t = torch.tensor([5, 7, 1, 3], device=d)
        one = torch.tensor([0], device=d)
        layer.snapshot_candidates(one, one + 1, torch.tensor([6], device=d), slots_t)
        layer.commit_verified(slots_t, torch.tensor([1, -1, 0, 0], device=d))
    torch.cuda.synchronize()
    compare_states(f"{name} snapshot and commit", cpu, gpu, srel)
    both("verify+prefill", [2, 1, 12], [5, 3, 1], verify_rows=2, sync_free=dtype == F32)

    # The decode graph: 3 rows of one token, replayed over 3 steps with new inputs.
    rows, slots = 3, [5, 1, 3]
    x_buf = torch.zeros(rows, HIDDEN, dtype=dtype, device=dev)
    dec = meta_of([1] * rows, slots, dev, graph=True)
    with torch.no_grad():
        graph, out = capture(lambda: gpu(x_buf, dec))
    # Warm-up and capture ran the step twice on the device: restore the states from the CPU's.
    for key in gpu.state:
        gpu.state[key].copy_(cpu.state[key])
    for i in range(3):
        x = x_of(rows)
        x_buf.copy_(x)
        graph.replay()
        with torch.no_grad():
            want = cpu(x, meta_of([1] * rows, slots, CPU))
        torch.cuda.synchronize()
        close(f"{name} decode graph {i} y", out, want, rel)
        compare_states(f"{name} decode graph {i}", cpu, gpu, srel)

    # The verify graph: 2 rows of k + 1 tokens, replayed twice; the live states must not move.
    vlens, vslots = [DRAFTS + 1, DRAFTS + 1], [1, 5]
    xv_buf = torch.zeros(sum(vlens), HIDDEN, dtype=dtype, device=dev)
    ver = meta_of(vlens, vslots, dev, verify_rows=2, graph=True)
    with torch.no_grad():
        vgraph, vout = capture(lambda: gpu(xv_buf, ver))
    for i in range(2):
        x = x_of(sum(vlens))
        xv_buf.copy_(x)
        vgraph.replay()
        with torch.no_grad():
            want = cpu(x, meta_of(vlens, vslots, CPU, verify_rows=2))
        torch.cuda.synchronize()
        close(f"{name} verify graph {i} y", vout, want, rel)
        compare_states(f"{name} verify graph {i}", cpu, gpu, srel)
        compare_scratch(f"{name} verify graph {i}", cpu, gpu, slice(0, 2), srel)


# The Mamba2 families' norm kernels (hyserve.kernels.norm) on CUDA against their CPU references, at Nemotron-H-8B's
# widths (hidden 4096, gated-norm groups of 1024 in 8192 channels; Granite's one group over the width) and odd ones;
# each eager without a sync, then captured in a CUDA graph and replayed with new inputs.
NORM_TOLS = {F32: 1e-5, BF16: 8e-3, torch.float16: 1e-3}  # about one unit in the last place of the largest value


def _norm_rows(t: int, d: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(t, d + 3, generator=gen) * 2).to(dtype)[:, 1 : 1 + d]


@pytest.mark.parametrize("dtype", list(NORM_TOLS), ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("t", [0, 1, 33])
def test_scaled_norms_match_the_cpu_reference_without_sync(dtype: torch.dtype, t: int) -> None:
    from hyserve.kernels.norm import add_scaled_rms_norm, add_scaled_rms_norm_ref, scaled_rms_norm, scaled_rms_norm_ref

    gen = torch.Generator().manual_seed(101 + t)
    for d in (37, 4096):
        x, delta = _norm_rows(t, d, dtype, gen), _norm_rows(t, d, dtype, gen)
        w = (1 + 0.3 * torch.randn(d, generator=gen)).to(dtype)
        xc, dc, wc = x.cuda(), delta.cuda(), w.cuda()
        with no_sync():
            got = scaled_rms_norm(xc, wc, 1e-5)
            res, out = add_scaled_rms_norm(xc, dc, wc, 1e-5, 1.6)
            res1, out1 = add_scaled_rms_norm(xc, dc, wc, 1e-5)
        close(f"scaled {d}", got, scaled_rms_norm_ref(x, w, 1e-5), NORM_TOLS[dtype])
        for tag, (r, o), s in (("multiplied", (res, out), 1.6), ("plain", (res1, out1), 1.0)):
            want_res, want_out = add_scaled_rms_norm_ref(x, delta, w, 1e-5, s)
            assert r.dtype == want_res.dtype, f"add {tag} {d}: residual dtype"
            if dtype == F32 and s != 1.0:  # the compiler fuses x + d * s into one rounding (torch rounds twice):
                # they differ by at most the product's rounding plus the sum's, bounded by the operands' magnitude
                # (not the result's: x and d * s nearly cancel in some of 4096 random entries)
                err = (r.cpu() - want_res).abs()
                bound = 2.0**-23 * (x.abs() + 2 * (delta * s).abs())
                assert bool((err <= bound).all()), f"add {tag} {d}: residual off by {float(err.max()):.3g}"
            else:
                assert torch.equal(r.cpu(), want_res), f"add {tag} {d}: residual differs"
            close(f"add {tag} {d} norm", o, want_out, NORM_TOLS[dtype])


@pytest.mark.parametrize("dtype", list(NORM_TOLS), ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("norm_before_gate", [False, True], ids=["gate_first", "norm_first"])
def test_grouped_gated_norm_matches_the_cpu_reference_without_sync(dtype: torch.dtype, norm_before_gate: bool) -> None:
    from hyserve.kernels.norm import (
        gated_sum_squares,
        gated_sum_squares_ref,
        grouped_gated_rms_norm,
        grouped_gated_rms_norm_ref,
        silu_gate,
        silu_gate_ref,
    )

    gen = torch.Generator().manual_seed(111)
    for t in (0, 1, 33):
        for width, group in ((8192, 1024), (8192, 8192), (39, 13)):
            y = torch.randn(t, width, generator=gen) * 1.5
            z = (torch.randn(t, width + 11, generator=gen) * 2).to(dtype)[:, 4 : 4 + width]
            w = (1 + 0.3 * torch.randn(width, generator=gen)).to(dtype)
            yc, zc, wc = y.cuda(), z.cuda(), w.cuda()
            with no_sync():
                got = grouped_gated_rms_norm(yc, zc, wc, group, 1e-5, norm_before_gate, dtype)
                sums = gated_sum_squares(yc, zc, norm_before_gate)
                spanning = grouped_gated_rms_norm(yc, zc, wc, 2 * width, 1e-5, norm_before_gate, dtype, sums * 2)
                gate = silu_gate(yc, zc, dtype)
            tag = f"T={t} {width}/{group}"
            close(f"gated {tag}", got, grouped_gated_rms_norm_ref(y, z, w, group, 1e-5, norm_before_gate, dtype),
                  NORM_TOLS[dtype])
            want_sums = gated_sum_squares_ref(y, z, norm_before_gate)
            close(f"sum of squares {tag}", sums, want_sums, 1e-5)
            close(f"spanning {tag}", spanning, grouped_gated_rms_norm_ref(y, z, w, 2 * width, 1e-5, norm_before_gate,
                                                                          dtype, want_sums * 2), NORM_TOLS[dtype])
            close(f"gate alone {tag}", gate, silu_gate_ref(y, z, dtype), 2 * NORM_TOLS[dtype])


def test_norm_kernels_replay_in_a_cuda_graph() -> None:
    """A block's norms as a decode step captures them: the residual add fused into the scaled norm (Granite's
    multiplier), then the grouped gated norm, replayed with new inputs against the CPU references."""
    from hyserve.kernels.norm import (
        add_scaled_rms_norm,
        add_scaled_rms_norm_ref,
        grouped_gated_rms_norm,
        grouped_gated_rms_norm_ref,
    )

    gen = torch.Generator().manual_seed(121)
    t, d, width, group = 4, 4096, 8192, 1024
    w = (1 + 0.3 * torch.randn(d, generator=gen)).to(BF16)
    wg = (1 + 0.3 * torch.randn(width, generator=gen)).to(BF16)
    bufs = [torch.zeros(t, d, dtype=BF16, device="cuda"), torch.zeros(t, d, dtype=BF16, device="cuda"),
            torch.zeros(t, width, device="cuda"), torch.zeros(t, width, dtype=BF16, device="cuda")]
    wc, wgc = w.cuda(), wg.cuda()

    def step() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        res, out = add_scaled_rms_norm(bufs[0], bufs[1], wc, 1e-5, 1.6)
        return res, out, grouped_gated_rms_norm(bufs[2], bufs[3], wgc, group, 1e-5, False, BF16)

    graph, outs = capture(step)
    for i in range(2):
        x, delta = (torch.randn(t, d, generator=gen) * 2).to(BF16), torch.randn(t, d, generator=gen).to(BF16)
        y, z = torch.randn(t, width, generator=gen), torch.randn(t, width, generator=gen).to(BF16)
        for buf, v in zip(bufs, (x, delta, y, z), strict=True):
            buf.copy_(v)
        graph.replay()
        torch.cuda.synchronize()
        want_res, want_out = add_scaled_rms_norm_ref(x, delta, w, 1e-5, 1.6)
        assert torch.equal(outs[0].cpu(), want_res), f"graph replay {i}: residual differs"
        close(f"graph replay {i} norm", outs[1], want_out, NORM_TOLS[BF16])
        close(f"graph replay {i} gated norm", outs[2], grouped_gated_rms_norm_ref(y, z, wg, group, 1e-5, False, BF16),
              NORM_TOLS[BF16])

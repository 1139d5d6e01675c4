"""Qwen4-Exp's PLE and indexed (QSA) attention on CUDA (skipped without a GPU).

The layers' one torch formulation (hyserve.layers.ple, hyserve.layers.qsa) runs on the device without a host sync:

* eager steps (prefill chunks, decode, verify rows) under ``torch.cuda.set_sync_debug_mode("error")`` equal the same
  layer on the CPU (same weights, same caches and states);
* a decode step (one token per row, ``max_seq_len`` = the model length, no host copies) and a verify step (k + 1
  tokens per row) are captured in a ``torch.cuda.CUDAGraph`` and replayed over several steps with new inputs written
  into the persistent buffers: outputs, states, candidates and caches equal the CPU's eager steps.
"""

from __future__ import annotations

import copy
import math
import random
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from hyserve.layers.ple import PerLayerEmbedding
from hyserve.layers.qsa import IndexedAttention, indexed_attention, indexed_attention_ref
from hyserve.layers.quantization import QuantizationConfig
from hyserve.layers.rotary import RotaryEmbedding
from hyserve.model.metadata import StepMetadata, VerifyMetadata
from hyserve.model.mrope import MRotaryEmbedding
from hyserve.testing.cuda import capture, no_sync

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CPU = torch.device("cpu")
EOS = 1
MAX_MODEL_LEN = 160
BS = 16
K = 3  # drafts per verify row


def close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    torch.testing.assert_close(got.detach().to(CPU).float(), want.detach().float(), rtol=tol, atol=tol)


# ------------------------------------------------------------------------------------------------------------ QSA


@dataclass
class QCfg:
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    attention_bias: bool = False
    rms_norm_eps: float = 1e-6
    quantization: QuantizationConfig | None = None
    indexer_n_heads: int = 4
    indexer_head_dim: int = 32
    indexer_budget: int = 32
    indexer_compress_ratio: int = 8
    partial_rotary_factor: float = 0.5


def make_qsa(dtype: torch.dtype, mrope: bool = False) -> IndexedAttention:
    """The QSA layer; ``mrope``: with M-RoPE (a model with images: the positions' store and the kernels' M-RoPE
    path)."""
    cfg = QCfg()
    rotary_dim = int(cfg.head_dim * cfg.partial_rotary_factor)
    rotary = (MRotaryEmbedding(rotary_dim, 10000.0, (rotary_dim // 4, rotary_dim // 8, rotary_dim // 8)) if mrope
              else RotaryEmbedding(rotary_dim, 10000.0))
    layer = IndexedAttention(cfg, rotary, "model.layers.3.self_attn")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.1 if p.dim() == 1 else 0.3))
    return layer.to(dtype).eval()


def bind_qsa_caches(layer: IndexedAttention, device: torch.device, num_blocks: int, dtype: torch.dtype) -> None:
    """Zeroed paged K, V and index caches for ``layer`` on ``device``."""
    spec = layer.cache_spec(dtype)
    shape = (num_blocks, BS, spec.num_kv_heads, spec.head_dim)
    layer.bind_kv(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
    layer.bind_index_cache(torch.zeros(num_blocks, BS, spec.index_dim, dtype=dtype, device=device))


def qsa_tables(reqs: int, num_blocks: int) -> torch.Tensor:
    ids = list(range(1, num_blocks))
    random.Random(7).shuffle(ids)
    width = MAX_MODEL_LEN // BS
    return torch.tensor([ids[r * width:(r + 1) * width] for r in range(reqs)], dtype=torch.int32)


def qsa_meta(chunks: list[tuple[int, int, int]], tables: torch.Tensor, device: torch.device,
             max_seq_len: int | None = None, verify_rows: int = 0) -> StepMetadata:
    """chunks: (request, start, n) per row."""
    positions, slots, qsl, lens = [], [], [0], []
    for req, start, n in chunks:
        for p in range(start, start + n):
            positions.append(p)
            slots.append(int(tables[req, p // BS]) * BS + p % BS)
        qsl.append(qsl[-1] + n)
        lens.append(start + n)
    qsl_t = torch.tensor(qsl, dtype=torch.int32, device=device)
    r = len(chunks)
    verify = None
    if verify_rows:
        verify = VerifyMetadata(num_rows=verify_rows, num_tokens=qsl[verify_rows], max_query_len=K + 1,
                                query_start_loc=qsl_t[:verify_rows + 1], state_slots=torch.arange(verify_rows),
                                rest_query_start_loc=qsl_t[verify_rows:] - qsl[verify_rows],
                                rest_state_slots=torch.arange(verify_rows, r), rest_max_query_len=0)
    return StepMetadata(
        positions=torch.tensor(positions, dtype=torch.int64, device=device), query_start_loc=qsl_t,
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        state_slots=torch.arange(r, device=device), block_tables=tables[[c[0] for c in chunks]].to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        max_query_len=max(c[2] for c in chunks), max_seq_len=max_seq_len or max(lens), verify=verify,
        query_start_loc_cpu=None if max_seq_len else qsl_t.cpu())


def with_image(meta: StepMetadata) -> StepMetadata:
    """``meta`` with (3, T) M-RoPE positions: tokens at positions 10 .. 39 an image of rows of 6 (height and width
    advancing inside it), the others text."""
    p = meta.positions
    inside = (p >= 10) & (p < 40)
    three = p.expand(3, -1).clone()
    three[1] = torch.where(inside, 10 + (p - 10) // 6, p)
    three[2] = torch.where(inside, 10 + (p - 10) % 6, p)
    three[0] = torch.where(inside, torch.full_like(p, 10), p)
    meta.mrope_positions = three
    return meta


def qsa_run(layer: IndexedAttention, x: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
    layer.rotary[0].prepare(meta.rotary_positions)
    return layer(x, meta)


def copy_meta(dst: StepMetadata, src: StepMetadata) -> None:
    """Refill a graph's persistent metadata buffers from a step's metadata (same shapes)."""
    for name in ("positions", "query_start_loc", "seq_lens", "state_slots", "block_tables", "slot_mapping"):
        getattr(dst, name).copy_(getattr(src, name))


@pytest.mark.parametrize("mrope", [False, True], ids=["text", "mrope"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_qsa_eager_without_sync_then_decode_and_verify_graphs(dtype: torch.dtype, tol: float, mrope: bool) -> None:
    """Eager prefill chunks (with ``mrope``: an image's three-axis positions inside row 2's), then decode and
    verify steps in CUDA graphs (text positions), against the CPU; the caches (and the positions' store) equal."""
    torch.manual_seed(0)
    cpu_layer = make_qsa(dtype, mrope)
    dev = torch.device("cuda")
    gpu_layer = copy.deepcopy(cpu_layer).to(dev)
    reqs, num_blocks = 4, 4 * (MAX_MODEL_LEN // BS) + 1
    tables = qsa_tables(reqs, num_blocks)
    bind_qsa_caches(cpu_layer, CPU, num_blocks, dtype)
    bind_qsa_caches(gpu_layer, dev, num_blocks, dtype)
    gen = torch.Generator().manual_seed(1)

    def x_of(n: int) -> torch.Tensor:
        return torch.randn(n, QCfg.hidden_size, generator=gen).to(dtype)

    image = with_image if mrope else (lambda m: m)

    def both(chunks: list[tuple[int, int, int]], x: torch.Tensor, verify_rows: int = 0) -> torch.Tensor:
        want = qsa_run(cpu_layer, x, image(qsa_meta(chunks, tables, CPU, verify_rows=verify_rows)))
        meta, xd = image(qsa_meta(chunks, tables, dev, verify_rows=verify_rows)), x.to(dev)  # before the guard
        with no_sync():
            got = qsa_run(gpu_layer, xd, meta)
        close(got, want, tol)
        return want

    ctx = [70, 45, 101, 9]
    with torch.no_grad():
        # Eager prefill in chunks (dense and sparse queries), rows out of order.
        both([(2, 0, 60), (0, 0, 40), (1, 0, 45)], x_of(145))
        both([(0, 40, 30), (2, 60, 41), (3, 0, 9)], x_of(80))
        # The decode graph: 4 rows, one token each, max_seq_len = the model length.
        dec = qsa_meta([(r, ctx[r], 1) for r in range(reqs)], tables, dev, max_seq_len=MAX_MODEL_LEN)
        x_buf = torch.zeros(reqs, QCfg.hidden_size, dtype=dtype, device=dev)
        graph, out = capture(lambda: qsa_run(gpu_layer, x_buf, dec))
        for _ in range(3):
            chunks = [(r, ctx[r], 1) for r in (2, 0, 3, 1)]
            x = x_of(reqs)
            want = qsa_run(cpu_layer, x, qsa_meta(chunks, tables, CPU))
            copy_meta(dec, qsa_meta(chunks, tables, dev, max_seq_len=MAX_MODEL_LEN))
            x_buf.copy_(x)
            graph.replay()
            close(out, want, tol)
            ctx = [c + 1 for c in ctx]
        # The verify graph: 2 rows of k + 1 tokens.
        ver = qsa_meta([(r, ctx[r], K + 1) for r in (0, 1)], tables, dev, max_seq_len=MAX_MODEL_LEN, verify_rows=2)
        xv_buf = torch.zeros(2 * (K + 1), QCfg.hidden_size, dtype=dtype, device=dev)
        vgraph, vout = capture(lambda: qsa_run(gpu_layer, xv_buf, ver))
        for rows in ((0, 1), (2, 3), (3, 0)):
            chunks = [(r, ctx[r], K + 1) for r in rows]
            x = x_of(2 * (K + 1))
            want = qsa_run(cpu_layer, x, qsa_meta(chunks, tables, CPU, verify_rows=2))
            copy_meta(ver, qsa_meta(chunks, tables, dev, max_seq_len=MAX_MODEL_LEN, verify_rows=2))
            xv_buf.copy_(x)
            vgraph.replay()
            close(vout, want, tol)
            for r in rows:
                ctx[r] += 1  # one draft accepted: the rest is overwritten next time
    torch.cuda.synchronize()
    for name in ("k_cache", "v_cache", "index_cache"):
        close(getattr(gpu_layer, name), getattr(cpu_layer, name), tol)
    if mrope:
        assert gpu_layer.position_cache is not None and cpu_layer.position_cache is not None
        assert torch.equal(gpu_layer.position_cache.cpu(), cpu_layer.position_cache)
        assert int(cpu_layer.position_cache[..., 1].ne(cpu_layer.position_cache[..., 0]).sum()) > 0


def test_qsa_device_path_equals_the_cpu_reference_with_ties() -> None:
    """The batched function on CUDA against the per-row reference on the CPU, where many blocks tie at 0."""
    gen = torch.Generator().manual_seed(3)
    lens = [(150, 1), (33, 1), (0, 0), (120, 7), (64, 20), (5, 5)]
    bs, hkv, d, hi, di, c, budget = 16, 2, 32, 4, 32, 8, 32
    nblocks = 64
    tables = torch.randperm(nblocks - 1, generator=gen)[:len(lens) * 10].view(len(lens), 10).to(torch.int32) + 1
    index = torch.randn(nblocks, bs, di, generator=gen)
    flat = index.view(-1, di)
    for r, (ctx, _) in enumerate(lens):  # blocks 2.. of every row: non-positive keys, scores exactly 0
        for p in range(2 * c, ctx):
            flat[int(tables[r, p // bs]) * bs + p % bs] = -torch.rand(di, generator=gen) - 0.1
    t = sum(n for _, n in lens)
    qsl = torch.tensor([0, *torch.tensor([n for _, n in lens]).cumsum(0).tolist()], dtype=torch.int32)
    args: dict[str, Any] = dict(q=torch.randn(t, 4, d, generator=gen), iq=torch.randn(t, hi, di, generator=gen).abs(),
                k_cache=torch.randn(nblocks, bs, hkv, d, generator=gen),
                v_cache=torch.randn(nblocks, bs, hkv, d, generator=gen), index_cache=index, block_tables=tables,
                query_start_loc=qsl, seq_lens=torch.tensor([c_ for c_, _ in lens], dtype=torch.int32),
                scale=d ** -0.5, k_norm=torch.nn.Identity(), inv_freq=torch.zeros(8), budget=budget, c=c)
    want = indexed_attention_ref(**args)
    dev_args: dict[str, Any] = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    with no_sync():
        got = indexed_attention(**dev_args, max_seq_len=MAX_MODEL_LEN)
    close(got, want, 1e-4)


# ------------------------------------------------------------------------------------------------------------ PLE


@dataclass
class PCfg:
    hidden_size: int = 32
    hc_count: int = 2
    ple_embed_dim: int = 32
    ple_conv_kernel_size: int = 4
    ngram_size: int = 3
    heads_per_ngram: int = 2
    ngram_vocab_size_base: int = 1000
    make_ngram_vocab_size_divisible_by: int = 128
    seed: int = 1234
    vocab_size: int = 50
    split_ngram_parts: int = 4
    rms_norm_eps: float = 1e-6
    ple_eos_token_id: int = EOS


W = PCfg.hidden_size * PCfg.hc_count


def make_ple(device: torch.device, dtype: torch.dtype, slots: int, verify_rows: int) -> PerLayerEmbedding:
    torch.manual_seed(0)
    layer = PerLayerEmbedding(PCfg(), 1, "model.layers.1.ple")
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" in name else 1.0 if "ngram" in name else 0.3))
    layer = layer.to(device=device, dtype=dtype)
    spec = layer.cache_spec(dtype)
    layer.bind_state(spec.allocate((slots,), device))
    layer.bind_verify_scratch(spec.allocate((verify_rows, K + 1), device))
    return layer


def ple_meta(lens: list[int], slots: list[int], device: torch.device, verify_rows: int = 0,
             graph: bool = False) -> StepMetadata:
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    t = sum(lens)
    slot_t = torch.tensor(slots, dtype=torch.int64, device=device)
    verify = None
    if verify_rows:
        nv = sum(lens[:verify_rows])
        verify = VerifyMetadata(num_rows=verify_rows, num_tokens=nv, max_query_len=K + 1,
                                query_start_loc=qsl[:verify_rows + 1], state_slots=slot_t[:verify_rows],
                                rest_query_start_loc=qsl[verify_rows:] - nv, rest_state_slots=slot_t[verify_rows:],
                                rest_max_query_len=max(lens[verify_rows:], default=0))
    return StepMetadata(positions=torch.zeros(t, dtype=torch.int64, device=device), query_start_loc=qsl,
                        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device), state_slots=slot_t,
                        block_tables=torch.zeros(len(lens), 1, dtype=torch.int32, device=device),
                        slot_mapping=torch.full((t,), -1, dtype=torch.int64, device=device),
                        max_query_len=max(lens), max_seq_len=MAX_MODEL_LEN, verify=verify,
                        query_start_loc_cpu=None if graph else qsl.cpu())


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_ple_eager_without_sync_then_decode_and_verify_graphs(dtype: torch.dtype, tol: float) -> None:
    dev = torch.device("cuda")
    slots, vrows = 8, 2
    cpu_layer = make_ple(CPU, dtype, slots, vrows)
    gpu_layer = make_ple(dev, dtype, slots, vrows)
    gpu_layer.load_state_dict(cpu_layer.state_dict())
    gen = torch.Generator().manual_seed(2)

    def step(lens: list[int], sl: list[int], verify_rows: int = 0) -> None:
        t = sum(lens)
        ids = torch.randint(2, 50, (t,), generator=gen)
        ids[torch.rand(t, generator=gen) < 0.1] = EOS
        x = torch.randn(t, W, generator=gen).to(dtype)
        want = cpu_layer(x, ids, ple_meta(lens, sl, CPU, verify_rows))
        meta, xd, idd = ple_meta(lens, sl, dev, verify_rows), x.to(dev), ids.to(dev)  # copies in: before the guard
        with no_sync():
            got = gpu_layer(xd, idd, meta)
        close(got, want, tol)

    with torch.no_grad():
        step([7, 0, 12, 2], [5, 5, 1, 6])  # an empty row naming a busy slot
        step([1, 9, 1], [6, 3, 5])
        step([K + 1, K + 1, 5], [5, 1, 3], verify_rows=2)
        # Decode graph: 4 rows of one token.
        rows = 4
        dec = ple_meta([1] * rows, [5, 1, 3, 6], dev, graph=True)
        x_buf = torch.zeros(rows, W, dtype=dtype, device=dev)
        id_buf = torch.zeros(rows, dtype=torch.int64, device=dev)
        # The warm-up call advances the rows' states on the device: put them back, so the CPU (which made no such
        # step) and the replays start from the same states.
        kept = {name: t.clone() for name, t in gpu_layer.state.items()}
        graph, out = capture(lambda: gpu_layer(x_buf, id_buf, dec))
        for name, t in kept.items():
            gpu_layer.state[name].copy_(t)
        for sl in ([5, 1, 3, 6], [6, 3, 1, 5], [0, 2, 4, 7]):
            ids = torch.randint(2, 50, (rows,), generator=gen)
            ids[0] = EOS
            x = torch.randn(rows, W, generator=gen).to(dtype)
            want = cpu_layer(x, ids, ple_meta([1] * rows, sl, CPU))
            dec.state_slots.copy_(torch.tensor(sl))
            x_buf.copy_(x)
            id_buf.copy_(ids)
            graph.replay()
            close(out, want, tol)
        # Verify graph: 2 rows of k + 1 tokens, no rest rows.
        ver = ple_meta([K + 1] * vrows, [5, 1], dev, verify_rows=vrows, graph=True)
        xv_buf = torch.zeros(vrows * (K + 1), W, dtype=dtype, device=dev)
        idv_buf = torch.zeros(vrows * (K + 1), dtype=torch.int64, device=dev)
        vgraph, vout = capture(lambda: gpu_layer(xv_buf, idv_buf, ver))
        for sl in ([5, 1], [3, 6], [7, 0]):
            n = vrows * (K + 1)
            ids = torch.randint(2, 50, (n,), generator=gen)
            ids[2] = EOS
            x = torch.randn(n, W, generator=gen).to(dtype)
            want = cpu_layer(x, ids, ple_meta([K + 1] * vrows, sl, CPU, verify_rows=vrows))
            assert ver.verify is not None
            ver.verify.state_slots.copy_(torch.tensor(sl))
            xv_buf.copy_(x)
            idv_buf.copy_(ids)
            vgraph.replay()
            close(vout, want, tol)
            assert gpu_layer.verify_scratch is not None and cpu_layer.verify_scratch is not None
            for name in ("token_context", "conv_state"):
                close(gpu_layer.verify_scratch[name], cpu_layer.verify_scratch[name], tol)
            gpu_layer.commit_verified(torch.tensor(sl, device=dev), torch.tensor([1, 0], device=dev))
            cpu_layer.commit_verified(torch.tensor(sl), torch.tensor([1, 0]))
    torch.cuda.synchronize()
    assert torch.equal(gpu_layer.state["token_context"].cpu(), cpu_layer.state["token_context"])
    close(gpu_layer.state["conv_state"], cpu_layer.state["conv_state"], tol)
    assert math.isfinite(float(gpu_layer.state["conv_state"].float().abs().sum()))


# ------------------------------------------------------------------------------------------ hyper-connections


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_hyper_connection_kernels_eager_and_in_a_graph(dtype: torch.dtype, tol: float) -> None:
    """``GatedResidual`` on CUDA (the fused kernels) equals the CPU's torch formulation: ``mix``, ``inject_and_mix``
    and ``inject_into``, eagerly without a host sync and captured in a CUDA graph replayed with new inputs."""
    from hyserve.layers.hyper_connection import GatedResidual

    h, s, rank, rows = 256, 4, 32, 5
    torch.manual_seed(0)
    cpu = GatedResidual(h, s, rank, 1e-6)
    with torch.no_grad():
        for p in cpu.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() == 1 else 0.1))
    cpu = cpu.to(dtype)
    gpu = copy.deepcopy(cpu).cuda()
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(5)

    def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (torch.randn(rows, s * h, generator=gen).to(dtype), torch.randn(rows, h, generator=gen).to(dtype),
                torch.rand(rows, s, generator=gen).to(dtype) * 2)

    def run(block: GatedResidual, x: torch.Tensor, o: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
        mixed, weights = block.mix(x)
        x2, h2, w2 = block.inject_and_mix(x, o, w)
        assert weights is not None and w2 is not None
        return [mixed, weights, x2, h2, w2, GatedResidual.inject_into(x2, h2, w2)]

    with torch.no_grad():
        x, o, w = inputs()
        want = run(cpu, x, o, w)
        xd, od_, wd = x.to(dev), o.to(dev), w.to(dev)
        with no_sync():
            got = run(gpu, xd, od_, wd)
        for g, t in zip(got, want, strict=True):
            close(g, t, tol)
        bufs = [torch.zeros_like(xd), torch.zeros_like(od_), torch.zeros_like(wd)]
        graph, outs = capture(lambda: run(gpu, *bufs))
        for _ in range(3):
            x, o, w = inputs()
            want = run(cpu, x, o, w)
            for b, v in zip(bufs, (x, o, w), strict=True):
                b.copy_(v)
            graph.replay()
            for g, t in zip(outs, want, strict=True):
                close(g, t, tol)


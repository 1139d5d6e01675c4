"""Qwen4-Exp's indexed (QSA) attention layer (``hyserve.layers.qsa``) against an independent dense reference.

The reference below is docs/qwen4_exp_facts.md §3.6 written straightforwardly on the unpaged whole sequence, one
query at a time (Python lists of visible positions, blocks cut from them, pooled, normed, rotated at their first
position, scored, ``topk``, plus the tail), sharing no code with the layer: its own RMSNorm, RoPE and softmax. The
layer runs over paged caches with shuffled block ids, several rows, staggered chunks, decode steps and verify rows.

Random weights make a block's relu-summed score exactly 0 only when every indexer head's dot product is negative;
such ties (and near ties) would make the selection depend on rounding, so each comparison first checks that the
reference's selection has a clear margin (``MARGIN``) at every sparse query: a failure there is a bad seed, not a
bug.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass

import pytest
import torch

from hyserve.cache.specs import AttentionSpec
from hyserve.layers.attention import Attention
from hyserve.layers.qsa import IndexedAttention, store_index_keys_ref
from hyserve.layers.quantization import QuantizationConfig
from hyserve.layers.rotary import RotaryEmbedding
from hyserve.model.base import CausalLM
from hyserve.model.loader import checkpoint_tensors
from hyserve.model.metadata import StepMetadata, VerifyMetadata
from hyserve.model.mrope import MRotaryEmbedding
from hyserve.testing.triton_interpreter import interpreter_subprocess_results
from hyserve.worker.memory import allocate_index_caches, allocate_kv

THETA = 10000.0
MARGIN = 1e-4


@dataclass
class Cfg:
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    attention_bias: bool = False
    rms_norm_eps: float = 1e-6
    quantization: QuantizationConfig | None = None
    indexer_n_heads: int = 3
    indexer_head_dim: int = 16
    indexer_budget: int = 8
    indexer_compress_ratio: int = 4
    partial_rotary_factor: float = 0.5

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


def make_layer(cfg: Cfg, seed: int = 0, dtype: torch.dtype = torch.float32) -> IndexedAttention:
    layer = IndexedAttention(cfg, RotaryEmbedding(cfg.rotary_dim, THETA), "model.layers.3.self_attn")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("norm.weight"):  # zero-centred norms: a scale of 1 + w
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    return layer.to(dtype)


# ------------------------------------------------------------------------------------------------ the reference


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())).to(x.dtype)


# The M-RoPE layout the image tests use: of rotary_dim / 2 = 4 frequencies, 1 turns with height, 2 with width.
SECTION = (2, 1, 1)


def _freq_positions(pos: int | tuple[int, int, int], n: int) -> torch.Tensor:
    """The position each of ``n`` frequencies turns at: ``pos`` for all (text), or transformers' interleaved M-RoPE
    of ``SECTION`` for a (time, height, width) ``pos``: frequency i takes height where i % 3 == 1 and i < 3 *
    SECTION[1], width where i % 3 == 2 and i < 3 * SECTION[2], time otherwise."""
    if isinstance(pos, int):
        return torch.full((n,), float(pos))
    axis = [1 if i % 3 == 1 and i < 3 * SECTION[1] else 2 if i % 3 == 2 and i < 3 * SECTION[2] else 0
            for i in range(n)]
    return torch.tensor([float(pos[a]) for a in axis])


def _rope(x: torch.Tensor, pos: int | tuple[int, int, int], rotary_dim: int) -> torch.Tensor:
    """x (..., D) rotated at one position (or M-RoPE's three) on its first rotary_dim channels (NeoX halves,
    cos/sin in x's dtype)."""
    inv = 1.0 / (THETA ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    ang = _freq_positions(pos, inv.shape[0]) * inv
    cos = torch.cat([ang.cos(), ang.cos()]).to(x.dtype)
    sin = torch.cat([ang.sin(), ang.sin()]).to(x.dtype)
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


@dataclass
class RefOut:
    y: torch.Tensor  # (L, hidden)
    selected: list[list[int]]  # per query: the positions it attends to
    sparse: list[bool]  # per query: whether the selection was sparse (more complete blocks than budget // c)
    margin: float  # smallest gap between the last chosen and the first left-out block score, over sparse queries


def reference(layer: IndexedAttention, cfg: Cfg, x: torch.Tensor, dense: bool = False,
              positions: list[tuple[int, int, int]] | None = None) -> RefOut:
    """The whole sequence x (L, hidden) through the QSA layer's formulas, per query; ``dense``: every query sees
    its whole causal prefix (the selection left out); ``positions``: each token's M-RoPE (time, height, width)
    positions (default: its index on every axis)."""
    sd = {k: v.detach() for k, v in checkpoint_tensors(layer).items()}  # checkpoint names (q, k, v merged in one GEMM)
    L = x.shape[0]
    at: list[int | tuple[int, int, int]] = list(positions) if positions is not None else list(range(L))
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    ih, idd, c = cfg.indexer_n_heads, cfg.indexer_head_dim, cfg.indexer_compress_ratio
    top, eps, rd = cfg.indexer_budget // c, cfg.rms_norm_eps, cfg.rotary_dim
    qg = (x @ sd["q_proj.weight"].T).view(L, nh, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:]
    q = _rms(q, sd["q_norm.weight"], eps)
    k = _rms((x @ sd["k_proj.weight"].T).view(L, nkv, hd), sd["k_norm.weight"], eps)
    v = (x @ sd["v_proj.weight"].T).view(L, nkv, hd)
    q = torch.stack([_rope(q[i], at[i], rd) for i in range(L)])
    k = torch.stack([_rope(k[i], at[i], rd) for i in range(L)])
    iqk = (x @ sd["indexer.index_qk_proj.weight"].T).view(L, ih + 1, idd)
    iq = _rms(iqk[:, :ih], sd["indexer.q_layernorm.weight"], eps)
    iq = torch.stack([_rope(iq[i], at[i], rd) for i in range(L)])
    kraw = iqk[:, ih]
    outs, selected, sparse, margin = [], [], [], math.inf
    for i in range(L):
        vis = list(range(i + 1))
        nb = len(vis) // c
        toks = vis
        sparse.append(nb > top and not dense)
        if nb > top and not dense:
            blocks = [vis[j * c:(j + 1) * c] for j in range(nb)]
            scores = []
            for blk in blocks:
                pooled = kraw[blk].float().mean(dim=0).to(kraw.dtype)
                kb = _rope(_rms(pooled, sd["indexer.k_layernorm.weight"], eps), at[blk[0]], rd)
                s = sum(max(0.0, float(iq[i, h].float() @ kb.float())) for h in range(ih)) / math.sqrt(idd)
                scores.append(s)
            order = sorted(range(nb), key=lambda j: -scores[j])
            chosen = sorted(order[:top])
            margin = min(margin, scores[order[top - 1]] - scores[order[top]])
            toks = [p for j in chosen for p in blocks[j]] + vis[nb * c:]
        selected.append(toks)
        o = torch.empty(nh, hd, dtype=torch.float32)
        for h in range(nh):
            kvh = h // (nh // nkv)
            att = (k[toks, kvh].float() @ q[i, h].float()) * hd**-0.5
            o[h] = torch.softmax(att, dim=0) @ v[toks, kvh].float()
        outs.append(o.to(x.dtype))
    attn = torch.stack(outs).reshape(L, nh * hd) * torch.sigmoid(gate.reshape(L, nh * hd))
    return RefOut(attn @ sd["o_proj.weight"].T, selected, sparse, margin)


# ------------------------------------------------------------------------------------------------ the paged harness


class Paged:
    """A layer over its own paged caches: each request owns shuffled block ids; steps are lists of (request, start,
    end) chunks."""

    def __init__(self, layer: IndexedAttention, dtype: torch.dtype, block_size: int, num_blocks: int = 64,
                 kv_dtype: torch.dtype | None = None, seed: int = 0) -> None:
        self.layer, self.bs, self.dtype = layer, block_size, dtype
        spec = dataclasses.replace(layer.cache_spec(dtype), dtype=kv_dtype or dtype)
        (k, v), = allocate_kv([spec], num_blocks, block_size, torch.device("cpu"))
        index, = allocate_index_caches([spec], num_blocks, block_size, torch.device("cpu"))
        assert index is not None
        layer.bind_kv(k, v)
        layer.bind_index_cache(index)
        self.free = list(range(1, num_blocks))  # block 0 unused, as the runner's null block
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}

    def blocks_for(self, req: int, length: int) -> list[int]:
        table = self.tables.setdefault(req, [])
        while len(table) * self.bs < length:
            table.append(self.free.pop())
        return table

    def step(self, chunks: list[tuple[int, torch.Tensor, int]], verify_rows: int = 0,
             mrope: dict[int, list[tuple[int, int, int]]] | None = None,
             shift: dict[int, int] | None = None) -> list[torch.Tensor]:
        """chunks: (request, x of the chunk's tokens (n, hidden), start position); the first ``verify_rows`` rows
        are verify rows; ``mrope``: a request's M-RoPE positions by sequence index, where the step's rows reach
        them (the step then carries (3, T) positions, as the runner's image steps do); ``shift``: a request's text
        positions past its last image, its sequence index plus this (the runner's decode steps). Returns each
        chunk's output (n, hidden)."""
        positions, qsl, seq_lens, slots, rows = [], [0], [], [], []
        for req, xc, start in chunks:
            n = xc.shape[0]
            table = self.blocks_for(req, start + n)
            for p in range(start, start + n):
                positions.append(p + (shift or {}).get(req, 0))
                slots.append(table[p // self.bs] * self.bs + p % self.bs)
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
            rows.append(table)
        width = max(len(t) for t in rows) + 2
        bt = torch.zeros(len(rows), width, dtype=torch.int32)
        for r, t in enumerate(rows):
            bt[r, :len(t)] = torch.tensor(t, dtype=torch.int32)
        R = len(chunks)
        qsl_t = torch.tensor(qsl, dtype=torch.int32)
        verify = None
        if verify_rows:
            nv = qsl[verify_rows]
            verify = VerifyMetadata(
                num_rows=verify_rows, num_tokens=nv, max_query_len=max(c[1].shape[0] for c in chunks[:verify_rows]),
                query_start_loc=qsl_t[:verify_rows + 1], state_slots=torch.arange(verify_rows),
                rest_query_start_loc=qsl_t[verify_rows:] - nv, rest_state_slots=torch.arange(verify_rows, R),
                rest_max_query_len=max([c[1].shape[0] for c in chunks[verify_rows:]], default=0))
        meta = StepMetadata(
            positions=torch.tensor(positions, dtype=torch.int64), query_start_loc=qsl_t,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32), state_slots=torch.arange(R),
            block_tables=bt, slot_mapping=torch.tensor(slots, dtype=torch.int64),
            max_query_len=max(c[1].shape[0] for c in chunks), max_seq_len=max(seq_lens), verify=verify)
        if mrope is not None:
            three = [mrope[req][p] if req in mrope else (p, p, p)
                     for req, xc, start in chunks for p in range(start, start + xc.shape[0])]
            meta.mrope_positions = torch.tensor(three, dtype=torch.int64).t().contiguous()
        x = torch.cat([c[1] for c in chunks]).to(self.dtype)
        self.layer.rotary[0].prepare(meta.rotary_positions)
        with torch.no_grad():
            y = self.layer(x, meta)
        return list(torch.split(y, [c[1].shape[0] for c in chunks]))


def _x(L: int, cfg: Cfg, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(L, cfg.hidden_size, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _check_ref(ref: RefOut) -> None:
    assert any(ref.sparse), "no query had more complete blocks than the budget: the selection is not exercised"
    assert ref.margin > MARGIN, f"the reference's selection has a near tie ({ref.margin}): pick another seed"


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = 2e-5) -> None:
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


# ------------------------------------------------------------------------------------------------ tests


def test_one_prompt_longer_than_budget_matches_the_reference_and_the_selection_matters() -> None:
    cfg = Cfg()
    layer = make_layer(cfg)
    x = _x(48, cfg, seed=1)
    ref = reference(layer, cfg, x)
    _check_ref(ref)
    (y,) = Paged(layer, torch.float32, block_size=8).step([(0, x, 0)])
    _close(y, ref.y)
    # The selection changes the output: dense attention differs at sparse queries (and only there).
    dense = reference(layer, cfg, x, dense=True).y
    sparse_rows = torch.tensor(ref.sparse)
    assert (y[sparse_rows] - dense[sparse_rows]).abs().max() > 1e-3
    _close(y[~sparse_rows], dense[~sparse_rows])


def test_staggered_chunks_of_several_rows_over_shuffled_blocks() -> None:
    cfg = Cfg()
    layer = make_layer(cfg, seed=2)
    lengths = {0: 45, 1: 37, 2: 52}
    xs = {r: _x(n, cfg, seed=10 + r) for r, n in lengths.items()}
    refs = {r: reference(layer, cfg, xs[r]) for r in lengths}
    for ref in refs.values():
        _check_ref(ref)
    paged = Paged(layer, torch.float32, block_size=8, seed=3)
    chunk = {0: 7, 1: 11, 2: 5}
    begin = {0: 0, 1: 1, 2: 3}  # the step each request starts at
    done = dict.fromkeys(lengths, 0)
    got: dict[int, list[torch.Tensor]] = {r: [] for r in lengths}
    for step in range(40):
        chunks = []
        for r in (2, 0, 1):  # rows not in request order
            if step >= begin[r] and done[r] < lengths[r]:
                n = min(chunk[r], lengths[r] - done[r])
                chunks.append((r, xs[r][done[r]:done[r] + n], done[r]))
                done[r] += n
        if not chunks:
            break
        for (r, _, _), y in zip(chunks, paged.step(chunks), strict=True):
            got[r].append(y)
    assert all(done[r] == lengths[r] for r in lengths)
    # The block tables are not the identity and the rows' blocks interleave.
    assert any(t != sorted(t) or t != list(range(t[0], t[0] + len(t))) for t in paged.tables.values())
    for r in lengths:
        _close(torch.cat(got[r]), refs[r].y)


def test_decode_one_token_at_a_time() -> None:
    cfg = Cfg()
    layer = make_layer(cfg, seed=4)
    lengths = {0: 41, 1: 34}
    xs = {r: _x(n, cfg, seed=20 + r) for r, n in lengths.items()}
    refs = {r: reference(layer, cfg, xs[r]) for r in lengths}
    for ref in refs.values():
        _check_ref(ref)
    paged = Paged(layer, torch.float32, block_size=4, seed=5)
    prefill = {0: 10, 1: 3}
    got = {r: paged.step([(r, xs[r][:prefill[r]], 0)])[0] for r in lengths}
    outs = {r: [got[r]] for r in lengths}
    for p in range(max(lengths.values())):
        chunks = [(r, xs[r][p:p + 1], p) for r in (1, 0) if prefill[r] <= p < lengths[r]]
        if not chunks:
            continue
        for (r, _, _), y in zip(chunks, paged.step(chunks), strict=True):
            outs[r].append(y)
    for r in lengths:
        _close(torch.cat(outs[r]), refs[r].y)


def test_a_query_completing_a_block_may_leave_itself_out() -> None:
    cfg = Cfg()
    c = cfg.indexer_compress_ratio
    layer = make_layer(cfg, seed=6)
    x = _x(64, cfg, seed=7)
    ref = reference(layer, cfg, x)
    _check_ref(ref)
    completing = [p for p in range(len(ref.selected)) if (p + 1) % c == 0 and ref.sparse[p]]
    left_out = [p for p in completing if p not in ref.selected[p]]
    kept = [p for p in completing if p in ref.selected[p]]
    assert left_out and kept, "the seed must give both a query whose own (just completed) block is left out and one"
    paged = Paged(layer, torch.float32, block_size=8, seed=8)
    # Prefill up to a block boundary, then decode: each query completing a block is its step's only token.
    first = completing[0]
    outs = [paged.step([(0, x[:first], 0)])[0]]
    for p in range(first, x.shape[0]):
        outs.append(paged.step([(0, x[p:p + 1], p)])[0])
    y = torch.cat(outs)
    _close(y, ref.y)
    # The query that leaves itself out differs from one that attends to its whole selection plus itself.
    assert (y[left_out] - reference(layer, cfg, x, dense=True).y[left_out]).abs().max() > 1e-3


def test_dense_when_the_blocks_fit_the_budget_equals_plain_attention() -> None:
    cfg = Cfg(indexer_budget=16)
    c, top = cfg.indexer_compress_ratio, cfg.indexer_budget // cfg.indexer_compress_ratio
    L = (top + 1) * c - 1  # the last query sees exactly budget // c complete blocks
    layer = make_layer(cfg, seed=9)
    x = _x(L, cfg, seed=10)
    ref = reference(layer, cfg, x)
    assert not any(ref.sparse)
    (y,) = Paged(layer, torch.float32, block_size=8).step([(0, x, 0)])
    _close(y, ref.y)
    # The existing paged attention with the same weights gives the same output.
    plain = Attention(cfg, layer.rotary[0], "model.layers.3.self_attn")
    plain.load_state_dict({k: v for k, v in layer.state_dict().items() if not k.startswith("indexer.")})
    spec = plain.cache_spec(torch.float32)
    (kc, vc), = allocate_kv([spec], 8, 8, torch.device("cpu"))
    plain.bind_kv(kc, vc)
    meta = StepMetadata(positions=torch.arange(L), query_start_loc=torch.tensor([0, L], dtype=torch.int32),
                        seq_lens=torch.tensor([L], dtype=torch.int32), state_slots=torch.zeros(1, dtype=torch.long),
                        block_tables=torch.arange(1, 5, dtype=torch.int32)[None], slot_mapping=torch.arange(8, 8 + L),
                        max_query_len=L, max_seq_len=L)
    plain.rotary[0].prepare(meta.positions)
    with torch.no_grad():
        _close(plain(x, meta), y)


def test_verify_rows_see_their_causal_prefix_and_rejected_drafts_are_overwritten() -> None:
    cfg = Cfg()
    layer = make_layer(cfg, seed=11)
    L, k = 40, 3
    x = _x(L, cfg, seed=12)
    other = _x(30, cfg, seed=13)
    drafts = _x(k, cfg, seed=14)
    paged = Paged(layer, torch.float32, block_size=8, seed=15)
    p0 = 27  # the verify row's last accepted token is at p0; drafts at p0+1..p0+k
    paged.step([(0, x[:p0], 0), (1, other[:9], 0)])
    # Verify row: [x[p0], drafts] (wrong tokens), beside a prefill chunk of another request.
    seq_spec = torch.cat([x[:p0 + 1], drafts])
    ref_spec = reference(layer, cfg, seq_spec)
    ref_other = reference(layer, cfg, other)
    _check_ref(ref_spec)
    yv, yo = paged.step([(0, seq_spec[p0:], p0), (1, other[9:30], 9)], verify_rows=1)
    _close(yv, ref_spec.y[p0:])
    _close(yo, ref_other.y[9:30])
    # One draft rejected at once: the next step feeds the true tokens from p0 + 1 over the drafts' slots.
    ref = reference(layer, cfg, x)
    _check_ref(ref)
    (y,) = paged.step([(0, x[p0 + 1:], p0 + 1)])
    _close(y, ref.y[p0 + 1:])


def test_bfloat16_follows_the_reference() -> None:
    cfg = Cfg()
    dtype = torch.bfloat16
    layer = make_layer(cfg, seed=21, dtype=dtype)
    x = _x(44, cfg, seed=22, dtype=dtype)
    ref = reference(layer, cfg, x)
    _check_ref(ref)
    paged = Paged(layer, dtype, block_size=8, seed=18)
    y = torch.cat([paged.step([(0, x[:20], 0)])[0], paged.step([(0, x[20:], 20)])[0]])
    assert paged.layer.index_cache is not None and paged.layer.index_cache.dtype == dtype
    _close(y, ref.y, tol=2e-2)


def test_the_layer_has_the_checkpoint_names_and_shapes() -> None:
    cfg = Cfg()
    layer = make_layer(cfg)
    ih, idd, h = cfg.indexer_n_heads, cfg.indexer_head_dim, cfg.hidden_size
    shapes = {k: tuple(v.shape) for k, v in checkpoint_tensors(layer).items()}
    assert shapes == {
        "q_proj.weight": (cfg.num_attention_heads * cfg.head_dim * 2, h),
        "k_proj.weight": (cfg.num_key_value_heads * cfg.head_dim, h),
        "v_proj.weight": (cfg.num_key_value_heads * cfg.head_dim, h),
        "o_proj.weight": (h, cfg.num_attention_heads * cfg.head_dim),
        "q_norm.weight": (cfg.head_dim,), "k_norm.weight": (cfg.head_dim,),
        "indexer.index_qk_proj.weight": ((ih + 1) * idd, h),
        "indexer.q_layernorm.weight": (idd,), "indexer.k_layernorm.weight": (idd,),
    }


def image_positions(text_before: int, grid: tuple[int, int], text_after: int) -> list[tuple[int, int, int]]:
    """M-RoPE positions of text, one image of ``grid`` (height, width) merged patches, then text, laid out as
    transformers' get_rope_index lays them: the image's tokens at (start, start + row, start + col), the text after
    it from start + max(grid)."""
    out = [(p, p, p) for p in range(text_before)]
    s = text_before
    out += [(s, s + i // grid[1], s + i % grid[1]) for i in range(grid[0] * grid[1])]
    nxt = s + max(grid)
    return out + [(p, p, p) for p in range(nxt, nxt + text_after)]


def mrope_layer(cfg: Cfg, seed: int) -> IndexedAttention:
    layer = IndexedAttention(cfg, MRotaryEmbedding(cfg.rotary_dim, THETA, SECTION), "model.layers.3.self_attn")
    ref = make_layer(cfg, seed=seed)
    layer.load_state_dict(ref.state_dict())
    return layer


def test_mrope_block_keys_turn_at_their_first_tokens_positions(monkeypatch: pytest.MonkeyPatch) -> None:
    """With images (M-RoPE), a block key turns at its first token's three positions, kept in the positions' store
    by the step that wrote the token: a prompt of text, an image whose blocks start inside and across its rows,
    and text, in chunks and then decode steps (the blocks of earlier steps read back from the store) beside a
    text-only row, against the per-query reference. Sabotaged: the store given each token's index in its step, or
    its time position on all three axes, the sparse queries' outputs move."""
    cfg = Cfg()
    pos = image_positions(6, (5, 6), 16)  # 52 tokens; blocks of 4 start at 0, 4, 8, ... across the image rows
    x, x_text = _x(len(pos), cfg, seed=7), _x(40, cfg, seed=8)
    layer = mrope_layer(cfg, seed=4)
    assert layer.cache_spec(torch.float32).index_positions
    ref = reference(layer, cfg, x, positions=pos)
    ref_text = reference(layer, cfg, x_text)
    _check_ref(ref)
    _check_ref(ref_text)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        paged = Paged(layer, torch.float32, block_size=8, seed=5)
        assert layer.position_cache is not None and layer.position_cache.shape[:2] == layer.index_cache.shape[:2]
        outs: dict[int, list[torch.Tensor]] = {0: [], 1: []}
        for (a, b), (ta, tb) in (((0, 13), (0, 20)), ((13, 30), (20, 33)), ((30, 48), (33, 37))):
            y0, y1 = paged.step([(0, x[a:b], a), (1, x_text[ta:tb], ta)], mrope={0: pos})
            outs[0].append(y0)
            outs[1].append(y1)
        for p in range(48, len(pos)):  # decode: text positions only (after the image), as the runner's graphs
            t = 37 + (p - 48) % 3
            y0, y1 = paged.step([(0, x[p:p + 1], p), (1, x_text[t:t + 1], t)],
                                mrope={0: pos} if p < 50 else None, shift={0: pos[p][0] - p})
            outs[0].append(y0)
            if p - 48 < 3:
                outs[1].append(y1)
        return torch.cat(outs[0]), torch.cat(outs[1])

    y, y_text = run()
    _close(y, ref.y)
    _close(y_text, ref_text.y)
    import hyserve.layers.qsa as qsa

    monkeypatch.setattr(qsa, "token_positions", lambda p: torch.arange(p.shape[-1], dtype=torch.int32)[:, None]
                        .expand(-1, 3).contiguous())
    bad, _ = run()
    sparse_rows = torch.tensor(ref.sparse)
    assert (bad[sparse_rows] - ref.y[sparse_rows]).abs().max() > 1e-3
    # Sabotaged again, subtler: the time position kept on all three axes (height and width lost).
    monkeypatch.undo()
    real = qsa.token_positions
    monkeypatch.setattr(qsa, "token_positions", lambda p: real(p[0] if p.dim() == 2 else p))
    bad, _ = run()
    assert (bad[sparse_rows] - ref.y[sparse_rows]).abs().max() > 1e-3


# ------------------------------------------------------------------------------------------------ the cache


def test_an_fp8_kv_spec_keeps_the_index_keys_in_the_model_dtype() -> None:
    layer = make_layer(Cfg(), dtype=torch.bfloat16)
    spec = layer.cache_spec(torch.bfloat16)
    assert (spec.index_dim, spec.index_dtype) == (16, torch.bfloat16)
    fp8 = dataclasses.replace(spec, dtype=torch.float8_e4m3fn)  # what the model runner does for kv_cache_dtype=fp8
    assert fp8.index_dtype == torch.bfloat16
    (k, v), = allocate_kv([fp8], 5, 8, torch.device("cpu"))
    index, = allocate_index_caches([fp8], 5, 8, torch.device("cpu"))
    assert k.dtype == v.dtype == torch.float8_e4m3fn
    assert index is not None and index.dtype == torch.bfloat16 and index.shape == (5, 8, 16)


def test_bytes_per_block_counts_the_index_keys() -> None:
    plain = AttentionSpec(2, 16, torch.bfloat16)
    assert plain.bytes_per_block(8) == 2 * 8 * 2 * 16 * 2
    fp8 = AttentionSpec(2, 16, torch.float8_e4m3fn, index_dim=24, index_dtype=torch.bfloat16)
    assert fp8.bytes_per_block(8) == 2 * 8 * 2 * 16 * 1 + 8 * 24 * 2
    with pytest.raises(ValueError, match="index_dtype"):
        AttentionSpec(2, 16, torch.bfloat16, index_dim=8)
    assert allocate_index_caches([plain], 3, 8, torch.device("cpu")) == [None]


class _TwoLayers(CausalLM):
    def __init__(self) -> None:
        super().__init__()
        cfg = Cfg()
        self.a = Attention(cfg, RotaryEmbedding(cfg.rotary_dim, THETA), "model.layers.0.self_attn")
        self.b = make_layer(cfg)


def test_bind_caches_binds_the_index_caches_of_the_layers_that_have_them() -> None:
    model = _TwoLayers()
    specs = list(model.cache_specs(torch.float32).attention)
    assert [s.index_dim for s in specs] == [0, 16]
    kv = allocate_kv(specs, 4, 8, torch.device("cpu"))
    index = allocate_index_caches(specs, 4, 8, torch.device("cpu"))
    assert index[0] is None and index[1] is not None
    model.bind_caches(kv, [], index)
    assert model.a.index_cache is None and model.b.index_cache is index[1]
    assert model.b.k_cache is kv[1][0]
    fresh = _TwoLayers()
    fresh.bind_caches(kv, [])  # the old two-argument call still binds the KV
    assert fresh.b.k_cache is kv[1][0] and fresh.b.index_cache is None
    with pytest.raises(ValueError, match="index cache count"):
        fresh.bind_caches(kv, [], index[:1])


def test_index_keys_are_stored_through_the_slot_mapping_skipping_minus_one() -> None:
    cache = torch.zeros(3, 4, 2)
    keys = torch.arange(1.0, 9.0).view(4, 2)
    store_index_keys_ref(keys, cache, torch.tensor([9, -1, 0, 6]))
    flat = cache.view(12, 2)
    assert flat[9].tolist() == [1.0, 2.0] and flat[0].tolist() == [5.0, 6.0] and flat[6].tolist() == [7.0, 8.0]
    assert int((flat != 0).any(dim=1).sum()) == 3


def test_equal_scores_go_to_the_earlier_block_whatever_the_step_holds() -> None:
    """Blocks 1-3 score exactly 0 (relu of negative dot products) behind block 0: the second pick is block 1, also
    when a later query of the same step sees more (tied) blocks."""
    from hyserve.layers.qsa import select_tokens

    c, budget = 4, 8
    keys = torch.tensor([[1.0, 0.0]] + [[-1.0, 0.0]] * 5)
    q = torch.tensor([[[1.0, 0.0]]])
    alone = select_tokens(q, keys, torch.tensor([15]), 24, budget, c)
    both = select_tokens(torch.cat([q, q]), keys, torch.tensor([15, 23]), 24, budget, c)
    want = torch.zeros(24, dtype=torch.bool)
    want[:8] = True  # blocks 0 and 1; no tail at position 15
    assert torch.equal(alone[0], want) and torch.equal(both[0], want)
    want_late = torch.zeros(24, dtype=torch.bool)
    want_late[:8] = True  # six complete blocks at position 23, blocks 0 and 1 again
    assert torch.equal(both[1], want_late)


# ------------------------------------------------------------------------------------------------ the batched path


class _NoHostSync(torch.utils._python_dispatch.TorchDispatchMode):
    """Raises on every op that needs the device's data on the host: ``.item()``/``int()``/``bool()`` (their
    ``_local_scalar_dense``), ``nonzero`` and the ops with data-dependent output shapes (boolean masks)."""

    BANNED = ("nonzero", "_local_scalar_dense", "masked_select", "unique", "repeat_interleave", "bincount")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.__name__.split(".")[0]
        if name in self.BANNED:
            raise AssertionError(f"host sync: {func}")
        if name.startswith("index"):
            for a in args:
                items = a if isinstance(a, (list, tuple)) else [a]
                if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items):
                    raise AssertionError(f"boolean mask index (a nonzero): {func}")
        return func(*args, **(kwargs or {}))


def no_host_sync(monkeypatch: pytest.MonkeyPatch) -> _NoHostSync:
    """The dispatch guard, plus ``tolist`` (which reads the data without an op) made to raise."""

    def banned(*_: object, **__: object) -> None:
        raise AssertionError("host sync: tolist")

    monkeypatch.setattr(torch.Tensor, "tolist", banned)
    return _NoHostSync()


def random_paged_problem(lens: list[tuple[int, int]], seed: int, dtype: torch.dtype = torch.float32,
                         kv_dtype: torch.dtype | None = None, bs: int = 8, hq: int = 4, hkv: int = 2, d: int = 16,
                         hi: int = 3, di: int = 16, tie_blocks: int = 0) -> dict:
    """Caches filled with random values (garbage past each row's context included) and a step of rows (context
    length, new tokens) over shuffled blocks; ``tie_blocks`` > 0 makes every query's score of that many blocks per
    row exactly 0 (keys opposite to every indexer query), so that ties decide."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-ctx // bs) for ctx, _ in lens) + 2
    nblocks = sum(-(-ctx // bs) for ctx, _ in lens) + 3
    perm = torch.randperm(nblocks - 1, generator=gen) + 1
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    used = 0
    for r, (ctx, _) in enumerate(lens):
        nb = -(-ctx // bs)
        tables[r, :nb] = perm[used:used + nb].to(torch.int32)
        used += nb
    k = torch.randn(nblocks, bs, hkv, d, generator=gen)
    v = torch.randn(nblocks, bs, hkv, d, generator=gen)
    index = torch.randn(nblocks, bs, di, generator=gen)
    t = sum(n for _, n in lens)
    iq = torch.randn(t, hi, di, generator=gen).abs()  # non-negative queries: a non-positive key scores 0
    inv_freq = 1.0 / (THETA ** (torch.arange(0, 8, 2).float() / 8))
    if tie_blocks:
        # Blocks 1 .. tie_blocks of every row: non-positive unrotated keys (no rotary), so they all score 0.
        inv_freq = torch.zeros(4)
        flat = index.view(-1, di)
        for r, (ctx, _) in enumerate(lens):
            for p in range(4, min(4 * (tie_blocks + 1), ctx)):
                flat[int(tables[r, p // bs]) * bs + p % bs] = -torch.rand(di, generator=gen) - 0.1
    qsl = torch.tensor([0, *torch.tensor([n for _, n in lens]).cumsum(0).tolist()], dtype=torch.int32)
    kv = kv_dtype or dtype
    return dict(q=torch.randn(t, hq, d, generator=gen).to(dtype), iq=iq.to(dtype), k_cache=k.to(kv),
                v_cache=v.to(kv), index_cache=index.to(dtype), block_tables=tables, query_start_loc=qsl,
                seq_lens=torch.tensor([ctx for ctx, _ in lens], dtype=torch.int32), scale=d ** -0.5,
                k_norm=torch.nn.Identity(), inv_freq=inv_freq, budget=8, c=4)


STEP_ROWS = [(41, 1), (9, 1), (0, 0), (60, 5), (30, 12), (3, 3), (17, 4), (33, 1)]
# The kernels' step under the interpreter (its cost goes with the tokens, one program or more each): the same kinds of
# rows, decode, chunks (of 6 and 5 tokens: the rows of 12 and 4 above run on the CPU), an empty row, dense and sparse
# queries, 18 tokens in all.
KERNEL_STEP_ROWS = [(41, 1), (9, 1), (0, 0), (60, 5), (30, 6), (3, 3), (17, 2)]
DECODE_ROWS = [(41, 1), (9, 1), (0, 0), (60, 4), (33, 1), (17, 4), (52, 1)]


@pytest.mark.parametrize("tile", [None, 1, 700])
@pytest.mark.parametrize("ties", [0, 20])
def test_the_batched_path_equals_the_per_row_reference(tile: int | None, ties: int,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``indexed_attention`` (sync-free, static tiles) against ``indexed_attention_ref`` (per row, host lengths): rows
    of decode, chunks, an empty row, dense and sparse queries, with exact ties; one tile, one token per tile, and
    tiles that cut rows apart."""
    import hyserve.layers.qsa as qsa

    if tile is not None:
        monkeypatch.setattr(qsa, "QSA_TILE_ELEMENTS", tile)
    prob = random_paged_problem(STEP_ROWS, seed=31 + ties, tie_blocks=ties)
    want = qsa.indexed_attention_ref(**prob)
    got = qsa.indexed_attention(**prob, max_seq_len=64)  # an upper bound above every row's context
    _close(got, want, tol=1e-5)
    # Another step holding only two of the rows (other bounds): the same outputs for them.
    idx = [0, 5]
    qsl = prob["query_start_loc"].tolist()
    toks = [t for r in idx for t in range(qsl[r], qsl[r + 1])]
    prob2 = dict(prob, block_tables=prob["block_tables"][idx], seq_lens=prob["seq_lens"][idx],
                 query_start_loc=torch.tensor([0, 1, 4], dtype=torch.int32), q=prob["q"][toks], iq=prob["iq"][toks])
    alone = qsa.indexed_attention(**prob2, max_seq_len=41)
    _close(alone, want[toks], tol=1e-5)


def test_the_batched_path_with_fp8_kv_and_bf16() -> None:
    import hyserve.layers.qsa as qsa

    prob = random_paged_problem(STEP_ROWS, seed=5, dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn)
    prob["k_scale"] = torch.tensor([0.5, 2.0])
    prob["v_scale"] = torch.tensor([1.5, 0.25])
    want = qsa.indexed_attention_ref(**prob)
    got = qsa.indexed_attention(**prob, max_seq_len=60)
    _close(got, want, tol=2e-2)


def test_the_layer_forward_has_no_host_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole forward (projections, stores, pooling, selection, attention) with the host copies absent does no
    ``.item()``, ``.tolist()``, ``nonzero`` or boolean-mask index: what CUDA graph capture needs."""
    cfg = Cfg()
    layer = make_layer(cfg, seed=2)
    xs = {r: _x(n, cfg, seed=40 + r) for r, n in ((0, 45), (1, 30))}
    refs = {r: reference(layer, cfg, x) for r, x in xs.items()}
    paged = Paged(layer, torch.float32, block_size=8, seed=3)
    paged.step([(0, xs[0][:40], 0), (1, xs[1][:26], 0)])
    import hyserve.layers.qsa as qsa

    store_kv = qsa.store_kv

    def store_kv_outside_guard(*args: object) -> None:  # on CUDA a Triton kernel; the CPU reference uses masks
        with torch.utils._python_dispatch._disable_current_modes():
            store_kv(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(qsa, "store_kv", store_kv_outside_guard)
    guard = no_host_sync(monkeypatch)
    with guard:
        a, b = paged.step([(0, xs[0][40:45], 40), (1, xs[1][26:27], 26)])  # a chunk and a decode row
    monkeypatch.undo()
    _close(a, refs[0].y[40:45])
    _close(b, refs[1].y[26:27])
    with pytest.raises(AssertionError, match="host sync"), no_host_sync(monkeypatch):
        torch.tensor([1, 0]).nonzero()  # the guard does catch one


# ------------------------------------------------------------------------------------- the kernels (interpreter)

def test_dense_steps_take_plain_paged_attention_and_agree() -> None:
    """When no query of the step can see more complete blocks than the budget takes, the layer's function hands the
    step to ``paged_attention`` (given ``max_query_len``): the same result as the per-row reference."""
    import hyserve.layers.qsa as qsa

    prob = dict(random_paged_problem(STEP_ROWS, seed=8), budget=64)  # 64 // 4 = 16 blocks >= 64 // 4 seen
    want = qsa.indexed_attention_ref(**prob)
    called = []
    paged = qsa.paged_attention

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        called.append(True)
        return paged(*args, **kwargs)  # type: ignore[arg-type]

    qsa.paged_attention = spy  # type: ignore[assignment]
    try:
        got = qsa.indexed_attention(**prob, max_seq_len=64, max_query_len=12, kernels=False)
    finally:
        qsa.paged_attention = paged  # type: ignore[assignment]
    assert called == [True]
    _close(got, want, tol=1e-5)
    sparse = qsa.indexed_attention(**dict(prob, budget=8), max_seq_len=64, max_query_len=12, kernels=False)
    assert not torch.allclose(sparse, got, atol=1e-3)  # with a budget the selection matters: not the dense result


def run_kernel_checks() -> dict[str, list]:
    """Under ``TRITON_INTERPRET=1``: the QSA kernels (``hyserve.kernels.attention.qsa``) inside ``indexed_attention``
    against the per-row reference, and sabotaged calls that must differ. {name: [ok, message]}."""
    import os

    import hyserve.kernels.attention.qsa as kq
    import hyserve.layers.qsa as qsa
    from hyserve.testing.triton_interpreter import patch_triton_interpreter

    assert os.environ.get("TRITON_INTERPRET") == "1"
    patch_triton_interpreter()
    out: dict[str, list] = {}

    def check(name: str, got: torch.Tensor, want: torch.Tensor, tol: float, differ: bool = False) -> None:
        err = float((got.float() - want.float()).abs().max())
        out[name] = [(err > 10 * tol) if differ else (err <= tol), f"max err {err:.3g}"]

    for ties in (0, 20):
        prob = random_paged_problem(KERNEL_STEP_ROWS, seed=31 + ties, tie_blocks=ties)
        want = qsa.indexed_attention_ref(**prob)
        check(f"fp32_ties{ties}", qsa.indexed_attention(**prob, max_seq_len=64, kernels=True), want, 1e-5)
        below = kq._SPLIT_BELOW
        kq._SPLIT_BELOW = 0  # one program per (token, kv head): the prefill form
        try:
            check(f"fp32_single_ties{ties}", qsa.indexed_attention(**prob, max_seq_len=64, kernels=True), want, 1e-5)
        finally:
            kq._SPLIT_BELOW = below
    prob = random_paged_problem(KERNEL_STEP_ROWS, seed=5, dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn)
    prob["k_scale"] = torch.tensor([0.5, 2.0])
    prob["v_scale"] = torch.tensor([1.5, 0.25])
    check("bf16_fp8kv", qsa.indexed_attention(**prob, max_seq_len=60, kernels=True), qsa.indexed_attention_ref(**prob),
          2e-2)
    prob = random_paged_problem(KERNEL_STEP_ROWS, seed=6, dtype=torch.bfloat16)
    check("bf16", qsa.indexed_attention(**prob, max_seq_len=64, kernels=True), qsa.indexed_attention_ref(**prob), 2e-2)
    # Decode and verify rows (at most 4 tokens a row, given max_query_len): the blocks pooled inside the scores
    # kernel, with a real key norm and rotation; float32 with exact ties, bf16; the block keys' norm weight of
    # another layer must change the selection.
    from hyserve.layers.norm import RMSNorm

    norm = RMSNorm(16, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16, generator=torch.Generator().manual_seed(9)) * 0.3)
    for ties in (0, 20):
        prob = dict(random_paged_problem(DECODE_ROWS, seed=12 + ties, tie_blocks=ties), k_norm=norm)
        want = qsa.indexed_attention_ref(**prob)
        check(f"pooled_in_kernel_fp32_ties{ties}",
              qsa.indexed_attention(**prob, max_seq_len=64, max_query_len=4, kernels=True), want, 1e-5)
    prob = dict(random_paged_problem(DECODE_ROWS, seed=14, dtype=torch.bfloat16), k_norm=norm.to(torch.bfloat16))
    check("pooled_in_kernel_bf16", qsa.indexed_attention(**prob, max_seq_len=64, max_query_len=4, kernels=True),
          qsa.indexed_attention_ref(**prob), 2e-2)
    prob = dict(random_paged_problem(DECODE_ROWS, seed=12), k_norm=norm)
    other = RMSNorm(16, 1e-6)
    with torch.no_grad():
        other.weight.copy_(norm.weight.flip(0) * 3)
    check("pooled_in_kernel_other_norm_caught",
          qsa.indexed_attention(**dict(prob, k_norm=other), max_seq_len=64, max_query_len=4, kernels=True),
          qsa.indexed_attention_ref(**prob), 1e-5, differ=True)
    # M-RoPE (images): each block turns at its first token's three positions from the paged positions' store, in
    # the kernel as in the per-row reference; the kernel must not fall back to j*c.
    from hyserve.model.mrope import frequency_axes

    axes = frequency_axes(4, SECTION)
    for dt, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        prob = dict(random_paged_problem(DECODE_ROWS, seed=16, dtype=dt), k_norm=norm.to(dt))
        gen_p = torch.Generator().manual_seed(17)
        nb, bs = prob["index_cache"].shape[:2]
        prob.update(position_cache=torch.randint(0, 90, (nb, bs, 3), generator=gen_p, dtype=torch.int32), axes=axes)
        want = qsa.indexed_attention_ref(**prob)
        name = "pooled_in_kernel_mrope_" + ("fp32" if dt == torch.float32 else "bf16")
        check(name, qsa.indexed_attention(**prob, max_seq_len=64, max_query_len=4, kernels=True), want, tol)
        if dt == torch.float32:
            text = {k: v for k, v in prob.items() if k not in ("position_cache", "axes")}
            check("pooled_in_kernel_mrope_ignored_caught",
                  qsa.indexed_attention(**text, max_seq_len=64, max_query_len=4, kernels=True), want, tol, differ=True)
    # The positions' store: each token's three positions at its slot (int32), -1 skipped.
    gen_s = torch.Generator().manual_seed(12)
    pcache = torch.randint(0, 50, (5, 8, 3), generator=gen_s, dtype=torch.int32)
    three = torch.randint(0, 50, (6, 3), generator=gen_s, dtype=torch.int32)
    slots = torch.tensor([3, -1, 17, 39, -1, 8])
    want_p = pcache.clone()
    qsa.store_index_keys_ref(three, want_p, slots)
    got_p = pcache.clone()
    kq.store_index_keys(three, got_p, slots)
    out["store_index_positions"] = [bool(torch.equal(got_p, want_p)) and not torch.equal(want_p, pcache),
                                    "equal to the reference store"]
    # The index-key store: each token's raw key at its slot, -1 skipped, other slots untouched.
    gen_s = torch.Generator().manual_seed(11)
    cache = torch.randn(5, 8, 16, generator=gen_s)
    keys = torch.randn(6, 16, generator=gen_s)
    slots = torch.tensor([3, -1, 17, 39, -1, 8])
    want_cache = cache.clone()
    qsa.store_index_keys_ref(keys, want_cache, slots)
    got_cache = cache.clone()
    kq.store_index_keys(keys, got_cache, slots)
    out["store_index_keys"] = [bool(torch.equal(got_cache, want_cache)), "equal to the reference store"]
    # The scores kernel alone, blocks past each token's view at -inf.
    gen = torch.Generator().manual_seed(3)
    iq, keys = torch.randn(7, 3, 16, generator=gen), torch.randn(2, 9, 16, generator=gen)
    rows, vis = torch.tensor([0, 1, 1, 0, 1, 0, 0]), torch.tensor([9, 0, 4, 2, 9, 1, 5])
    want = torch.relu(torch.einsum("thd,tjd->thj", iq, keys[rows])).sum(dim=1) / 4.0
    want = want.masked_fill(torch.arange(9)[None, :] >= vis[:, None], float("-inf"))
    got = kq.qsa_block_scores(iq, keys, rows, vis)
    fin = torch.isfinite(want)
    out["scores"] = [bool(torch.equal(fin, torch.isfinite(got)) and torch.allclose(got[fin], want[fin], atol=1e-5)),
                     "finite where the reference is, equal there"]
    # The attention kernel on each token's whole causal prefix (the dense reference), then sabotaged: every token
    # reading row 0's block table, and the lanes one position early (a token missing itself) must differ.
    from hyserve.kernels.varlen import row_index

    prob = random_paged_problem(KERNEL_STEP_ROWS, seed=31)
    want = qsa.indexed_attention_ref(**dict(prob, budget=64))
    t = prob["q"].shape[0]
    qsl = prob["query_start_loc"].to(torch.int64)
    rows, ipos = row_index(qsl, t)
    qpos = prob["seq_lens"].to(torch.int64)[rows] - (qsl[1:] - qsl[:-1])[rows] + ipos
    lanes = torch.arange(128)[None, :].expand(t, 128)  # 2 splits of 64 lanes (every position is below 60), the last
    # one empty
    causal = torch.where(lanes <= qpos[:, None], lanes, -1).to(torch.int32)
    early = torch.where((lanes >= 1) & (lanes <= qpos[:, None]), lanes - 1, -1).to(torch.int32)
    for name, use_rows, pos, part in (("dense_splits", rows, causal, None), ("dense_single", rows, causal, 128),
                                      ("row0_caught", torch.zeros_like(rows), causal, None),
                                      ("early_caught", rows, early, None)):
        got = kq.qsa_attention(prob["q"], prob["k_cache"], prob["v_cache"], prob["block_tables"], use_rows, pos,
                               prob["scale"], part=part)
        check(name, got, want, 1e-5, differ=name.endswith("caught"))
    return out


QSA_KERNEL_CHECKS = ["fp32_ties0", "fp32_single_ties0", "fp32_ties20", "fp32_single_ties20", "bf16_fp8kv",
                     "bf16", "scores", "dense_splits", "dense_single", "row0_caught",
                     "early_caught", "pooled_in_kernel_fp32_ties0", "pooled_in_kernel_fp32_ties20",
                     "pooled_in_kernel_bf16", "pooled_in_kernel_other_norm_caught", "store_index_keys",
                     "pooled_in_kernel_mrope_fp32", "pooled_in_kernel_mrope_bf16",
                     "pooled_in_kernel_mrope_ignored_caught", "store_index_positions"]


@pytest.fixture(scope="module")
def kernel_results() -> dict[str, list]:
    pytest.importorskip("triton")
    return interpreter_subprocess_results(__file__, "--kernel-checks")


@pytest.mark.parametrize("name", QSA_KERNEL_CHECKS)
def test_qsa_kernels_under_the_interpreter(kernel_results: dict[str, list], name: str) -> None:
    """The Triton scores and attention kernels (CUDA's path) on CPU tensors under the interpreter: equal to the
    reference in float32 (split and single-program forms, with exact score ties), bf16 with an FP8 KV cache; a
    token reading another row's table, or lanes one position off, differ."""
    ok, msg = kernel_results[name]
    assert ok, f"{name}: {msg}"


if __name__ == "__main__":
    import json
    import sys

    if "--kernel-checks" in sys.argv:
        print("RESULTS " + json.dumps(run_kernel_checks()))

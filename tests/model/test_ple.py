"""Qwen4-Exp's Per-Layer Embedding (``hyserve.layers.ple``) against an independent, straightforward implementation of
docs/qwen4_exp_facts.md §3.4 written here: per-token loops over a whole sequence, its own hash constants, its own
norms and conv. The layer runs in the engine's varlen layout: whole prompts, chunks staggered across steps among
other rows, eos in the middle, verify rows whose per-position candidates are checked and committed."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from hyserve.layers.ple import (
    PerLayerEmbedding,
    find_primes_from,
    ngram_head_offsets,
    ngram_head_sizes,
    ngram_multipliers,
    ngram_table_rows,
)
from hyserve.model import loader
from hyserve.model.metadata import StepMetadata, VerifyMetadata
from hyserve.testing.triton_interpreter import interpreter_subprocess_results

M64 = (1 << 64) - 1
EOS = 1


@dataclass
class Cfg:
    hidden_size: int = 8
    hc_count: int = 2
    ple_embed_dim: int = 8
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


# --------------------------------------------------------------------------------------------------------------
# The independent reference: facts §3.4, one token at a time.


def _splitmix(v: int) -> int:
    v = (v + 0x9E3779B97F4A7C15) & M64
    v = ((v ^ (v >> 30)) * 0xBF58476D1CE4E5B9) & M64
    v = ((v ^ (v >> 27)) * 0x94D049BB133111EB) & M64
    return (v ^ (v >> 31)) & M64


def _ref_mults(j: int, cfg: Cfg) -> list[int]:
    half = max(1, ((2**63 - 1) // max(cfg.vocab_size, 1)) // 2)
    base = cfg.seed + 10007 * j
    return [2 * (_splitmix((base + 0x9E3779B97F4A7C15 * (i + 1)) & M64) % half) + 1 for i in range(cfg.ngram_size)]


def _ref_primes(j: int, cfg: Cfg) -> list[int]:
    g = (cfg.ngram_size - 1) * cfg.heads_per_ngram
    found: list[int] = []
    n = cfg.ngram_vocab_size_base
    while len(found) < (j + 1) * g:
        if n > 1 and all(n % d for d in range(2, int(n**0.5) + 1)):
            found.append(n)
        n += 1
    return found[j * g:]


def _ref_rows(seq: list[int], j: int, cfg: Cfg) -> list[list[int]]:
    """Each token's table rows (one per head), n=2 heads first."""
    n, hpn, eos = cfg.ngram_size, cfg.heads_per_ngram, cfg.ple_eos_token_id
    mult, sizes = _ref_mults(j, cfg), _ref_primes(j, cfg)
    offsets = [sum(sizes[:h]) for h in range(len(sizes))]
    out = []
    for p in range(len(seq)):
        start = 0  # the segment of p starts after the last eos strictly before p
        for q in range(p - 1, -1, -1):
            if seq[q] == eos:
                start = q + 1
                break
        t = [seq[p - k] if p - k >= 0 and p - k >= start else eos for k in range(n)]
        rows = []
        for order in range(2, n + 1):
            x = 0
            for k in range(order):
                x ^= t[k] * mult[k]
            for i in range(hpn):
                h = (order - 2) * hpn + i
                rows.append(x % sizes[h] + offsets[h])
        out.append(rows)
    return out


def _ref_grouped_norm(v: torch.Tensor, w: torch.Tensor, group: int, eps: float) -> torch.Tensor:
    out = torch.empty_like(v)
    for s in range(v.shape[0] // group):
        span = slice(s * group, (s + 1) * group)
        out[span] = v[span] / torch.sqrt((v[span] * v[span]).mean() + eps) * (1 + w[span])
    return out


def reference(layer: PerLayerEmbedding, cfg: Cfg, j: int, seq: list[int], x: torch.Tensor
              ) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """The PLE term of every token of ``seq`` (whole sequence, float32), the last ngram_size-1 ids of eos-padded
    history, and the conv window: the last (k-1)*ngram_size values of C (zeros before the sequence)."""
    h, s = cfg.hidden_size, cfg.hc_count
    wdt = s * h
    sd = {k: v.detach().float() for k, v in layer.state_dict().items()}
    table = sd["ple_embedding.ngram_embedding.weight"]
    kern, dil = cfg.ple_conv_kernel_size, cfg.ngram_size
    conv_w = sd["conv1d.weight"][:, 0, :]  # (W, k)
    eps = cfg.rms_norm_eps
    cs: list[torch.Tensor] = []
    outs = []
    for p, rows in enumerate(_ref_rows(seq, j, cfg)):
        e = torch.cat([table[r] for r in rows])
        kn = _ref_grouped_norm(sd["key_proj.weight"] @ e, sd["norm_key.weight"], h, eps)
        qn = _ref_grouped_norm(x[p].float(), sd["norm_query.weight"], h, eps)
        v = sd["value_proj.weight"] @ e
        gv = torch.empty(wdt)
        for st in range(s):
            g = float((kn[st * h:(st + 1) * h] * qn[st * h:(st + 1) * h]).sum()) / math.sqrt(h)
            g = math.copysign(math.sqrt(max(abs(g), 1e-6)), g) if g != 0 else 0.0
            gv[st * h:(st + 1) * h] = v / (1 + math.exp(-g))
        c = _ref_grouped_norm(gv, sd["norm_conv.weight"], h, eps)
        cs.append(c)
        acc = torch.zeros(wdt)
        for tap in range(kern):
            q = p - (kern - 1 - tap) * dil
            if q >= 0:
                acc += conv_w[:, tap] * cs[q]
        outs.append(gv + acc * torch.sigmoid(acc))
    hist = [EOS] * (cfg.ngram_size - 1) + seq
    win = (kern - 1) * dil
    padded = [torch.zeros(wdt)] * win + cs
    return torch.stack(outs), hist[len(hist) - (cfg.ngram_size - 1):], torch.stack(padded[len(padded) - win:], 1)


# --------------------------------------------------------------------------------------------------------------
# The layer under test, driven step by step.


def make_layer(cfg: Cfg, j: int = 1, dtype: torch.dtype = torch.float32) -> PerLayerEmbedding:
    torch.manual_seed(0)
    layer = PerLayerEmbedding(cfg, j, "model.layers.1.ple")
    with torch.no_grad():
        for name, p in layer.named_parameters():
            scale = 0.3 if "norm" in name else 1.0 if "ngram" in name else 0.5
            p.copy_(torch.randn_like(p) * scale)
    return layer.to(dtype)


class Pool:
    def __init__(self, layer: PerLayerEmbedding, slots: int, dtype: torch.dtype = torch.float32,
                 verify_rows: int = 0, k: int = 0) -> None:
        self.layer = layer
        spec = layer.cache_spec(dtype)
        self.state = spec.allocate((slots,), torch.device("cpu"))
        layer.bind_state(self.state)
        if verify_rows:
            layer.bind_verify_scratch(spec.allocate((verify_rows, k + 1), torch.device("cpu")))


def _meta(lens: list[int], slots: list[int]) -> StepMetadata:
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    t = int(qsl[-1])
    # A strided view: slots need not be a contiguous tensor.
    slot_t = torch.tensor([[s, -1] for s in slots], dtype=torch.int64)[:, 0]
    return StepMetadata(positions=torch.zeros(t, dtype=torch.int64), query_start_loc=qsl,
                        seq_lens=torch.tensor(lens, dtype=torch.int32), state_slots=slot_t,
                        block_tables=torch.zeros(len(lens), 1, dtype=torch.int32),
                        slot_mapping=torch.full((t,), -1, dtype=torch.int64), max_query_len=max(lens, default=0),
                        max_seq_len=max(lens, default=0), query_start_loc_cpu=qsl)


def _verify_meta(vlens: list[int], vslots: list[int], rlens: list[int], rslots: list[int]) -> StepMetadata:
    meta = _meta(vlens + rlens, vslots + rslots)
    vq = torch.tensor([0, *torch.tensor(vlens).cumsum(0).tolist()], dtype=torch.int32)
    rq = torch.tensor([0, *torch.tensor(rlens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    meta.verify = VerifyMetadata(num_rows=len(vlens), num_tokens=int(vq[-1]), max_query_len=max(vlens),
                                 query_start_loc=vq, state_slots=torch.tensor(vslots),
                                 rest_query_start_loc=rq, rest_state_slots=torch.tensor(rslots, dtype=torch.int64),
                                 rest_max_query_len=max(rlens, default=0), rest_query_start_loc_cpu=rq)
    return meta


def _seq(n: int, gen: torch.Generator, eos_at: tuple[int, ...] = ()) -> list[int]:
    s = torch.randint(2, 50, (n,), generator=gen).tolist()
    for i in eos_at:
        s[i] = EOS
    return s


CFG = Cfg()
W = CFG.hidden_size * CFG.hc_count


def _decode_ctx(stored: torch.Tensor) -> list[int]:
    return (stored ^ EOS).tolist()


def test_whole_prompt_matches_reference() -> None:
    layer = make_layer(CFG)
    pool = Pool(layer, 4)
    gen = torch.Generator().manual_seed(1)
    seq = _seq(23, gen)
    x = torch.randn(len(seq), W, generator=gen)
    want, ctx, conv = reference(layer, CFG, 1, seq, x)
    with torch.no_grad():
        got = layer(x, torch.tensor(seq), _meta([len(seq)], [2]))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert _decode_ctx(pool.state["token_context"][2]) == ctx
    torch.testing.assert_close(pool.state["conv_state"][2], conv, atol=2e-5, rtol=2e-5)
    for other in (0, 1, 3):  # slots no row names stay as they were
        assert not pool.state["token_context"][other].any() and not pool.state["conv_state"][other].any()


def test_fresh_slot_is_all_zeros_and_means_eos_context() -> None:
    layer = make_layer(CFG)
    spec = layer.cache_spec(torch.bfloat16)
    shapes = {t.name: (t.shape, t.dtype) for t in spec.tensors}
    assert shapes == {"token_context": ((2,), torch.int64), "conv_state": ((W, 9), torch.bfloat16)}
    pool = Pool(layer, 2)
    gen = torch.Generator().manual_seed(2)
    seq = [EOS, EOS, *_seq(3, gen)]  # explicit eos copies: the same hashes as a fresh start
    x = torch.randn(len(seq), W, generator=gen)
    with torch.no_grad():
        got_tail = layer(x[2:], torch.tensor(seq[2:]), _meta([3], [1]))
    want, _, _ = reference(layer, CFG, 1, seq[2:], x[2:])
    torch.testing.assert_close(got_tail, want, atol=2e-5, rtol=2e-5)
    assert pool.state["token_context"][0].tolist() == [0, 0]


@pytest.mark.parametrize("eos_at", [(), (0,), (5,), (6, 7), (11,), (3, 13)])
def test_staggered_chunks_among_other_rows(eos_at: tuple[int, ...]) -> None:
    """Three requests in slots 6, 1, 3 of 8, fed in chunks (some shorter than the n-gram context, some empty rows)
    across steps in varying row orders: every token's output and the final states equal the whole-sequence
    reference."""
    layer = make_layer(CFG)
    pool = Pool(layer, 8)
    gen = torch.Generator().manual_seed(3)
    seqs = {"a": _seq(16, gen, eos_at), "b": _seq(14, gen, tuple(i for i in eos_at if i < 14)), "c": _seq(9, gen)}
    xs = {k: torch.randn(len(s), W, generator=gen) for k, s in seqs.items()}
    slots = {"a": 6, "b": 1, "c": 3}
    refs = {k: reference(layer, CFG, 1, s, xs[k]) for k, s in seqs.items()}
    # (request, chunk length) per row of each step
    schedule = [
        [("a", 1), ("b", 5)],
        [("b", 1), ("a", 7), ("c", 0), ("c", 2)],
        [("c", 1), ("a", 0), ("b", 1)],
        [("a", 1), ("c", 1), ("b", 6)],
        [("b", 1), ("c", 5), ("a", 7)],
    ]
    done = dict.fromkeys(seqs, 0)
    for step in schedule:
        ids, x, lens, slot_list, spans = [], [], [], [], []
        for req, n in step:
            i = done[req]
            ids += seqs[req][i:i + n]
            x.append(xs[req][i:i + n])
            lens.append(n)
            slot_list.append(slots[req] if n else slots["a"])  # an empty row may name any slot, even a busy one
            spans.append((req, i, n))
            done[req] += n
        with torch.no_grad():
            out = layer(torch.cat(x), torch.tensor(ids, dtype=torch.int64), _meta(lens, slot_list))
        off = 0
        for req, i, n in spans:
            torch.testing.assert_close(out[off:off + n], refs[req][0][i:i + n], atol=3e-5, rtol=3e-5)
            off += n
    assert done == {k: len(s) for k, s in seqs.items()}
    for req, slot in slots.items():
        assert _decode_ctx(pool.state["token_context"][slot]) == refs[req][1]
        torch.testing.assert_close(pool.state["conv_state"][slot], refs[req][2], atol=3e-5, rtol=3e-5)
    for other in (0, 2, 4, 5, 7):
        assert not pool.state["token_context"][other].any() and not pool.state["conv_state"][other].any()


def test_chunked_equals_one_shot_bf16() -> None:
    """In the model dtype, token-at-a-time decode gives the one-shot prefill's outputs and states."""
    layer = make_layer(CFG, dtype=torch.bfloat16)
    pool = Pool(layer, 3, torch.bfloat16)
    gen = torch.Generator().manual_seed(4)
    seq = _seq(15, gen, (7,))
    x = torch.randn(len(seq), W, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        one = layer(x, torch.tensor(seq), _meta([len(seq)], [0]))
        steps = [layer(x[i:i + 1], torch.tensor(seq[i:i + 1]), _meta([1], [2])) for i in range(len(seq))]
    torch.testing.assert_close(torch.cat(steps), one, atol=1e-2, rtol=1e-2)
    assert torch.equal(pool.state["token_context"][0], pool.state["token_context"][2])
    torch.testing.assert_close(pool.state["conv_state"][0], pool.state["conv_state"][2], atol=1e-2, rtol=1e-2)
    want, _, _ = reference(layer, CFG, 1, seq, x.float())
    torch.testing.assert_close(one.float(), want, atol=6e-2, rtol=6e-2)


def _state_after(layer: PerLayerEmbedding, seq: list[int], x: torch.Tensor, p: int) -> tuple[list[int], torch.Tensor]:
    _, ctx, conv = reference(layer, CFG, 1, seq[:p + 1], x[:p + 1])
    return ctx, conv


def test_verify_candidates_commit_and_continue() -> None:
    """Verify rows (last token + 3 drafts) next to a prefill row: outputs equal the reference over the drafted
    sequence; every candidate equals the sequential state after its position; the live slots are untouched; after
    committing accepted counts 1, 0 and 'keep' (-1), the next step continues from the committed state."""
    k = 3
    layer = make_layer(CFG)
    pool = Pool(layer, 8, verify_rows=2, k=k)
    gen = torch.Generator().manual_seed(5)
    base_a, base_b, seq_c = _seq(10, gen, (4,)), _seq(6, gen), _seq(12, gen)
    drafts_a, drafts_b = _seq(4, gen, (1,)), _seq(4, gen)
    xa, xb, xc = (torch.randn(n, W, generator=gen) for n in (14, 10, 12))
    sa, sb, sc = 5, 0, 2
    with torch.no_grad():
        layer(torch.cat([xa[:10], xb[:6], xc[:4]]), torch.tensor(base_a + base_b + seq_c[:4]),
              _meta([10, 6, 4], [sa, sb, sc]))
    live = {n: t.clone() for n, t in pool.state.items()}
    draft_a, draft_b = base_a + drafts_a, base_b + drafts_b
    meta = _verify_meta([4, 4], [sa, sb], [5], [sc])
    with torch.no_grad():
        out = layer(torch.cat([xa[10:14], xb[6:10], xc[4:9]]), torch.tensor(drafts_a + drafts_b + seq_c[4:9]), meta)
    ref_a, ref_b, ref_c = (reference(layer, CFG, 1, s, x) for s, x in ((draft_a, xa), (draft_b, xb), (seq_c, xc)))
    torch.testing.assert_close(out[:4], ref_a[0][10:14], atol=3e-5, rtol=3e-5)
    torch.testing.assert_close(out[4:8], ref_b[0][6:10], atol=3e-5, rtol=3e-5)
    torch.testing.assert_close(out[8:], ref_c[0][4:9], atol=3e-5, rtol=3e-5)
    scratch = layer.verify_scratch
    assert scratch is not None
    for row, (seq, x, start) in enumerate(((draft_a, xa, 10), (draft_b, xb, 6))):
        for pos in range(k + 1):
            ctx, conv = _state_after(layer, seq, x, start + pos)
            assert _decode_ctx(scratch["token_context"][row, pos]) == ctx, (row, pos)
            torch.testing.assert_close(scratch["conv_state"][row, pos], conv, atol=3e-5, rtol=3e-5)
    for slot in (sa, sb):  # verify rows only read their slots
        for name in live:
            assert torch.equal(pool.state[name][slot], live[name][slot])
    # snapshot_candidates: a pool entry takes one candidate
    layer.snapshot_candidates(torch.tensor([0]), torch.tensor([2]), torch.tensor([7]), torch.tensor([sa, sb]))
    assert torch.equal(pool.state["token_context"][7], scratch["token_context"][0, 2])
    assert torch.equal(pool.state["conv_state"][7], scratch["conv_state"][0, 2])

    # Row a accepts its first draft (candidate 1), row b none of its drafts (candidate 0).
    layer.commit_verified(torch.tensor([sa, sb]), torch.tensor([1, 0]))
    final_a = base_a + drafts_a[:2] + _seq(3, gen)
    final_b = base_b + drafts_b[:1] + _seq(3, gen)
    xa2 = torch.cat([xa[:12], torch.randn(3, W, generator=gen)])
    xb2 = torch.cat([xb[:7], torch.randn(3, W, generator=gen)])
    with torch.no_grad():
        out2 = layer(torch.cat([xb2[7:10], xa2[12:15], xc[9:12]]), torch.tensor(final_b[7:] + final_a[12:] + seq_c[9:]),
                     _meta([3, 3, 3], [sb, sa, sc]))
    want_a, want_b = reference(layer, CFG, 1, final_a, xa2), reference(layer, CFG, 1, final_b, xb2)
    torch.testing.assert_close(out2[:3], want_b[0][7:], atol=3e-5, rtol=3e-5)
    torch.testing.assert_close(out2[3:6], want_a[0][12:], atol=3e-5, rtol=3e-5)
    torch.testing.assert_close(out2[6:], ref_c[0][9:], atol=3e-5, rtol=3e-5)
    assert _decode_ctx(pool.state["token_context"][sa]) == want_a[1]
    assert _decode_ctx(pool.state["token_context"][sb]) == want_b[1]


def test_verify_reject_keeps_state() -> None:
    """A verify row whose commit is skipped (-1) keeps its live state: the next step feeds other tokens from the
    same point."""
    layer = make_layer(CFG)
    pool = Pool(layer, 4, verify_rows=1, k=2)
    gen = torch.Generator().manual_seed(6)
    base = _seq(7, gen)
    x = torch.randn(12, W, generator=gen)
    with torch.no_grad():
        layer(x[:7], torch.tensor(base), _meta([7], [3]))
        layer(x[7:10], torch.tensor(_seq(3, gen)), _verify_meta([3], [3], [], []))
    layer.commit_verified(torch.tensor([3]), torch.tensor([-1]))
    cont = _seq(5, gen)
    with torch.no_grad():
        out = layer(x[7:12], torch.tensor(cont), _meta([5], [3]))
    want = reference(layer, CFG, 1, base + cont, x)
    torch.testing.assert_close(out, want[0][7:], atol=3e-5, rtol=3e-5)
    assert _decode_ctx(pool.state["token_context"][3]) == want[1]


# --------------------------------------------------------------------------------------------------------------
# Constants and checkpoint.

DEFAULT_PRIMES = [20000003, 20000023, 20000033, 20000047, 20000059, 20000063, 20000069, 20000077, 20000081,
                  20000093, 20000107, 20000147, 20000153, 20000159, 20000161, 20000171]


def test_default_constants() -> None:
    assert ngram_multipliers(0, 3, 248320, 1234) == [23703573157769, 20109073645365, 8052911324071]
    assert ngram_multipliers(1, 3, 248320, 1234) == [3352040966061, 19752442147475, 10742103100073]
    sizes = ngram_head_sizes(0, 16, 20_000_000)
    assert sizes == DEFAULT_PRIMES
    assert sum(sizes) == 320001446 and ngram_table_rows(sizes, 128) == 320001536
    assert ngram_head_offsets(sizes)[:3] == [0, 20000003, 40000026]
    later = ngram_head_sizes(1, 16, 20_000_000)  # distinct primes for the next PLE layer
    assert later[0] > DEFAULT_PRIMES[-1] and list(find_primes_from(20_000_000, 32)[16:]) == later


def test_small_constants_match_reference() -> None:
    layer = make_layer(CFG, j=1)
    emb = layer.ple_embedding
    assert emb.layer_multipliers.tolist() == _ref_mults(1, CFG)
    assert emb.ngram_heads_vocab_sizes.tolist() == _ref_primes(1, CFG)
    sizes = _ref_primes(1, CFG)
    assert emb.ngram_heads_offsets.tolist() == [sum(sizes[:h]) for h in range(4)]
    assert emb.ngram_embedding.weight.shape == (-(-sum(sizes) // 128) * 128, 2)
    assert layer.key_proj.weight.shape == (W, 8) and layer.value_proj.weight.shape == (8, 8)
    assert layer.conv1d.weight.shape == (W, 1, 4)


def test_checkpoint_names_parts_and_derived() -> None:
    cfg = Cfg(split_ngram_parts=3)  # rows not a multiple of 3: torch.chunk's uneven last piece
    layer = make_layer(cfg)
    names = set(layer.state_dict())
    assert names == {"ple_embedding.ngram_embedding.weight", "key_proj.weight", "value_proj.weight",
                     "norm_key.weight", "norm_query.weight", "norm_conv.weight", "conv1d.weight"}
    holder = torch.nn.Module()
    holder.ple = layer
    parts = loader.checkpoint_parts(holder)
    table = layer.ple_embedding.ngram_embedding.weight
    src = torch.randn_like(table)
    pieces = torch.chunk(src, 3, dim=0)
    assert set(parts) == {f"ple.ple_embedding.ngram_embedding.shard_{i}.weight" for i in range(3)}
    with torch.no_grad():
        for i, piece in enumerate(pieces):
            whole, view = parts[f"ple.ple_embedding.ngram_embedding.shard_{i}.weight"]
            assert whole == "ple.ple_embedding.ngram_embedding.weight" and view.shape == piece.shape
            view.copy_(piece)
    assert torch.equal(table, src)

    derived = loader.checkpoint_derived(holder)
    assert set(derived) == {"ple.ple_embedding.layer_multipliers", "ple.ple_embedding.ngram_heads_vocab_sizes",
                            "ple.ple_embedding.ngram_heads_offsets"}
    good = layer.ple_embedding.layer_multipliers.clone()
    layer.check_checkpoint_buffer("ple_embedding.layer_multipliers", good)
    with pytest.raises(ValueError, match="differs"):
        layer.check_checkpoint_buffer("ple_embedding.layer_multipliers", good + 2)
    with pytest.raises(ValueError, match="differs"):
        layer.check_checkpoint_buffer("ple_embedding.ngram_heads_offsets", torch.zeros(5, dtype=torch.int64))


# --------------------------------------------------------------------------------------------------------------
# No host synchronization (what CUDA graph capture needs).


class _NoHostSync(torch.utils._python_dispatch.TorchDispatchMode):
    """Raises on every op that needs the data on the host: ``.item()``/``int()``/``bool()`` (``_local_scalar_dense``),
    ``nonzero`` and the ops with data-dependent output shapes (boolean-mask indexing included)."""

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


def test_forward_has_no_host_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step with an empty row naming a busy slot, then a verify step, with the host copies absent: no
    ``.item()``, ``.tolist()``, ``nonzero`` or boolean mask; the results still equal the reference."""
    layer = make_layer(CFG)
    pool = Pool(layer, 8, verify_rows=1, k=2)
    gen = torch.Generator().manual_seed(9)
    seq_a, seq_b = _seq(9, gen, (3,)), _seq(6, gen)
    xa, xb = torch.randn(9, W, generator=gen), torch.randn(6, W, generator=gen)
    meta = _meta([6, 0, 3], [4, 4, 2])
    meta.query_start_loc_cpu = None
    vmeta = _verify_meta([3], [4], [3], [2])
    vmeta.query_start_loc_cpu = None
    assert vmeta.verify is not None
    vmeta.verify.rest_query_start_loc_cpu = None

    def banned(*_: object, **__: object) -> None:
        raise AssertionError("host sync: tolist")

    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "tolist", banned)
        with torch.no_grad(), _NoHostSync():
            out1 = layer(torch.cat([xa[:6], xb[:3]]), torch.tensor(seq_a[:6] + seq_b[:3]), meta)
            out2 = layer(torch.cat([xa[6:], xb[3:]]), torch.tensor(seq_a[6:] + seq_b[3:]), vmeta)
    ref_a, ref_b = reference(layer, CFG, 1, seq_a, xa), reference(layer, CFG, 1, seq_b, xb)
    torch.testing.assert_close(out1, torch.cat([ref_a[0][:6], ref_b[0][:3]]), atol=3e-5, rtol=3e-5)
    torch.testing.assert_close(out2, torch.cat([ref_a[0][6:], ref_b[0][3:]]), atol=3e-5, rtol=3e-5)
    assert _decode_ctx(pool.state["token_context"][2]) == ref_b[1]
    assert layer.verify_scratch is not None
    assert _decode_ctx(layer.verify_scratch["token_context"][0, 2]) == ref_a[1]
    with pytest.raises(AssertionError, match="host sync"), _NoHostSync():
        torch.tensor([1, 0]).nonzero()


# ------------------------------------------------------------------------------------- the kernel (interpreter)


def run_kernel_checks() -> dict[str, list]:
    """Under ``TRITON_INTERPRET=1``: the n-gram hash + gather kernel (``hyserve.kernels.ple``, CUDA's path) against
    the layer's torch formulation at the real vocabulary's multipliers (int64 products up to 8.8e18),
    orders 2 to 4, eos inside the histories; the layer tests above on the kernel path against the independent
    reference; a sabotaged call (multipliers reversed) that must differ. {name: [ok, message]}."""
    import os

    import hyserve.layers.ple as ple_mod
    from hyserve.kernels.ple import ngram_embed
    from hyserve.testing.triton_interpreter import patch_triton_interpreter

    assert os.environ.get("TRITON_INTERPRET") == "1"
    patch_triton_interpreter()
    out: dict[str, list] = {}
    gen = torch.Generator().manual_seed(7)
    for n, hpn in ((2, 1), (3, 2), (4, 3)):
        cfg = Cfg(ngram_size=n, heads_per_ngram=hpn, ple_embed_dim=4 * (n - 1) * hpn, vocab_size=248320)
        layer = make_layer(cfg, j=2)
        tokens = torch.randint(0, 248320, (40, n), generator=gen)
        tokens[torch.rand(40, n, generator=gen) < 0.2] = EOS
        with torch.no_grad():
            got = layer._embed(tokens)
            real = ple_mod.uses_triton
            ple_mod.uses_triton = lambda t: False  # type: ignore[assignment]
            try:
                want = layer._embed(tokens)
            finally:
                ple_mod.uses_triton = real  # type: ignore[assignment]
        out[f"embed_n{n}"] = [bool(torch.equal(got, want)), f"max diff {float((got - want).abs().max()):.3g}"]
        if n == 4:
            e = layer.ple_embedding
            bad = ngram_embed(tokens, e.layer_multipliers.flip(0), e.ngram_heads_vocab_sizes, e.ngram_heads_offsets,
                              e.ngram_embedding.weight, EOS, hpn)
            out["reversed_multipliers_caught"] = [not torch.equal(bad, want), "differs"]
    # The gate kernel against the torch formulation (float32 to rounding, bf16 to its spacing), and a sabotage: the
    # value of another token must differ.
    from hyserve.kernels.ple import ple_gate

    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        layer = make_layer(CFG, dtype=dtype)
        x = torch.randn(9, W, generator=gen).to(dtype)
        e = torch.randn(9, CFG.ple_embed_dim, generator=gen).to(dtype)
        with torch.no_grad():
            got = layer._gate(x, e)
            real = ple_mod.uses_triton
            ple_mod.uses_triton = lambda t: False  # type: ignore[assignment]
            try:
                want = layer._gate(x, e)
            finally:
                ple_mod.uses_triton = real  # type: ignore[assignment]
            err = float((got.float() - want.float()).abs().max())
            out[f"gate_{str(dtype).split('.')[-1]}"] = [err <= tol, f"max err {err:.3g}"]
            if dtype == torch.float32:
                bad = ple_gate(layer.norm_key(layer.key_proj(e)), layer.norm_query(x), layer.value_proj(e).roll(1, 0),
                               CFG.hc_count, 1e-6)
                out["gate_rolled_value_caught"] = [float((bad - want).abs().max()) > 100 * tol, "differs"]
    for test in (test_whole_prompt_matches_reference, test_chunked_equals_one_shot_bf16,
                 test_verify_candidates_commit_and_continue):
        try:
            test()
            out[test.__name__] = [True, "passed on the kernel path"]
        except AssertionError as exc:
            out[test.__name__] = [False, str(exc)[:500]]
    return out


PLE_KERNEL_CHECKS = ["embed_n2", "embed_n3", "embed_n4", "reversed_multipliers_caught", "gate_float32",
                     "gate_bfloat16", "gate_rolled_value_caught",
                     "test_whole_prompt_matches_reference", "test_chunked_equals_one_shot_bf16",
                     "test_verify_candidates_commit_and_continue"]


@pytest.fixture(scope="module")
def kernel_results() -> dict[str, list]:
    pytest.importorskip("triton")
    return interpreter_subprocess_results(__file__, "--kernel-checks")


@pytest.mark.parametrize("name", PLE_KERNEL_CHECKS)
def test_ngram_kernel_under_the_interpreter(kernel_results: dict[str, list], name: str) -> None:
    ok, msg = kernel_results[name]
    assert ok, f"{name}: {msg}"


if __name__ == "__main__":
    import json
    import sys

    if "--kernel-checks" in sys.argv:
        print("RESULTS " + json.dumps(run_kernel_checks()))

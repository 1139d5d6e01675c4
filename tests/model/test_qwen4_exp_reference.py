"""The Qwen4-Exp test support itself (``hyserve.testing.qwen4_exp``): the tiny checkpoint transformers 5.24 writes has
the release layout (docs/qwen4_exp_facts.md §2), the reference in its subprocess decodes with its cache as it
computes without, and the n-gram hash of its PLE layers is the rule of §3.4, re-implemented here independently of
transformers (splitmix64 multipliers, primes from ``ngram_vocab_size_base``, offsets, restart after eos)."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hyserve.testing import qwen4_exp
from hyserve.testing.families import FAMILIES
from hyserve.testing.files import read_checkpoint_tensors
from hyserve.testing.qwen3_5 import reference_logits
from hyserve.testing.qwen4_exp import (
    QWEN4_EXP,
    QWEN4_EXP_LAYER_PATTERNS,
    Qwen4ExpReference,
    ReferenceProcessError,
    load_qwen4_exp_reference,
    write_tiny_qwen4_exp_checkpoint,
)
from hyserve.testing.tokenizer import ENDOFTEXT, special_token_ids, tokenizer_size

PATTERN = QWEN4_EXP_LAYER_PATTERNS["attn_mid"]  # GDN, GDN + PLE, attention (QSA), GDN + PLE
PLE_LAYER_IDS = (2, 4)  # 1-indexed: PLE tables 0 and 1 (different primes and multipliers)
EOS = special_token_ids()[ENDOFTEXT]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_tiny_qwen4_exp_checkpoint(tmp_path_factory.mktemp("qwen4_exp") / "causal", layer_types=PATTERN,
                                           ple_layer_ids=PLE_LAYER_IDS, seed=3)


@pytest.fixture(scope="module")
def ref(ckpt: str) -> Iterator[Qwen4ExpReference]:
    reference = load_qwen4_exp_reference(ckpt)
    yield reference
    reference.close()


def _config(path: str) -> dict:
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        return json.load(f)


def _prompt(cfg: dict) -> list[int]:
    """Longer than the indexer's budget plus a block (queries choose among more blocks than they may keep), with an
    eos after an ordinary token (an n-gram restart that changes the trigram) and two eos in a row."""
    n = cfg["indexer_budget"] + 3 * cfg["indexer_compress_ratio"] + 2
    ids = torch.randint(0, EOS, (n,), generator=torch.Generator().manual_seed(11)).tolist()
    ids[6] = ids[13] = ids[14] = EOS
    return ids


# --- the n-gram hash, re-implemented from docs/qwen4_exp_facts.md §3.4 -------------------------------------------

_M64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


def _splitmix64(v: int) -> int:
    v = (v + _GAMMA) & _M64
    v = ((v ^ (v >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    v = ((v ^ (v >> 27)) * 0x94D049BB133111EB) & _M64
    return (v ^ (v >> 31)) & _M64


def _multipliers(vocab: int, ngram_size: int, table: int, seed: int) -> list[int]:
    half = max(1, ((2**63 - 1) // max(vocab, 1)) // 2)
    base = seed + 10007 * table
    return [2 * (_splitmix64((base + _GAMMA * (i + 1)) & _M64) % half) + 1 for i in range(ngram_size)]


def _primes_from(start: int, count: int) -> list[int]:
    out: list[int] = []
    n = start
    while len(out) < count:
        if n >= 2 and all(n % d for d in range(2, math.isqrt(n) + 1)):
            out.append(n)
        n += 1
    return out


def _head_sizes(cfg: dict, table: int) -> list[int]:
    heads = (cfg["ngram_size"] - 1) * cfg["heads_per_ngram"]
    return _primes_from(cfg["ngram_vocab_size_base"], (table + 1) * heads)[table * heads:]


def _offsets(sizes: list[int]) -> list[int]:
    return [sum(sizes[:h]) for h in range(len(sizes))]


def _rows(ids: list[int], cfg: dict, table: int, *, restart: bool = True) -> torch.Tensor:
    """Row of each hash head for each position: the tokens back to the last eos strictly before the position
    (older ones, and those before the sequence, read as eos), XOR of token x multiplier, mod the head's prime,
    plus its offset; the bigram heads first. ``restart=False``: the rule without the restart after eos."""
    n, hpn, eos = cfg["ngram_size"], cfg["heads_per_ngram"], cfg["eos_token_id"]
    mult = _multipliers(cfg["vocab_size"], n, table, cfg["seed"])
    sizes = _head_sizes(cfg, table)
    offsets = _offsets(sizes)
    out = []
    for p in range(len(ids)):
        start = max([i + 1 for i in range(p) if ids[i] == eos and restart], default=0)
        back = [ids[p - k] if p - k >= start else eos for k in range(n)]
        row = []
        for order in range(2, n + 1):
            x = 0
            for k in range(order):
                x ^= back[k] * mult[k]
            for i in range(hpn):
                h = (order - 2) * hpn + i
                row.append(x % sizes[h] + offsets[h])
        out.append(row)
    return torch.tensor(out, dtype=torch.long)


def test_hash_constants_match_the_documented_defaults() -> None:
    """The re-implementation against numbers computed for the released config (vocab 248320, seed 1234, 2e7)."""
    assert _multipliers(248320, 3, 0, 1234) == [23703573157769, 20109073645365, 8052911324071]
    assert _multipliers(248320, 3, 1, 1234) == [3352040966061, 19752442147475, 10742103100073]
    primes = _primes_from(20_000_000, 16)
    assert primes[:4] == [20000003, 20000023, 20000033, 20000047] and sum(primes) == 320001446
    assert math.ceil(sum(primes) / 128) * 128 == 320001536 == 512 * 625003


# --- the checkpoint on disk ----------------------------------------------------------------------------------------

def test_checkpoint_has_the_release_layout(ckpt: str) -> None:
    cfg = _config(ckpt)
    assert cfg["model_type"] == "qwen4_exp_text" and cfg["architectures"] == ["Qwen4ExpForCausalLM"]
    assert cfg["layer_types"] == PATTERN  # the release's name for the QSA layers, not transformers' indexed_attention
    assert cfg["ple_layer_ids"] == list(PLE_LAYER_IDS) and cfg["eos_token_id"] == EOS
    assert cfg["vocab_size"] >= tokenizer_size() and cfg["tie_word_embeddings"] is False
    assert cfg["indexer_budget"] < len(_prompt(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert os.path.isfile(os.path.join(ckpt, name))

    tensors = read_checkpoint_tensors(ckpt)
    assert "model.norm.weight" not in tensors and not [n for n in tensors if n.startswith("mtp.")]
    assert {"lm_head.weight", "model.embed_tokens.weight", "model.hyper_connection_mixer.hc_norm.weight"} <= set(
        tensors)
    h, inter, experts = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"]
    for layer in range(len(PATTERN)):
        prefix = f"model.layers.{layer}.mlp.experts."
        got = {n for n in tensors if n.startswith(prefix)}
        assert got == {f"{prefix}{e}.{p}.weight" for e in range(experts) for p in ("gate_proj", "up_proj", "down_proj")}
        assert tensors[f"{prefix}0.gate_proj.weight"].shape == tensors[f"{prefix}0.up_proj.weight"].shape == (inter, h)
        assert tensors[f"{prefix}{experts - 1}.down_proj.weight"].shape == (h, inter)
        assert (f"model.layers.{layer}.self_attn.indexer.index_qk_proj.weight" in tensors) == (
            PATTERN[layer] == "full_attention")
        has_ple = any(n.startswith(f"model.layers.{layer}.ple.") for n in tensors)
        assert has_ple == (layer + 1 in PLE_LAYER_IDS)

    parts, heads = cfg["split_ngram_parts"], (cfg["ngram_size"] - 1) * cfg["heads_per_ngram"]
    for table, layer_id in enumerate(PLE_LAYER_IDS):
        base = f"model.layers.{layer_id - 1}.ple."
        emb = base + "ple_embedding.ngram_embedding."
        shards = sorted((n for n in tensors if n.startswith(emb)),
                        key=lambda n: int(n.removeprefix(emb + "shard_").removesuffix(".weight")))
        assert shards == [f"{emb}shard_{i}.weight" for i in range(parts)]
        rows = sum(tensors[n].shape[0] for n in shards)
        divisor = cfg["make_ngram_vocab_size_divisible_by"]
        assert rows == math.ceil(sum(_head_sizes(cfg, table)) / divisor) * divisor
        assert {tensors[n].shape for n in shards} == {(rows // parts, cfg["ple_embed_dim"] // heads)}
        assert tensors[base + "conv1d.weight"].abs().min() > 0  # transformers' init leaves it zero
        for norm in ("norm_key", "norm_query", "norm_conv"):
            assert tensors[f"{base}{norm}.weight"].abs().max() > 0.1  # random around 0 (a 1 + w gain)


def test_checkpoint_hash_buffers_follow_the_rule(ckpt: str) -> None:
    """The persistent buffers transformers saved for each PLE layer equal the independently computed constants."""
    cfg, tensors = _config(ckpt), read_checkpoint_tensors(ckpt)
    mults = []
    for table, layer_id in enumerate(PLE_LAYER_IDS):
        prefix = f"model.layers.{layer_id - 1}.ple.ple_embedding."
        sizes = _head_sizes(cfg, table)
        mult = _multipliers(cfg["vocab_size"], cfg["ngram_size"], table, cfg["seed"])
        assert tensors[prefix + "layer_multipliers"].tolist() == mult
        assert tensors[prefix + "ngram_heads_vocab_sizes"].tolist() == sizes
        assert tensors[prefix + "ngram_heads_offsets"].tolist() == _offsets(sizes)
        assert all(m % 2 == 1 and m * (cfg["vocab_size"] - 1) < 2**63 for m in mult)
        mults.append(mult)
    assert mults[0] != mults[1]


# --- the reference process ------------------------------------------------------------------------------------------

def test_reference_loads_every_tensor(ref: Qwen4ExpReference, ckpt: str) -> None:
    assert ref.architecture == "Qwen4ExpForCausalLM"
    assert ref.loading_info["missing_keys"] == [] and ref.loading_info["unexpected_keys"] == []
    assert ref.loading_info["mismatched_keys"] == []
    # transformers 5.24 reads the release's full_attention as its QSA layer.
    assert ref.config.layer_types == ["indexed_attention" if t == "full_attention" else t for t in PATTERN]
    assert ref.config.number_of_conv_states == 3


def test_cached_decode_matches_the_uncached_forward(ref: Qwen4ExpReference, ckpt: str) -> None:
    ids = _prompt(_config(ckpt))
    full = reference_logits(ref, ids)  # hyserve.testing.qwen3_5's helper, unchanged
    assert full.shape == (len(ids), ref.config.vocab_size) and torch.isfinite(full).all()
    assert full.std(dim=-1).min() > 1.0  # spread logits: a wrong path shows
    for prefill in (1, 7):
        cached = ref.cached_logits(ids, prefill)
        assert cached.shape == full.shape
        diff = (cached - full).abs().max().item()
        assert diff < 1e-4, f"prefill {prefill}: cached decode differs from the uncached forward by {diff}"
    batch = ref(input_ids=torch.tensor([ids, ids[::-1]]), use_cache=False).logits
    assert batch.shape == (2, len(ids), ref.config.vocab_size)
    assert torch.allclose(batch[0], full, atol=1e-5, rtol=0)


def test_reference_ngram_rows_follow_the_rule(ref: Qwen4ExpReference, ckpt: str) -> None:
    """Rows transformers looks up, uncached and through its cache, against the re-implemented hash."""
    cfg = _config(ckpt)
    ids = _prompt(cfg)
    expected = {layer_id - 1: _rows(ids, cfg, table) for table, layer_id in enumerate(PLE_LAYER_IDS)}
    assert not torch.equal(_rows(ids, cfg, 0, restart=False), expected[PLE_LAYER_IDS[0] - 1])  # the restart shows
    assert {k: v.tolist() for k, v in ref.ngram_rows(ids).items()} == {k: v.tolist() for k, v in expected.items()}
    cached = ref.ngram_rows(ids, prefill=5)
    assert {k: v.tolist() for k, v in cached.items()} == {k: v.tolist() for k, v in expected.items()}


def test_reference_reports_a_failed_command_and_goes_on(ref: Qwen4ExpReference, ckpt: str) -> None:
    ids = _prompt(_config(ckpt))
    with pytest.raises(ReferenceProcessError, match="prefill 0 must be in"):
        ref.cached_logits(ids, 0)
    assert ref.cached_logits(ids[:3], 3).shape == (3, ref.config.vocab_size)


def test_missing_reference_site_says_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(qwen4_exp, "REFERENCE_SITE", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"run scripts/setup\.sh"):
        qwen4_exp.reference_site()


# --- the family's registration and the VLM form -------------------------------------------------------------------

def test_family_is_registered() -> None:
    assert FAMILIES["qwen4_exp"] is QWEN4_EXP
    for types in QWEN4_EXP.layer_patterns.values():
        assert "full_attention" in types and types[1] == "linear_attention"  # PLE's default layer 2 is GDN


def test_vlm_checkpoint(tmp_path: Path) -> None:
    path = write_tiny_qwen4_exp_checkpoint(tmp_path / "vlm", form="vlm",
                                           layer_types=QWEN4_EXP_LAYER_PATTERNS["attn_both_ends"], seed=1)
    cfg = _config(path)
    assert cfg["model_type"] == "qwen4_exp" and cfg["architectures"] == ["Qwen4ExpForConditionalGeneration"]
    assert cfg["text_config"]["layer_types"] == QWEN4_EXP_LAYER_PATTERNS["attn_both_ends"]
    assert cfg["text_config"]["ple_layer_ids"] == [2]
    assert max(cfg[k] for k in ("image_token_id", "video_token_id")) < cfg["text_config"]["vocab_size"]
    assert os.path.isfile(os.path.join(path, "preprocessor_config.json"))
    tensors = read_checkpoint_tensors(path)
    emb = "model.language_model.layers.1.ple.ple_embedding.ngram_embedding."
    assert {n for n in tensors if n.startswith(emb)} == {f"{emb}shard_{i}.weight" for i in range(4)}
    assert "model.language_model.layers.0.mlp.experts.3.down_proj.weight" in tensors
    assert any(n.startswith("model.visual.") for n in tensors) and "lm_head.weight" in tensors
    assert not [n for n in tensors if n.startswith("model.layers.")]
    ref = load_qwen4_exp_reference(path)
    try:
        assert ref.architecture == "Qwen4ExpForConditionalGeneration"
        assert ref.loading_info["missing_keys"] == [] and ref.loading_info["unexpected_keys"] == []
        ids = _prompt(cfg["text_config"])
        full = reference_logits(ref, ids)
        assert torch.isfinite(full).all() and full.std(dim=-1).min() > 1.0
        assert (ref.cached_logits(ids, 4) - full).abs().max().item() < 1e-4
    finally:
        ref.close()

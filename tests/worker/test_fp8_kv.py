"""FP8 KV cache (``kv_cache_dtype="fp8"``): K and V of the attention layers stored in float8_e4m3fn.

The independent reference is transformers' float32 model with the cache's quantization emulated where the cache
sits: the keys as the rotary embedding returns them and the values as ``v_proj`` returns them, each rounded to
float8_e4m3fn and back (torch's own cast). hyserve must match it within the tolerances of the unquantized tests
(measured: 4e-5 logprob). Against the unquantized model the outputs of these tiny random models move by up to several
nats of logprob (their logits span +-20), so "close to unquantized" is no test here; the emulated reference is one
that an engine ignoring the FP8 setting fails (checked below).

Also: the block size stays 16 with FP8 KV and prefix hits land on 16-token boundaries, with prefix caching, MTP
speculative decoding, chunked prefill and async scheduling on together; per-kv-head scales in the kernels; memory
planning at one byte per element; clear errors.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hyserve import SamplingParams
from hyserve.kernels.attention import reference
from hyserve.kernels.attention.reference import paged_attention_ref, store_kv_ref
from hyserve.outputs import RequestOutput
from hyserve.testing import reference_logits
from hyserve.testing.engine import GREEDY_TOL, LOGPROB_TOL, drive, make_llm
from hyserve.testing.families import LAYER_PATTERNS, CheckpointCache

FP8 = torch.float8_e4m3fn


def _round(x: torch.Tensor, scale: float) -> torch.Tensor:
    return ((x / scale).clamp(-448, 448).to(FP8).to(x.dtype)) * scale


@contextlib.contextmanager
def fp8_kv_emulated(ref: torch.nn.Module, k_scale: float = 1.0, v_scale: float = 1.0) -> Iterator[None]:
    """Within: ``ref`` (transformers Qwen3.5) computes attention from keys and values rounded to FP8 as the cache
    stores them (value / scale, one scale for every layer here)."""
    import transformers.models.qwen3_5.modeling_qwen3_5 as modeling

    original = modeling.apply_rotary_pos_emb

    def rope(q, k, *args, **kwargs):  # type: ignore[no-untyped-def]
        q, k = original(q, k, *args, **kwargs)
        return q, _round(k, k_scale)

    hooks = [m.register_forward_hook(lambda mod, inp, out: _round(out, v_scale))
             for name, m in ref.named_modules() if name.endswith("self_attn.v_proj")]
    modeling.apply_rotary_pos_emb = rope
    try:
        yield
    finally:
        modeling.apply_rotary_pos_emb = original
        for h in hooks:
            h.remove()


def deviation(ref: torch.nn.Module, prompt: list[int], out: RequestOutput, k_scale: float = 1.0,
              v_scale: float = 1.0) -> tuple[float, float]:
    """(largest logit gap between a chosen token and the emulated reference's argmax, largest logprob error)."""
    toks = out.outputs[0].token_ids
    assert toks, "no tokens generated"
    with fp8_kv_emulated(ref, k_scale, v_scale):
        logits = reference_logits(ref, prompt + toks).double()  # type: ignore[arg-type]
    logp = torch.log_softmax(logits, dim=-1)
    gap = err = 0.0
    for i, tok in enumerate(toks):
        row = logits[len(prompt) - 1 + i]
        gap = max(gap, float(row.max() - row[tok]))
        err = max(err, abs(out.outputs[0].logprobs[i][tok].logprob - float(logp[len(prompt) - 1 + i, tok])))
    return gap, err


def toks(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(440) for _ in range(n)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1)


def fp8_llm(path: str, **kw: object):
    args: dict[str, object] = dict(kv_cache_dtype="fp8", speculative_config={"method": "mtp",
                                   "num_speculative_tokens": 2}, async_scheduling=True, max_num_batched_tokens=32,
                                   recurrent_snapshot_interval=32, num_snapshot_slots=32, num_kv_blocks=256)
    args.update(kw)
    return make_llm(path, **args)


# Prompts: b shares a's first 53 tokens (a's prompt end leaves a snapshot at 48, three 16-token blocks), c arrives
# later and continues b's whole prompt and output (b's end leaves one at a 16-token boundary past its prompt).
A = toks(53, 1)
B = A + toks(12, 2)


@pytest.mark.parametrize("pattern", ["attn_first", "attn_both_ends"])
def test_fp8_kv_matches_transformers_with_the_cache_quantization_emulated(ckpts: CheckpointCache,
                                                                         pattern: str) -> None:
    path = ckpts.get("conditional", pattern, with_mtp=True)
    ref = ckpts.reference(path)
    llm = fp8_llm(path)
    runner = llm.llm_engine.runner
    assert runner.block_size == 16
    assert all(k.dtype == FP8 and v.dtype == FP8 for k, v in runner.kv_caches_all)  # MTP layer's KV too
    final = drive(llm.llm_engine, {0: [("a", A, greedy(10))], 6: [("b", B, greedy(30))]})
    c_prompt = B + final["b"].outputs[0].token_ids + toks(9, 3)
    final.update(drive(llm.llm_engine, {0: [("c", c_prompt, greedy(10))]}))
    prompts = {"a": A, "b": B, "c": c_prompt}
    for rid, prompt in prompts.items():
        gap, err = deviation(ref, prompt, final[rid])
        assert gap <= GREEDY_TOL and err <= LOGPROB_TOL, (rid, gap, err)
    assert final["b"].num_cached_tokens == 48  # a's prompt-end snapshot: 16-token granularity with FP8 KV
    assert final["c"].num_cached_tokens % 16 == 0 and final["c"].num_cached_tokens > len(B)
    assert llm.get_metrics()["hyserve:spec_decode_num_draft_tokens"] > 0
    llm.llm_engine.assert_no_leaks()


def test_the_check_fails_for_an_engine_that_ignores_fp8_kv(ckpts: CheckpointCache,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage: the setting accepted and the cache kept in float32. The emulated-reference check must see it."""
    import hyserve.worker.model_runner as model_runner

    monkeypatch.setattr(model_runner, "resolve_kv_cache_dtype", lambda name, dtype, device: dtype)
    path = ckpts.get("conditional", "attn_both_ends", with_mtp=True)
    ref = ckpts.reference(path)
    llm = fp8_llm(path)
    assert llm.llm_engine.runner.kv_caches[0][0].dtype == torch.float32
    out = llm.generate({"prompt_token_ids": B}, greedy(10), use_tqdm=False)[0]
    gap, err = deviation(ref, B, out)
    assert gap > GREEDY_TOL or err > LOGPROB_TOL, "an unquantized cache passed the FP8 check"


def test_checkpoint_kv_scales_are_read_and_used(tmp_path: Path) -> None:
    """A checkpoint carrying FP8 KV-cache scales (``self_attn.k_scale`` per tensor, the deprecated shared
    ``kv_scale`` form for the MTP layer, ``v_scale`` as a scalar): the layers hold them, and the outputs match the
    reference emulating those scales, not the unscaled one."""
    from safetensors.torch import load_file, save_file

    from hyserve.testing import load_reference_model, write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path / "ckpt", form="conditional", layer_types=LAYER_PATTERNS["attn_both_ends"],
                                 with_mtp=True)
    k_scale, v_scale = 0.37, 1.7  # not powers of two: the rounding grid moves
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    extra: dict[str, torch.Tensor] = {}
    for f in files:
        for name in load_file(os.path.join(path, f)):
            if name.endswith("self_attn.k_proj.weight") and not name.startswith("mtp."):
                module = name.removesuffix(".k_proj.weight")
                extra[f"{module}.k_scale"] = torch.tensor([k_scale])
                extra[f"{module}.v_scale"] = torch.tensor(v_scale)
    assert len(extra) == 4
    extra["mtp.layers.0.self_attn.kv_scale"] = torch.tensor([0.5])
    save_file(extra, os.path.join(path, "kv_scales.safetensors"))
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        import json

        with open(index) as fh:
            meta = json.load(fh)
        meta["weight_map"].update(dict.fromkeys(extra, "kv_scales.safetensors"))
        with open(index, "w") as fh:
            json.dump(meta, fh)
    else:  # one file: merge the scales into it
        main = os.path.join(path, "model.safetensors")
        save_file({**load_file(main), **extra}, main)
        os.remove(os.path.join(path, "kv_scales.safetensors"))
    ref = load_reference_model(path)
    llm = fp8_llm(path)
    runner = llm.llm_engine.runner
    layers = runner.model.attention_layers()
    assert all(torch.allclose(layer.k_scale.cpu(), torch.full((layer.num_kv_heads,), k_scale)) for layer in layers)
    assert all(torch.allclose(layer.v_scale.cpu(), torch.full((layer.num_kv_heads,), v_scale)) for layer in layers)
    mtp_layer = runner.mtp_kv_layers[0]
    assert float(mtp_layer.k_scale[0]) == 0.5 and float(mtp_layer.v_scale[0]) == 0.5
    out = llm.generate({"prompt_token_ids": B}, greedy(12), use_tqdm=False)[0]
    gap, err = deviation(ref, B, out, k_scale, v_scale)
    assert gap <= GREEDY_TOL and err <= LOGPROB_TOL, (gap, err)
    gap1, err1 = deviation(ref, B, out)
    assert gap1 > GREEDY_TOL or err1 > LOGPROB_TOL, "the unscaled emulation matched too: the scales were not used"
    plain = make_llm(path)  # a cache in the model's dtype reads past the scales
    assert plain.llm_engine.runner.kv_caches[0][0].dtype == torch.float32


@pytest.mark.parametrize("sabotage", [False, True])
def test_kernels_apply_per_head_scales(monkeypatch: pytest.MonkeyPatch, sabotage: bool) -> None:
    """store + paged attention over an FP8 cache with a scale per kv head, against attention computed here from
    K/scale and V/scale rounded to FP8 (torch's cast) and multiplied back; the sabotaged store ignores the scales."""
    if sabotage:
        def unscaled(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
            return x.float().clamp(-448, 448).to(dtype)

        monkeypatch.setattr(reference, "quantize_kv", unscaled)
    g = torch.Generator().manual_seed(0)
    hkv, group, d, bs, nb = 2, 2, 16, 16, 8
    lens = [21, 5]  # two rows of context, prefill queries of 3 and 1 tokens at their ends
    nq = [3, 1]
    k_scale, v_scale = torch.tensor([0.5, 4.0]), torch.tensor([2.0, 0.25])
    kc = torch.zeros(nb, bs, hkv, d, dtype=FP8)
    vc = torch.zeros_like(kc)
    bt = torch.tensor([[5, 2], [7, 0]], dtype=torch.int32)
    ks, vs, slots = [], [], []
    for r, n in enumerate(lens):
        k = torch.randn(n, hkv, d, generator=g) * 3
        v = torch.randn(n, hkv, d, generator=g) * 3
        ks.append(k)
        vs.append(v)
        slots += [int(bt[r, p // bs]) * bs + p % bs for p in range(n)]
    store_kv_ref(torch.cat(ks), torch.cat(vs), kc, vc, torch.tensor(slots), k_scale, v_scale)
    q = torch.randn(sum(nq), hkv * group, d, generator=g)
    qsl = torch.tensor([0, 3, 4], dtype=torch.int32)
    out = paged_attention_ref(q, kc, vc, bt, qsl, torch.tensor(lens, dtype=torch.int32), d**-0.5, 3, max(lens),
                              k_scale, v_scale)
    want = []
    for r, n in enumerate(lens):
        kq = (ks[r] / k_scale[None, :, None]).to(FP8).float() * k_scale[None, :, None]
        vq = (vs[r] / v_scale[None, :, None]).to(FP8).float() * v_scale[None, :, None]
        for i in range(nq[r]):
            pos = n - nq[r] + i
            qi = q[int(qsl[r]) + i].view(hkv, group, d)
            s = torch.einsum("hgd,lhd->hgl", qi, kq[: pos + 1]) * d**-0.5
            want.append(torch.einsum("hgl,lhd->hgd", s.softmax(-1), vq[: pos + 1]).reshape(hkv * group, d))
    close = torch.allclose(out, torch.stack(want), atol=1e-4, rtol=1e-4)
    assert close != sabotage


def test_fp8_kv_takes_one_byte_per_element_in_the_memory_plan(ckpts: CheckpointCache) -> None:
    path = ckpts.get("causal", "attn_both_ends")
    plain = make_llm(path, num_kv_blocks=None, cpu_cache_memory_bytes=8 * 2**20)
    fp8 = make_llm(path, num_kv_blocks=None, cpu_cache_memory_bytes=8 * 2**20, kv_cache_dtype="fp8")
    a, b = plain.llm_engine.runner, fp8.llm_engine.runner
    assert a.cache_info().kv_bytes_per_block == 4 * b.cache_info().kv_bytes_per_block  # float32 -> 1 byte
    assert b.layout.num_kv_blocks > a.layout.num_kv_blocks


def test_bad_kv_cache_dtypes_and_scales_are_refused(ckpts: CheckpointCache) -> None:
    path = ckpts.get("causal", "attn_both_ends")
    with pytest.raises(ValueError, match=r"fp8_e5m2.*auto, fp8, fp8_e4m3"):
        make_llm(path, kv_cache_dtype="fp8_e5m2")
    llm = make_llm(path, kv_cache_dtype="fp8_e4m3")
    layer = llm.llm_engine.runner.model.attention_layers()[0]
    with pytest.raises(ValueError, match="kv heads"):
        layer.set_kv_scales(torch.ones(3), torch.ones(1))
    with pytest.raises(ValueError, match="positive and finite"):
        layer.set_kv_scales(torch.ones(1), torch.tensor([0.0]))


def test_cli_flag_reaches_the_engine() -> None:
    import argparse

    from hyserve.engine_args import engine_args

    p = argparse.ArgumentParser()
    engine_args(p)
    assert p.parse_args(["--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
    assert p.parse_args([]).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-cache-dtype", "int8"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_fp8_kernels_match_the_reference_cuda(dtype: torch.dtype) -> None:
    from hyserve.kernels.attention import paged_attention_triton, store_kv_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    hkv, group, d, bs, nb = 2, 4, 128, 16, 160
    lens = [700, 33, 1]  # 44, 3 and 1 blocks of a 44-wide block table
    slots = torch.randperm(nb, generator=g, device="cuda")[:132].view(3, 44).to(torch.int32)
    k_scale = torch.tensor([0.5, 2.0], device="cuda")
    v_scale = torch.tensor([3.0, 0.75], device="cuda")
    caches = [torch.zeros(nb, bs, hkv, d, dtype=FP8, device="cuda") for _ in range(4)]
    flat = torch.cat([torch.tensor([int(slots[r, p // bs]) * bs + p % bs for p in range(n)]) for r, n in
                      enumerate(lens)]).cuda()
    k = torch.randn(sum(lens), hkv, d, generator=g, device="cuda", dtype=dtype) * 2
    v = torch.randn(sum(lens), hkv, d, generator=g, device="cuda", dtype=dtype) * 2
    store_kv_triton(k, v, caches[0], caches[1], flat, k_scale, v_scale)
    store_kv_ref(k, v, caches[2], caches[3], flat, k_scale, v_scale)
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))  # same rounding, same clamping
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    for nq in ([1, 1, 1], [5, 33, 1]):  # decode, then prefill queries at the rows' ends
        qsl = torch.tensor([0, *torch.tensor(nq).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        q = torch.randn(sum(nq), hkv * group, d, generator=g, device="cuda", dtype=dtype)
        got = paged_attention_triton(q, caches[0], caches[1], slots, qsl, seq, d**-0.5, max(nq), max(lens),
                                     decode_partition=128, k_scale=k_scale, v_scale=v_scale)
        want = paged_attention_ref(q, caches[2], caches[3], slots, qsl, seq, d**-0.5, max(nq), max(lens),
                                   k_scale, v_scale)
        tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_kv_on_cuda_matches_the_emulated_reference_cuda(ckpts: CheckpointCache) -> None:
    path = ckpts.get("conditional", "attn_both_ends", with_mtp=True)
    ref = ckpts.reference(path)
    llm = fp8_llm(path, device="cuda")
    final = drive(llm.llm_engine, {0: [("a", A, greedy(10))], 3: [("b", B, greedy(10))]})
    for rid, prompt in (("a", A), ("b", B)):
        gap, err = deviation(ref, prompt, final[rid])
        assert gap <= 5e-3 and err <= 5e-3, (rid, gap, err)  # float32 on CUDA: tf32-free, graphs on
    assert final["b"].num_cached_tokens == 48

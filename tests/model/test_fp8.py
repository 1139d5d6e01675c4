"""FP8 weights (issue 15): compressed-tensors FP8 (per channel + dynamic per token, per tensor + static), Qwen's block
FP8 (128x128, dynamic per token and 128-group), and online FP8 of a bf16 checkpoint.

The yardstick is transformers' model holding the dequantized weights, with each quantized ``nn.Linear``'s input
quantized by a forward pre-hook (``hyserve.testing.fp8``). The engine runs with prefix caching, MTP speculative
decoding and chunked prefill on, a second request hitting the first's prefix.

Tolerances (float32, CPU). Each FP8 layer of the engine reproduces the reference's quantized ``nn.Linear`` on the
reference's own inputs to 1e-5 (``test_each_fp8_layer_reproduces_the_reference_on_its_inputs``: the same math). End
to end the two models' float32 arithmetic differs in order (1e-6 relative), and requantizing every layer's input
turns such a difference into a whole e4m3 step (6-12 % of one element) wherever it straddles a rounding boundary;
these random tiny models amplify a perturbation ~100x per layer, so a few positions end up 0.1-0.4 apart in
log-probability (measured on the runs here, top-5 log-probs of 40 tokens: mean 0-0.05, max 0.37, tensor parallel
and online FP8 included). Skipping the activation quantization moves every element by ~3.6 % rms and gives mean
0.6-2.8, max 4.5-14 on the same runs. So: mean |diff| <= 0.15 and max <= 1.5 (3x above the noise, 3x below the
sabotage); and where the reference's top two logits are more than 0.5 apart (above the largest difference
measured), the engine's token is the reference's argmax. ``test_skipping_activation_quantization_is_caught`` checks
that this comparison fails for an engine that skips the activation quantization.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch.nn import functional as F

from hyserve import SamplingParams
from hyserve.distributed import parallel_state
from hyserve.engine_args import engine_args
from hyserve.engine_args import make_llm as make_llm_from_flags
from hyserve.kernels import fp8 as fp8_kernels
from hyserve.layers.linear import Linear, LinearBase
from hyserve.layers.quantization import fp8 as fp8_method
from hyserve.layers.quantization import parse_quantization_config
from hyserve.layers.sharding import Shard, shard_of
from hyserve.model.loader import load_weights
from hyserve.model.qwen3_5 import Qwen3_5ForCausalLM as HyModel
from hyserve.model.registry import load_model_config
from hyserve.outputs import RequestOutput
from hyserve.testing import read_checkpoint_tensors, write_tiny_checkpoint
from hyserve.testing.engine import make_llm, random_prompts
from hyserve.testing.fp8 import (
    FP8,
    assert_close_to_fp8_reference,
    dequantize,
    load_engine_model,
    load_fp8_reference,
    load_online_fp8_reference,
    quantization_config,
    write_fp8_checkpoint,
)

MEAN_TOL = 0.15  # mean |log-prob difference| over the top-5 of every generated token
MAX_TOL = 1.5  # the largest such difference
MARGIN = 0.5  # reference top-2 logit gap above which the engine's token must be the reference's argmax

# Dimensions whose tensor-parallel halves are whole 128x128 blocks (q/k/v heads of 128, GDN heads of 128, MLP 256).
TP_BLOCK_DIMS: dict[str, Any] = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                                     linear_num_key_heads=2, linear_key_head_dim=128, linear_num_value_heads=4,
                                     linear_value_head_dim=128, intermediate_size=256)

CASES: dict[str, dict[str, Any]] = {
    # Per-channel bf16 scales; an exact ignore entry and a re: one.
    "ct_dynamic": dict(fmt="ct_dynamic", form="causal", scale_dtype=torch.bfloat16,
                       ignore=["lm_head", r"re:.*linear_attn\.in_proj_[ab]$", "model.layers.1.mlp.down_proj"]),
    # VLM form, per-tensor scales (merged parts differ), static input scales; gate_proj of layer 2 ignored while its
    # up_proj is FP8 (the merged projection runs two GEMMs).
    "ct_static": dict(fmt="ct_static", form="conditional",
                      ignore=["lm_head", "re:.*in_proj_[ab]$", "model.language_model.layers.2.mlp.gate_proj"]),
    # VLM form, hidden 64: every weight is one partial block wide.
    "block": dict(fmt="block", form="conditional"),
    # 160 = 128 + 32 columns, 192 = 128 + 64 rows: ceil-shaped scales; gate_proj's 192 rows end a GEMM.
    "block_ceil": dict(fmt="block", form="causal", scale_dtype=torch.bfloat16, hidden_size=160,
                       intermediate_size=192),
}


# The layer each case's ignore list names exactly (model-side name), besides lm_head and in_proj_a / in_proj_b.
IGNORED_BY_NAME = {"ct_dynamic": "model.layers.1.mlp.down_proj", "ct_static": "model.layers.2.mlp.gate_proj"}


class Checkpoints:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.paths: dict[str, str] = {}

    def get(self, case: str, **extra: Any) -> str:
        key = case + "".join(f"-{k}" for k in sorted(extra))
        if key not in self.paths:
            kw = {**CASES[case], **extra}
            self.paths[key] = write_fp8_checkpoint(self.root / key, kw.pop("fmt"), with_mtp=True, seed=11, **kw)
        return self.paths[key]


@pytest.fixture(scope="module")
def fp8_ckpts(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("fp8"))


def runner_of(llm: Any) -> Any:
    return llm.llm_engine.executor.driver_worker.runner


def run_shared_prefix(path: str, **kw: Any) -> tuple[Any, list[tuple[list[int], RequestOutput]]]:
    """Two requests sharing a 37-token prefix, one after the other (the second hits the first's cache), through an
    engine with MTP (2 drafts), prefix caching and 24-token prefill chunks."""
    llm = make_llm(path, speculative_config={"method": "mtp", "num_speculative_tokens": 2},
                   enable_prefix_caching=True, max_num_batched_tokens=24, max_num_seqs=4, block_size=16,
                   recurrent_snapshot_interval=16, num_snapshot_slots=32, **kw)
    shared = random_prompts(1, [37], seed=3)[0]
    prompts = [shared + tail for tail in random_prompts(2, [5, 11], seed=4)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=5)
    outs = [llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0] for p in prompts]
    metrics = llm.get_metrics()
    assert metrics["hyserve:prefix_cache_hits"] >= 32, metrics
    assert metrics["hyserve:spec_decode_num_drafts"] > 0, metrics
    llm.llm_engine.assert_no_leaks()
    return llm, list(zip(prompts, outs, strict=True))


def assert_matches_fp8_reference(ref: Any, runs: list[tuple[list[int], RequestOutput]]) -> None:
    """The tolerances of the module docstring."""
    assert_close_to_fp8_reference(ref, runs, MEAN_TOL, MAX_TOL, MARGIN, min_clear=10)


def fp8_modules(model: torch.nn.Module) -> dict[str, bool]:
    """Model-side name of every linear part -> whether its weight is FP8."""
    return {m.part_name(p): m.weight.dtype == FP8 for m in model.modules() if isinstance(m, LinearBase)
            for p in m.parts}


# ------------------------------------------------------------------------------------------------ end to end


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_the_fp8_reference(fp8_ckpts: Checkpoints, case: str) -> None:
    path = fp8_ckpts.get(case)
    llm, runs = run_shared_prefix(path)
    assert_matches_fp8_reference(load_fp8_reference(path), runs)
    runner = runner_of(llm)
    quantized = fp8_modules(runner.model)
    assert sum(quantized.values()) >= 20
    # The ignore list: the layers it names load in the model dtype, the others in FP8.
    for name, is_fp8 in quantized.items():
        ignored = name.endswith(("in_proj_a", "in_proj_b")) or name == IGNORED_BY_NAME.get(case)
        assert is_fp8 != ignored, name
    unquantized = [m for m in runner.model.modules() if isinstance(m, LinearBase) and not m.method.quantized]
    assert unquantized and all(m.weight.dtype == torch.float32 for m in unquantized)
    assert runner.model.lm_head.weight.dtype == torch.float32
    # The MTP head's checkpoint tensors are FP8 too: its layers are quantized.
    assert all(fp8_modules(runner.mtp).values())


@pytest.mark.parametrize("case", ["ct_dynamic", "block_ceil"])
def test_skipping_activation_quantization_is_caught(fp8_ckpts: Checkpoints, case: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage: FP8 layers that dequantize the weight but feed the activations unquantized."""

    def no_act_quant(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, *_: Any) -> torch.Tensor:
        return F.linear(x, (weight.float() * scale.float()).to(x.dtype))

    def no_act_quant_block(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                           group: int | None) -> torch.Tensor:
        return F.linear(x, fp8_kernels.dequantize_block_weight(weight, scale, block).to(x.dtype))

    monkeypatch.setattr(fp8_method, "fp8_linear", no_act_quant)
    monkeypatch.setattr(fp8_method, "fp8_block_linear", no_act_quant_block)
    monkeypatch.setenv("HYSERVE_FP8_FUSED_QUANT", "0")  # every GEMM quantizes its own input (the sabotaged step)
    path = fp8_ckpts.get(case)
    _, runs = run_shared_prefix(path)
    with pytest.raises(AssertionError, match=r"log-prob differences|reference argmax"):
        assert_matches_fp8_reference(load_fp8_reference(path), runs)


def test_producers_quantize_for_the_fp8_gemms(fp8_ckpts: Checkpoints, monkeypatch: pytest.MonkeyPatch) -> None:
    """With FP8_DYNAMIC weights the norms and the SwiGLU hand their FP8 GEMMs the activation quantized per token
    (``Fp8Activation``; the plain one beside it for the merged in_proj's bf16 parts), and the outputs are those of
    every GEMM quantizing its own input, token for token and log-prob for log-prob (both against the reference)."""
    seen: dict[str, int] = {"fp8": 0, "plain": 0}
    linear = fp8_method.fp8_linear

    def counting(x: Any, *args: Any) -> torch.Tensor:
        seen["fp8" if isinstance(x, fp8_kernels.Fp8Activation) else "plain"] += 1
        return linear(x, *args)

    monkeypatch.setattr(fp8_method, "fp8_linear", counting)
    path = fp8_ckpts.get("ct_dynamic")
    _, fused = run_shared_prefix(path)
    # Every FP8 GEMM whose producer is a norm, the SwiGLU or the attention gate took the quantized form; the GDN
    # out_proj (after the gated norm) did not.
    assert seen["fp8"] > 0 and seen["plain"] > 0, seen
    assert_matches_fp8_reference(load_fp8_reference(path), fused)
    monkeypatch.setenv("HYSERVE_FP8_FUSED_QUANT", "0")
    seen.update(fp8=0, plain=0)
    _, own = run_shared_prefix(path)
    assert seen["fp8"] == 0, seen
    for (_, a), (_, b) in zip(fused, own, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_plain_parts_fed_the_quantized_activation_are_caught(fp8_ckpts: Checkpoints,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage: a merged projection's bf16 parts (``in_proj_a`` / ``in_proj_b`` here) read the FP8 activation
    dequantized instead of the plain one its producer kept beside it."""
    gemm = LinearBase.gemm

    def dequantized_plain(self: LinearBase, x: Any) -> torch.Tensor:
        if isinstance(x, fp8_kernels.Fp8Activation) and not self.method.takes_fp8_activation():
            return self.method.apply(self, (x.q.float() * x.scale).to(x.dtype))
        return gemm(self, x)

    monkeypatch.setattr(LinearBase, "gemm", dequantized_plain)
    path = fp8_ckpts.get("ct_dynamic")
    _, runs = run_shared_prefix(path)
    with pytest.raises(AssertionError, match=r"log-prob differences|reference argmax"):
        assert_matches_fp8_reference(load_fp8_reference(path), runs)


def test_online_fp8_matches_per_channel_reference(tmp_path: Path) -> None:
    path = write_tiny_checkpoint(tmp_path, with_mtp=True, seed=5, dtype=torch.bfloat16)
    llm, runs = run_shared_prefix(path, quantization="fp8")
    assert_matches_fp8_reference(load_online_fp8_reference(path), runs)
    runner = runner_of(llm)
    assert all(fp8_modules(runner.model).values()) and all(fp8_modules(runner.mtp).values())
    assert runner.model.lm_head.weight.dtype == torch.float32
    assert runner.model.model.embed_tokens.weight.dtype == torch.float32


@pytest.mark.parametrize("case,dims",
                         [("ct_dynamic", {}), pytest.param("block", TP_BLOCK_DIMS, marks=pytest.mark.slow)],
                         ids=["ct_dynamic", "block"])
def test_tensor_parallel_fp8_matches_the_reference(fp8_ckpts: Checkpoints, case: str, dims: dict[str, Any]) -> None:
    """Two ranks: weights and per-channel scales split by rows (column-parallel) or columns (row-parallel), block
    scales with their blocks. A row-parallel layer's rank quantizes its input slice per token on its own (as vLLM
    does; the reference emulates it); block groups are whole on each rank."""
    path = fp8_ckpts.get(case, **dims)
    _, runs = run_shared_prefix(path, tensor_parallel_size=2)
    assert_matches_fp8_reference(load_fp8_reference(path, tensor_parallel_size=2), runs)


# ------------------------------------------------------------------------------------------------ loading


def _load(path: str) -> HyModel:
    cfg = load_model_config(path)
    model = HyModel(cfg).eval()
    load_weights(model, path, cfg)
    return model


@pytest.mark.parametrize("case", list(CASES))
def test_each_fp8_layer_reproduces_the_reference_on_its_inputs(fp8_ckpts: Checkpoints, case: str) -> None:
    """Every quantized GEMM of the loaded model, fed the reference's input to each ``nn.Linear``, gives that
    layer's output (dequantized weight, emulated activation quantization) to float32 rounding."""
    path = fp8_ckpts.get(case)
    model, ref = _load(path), load_fp8_reference(path)
    inputs: dict[str, torch.Tensor] = {}
    outputs: dict[str, torch.Tensor] = {}
    for name, m in ref.named_modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_pre_hook(lambda _m, a, n=name: inputs.__setitem__(n, a[0][0]), prepend=True)
            m.register_forward_hook(lambda _m, _a, out, n=name: outputs.__setitem__(n, out[0]))
    with torch.no_grad():
        ref(input_ids=torch.tensor(random_prompts(1, [29], seed=8)), use_cache=False)
        checked = 0
        for m in model.modules():
            if not isinstance(m, LinearBase) or not m.method.quantized:
                continue
            y, off = m.gemm(inputs[m.part_name(m.parts[0])]), 0
            for part in m.parts:
                torch.testing.assert_close(y[:, off : off + part.size], outputs[m.part_name(part)], rtol=1e-5,
                                           atol=1e-5)
                off += part.size
                checked += 1
    assert checked >= 20


def test_merged_parts_keep_their_own_per_tensor_scales(fp8_ckpts: Checkpoints) -> None:
    """Per-tensor scales of in_proj_qkv and in_proj_z (one GEMM) are each its rows' scale, not a shared one."""
    path = fp8_ckpts.get("ct_static")
    tensors = read_checkpoint_tensors(path)
    model = _load(path)
    gemm = model.model.layers[0].linear_attn.in_proj._gemms[0]
    assert [p.name for p in gemm.parts] == ["in_proj_qkv", "in_proj_z"]
    prefix = "model.language_model.layers.0.linear_attn"
    qkv, z = (tensors[f"{prefix}.{n}.weight_scale"].float() for n in ("in_proj_qkv", "in_proj_z"))
    assert not torch.equal(qkv, z)
    n = gemm.parts[0].size
    assert torch.equal(gemm.weight_scale[:n], qkv.expand(n, 1)) and torch.equal(gemm.weight_scale[n:],
                                                                                 z.expand(gemm.parts[1].size, 1))
    # Static input scales: those of the parts (one input, one calibration: equal), the GEMM uses their maximum.
    assert torch.equal(gemm.input_scale_max, gemm.input_scale.max().reshape(1))


def test_mtp_head_left_in_bf16_by_the_quantizer_loads_unquantized(fp8_ckpts: Checkpoints) -> None:
    """A compressed-tensors checkpoint whose MTP tensors stayed bf16 (its quantizer never loaded the head) although
    ``targets: [Linear]`` names them: the head follows its tensors."""
    path = fp8_ckpts.get("ct_dynamic", quantize_mtp=False)
    assert read_checkpoint_tensors(path)["mtp.fc.weight"].dtype == torch.bfloat16
    llm, _ = run_shared_prefix(path)
    assert not any(fp8_modules(runner_of(llm).mtp).values())
    assert all(v for k, v in fp8_modules(runner_of(llm).model).items() if "mlp.up_proj" in k)


def test_matching_rules_of_both_forms() -> None:
    """``re:`` is re.match (anchored at the start only), other entries equal the name, ``Linear`` matches every
    linear layer; names are matched in the checkpoint's form and in the other Qwen3.5 form."""
    raw = {"quantization_config": quantization_config("ct_dynamic", [
        "model.language_model.layers.0.self_attn.q_proj", r"re:.*mlp\.down", "layers.1.mlp.up_proj"])}
    quant = parse_quantization_config(raw, "Qwen3_5ForCausalLM")
    assert quant is not None
    q = lambda name: quant.linear_method(name).quantized
    assert not q("model.layers.0.self_attn.q_proj")  # listed in the other form
    assert q("model.layers.1.self_attn.q_proj")
    assert not q("model.layers.3.mlp.down_proj") and not q("mtp.layers.0.mlp.down_proj")
    assert q("model.layers.1.mlp.up_proj")  # an exact entry is not a suffix
    assert q("mtp.fc")
    block = parse_quantization_config({"quantization_config": quantization_config(
        "block", ["model.layers.0.mlp.gate_proj"])}, "Qwen3_5ForConditionalGeneration")
    assert block is not None
    assert not block.linear_method("model.layers.0.mlp.gate_proj").quantized
    assert block.linear_method("model.layers.0.mlp.up_proj").quantized


def test_startup_log_says_what_is_quantized(fp8_ckpts: Checkpoints, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="hyserve"):
        make_llm(fp8_ckpts.get("ct_dynamic"))
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("quantization:"))
    # 4 layers: 3 GDN (qkv, z, a, b, out, gate, up, down) and 1 attention (q, k, v, o, gate, up, down); in_proj_a/b
    # of the GDN layers and layer 1's down_proj are ignored.
    assert "compressed-tensors FP8" in line and "weights per channel, activations dynamic per token" in line
    assert "24 linear layers in FP8, 7 kept in float32" in line
    # Weight bytes at their real size: one byte per FP8 weight, the scales in float32.
    tensors = {k: v for k, v in read_checkpoint_tensors(fp8_ckpts.get("ct_dynamic")).items() if k.startswith("model.")}
    fp8_bytes = sum(t.numel() for t in tensors.values() if t.dtype == FP8)
    scale_bytes = 4 * sum(t.numel() for k, t in tensors.items() if k.endswith(".weight_scale"))
    assert f"FP8 weights {fp8_bytes / 2**20:.2f} MiB + scales {scale_bytes / 2**20:.2f} MiB" in line


# ------------------------------------------------------------------------------------------------ bad input


def _copy(src: str, dst: Path) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def _edit_quant(path: str, **fields: Any) -> None:
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    for key, value in fields.items():
        if value is None:
            cfg["quantization_config"].pop(key, None)
        else:
            cfg["quantization_config"][key] = value
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(cfg, f)


def _edit_tensors(path: str, drop: tuple[str, ...] = (), put: dict[str, torch.Tensor] | None = None) -> None:
    tensors = read_checkpoint_tensors(path)
    for name in drop:
        del tensors[name]
    tensors.update(put or {})
    save_file(tensors, os.path.join(path, "model.safetensors"))


def _group(**weights: Any) -> dict[str, Any]:
    group = quantization_config("ct_dynamic", [])["config_groups"]["group_0"]
    return {"group_0": {**group, "weights": {**group["weights"], **weights}}}


@pytest.mark.parametrize("fields,match", [
    ({"quant_method": "awq"}, r"unsupported quant_method 'awq'.*supported: compressed-tensors.*fp8"),
    ({"config_groups": _group(type="int")}, r"int8 quantization is not supported; supported: FP8"),
    ({"config_groups": {"NVFP4": ["Linear"]}}, r"preset scheme 'NVFP4' is not supported; supported presets: FP8, "
                                              r"FP8_DYNAMIC, FP8_BLOCK"),
    ({"config_groups": _group(strategy="group", group_size=128)},
     r"strategy 'group' is not supported for weights; supported: channel, tensor, block"),
    ({"config_groups": _group(symmetric=False)}, r"asymmetric"),
    ({"format": "pack-quantized"}, r"format 'pack-quantized' is not supported; supported: 'float-quantized'"),
    ({"kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}},
     r"kv_cache_scheme strategy='token' is not supported; supported: FP8.*tensor or attn_head"),
    ({"offload": True}, r"unsupported field\(s\) 'offload'"),
])
def test_unsupported_compressed_tensors_configs_name_themselves(fp8_ckpts: Checkpoints, tmp_path: Path,
                                                                 fields: dict[str, Any], match: str) -> None:
    path = _copy(fp8_ckpts.get("ct_dynamic"), tmp_path / "c")
    _edit_quant(path, **fields)
    with pytest.raises(ValueError, match=match):
        load_model_config(path)


@pytest.mark.parametrize("fields,match", [
    ({"activation_scheme": "static"}, r"activation_scheme 'static' is not supported; supported: 'dynamic'"),
    ({"weight_block_size": None}, r"without weight_block_size \(per-tensor FP8\) is not supported"),
    ({"scale_fmt": "ue8m0"}, r"scale_fmt 'ue8m0'"),
    ({"group_size": 64}, r"unsupported field\(s\) 'group_size'"),
])
def test_unsupported_block_fp8_configs_name_themselves(fp8_ckpts: Checkpoints, tmp_path: Path,
                                                       fields: dict[str, Any], match: str) -> None:
    path = _copy(fp8_ckpts.get("block"), tmp_path / "b")
    _edit_quant(path, **fields)
    with pytest.raises(ValueError, match=match):
        load_model_config(path)


@pytest.mark.parametrize("case,edit,match", [
    ("ct_dynamic", "drop", r"^model\.layers\.0\.mlp\.down_proj\.weight_scale is missing: the checkpoint's "
                           r"quantization_config \(compressed-tensors FP8"),
    ("ct_static", "drop", r"^model\.language_model\.layers\.0\.mlp\.down_proj\.weight_scale is missing"),
    ("block", "drop", r"^model\.language_model\.layers\.0\.mlp\.down_proj\.weight_scale_inv is missing"),
    ("ct_dynamic", "shape", r"shape mismatch for 'model\.layers\.0\.mlp\.down_proj\.weight_scale': checkpoint has "
                            r"\[64\], model expects \[64, 1\]"),
    ("ct_static", "shape", r"shape mismatch for 'model\.language_model\.layers\.0\.mlp\.down_proj\.weight_scale': "
                           r"checkpoint has \[2\], model expects \[1\] or \[\]"),
    ("block", "shape", r"shape mismatch for 'model\.language_model\.layers\.0\.mlp\.down_proj\.weight_scale_inv'"),
])
def test_bad_scale_tensors_are_named(fp8_ckpts: Checkpoints, tmp_path: Path, case: str, edit: str,
                                     match: str) -> None:
    path = _copy(fp8_ckpts.get(case), tmp_path / "c")
    prefix = "model.language_model" if CASES[case]["form"] == "conditional" else "model"
    name = f"{prefix}.layers.0.mlp.down_proj." + ("weight_scale_inv" if case == "block" else "weight_scale")
    if edit == "drop":
        _edit_tensors(path, drop=(name,))
    else:
        _edit_tensors(path, put={name: torch.ones(64 if case == "ct_dynamic" else 2)})
    with pytest.raises(ValueError, match=match):
        _load(path)


def test_fp8_bytes_never_load_as_unquantized_values(fp8_ckpts: Checkpoints, tmp_path: Path) -> None:
    # A quantized layer listed in ignore, and a checkpoint without quantization_config: both refused by name.
    path = _copy(fp8_ckpts.get("ct_dynamic"), tmp_path / "a")
    _edit_quant(path, ignore=["lm_head", r"re:.*in_proj_[ab]$", "model.layers.1.mlp.down_proj",
                              "model.layers.0.mlp.up_proj"])
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight is FP8 \(F8_E4M3\) in the "
                                         r"checkpoint, but its quantization_config .* leaves this layer unquantized"):
        _load(path)
    path = _copy(fp8_ckpts.get("ct_dynamic"), tmp_path / "b")
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    cfg.pop("quantization_config")
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match=r"is FP8 \(F8_E4M3\) in the checkpoint, but config\.json has no "
                                         r"quantization_config"):
        _load(path)
    # The other way: a layer the config quantizes whose checkpoint weight is bf16.
    path = _copy(fp8_ckpts.get("ct_dynamic"), tmp_path / "c")
    _edit_quant(path, ignore=["lm_head", "re:.*in_proj_b$", "model.layers.1.mlp.down_proj"])
    with pytest.raises(ValueError, match=r"model\.layers\.0\.linear_attn\.in_proj_a\.weight is BF16 in the "
                                         r"checkpoint, but its quantization_config .* quantizes this layer"):
        _load(path)


def test_quantization_flag_errors(fp8_ckpts: Checkpoints, tmp_path: Path) -> None:
    plain = write_tiny_checkpoint(tmp_path / "plain")
    with pytest.raises(ValueError, match=r"quantization='int8' is not supported; supported: fp8"):
        load_model_config(plain, quantization="int8")
    with pytest.raises(ValueError, match=r"quantization='fp8' does not match the checkpoint, which is quantized with "
                                         r"compressed-tensors"):
        make_llm(fp8_ckpts.get("ct_dynamic"), quantization="fp8")
    # A block-FP8 checkpoint is FP8 already: the flag agrees with it.
    cfg = load_model_config(fp8_ckpts.get("block"), quantization="fp8")
    assert cfg.quantization is not None and cfg.quantization.method_name == "fp8"
    assert not cfg.quantization.quantizes_at_load


def test_quantization_command_line_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    engine_args(parser)
    path = write_tiny_checkpoint(tmp_path)
    llm = make_llm_from_flags(parser.parse_args(["--device", "cpu", "--quantization", "fp8"]), path)
    assert all(fp8_modules(runner_of(llm).model).values())
    assert llm.llm_engine.model_config.quantization is not None
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int8"])
    err = capsys.readouterr().err
    assert "argument --quantization: invalid choice: 'int8'" in err and "fp8" in err.rsplit("choose from", 1)[1]


def test_gpu_without_fp8_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"FP8 weights need a GPU with FP8 support \(compute capability 8\.9 or "
                                         r"newer.*NVIDIA A100 has 8\.0"):
        fp8_kernels.check_fp8_device(torch.device("cuda"))
    fp8_kernels.check_fp8_device(torch.device("cpu"))


# ------------------------------------------------------------------------------------------------ tensor parallel


@pytest.mark.parametrize("case,dims", [("ct_dynamic", {}), ("ct_static", {}), ("block", TP_BLOCK_DIMS)],
                         ids=["ct_dynamic", "ct_static", "block"])
def test_each_rank_holds_its_slice_of_the_dequantized_weights(fp8_ckpts: Checkpoints, case: str,
                                                               dims: dict[str, Any],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Both ranks of tensor_parallel_size=2, built in this process: every quantized part's weight, dequantized with
    the scales the rank loaded, is exactly its rows (column-parallel) or columns (row-parallel) of the checkpoint's
    dequantized weight."""
    path = fp8_ckpts.get(case, **dims)
    tensors = read_checkpoint_tensors(path)
    vlm = CASES[case]["form"] == "conditional"
    monkeypatch.setattr(parallel_state, "_TP_SIZE", 2)
    for rank in (0, 1):
        monkeypatch.setattr(parallel_state, "_TP_RANK", rank)
        checked = 0
        for m in _load(path).modules():
            if not isinstance(m, LinearBase) or not m.method.quantized:
                continue
            scheme = m.method.scheme
            if scheme.block is not None:
                local = fp8_kernels.dequantize_block_weight(m.weight, getattr(m, scheme.scale_name), scheme.block)
            else:
                local = m.weight.float() * m.weight_scale
            off = 0
            for part in m.parts:
                name = m.part_name(part)
                full = dequantize(tensors, "model.language_model." + name[len("model."):] if vlm else name)
                assert part.shard is not None, name
                torch.testing.assert_close(local[off : off + part.size], part.shard.take(full), rtol=0, atol=0)
                off += part.size
                checked += 1
        assert checked >= 20


def test_block_shards_off_the_block_grid_are_refused(fp8_ckpts: Checkpoints) -> None:
    """A rank's rows off the block grid of a tensor of two rows of blocks are refused; in a tensor of one row of
    blocks any rows are fine (they all take its scales)."""
    quant = load_model_config(fp8_ckpts.get("block")).quantization
    with pytest.raises(ValueError, match=r"model\.layers\.3\.self_attn\.q_proj: this tensor-parallel rank's rows "
                                         r"\[64, 192\) of 256 do not start and end on the checkpoint's 128x128 FP8 "
                                         r"blocks"):
        Linear(64, 128, quant=quant, prefix="model.layers.3.self_attn.q_proj", shard=Shard((256, 64), 0, ((64, 192),)))
    one_row = Linear(64, 64, quant=quant, prefix="model.layers.3.self_attn.q_proj",
                     shard=Shard((128, 64), 0, ((64, 128),)))
    assert shard_of(one_row.weight_scale_inv) == Shard((1, 1), 0, ((0, 1),))


# ------------------------------------------------------------------------------------------------ CUDA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", fp8_kernels.GEMM_BACKENDS)
def test_cuda_scaled_mm_matches_the_reference(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    """``torch._scaled_mm`` (rowwise scales) or the Triton GEMM, and the block path (Triton), against the CPU
    reference on the same FP8 weights; bf16 activations. The activation quantization is the same arithmetic on both
    devices; what differs is the GEMM's summation order and its bf16 output (2^-8 relative)."""
    monkeypatch.setenv("HYSERVE_FP8_GEMM", backend)
    fp8_kernels.check_fp8_device(torch.device("cuda"))
    gen = torch.Generator().manual_seed(0)
    for m, k, n in ((1, 256, 512), (7, 64, 128), (33, 512, 256), (300, 1024, 768)):
        x = torch.randn(m, k, generator=gen).bfloat16()
        w = torch.randn(n, k, generator=gen) / k**0.5
        scale = w.abs().amax(dim=1, keepdim=True) / 448
        wq = (w / scale).clamp(-448, 448).to(FP8)
        for input_scale in (None, torch.tensor([x.float().abs().max() / 448 * 0.7])):
            want = fp8_kernels.fp8_linear_ref(x, wq, scale, input_scale).float()
            got = fp8_kernels.fp8_linear(x.cuda(), wq.cuda(), scale.cuda(),
                                         None if input_scale is None else input_scale.cuda()).cpu().float()
            torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))
        bscale = torch.rand(-(-n // 128), -(-k // 128), generator=gen) / 448 + 1e-3
        for group in (128, None):
            want = fp8_kernels.fp8_block_linear_ref(x, wq, bscale, (128, 128), group).float()
            got = fp8_kernels.fp8_block_linear(x.cuda(), wq.cuda(), bscale.cuda(), (128, 128), group).cpu().float()
            torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 33, 300, 2049])
def test_cuda_blockwise_scaled_mm_matches_the_reference(m: int) -> None:
    """cuBLASLt's block-scaled GEMM (``HYSERVE_FP8_GEMM=scaled_mm`` with 128x128 weights), called directly so that
    no shape falls back to the Triton kernel: token counts not multiples of 4 (the scales' columns M apart), K of
    several groups of four blocks, N not a multiple of 128 (a partial last weight block); and one shape it refuses."""
    gen = torch.Generator().manual_seed(m)
    k, n = 1024, 704
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen) / k**0.5
    bscale = torch.rand(-(-n // 128), k // 128, generator=gen) / 448 + 1e-3
    wq = (w / bscale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)).clamp(-448, 448).to(FP8)
    assert fp8_kernels.blockwise_scaled_mm_fits(wq, bscale, (128, 128))
    assert not fp8_kernels.blockwise_scaled_mm_fits(wq[:, :256], bscale[:, :2], (128, 128))  # 2 K blocks
    want = fp8_kernels.fp8_block_linear_ref(x, wq, bscale, (128, 128), 128).float()
    got = fp8_kernels.blockwise_scaled_mm(x.cuda(), wq.cuda(), bscale.cuda(), torch.bfloat16).cpu().float()
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("block", [None, (128, 128)])
def test_cuda_split_k_gemm_is_exact_between_runs_and_under_graph_replay(monkeypatch: pytest.MonkeyPatch,
                                                                         block: tuple[int, int] | None) -> None:
    """Decode shapes split K over many programs; the last of a tile's programs adds the partials in split order.
    So two launches on the same input agree bit for bit, a captured graph replayed on new inputs gives the eager
    launch's bits, the locks are zero after every launch, and the result is the reference's within bf16."""
    monkeypatch.setenv("HYSERVE_FP8_GEMM", "triton")
    fp8_kernels.check_fp8_device(torch.device("cuda"))
    gen = torch.Generator().manual_seed(5)
    m, k, n = 1, 4096, 1024
    assert fp8_kernels.gemm_config(m, n, k).split_k > 4
    w = torch.randn(n, k, generator=gen) / k**0.5
    if block is None:
        scale = w.abs().amax(dim=1, keepdim=True) / 448
        wq = (w / scale).clamp(-448, 448).to(FP8)
    else:
        scale = torch.rand(n // 128, k // 128, generator=gen) / 448 + 1e-3
        wq = (w / scale.repeat_interleave(128, 0).repeat_interleave(128, 1)).clamp(-448, 448).to(FP8)
    wq_d, scale_d = wq.cuda(), scale.cuda()

    def run(x: torch.Tensor) -> torch.Tensor:
        if block is None:
            return fp8_kernels.fp8_linear(x, wq_d, scale_d)
        return fp8_kernels.fp8_block_linear(x, wq_d, scale_d, block, 128)

    def ref(x: torch.Tensor) -> torch.Tensor:
        if block is None:
            return fp8_kernels.fp8_linear_ref(x, wq, scale)
        return fp8_kernels.fp8_block_linear_ref(x, wq, scale, block, 128)

    xs = [torch.randn(m, k, generator=gen).bfloat16() for _ in range(3)]
    locks = fp8_kernels.split_locks(torch.device("cuda"))
    first = run(xs[0].cuda())
    assert torch.equal(first, run(xs[0].cuda()))
    assert int(locks.count_nonzero()) == 0
    torch.testing.assert_close(first.float().cpu(), ref(xs[0]).float(), rtol=1e-2,
                               atol=1e-2 * float(ref(xs[0]).float().abs().max()))
    static = xs[0].cuda()
    run(static)  # warm: compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(static)
    for x in xs[1:] + xs[:1]:
        static.copy_(x.cuda())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, run(x.cuda()))
        assert int(locks.count_nonzero()) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_layers_match_the_cpu_reference(fp8_ckpts: Checkpoints, case: str) -> None:
    """The checkpoint loaded onto CUDA (bf16 model: the _scaled_mm path where K and N are multiples of 16, the
    block path otherwise) against the same checkpoint on the CPU (the float32 reference path), layer by layer on the
    same bf16 inputs (so both quantize the same values): only the GEMM's summation order and bf16 output differ."""
    path = fp8_ckpts.get(case)
    gpu = load_engine_model(HyModel, path, "cuda", torch.bfloat16)
    cpu = _load(path)
    gen = torch.Generator().manual_seed(2)
    named = [(n, c, g) for (n, c), g in zip(cpu.named_modules(), gpu.modules(), strict=True)
             if isinstance(c, LinearBase) and c.method.quantized]
    pairs = [(c, g) for _, c, g in named]
    # The tiny model's quantized projections (those the quantizer did not leave in bf16): every kind, merged or not
    # (the merged projections' GEMMs are named by their index), 15 to 21 of them with the four schemes.
    kinds = {n.rsplit(".", 1)[-1] for n, _, _ in named}
    assert {"o_proj", "out_proj", "down_proj", "0"} <= kinds and len(pairs) >= 15, (kinds, len(pairs))
    with torch.no_grad():
        for c, g in pairs:
            x = torch.randn(9, c.in_features, generator=gen).bfloat16()
            want = c.gemm(x.float())
            got = g.gemm(x.cuda()).float().cpu()
            torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_producers_quantizing_change_no_bit(fp8_ckpts: Checkpoints, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the card with CUDA graphs, bf16: the norms, the SwiGLU and the attention gate quantizing for the FP8_DYNAMIC
    GEMMs give the tokens and log-probs of every GEMM quantizing its own input, bit for bit (the same FP8 values and
    scales reach the same GEMMs), through prefix caching, MTP and chunked prefill."""
    path = fp8_ckpts.get("ct_dynamic")
    runs = {}
    # (HYSERVE_FP8_FUSED_QUANT, HYSERVE_GDN_FUSED_QUANT): the default, every GEMM on its own, and the GDN decode and
    # verify launches quantizing out_proj's input too (off by default, kept to measure)
    for mode in (("1", "0"), ("0", "0"), ("1", "1")):
        monkeypatch.setenv("HYSERVE_FP8_FUSED_QUANT", mode[0])
        monkeypatch.setenv("HYSERVE_GDN_FUSED_QUANT", mode[1])
        _, runs[mode] = run_shared_prefix(path, device="cuda", dtype="bfloat16")
    for mode in (("1", "0"), ("1", "1")):
        for (_, a), (_, b) in zip(runs[mode], runs[("0", "0")], strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids, mode
            assert a.outputs[0].logprobs == b.outputs[0].logprobs, mode


def test_the_gdn_output_quantization_is_asked_for(fp8_ckpts: Checkpoints, monkeypatch: pytest.MonkeyPatch) -> None:
    """``HYSERVE_GDN_FUSED_QUANT``: off unless 1 (the GDN decode launch quantizing its output measured slower than
    the GEMM's own quantization), then every FP8 out_proj's GDN layer asks its fused launches for it; any other
    value refused rather than read as off."""
    from hyserve.layers.gdn import GatedDeltaNet, output_quant_switch

    path = fp8_ckpts.get("ct_dynamic")
    for value, want in ((None, None), ("0", None), ("1", "fp8")):
        if value is None:
            monkeypatch.delenv("HYSERVE_GDN_FUSED_QUANT", raising=False)
        else:
            monkeypatch.setenv("HYSERVE_GDN_FUSED_QUANT", value)
        assert output_quant_switch() == (want is not None)
        model = load_engine_model(HyModel, path, "cpu", torch.float32)
        layers = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
        assert layers and all(m.out_proj.method.takes_fp8_activation() for m in layers)
        assert {m.out_quant for m in layers} == {want}, value
    for bad in ("2", "on", ""):
        monkeypatch.setenv("HYSERVE_GDN_FUSED_QUANT", bad)
        with pytest.raises(ValueError, match="HYSERVE_GDN_FUSED_QUANT"):
            output_quant_switch()


def test_merged_parts_of_two_gemms_are_cut_without_joining() -> None:
    """GDN's input projection in the seed's checkpoint: ``in_proj_qkv`` / ``in_proj_z`` in FP8, ``in_proj_b`` /
    ``in_proj_a`` kept in bf16, so two GEMMs. ``forward_split`` gives the pieces ``forward(x).split`` gives, each a
    view of its own GEMM's output (no ``torch.cat`` copy of the whole output per layer); a piece across the two
    outputs is refused by name."""
    from hyserve.layers.linear import MergedLinear

    quant = parse_quantization_config({"quantization_config": quantization_config(
        "ct_dynamic", ["lm_head", r"re:.*in_proj_[ab]$"])}, "Qwen3_5ForCausalLM")
    assert quant is not None
    sizes = [48, 16, 4, 4]
    lin = MergedLinear(32, list(zip(["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"], sizes, strict=True)),
                       quant=quant, prefix="model.layers.0.linear_attn")
    assert len(lin.gemms) == 2
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in lin.parameters():
            p.copy_((torch.rand(p.shape, generator=gen) * 0.5 + 0.25).to(p.dtype))
    x = torch.randn(5, 32, generator=gen)
    want = lin(x).split(sizes, dim=-1)
    got = lin.forward_split(x, sizes)
    assert len(got) == 4 and all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    storage = [t.untyped_storage().data_ptr() for t in got]
    assert storage[0] == storage[1] != storage[2] == storage[3]
    with pytest.raises(ValueError, match="straddle"):
        lin.forward_split(x, [48, 18, 6])

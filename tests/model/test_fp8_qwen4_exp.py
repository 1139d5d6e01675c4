"""Qwen4-Exp FP8 checkpoints (issue 32) against transformers 5.24 on their dequantized weights, the activation
quantization emulated (``hyserve.testing.fp8_qwen4_exp``), teacher-forced, float32 on the CPU: Qwen's block FP8
(``weight_scale_inv`` per 128 x 128 block) and compressed-tensors FP8_DYNAMIC (per output channel), with the ignore
list the releases carry (LM head, GDN ``in_proj_a`` / ``in_proj_b``, routers, ``shared_expert_gate``, the
hyper-connection linears); the GDN and attention projections, the QSA indexer's ``index_qk_proj``, the experts, the
shared expert and the PLE ``key_proj`` / ``value_proj`` in FP8. Prompts with EOS inside (PLE restarts), longer than
the indexer budget (QSA selects), chunked. And a config that quantizes the hyper-connection linears too: served when
the model builds them quantized, else refused naming the module."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from hyserve import SamplingParams
from hyserve.layers.hyper_connection import GatedResidual
from hyserve.layers.quantization.fp8 import Fp8LinearMethod
from hyserve.model.registry import load_model_config
from hyserve.testing.engine import make_llm, random_prompts
from hyserve.testing.fp8 import FP8, assert_close_to_fp8_reference
from hyserve.testing.fp8_qwen4_exp import load_fp8_qwen4_exp_reference, quantize_qwen4_exp_checkpoint
from hyserve.testing.qwen4_exp import QWEN4_EXP_LAYER_PATTERNS, write_tiny_qwen4_exp_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
CASES: dict[str, dict[str, Any]] = {
    "block": dict(fmt="block", block=(128, 128)),
    "ct_dynamic": dict(fmt="ct_dynamic"),
    # Small tiles, so that the hyper-connection linears span several blocks.
    "block_hc": dict(fmt="block", block=(16, 16), quantize_hyper_connections=True),
}
HC = ("input_mix_weight_down", "input_mix_weight_up", "block_inject_weight")


class Checkpoints:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.base: str | None = None
        self.paths: dict[str, str] = {}
        self.quantized: dict[str, list[str]] = {}

    def get(self, case: str) -> str:
        if self.base is None:
            # Eight indexer heads (no exact score ties: see tests/model/test_qwen4_exp.py); experts of 128 rows, whole
            # 128 x 128 blocks each.
            self.base = write_tiny_qwen4_exp_checkpoint(self.root / "base", layer_types=QWEN4_EXP_LAYER_PATTERNS[
                "attn_mid"], indexer_n_heads=8, moe_intermediate_size=128, seed=0)
        if case not in self.paths:
            path = str(self.root / case)
            shutil.copytree(self.base, path)
            kw = dict(CASES[case])
            self.quantized[case] = quantize_qwen4_exp_checkpoint(path, kw.pop("fmt"), **kw)
            self.paths[case] = path
        return self.paths[case]


@pytest.fixture(scope="module")
def q4_ckpts(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("fp8_qwen4_exp"))


def _prompts(path: str) -> list[list[int]]:
    """Lengths 1 to 40 (the indexer budget is 8), EOS inside two of them."""
    eos = load_model_config(path).ple_eos_token_id  # type: ignore[attr-defined]
    prompts = random_prompts(5, [1, 7, 23, 40, 17], seed=3)
    prompts[2][5] = eos
    prompts[3][11] = prompts[3][12] = eos
    return prompts


def _check(q4_ckpts: Checkpoints, case: str) -> Any:
    path = q4_ckpts.get(case)
    llm = make_llm(path, max_num_batched_tokens=16)  # chunks: the PLE, GDN and indexer states cross steps
    ref = load_fp8_qwen4_exp_reference(path)
    try:
        # Every FP8 module of the checkpoint is emulated (the experts once per MoE layer).
        experts = {m.split(".experts.")[0] for m in q4_ckpts.quantized[case] if ".experts." in m}
        assert len(ref.emulated) == len({m for m in q4_ckpts.quantized[case] if ".experts." not in m}) + len(experts)
        prompts = _prompts(path)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        assert_close_to_fp8_reference(ref, list(zip(prompts, outs, strict=True)), 1e-2, 0.1, 0.1, min_clear=12)
    finally:
        ref.close()
    return llm.llm_engine.runner.model


def _fp8(linear: Any) -> bool:
    return bool(linear.method.quantized) and linear.weight.dtype == FP8


@pytest.mark.parametrize("case", ["block", "ct_dynamic"])
def test_greedy_matches_the_fp8_reference(q4_ckpts: Checkpoints, case: str) -> None:
    model = _check(q4_ckpts, case)
    layers = list(model.model.layers)
    for layer in layers:
        mlp = layer.mlp
        assert not mlp.gate.method.quantized and not mlp.shared_expert_gate.method.quantized
        assert mlp.experts.gate_up_proj.dtype == FP8 and _fp8(mlp.shared_expert.down_proj)
        for hc in (layer.attn_hyper_connection, layer.mlp_hyper_connection):
            assert all(getattr(hc, n).weight.dtype == torch.float32 for n in HC)
        if hasattr(layer, "self_attn"):
            assert _fp8(layer.self_attn.indexer.index_qk_proj)
        if layer.ple is not None:
            assert _fp8(layer.ple.key_proj) and _fp8(layer.ple.value_proj)
    assert sum(layer.ple is not None for layer in layers) == 1
    scale = "weight_scale_inv" if case == "block" else "weight_scale"
    assert hasattr(next(layer.ple for layer in layers if layer.ple is not None).key_proj, scale)


def test_quantized_hyper_connections_are_served(q4_ckpts: Checkpoints) -> None:
    """A config that leaves the hyper-connection linears out of its ignore list, their weights FP8 in the
    checkpoint: the model builds every hyper-connection (each layer's two and the final mixer) quantized by name,
    and serves them against the reference on the dequantized weights."""
    path = q4_ckpts.get("block_hc")
    assert any("hyper_connection" in m for m in q4_ckpts.quantized["block_hc"])
    cfg = load_model_config(path)
    hc = GatedResidual(64, 4, 8, 1e-6, quant=cfg.quantization, prefix="model.layers.0.attn_hyper_connection")
    for name in HC:
        linear = getattr(hc, name)
        assert isinstance(linear.method, Fp8LinearMethod) and linear.weight.dtype == FP8
        assert linear.weight_scale_inv.shape == (-(-linear.out_features // 16), -(-linear.in_features // 16))
    model = _check(q4_ckpts, "block_hc")
    assert all(_fp8(getattr(layer.mlp_hyper_connection, n)) for layer in model.model.layers for n in HC)
    assert all(_fp8(getattr(model.model.hyper_connection_mixer, n)) for n in HC if n != "block_inject_weight")

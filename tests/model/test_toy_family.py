"""A new family registered the way docs/adding_a_model.md says: a Qwen3.5 variant whose MLP is the non-gated GELU
MLP (``hyserve.layers.mlp.GeluMLP``), its family file being this module's ``GeluDecoderLayer`` and
``ToyGeluForCausalLM``, registered with one registry entry. Its greedy outputs and log-probabilities match a
transformers reference built the same way (transformers' Qwen3.5 classes with the MLP swapped), teacher-forced,
float32, on the CPU; a checkpoint with the gated MLP's tensors is refused by name.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from transformers import Qwen3_5ForCausalLM as Qwen3_5ForCausalLMReference
from transformers import Qwen3_5TextConfig

from hyserve import SamplingParams
from hyserve.layers.mlp import GeluMLP
from hyserve.model import registry
from hyserve.model.qwen3_5 import DecoderLayer, Qwen3_5ForCausalLM
from hyserve.model.qwen3_5_config import Qwen3_5Config, parse_qwen3_5_config
from hyserve.testing import load_reference_model, read_checkpoint_tensors, write_tiny_checkpoint
from hyserve.testing.engine import assert_matches_reference, make_llm, random_prompts
from hyserve.testing.families import LAYER_PATTERNS, CheckpointCache, FamilyCheckpoints, register_family

TOY_ARCH = "ToyGeluForCausalLM"


# ------------------------------------------------------------------------------------------------ the family file


class GeluDecoderLayer(DecoderLayer):
    def make_mlp(self, cfg: Qwen3_5Config, prefix: str) -> nn.Module:
        return GeluMLP(cfg.hidden_size, cfg.intermediate_size, cfg.quantization, prefix)


class ToyGeluForCausalLM(Qwen3_5ForCausalLM):
    decoder_layer = GeluDecoderLayer


# ------------------------------------------------------------------------------------------------ the reference


class ReferenceGeluMLP(nn.Module):
    """transformers' Qwen3.5 MLP with the gate taken out: ``down_proj(gelu(up_proj(x)))``."""

    def __init__(self, hidden: int, intermediate: int, gen: torch.Generator) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        with torch.no_grad():
            self.up_proj.weight.copy_(torch.randn(intermediate, hidden, generator=gen) / hidden**0.5)
            self.down_proj.weight.copy_(torch.randn(hidden, intermediate, generator=gen) * 0.5 / intermediate**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.gelu(self.up_proj(x)))


def reference_toy_model(path: str) -> Any:
    """transformers' Qwen3.5 classes with every MLP swapped for ``ReferenceGeluMLP``, holding the checkpoint's
    tensors (loaded strictly: every tensor has its parameter and every parameter its tensor)."""
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    ref = Qwen3_5ForCausalLMReference(Qwen3_5TextConfig(**{k: v for k, v in raw.items() if k != "architectures"}))
    gen = torch.Generator().manual_seed(0)
    for layer in ref.model.layers:
        layer.mlp = ReferenceGeluMLP(ref.config.hidden_size, ref.config.intermediate_size, gen)
    ref.load_state_dict(read_checkpoint_tensors(path), strict=True)
    return ref.float().eval()


def write_toy_checkpoint(path: str, **kw: Any) -> str:
    """A tiny Qwen3.5 checkpoint (``write_tiny_checkpoint(path, **kw)``, causal form) whose MLPs are GELU ones drawn
    by ``ReferenceGeluMLP``, saved by name under the toy's architecture."""
    write_tiny_checkpoint(path, **kw)
    ref = load_reference_model(path)
    gen = torch.Generator().manual_seed(1)
    for layer in ref.model.layers:
        layer.mlp = ReferenceGeluMLP(ref.config.hidden_size, ref.config.intermediate_size, gen)
    save_file({n: t.contiguous() for n, t in ref.state_dict().items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump({**raw, "architectures": [TOY_ARCH]}, f)
    return path


# The family's test support (its checkpoint writer and reference): cached-checkpoint tests ask for it by name.
TOY_FAMILY = register_family(FamilyCheckpoints("toy_gelu", write_toy_checkpoint, reference_toy_model,
                                               {p: LAYER_PATTERNS[p] for p in ("gdn3_attn1", "attn_first")}))


@pytest.fixture(scope="module")
def toy_arch() -> Iterator[None]:
    registry.register_model(TOY_ARCH, ToyGeluForCausalLM, parse_qwen3_5_config, ("qwen3_5_text",))
    try:
        yield
    finally:
        registry.unregister_model(TOY_ARCH)


@pytest.mark.parametrize("pattern", ["gdn3_attn1", "attn_first"])
def test_the_toy_family_matches_its_transformers_reference(ckpts: CheckpointCache, toy_arch: None,
                                                           pattern: str) -> None:
    path = ckpts.get("causal", pattern, family="toy_gelu")
    ref = ckpts.reference(path)
    llm = make_llm(path, max_num_batched_tokens=16)
    model = llm.llm_engine.runner.model
    assert type(model) is ToyGeluForCausalLM
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    assert len(layers) == 4 and all(isinstance(layer.mlp, GeluMLP) for layer in layers)
    prompts = random_prompts(4, [1, 7, 23, 40], seed=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        assert_matches_reference(ref, prompt, out)


def test_the_toy_family_refuses_a_gated_mlp_checkpoint(toy_arch: None, tmp_path: Any) -> None:
    """The plain Qwen3.5 checkpoint under the toy's name: its gate_proj tensors have no parameter to go to."""
    path = write_tiny_checkpoint(str(tmp_path / "gated"))
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump({**raw, "architectures": [TOY_ARCH]}, f)
    with pytest.raises(ValueError, match=r"unexpected tensor.*mlp\.gate_proj"):
        make_llm(path)

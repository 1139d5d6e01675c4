"""Random-weight checkpoints of real model shapes, for GPU checks and benchmarks (no download needed).

    python benchmarks/shapes.py --shape 2b --out /tmp/qwen35-2b-shape [--device cuda]
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

SHAPE_2B: dict[str, Any] = dict(
    vocab_size=248320, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
    num_attention_heads=8, num_key_value_heads=2, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, partial_rotary_factor=0.25, tie_word_embeddings=True, max_position_embeddings=32768,
)
SHAPES = {"2b": SHAPE_2B}


def write_random_checkpoint(path: str, shape: dict[str, Any], device: str = "cuda", seed: int = 0) -> int:
    """Write transformers' Qwen3_5ForCausalLM with random bf16 weights; returns the parameter count.

    transformers' init leaves the zero-centred norms at identity; they are spread a little so that a kernel that
    ignores a norm weight shows.
    """
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(**shape, layer_types=None)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3_5ForCausalLM(cfg).to(torch.bfloat16)
    zero_centred = ("layernorm.weight", "q_norm.weight", "k_norm.weight", "model.norm.weight")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(zero_centred):
                p.normal_(0.0, 0.1)
    model.save_pretrained(path)
    n = sum(p.numel() for p in model.parameters())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="2b")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    n = write_random_checkpoint(args.out, SHAPES[args.shape], args.device)
    print(f"wrote {args.shape} shape ({n / 1e9:.2f} B parameters) to {args.out}")


if __name__ == "__main__":
    main()

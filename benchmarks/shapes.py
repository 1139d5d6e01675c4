"""Random-weight checkpoints of real model shapes, for GPU checks and benchmarks (no download needed).

    python benchmarks/shapes.py --shape 2b --out /tmp/qwen35-2b-shape [--device cuda] [--mtp] [--init spread|stable]

``--mtp`` adds one random multi-token-prediction layer (``mtp.*`` in a shard of its own, listed in the index;
``mtp_num_hidden_layers`` in config.json), as Qwen3.5 checkpoints carry it. ``--config-only`` writes config.json
alone, for ``--load-format dummy`` (random weights made at load: shapes whose checkpoints do not fit on disk).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

SHAPE_2B: dict[str, Any] = dict(
    vocab_size=248320, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
    num_attention_heads=8, num_key_value_heads=2, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, partial_rotary_factor=0.25, tie_word_embeddings=True, max_position_embeddings=32768,
)
SHAPES = {"2b": SHAPE_2B}


def write_random_checkpoint(path: str, shape: dict[str, Any], device: str = "cuda", seed: int = 0,
                            mtp: bool = False) -> int:
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
    if mtp:
        n += add_random_mtp(path, cfg, seed)
    return n


def write_spread_checkpoint(path: str, shape: dict[str, Any], seed: int = 0, mtp: bool = False,
                            embed_std: float | None = None) -> int:
    """The shape with the test checkpoints' initialisation (hyserve.testing: activations O(1), logits spread wide),
    bf16, sharded. ``embed_std`` rescales the (tied) embedding to that standard deviation.

    Deep random models are chaotic: with this init at 24 layers, greedy outputs in bf16 and float32 part within a
    few tokens (on the CPU, 1-6 tokens; median top-2 margin 0.7 nats), so bf16 rounding differences between two
    paths that are equal in exact arithmetic (one-token decode, a multi-token verify pass) change greedy outputs.
    With ``embed_std=1.0`` the residual stream is dominated by the current token's embedding and, the embedding
    being tied, every token predicts itself with a margin of tens of nats: greedy output is stable under rounding
    (it repeats the last prompt token), which benchmarks that replay a greedy continuation in bf16 need. The
    arithmetic of a step does not depend on the weights' values, so the timing is that of any such model."""
    from hyserve.testing import write_tiny_checkpoint

    cfg = dict(shape)
    n_layers = cfg.pop("num_hidden_layers")
    rope = {"rope_type": "default", "rope_theta": 10_000_000.0,
            "partial_rotary_factor": cfg.pop("partial_rotary_factor")}
    tie = cfg.pop("tie_word_embeddings")
    types = (["linear_attention"] * 3 + ["full_attention"]) * (n_layers // 4)
    write_tiny_checkpoint(path, layer_types=types, tie_word_embeddings=tie, sharded=True, with_mtp=mtp, seed=seed,
                          dtype=torch.bfloat16, rope_parameters=rope, **cfg)
    with open(os.path.join(path, "model.safetensors.index.json"), encoding="utf-8") as f:
        index = json.load(f)
    if embed_std is not None:
        from safetensors.torch import load_file, save_file

        name = "model.embed_tokens.weight"
        shard = os.path.join(path, index["weight_map"][name])
        tensors = load_file(shard)
        emb = tensors[name].float()
        tensors[name] = (emb * (embed_std / emb.std())).to(torch.bfloat16).contiguous()
        save_file(tensors, shard, metadata={"format": "pt"})
    return int(index["metadata"]["total_size"]) // 2


def add_random_mtp(path: str, cfg: Any, seed: int) -> int:
    """Add ``mtp.*`` tensors (one layer, random bf16) as ``mtp.safetensors`` and list every tensor in the index."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from hyserve.testing import init_tensor, mtp_shapes

    gen = torch.Generator().manual_seed(seed + 1)
    tensors = {name: init_tensor(name, shape, gen).to(torch.bfloat16).contiguous()
               for name, shape in mtp_shapes(cfg).items()}
    save_file(tensors, os.path.join(path, "mtp.safetensors"), metadata={"format": "pt"})
    index_path = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):  # a lone model.safetensors is read without the index: make it a shard
        os.replace(single, os.path.join(path, "model-main.safetensors"))
        with safe_open(os.path.join(path, "model-main.safetensors"), framework="pt") as f:
            index = {"metadata": {}, "weight_map": dict.fromkeys(f.keys(), "model-main.safetensors")}
    else:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
    index["weight_map"].update(dict.fromkeys(tensors, "mtp.safetensors"))
    with open(index_path, "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
    config_path = os.path.join(path, "config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    config["mtp_num_hidden_layers"] = 1
    if isinstance(config.get("text_config"), dict):  # the VLM form: engines read the text model's field
        config["text_config"]["mtp_num_hidden_layers"] = 1
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return sum(t.numel() for t in tensors.values())


def write_config_only(path: str, shape: dict[str, Any], mtp: bool = False) -> None:
    """config.json of ``shape`` (Qwen3_5ForCausalLM, bf16), with one MTP layer declared when ``mtp``."""
    from transformers import Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(**shape, layer_types=None, dtype="bfloat16")
    if mtp:
        cfg.mtp_num_hidden_layers = 1
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    cfg.save_pretrained(path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="2b")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--mtp", action="store_true", help="add one random MTP layer (mtp.* tensors)")
    ap.add_argument("--init", choices=("transformers", "spread", "stable"), default="transformers",
                    help="transformers: its own init (near-flat logits); spread: the test checkpoints' init (wide "
                         "logits); stable: spread with a dominant embedding (greedy output stable under bf16 "
                         "rounding, for benchmarks that replay a greedy continuation)")
    ap.add_argument("--config-only", action="store_true",
                    help="config.json alone, for hyserve's --load-format dummy (no weights written)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.config_only:
        write_config_only(args.out, SHAPES[args.shape], mtp=args.mtp)
        print(f"wrote the {args.shape} shape's config.json to {args.out} (load it with --load-format dummy)")
        return
    if args.init in ("spread", "stable"):
        n = write_spread_checkpoint(args.out, SHAPES[args.shape], mtp=args.mtp,
                                    embed_std=1.0 if args.init == "stable" else None)
    else:
        n = write_random_checkpoint(args.out, SHAPES[args.shape], args.device, mtp=args.mtp)
    what = f"{args.shape} shape" + (" with an MTP layer" if args.mtp else "")
    print(f"wrote {what} ({n / 1e9:.2f} B parameters) to {args.out}")


if __name__ == "__main__":
    main()

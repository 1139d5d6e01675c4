"""Checkpoint files as real releases lay them out, family-neutral: safetensors weights in one file or in shards with
their index, JSON files, and reading every tensor back by its on-disk name."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def save_weights(path: str, tensors: dict[str, torch.Tensor], *, sharded: bool) -> None:
    """model.safetensors, or three shards and model.safetensors.index.json (names spread round-robin)."""
    if not sharded:
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return
    names = sorted(tensors)
    n_shards = 3
    weight_map: dict[str, str] = {}
    for i in range(n_shards):
        shard = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::n_shards]}
        save_file(part, os.path.join(path, shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_json(os.path.join(path, "model.safetensors.index.json"), index)



def write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def read_checkpoint_tensors(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of a written checkpoint, by its on-disk name (for tests comparing loaded weights)."""
    path = os.fspath(path)
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(os.path.join(path, name), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 (safe_open is not a dict)
    return out


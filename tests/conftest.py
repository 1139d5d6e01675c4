"""Shared test setup: tiny checkpoints written once per session, one CPU thread (tiny matmuls run fastest so, and a
2-core CI machine is not oversubscribed)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)

from hyserve.testing import load_reference_model, write_tiny_checkpoint  # noqa: E402

LAYER_PATTERNS = {
    "gdn3_attn1": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "attn_first": ["full_attention", "linear_attention", "linear_attention", "linear_attention"],
    "attn_last_gdn_run": ["linear_attention"] * 5 + ["full_attention"],
    "attn_both_ends": ["full_attention", "linear_attention", "linear_attention", "full_attention"],
}


class CheckpointCache:
    """Writes each (form, pattern, ...) checkpoint once and keeps its transformers reference model."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._paths: dict[tuple, str] = {}
        self._refs: dict[str, object] = {}

    def get(self, form: str = "causal", pattern: str = "gdn3_attn1", **kw: object) -> str:
        key = (form, pattern, tuple(sorted(kw.items())))
        if key not in self._paths:
            path = os.path.join(self.root, f"ckpt{len(self._paths)}")
            write_tiny_checkpoint(path, form=form, layer_types=LAYER_PATTERNS[pattern], **kw)  # type: ignore[arg-type]
            self._paths[key] = path
        return self._paths[key]

    def reference(self, path: str):
        if path not in self._refs:
            self._refs[path] = load_reference_model(path)
        return self._refs[path]


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> CheckpointCache:
    return CheckpointCache(str(tmp_path_factory.mktemp("ckpts")))

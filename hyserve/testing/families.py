"""The families the tests write checkpoints of, and the cache that writes each checkpoint once per session.

A family's test support is a ``FamilyCheckpoints``: how to write a tiny random checkpoint of it (``write(path, **kw)``,
the real release's layout) and how to load the independent reference (transformers' own model classes) from that
directory. Qwen3.5 is registered here; a new family registers its own entry from its own module
(``register_family``), and every cached-checkpoint test can then ask ``CheckpointCache.get(family=...)`` for it.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hyserve.testing.qwen3_5 import load_reference_model, write_tiny_checkpoint

# Qwen3.5 layer patterns the tests run: the attention layer last, first, after a run of five GDN layers, at both ends.
LAYER_PATTERNS = {
    "gdn3_attn1": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "attn_first": ["full_attention", "linear_attention", "linear_attention", "linear_attention"],
    "attn_last_gdn_run": ["linear_attention"] * 5 + ["full_attention"],
    "attn_both_ends": ["full_attention", "linear_attention", "linear_attention", "full_attention"],
}


@dataclass(frozen=True)
class FamilyCheckpoints:
    """One family's tiny checkpoints: ``write(path, layer_types=..., **kw)`` writes one and returns its path;
    ``reference(path)`` loads the independent reference model (float32, CPU, eval); ``layer_patterns`` names the
    layer orders its tests run."""

    name: str
    write: Callable[..., str]
    reference: Callable[[str], Any]
    layer_patterns: dict[str, list[str]]


FAMILIES: dict[str, FamilyCheckpoints] = {}


def register_family(family: FamilyCheckpoints) -> FamilyCheckpoints:
    """Add a family's test support (a name registered twice must be the same entry)."""
    old = FAMILIES.setdefault(family.name, family)
    if old != family:
        raise ValueError(f"test family {family.name!r} is already registered differently")
    return family


QWEN3_5 = register_family(FamilyCheckpoints("qwen3_5", write_tiny_checkpoint, load_reference_model, LAYER_PATTERNS))


class CheckpointCache:
    """Writes each (family, form, pattern, ...) checkpoint once under ``root`` and keeps its reference model, and
    the results of deterministic runs on its checkpoints that several tests compare with (``memo``)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._paths: dict[tuple, str] = {}
        self._refs: dict[str, object] = {}
        self._family_of: dict[str, FamilyCheckpoints] = {}
        self._memo: dict[tuple, Any] = {}

    def memo(self, key: tuple, compute: Callable[[], Any]) -> Any:
        """A copy of ``compute()``'s result, computed once per session for ``key``: a reference run (the one-process
        engine on a scenario) that tests of several files compare with. ``key`` must name everything the run depends
        on besides this cache's checkpoints (``hyserve.testing.engine.run_key``)."""
        if key not in self._memo:
            self._memo[key] = compute()
        return copy.deepcopy(self._memo[key])

    def get(self, form: str = "causal", pattern: str = "gdn3_attn1", *, family: str = "qwen3_5", **kw: object) -> str:
        fam = FAMILIES[family]
        key = (family, form, pattern, tuple(sorted(kw.items())))
        if key not in self._paths:
            path = os.path.join(self.root, f"ckpt{len(self._paths)}")
            fam.write(path, form=form, layer_types=fam.layer_patterns[pattern], **kw)
            self._paths[key] = path
            self._family_of[path] = fam
        return self._paths[key]

    def reference(self, path: str) -> Any:
        if path not in self._refs:
            self._refs[path] = self._family_of.get(path, QWEN3_5).reference(path)
        return self._refs[path]

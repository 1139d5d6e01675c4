"""Architecture name (config.json ``architectures[0]``) -> where its family lives: the model class, the parser of
its config.json and its draft head, each named as ``(module, name)`` and imported on first use.

Adding a family is one ``FamilyEntry`` line in ``_FAMILIES`` (docs/adding_a_model.md); the runner builds whatever
class the checkpoint's architecture names, and plans its caches from the specs its layers declare
(``hyserve.model.base``). A checkpoint's ``ModelConfig`` is read here too (``load_model_config``), since only the
registry knows which family's parser reads its config.json.
"""

from __future__ import annotations

import importlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hyserve.cache.specs import CacheSpecs
from hyserve.config import ModelConfig
from hyserve.layers.quantization import parse_quantization_config
from hyserve.layers.quantization.modelopt import HF_QUANT_CONFIG, from_hf_quant_config
from hyserve.model.base import CausalLM


@dataclass(frozen=True, slots=True)
class DraftHead:
    """A family's multi-token-prediction head: ``build(cfg)``, then ``load(head, checkpoint's draft tensors)``.
    Its KV-caching layers declare their specs like the model's (``hyserve.model.base.KVCacheLayer``)."""

    build: Callable[[ModelConfig], nn.Module]
    load: Callable[[nn.Module, dict[str, torch.Tensor]], None]


# (module, name): an object of a module, imported when first asked for.
Ref = tuple[str, str]


def _resolve(ref: Ref) -> Any:
    module, name = ref
    return getattr(importlib.import_module(module), name)


def _ref(obj: Any) -> Ref:
    return obj.__module__, obj.__qualname__


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """One architecture: its model class and config parser (and draft head, if the family has one) by reference,
    so that the registry imports no family before a checkpoint names it."""

    architecture: str
    model: Ref
    parser: Ref
    # config.json ``model_type`` values this architecture is read from; the first is assumed when a config names a
    # model type but no architecture.
    model_types: tuple[str, ...]
    # The draft head's (module, head class, loader function), all three in one module.
    draft: tuple[str, str, str] | None = None

    @property
    def model_class(self) -> Callable[[ModelConfig], CausalLM]:
        return _resolve(self.model)  # type: ignore[no-any-return]

    @property
    def parse_config(self) -> Callable[[dict[str, Any]], ModelConfig]:
        return _resolve(self.parser)  # type: ignore[no-any-return]

    @property
    def draft_head(self) -> DraftHead | None:
        if self.draft is None:
            return None
        module, build, load = self.draft
        return DraftHead(_resolve((module, build)), _resolve((module, load)))


_QWEN3_5 = ("hyserve.model.qwen3_5", "Qwen3_5ForCausalLM")
_QWEN3_5_PARSER = ("hyserve.model.qwen3_5_config", "parse_qwen3_5_config")
_QWEN3_5_MTP = ("hyserve.model.mtp", "MTPHead", "load_mtp_weights")
_QWEN3_5_MOE = ("hyserve.model.qwen3_5_moe", "Qwen3_5MoeForCausalLM")
_QWEN3_5_MOE_PARSER = ("hyserve.model.qwen3_5_moe_config", "parse_qwen3_5_moe_config")
_QWEN3_5_MOE_MTP = ("hyserve.model.qwen3_5_moe", "Qwen3_5MoeMTPHead", "load_moe_mtp_weights")
_QWEN3_NEXT = ("hyserve.model.qwen3_next", "Qwen3NextForCausalLM")
_QWEN3_NEXT_PARSER = ("hyserve.model.qwen3_next_config", "parse_qwen3_next_config")
_QWEN3_NEXT_MTP = ("hyserve.model.qwen3_next", "Qwen3NextMTPHead", "load_mtp_weights")
_QWEN4_EXP = ("hyserve.model.qwen4_exp", "Qwen4ExpForCausalLM")
_QWEN4_EXP_PARSER = ("hyserve.model.qwen4_exp_config", "parse_qwen4_exp_config")
_QWEN4_EXP_MTP = ("hyserve.model.qwen4_exp_mtp", "Qwen4ExpMTPHead", "load_qwen4_exp_mtp_weights")
_NEMOTRON_H = ("hyserve.model.nemotron_h", "NemotronHForCausalLM")
_NEMOTRON_H_PARSER = ("hyserve.model.nemotron_h_config", "parse_nemotron_h_config")
_GRANITE_H = ("hyserve.model.granitemoehybrid", "GraniteMoeHybridForCausalLM")
_GRANITE_H_PARSER = ("hyserve.model.granitemoehybrid_config", "parse_granitemoehybrid_config")
_FALCON_H1 = ("hyserve.model.falcon_h1", "FalconH1ForCausalLM")
_FALCON_H1_PARSER = ("hyserve.model.falcon_h1_config", "parse_falcon_h1_config")
# Both checkpoint forms of each family parse from either model_type (text fields at top level or under text_config).
_FAMILIES = (
    ModelEntry("Qwen3_5ForConditionalGeneration", _QWEN3_5, _QWEN3_5_PARSER, ("qwen3_5", "qwen3_5_text"), _QWEN3_5_MTP),
    ModelEntry("Qwen3_5ForCausalLM", _QWEN3_5, _QWEN3_5_PARSER, ("qwen3_5_text", "qwen3_5"), _QWEN3_5_MTP),
    ModelEntry("Qwen3_5MoeForConditionalGeneration", _QWEN3_5_MOE, _QWEN3_5_MOE_PARSER,
               ("qwen3_5_moe", "qwen3_5_moe_text"), _QWEN3_5_MOE_MTP),
    ModelEntry("Qwen3_5MoeForCausalLM", _QWEN3_5_MOE, _QWEN3_5_MOE_PARSER, ("qwen3_5_moe_text", "qwen3_5_moe"),
               _QWEN3_5_MOE_MTP),
    ModelEntry("Qwen3NextForCausalLM", _QWEN3_NEXT, _QWEN3_NEXT_PARSER, ("qwen3_next",), _QWEN3_NEXT_MTP),
    # Qwen4-Exp's MTP head reads the wide residual (hyserve.model.qwen4_exp_mtp).
    ModelEntry("Qwen4ExpForConditionalGeneration", _QWEN4_EXP, _QWEN4_EXP_PARSER, ("qwen4_exp", "qwen4_exp_text"),
               _QWEN4_EXP_MTP),
    ModelEntry("Qwen4ExpForCausalLM", _QWEN4_EXP, _QWEN4_EXP_PARSER, ("qwen4_exp_text", "qwen4_exp"), _QWEN4_EXP_MTP),
    ModelEntry("NemotronHForCausalLM", _NEMOTRON_H, _NEMOTRON_H_PARSER, ("nemotron_h",)),
    ModelEntry("GraniteMoeHybridForCausalLM", _GRANITE_H, _GRANITE_H_PARSER, ("granitemoehybrid",)),
    ModelEntry("FalconH1ForCausalLM", _FALCON_H1, _FALCON_H1_PARSER, ("falcon_h1",)),
)
_REGISTRY: dict[str, ModelEntry] = {e.architecture: e for e in _FAMILIES}


def register_model(architecture: str, model_class: Callable[[ModelConfig], CausalLM],
                   parse_config: Callable[[dict[str, Any]], ModelConfig], model_types: tuple[str, ...],
                   draft_head: DraftHead | None = None) -> None:
    """Register a family at run time (tests), from objects already imported."""
    draft = None
    if draft_head is not None:
        (module, build), (load_module, load) = _ref(draft_head.build), _ref(draft_head.load)
        if load_module != module:
            raise ValueError("a draft head's class and its loader must live in one module")
        draft = (module, build, load)
    _REGISTRY[architecture] = ModelEntry(architecture, _ref(model_class), _ref(parse_config), model_types, draft)


def unregister_model(architecture: str) -> None:
    _REGISTRY.pop(architecture, None)


def supported_architectures() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def unsupported(name: object, model_type: object) -> ValueError:
    return ValueError(f"unsupported architecture {name!r} (model_type={model_type!r}); "
                      f"supported: {', '.join(supported_architectures())}")


def resolve_architecture(architecture: str | None, model_type: object) -> ModelEntry:
    """The entry for a config.json's ``architectures[0]`` (or, when it names none, its ``model_type``)."""
    if architecture is not None:
        entry = _REGISTRY.get(architecture)
        if entry is None or model_type not in entry.model_types:
            raise unsupported(architecture, model_type)
        return entry
    for entry in _REGISTRY.values():
        if entry.model_types and entry.model_types[0] == model_type:
            return entry
    raise unsupported(model_type or "<none>", model_type)


def parse_model_config(raw: dict[str, Any], quantization: str | None = None) -> ModelConfig:
    """Parse a config.json with its architecture's registered parser; unknown architectures are refused with
    the supported list. Its ``quantization_config``, with the ``quantization`` engine argument applied, becomes
    ``quantization`` (unsupported schemes are refused here, naming them)."""
    architectures = raw.get("architectures") or []
    entry = resolve_architecture(architectures[0] if architectures else None, raw.get("model_type"))
    cfg = entry.parse_config(raw)
    cfg.quantization = parse_quantization_config(raw, cfg.architecture, quantization)
    return cfg


def load_model_config(model_dir: str, quantization: str | None = None) -> ModelConfig:
    """The ``ModelConfig`` of the checkpoint in ``model_dir`` (its config.json, ``parse_model_config``; an older
    ModelOpt checkpoint's ``hf_quant_config.json`` stands for a missing ``quantization_config``)."""
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(missing_model_dir_message(model_dir))
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config.json not found in model directory {model_dir!r}")
    with open(path, encoding="utf-8") as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: invalid JSON ({e})") from e
    hf_path = os.path.join(model_dir, HF_QUANT_CONFIG)
    if os.path.isfile(hf_path) and raw.get("quantization_config") is None \
            and (raw.get("text_config") or {}).get("quantization_config") is None:
        # an older ModelOpt checkpoint: its quantization in hf_quant_config.json beside config.json
        with open(hf_path, encoding="utf-8") as f:
            try:
                hf = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{hf_path}: invalid JSON ({e})") from e
        raw = {**raw, "quantization_config": from_hf_quant_config(hf)}
    return parse_model_config(raw, quantization)


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def missing_model_dir_message(model_dir: str) -> str:
    """hyserve loads local directories only: a hub id (``Qwen/Qwen3.5-2B``) is not downloaded, so say so."""
    msg = f"model directory not found: {model_dir!r}"
    if _HUB_ID.fullmatch(model_dir):
        msg += (" (hyserve loads only local checkpoint directories and downloads nothing; if this is a Hugging Face"
                f" hub id, download it first, e.g. `hf download {model_dir} --local-dir DIR`, and pass DIR)")
    else:
        msg += " (hyserve loads only local checkpoint directories and downloads nothing)"
    return msg


def model_class(cfg: ModelConfig) -> Callable[[ModelConfig], CausalLM]:
    """The class that builds the model ``cfg`` (as parsed by its architecture's parser) describes."""
    entry = _REGISTRY.get(cfg.architecture)
    if entry is None:
        raise unsupported(cfg.architecture, None)
    return entry.model_class


def draft_head(cfg: ModelConfig) -> DraftHead:
    """The MTP head of the family ``cfg`` belongs to; refused for families without one."""
    model_class(cfg)  # unknown architectures: the usual message
    head = _REGISTRY[cfg.architecture].draft_head
    if head is None:
        raise ValueError(f"architecture {cfg.architecture!r} has no MTP head; use another speculative method")
    return head


def cache_specs_for(cfg: ModelConfig, dtype: torch.dtype) -> CacheSpecs:
    """The cache specs of the model ``cfg`` describes, from its layers built on the meta device (no memory)."""
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    return model.cache_specs(dtype)

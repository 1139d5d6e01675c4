"""NVIDIA ModelOpt FP8 checkpoints (``quant_method: "modelopt"``, ``quant_algo: "FP8"``), the format of NVIDIA's own
FP8 releases (Nemotron-H FP8, Nemotron 3 FP8).

The config (docs/fp8_facts.md section 11), in config.json's ``quantization_config``::

    {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8" or null,
     "exclude_modules": ["lm_head", "*mixer.conv1d*", ...], "producer": {"name": "modelopt", "version": ...}}

or, in older checkpoints, in ``hf_quant_config.json`` beside config.json as ``{"producer": ..., "quantization":
{"quant_algo": ..., "kv_cache_quant_algo": ..., "exclude_modules": [...]}}`` (``hyserve.model.registry`` folds that
file into the config when config.json has no ``quantization_config``).

Each quantized linear layer stores ``weight`` float8_e4m3fn, ``weight_scale`` (one float32 value per tensor) and
``input_scale`` (one float32 value: the static activation scale), which is compressed-tensors' FP8 scheme
(weights per tensor, activations static per tensor): :class:`hyserve.layers.quantization.fp8.Fp8Scheme`
``("tensor", "tensor")``. ``exclude_modules`` entries are ``fnmatch`` wildcards (``*``, ``?``, ``[...]``, case
sensitive) over the whole module name in the checkpoint's own naming, as vLLM's ``ModelOptFp8Config`` matches them;
an entry naming a module also excludes the linear layers inside it (``backbone.layers.3.mixer`` excludes its
``in_proj``). vLLM also takes an entry found anywhere inside a name as a match (a rule for older checkpoints);
hyserve does not (``layers.1`` would then exclude ``layers.11``).

``kv_cache_quant_algo: "FP8"``: the checkpoint carries the attention layers' ``k_proj.k_scale`` / ``v_proj.v_scale``
(or ``k_scale`` / ``v_scale``); the loader reads them as it reads compressed-tensors' and an FP8 cache
(``--kv-cache-dtype fp8``) uses them; the default cache dtype stays what it is.

Nemotron 3's routed experts in FP8 (NVIDIA's releases): each expert's ``up_proj`` / ``down_proj`` with its own
``weight_scale`` and ``input_scale``; the layer quantizes activations with the maximum over its experts of each
projection's input scales, as vLLM's ModelOpt FP8 MoE does (``hyserve.layers.sigmoid_moe.UngatedExperts``).

Refused, naming them: every other ``quant_algo`` (``NVFP4``, ``FP8_PB_WO``, ``FP8_PER_CHANNEL_PER_TOKEN``,
``W4A8_AWQ``, ``MIXED_PRECISION``, ...), another ``kv_cache_quant_algo``, unknown fields, and the gated experts of
other families left in FP8 (static per-tensor input scales are refused for them,
``hyserve.layers.quantization.experts``): such a checkpoint loads when ``exclude_modules`` names its experts.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

from hyserve.layers.quantization.base import UNQUANTIZED, LinearMethod, QuantizationConfig
from hyserve.layers.quantization.fp8 import Fp8LinearMethod, Fp8Scheme
from hyserve.layers.quantization.matching import CheckpointNames

QUANT_METHOD = "modelopt"
QUANT_ALGO = "FP8"
HF_QUANT_CONFIG = "hf_quant_config.json"
_CONFIG_KEYS = ("quant_method", "quant_algo", "kv_cache_quant_algo", "exclude_modules", "producer")
_KV_CACHE_ALGOS = (None, "FP8")
SCHEME = Fp8Scheme("tensor", "tensor")


def excluded(entries: tuple[str, ...], forms: tuple[str, ...]) -> bool:
    """Whether an ``exclude_modules`` entry names a module known by ``forms``: an ``fnmatch`` wildcard over the whole
    name, or the name of a module holding it."""
    return any(fnmatch.fnmatchcase(n, e) or n.startswith(e + ".") for e in entries for n in forms)


@dataclass(frozen=True, slots=True)
class ModelOptFp8Config(QuantizationConfig):
    exclude: tuple[str, ...]
    names: CheckpointNames
    kv_cache_quant_algo: str | None = None

    method_name = QUANT_METHOD

    def linear_method(self, name: str) -> LinearMethod:
        if excluded(self.exclude, self.names.forms(name)):
            return UNQUANTIZED
        return Fp8LinearMethod(SCHEME)

    def describe(self) -> str:
        kv = ", FP8 KV-cache scales" if self.kv_cache_quant_algo else ""
        return f"ModelOpt FP8 ({SCHEME.describe()}{kv})"


def parse_modelopt(qc: dict[str, Any], names: CheckpointNames) -> ModelOptFp8Config:
    unknown = sorted(set(qc) - set(_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"ModelOpt quantization_config: unsupported field(s) {', '.join(map(repr, unknown))} "
                         f"(supported fields: {', '.join(_CONFIG_KEYS)})")
    algo = qc.get("quant_algo")
    if not isinstance(algo, str) or algo.upper() != QUANT_ALGO:
        raise ValueError(f"ModelOpt quant_algo {algo!r} is not supported; supported: {QUANT_ALGO!r} (per-tensor "
                         "weight scales, static per-tensor input scales)")
    kv = qc.get("kv_cache_quant_algo")
    if isinstance(kv, str):
        kv = kv.upper()
    if kv not in _KV_CACHE_ALGOS:
        raise ValueError(f"ModelOpt kv_cache_quant_algo {qc['kv_cache_quant_algo']!r} is not supported; supported: "
                         "null, 'FP8' (the checkpoint's k / v scales, used by --kv-cache-dtype fp8)")
    exclude = qc.get("exclude_modules") or []
    if not isinstance(exclude, list) or not all(isinstance(e, str) for e in exclude):
        raise ValueError(f"ModelOpt exclude_modules must be a list of strings (got {exclude!r})")
    return ModelOptFp8Config(tuple(exclude), names, kv)


def from_hf_quant_config(hf: Any) -> dict[str, Any]:
    """The ``quantization_config`` an older checkpoint's ``hf_quant_config.json`` (``{"producer": ...,
    "quantization": {...}}``) stands for."""
    if not isinstance(hf, dict) or not isinstance(hf.get("quantization"), dict):
        raise ValueError(f"{HF_QUANT_CONFIG}: expected an object with a 'quantization' object (got {hf!r})")
    unknown = sorted(set(hf) - {"producer", "quantization"})
    if unknown:
        raise ValueError(f"{HF_QUANT_CONFIG}: unsupported field(s) {', '.join(map(repr, unknown))} (supported "
                         "fields: producer, quantization)")
    qc: dict[str, Any] = {"quant_method": QUANT_METHOD, **hf["quantization"]}
    if "producer" in hf:
        qc["producer"] = hf["producer"]
    return qc

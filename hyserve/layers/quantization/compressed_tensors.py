"""compressed-tensors FP8 checkpoints (``quant_method: "compressed-tensors"``, ``format: "float-quantized"``).

The config's model, as the compressed-tensors project defines it (docs/fp8_facts.md sections 2-5):
``config_groups`` of schemes (``targets``, ``weights``, ``input_activations``, ``output_activations``, ``format``) or
preset names with their targets, an ``ignore`` list, ``kv_cache_scheme``. A linear layer takes the scheme of the
group whose ``targets`` match it, unless an ``ignore`` entry matches it (ignore wins); a layer no group targets stays
in the model dtype. ``targets`` and ``ignore`` entries: exact names, ``re:`` patterns, the class name ``Linear``.

Supported schemes (FP8 e4m3, symmetric; the checkpoint's tensors in parentheses):

* weights ``channel`` (``weight_scale`` ``(out, 1)``) or ``tensor`` (``weight_scale`` ``(1,)`` or scalar), with
  input activations dynamic per ``token`` (no stored scale; FP8_DYNAMIC) or static per ``tensor``
  (``input_scale``; FP8);
* weights ``block`` (``weight_scale`` ``(ceil(out / bn), ceil(in / bk))``), with input activations dynamic per
  ``group`` of ``bk`` (FP8_BLOCK) or per ``token``.

Every field the format defines is read: one hyserve cannot honour (another type or bit width, an asymmetric scheme,
activation ordering, output activations, sparsity, transforms, a KV-cache scheme) is refused with its name, and so is
any key the format does not define. ``observer`` / ``observer_kwargs`` (how calibration chose the scales),
``global_compression_ratio`` and ``version`` describe how the checkpoint was made and change nothing in loading.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hyserve.layers.quantization.base import UNQUANTIZED, LinearMethod, QuantizationConfig
from hyserve.layers.quantization.fp8 import Fp8LinearMethod, Fp8Scheme
from hyserve.layers.quantization.matching import CheckpointNames, check_entries, matches

QUANT_METHOD = "compressed-tensors"
FORMAT = "float-quantized"
MIXED_FORMAT = "mixed-precision"  # written when groups use different formats: each group's own must then be FORMAT

_CONFIG_KEYS = ("quant_method", "config_groups", "format", "ignore", "kv_cache_scheme", "quantization_status",
                "global_compression_ratio", "version", "sparsity_config", "transform_config")
_SCHEME_KEYS = ("targets", "weights", "input_activations", "output_activations", "format")
_ARGS_KEYS = ("num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic", "actorder",
              "scale_dtype", "zp_dtype", "observer", "observer_kwargs")
_SCALE_DTYPES = (None, "float32", "bfloat16", "float16", "torch.float32", "torch.bfloat16", "torch.float16")

SUPPORTED_SCHEMES = ("weights channel or tensor + activations token (dynamic) or tensor (static); weights block + "
                     "activations group (dynamic, group_size = the block's columns) or token (dynamic)")

_FP8 = {"num_bits": 8, "type": "float", "symmetric": True}
PRESETS: dict[str, dict[str, Any]] = {
    "FP8": {"weights": {**_FP8, "strategy": "tensor"},
            "input_activations": {**_FP8, "strategy": "tensor", "dynamic": False}},
    "FP8_DYNAMIC": {"weights": {**_FP8, "strategy": "channel"},
                    "input_activations": {**_FP8, "strategy": "token", "dynamic": True}},
    "FP8_BLOCK": {"weights": {**_FP8, "strategy": "block", "block_structure": [128, 128]},
                  "input_activations": {**_FP8, "strategy": "group", "group_size": 128, "dynamic": True}},
}


@dataclass(frozen=True, slots=True)
class SchemeGroup:
    name: str
    targets: tuple[str, ...]
    scheme: Fp8Scheme


@dataclass(frozen=True, slots=True)
class CompressedTensorsConfig(QuantizationConfig):
    groups: tuple[SchemeGroup, ...]
    ignore: tuple[str, ...]
    names: CheckpointNames

    method_name = QUANT_METHOD

    def linear_method(self, name: str) -> LinearMethod:
        forms = self.names.forms(name)
        if any(matches(e, forms, regex=True, classes=True) for e in self.ignore):
            return UNQUANTIZED
        hits = [g for g in self.groups if any(matches(t, forms, regex=True, classes=True) for t in g.targets)]
        if not hits:
            return UNQUANTIZED
        if len({g.scheme for g in hits}) > 1:
            raise ValueError(f"quantization_config: {forms[0]} is targeted by config_groups "
                             f"{', '.join(repr(g.name) for g in hits)} with different schemes")
        return Fp8LinearMethod(hits[0].scheme)

    def describe(self) -> str:
        schemes = "; ".join(f"{g.name}: {g.scheme.describe()}" for g in self.groups)
        return f"compressed-tensors FP8 ({schemes})"


def parse_compressed_tensors(qc: dict[str, Any], names: CheckpointNames) -> CompressedTensorsConfig:
    _check_keys(qc, _CONFIG_KEYS, "quantization_config")
    fmt = qc.get("format")
    if fmt not in (FORMAT, MIXED_FORMAT):
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported; supported: {FORMAT!r} (FP8 weights "
                         f"and activations), or {MIXED_FORMAT!r} whose every group is {FORMAT!r}")
    status = qc.get("quantization_status")
    if status not in (None, "compressed"):
        raise ValueError(f"compressed-tensors quantization_status {status!r} is not supported; supported: "
                         "'compressed' (weights saved quantized)")
    _check_kv_cache_scheme(qc.get("kv_cache_scheme"))
    for key in ("sparsity_config", "transform_config"):
        if qc.get(key):
            raise ValueError(f"compressed-tensors {key} is not supported (got {qc[key]!r}); supported: empty")
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list):
        raise ValueError(f"quantization_config.ignore must be a list (got {ignore!r})")
    check_entries(ignore, "ignore", regex=True)
    raw_groups = qc.get("config_groups")
    if not isinstance(raw_groups, dict) or not raw_groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    groups = tuple(_parse_group(name, value, fmt) for name, value in raw_groups.items())
    return CompressedTensorsConfig(groups, tuple(ignore), names)


def _parse_group(name: str, value: Any, top_format: str) -> SchemeGroup:
    if isinstance(value, list):  # a preset name as the group's key, its targets as the value
        preset = PRESETS.get(name.upper())
        if preset is None:
            raise ValueError(f"compressed-tensors preset scheme {name!r} is not supported; supported presets: "
                             f"{', '.join(PRESETS)}")
        value = {"targets": value, **preset}
    if not isinstance(value, dict):
        raise ValueError(f"config_groups.{name} must be a scheme object or a list of targets (got {value!r})")
    where = f"config_groups.{name}"
    _check_keys(value, _SCHEME_KEYS, where)
    group_format = value.get("format")
    if group_format not in (None, FORMAT) or (top_format == MIXED_FORMAT and group_format != FORMAT):
        raise ValueError(f"{where}: format {group_format!r} is not supported; supported: {FORMAT!r}")
    targets = value.get("targets")
    if not isinstance(targets, list) or not targets:
        raise ValueError(f"{where}: targets must be a non-empty list")
    check_entries(targets, f"{where}.targets", regex=True)
    if value.get("output_activations") is not None:
        raise ValueError(f"{where}: output_activations are not supported; supported: null")
    weights = value.get("weights")
    if not isinstance(weights, dict):
        raise ValueError(f"{where}: no weights scheme")
    acts = value.get("input_activations")
    if not isinstance(acts, dict):
        raise ValueError(f"{where}: weight-only quantization (no input_activations) is not supported; supported: "
                         f"{SUPPORTED_SCHEMES}")
    w_strategy, block = _parse_args(weights, f"{where}.weights", weights=True)
    a_strategy, group = _parse_args(acts, f"{where}.input_activations", weights=False)
    combo = (w_strategy, a_strategy)
    if w_strategy == "block":
        assert block is not None
        if a_strategy == "group" and group != block[1]:
            raise ValueError(f"{where}: input_activations group_size {group} differs from the weights' block columns "
                             f"{block[1]}; supported: equal")
        ok = a_strategy in ("group", "token")
    else:
        ok = a_strategy in ("token", "tensor")
    if not ok:
        raise ValueError(f"{where}: weights {combo[0]!r} with input_activations {combo[1]!r} is not supported; "
                         f"supported: {SUPPORTED_SCHEMES}")
    return SchemeGroup(name, tuple(targets), Fp8Scheme(w_strategy, a_strategy, block))


def _parse_args(args: dict[str, Any], where: str, *, weights: bool) -> tuple[str, Any]:
    """``(strategy, block_structure or group_size)`` of one ``QuantizationArgs`` object, refusing what hyserve cannot
    run. The strategy is inferred as compressed-tensors does when null (no group_size: tensor; -1: channel; > 0:
    group)."""
    _check_keys(args, _ARGS_KEYS, where)
    kind, bits = args.get("type", "int"), args.get("num_bits", 8)
    if kind != "float" or bits != 8:
        raise ValueError(f"{where}: {kind}{bits} quantization is not supported; supported: FP8 (type 'float', "
                         "num_bits 8)")
    if args.get("symmetric", True) is not True:
        raise ValueError(f"{where}: asymmetric quantization (symmetric false) is not supported; supported: symmetric")
    if args.get("actorder") not in (None, False):
        raise ValueError(f"{where}: actorder {args['actorder']!r} is not supported; supported: null")
    if args.get("zp_dtype") is not None:
        raise ValueError(f"{where}: zp_dtype {args['zp_dtype']!r} is not supported (FP8 is symmetric); supported: null")
    if args.get("scale_dtype") not in _SCALE_DTYPES:
        raise ValueError(f"{where}: scale_dtype {args['scale_dtype']!r} is not supported; supported: null, float32, "
                         "bfloat16, float16")
    group_size = args.get("group_size")
    strategy = args.get("strategy")
    if strategy is None:
        strategy = "tensor" if group_size is None else ("channel" if group_size == -1 else "group")
    dynamic = args.get("dynamic", False)
    block = args.get("block_structure")
    if weights:
        if strategy not in ("channel", "tensor", "block"):
            raise ValueError(f"{where}: strategy {strategy!r} is not supported for weights; supported: channel, "
                             "tensor, block")
        if dynamic is not False:
            raise ValueError(f"{where}: dynamic {dynamic!r} weights are not supported; supported: false")
        if strategy == "block":
            if isinstance(block, str):  # the legacy "128x128" form
                block = [int(v) for v in block.lower().split("x")]
            if not (isinstance(block, list) and len(block) == 2 and all(isinstance(v, int) and v > 0 for v in block)):
                raise ValueError(f"{where}: block strategy needs block_structure [rows, cols] (got {block!r})")
            return strategy, (block[0], block[1])
        if block is not None or group_size not in (None, -1):
            raise ValueError(f"{where}: strategy {strategy!r} takes no block_structure or group_size")
        return strategy, None
    if block is not None:
        raise ValueError(f"{where}: block_structure is not supported for activations; supported: null")
    if strategy in ("token", "group"):
        if dynamic is not True:
            raise ValueError(f"{where}: {strategy} activations must be dynamic (got dynamic {dynamic!r})")
        if strategy == "group":
            if not isinstance(group_size, int) or group_size <= 0:
                raise ValueError(f"{where}: group activations need a positive group_size (got {group_size!r})")
            return strategy, group_size
        return strategy, None
    if strategy == "tensor":
        if dynamic is not False:
            raise ValueError(f"{where}: dynamic per-tensor activations (dynamic {dynamic!r}) are not supported; "
                             "supported: dynamic per token, or static per tensor")
        return strategy, None
    raise ValueError(f"{where}: strategy {strategy!r} is not supported for activations; supported: token, tensor, "
                     "group")


def _check_keys(obj: dict[str, Any], allowed: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(obj) - set(allowed))
    if unknown:
        raise ValueError(f"{where}: unsupported field(s) {', '.join(map(repr, unknown))} (supported fields: "
                         f"{', '.join(allowed)})")


_KV_SCHEME_SUPPORTED = ("FP8 (num_bits 8, type float), symmetric, static, strategy tensor or attn_head: the "
                        "checkpoint's k_scale / v_scale, used by --kv-cache-dtype fp8")


def _check_kv_cache_scheme(scheme: Any) -> None:
    """A ``kv_cache_scheme`` describes the FP8 KV-cache scales the checkpoint carries on its attention modules
    (``self_attn.k_scale`` / ``v_scale``, read by the loader); refuse the schemes whose scales mean something else."""
    if scheme is None:
        return
    if not isinstance(scheme, dict):
        raise ValueError(f"compressed-tensors kv_cache_scheme must be an object (got {scheme!r})")
    unknown = sorted(set(scheme) - set(_ARGS_KEYS))
    if unknown:
        raise ValueError(f"compressed-tensors kv_cache_scheme: unsupported field(s) {', '.join(map(repr, unknown))}")
    wanted = {"num_bits": (8,), "type": ("float",), "strategy": ("tensor", "attn_head"), "symmetric": (True, None),
              "dynamic": (False, None), "group_size": (None,), "block_structure": (None,), "actorder": (None,)}
    for key, allowed in wanted.items():
        if scheme.get(key) not in allowed:
            raise ValueError(f"compressed-tensors kv_cache_scheme {key}={scheme.get(key)!r} is not supported; "
                             f"supported: {_KV_SCHEME_SUPPORTED}")

"""Load a safetensors checkpoint into a model whose parameter names are the checkpoint's.

The family's config maps the names (``ModelConfig.checkpoint_name``; Qwen3.5's strips ``model.language_model.`` and
moves the vision tower's to ``visual.``), and names the prefix of its draft head's tensors
(``ModelConfig.draft_prefix``, Qwen3.5's ``mtp.``): those are returned to the caller, not loaded into the model.
``visual.X`` tensors are skipped, with one warning giving the count, where the model holds no vision tower (image
input off, or a text-only model). A module that owns stacked tensors loads them itself: a ``MergedLinear``
(one GEMM for several checkpoint tensors) offers its parts' row views under the checkpoint's names, a module with
stacked tensors that checkpoints may also store in pieces offers the pieces' views (``checkpoint_parts``: a
checkpoint holds either the stacked tensor or all of its pieces, e.g. a mixture-of-experts layer's experts fused or
one by one), and a target carrying a ``LoadSpec`` is copied by its own ``load``. A module that computes tensors from
the config that checkpoints may also store (``checkpoint_derived``: Qwen4-Exp's n-gram hash constants) has them
checked against its own values where a checkpoint holds them, never loaded.

Quantized layers (``hyserve.layers.quantization``): a layer the model's quantization config quantizes has FP8
``weight`` and scale targets (``weight_scale``, ``weight_scale_inv``, ``input_scale``), so the header pass checks
each scale's presence and shape like any tensor's; dtypes are checked too: an FP8 checkpoint tensor is never loaded
into a layer that is not quantized (its bytes are not bf16 values), and a quantized layer's weight must be FP8
(online FP8 excepted: it quantizes an unquantized weight as it loads). Targets may carry a ``LoadSpec``
(``hyserve.layers.sharding``): the checkpoint shapes and dtypes it accepts and how it is copied in.

Targets are the model's parameters and persistent buffers (its ``state_dict`` entries), one per distinct tensor,
with each merged projection (:class:`hyserve.layers.linear.MergedLinear`: one GEMM for, e.g., ``in_proj_qkv``,
``in_proj_z``, ``in_proj_b`` and ``in_proj_a``) replaced by its parts' row views under the checkpoint's names:
a tied ``lm_head.weight`` is the embedding itself and is not a target of its own. With
``config.tie_word_embeddings`` a checkpoint may omit ``lm_head.weight``; if it has one anyway it is ignored (as
transformers does: the embedding is the source of the tie), and a model that did not tie its ``lm_head`` gets a copy
of the embedding.

Loading is two passes: the first reads only the safetensors headers and checks every name and shape, so a bad
checkpoint fails with an error naming the problem before any parameter is touched; the second reads one tensor at
a time (``safe_open``) and copies it into its target, converting dtype and device, so peak extra memory is about one
tensor.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from safetensors import safe_open
from tqdm import tqdm

from hyserve.config import ModelConfig
from hyserve.kernels.fp8 import FP8_DTYPE
from hyserve.layers.linear import LinearBase, MergedLinear
from hyserve.layers.sharding import load_spec_of, shard_of
from hyserve.model.base import KVCacheLayer

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
LM_HEAD = "lm_head.weight"
EMBEDDING = "model.embed_tokens.weight"
PROGRESS_MIN_BYTES = 200 * 1024 * 1024
_MAX_LISTED = 5

_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
                "F8_E4M3": 1, "F8_E5M2": 1}
FP8_CHECKPOINT_DTYPE = "F8_E4M3"
# Safetensors' names of torch dtypes (for tensors already read: the MTP head's).
_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64", torch.int32: "I32",
              torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
# Tensors of quantized layers other than the weight (kept in their stored dtype when returned for the MTP head).
SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv", ".input_scale")


# An FP8 KV cache's scales as checkpoints name them, under the attention module: the current compressed-tensors
# names, ModelOpt's k_proj.k_scale / v_proj.v_scale (matched first), the older output scales of k_proj / v_proj, and
# the deprecated kv_scale shared by K and V (docs/fp8_facts.md section 8). Convention: value = stored FP8 x scale.
_KV_SCALE_SUFFIXES = {"k_proj.k_scale": ("k",), "v_proj.v_scale": ("v",),
                      "k_scale": ("k",), "v_scale": ("v",), "kv_scale": ("k", "v"), "k_proj.output_scale": ("k",),
                      "v_proj.output_scale": ("v",)}


def split_kv_scale(name: str) -> tuple[str, tuple[str, ...]] | None:
    """``(attention module name, "k" and/or "v")`` if ``name`` is an FP8 KV-cache scale, else None."""
    for suffix, which in _KV_SCALE_SUFFIXES.items():
        if name.endswith("." + suffix):
            return name[: -len(suffix) - 1], which
    return None


def apply_kv_scale(model: torch.nn.Module, module_name: str, which: tuple[str, ...], tensor: torch.Tensor,
                   ckpt_name: str) -> None:
    layer = model.get_submodule(module_name)
    assert isinstance(layer, KVCacheLayer)
    for w in which:
        layer.set_checkpoint_kv_scale(w, tensor, ckpt_name)


def _is_kv_scale_of(name: str, kv_layers: set[str]) -> bool:
    kv = split_kv_scale(name)
    return kv is not None and kv[0] in kv_layers


def kv_layer_names(model: torch.nn.Module) -> set[str]:
    return {name for name, m in model.named_modules() if isinstance(m, KVCacheLayer)}


@dataclass(slots=True, frozen=True)
class _Entry:
    """One checkpoint tensor: where it is, what it becomes."""

    ckpt_name: str
    file: str
    shape: tuple[int, ...]
    nbytes: int
    target: str | None  # model name to copy into; None for a draft head's tensor (returned, not loaded)
    kv_scale: bool = False  # ``target`` is an FP8 KV-cache scale of an attention layer (``split_kv_scale``)
    derived: bool = False  # ``target`` is a value the model computes from its config (``checkpoint_derived``)


def load_weights(
    model: torch.nn.Module, model_dir: str, config: ModelConfig, *, show_progress: bool | None = None,
    with_draft_head: bool = True,
) -> dict[str, torch.Tensor]:
    """Copy the checkpoint in ``model_dir`` into ``model`` (already on its device and dtype).

    Returns the ``mtp.*`` tensors (checkpoint name -> tensor on the model's device, in the model's dtype except FP8
    weights and quantization scales, which keep theirs) for speculative decoding; empty if the checkpoint has none,
    or without ``with_draft_head`` (then they are not read).
    ``show_progress`` None shows a tqdm bar only for checkpoints over 200 MB. Raises FileNotFoundError for a missing
    directory, weight file or shard, and ValueError for missing/unexpected/duplicate tensors, shape mismatches and
    dtypes that do not fit (FP8 tensors into unquantized layers, unquantized ones into FP8 layers).
    """
    files = checkpoint_files(model_dir)
    targets = _targets(model, config)
    holds = getattr(model, "holds", None)
    parts = checkpoint_parts(model)
    derived = checkpoint_derived(model)
    entries = _plan(files, targets, config, holds if callable(holds) else None, kv_layer_names(model), parts,
                    foreign_parts(model), derived)
    if not with_draft_head:
        entries = [e for e in entries if e.target is not None]
    dest = {**targets, **{name: view for name, (_, view) in parts.items()}}
    device, dtype = _model_device_dtype(model)
    total = sum(e.nbytes for e in entries)
    show = total > PROGRESS_MIN_BYTES if show_progress is None else show_progress
    mtp: dict[str, torch.Tensor] = {}
    with torch.no_grad(), tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                               desc="Loading weights", disable=not show) as bar:
        for entry, tensor in _read(entries):
            if entry.target is None:
                keep = tensor.dtype == FP8_DTYPE or entry.ckpt_name.endswith(SCALE_SUFFIXES) \
                    or split_kv_scale(entry.ckpt_name) is not None
                mtp[entry.ckpt_name] = tensor.to(device=device, dtype=None if keep else dtype)
            elif entry.kv_scale:
                module, which = split_kv_scale(entry.target) or ("", ())
                apply_kv_scale(model, module, which, tensor, entry.ckpt_name)
            elif entry.derived:
                want = derived[entry.target]
                if not torch.equal(tensor.to(want.device, want.dtype), want):
                    raise ValueError(f"{entry.ckpt_name} in the checkpoint ({_short(tensor)}) is not what its "
                                     f"config.json gives ({_short(want)}): a config of another model?")
            else:
                copy_into(dest[entry.target], tensor)
            bar.update(entry.nbytes)
        _fill_untied_lm_head(model, targets, config)
        finish_loading(model)
    return mtp


def safetensors_dtype(tensor: torch.Tensor) -> str:
    """The safetensors name of ``tensor``'s dtype (``F32``, ``BF16``, ``F8_E4M3``, ...)."""
    return _ST_DTYPES[tensor.dtype]


def copy_into(target: torch.Tensor, tensor: torch.Tensor) -> None:
    """Copy checkpoint ``tensor`` (the whole checkpoint tensor) into ``target``: its ``LoadSpec``'s load, else this
    rank's ``Shard`` of it, converted to the target's dtype and device."""
    spec = load_spec_of(target)
    if spec is not None and spec.load is not None:
        spec.load(target.data, tensor)
        return
    shard = shard_of(target)
    part = shard.take(tensor) if shard is not None else tensor
    target.data.copy_(part.reshape(target.shape))


def finish_loading(module: torch.nn.Module) -> None:
    """Once every tensor is in: what quantized layers derive from theirs (their method's
    ``process_weights_after_loading``; a module that is no linear layer, such as stacked experts, may have its own
    ``process_weights_after_loading()``)."""
    for m in module.modules():
        if isinstance(m, LinearBase):
            m.method.process_weights_after_loading(m)
            continue
        own = getattr(m, "process_weights_after_loading", None)
        if callable(own):
            own()


def draft_tensor_dtypes(model_dir: str, config: ModelConfig) -> dict[str, torch.dtype]:
    """The draft head's checkpoint tensors (names under ``config.draft_prefix``) and their dtypes, from the headers
    alone (what ``load_weights`` would return, without reading it)."""
    prefix = config.draft_prefix
    if prefix is None:
        return {}
    by_name = {v: k for k, v in _ST_DTYPES.items()}
    out: dict[str, torch.dtype] = {}
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if name.startswith(prefix):
                    out[name] = by_name.get(f.get_slice(name).get_dtype(), torch.float32)
    return out


def checkpoint_files(model_dir: str) -> list[str]:
    """The safetensors files of a checkpoint: ``model.safetensors``, else the shards of the index json.

    The single file wins when both exist, as in transformers.
    """
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model directory not found: {model_dir!r}")
    single = os.path.join(model_dir, SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index):
        return _index_shards(model_dir, index)
    others = sorted(f for f in os.listdir(model_dir) if f.endswith((".safetensors", ".bin", ".pt", ".gguf")))
    hint = f" (found {', '.join(others[:_MAX_LISTED])}; only safetensors with an index are supported)" if others else ""
    raise FileNotFoundError(f"no safetensors weights in {model_dir!r}: expected {SINGLE_FILE} or {INDEX_FILE}{hint}")


def _index_shards(model_dir: str, index_path: str) -> list[str]:
    with open(index_path, encoding="utf-8") as f:
        try:
            index = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{index_path}: invalid JSON ({e})") from e
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index_path}: no 'weight_map' object")
    shards = sorted(set(weight_map.values()))
    missing = [s for s in shards if not os.path.isfile(os.path.join(model_dir, s))]
    if missing:
        raise FileNotFoundError(
            f"{INDEX_FILE} in {model_dir!r} references shard file(s) that do not exist: {', '.join(missing)}"
        )
    return [os.path.join(model_dir, s) for s in shards]


def checkpoint_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s parameters and persistent buffers in checkpoint terms: one name per distinct tensor (the first
    registered: an alias such as ``mixer`` or a tied ``lm_head`` adds none), and a :class:`MergedLinear`'s tensors
    (weights, and scales when quantized) as its parts' row views under the parts' checkpoint names."""
    distinct: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            distinct[name] = tensor
    merged: dict[int, tuple[str, MergedLinear]] = {}  # a merged projection's tensors -> (its parent's name, it)
    for name, m in module.named_modules():
        if isinstance(m, MergedLinear):
            for tensor in m.state_dict(keep_vars=True).values():
                merged[id(tensor)] = (name.rpartition(".")[0], m)
    out: dict[str, torch.Tensor] = {}
    expanded: set[int] = set()
    for name, tensor in distinct.items():
        owner = merged.get(id(tensor))
        if owner is None:
            out[name] = tensor
            continue
        parent, m = owner
        if id(m) in expanded:
            continue
        expanded.add(id(m))
        prefix = f"{parent}." if parent else ""
        for part_name, view in m.checkpoint_tensors().items():
            out[prefix + part_name] = view
    return out


def checkpoint_derived(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Tensors ``module`` computes from its config that a checkpoint may also hold (name -> the model's value),
    from every submodule with a ``checkpoint_derived()`` method (names relative to it)."""
    out: dict[str, torch.Tensor] = {}
    for prefix, m in module.named_modules():
        offer = getattr(m, "checkpoint_derived", None)
        if callable(offer):
            for name, value in offer().items():
                out[f"{prefix}.{name}" if prefix else name] = value
    return out


def _short(t: torch.Tensor) -> str:
    values = t.reshape(-1)[:4].tolist()
    return f"{list(t.shape)} starting {values}"


def checkpoint_parts(module: torch.nn.Module) -> dict[str, tuple[str, torch.Tensor]]:
    """The pieces under which a checkpoint may store ``module``'s stacked tensors instead: piece name -> (the
    stacked tensor's name, the piece's view of it), from every submodule with a ``checkpoint_parts()`` method."""
    out: dict[str, tuple[str, torch.Tensor]] = {}
    for name, m in module.named_modules():
        offer = getattr(m, "checkpoint_parts", None)
        if callable(offer):
            prefix = f"{name}." if name else ""
            for part, (whole, view) in offer().items():
                out[prefix + part] = (prefix + whole, view)
    return out


def foreign_parts(module: torch.nn.Module) -> set[str]:
    """The checkpoint pieces other ranks hold (an expert-parallel rank's MoE layers hold only their experts), from
    every submodule with a ``foreign_parts()`` method: the loader skips them."""
    out: set[str] = set()
    for name, m in module.named_modules():
        offer = getattr(m, "foreign_parts", None)
        if callable(offer):
            prefix = f"{name}." if name else ""
            out.update(prefix + part for part in offer())
    return out


def parts_given(parts: dict[str, tuple[str, torch.Tensor]], given: set[str]) -> dict[str, tuple[str, torch.Tensor]]:
    """The pieces (of ``parts``) among the checkpoint's names ``given``: each stacked tensor must come whole or in
    all of its pieces, never both."""
    by_whole: dict[str, list[str]] = {}
    for part, (whole, _) in parts.items():
        by_whole.setdefault(whole, []).append(part)
    out: dict[str, tuple[str, torch.Tensor]] = {}
    for whole, pieces in by_whole.items():
        got = [p for p in pieces if p in given]
        if not got:
            continue
        if whole in given:
            raise ValueError(f"checkpoint has both {whole!r} and its pieces ({got[0]!r}, ...)")
        if len(got) < len(pieces):
            missing = [p for p in pieces if p not in given]
            raise ValueError(f"missing tensor(s) in checkpoint: {_listing(missing)} (pieces of {whole!r}, of which "
                             f"{len(got)} are there)")
        out.update({p: parts[p] for p in got})
    return out


def _targets(model: torch.nn.Module, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Model name -> tensor for every distinct parameter/persistent buffer, merged projections as their parts."""
    state = model.state_dict(keep_vars=True)
    out = checkpoint_tensors(model)
    tied_in_model = LM_HEAD in state and LM_HEAD not in out
    if tied_in_model and not config.tie_word_embeddings:
        raise ValueError("the model ties lm_head to the embedding but the config has tie_word_embeddings=False")
    if config.tie_word_embeddings:
        out.pop(LM_HEAD, None)  # filled from the embedding by _fill_untied_lm_head
    return out


def _plan(files: list[str], targets: dict[str, torch.Tensor], config: ModelConfig,
          holds: Callable[[str], bool] | None = None, kv_layers: set[str] | None = None,
          parts: dict[str, tuple[str, torch.Tensor]] | None = None, foreign: set[str] | None = None,
          derived: dict[str, torch.Tensor] | None = None) -> list[_Entry]:
    """Check names and shapes from the headers only; returns what to read, in file order. Names map by the
    config's ``checkpoint_name``; ``holds``: whether a tensor belongs to this pipeline stage (the others' are
    skipped); ``kv_layers``: the attention modules, whose FP8 KV-cache scales a checkpoint may carry; ``parts``:
    the pieces a checkpoint may store stacked tensors as (``checkpoint_parts``); ``foreign``: pieces other ranks
    hold (``foreign_parts``), skipped; ``derived``: values the model computes that a checkpoint may hold
    (``checkpoint_derived``), checked when read."""
    parts = parts or {}
    foreign = foreign or set()
    derived = derived or {}
    pieces: dict[str, str] = {}
    draft = config.draft_prefix
    entries: list[_Entry] = []
    loaded: dict[str, str] = {}
    kv_scales = 0
    skipped_visual = skipped_stage = skipped_foreign = 0
    unexpected: list[str] = []
    has_tower = any(t.startswith("visual.") for t in targets)
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                meta = f.get_slice(name)
                shape = tuple(meta.get_shape())
                st_dtype = meta.get_dtype()
                nbytes = _numel(shape) * _DTYPE_BYTES.get(st_dtype, 4)
                target = config.checkpoint_name(name)
                if holds is not None and not holds(target):
                    skipped_stage += 1
                elif target in foreign:
                    skipped_foreign += 1
                elif draft is not None and name.startswith(draft):
                    entries.append(_Entry(name, path, shape, nbytes, None))
                elif target.startswith("visual.") and not has_tower:
                    skipped_visual += 1
                elif target == LM_HEAD and config.tie_word_embeddings:
                    logger.info("ignoring %s: tie_word_embeddings=True, the embedding is the output projection", name)
                elif target not in targets and _is_kv_scale_of(target, kv_layers or set()):
                    if _numel(shape) == 0:
                        raise ValueError(f"{name} is empty")
                    kv_scales += 1
                    entries.append(_Entry(name, path, shape, nbytes, target, kv_scale=True))
                elif target not in targets and target in derived:
                    if shape != tuple(derived[target].shape):
                        raise ValueError(f"{name}: shape {list(shape)} in the checkpoint, but its config.json gives "
                                         f"{list(derived[target].shape)}")
                    entries.append(_Entry(name, path, shape, nbytes, target, derived=True))
                elif target not in targets and target in parts:
                    check_tensor(name, parts[target][1], shape, st_dtype, config)
                    pieces[target] = name
                    entries.append(_Entry(name, path, shape, nbytes, target))
                elif target not in targets:
                    unexpected.append(name)
                else:
                    if target in loaded:
                        raise ValueError(f"checkpoint has two tensors for {target!r}: {loaded[target]!r} and {name!r}")
                    check_tensor(name, targets[target], shape, st_dtype, config)
                    loaded[target] = name
                    entries.append(_Entry(name, path, shape, nbytes, target))
    if skipped_visual:
        logger.warning("skipped %d vision-tower tensors (model.visual.*): image input is off, only the text model "
                       "is served", skipped_visual)
    if skipped_stage:
        logger.info("skipped %d tensors that other pipeline stages hold", skipped_stage)
    if skipped_foreign:
        logger.info("skipped %d expert tensors that other expert-parallel ranks hold", skipped_foreign)
    if kv_scales:
        logger.info("read %d KV-cache scales (an FP8 KV cache uses them: --kv-cache-dtype fp8)", kv_scales)
    for whole, _ in parts_given(parts, set(pieces) | set(loaded)).values():
        loaded.setdefault(whole, "its pieces")
    _check_complete(targets, loaded, unexpected, config)
    return entries


def check_tensor(name: str, target: torch.Tensor, shape: tuple[int, ...], st_dtype: str, config: ModelConfig) -> None:
    """Refuse checkpoint tensor ``name`` (``shape``, safetensors dtype ``st_dtype``) for ``target`` unless its shape
    is the target's (the whole tensor when sharded, or a shape its ``LoadSpec`` accepts) and its dtype fits: FP8 only
    into FP8 targets, FP8 targets only from FP8 (or what their ``LoadSpec`` accepts)."""
    spec = load_spec_of(target)
    shard = shard_of(target)  # tensor parallel: the checkpoint holds the whole tensor
    full = shard.full_shape if shard is not None else tuple(target.shape)
    accepted = spec.shapes if spec is not None and spec.shapes is not None else (full,)
    if shape not in accepted:
        want = " or ".join(str(list(a)) for a in accepted)
        raise ValueError(f"shape mismatch for {name!r}: checkpoint has {list(shape)}, model expects {want}")
    quant = config.quantization
    scheme = quant.describe() if quant is not None else "unquantized"
    if spec is not None:
        if st_dtype not in spec.dtypes:
            raise ValueError(f"{name} is {st_dtype} in the checkpoint; this layer ({scheme}) expects "
                             f"{' or '.join(spec.dtypes)}")
    elif target.dtype == FP8_DTYPE:
        if st_dtype != FP8_CHECKPOINT_DTYPE:
            raise ValueError(f"{name} is {st_dtype} in the checkpoint, but its quantization_config ({scheme}) "
                             f"quantizes this layer: expected {FP8_CHECKPOINT_DTYPE} (a layer the checkpoint keeps "
                             "unquantized belongs in the config's ignore / modules_to_not_convert)")
    elif st_dtype.startswith("F8"):
        why = "config.json has no quantization_config" if quant is None else \
            f"its quantization_config ({scheme}) leaves this layer unquantized (or it is not a linear projection: " \
            "the embedding, LM head, norms and convs stay unquantized)"
        raise ValueError(f"{name} is FP8 ({st_dtype}) in the checkpoint, but {why}; FP8 bytes are not loaded as "
                         "unquantized values")


def _check_complete(
    targets: dict[str, torch.Tensor], loaded: dict[str, str], unexpected: list[str], config: ModelConfig
) -> None:
    quant = config.quantization
    if unexpected:
        scales = [n for n in unexpected if n.endswith(SCALE_SUFFIXES)]
        hint = ""
        if scales:
            why = "config.json has no quantization_config" if quant is None else \
                f"its quantization_config ({quant.describe()}) leaves that layer unquantized or scales it otherwise"
            hint = f"; {scales[0]} is a quantization scale, but {why}"
        raise ValueError(
            f"unexpected tensor(s) in checkpoint (no such parameter in the {config.architecture} text model): "
            f"{_listing(unexpected)}{hint}"
        )
    missing = [t for t in targets if t not in loaded]
    if missing:
        # Named as the checkpoint would name them (the family's config knows its layouts on disk).
        on_disk = list(loaded.values())
        shown = [config.disk_name(t, on_disk) for t in missing]
        scales = [n for n in shown if n.endswith(SCALE_SUFFIXES)]
        if scales and quant is not None:
            more = f" ({len(scales)} scale tensors are missing in all)" if len(scales) > 1 else ""
            raise ValueError(f"{scales[0]} is missing: the checkpoint's quantization_config ({quant.describe()}) "
                             f"quantizes {scales[0].rsplit('.', 1)[0]}{more}")
        hint = " (the config has tie_word_embeddings=False)" if missing == [LM_HEAD] else ""
        raise ValueError(f"missing tensor(s) in checkpoint: {_listing(shown)}{hint}")


def _listing(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_MAX_LISTED])
    more = f" and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else ""
    return f"{shown}{more} ({len(names)} in total)"


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _read(entries: list[_Entry]) -> Iterator[tuple[_Entry, torch.Tensor]]:
    """Yield each entry's tensor, one at a time, each file opened once."""
    by_file: dict[str, list[_Entry]] = {}
    for e in entries:
        by_file.setdefault(e.file, []).append(e)
    for path, group in by_file.items():
        with safe_open(path, framework="pt") as f:
            for e in group:
                yield e, f.get_tensor(e.ckpt_name)


def _model_device_dtype(model: torch.nn.Module) -> tuple[torch.device, torch.dtype]:
    """Device and floating dtype of the model's parameters (mtp tensors are returned in these)."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.device, p.dtype
    return torch.device("cpu"), torch.get_default_dtype()


def _fill_untied_lm_head(model: torch.nn.Module, targets: dict[str, torch.Tensor], config: ModelConfig) -> None:
    """With tied embeddings but a model whose lm_head is its own tensor, copy the embedding into it."""
    if not config.tie_word_embeddings:
        return
    state = model.state_dict(keep_vars=True)
    head, emb = state.get(LM_HEAD), targets.get(EMBEDDING)
    if head is not None and emb is not None and head is not emb:
        head.data.copy_(emb.data)

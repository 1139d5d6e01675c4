"""Load a Qwen3.5 safetensors checkpoint into a model whose parameter names are transformers' ``Qwen3_5ForCausalLM``.

Checkpoint names are mapped to model names as follows:

* ``model.language_model.X`` (``Qwen3_5ForConditionalGeneration`` checkpoints) -> ``model.X``;
* ``model.X`` (``Qwen3_5ForCausalLM`` checkpoints) and ``lm_head.weight`` -> unchanged;
* ``model.visual.*`` / ``visual.*`` (vision tower) -> skipped, with one warning giving the count;
* ``mtp.*`` (multi-token-prediction head) -> returned to the caller, not loaded into the model.

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
from hyserve.layers.linear import MergedLinear
from hyserve.layers.sharding import shard_of

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
LM_HEAD = "lm_head.weight"
EMBEDDING = "model.embed_tokens.weight"
PROGRESS_MIN_BYTES = 200 * 1024 * 1024
_MAX_LISTED = 5

_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
                "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(slots=True, frozen=True)
class _Entry:
    """One checkpoint tensor: where it is, what it becomes."""

    ckpt_name: str
    file: str
    shape: tuple[int, ...]
    nbytes: int
    target: str | None  # model name to copy into; None for an mtp tensor (returned, not loaded)


def load_weights(
    model: torch.nn.Module, model_dir: str, config: ModelConfig, *, show_progress: bool | None = None
) -> dict[str, torch.Tensor]:
    """Copy the checkpoint in ``model_dir`` into ``model`` (already on its device and dtype).

    Returns the ``mtp.*`` tensors (checkpoint name -> tensor on the model's device, in the model's dtype) for
    speculative decoding; empty if the checkpoint has none. ``show_progress`` None shows a tqdm bar only for
    checkpoints over 200 MB. Raises FileNotFoundError for a missing directory, weight file or shard, and
    ValueError for missing/unexpected/duplicate tensors and shape mismatches.
    """
    files = checkpoint_files(model_dir)
    targets = _targets(model, config)
    holds = getattr(model, "holds", None)
    entries = _plan(files, targets, config, holds if callable(holds) else None)
    device, dtype = _model_device_dtype(model)
    total = sum(e.nbytes for e in entries)
    show = total > PROGRESS_MIN_BYTES if show_progress is None else show_progress
    mtp: dict[str, torch.Tensor] = {}
    with torch.no_grad(), tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                               desc="Loading weights", disable=not show) as bar:
        for entry, tensor in _read(entries):
            if entry.target is None:
                mtp[entry.ckpt_name] = tensor.to(device=device, dtype=dtype)
            else:
                target = targets[entry.target]
                shard = shard_of(target)
                target.data.copy_(shard.take(tensor) if shard is not None else tensor)
            bar.update(entry.nbytes)
        _fill_untied_lm_head(model, targets, config)
    return mtp


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
    registered: an alias such as ``mixer`` or a tied ``lm_head`` adds none), and a :class:`MergedLinear`'s weight
    as its parts' row views under the parts' checkpoint names."""
    distinct: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            distinct[name] = tensor
    merged = {id(m.weight): m for m in module.modules() if isinstance(m, MergedLinear)}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in distinct.items():
        m = merged.get(id(tensor))
        if m is None:
            out[name] = tensor
            continue
        parent = name.rsplit(".", 2)[0] + "." if name.count(".") >= 2 else ""
        for part, view in m.part_views().items():
            out[f"{parent}{part}.weight"] = view
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


def _map_name(name: str) -> str | None:
    """Checkpoint name -> model name; None for tensors that are not the text model's (vision, mtp)."""
    if name.startswith(("model.visual.", "visual.", "mtp.")):
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    return name


def _plan(files: list[str], targets: dict[str, torch.Tensor], config: ModelConfig,
          holds: Callable[[str], bool] | None = None) -> list[_Entry]:
    """Check names and shapes from the headers only; returns what to read, in file order. ``holds``: whether a
    tensor belongs to this pipeline stage (the others' are skipped)."""
    entries: list[_Entry] = []
    loaded: dict[str, str] = {}
    skipped_visual = skipped_stage = 0
    unexpected: list[str] = []
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                meta = f.get_slice(name)
                shape = tuple(meta.get_shape())
                nbytes = _numel(shape) * _DTYPE_BYTES.get(meta.get_dtype(), 4)
                target = _map_name(name)
                if holds is not None and not holds(target or name):
                    skipped_stage += 1
                elif name.startswith("mtp."):
                    entries.append(_Entry(name, path, shape, nbytes, None))
                elif target is None:
                    skipped_visual += 1
                elif target == LM_HEAD and config.tie_word_embeddings:
                    logger.info("ignoring %s: tie_word_embeddings=True, the embedding is the output projection", name)
                elif target not in targets:
                    unexpected.append(name)
                else:
                    _check_one(name, target, shape, targets, loaded)
                    loaded[target] = name
                    entries.append(_Entry(name, path, shape, nbytes, target))
    if skipped_visual:
        logger.warning("skipped %d vision-tower tensors (model.visual.*): only the text model is served",
                       skipped_visual)
    if skipped_stage:
        logger.info("skipped %d tensors that other pipeline stages hold", skipped_stage)
    _check_complete(targets, loaded, unexpected, config)
    return entries


def _check_one(
    name: str, target: str, shape: tuple[int, ...], targets: dict[str, torch.Tensor], loaded: dict[str, str]
) -> None:
    if target in loaded:
        raise ValueError(f"checkpoint has two tensors for {target!r}: {loaded[target]!r} and {name!r}")
    shard = shard_of(targets[target])  # tensor parallel: the checkpoint holds the whole tensor
    expected = shard.full_shape if shard is not None else tuple(targets[target].shape)
    if shape != expected:
        raise ValueError(
            f"shape mismatch for {name!r}: checkpoint has {list(shape)}, model expects {list(expected)}"
        )


def _check_complete(
    targets: dict[str, torch.Tensor], loaded: dict[str, str], unexpected: list[str], config: ModelConfig
) -> None:
    if unexpected:
        raise ValueError(
            f"unexpected tensor(s) in checkpoint (no such parameter in the {config.architecture} text model): "
            f"{_listing(unexpected)}"
        )
    missing = [t for t in targets if t not in loaded]
    if missing:
        hint = " (the config has tie_word_embeddings=False)" if missing == [LM_HEAD] else ""
        raise ValueError(f"missing tensor(s) in checkpoint: {_listing(missing)}{hint}")


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

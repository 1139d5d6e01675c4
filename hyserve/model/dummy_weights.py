"""Random weights from ``config.json`` alone (``--load-format dummy``): benchmarks of shapes whose checkpoints are
not on disk.

As vLLM's dummy format, every tensor of the model gets small uniform values in [-1e-3, 1e-3], except the few whose
meaning needs another range for the model to compute something finite and O(1) (``dummy_values``):

* the Gated DeltaNet's ``A_log``: ``log(U[1, 16])`` (a decay rate ``A`` in [1, 16], about the range transformers
  initialises it from), and its ``dt_bias``: ``U[0.5, 1.5]``;
* the norms that scale by ``w`` (the GDN output norm, the vision tower's LayerNorms): ``U[0.9, 1.1]``; the
  zero-centred RMSNorms (scale ``1 + w``) take the common range, a gain of about 1;
* FP8 weights (an FP8 ``quantization_config``): the FP8 values ``U[-1, 1]`` and their scales ``1e-3``, so a
  quantized layer computes with weights of the same size as an unquantized one (FP8 MoE experts too: their stacked
  ``gate_up_proj`` / ``down_proj`` and their scales); static activation scales ``1``.

The tensors are made as a checkpoint would hold them (whole tensors in the checkpoint's shape and dtype) and copied
in by the loader's ``copy_into``: tensor-parallel ranks take their shard of one same tensor, online FP8 quantizes as
it loads, and quantized layers finish as after a real load. Each tensor is drawn on the model's device by its own
generator, seeded from the engine seed and the tensor's checkpoint name: the weights do not depend on the order of
loading, the pipeline stage or the rank, and a seed gives the same model every time on one kind of device. The MTP
head's tensors (``mtp.*``) are made the same way when it is asked for, unquantized.
"""

from __future__ import annotations

import dataclasses
import logging
import zlib
from collections.abc import Iterator

import torch
from torch import nn

from hyserve.config import ModelConfig
from hyserve.kernels.fp8 import FP8_DTYPE
from hyserve.layers.norm import GatedRMSNorm
from hyserve.layers.sharding import load_spec_of, shard_of
from hyserve.model import registry
from hyserve.model.loader import (
    EMBEDDING,
    FP8_CHECKPOINT_DTYPE,
    LM_HEAD,
    checkpoint_tensors,
    copy_into,
    finish_loading,
)

logger = logging.getLogger(__name__)

DUMMY_LOW, DUMMY_HIGH = -1e-3, 1e-3
FP8_DUMMY_SCALE = 1e-3
# Ranges wide enough to stay random in bf16 (whose step next to 1 is 2**-7).
DT_BIAS_RANGE = (0.5, 1.5)
PLAIN_GAIN_RANGE = (0.9, 1.1)
_ST_TO_TORCH = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, FP8_CHECKPOINT_DTYPE: FP8_DTYPE}
_SCALES = (".weight_scale", ".weight_scale_inv", "_proj_scale", "_proj_scale_inv")  # linear layers', stacked experts'



def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of checkpoint tensor ``name`` under engine seed ``seed``."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def dummy_values(name: str, shape: tuple[int, ...], dtype: torch.dtype, plain_gain: bool,
                 gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """Checkpoint tensor ``name`` (``shape``, stored as ``dtype``); ``plain_gain``: a norm weight that scales by
    ``w`` (not ``1 + w``)."""
    def uniform(low: float, high: float) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.float32, device=device).uniform_(low, high, generator=gen)

    if dtype == FP8_DTYPE:
        return uniform(-1.0, 1.0).to(FP8_DTYPE)
    if name.endswith(_SCALES):
        out = torch.full(shape, FP8_DUMMY_SCALE, device=device)
    elif name.endswith(".input_scale"):
        out = torch.ones(shape, device=device)
    elif name.endswith("A_log"):
        out = uniform(1.0, 16.0).log_()
    elif name.endswith("dt_bias"):
        out = uniform(*DT_BIAS_RANGE)
    elif plain_gain:
        out = uniform(*PLAIN_GAIN_RANGE)
    else:
        out = uniform(DUMMY_LOW, DUMMY_HIGH)
    return out.to(dtype)


def _plain_gain_norms(module: nn.Module) -> set[str]:
    """Names of the weights that scale by ``w``: the GDN output norms and LayerNorms."""
    return {f"{name}.weight" if name else "weight" for name, m in module.named_modules(remove_duplicate=False)
            if isinstance(m, GatedRMSNorm | nn.LayerNorm)}


def _stored_form(target: torch.Tensor, model_dtype: torch.dtype) -> tuple[tuple[int, ...], torch.dtype]:
    """The shape and dtype a checkpoint holds for ``target`` (what the loader's header check accepts)."""
    spec = load_spec_of(target)
    shard = shard_of(target)
    shape = shard.full_shape if shard is not None else tuple(target.shape)
    if spec is not None and spec.shapes:
        shape = tuple(spec.shapes[0]) or (1,)
    if spec is not None:
        names = [d for d in spec.dtypes if d in _ST_TO_TORCH]
        dtypes = [_ST_TO_TORCH[d] for d in names]
        dtype = model_dtype if model_dtype in dtypes else dtypes[0]
    else:
        dtype = FP8_DTYPE if target.dtype == FP8_DTYPE else target.dtype
    return tuple(shape), dtype


def dummy_tensors(module: nn.Module, targets: dict[str, torch.Tensor], seed: int, prefix: str,
                   model_dtype: torch.dtype, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, checkpoint tensor)`` for every floating target of ``module`` (``checkpoint_tensors``' names), one at
    a time: what ``load_dummy_weights`` copies in (names under ``prefix`` seed the draft head's)."""
    plain = _plain_gain_norms(module)
    for name, target in targets.items():
        if not target.is_floating_point():
            continue
        shape, dtype = _stored_form(target, model_dtype)
        gen = torch.Generator(device=device)
        gen.manual_seed(tensor_seed(seed, prefix + name))
        yield name, dummy_values(name, shape, dtype, name in plain, gen, device)


def load_dummy_weights(model: nn.Module, config: ModelConfig, seed: int, *,
                       with_draft_head: bool = False) -> dict[str, torch.Tensor]:
    """Fill every parameter and persistent buffer of ``model`` (on its device and dtype) with dummy values; returns
    the draft head's tensors (checkpoint names ``mtp.*``) when ``with_draft_head`` and the config has an MTP layer,
    as ``load_weights`` returns a checkpoint's."""
    device, dtype = _device_dtype(model)
    targets = checkpoint_tensors(model)
    tied = config.tie_word_embeddings
    if tied:
        targets.pop(LM_HEAD, None)
    with torch.no_grad():
        for name, tensor in dummy_tensors(model, targets, seed, "", dtype, device):
            copy_into(targets[name], tensor)
        state = model.state_dict(keep_vars=True)
        head, emb = state.get(LM_HEAD), targets.get(EMBEDDING)
        if tied and head is not None and emb is not None and head is not emb:
            head.data.copy_(emb.data)
        finish_loading(model)
    logger.info("load format dummy: random weights (seed %d) in %d tensors", seed, len(targets))
    if not with_draft_head or config.mtp_num_hidden_layers <= 0 or config.draft_prefix is None:
        return {}
    return _draft_head_tensors(config, seed, dtype, device)


def _draft_head_tensors(config: ModelConfig, seed: int, dtype: torch.dtype, device: torch.device
                        ) -> dict[str, torch.Tensor]:
    """The MTP head's checkpoint tensors (unquantized), from its layout built on the meta device."""
    prefix = config.draft_prefix or ""
    cfg = dataclasses.replace(config, quantization=None)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            head = registry.draft_head(config).build(cfg)
    finally:
        torch.set_default_dtype(prev)
    targets = checkpoint_tensors(head)
    return {prefix + name: t for name, t in dummy_tensors(head, targets, seed, prefix, dtype, device)}


def _device_dtype(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != FP8_DTYPE:
            return p.device, p.dtype
    return torch.device("cpu"), torch.get_default_dtype()

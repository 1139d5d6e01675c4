"""Linear layers: one GEMM for several projections of the same input (checkpoints store them as separate tensors),
the tensor-parallel forms (``hyserve.distributed.parallel_state``), and a quant method in each GEMM
(``hyserve.layers.quantization``).

Column-parallel projections need no class of their own: a rank's output rows are a ``Shard`` of the checkpoint
tensor (``hyserve.layers.sharding``) and the layer's output is that rank's heads or channels. A row-parallel
projection takes the rank's input columns and sums its output over the group.

Each GEMM (``LinearBase``) takes its method from the model's ``QuantizationConfig`` by its checkpoint name; the
method creates the parameters (``weight`` and, quantized, its scales) with what the loader needs (shards of scales
included). A merged projection whose parts get different methods (a checkpoint that keeps ``in_proj_a``/``in_proj_b``
in bf16 beside FP8 ``in_proj_qkv``/``in_proj_z``) runs one GEMM per run of consecutive parts with equal methods.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from hyserve.distributed.parallel_state import all_gather_last, all_reduce, shard_range, tp_size
from hyserve.kernels.fp8 import Fp8Activation
from hyserve.kernels.gemv import DeferredInput, NormedInput, SwigluInput, decode_gemm_enabled, decode_linear
from hyserve.layers.quantization.base import UNQUANTIZED, LinearMethod, LinearPart, QuantizationConfig
from hyserve.layers.sharding import Shard, set_shard


def fused_quant_enabled() -> bool:
    """Whether producers quantize FP8 GEMMs' activations in their own launch (``HYSERVE_FP8_FUSED_QUANT``, default
    1; 0 gives each GEMM its own quantization launch, to measure against). Another value is refused."""
    value = os.environ.get("HYSERVE_FP8_FUSED_QUANT", "1")
    if value not in ("0", "1"):
        raise ValueError(f"HYSERVE_FP8_FUSED_QUANT={value!r}: 1 (the default) or 0")
    return value == "1"


def fp8_input_of(gemms: Sequence[LinearBase]) -> str | None:
    """What the producer of the one input of ``gemms`` writes: ``"fp8"`` when every GEMM takes an activation
    quantized per token (``LinearMethod.takes_fp8_activation``), ``"fp8+plain"`` when only some do, None when none
    does (or ``fused_quant_enabled`` is off)."""
    takes = [g.method.takes_fp8_activation() for g in gemms]
    if not any(takes) or not fused_quant_enabled():
        return None
    return "fp8" if all(takes) else "fp8+plain"


def fp8_input_for(module: nn.Module) -> str | None:
    """The form ``module``'s input is produced in: its ``fp8_input()`` (a block whose first GEMMs may take an
    activation quantized by its producer: ``MLP``, ``GatedDeltaNet``, ``Attention``), else None (plain)."""
    form = getattr(module, "fp8_input", None)
    return form() if callable(form) else None


def takes_deferred_input(module: nn.Module) -> bool:
    """Whether ``module``'s input may come as its norm deferred into its first GEMM's prologue (its
    ``takes_deferred()``: ``MLP``, ``GatedDeltaNet``); False for any other block."""
    takes = getattr(module, "takes_deferred", None)
    return bool(takes()) if callable(takes) else False


def linear_method(quant: QuantizationConfig | None, name: str) -> LinearMethod:
    """The method of linear layer ``name`` (model-side name) under ``quant`` (``None``: unquantized)."""
    return UNQUANTIZED if quant is None else quant.linear_method(name)


class LinearBase(nn.Module):
    """One GEMM ``x W^T`` over this rank's rows and columns; ``parts`` are the checkpoint projections of its output
    rows, in order. ``prefix`` names the layer (a merged projection's parent, whose children the parts' names are)."""

    weight: torch.Tensor

    def __init__(self, in_features: int, parts: Sequence[LinearPart], method: LinearMethod, *, prefix: str,
                 bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.parts = tuple(parts)
        self.out_features = sum(p.size for p in self.parts)
        self.prefix = prefix
        self.method = method
        method.create_weights(self)
        self.bias: nn.Parameter | None = None
        if bias:
            assert len(self.parts) == 1, "a merged projection has no bias"
            self.bias = nn.Parameter(torch.empty(self.out_features), requires_grad=False)
            shard = self.parts[0].shard
            if shard is not None and shard.dim == 0:
                set_shard(self.bias, Shard((shard.full_shape[0],), 0, shard.ranges))

    def part_name(self, part: LinearPart) -> str:
        """The model-side module name of ``part``."""
        if part.name is None:
            return self.prefix
        return f"{self.prefix}.{part.name}" if self.prefix else part.name

    def gemm(self, x: torch.Tensor | Fp8Activation | DeferredInput) -> torch.Tensor:
        if isinstance(x, (NormedInput, SwigluInput)):
            # A decode step's norm or SwiGLU in this GEMM's prologue (hyserve.kernels.gemv); otherwise computed here.
            if self.method is UNQUANTIZED and self.weight.dtype == x.dtype:
                return decode_linear(x, self.weight)
            x = x.materialize()
        if isinstance(x, Fp8Activation) and not self.method.takes_fp8_activation():
            if x.plain is None:
                raise TypeError(f"{self.prefix}: an FP8 activation reached a GEMM that reads the plain one "
                                f"({self.method.describe()}); its producer was asked for the wrong form")
            x = x.plain
        return self.method.apply(self, x)  # type: ignore[arg-type]

    def fp8_input(self) -> str | None:
        """The form this GEMM's producer writes its input in (``hyserve.kernels.norm.QUANT_MODES``)."""
        return fp8_input_of([self])

    def takes_deferred(self) -> bool:
        """Whether this GEMM computes a deferred input (``hyserve.kernels.gemv``: the norm or SwiGLU before it) in
        its own prologue: an unquantized weight with ``HYSERVE_DECODE_GEMM=on``."""
        return self.method is UNQUANTIZED and decode_gemm_enabled()

    def part_tensors(self) -> dict[str, torch.Tensor]:
        """``{part.param: view}``: each named part's checkpoint tensors (``in_proj_z.weight``, ...), views of this
        GEMM's parameters."""
        out: dict[str, torch.Tensor] = {}
        off = 0
        for i, part in enumerate(self.parts):
            assert part.name is not None
            for param, view in self.method.part_tensors(self, i, off).items():
                out[f"{part.name}.{param}"] = view
            off += part.size
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"{self.method.describe()}")


class Linear(LinearBase):
    """A replicated projection, or a column-parallel one: ``shard`` is this rank's rows of the checkpoint tensor."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False,
                 quant: QuantizationConfig | None = None, prefix: str = "", shard: Shard | None = None) -> None:
        super().__init__(in_features, [LinearPart(None, out_features, shard)], linear_method(quant, prefix),
                         prefix=prefix, bias=bias)

    def forward(self, x: torch.Tensor | Fp8Activation | DeferredInput) -> torch.Tensor:
        y = self.gemm(x)
        return y if self.bias is None else y + self.bias


class MergedLinear(nn.Module):
    """``parts``: each projection's checkpoint name relative to ``prefix`` (the parent module, e.g. ``in_proj_z``
    of ``model.layers.0.linear_attn``) and its output size (this rank's), in output order; ``shards`` their rows
    of the checkpoint tensors when tensor-parallel. The loader fills each part's rows (``checkpoint_tensors``);
    :meth:`split` cuts the output into the parts (views)."""

    def __init__(self, in_features: int, parts: list[tuple[str, int]], shards: dict[str, Shard] | None = None, *,
                 quant: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.parts = list(parts)
        self.sizes = [n for _, n in parts]
        shards = dict(shards or {})
        methods = [linear_method(quant, f"{prefix}.{name}" if prefix else name) for name, _ in parts]
        # Consecutive parts with equal methods share a GEMM, unless the earlier one's rows end inside a scale block.
        groups: list[list[int]] = []
        for i, method in enumerate(methods):
            last = groups[-1][-1] if groups else -1
            if last >= 0 and methods[last] == method and self.sizes[last] % method.row_alignment == 0:
                groups[-1].append(i)
            else:
                groups.append([i])
        self.gemms = nn.ModuleList([
            LinearBase(in_features, [LinearPart(parts[i][0], parts[i][1], shards.get(parts[i][0])) for i in g],
                       methods[g[0]], prefix=prefix) for g in groups])
        self._gemms: list[LinearBase] = list(self.gemms)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor | Fp8Activation | DeferredInput) -> torch.Tensor:
        if len(self._gemms) == 1:
            return self._gemms[0].gemm(x)
        return torch.cat([g.gemm(x) for g in self._gemms], dim=-1)

    def forward_split(self, x: torch.Tensor | Fp8Activation | DeferredInput, sizes: list[int]
                      ) -> tuple[torch.Tensor, ...]:
        """The output cut into consecutive pieces of ``sizes`` (views), as ``forward(x).split(sizes, -1)`` but
        without joining the GEMMs' outputs first: where the parts take two GEMMs (an FP8 checkpoint keeping some in
        bf16, as the seed's keeps GDN's ``in_proj_b`` / ``in_proj_a``), ``torch.cat`` copied the whole output once
        more per layer. A piece may not straddle two GEMMs' outputs (refused)."""
        if len(self._gemms) == 1:
            return tuple(self._gemms[0].gemm(x).split(sizes, dim=-1))
        pieces: list[torch.Tensor] = []
        i = 0
        for g in self._gemms:
            y = g.gemm(x)
            width, start = y.shape[-1], i
            while i < len(sizes) and sum(sizes[start : i + 1]) <= width:
                i += 1
            if sum(sizes[start:i]) != width:
                raise ValueError(f"pieces {sizes} straddle the GEMMs' outputs "
                                 f"{[g.out_features for g in self._gemms]}")
            pieces.extend(y.split(sizes[start:i], dim=-1))
        if i != len(sizes):
            raise ValueError(f"pieces {sizes} are wider than the output ({sum(self.sizes)})")
        return tuple(pieces)

    def fp8_input(self) -> str | None:
        """The form this projection's producer writes its input in (``hyserve.kernels.norm.QUANT_MODES``)."""
        return fp8_input_of(self._gemms)

    def takes_deferred(self) -> bool:
        """One GEMM that computes a deferred input in its prologue (``LinearBase.takes_deferred``)."""
        return len(self._gemms) == 1 and self._gemms[0].takes_deferred()

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(y.split(self.sizes, dim=-1))

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """``{part.param: tensor}`` over every part (``in_proj_qkv.weight``, ``in_proj_qkv.weight_scale``, ...):
        views of the GEMMs' parameters, each carrying its part's shard."""
        out: dict[str, torch.Tensor] = {}
        for g in self._gemms:
            out.update(g.part_tensors())
        return out


class RowParallelLinear(LinearBase):
    """``in_range`` of the full ``in_features_full`` inputs on this rank; the outputs are summed over the group,
    then the (whole) bias is added once."""

    def __init__(self, in_features_full: int, out_features: int, in_range: tuple[int, int], bias: bool = False,
                 sharded: bool = True, *, quant: QuantizationConfig | None = None, prefix: str = "") -> None:
        shard = Shard((out_features, in_features_full), 1, (in_range,)) if sharded else None
        super().__init__(in_range[1] - in_range[0], [LinearPart(None, out_features, shard)],
                         linear_method(quant, prefix), prefix=prefix, bias=bias)
        self.sharded = sharded
        # False: the caller sums this partial output over the group itself (with others, in one all-reduce).
        self.reduce_results = True

    def forward(self, x: torch.Tensor | Fp8Activation | DeferredInput) -> torch.Tensor:
        y = self.gemm(x)
        if self.sharded and self.reduce_results:
            y = all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows [vocab_start, vocab_end) of the embedding; other ids give zeros here, and the sum over the
    group is the whole lookup."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        v0, v1 = shard_range(num_embeddings)
        super().__init__(v1 - v0, embedding_dim, _weight=torch.empty(v1 - v0, embedding_dim))
        if not self.weight.is_meta:  # on the meta device (the weights' plan) normal_'s Python reference imports
            self.reset_parameters()  # torch._dynamo (2 s of CPU a worker process); a meta tensor holds no values
        self.vocab_start, self.vocab_end = v0, v1
        self.sharded = tp_size() > 1
        if self.sharded:
            set_shard(self.weight, Shard((num_embeddings, embedding_dim), 0, ((v0, v1),)))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.sharded:
            return super().forward(ids)
        inside = (ids >= self.vocab_start) & (ids < self.vocab_end)
        local = F.embedding(torch.where(inside, ids - self.vocab_start, 0), self.weight)
        return all_reduce(local.masked_fill(~inside.unsqueeze(-1), 0))


class ParallelLMHead(nn.Linear):
    """This rank's vocabulary rows of the LM head; ``gather`` puts the ranks' logits side by side (every rank gets
    the whole vocabulary, so every rank samples the same token)."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        v0, v1 = shard_range(vocab_size)
        super().__init__(hidden_size, v1 - v0, bias=False)
        self.sharded = tp_size() > 1
        if self.sharded:
            set_shard(self.weight, Shard((vocab_size, hidden_size), 0, ((v0, v1),)))

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        return all_gather_last(local) if self.sharded else local

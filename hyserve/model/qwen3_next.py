"""The Qwen3-Next text model (``Qwen3NextForCausalLM``): Qwen3.5's decoder (``hyserve.model.qwen3_5``: Gated
DeltaNet and gated attention mixers, zero-centred RMSNorms, partial plain RoPE) with each layer's feed-forward block
the sparse MoE block (``hyserve.layers.moe``) or the dense gated MLP, as ``Qwen3NextConfig.sparse_layer`` says, and
its MTP head, laid out as vLLM's ``qwen3_next_mtp`` reads it (``mtp.fc``, ``mtp.pre_fc_norm_embedding``,
``mtp.pre_fc_norm_hidden``, ``mtp.layers.0.*`` with its own MoE block, ``mtp.norm``): Qwen3.5's head
(``hyserve.model.mtp``).

The one difference in the mixers is the checkpoint's layout of the GDN input projections: two fused tensors,
grouped by key head (transformers' ``fix_query_key_value_ordering``), with r = value heads per key head:

    in_proj_qkvz  [nk * (2 dk + 2 r dv), H]   key head j's rows: q_j (dk), k_j (dk), v of its r heads, z of them
    in_proj_ba    [nk * 2 r, H]               key head j's rows: b of its r value heads, a of them

They load, re-ordered by their ``Shard``'s row ranges (``fused_in_proj_rows``), into the same GEMM as Qwen3.5's,
whose output is [q | k | v | z | b | a] of this rank's heads: the forward path is Qwen3.5's. Tensor parallel:
a rank holds whole key-head groups (its key heads, and the r value heads of each).

FP8 (docs/fp8_facts.md): the row re-order is a ``Shard`` of many row ranges, and a quantized part's scales take the
same ranges of theirs (``Fp8LinearMethod``): per-channel scales row for row, block scales (Qwen's block FP8,
``weight_scale_inv``) by whole rows of blocks, which holds when every piece of a group (q_j and k_j of dk rows, the
v and z of r dv rows; b and a of r rows) is a multiple of the block's rows: 128 in the release (dk = dv = 128), or
when the whole tensor is one row of blocks (``in_proj_ba``'s 2 nv = 64 rows in the release: all its rows share the
scales; the release is taken to keep it in bf16, as vLLM's "ba_proj doesn't support blockwise fp8" suggests). Other
pieces are refused when the layer is built.
"""

from __future__ import annotations

from torch import nn

from hyserve.layers.gdn import GatedDeltaNet, GDNConfig
from hyserve.layers.linear import MergedLinear, linear_method
from hyserve.layers.moe import SparseMoeBlock
from hyserve.layers.sharding import Shard
from hyserve.model.mtp import MTPHead, load_mtp_weights
from hyserve.model.qwen3_5 import DecoderLayer
from hyserve.model.qwen3_5_config import Qwen3_5Config
from hyserve.model.qwen3_5_moe import Qwen3_5MoeForCausalLM
from hyserve.model.qwen3_next_config import qwen3_next_config

__all__ = ["FusedGatedDeltaNet", "NextDecoderLayer", "Qwen3NextForCausalLM", "Qwen3NextMTPHead", "fused_in_proj_rows",
           "load_mtp_weights"]

Rows = tuple[tuple[int, int], ...]


def fused_in_proj_rows(num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                       k_range: tuple[int, int]) -> tuple[Rows, Rows]:
    """The rows of ``in_proj_qkvz`` and of ``in_proj_ba`` that give [q | k | v | z] and [b | a] of key heads
    ``k_range`` (and of their value heads), in that order."""
    r = num_v_heads // num_k_heads
    dk, rdv = head_k_dim, r * head_v_dim
    group = 2 * dk + 2 * rdv
    heads = range(*k_range)
    offsets = (0, dk), (dk, 2 * dk), (2 * dk, 2 * dk + rdv), (2 * dk + rdv, group)  # q, k, v, z in a group
    qkvz = tuple((j * group + a, j * group + b) for a, b in offsets for j in heads)
    ba = tuple((j * 2 * r + a, j * 2 * r + b) for a, b in ((0, r), (r, 2 * r)) for j in heads)
    return qkvz, ba


class FusedGatedDeltaNet(GatedDeltaNet):
    """Qwen3.5's GDN layer whose input projections load from the fused ``in_proj_qkvz`` / ``in_proj_ba``."""

    def make_in_proj(self, cfg: GDNConfig, prefix: str) -> MergedLinear:
        nk, nv, h = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.hidden_size
        (k0, k1), r = self.k_range, nv // nk
        full_qkvz = nk * (2 * self.head_k_dim + 2 * r * self.head_v_dim)
        pieces = {"in_proj_qkvz": (full_qkvz, {"q and k": self.head_k_dim, "v and z": r * self.head_v_dim}),
                  "in_proj_ba": (2 * nv, {"b and a": r})}
        for name, (full, sizes) in pieces.items():
            # A block-quantized part's scales re-order by whole rows of blocks (see the module docstring).
            rows = linear_method(cfg.quantization, f"{prefix}.{name}").row_alignment
            for what, n in sizes.items():
                if n % rows and full > rows:
                    raise ValueError(
                        f"{prefix}.{name}: block FP8 with {rows}-row blocks, but each key-head group's {what} "
                        f"pieces are {n} rows and the tensor {full}: the scales cannot follow the grouped rows' "
                        f"re-order (supported: pieces of whole blocks, as the release's 128-row heads are, or a "
                        f"tensor of at most one row of blocks; else {name} kept in bf16, in modules_to_not_convert)")
        # The value heads this rank holds are those of its key heads' groups.
        assert self.v_range == (k0 * r, k1 * r), (self.k_range, self.v_range)
        qkvz, ba = fused_in_proj_rows(nk, nv, self.head_k_dim, self.head_v_dim, self.k_range)
        shards = {"in_proj_qkvz": Shard((full_qkvz, h), 0, qkvz), "in_proj_ba": Shard((2 * nv, h), 0, ba)}
        return MergedLinear(h, [("in_proj_qkvz", self.conv_dim + self.value_dim),
                                ("in_proj_ba", 2 * self.num_v_heads)], shards, quant=cfg.quantization,
                           prefix=prefix)


class NextDecoderLayer(DecoderLayer):
    """Fused GDN input projections; the MoE block or the dense MLP by the layer's index."""

    linear_attention = FusedGatedDeltaNet

    def make_mlp(self, cfg: Qwen3_5Config, prefix: str) -> nn.Module:
        next_cfg = qwen3_next_config(cfg)
        if next_cfg.sparse_layer(self.layer_idx):
            return SparseMoeBlock(next_cfg, prefix)
        return super().make_mlp(cfg, prefix)


class Qwen3NextForCausalLM(Qwen3_5MoeForCausalLM):
    decoder_layer = NextDecoderLayer


class Qwen3NextMTPHead(MTPHead):
    """Qwen3.5's MTP head with Qwen3-Next's decoder layer (index 0: the MoE block unless the config makes layer 0
    dense); loaded by Qwen3.5's ``load_mtp_weights``."""

    decoder_layer = NextDecoderLayer

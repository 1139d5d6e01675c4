"""The Qwen3.5 vision tower (``model.visual`` of ``Qwen3_5ForConditionalGeneration``) in plain PyTorch.

Mirrors transformers' ``Qwen3_5VisionModel`` (``transformers/models/qwen3_5/modeling_qwen3_5.py``, 5.17):

* patch embedding: a Conv3d whose kernel equals its stride (temporal_patch_size x patch_size x patch_size) over the
  flattened ``(C, T, P, P)`` patches the Qwen2-VL image processor emits;
* a learned square position-embedding table, bilinearly resampled (align_corners=True) to each image's patch grid;
* ``depth`` pre-LayerNorm blocks whose attention carries a 2-D (height, width) axial rotary embedding and attends only
  within one frame of one image (transformers' per-``cu_seqlens``-segment path);
* the patch merger: LayerNorm, then each ``spatial_merge_size**2`` block of consecutive patches concatenated and
  projected by a GELU MLP to the text model's width (``out_hidden_size``).

Qwen3.5 has no deepstack (unlike Qwen3-VL): only the merger's output reaches the text model. Patches arrive in
spatial-merge-block order (block row, block column, row in block, column in block), which the position embedding, the
rotary positions and the merger all assume. Parameter names are the checkpoint's ``model.visual.*`` names without that
prefix.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hyserve.utils import host_to_device

VISION_PREFIXES = ("model.visual.", "visual.")

# transformers' ACT2FN names for the activations a Qwen3.5 vision config can name.
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "silu": F.silu,
    "relu": F.relu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


def _spatial_patch_size(value: Any) -> int:
    # transformers' config type allows a pair, but its Conv3d kernel only works with one square size.
    if isinstance(value, list | tuple):
        if len(value) != 2 or value[0] != value[1]:
            raise ValueError(f"vision_config: only square patches are supported, got patch_size={value!r}")
        value = value[0]
    return int(value)


def _temporal_patch_size(value: Any) -> int:
    if isinstance(value, list | tuple):
        if len(set(value)) != 1:
            raise ValueError(f"vision_config: unsupported temporal_patch_size={value!r}")
        value = value[0]
    return int(value)


@dataclass(frozen=True)
class VisionConfig:
    """The fields of a checkpoint's ``vision_config`` the tower uses; defaults are ``Qwen3_5VisionConfig``'s."""

    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision_config: hidden_size {self.hidden_size} not divisible by {self.num_heads} heads")
        # The rotary splits each head into height and width halves, each rotated as NeoX pairs.
        if self.head_dim % 4:
            raise ValueError(f"vision_config: head_dim {self.head_dim} must be a multiple of 4")
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"vision_config: unsupported hidden_act {self.hidden_act!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_grid_per_side(self) -> int:
        return math.isqrt(self.num_position_embeddings)

    @property
    def patch_dim(self) -> int:
        """Width of one row of ``pixel_values``."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_dict(cls, vision: Mapping[str, Any]) -> VisionConfig:
        """From config.json's ``vision_config``; keys the tower does not use (model_type, initializer_range) are
        ignored."""
        if vision.get("deepstack_visual_indexes"):
            # A Qwen3-VL tower: transformers' Qwen3.5 model would silently drop those layers' features.
            raise ValueError("vision_config: deepstack_visual_indexes is set; Qwen3.5's vision tower has no deepstack")
        rope = dict(vision.get("rope_parameters") or {})
        rope_type = rope.get("rope_type", "axial")
        if rope_type != "axial":
            raise ValueError(f"vision_config: unsupported rope_type {rope_type!r} (supported: axial)")
        d = cls()
        return cls(
            depth=int(vision.get("depth", d.depth)),
            hidden_size=int(vision.get("hidden_size", d.hidden_size)),
            hidden_act=str(vision.get("hidden_act", d.hidden_act)),
            intermediate_size=int(vision.get("intermediate_size", d.intermediate_size)),
            num_heads=int(vision.get("num_heads", vision.get("num_attention_heads", d.num_heads))),
            in_channels=int(vision.get("in_channels", d.in_channels)),
            patch_size=_spatial_patch_size(vision.get("patch_size", d.patch_size)),
            spatial_merge_size=int(vision.get("spatial_merge_size", d.spatial_merge_size)),
            temporal_patch_size=_temporal_patch_size(vision.get("temporal_patch_size", d.temporal_patch_size)),
            out_hidden_size=int(vision.get("out_hidden_size", d.out_hidden_size)),
            num_position_embeddings=int(vision.get("num_position_embeddings", d.num_position_embeddings)),
            rope_theta=float(rope.get("rope_theta") or vision.get("rope_theta") or d.rope_theta),
        )


# ---------------------------------------------------------------------------------------------------------------------
# Per-patch index computations from grid_thw (no weights).


def _grids(grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> list[tuple[int, int, int]]:
    rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw
    return [(int(t), int(h), int(w)) for t, h, w in rows]


def vision_token_count(grid_thw: torch.Tensor | Sequence[Sequence[int]], spatial_merge_size: int) -> list[int]:
    """Per image (or video), how many placeholder tokens its embeddings fill: t * h * w / merge**2."""
    counts = []
    for t, h, w in _grids(grid_thw):
        if h % spatial_merge_size or w % spatial_merge_size:
            raise ValueError(f"grid {(t, h, w)} is not divisible by spatial_merge_size {spatial_merge_size}")
        counts.append(t * h * w // spatial_merge_size**2)
    return counts


def _block_order(values: torch.Tensor, merge: int) -> torch.Tensor:
    """A frame's (h, w, ...) per-patch table flattened in spatial-merge-block order, as the processor emits patches."""
    h, w = values.shape[:2]
    blocks = values.reshape(h // merge, merge, w // merge, merge, *values.shape[2:]).transpose(1, 2)
    return blocks.reshape(h * w, *values.shape[2:])


def rotary_position_ids(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """(total_patches, 2) long: each patch's (row, column) in its frame; every frame of a video repeats them."""
    parts = []
    for t, h, w in _grids(grid_thw):
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        parts.append(_block_order(torch.stack([rows, cols], dim=-1), merge).repeat(t, 1))
    return torch.cat(parts).to(grid_thw.device)


def attention_segments(grid_thw: torch.Tensor) -> list[int]:
    """Lengths of the runs of patches that attend to each other: one frame of one image or video each."""
    return [h * w for t, h, w in _grids(grid_thw) for _ in range(t)]


def _axis_taps(size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear (align_corners=True) taps into a ``side``-long table for ``size`` targets: (size, 2) each."""
    # The same float32 arithmetic as transformers' _interpolation_axis_taps_weights, so weights agree bit for bit.
    src = torch.arange(size).float() * (side - 1) / max(size - 1, 1)
    floor = torch.floor(src)
    offsets = torch.arange(2)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def position_interpolation(grid_thw: torch.Tensor, side: int, merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per patch, 4 indices into the flattened (side x side) position table and their bilinear weights."""
    indices, weights = [], []
    for t, h, w in _grids(grid_thw):
        h_taps, h_weights = _axis_taps(h, side)
        w_taps, w_weights = _axis_taps(w, side)
        idx = (h_taps[:, None, :, None] * side + w_taps[None, :, None, :]).reshape(h, w, 4)
        wgt = (h_weights[:, None, :, None] * w_weights[None, :, None, :]).reshape(h, w, 4)
        indices.append(_block_order(idx, merge).repeat(t, 1))
        weights.append(_block_order(wgt, merge).repeat(t, 1))
    return torch.cat(indices).to(grid_thw.device), torch.cat(weights).to(grid_thw.device)


# ---------------------------------------------------------------------------------------------------------------------
# Modules.


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (N, heads, head_dim); cos/sin: (N, head_dim) float32. Rotated in float32, as the reference does."""
    xf = x.float()
    return (xf * cos[:, None] + _rotate_half(xf) * sin[:, None]).to(x.dtype)


class VisionRotary:
    """Axial 2-D rope: the first half of each head's frequencies turns with the row, the second with the column."""

    def __init__(self, head_dim: int, theta: float) -> None:
        self.head_dim = head_dim
        self.theta = theta

    def cos_sin(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids: (N, 2) (row, column) -> cos, sin: (N, head_dim) float32."""
        # Computed per call rather than kept as a buffer, so casting the tower to bf16 cannot round the frequencies.
        spatial = self.head_dim // 2
        exponents = torch.arange(0, spatial, 2, dtype=torch.float32, device=position_ids.device) / spatial
        inv_freq = 1.0 / (self.theta**exponents)
        freqs = (position_ids[..., None].float() * inv_freq).flatten(1)  # (N, [row freqs | column freqs])
        freqs = torch.cat([freqs, freqs], dim=-1)
        return freqs.cos(), freqs.sin()


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        # Kept a Conv3d so the weight has the checkpoint's (hidden, C, T, P, P) shape.
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=kernel, stride=kernel, bias=True)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        # With kernel == stride over one patch, the convolution is a matmul over the flattened (C, T, P, P) row;
        # a GEMM is far faster than a 3-D convolution on such tiny inputs.
        return F.linear(pixel_values.to(weight.dtype), weight.flatten(1), self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], segments: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = _apply_rotary(q, *cos_sin), _apply_rotary(k, *cos_sin)
        out = segment_attention(q, k, v, segments)
        return self.proj(out.reshape(n, -1))


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: list[int]) -> torch.Tensor:
    """Bidirectional attention within each segment of the packed (N, heads, head_dim) q/k/v; (N, heads, head_dim).

    One call per segment, each of one image's (frame's) shape, never several equal segments batched: on CUDA, SDPA
    may take cuDNN's attention, which builds an execution plan on the host for every new shape (40-60 ms on an
    H100), and a step's images go through the tower together in varying numbers (``MMInputs.encode_together``).
    Each call is 4-D, (1, heads, n, head_dim): the fused kernels (FlashAttention, cuDNN, memory-efficient) take no
    3-D inputs, which fall to SDPA's math path."""

    def one(qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor) -> torch.Tensor:
        qb, kb, vb = (t.transpose(0, 1).unsqueeze(0) for t in (qs, ks, vs))
        return F.scaled_dot_product_attention(qb, kb, vb)[0].transpose(0, 1)

    if len(segments) == 1:
        return one(q, k, v)
    return torch.cat([one(*parts) for parts in zip(q.split(segments), k.split(segments), v.split(segments),
                                                      strict=True)])


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], segments: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos_sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.merged_size = cfg.hidden_size * cfg.spatial_merge_size**2
        # The norm is per patch, before the merge (transformers' use_postshuffle_norm=False).
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged_size, self.merged_size)
        self.linear_fc2 = nn.Linear(self.merged_size, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).reshape(-1, self.merged_size)
        # Exact (erf) GELU here, whatever the blocks' hidden_act is.
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionModel(nn.Module):
    """pixel_values (total_patches, C*T*P*P) + grid_thw (num_images, 3) -> (sum t*h*w / merge**2, out_hidden_size)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        n, dim = cfg.num_position_embeddings, cfg.hidden_size
        self.pos_embed = nn.Embedding(n, dim, _weight=torch.empty(n, dim))
        if not self.pos_embed.weight.is_meta:  # (as VocabParallelEmbedding: no torch._dynamo import on meta)
            self.pos_embed.reset_parameters()
        self.rotary = VisionRotary(cfg.head_dim, cfg.rope_theta)
        self.blocks = nn.ModuleList([VisionBlock(cfg) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg)

    @classmethod
    def from_config_dict(cls, vision_config: Mapping[str, Any]) -> VisionModel:
        return cls(VisionConfig.from_dict(vision_config))

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        self._check_inputs(pixel_values, grid_thw)
        x = self.patch_embed(pixel_values)
        x = x + self._position_embeddings(grid_thw).to(x.dtype)
        # the grid may sit on the host (the helpers read it there); what they compute goes to the tower's device
        cos_sin = self.rotary.cos_sin(host_to_device(rotary_position_ids(grid_thw, cfg.spatial_merge_size), x.device))
        segments = attention_segments(grid_thw)
        for block in self.blocks:
            x = block(x, cos_sin, segments)
        return self.merger(x)

    def _position_embeddings(self, grid_thw: torch.Tensor) -> torch.Tensor:
        indices, weights = position_interpolation(grid_thw, self.cfg.num_grid_per_side, self.cfg.spatial_merge_size)
        device = self.pos_embed.weight.device
        indices, weights = host_to_device(indices, device), host_to_device(weights, device)
        return (self.pos_embed(indices) * weights[:, :, None]).sum(1)

    def _check_inputs(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> None:
        # A wrong row count would otherwise surface as an opaque reshape error deep in a block.
        patches = sum(t * h * w for t, h, w in _grids(grid_thw))
        vision_token_count(grid_thw, self.cfg.spatial_merge_size)  # raises on grids the merger cannot split
        if pixel_values.shape != (patches, self.cfg.patch_dim):
            raise ValueError(
                f"pixel_values has shape {tuple(pixel_values.shape)}, grid_thw needs ({patches}, {self.cfg.patch_dim})"
            )


def load_vision_weights(module: VisionModel, tensors: Mapping[str, torch.Tensor]) -> None:
    """Load a checkpoint's vision tensors (``model.visual.*``, or ``visual.*``) into ``module``.

    Other tensors (the text model's, mtp) are ignored. Raises ValueError naming every missing, unexpected or
    wrongly shaped vision tensor rather than loading part of the tower.
    """
    state: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        prefix = next((p for p in VISION_PREFIXES if name.startswith(p)), None)
        if prefix is not None:
            state[name[len(prefix) :]] = tensor
    own = module.state_dict()
    problems = [f"missing: model.visual.{n}" for n in own if n not in state]
    problems += [f"unexpected: model.visual.{n}" for n in state if n not in own]
    problems += [
        f"shape mismatch: model.visual.{n} is {tuple(t.shape)}, expected {tuple(own[n].shape)}"
        for n, t in state.items()
        if n in own and t.shape != own[n].shape
    ]
    if problems:
        raise ValueError("vision weights do not match the vision tower: " + "; ".join(problems))
    module.load_state_dict(state, strict=True)

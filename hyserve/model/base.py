"""What the engine needs of a model and of its caching layers, whatever the family.

A layer that keeps per-request cache declares it: ``KVCacheLayer.cache_spec`` (paged K/V) or
``RecurrentLayer.cache_spec`` (a list of fixed-size tensors per request, ``hyserve.cache.specs``). The runner plans
memory from the specs, the state pool allocates from them, and each layer is handed its tensors by name
(``bind_state``, ``bind_verify_scratch``). What a recurrent tensor means, and how candidates of a verify step are
committed, stays inside the layer (and its kernels).
"""

from __future__ import annotations

import torch
from torch import nn

from hyserve.cache.specs import AttentionSpec, CacheSpecs, RecurrentStateSpec, entry_rows


class KVCacheLayer(nn.Module):
    """A layer reading and writing the paged KV cache: (num_blocks, block_size, num_kv_heads, head_dim) K and V.

    An FP8 cache (``kv_cache_dtype="fp8"``) holds K / ``k_scale`` and V / ``v_scale``, per kv head (float32,
    ``(num_kv_heads,)``); the scales are 1 unless a checkpoint gives them (``set_kv_scales``).
    """

    k_cache: torch.Tensor | None
    v_cache: torch.Tensor | None
    # (num_blocks, block_size, index_dim): per-token index keys in the KV's blocks and slots, for a layer whose
    # cache_spec has index_dim > 0 (indexed attention); None otherwise.
    index_cache: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    # This rank's kv heads [first, last) of the model's (tensor parallelism), for per-head checkpoint scales.
    kv_head_range: tuple[int, int] = (0, 0)
    num_kv_heads_total: int = 0

    def cache_spec(self, dtype: torch.dtype) -> AttentionSpec:
        raise NotImplementedError

    def set_checkpoint_kv_scale(self, which: str, value: torch.Tensor, name: str) -> None:
        """Keep a checkpoint's ``k`` or ``v`` scale (checkpoint tensor ``name``: one value, or one per kv head of the
        model, this rank's taken) for an FP8 cache bound later."""
        t = value.detach().float().reshape(-1).cpu()
        if t.numel() == self.num_kv_heads_total and t.numel() > 1:
            t = t[self.kv_head_range[0]:self.kv_head_range[1]]
        elif t.numel() != 1:
            raise ValueError(f"{name} has {t.numel()} values; expected one (per tensor) or {self.num_kv_heads_total} "
                             "(per kv head)")
        _check_positive(name, t)
        scales = self.__dict__.setdefault("_checkpoint_kv_scales", {})
        if which in scales:
            raise ValueError(f"checkpoint has two {which} scales for {name.rsplit('.', 1)[0]}")
        scales[which] = t

    def bind_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache
        given = self.__dict__.get("_checkpoint_kv_scales", {})
        if k_cache.dtype == torch.float8_e4m3fn and self.k_scale is None:
            ones = torch.ones(1)
            self.set_kv_scales(given.get("k", ones), given.get("v", ones))

    def bind_index_cache(self, index_cache: torch.Tensor) -> None:
        self.index_cache = index_cache

    def set_kv_scales(self, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """Per-kv-head (or per-tensor: one value) scales of an FP8 cache; copied into the tensors the layer already
        holds (captured CUDA graphs read those)."""
        n = self.k_cache.shape[2] if self.k_cache is not None else None
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            t = t.detach().float().reshape(-1)
            if n is not None and t.numel() == 1:
                t = t.expand(n).clone()
            if n is not None and t.numel() != n:
                raise ValueError(f"{name} has {t.numel()} values; the layer has {n} kv heads (one value, or one each)")
            _check_positive(name, t)
            held = getattr(self, name)
            if held is not None and held.shape == t.shape:
                held.copy_(t)
            else:
                setattr(self, name, t.to(self.k_cache.device if self.k_cache is not None else t.device).contiguous())


def _check_positive(name: str, scale: torch.Tensor) -> None:
    if not bool((scale > 0).all()) or not bool(torch.isfinite(scale).all()):
        raise ValueError(f"{name} must be positive and finite (got {scale.tolist()})")


class RecurrentLayer(nn.Module):
    """A layer with fixed-size per-request state, read and written through each row's state slot.

    ``state[name]``: (pool entries, *shape) for each tensor of ``cache_spec``; ``verify_scratch[name]``:
    (verify rows, k + 1, *shape) for each tensor of ``verify_scratch_spec`` (speculative decoding only): by default
    the candidate state after each verified position; a layer may keep less there and rebuild a candidate from the
    slot's state (Gated DeltaNet keeps each position's inputs: ``hyserve.kernels.gdn.verify``).
    ``supports_row_snapshots``: the layer writes every tensor of its state at the positions of
    ``StepMetadata.row_snapshots`` during its forward (prefix-cache snapshots inside prefill rows); where a layer of
    the model does not, the scheduler ends rows at snapshot points instead.
    """

    supports_row_snapshots = False
    # A verify step whose rows all hold one token (no drafts: speculation length 0) advances this layer's slots in
    # place, as a decode step does: nothing is left to reject, so there is no candidate to keep and no commit. The
    # runner then skips the layer's commit and takes its candidate snapshots from the slots (``copy_slots``).
    verifies_one_token_rows_in_place = False

    def __init__(self) -> None:
        super().__init__()
        self.state: dict[str, torch.Tensor] = {}
        self.verify_scratch: dict[str, torch.Tensor] | None = None

    def cache_spec(self, dtype: torch.dtype) -> RecurrentStateSpec:
        raise NotImplementedError

    def verify_scratch_spec(self, dtype: torch.dtype) -> RecurrentStateSpec:
        """What the layer keeps per verify row and position: by default a candidate state (``cache_spec``)."""
        return self.cache_spec(dtype)

    def bind_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self.state = tensors

    def bind_verify_scratch(self, tensors: dict[str, torch.Tensor]) -> None:
        self.verify_scratch = tensors

    def commit_verified(self, state_slots: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """Verify row ``r`` with ``a = num_accepted[r] >= 0`` takes candidate ``a`` into slot ``state_slots[r]``;
        rows with ``a < 0`` keep their state. Slots of the rows are distinct. No host sync (a select, not a mask
        gather). Families with a fused kernel override this."""
        assert self.verify_scratch is not None, "verify scratch not bound"
        rows = torch.arange(state_slots.shape[0], device=state_slots.device)
        take = num_accepted.clamp(min=0)
        for name, live in self.state.items():
            cand = self.verify_scratch[name][rows, take]
            keep = (num_accepted >= 0).view(-1, *([1] * (cand.dim() - 1)))
            live.index_copy_(0, state_slots, torch.where(keep, cand, live.index_select(0, state_slots)))

    def copy_slots(self, rows: torch.Tensor, entries: torch.Tensor, state_slots: torch.Tensor) -> None:
        """Pool ``entries[i]`` takes the state of verify row ``rows[i]``'s slot as it is (a one-token verify step's
        candidate snapshot, for a layer that ``verifies_one_token_rows_in_place``)."""
        slots = state_slots.index_select(0, rows)
        for live in self.state.values():
            flat = entry_rows(live)  # unit stride in any memory order
            flat.index_copy_(0, entries, flat.index_select(0, slots))

    def snapshot_candidates(self, rows: torch.Tensor, positions: torch.Tensor, entries: torch.Tensor,
                            state_slots: torch.Tensor) -> None:
        """Pool ``entries[i]`` takes verify row ``rows[i]``'s candidate after position ``positions[i]``
        (``state_slots``: the verify rows' slots, indexed by row). Runs before the step's commit: a layer that
        rebuilds candidates reads the slots' states from before the step."""
        assert self.verify_scratch is not None, "verify scratch not bound"
        for name, live in self.state.items():
            live.index_copy_(0, entries, self.verify_scratch[name][rows, positions])


class CausalLM(nn.Module):
    """A decoder returning post-final-norm hidden states; ``compute_logits`` applies the LM head."""

    lm_head: nn.Linear

    def __init__(self) -> None:
        super().__init__()
        self._recurrent_layers: list[RecurrentLayer] | None = None

    def head_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the LM head reads of the forward's output rows: the rows themselves, or for a family whose forward
        returns several residual streams (``ModelConfig.residual_width``) their mix."""
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.head_input(hidden)).float()

    def drop_unused_embedding(self, draft_head: bool) -> None:
        """Release the input embedding where this pipeline stage does not read it (``draft_head``: the MTP head
        runs here and reads it); by default every model keeps it."""

    def holds(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` (model naming) is this model's: a pipeline stage holds only its own
        layers, and the loader skips the other stages' tensors."""
        return True

    def input_embeddings(self) -> nn.Embedding:
        raise NotImplementedError

    def activation_width(self) -> int:
        """The widest per-token activation of a forward (elements), for estimating graph memory."""
        raise NotImplementedError

    def attention_layers(self) -> list[KVCacheLayer]:
        return [m for m in self.modules() if isinstance(m, KVCacheLayer)]

    def recurrent_layers(self) -> list[RecurrentLayer]:
        # Walked once: commit and snapshot copies ask every step, and a module walk costs ~1 ms of host time.
        if self._recurrent_layers is None:
            self._recurrent_layers = [m for m in self.modules() if isinstance(m, RecurrentLayer)]
        return self._recurrent_layers

    def cache_specs(self, dtype: torch.dtype) -> CacheSpecs:
        """Each caching layer's spec, in module order (the order of ``bind_caches``' lists)."""
        return CacheSpecs(attention=tuple(layer.cache_spec(dtype) for layer in self.attention_layers()),
                          recurrent=tuple(layer.cache_spec(dtype) for layer in self.recurrent_layers()),
                          verify_scratch=tuple(layer.verify_scratch_spec(dtype) for layer in self.recurrent_layers()))

    def bind_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                    states: list[dict[str, torch.Tensor]],
                    index_caches: list[torch.Tensor | None] | None = None) -> None:
        """Give each layer its slice of the runner-owned pools (one entry per attention / recurrent layer);
        ``index_caches``: one entry per attention layer (None where its spec has no index keys), or None for none."""
        attn, rec = self.attention_layers(), self.recurrent_layers()
        if len(attn) != len(kv_caches) or len(rec) != len(states):
            raise ValueError("cache count does not match the model's layer pattern")
        if index_caches is not None and len(index_caches) != len(attn):
            raise ValueError("index cache count does not match the model's attention layers")
        for layer, (k, v) in zip(attn, kv_caches, strict=True):
            layer.bind_kv(k, v)
        for layer, index in zip(attn, index_caches or (), strict=False):
            if index is not None:
                layer.bind_index_cache(index)
        for rec_layer, tensors in zip(rec, states, strict=True):
            rec_layer.bind_state(tensors)

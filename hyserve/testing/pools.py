"""Kernel tests' pools laid out as the engine lays them: views into ``StatePool``'s rows of bytes (one row per entry,
every tensor of the entry in it; a GDN SSM state value-major), so a kernel that assumed entries ``numel`` apart or a
key-major head would read another entry's bytes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from hyserve.cache.specs import RecurrentStateSpec, StateTensorSpec
from hyserve.cache.state_pool import StatePool


def pool_views(tensors: dict[str, tuple[torch.Tensor, tuple[int, ...] | None]]) -> dict[str, torch.Tensor]:
    """Copies of ``(S, ...)`` pools (``name: (pool, memory order of its dims after the first, or None)``) as the
    views of one ``StatePool`` of ``S - 1`` slots (its pad entry last) that holds them all: the same values, the
    engine's strides (no tensor's entries ``numel`` apart when there are two or more)."""
    spec = RecurrentStateSpec(tuple(StateTensorSpec(n, tuple(t.shape[1:]), t.dtype, order)
                                    for n, (t, order) in tensors.items()))
    first = next(iter(tensors.values()))[0]
    layer = StatePool([spec], num_slots=first.shape[0] - 1, device=first.device).layers[0]
    for n, (t, _) in tensors.items():
        layer[n].copy_(t)
        assert len(tensors) == 1 or layer[n].stride(0) != t[0].numel()
    return layer


def on_pool_rows(conv_state: torch.Tensor, ssm_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A GDN layer's ``(S, C, K - 1)`` conv pool and ``(S, Hv, Dk, Dv)`` SSM pool as the engine's views, the SSM state
    value-major."""
    views = pool_views({"conv_state": (conv_state, None), "ssm_state": (ssm_state, (0, 2, 1))})
    return views["conv_state"], views["ssm_state"]


def same_strides(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in ``t``'s own strides (``clone`` makes a tensor whose entries are not dense contiguous)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)


def on_contiguous_copies(fn: Callable[[dict[str, Any]], torch.Tensor],
                         names: Sequence[str]) -> Callable[[dict[str, Any]], torch.Tensor]:
    """``fn`` run on contiguous (key-major, entries ``numel`` apart) copies of a problem's pools ``names``, the
    results copied back into the problem's own: a reference for a kernel that reads the pools in their layout."""
    def run(p: dict[str, Any]) -> torch.Tensor:
        cp = {**p, **{n: p[n].contiguous() for n in names}}
        out = fn(cp)
        for n in names:
            p[n].copy_(cp[n])
        return out

    return run

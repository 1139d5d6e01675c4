"""Kernel tests' pools laid out as the engine lays them: a GDN layer's conv window and SSM state as views into
``StatePool``'s rows of bytes (one row per entry, every tensor of the entry in it, the SSM state value-major), so a
kernel that assumed entries ``numel`` apart or a key-major head would read another entry's bytes."""

from __future__ import annotations

import torch

from hyserve.cache.specs import RecurrentStateSpec, StateTensorSpec
from hyserve.cache.state_pool import StatePool


def on_pool_rows(conv_state: torch.Tensor, ssm_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of an ``(S, C, K - 1)`` conv pool and an ``(S, Hv, Dk, Dv)`` SSM pool in one ``StatePool`` of ``S - 1``
    slots (its pad entry last): the same values, the engine's strides."""
    spec = RecurrentStateSpec((StateTensorSpec("conv_state", tuple(conv_state.shape[1:]), conv_state.dtype),
                               StateTensorSpec("ssm_state", tuple(ssm_state.shape[1:]), ssm_state.dtype, (0, 2, 1))))
    layer = StatePool([spec], num_slots=conv_state.shape[0] - 1, device=conv_state.device).layers[0]
    layer["conv_state"].copy_(conv_state)
    layer["ssm_state"].copy_(ssm_state)
    assert layer["conv_state"].stride(0) != conv_state[0].numel() != 0 and layer["ssm_state"].stride(2) == 1
    return layer["conv_state"], layer["ssm_state"]


def same_strides(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in ``t``'s own strides (``clone`` makes a tensor whose entries are not dense contiguous)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)

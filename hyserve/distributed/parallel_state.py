"""This process's place in the tensor-parallel group, and the group's collectives (torch.distributed: gloo on the
CPU, NCCL on CUDA).

A worker joins the group before it builds its model (``init_tensor_parallel``); layers read ``tp_rank()`` and
``tp_size()`` when they are built to size their shards. Outside a worker (the engine's process, the tests' meta
models) the group is a group of one, and every collective is the identity.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

_TP_RANK = 0
_TP_SIZE = 1


# A collective that waits longer than this fails instead of hanging (a peer died or stopped answering); the engine
# notices a dead worker sooner, by its process (hyserve.executor.multiproc).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


def init_tensor_parallel(rank: int, world_size: int, init_method: str, device: torch.device) -> None:
    """Join the group of ``world_size`` workers (this one is ``rank``) at ``init_method`` (e.g. tcp://host:port)."""
    global _TP_RANK, _TP_SIZE
    if world_size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=COLLECTIVE_TIMEOUT)
    _TP_RANK, _TP_SIZE = rank, world_size


def tp_rank() -> int:
    return _TP_RANK


def tp_size() -> int:
    return _TP_SIZE


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the group, in place (the identity in a group of one)."""
    if _TP_SIZE > 1:
        dist.all_reduce(x)
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """The ranks' ``x`` side by side along the last dimension, in rank order (``x`` itself in a group of one)."""
    if _TP_SIZE == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def shard_range(total: int, rank: int | None = None, size: int | None = None) -> tuple[int, int]:
    """[start, end) of rank's equal share of ``total`` items (heads, channels); ``total`` must divide."""
    rank = _TP_RANK if rank is None else rank
    size = _TP_SIZE if size is None else size
    if total % size:
        raise ValueError(f"{total} does not split over {size} tensor-parallel ranks")
    n = total // size
    return rank * n, (rank + 1) * n

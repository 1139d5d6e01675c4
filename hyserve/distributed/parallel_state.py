"""This process's place among the workers, and their collectives (torch.distributed: gloo on the CPU, NCCL on CUDA).

``world = tensor_parallel_size x pipeline_parallel_size`` workers; global rank ``r`` is tensor-parallel rank
``r % T`` of pipeline stage ``r // T`` (vLLM's order: the ranks of one stage are adjacent, so a stage's all-reduces
stay on one host when T GPUs are one node). A stage's T ranks form its tensor-parallel group; rank ``r`` sends its
stage's output (hidden states and residuals) to ``r + T`` and receives its input from ``r - T``.

A worker joins before it builds its model (``init_distributed``); layers read ``tp_rank()`` / ``tp_size()`` to size
their shards and the model reads ``pp_rank()`` / ``pp_size()`` / ``stage_layers()`` to build only its stage's
layers. Outside a worker (the engine's process, the tests' meta models) there is one rank, one stage, and every
collective is the identity.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

_TP_RANK = 0
_TP_SIZE = 1
_PP_RANK = 0
_PP_SIZE = 1
_TP_GROUP: dist.ProcessGroup | None = None  # None: the default group (one stage), or no group (one rank)
_STAGE_LAYERS: tuple[int, int] | None = None  # [start, end) of this stage's decoder layers; None: all of them
_EXPERT_PARALLEL = False  # routed experts placed whole on the tensor-parallel ranks (--enable-expert-parallel)

# A collective that waits longer than this fails instead of hanging (a peer died or stopped answering); the engine
# notices a dead worker sooner, by its process (hyserve.executor.multiproc).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


def layer_partition(num_layers: int, pp: int, partition: list[int] | None = None) -> list[int]:
    """Decoder layers per stage: ``partition`` checked (``pp`` positive entries summing to ``num_layers``), or an
    even split whose remainder goes to the stages before the last (which also holds the norm and LM head)."""
    if partition is not None:
        if len(partition) != pp:
            raise ValueError(f"pp_layer_partition {','.join(map(str, partition))} has {len(partition)} entries for "
                             f"pipeline_parallel_size={pp}; give one layer count per stage")
        if any(n < 1 for n in partition):
            raise ValueError(f"pp_layer_partition {','.join(map(str, partition))}: every stage needs at least one "
                             "layer")
        if sum(partition) != num_layers:
            raise ValueError(f"pp_layer_partition {','.join(map(str, partition))} sums to {sum(partition)} layers "
                             f"but the model has num_hidden_layers={num_layers}")
        return list(partition)
    if pp > num_layers:
        raise ValueError(f"pipeline_parallel_size={pp} is more than the model's num_hidden_layers={num_layers}")
    parts = [num_layers // pp] * pp
    for i in range(num_layers % pp):
        parts[-2 - i if pp > 1 else 0] += 1
    return parts


def stage_range(partition: list[int], stage: int) -> tuple[int, int]:
    start = sum(partition[:stage])
    return start, start + partition[stage]


def init_distributed(rank: int, tp: int, pp: int, init_method: str, device: torch.device,
                     partition: list[int] | None = None, expert_parallel: bool = False) -> None:
    """Join the group of ``tp x pp`` workers (this one is global ``rank``) at ``init_method`` (tcp://host:port or
    env://); ``partition``: the decoder layers of each stage (``layer_partition``); ``expert_parallel``: MoE
    layers place whole experts on the tensor-parallel ranks instead of slicing each (``expert_parallel()``)."""
    global _TP_RANK, _TP_SIZE, _PP_RANK, _PP_SIZE, _TP_GROUP, _STAGE_LAYERS, _EXPERT_PARALLEL
    world = tp * pp
    if world > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        # NCCL with device_id: the communicator is formed here, on this rank's GPU (an error shows at startup, not
        # at the first collective, which may be inside a CUDA graph capture), and the stages' tensor-parallel
        # groups are split from it (ncclCommSplit) rather than built anew.
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                                timeout=COLLECTIVE_TIMEOUT, device_id=device if backend == "nccl" else None)
    _TP_RANK, _PP_RANK = rank % tp, rank // tp
    _TP_SIZE, _PP_SIZE = tp, pp
    _EXPERT_PARALLEL = expert_parallel
    _TP_GROUP = None
    if pp > 1 and tp > 1:  # every rank creates every stage's group, in the same order
        for stage in range(pp):
            group = dist.new_group(list(range(stage * tp, (stage + 1) * tp)))
            if stage == _PP_RANK:
                _TP_GROUP = group
    _STAGE_LAYERS = None
    if pp > 1:
        assert partition is not None and len(partition) == pp, "a pipeline stage needs the layer partition"
        _STAGE_LAYERS = stage_range(partition, _PP_RANK)


def shutdown_distributed() -> None:
    """Leave the group (a worker's last act when told to stop): NCCL's communicators are freed before the process
    exits rather than at interpreter teardown, and the rank forgets its place."""
    global _TP_RANK, _TP_SIZE, _PP_RANK, _PP_SIZE, _TP_GROUP, _STAGE_LAYERS, _EXPERT_PARALLEL
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP_RANK, _TP_SIZE, _PP_RANK, _PP_SIZE, _TP_GROUP, _STAGE_LAYERS = 0, 1, 0, 1, None, None
    _EXPERT_PARALLEL = False


def tp_rank() -> int:
    return _TP_RANK


def tp_size() -> int:
    return _TP_SIZE


def expert_parallel() -> bool:
    """Whether MoE layers place whole experts on the tensor-parallel ranks (asked for, and more than one rank)."""
    return _EXPERT_PARALLEL and _TP_SIZE > 1


def pp_rank() -> int:
    return _PP_RANK


def pp_size() -> int:
    return _PP_SIZE


def is_first_stage() -> bool:
    return _PP_RANK == 0


def is_last_stage() -> bool:
    return _PP_RANK == _PP_SIZE - 1


def stage_layers(num_layers: int) -> tuple[int, int]:
    """[start, end) of the decoder layers this stage holds (all of them with one stage)."""
    return (0, num_layers) if _STAGE_LAYERS is None else _STAGE_LAYERS


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel group, in place (the identity in a group of one)."""
    if _TP_SIZE > 1:
        dist.all_reduce(x, group=_TP_GROUP)
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """The ranks' ``x`` side by side along the last dimension, in rank order (``x`` itself in a group of one)."""
    if _TP_SIZE == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    return torch.cat(parts, dim=-1)


def shard_range(total: int, rank: int | None = None, size: int | None = None) -> tuple[int, int]:
    """[start, end) of rank's equal share of ``total`` items (heads, channels); ``total`` must divide."""
    rank = _TP_RANK if rank is None else rank
    size = _TP_SIZE if size is None else size
    if total % size:
        raise ValueError(f"{total} does not split over {size} tensor-parallel ranks")
    n = total // size
    return rank * n, (rank + 1) * n


class StageLink:
    """A stage's point-to-point link to its neighbours: the previous stage's output in, this stage's out.

    One tensor per step each way, (tokens, parts, width): the model's handover (``ModelConfig.stage_handover_parts``:
    Qwen3.5's [residual stream, pending MLP output], Qwen4-Exp's streams alone) stacked; steps are sent and
    received in the order every stage runs them, so message n is step n's. Sends are asynchronous (the stage goes
    on with its next step); a send's tensor is kept until the send completes.
    """

    def __init__(self) -> None:
        self.prev = (_PP_RANK - 1) * _TP_SIZE + _TP_RANK if _PP_RANK > 0 else None
        self.next = (_PP_RANK + 1) * _TP_SIZE + _TP_RANK if _PP_RANK < _PP_SIZE - 1 else None
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []

    def recv_into(self, buf: torch.Tensor) -> None:
        """The previous stage's output of this step into ``buf`` (tokens, parts, width), contiguous."""
        assert self.prev is not None, "the first stage receives nothing"
        assert buf.is_contiguous()
        dist.recv(buf, src=self.prev)

    def send(self, *parts: torch.Tensor) -> None:
        assert self.next is not None, "the last stage sends nothing"
        self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]
        buf = torch.stack(parts, dim=1)
        work = dist.isend(buf, dst=self.next)
        assert work is not None
        self._sends.append((work, buf))

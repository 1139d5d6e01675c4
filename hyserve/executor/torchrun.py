"""Workers started by ``torchrun`` (``distributed_executor_backend="torchrun"``), one per rank, on one or more nodes.

Every process runs the same command, e.g. on each of N nodes::

    torchrun --nnodes N --node-rank R --master-addr A --master-port P --nproc-per-node G \\
        -m hyserve.cli serve MODEL --tensor-parallel-size N*G --distributed-executor-backend torchrun

Rank 0 builds the engine (scheduler, and for ``serve`` the HTTP server) with its own worker in its process; every
other rank builds its worker and serves it (``serve_rank``) until rank 0 stops, then exits. Rank 0 sends each step
and RPC to the others over a gloo group (``broadcast_object_list``: plain data only, as everywhere across the seam);
the tensors move inside the model's own collectives (NCCL on CUDA, gloo on the CPU). RPC answers come back with
``all_gather_object``, so ``determine_available_memory`` is the minimum over every rank.

With pipeline parallelism rank 0 runs the first stage and the step's result is the output rank's (the first rank of
the last stage): that rank sends each step's ``RunnerOutput`` to rank 0 (``send_object_list`` on a gloo group of
the two) from a thread of its own, so that it goes on receiving the next steps while rank 0 has not read the result
yet (several micro-batches in flight); rank 0 reads them in step order.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import sys
import threading
from collections import deque
from typing import Any

import torch.distributed as dist

from hyserve.executor.base import Executor, StepHandle
from hyserve.scheduler.output import RunnerOutput, SchedulerOutput
from hyserve.worker.worker import Worker

logger = logging.getLogger("hyserve")


def torchrun_rank() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; ValueError outside a torchrun launch."""
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    except KeyError as e:
        raise ValueError(f"distributed_executor_backend='torchrun' needs the process to be started by torchrun "
                         f"({e.args[0]} is not set); use 'mp' to let the engine start its workers") from None


def _worker(worker_args: tuple[Any, ...], worker_kwargs: dict[str, Any], world_size: int, output_rank: int
            ) -> tuple[Worker, Any, Any]:
    rank, size, local = torchrun_rank()
    if size != world_size:
        raise ValueError(f"torchrun started {size} processes but tensor_parallel_size x pipeline_parallel_size is "
                         f"{world_size}; they must be equal (--nnodes x --nproc-per-node)")
    worker = Worker(*worker_args, **{**worker_kwargs, "rank": rank, "world_size": size, "local_rank": local,
                                     "dist_init_method": "env://"})
    control = dist.new_group(backend="gloo") if size > 1 else None
    results = dist.new_group([0, output_rank], backend="gloo") if output_rank else None
    return worker, control, results


class TorchrunExecutor(Executor):
    """Rank 0's side: its own worker here, every message also sent to the other ranks."""

    def __init__(self, world_size: int, worker_args: tuple[Any, ...], worker_kwargs: dict[str, Any],
                 output_rank: int = 0) -> None:
        self.worker: Worker | None
        self.output_rank = output_rank
        self.worker, self._control, self._results = _worker(worker_args, worker_kwargs, world_size, output_rank)
        self.world_size = world_size
        self._unread: deque[_RemoteResult] = deque()  # steps whose result the output rank sends, in step order
        atexit.register(self.shutdown)  # the other ranks stop with this process however it ends normally

    def _send(self, message: tuple[Any, ...]) -> None:
        if self._control is not None:
            dist.broadcast_object_list([message], src=0, group=self._control)

    def _driver(self) -> Worker:
        if self.worker is None:
            raise RuntimeError("this executor was shut down")
        return self.worker

    def collective_rpc(self, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
                       ) -> list[Any]:
        worker = self._driver()
        while self._unread:  # the output rank sends every step's result before it answers an RPC
            self._unread[0].result()
        self._send(("rpc", method, args, kwargs or {}))
        answer = getattr(worker, method)(*args, **(kwargs or {}))
        if self._control is None:
            return [answer]
        answers: list[Any] = [None] * self.world_size
        dist.all_gather_object(answers, answer, group=self._control)
        return answers

    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        return self.execute_model_async(scheduler_output).result()

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> StepHandle:
        worker = self._driver()
        self._send(("step", scheduler_output))
        own = worker.execute_model_async(scheduler_output)
        if not self.output_rank:
            return own
        handle = _RemoteResult(self, scheduler_output.step_id)
        self._unread.append(handle)
        return handle

    def _recv_result(self, handle: _RemoteResult) -> RunnerOutput:
        """Results arrive in step order: read up to ``handle``'s."""
        while True:
            first = self._unread.popleft()
            box: list[Any] = [None]
            dist.recv_object_list(box, src=self.output_rank, group=self._results)
            first._out = box[0]
            if first is handle:
                assert box[0].step_id == handle.step_id, "results arrive in step order"
                return box[0]

    def shutdown(self) -> None:
        if self.worker is None:
            return
        while self._unread:  # the output rank's sender finishes before it stops
            self._unread[0].result()
        self.worker = None
        self._send(("stop",))
        if dist.is_initialized():
            dist.destroy_process_group()


class _RemoteResult:
    """A step's result that the output rank sends to rank 0."""

    def __init__(self, executor: TorchrunExecutor, step_id: int) -> None:
        self._executor = executor
        self.step_id = step_id
        self._out: RunnerOutput | None = None

    def result(self) -> RunnerOutput:
        if self._out is None:
            self._out = self._executor._recv_result(self)
        return self._out


def serve_rank(world_size: int, worker_args: tuple[Any, ...], worker_kwargs: dict[str, Any],
               output_rank: int = 0) -> None:
    """A rank other than 0: build the worker, run what rank 0 sends until it says stop, then end the process."""
    worker, control, results = _worker(worker_args, worker_kwargs, world_size, output_rank)
    rank = torchrun_rank()[0]
    outbox: queue.Queue[RunnerOutput] | None = None
    if rank == output_rank and output_rank:
        outbox = queue.Queue()
        threading.Thread(target=_send_results, args=(outbox, results), daemon=True,
                         name="hyserve-results").start()
    logger.info("rank %d of %d: serving its worker until rank 0 stops", rank, world_size)
    while True:
        box: list[Any] = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=control)
        except RuntimeError as e:  # rank 0 went away without saying stop
            logger.error("rank %d: lost rank 0 (%s); exiting", rank, str(e).splitlines()[0])
            sys.exit(1)
        message = box[0]
        if message[0] == "stop":
            break
        if message[0] == "step":
            result = worker.execute_model(message[1])
            if outbox is not None:
                outbox.put(result)
        else:
            if outbox is not None:
                outbox.join()  # every step's result is with rank 0 before the RPC's answer
            _, method, args, kwargs = message
            dist.all_gather_object([None] * world_size, getattr(worker, method)(*args, **kwargs), group=control)
    dist.destroy_process_group()
    logger.info("rank %d: rank 0 stopped; exiting", rank)
    sys.exit(0)


def _send_results(outbox: queue.Queue[RunnerOutput], group: Any) -> None:
    """The output rank's sender: each step's result to rank 0, in step order, as rank 0 reads them."""
    while True:
        result = outbox.get()
        try:
            dist.send_object_list([result], dst=0, group=group)
        except RuntimeError as e:  # rank 0 went away
            logger.error("lost rank 0 while sending step %d's result (%s)", result.step_id, str(e).splitlines()[0])
            os._exit(1)
        finally:
            outbox.task_done()

"""The seam between the engine (scheduler, ids and ints) and the workers (device, model, caches, graphs).

An executor runs ``SchedulerOutput``s on its workers and returns ``RunnerOutput``s. Everything that crosses it is
plain data (``hyserve.scheduler.output``), so a worker can live in another process: in this one (``uniproc``), in
processes the engine starts (``multiproc``) or in processes torchrun started (``torchrun``). ``cache_infos`` and
``determine_available_memory`` come from every rank, and the engine plans a layout all of them hold
(``hyserve.cache.planner.plan_caches_for_ranks``); ``collective_rpc`` calls a method on every worker and returns
their answers in rank order; a step's result is the ``output_rank``'s answer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

from hyserve.cache.planner import CacheInfo, CacheLayout
from hyserve.scheduler.output import RunnerOutput, SchedulerOutput


class StepHandle(Protocol):
    """A step launched on the workers; ``result()`` waits for its ``RunnerOutput`` (and only for it)."""

    def result(self) -> RunnerOutput: ...


class Executor(ABC):
    # The rank whose answer is a step's result: the first rank of the last pipeline stage (it samples).
    output_rank: int = 0

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
                       ) -> list[Any]:
        """``worker.<method>(*args, **kwargs)`` on every worker; the answers in rank order."""

    def determine_available_memory(self) -> int:
        return min(self.collective_rpc("determine_available_memory"))

    def cache_infos(self) -> list[CacheInfo]:
        """Each rank's cache needs, in rank order (pipeline stages differ: each caches its own layers)."""
        return list(self.collective_rpc("cache_info"))

    def initialize_cache(self, layout: CacheLayout, max_model_len: int) -> None:
        self.collective_rpc("initialize_cache", (layout, max_model_len))

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Run one step on the workers; the driver worker's result."""

    @abstractmethod
    def execute_model_async(self, scheduler_output: SchedulerOutput) -> StepHandle:
        """Launch one step on the workers and return at once (async scheduling): the next step may be launched
        before this one's result is read; the workers run steps in the order they are launched."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release the workers (idempotent)."""

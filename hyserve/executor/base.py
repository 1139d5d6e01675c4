"""The seam between the engine (scheduler, ids and ints) and the workers (device, model, caches, graphs).

An executor runs ``SchedulerOutput``s on its workers and returns ``RunnerOutput``s. Everything that crosses it is
plain data (``hyserve.scheduler.output``), so a worker can live in another process; the in-process executor
(``uniproc``) is the only one today. ``determine_available_memory`` is the cache budget of the smallest worker (what
every worker can hold); ``collective_rpc`` calls a method on every worker and returns their answers in rank order.
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
    @abstractmethod
    def collective_rpc(self, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
                       ) -> list[Any]:
        """``worker.<method>(*args, **kwargs)`` on every worker; the answers in rank order."""

    def determine_available_memory(self) -> int:
        return min(self.collective_rpc("determine_available_memory"))

    def cache_info(self) -> CacheInfo:
        infos = self.collective_rpc("cache_info")
        return infos[0]

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

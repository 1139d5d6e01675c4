"""The in-process executor: one worker in this process, called directly."""

from __future__ import annotations

from typing import Any

from hyserve.executor.base import Executor, StepHandle
from hyserve.scheduler.output import RunnerOutput, SchedulerOutput
from hyserve.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, worker: Worker) -> None:
        self.worker: Worker | None = worker

    @property
    def driver_worker(self) -> Worker:
        if self.worker is None:
            raise RuntimeError("this executor was shut down")
        return self.worker

    def collective_rpc(self, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
                       ) -> list[Any]:
        return [getattr(self.driver_worker, method)(*args, **(kwargs or {}))]

    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        return self.driver_worker.execute_model(scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> StepHandle:
        return self.driver_worker.execute_model_async(scheduler_output)

    def shutdown(self) -> None:
        self.worker = None

"""Executors for tests."""

from __future__ import annotations

from typing import Any


class PicklingExecutor:
    """Test executor: every ``SchedulerOutput`` and ``RunnerOutput`` crosses the seam as bytes (``pickle``), as it
    would to a worker in another process; it refuses a message that carries a tensor or a live request.

    Built like ``UniProcExecutor`` (tests substitute it for the engine's executor class).
    """

    FORBIDDEN = (b"torch", b"hyserve.request")

    def __init__(self, worker: Any) -> None:
        from hyserve.executor.uniproc import UniProcExecutor

        self._inner = UniProcExecutor(worker)
        self.num_messages = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_inner"], name)

    def _cross(self, obj: Any) -> Any:
        import pickle

        data = pickle.dumps(obj)
        bad = [f.decode() for f in self.FORBIDDEN if f in data]
        if bad:
            raise AssertionError(f"{type(obj).__name__} is not plain data: it pickles {bad}")
        self.num_messages += 1
        return pickle.loads(data)

    def execute_model(self, scheduler_output: Any) -> Any:
        return self._cross(self._inner.execute_model(self._cross(scheduler_output)))

    def execute_model_async(self, scheduler_output: Any) -> Any:
        handle = self._inner.execute_model_async(self._cross(scheduler_output))
        executor = self

        class Handle:
            def result(self) -> Any:
                return executor._cross(handle.result())

        return Handle()


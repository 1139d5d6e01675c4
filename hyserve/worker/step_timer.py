"""Each step's own time on the device, for the speculation-length policy (``hyserve.speculative.adaptive``).

The host's interval between two results is not a step's time: with steps in flight the host may launch the next
step (an eager prompt step, for long) before it reads a result, and that interval then holds the other step's
work. On CUDA two timing events bracket what a step enqueues on the compute stream; the start fires when the stream
reaches it (after the step before), so their distance is the step's device time. They are read once the end has
completed (``query``, no sync), which is a later step's result for an asynchronous step. On the CPU a step runs
inside its launch, and its time is its execution's, reported with its own result.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import torch

MAX_PENDING = 64  # steps whose end has not completed yet (older ones are dropped unreported)


class StepTimer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._start: Any = None
        self._pending: deque[tuple[int, Any, Any]] = deque()  # (step id, start, end) on CUDA
        self._done: list[tuple[int, float]] = []

    def begin(self) -> None:
        """Before the step enqueues anything."""
        if self.cuda:
            if torch.cuda.is_current_stream_capturing():
                self._start = None
                return
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def end(self, step_id: int) -> None:
        """After the step enqueued its last work."""
        start, self._start = self._start, None
        if start is None:
            return
        if not self.cuda:
            self._done.append((step_id, time.perf_counter() - start))
            return
        stop = torch.cuda.Event(enable_timing=True)
        stop.record()
        self._pending.append((step_id, start, stop))
        if len(self._pending) > MAX_PENDING:
            self._pending.popleft()

    def take(self) -> list[tuple[int, float]]:
        """(step id, seconds) of the steps whose time is known now and was not reported yet, oldest first."""
        while self._pending and self._pending[0][2].query():
            step_id, start, stop = self._pending.popleft()
            self._done.append((step_id, start.elapsed_time(stop) / 1e3))
        done, self._done = self._done, []
        return done

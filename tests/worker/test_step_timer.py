"""``hyserve.worker.step_timer``: each step's own time, for the speculation-length policy. On the CPU a step's time
is its execution's, reported with its own result; on CUDA the device time between two events, reported once its
end has completed (with a later step's result), each step once, oldest first; a step captured into a graph is not
timed."""

from __future__ import annotations

import time

import pytest
import torch

from hyserve.worker.step_timer import MAX_PENDING, StepTimer


def test_a_cpu_step_reports_its_execution_time_with_its_own_result() -> None:
    timer = StepTimer(torch.device("cpu"))
    timer.begin()
    time.sleep(0.02)
    timer.end(7)
    timer.begin()
    timer.end(8)
    got = timer.take()
    assert [s for s, _ in got] == [7, 8] and got[0][1] >= 0.02 and got[1][1] < 0.02
    assert timer.take() == []  # each step once


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_step_reports_its_device_time_once_it_completed() -> None:
    """A step that waits on the device 20 ms behind a host sleep of 50 ms: its time is the device's, not the
    host's; a step whose end has not completed is not reported yet."""
    timer = StepTimer(torch.device("cuda"))
    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    timer.begin()
    torch.cuda._sleep(20_000_000)  # about 10-20 ms of device time
    timer.end(1)
    time.sleep(0.05)
    timer.begin()
    for _ in range(50):
        a = a @ a / 64
    timer.end(2)
    first = timer.take()
    torch.cuda.synchronize()
    rest = timer.take()
    got = dict(first + rest)
    assert [s for s, _ in first + rest] == [1, 2] and 0.0 < got[1] < 0.05 and got[2] > 0.0
    for i in range(MAX_PENDING + 5):
        timer.begin()
        timer.end(100 + i)
    torch.cuda.synchronize()
    assert len(timer.take()) == MAX_PENDING  # the oldest dropped unreported

"""A worker: one device, the model on it, every cache tensor, the step buffers and the CUDA graphs.

It answers the executor's calls (``hyserve.executor``): what it can hold, the cache layout to allocate, and steps
to run. It keeps no request state beyond each request's sampling parameters and the ids it sampled last step (for
async scheduling); everything else arrives with the step.
"""

from __future__ import annotations

import torch

from hyserve.cache.planner import CacheInfo, CacheLayout
from hyserve.config import EngineConfig, ModelConfig
from hyserve.scheduler.output import RunnerOutput, SchedulerOutput
from hyserve.worker.model_runner import ModelRunner, StepResult


class Worker:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, device: torch.device, dtype: torch.dtype,
                 num_speculative_tokens: int = 0, use_mtp: bool = False) -> None:
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)
        self.device = device
        self.runner = ModelRunner(config, model_config, device, dtype, num_speculative_tokens=num_speculative_tokens,
                                  use_mtp=use_mtp)

    def cache_info(self) -> CacheInfo:
        return self.runner.cache_info()

    def determine_available_memory(self) -> int:
        return self.runner.determine_available_memory()

    def initialize_cache(self, layout: CacheLayout, max_model_len: int) -> None:
        self.runner.initialize_cache(layout, max_model_len)

    def execute_model(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> StepResult:
        return self.runner.execute_model_async(scheduler_output)

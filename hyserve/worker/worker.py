"""A worker: one device, the model on it, every cache tensor, the step buffers and the CUDA graphs.

It answers the executor's calls (``hyserve.executor``): what it can hold, the cache layout to allocate, and steps
to run. It keeps no request state beyond each request's sampling parameters and the ids it sampled last step (for
async scheduling); everything else arrives with the step.
"""

from __future__ import annotations

import torch

from hyserve.cache.planner import CacheInfo, CacheLayout
from hyserve.config import EngineConfig, ModelConfig
from hyserve.distributed.parallel_state import init_tensor_parallel
from hyserve.scheduler.output import RunnerOutput, SchedulerOutput
from hyserve.worker.model_runner import ModelRunner, StepResult


class Worker:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, device: torch.device, dtype: torch.dtype,
                 num_speculative_tokens: int = 0, use_mtp: bool = False, rank: int = 0, world_size: int = 1,
                 dist_init_method: str | None = None, local_rank: int | None = None) -> None:
        if device.type == "cuda" and world_size > 1:  # one GPU per rank: its index on this node
            device = torch.device("cuda", rank if local_rank is None else local_rank)
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)
        self.device = device
        self.rank = rank
        # Tensor parallel: join the group before the model is built (its layers size their shards by it).
        if world_size > 1:
            assert dist_init_method is not None, "a tensor-parallel worker needs the group's address"
        init_tensor_parallel(rank, world_size, dist_init_method or "", device)
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

    def graph_replays(self) -> dict[str, int]:
        """Replays so far per graph kind (empty without graphs): for tests and tools across the process boundary."""
        graphs = self.runner.graphs
        return {} if graphs is None else {name: g.num_replays for name, g in graphs.sets.items()}

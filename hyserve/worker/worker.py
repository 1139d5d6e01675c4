"""A worker: one device, the model on it, every cache tensor, the step buffers and the CUDA graphs.

It answers the executor's calls (``hyserve.executor``): what it can hold, the cache layout to allocate, and steps
to run. It keeps no request state beyond each request's sampling parameters and the ids it sampled last step (for
async scheduling); everything else arrives with the step.
"""

from __future__ import annotations

import torch

from hyserve.cache.planner import CacheInfo, CacheLayout
from hyserve.config import EngineConfig, ModelConfig
from hyserve.distributed.parallel_state import init_distributed, layer_partition, shutdown_distributed
from hyserve.scheduler.output import RunnerOutput, SchedulerOutput
from hyserve.worker.model_runner import ModelRunner
from hyserve.worker.step_result import StepResult


class Worker:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, device: torch.device, dtype: torch.dtype,
                 num_speculative_tokens: int = 0, use_mtp: bool = False, rank: int = 0, world_size: int = 1,
                 dist_init_method: str | None = None, local_rank: int | None = None,
                 max_steps_in_flight: int = 1, spec_lengths: tuple[int, ...] = (),
                 synthetic_rates: tuple[float, ...] | None = None) -> None:
        if device.type == "cuda" and world_size > 1:  # one GPU per rank: its index on this node
            device = torch.device("cuda", rank if local_rank is None else local_rank)
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)
        self.device = device
        self.rank = rank
        # Join the group before the model is built: its layers size their shards by the tensor-parallel rank, and
        # it builds only the layers of its pipeline stage.
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        if world_size != tp * pp:
            raise ValueError(f"{world_size} workers for tensor_parallel_size={tp} x pipeline_parallel_size={pp}")
        if world_size > 1:
            assert dist_init_method is not None, "a worker of several needs the group's address"
        partition = layer_partition(model_config.num_hidden_layers, pp, config.pp_layer_partition) if pp > 1 \
            else None
        init_distributed(rank, tp, pp, dist_init_method or "", device, partition,
                         expert_parallel=config.enable_expert_parallel)
        self.runner = ModelRunner(config, model_config, device, dtype, num_speculative_tokens=num_speculative_tokens,
                                  use_mtp=use_mtp, max_steps_in_flight=max_steps_in_flight,
                                  spec_lengths=spec_lengths, synthetic_rates=synthetic_rates)

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

    def held_requests(self) -> list[str]:
        """The ids of the requests this worker keeps anything of (sampling parameters, images), sorted."""
        return self.runner.held_requests()

    def encoder_cache_stats(self) -> dict[str, int]:
        """The vision tower's outputs on this worker: images encoded, images brought back from the host tier, the
        entries each tier holds (``MMInputs``)."""
        return self.runner.mm.encoder_cache_stats()

    def num_uncommitted_steps(self) -> int:
        """Verify steps whose accepted counts this stage has not applied yet (tests: nothing left behind)."""
        return self.runner.num_uncommitted_steps

    def shutdown(self) -> None:
        """Leave the workers' group (torch.distributed), once the engine has stopped sending steps."""
        shutdown_distributed()

    def weight_bytes(self) -> dict[str, object]:
        """This rank's weights: planned before loading, and held (``ModelRunner.weight_bytes``)."""
        return self.runner.weight_bytes()

    def graph_replays(self) -> dict[str, int]:
        """Replays so far per graph kind (empty without graphs): for tests and tools across the process boundary."""
        graphs = self.runner.graphs
        return {} if graphs is None else {name: g.num_replays for name, g in graphs.sets.items()}

"""The step-level engine: admit requests, run scheduled steps, turn sampled tokens into outputs.

``step()`` returns a ``RequestOutput`` for every request that ran or finished in that step, shaped by its
``SamplingParams.output_kind``: the cumulative token ids and text so far (vLLM's default), only what is new (DELTA)
or nothing until it finishes (FINAL_ONLY). Sampled and verified tokens alike go through the one
``OutputProcessor`` (detokenization, stop checks, outputs).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections import deque
from typing import Any

import torch

from hyserve.cache.block_pool import BlockPool
from hyserve.cache.planner import CacheInfo, cache_memory_flag, plan_caches_for_ranks, snapshots_held_while_decoding
from hyserve.cache.prefix_cache import PrefixCache
from hyserve.cache.state_slots import StateSlots
from hyserve.config import (
    DEFAULT_MAX_NUM_SEQS,
    MM_MODALITIES,
    EngineConfig,
    apply_cpu_threads,
    default_max_num_batched_tokens,
    resolve_dtype,
    resolve_ssm_state_dtype,
)
from hyserve.distributed.parallel_state import layer_partition
from hyserve.engine.metrics import EngineMetrics, StatsLogger
from hyserve.engine.output_processor import NewTokens, OutputProcessor
from hyserve.engine.parallel_sampling import ParentRequest, ParentRequests, child_params
from hyserve.engine.request_metrics import RequestMetrics
from hyserve.executor.base import Executor, StepHandle
from hyserve.executor.uniproc import UniProcExecutor
from hyserve.model.registry import load_model_config
from hyserve.multimodal.image import ImageProcessorSettings, load_image
from hyserve.multimodal.inputs import MultimodalPrompt, build_multimodal_prompt
from hyserve.multimodal.processor_cache import GIB, ProcessorCache
from hyserve.outputs import RequestOutput
from hyserve.request import Request
from hyserve.sampling_params import SamplingParams
from hyserve.scheduler.output import RunnerOutput, SchedulerOutput
from hyserve.scheduler.scheduler import Scheduler
from hyserve.speculative.config import SpeculativeConfig
from hyserve.speculative.drafts import DraftManager
from hyserve.speculative.proposer import Proposer
from hyserve.structured_output.manager import StructuredOutputs
from hyserve.tokenizer import (
    UNSUPPORTED_GENERATION_KEYS,
    Tokenizer,
    generation_defaults,
    stop_token_ids,
)
from hyserve.worker.model_runner import ModelRunner
from hyserve.worker.worker import Worker

logger = logging.getLogger("hyserve")
# Tries at starting the worker processes when their group's port is taken in between (another process on the host).
PORT_ATTEMPTS = 3
MAX_UNTIMED_STEPS = 64  # steps waiting for the workers' time of them (older ones are forgotten)

PromptType = str | dict[str, Any] | list[int]


def has_raw_images(prompt: PromptType) -> bool:
    """``prompt`` carries images not processed yet (``multi_modal_data`` without ``multi_modal_inputs``): what
    ``LLMEngine.prepare_prompt`` would process."""
    return isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None \
        and prompt.get("multi_modal_inputs") is None


def banned_token_ids(output_processor: OutputProcessor, req: Request) -> list[int]:
    """Token ids banned while ``req``'s output is shorter than min_tokens (stop token ids, and EOS unless
    ignore_eos); the worker checks them against the vocabulary. A function of the output processor, not a method of
    the engine: the scheduler keeps it, and a bound method would make an engine <-> scheduler cycle."""
    p = req.sampling_params
    return sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else output_processor.eos_token_ids))


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        self.model_config = load_model_config(config.model, quantization=config.quantization)
        if self.model_config.multimodal is not None and config.image_limit == 0:
            # vLLM's text-only mode: no vision tower is built or loaded, and image requests are refused.
            logger.info("--limit-mm-per-prompt image=0: image input is off; the vision tower is not loaded")
            self.model_config = dataclasses.replace(self.model_config, multimodal=None)
        self.spec_config: SpeculativeConfig | None = None
        if config.speculative_config is not None:
            self.spec_config = SpeculativeConfig.from_dict(config.speculative_config, self.model_config)
        self.device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for but CUDA is not available; use device='cpu'")
        self.dtype = resolve_dtype(config.dtype, self.model_config, self.device)
        ssm_dtype = resolve_ssm_state_dtype(config.mamba_ssm_cache_dtype, self.dtype)
        if ssm_dtype != self.model_config.ssm_state_dtype:
            logger.info("recurrent SSM state in %s (--mamba-ssm-cache-dtype %s): computed in float32, stored in %s",
                        ssm_dtype, config.mamba_ssm_cache_dtype, ssm_dtype)
            self.model_config = dataclasses.replace(self.model_config, ssm_state_dtype=ssm_dtype)
        if config.max_num_batched_tokens is None:  # resolved once here, so the workers get the same budget
            config = self.config = dataclasses.replace(
                config, max_num_batched_tokens=default_max_num_batched_tokens(self.device.type))
        if self.device.type == "cpu":
            threads, why = apply_cpu_threads(config.cpu_threads)
            logger.info("CPU: torch uses %d intra-op thread%s (%s; --cpu-threads / cpu_threads sets it)", threads,
                        "" if threads == 1 else "s", why)
        self.tokenizer: Tokenizer | None = self._load_tokenizer(config.model)
        self.processor_cache: ProcessorCache | None = None
        if self.model_config.multimodal is not None:
            self.processor_cache = ProcessorCache(
                functools.partial(ImageProcessorSettings.from_checkpoint, config.model),
                int(config.mm_processor_cache_gb * GIB))
        # Values for the SamplingParams fields a request leaves unset (vLLM's default_sampling_params).
        self.default_sampling_params: dict[str, Any] = self._load_default_sampling_params()
        eos_token_ids = set(stop_token_ids(config.model, self.model_config))
        k = self.spec_config.num_speculative_tokens if self.spec_config else 0
        self.use_mtp = self.spec_config is not None and self.spec_config.method == "mtp"
        self.async_scheduling = config.async_scheduling if config.async_scheduling is not None \
            else self.device.type == "cuda"
        self.pipeline_parallel_size = pp = config.pipeline_parallel_size
        self.pp_layer_partition = layer_partition(self.model_config.num_hidden_layers, pp, config.pp_layer_partition)
        # Steps launched whose results are not applied yet, between two step() calls: with P pipeline stages, P - 1
        # micro-batches keep the stages busy; async scheduling adds one (its host work overlaps the device's).
        self.max_steps_in_flight = pp - 1 + int(self.async_scheduling)
        # The speculation length per step (hyserve.speculative.adaptive): unset, on for CUDA.
        spec = self.spec_config
        self.spec_adaptive = spec is not None and (spec.adaptive if spec.adaptive is not None
                                                   else self.device.type == "cuda")
        # The worker side: device, model, cache tensors, step buffers, graphs. The engine keeps ids and ints.
        self.executor: Executor = self._make_executor(k)
        infos = self.executor.cache_infos()
        # A concurrency the user set: the default snapshot budget is raised to what that many decoding requests
        # hold at once (``snapshot_demand_while_decoding``).
        wanted = snapshots_held_while_decoding(config.max_num_seqs, self.max_steps_in_flight) \
            if config.max_num_seqs is not None else 0
        self.layout = plan_caches_for_ranks(config, infos, config.max_num_seqs or DEFAULT_MAX_NUM_SEQS, k,
                                            functools.partial(self.executor.collective_rpc,
                                                              "determine_available_memory"), self.device.type,
                                            wanted)
        self.max_num_seqs = self.layout.max_num_seqs
        self.max_num_batched_tokens = int(config.max_num_batched_tokens or 0)
        self.block_pool = BlockPool(self.layout.num_kv_blocks, config.block_size)
        has_state = any(i.has_recurrent_state for i in infos)
        self.state_slots = StateSlots(self.layout.num_state_slots, self.layout.num_snapshots,
                                      self.layout.state_bytes_per_slot, has_state=has_state)
        self.max_model_len = self._resolve_max_model_len()
        self.executor.initialize_cache(self.layout, self.max_model_len)
        self.output_processor = OutputProcessor(self.tokenizer, eos_token_ids, self.max_model_len)
        self.structured_output = StructuredOutputs(self.tokenizer, self.model_config.vocab_size,
                                                   sorted(eos_token_ids))
        self.prefix_cache: PrefixCache | None = None
        if config.enable_prefix_caching:
            self.prefix_cache = PrefixCache(self.block_pool, self.state_slots, config.block_size,
                                            config.recurrent_snapshot_interval,
                                            has_recurrent_state=has_state,
                                            lookahead=1 if self.use_mtp else 0,
                                            num_host_snapshots=self.layout.num_host_snapshots)
        self.snapshots_inside_rows = self._resolve_snapshots_inside_rows(infos)
        self.drafts: DraftManager | None = None
        if self.spec_config is not None:
            adaptive = self.spec_config.adaptive
            self.drafts = DraftManager(self.spec_config, adaptive=self.spec_adaptive)
            logger.info("speculative decoding: %s, %s tokens per step%s", self.spec_config.method,
                        f"0 to {k} (chosen per step by the batch size and the acceptance measured)"
                        if self.drafts.policy.adaptive else k,
                        "" if adaptive is not None else " (the default on this device; speculative_config's "
                        "\"adaptive\" sets it)")
            if self.spec_config.synthetic_acceptance_rates is not None:
                logger.warning("speculative decoding: rejection_sample_method 'synthetic': each draft's verdict is "
                               "drawn (drafts 1 .. i kept with probability %s), not judged by the model: the "
                               "outputs are not the model's (a benchmarking mode)",
                               list(self.spec_config.synthetic_acceptance_rates))
        self.scheduler = Scheduler(self.max_num_seqs, self.max_num_batched_tokens, self.block_pool,
                                   self.state_slots, self.max_model_len, self.prefix_cache, self.drafts,
                                   banned_token_ids=functools.partial(banned_token_ids, self.output_processor),
                                   pipeline_parallel_size=pp, snapshots_inside_rows=self.snapshots_inside_rows,
                                   # One rank keeps each request's last token and drafts on the device, where a
                                   # verify row scheduled behind another reads them.
                                   async_verify=self.async_scheduling and self.use_mtp
                                   and config.tensor_parallel_size * pp == 1)
        self.metrics = EngineMetrics(requests=RequestMetrics(self.max_model_len))
        self.stats_logger: StatsLogger | None = None
        if not config.disable_log_stats:
            self.stats_logger = StatsLogger(config.log_stats_interval_s)
        self.requests: dict[str, Request] = {}
        self.parents = ParentRequests()  # requests with n > 1: their child requests (hyserve.engine.parallel_sampling)
        self.is_shut_down = False
        self._arrivals = 0
        # Steps launched whose results are not applied yet (at most max_steps_in_flight between two step() calls).
        self._in_flight: deque[tuple[SchedulerOutput, StepHandle, float]] = deque()
        self._last_result_time = 0.0  # when the last step's result was applied (the step durations' start)
        # Steps the policy times, waiting for the workers' measure of them: step id -> (decoding rows, k_step).
        self._untimed_steps: dict[int, tuple[int, int]] = {}
        logger.info("async scheduling is %s%s", "on" if self.async_scheduling else "off",
                    "" if config.async_scheduling is not None else " (the default on this device; "
                    "--async-scheduling / --no-async-scheduling sets it)")
        lay = self.layout
        logger.info("cache: %d KV blocks of %d tokens (%d tokens, %.1f MiB), %d state slots (%.1f MiB); "
                    "max_model_len %d, max_num_seqs %d, max_num_batched_tokens %d",
                    lay.num_kv_blocks - 1, config.block_size, (lay.num_kv_blocks - 1) * config.block_size,
                    lay.num_kv_blocks * lay.kv_bytes_per_block / 2**20, lay.num_state_slots,
                    (lay.num_state_slots + 1) * lay.state_bytes_per_slot / 2**20, self.max_model_len,
                    self.max_num_seqs, self.max_num_batched_tokens)
        if self.prefix_cache is not None:
            per_token = lay.kv_bytes_per_block / config.block_size
            logger.info("prefix cache: KV blocks of %d tokens and up to %d recurrent snapshots (%.1f MiB; one costs "
                        "the memory of %.0f KV tokens) share one key space; snapshots at each prompt end, request "
                        "end, branch point and every %d tokens", config.block_size, lay.num_snapshots,
                        lay.num_snapshots * lay.state_bytes_per_slot / 2**20,
                        lay.state_bytes_per_slot / max(per_token, 1e-9), config.recurrent_snapshot_interval)
            if lay.num_host_snapshots:
                logger.info("prefix cache: the resume points the snapshot budget evicts move to %d host entries "
                            "(%.1f GiB of pinned host memory per worker; --snapshot-host-memory-gb)",
                            lay.num_host_snapshots, lay.num_host_snapshots * lay.state_bytes_per_slot / 2**30)
            transient = self.snapshot_demand_while_decoding()
            if has_state and lay.num_snapshots < transient:
                # a warning where the user asked for the concurrency; the default one is sized to the memory, and a
                # default that full of decoding requests is rare enough to say so only in the debug log
                log = logger.warning if config.max_num_seqs is not None else logger.debug
                log(
                    "prefix cache: %d recurrent snapshots are fewer than the %d that %d decoding requests can hold "
                    "at once (each its latest block boundary's, and one reserved per step in flight), so published "
                    "snapshots are evicted within a few steps (speculative verify rows go without instead) and later "
                    "requests resume from little or nothing%s; "
                    "raise --snapshot-memory-fraction (%s), or store the state in the model's dtype "
                    "(--mamba-ssm-cache-dtype auto: half the size of the float32 default)", lay.num_snapshots,
                    transient, lay.max_num_seqs,
                    f" but the {lay.num_host_snapshots} host entries (resume points only, copied back on a hit)"
                    if lay.num_host_snapshots else "",
                    "now unset: the default share, raised up to its cap" if config.snapshot_memory_fraction is None
                    else f"now {config.snapshot_memory_fraction:.2f}")
        else:
            logger.info("prefix caching is off")

    def snapshot_demand_while_decoding(self) -> int:
        """Snapshot entries the running requests can hold at once while decoding: each keeps the snapshot at its
        latest block boundary (the request end's, once it finishes) and reserves one for the boundary a step may
        cross, for every step scheduled and not yet applied."""
        return snapshots_held_while_decoding(self.layout.max_num_seqs, self.max_steps_in_flight)

    def _make_executor(self, num_speculative_tokens: int) -> Executor:
        # The shorter speculation lengths a step may take: the worker captures verify graphs for each.
        spec = self.spec_config
        lengths = tuple(range(num_speculative_tokens)) if self.spec_adaptive else \
            (0,) if spec is not None and spec.disable_by_batch_size is not None else ()
        kw: dict[str, Any] = {"num_speculative_tokens": num_speculative_tokens, "use_mtp": self.use_mtp,
                              "max_steps_in_flight": self.max_steps_in_flight, "spec_lengths": lengths,
                              "synthetic_rates": spec.synthetic_acceptance_rates if spec is not None else None}
        tp, pp = self.config.tensor_parallel_size, self.config.pipeline_parallel_size
        self.model_config.check_tensor_parallel(tp, self.config.enable_expert_parallel)
        if self.config.enable_expert_parallel:
            log_expert_parallel(tp, getattr(self.model_config, "num_experts", 0))
        world = tp * pp
        output_rank = (pp - 1) * tp  # the first rank of the last stage samples: its answer is the step's result
        backend = self.config.distributed_executor_backend or ("mp" if world > 1 else "uni")
        shape = f"tensor_parallel_size={tp}, pipeline_parallel_size={pp}" + (
            f", layers per stage {','.join(map(str, self.pp_layer_partition))}" if pp > 1 else "")
        if backend == "torchrun":
            from hyserve.executor.torchrun import TorchrunExecutor, serve_rank, torchrun_rank

            args = (self.config, self.model_config, self.device, self.dtype)
            if torchrun_rank()[0] != 0:
                serve_rank(world, args, kw, output_rank)  # serves this rank until rank 0 stops, then ends the process
            logger.info("workers: %d ranks started by torchrun (%s); this is rank 0", world, shape)
            return TorchrunExecutor(world, args, kw, output_rank)
        if backend == "mp":
            from hyserve.executor.multiproc import MultiprocExecutor, WorkerError, free_tcp_address

            logger.info("workers: %d process%s (distributed_executor_backend='mp', %s)", world,
                        "" if world == 1 else "es", shape)
            kw.update(cpu_threads=torch.get_num_threads())
            for attempt in range(PORT_ATTEMPTS):
                # The group's port is free when chosen, but another process on the host may bind it before rank 0
                # does: the workers are stopped and started again on a fresh port.
                kw["dist_init_method"] = free_tcp_address() if world > 1 else None
                try:
                    return MultiprocExecutor(world, (self.config, self.model_config, self.device, self.dtype), kw,
                                             output_rank=output_rank)
                except WorkerError as exc:
                    if "EADDRINUSE" not in str(exc) or attempt == PORT_ATTEMPTS - 1:
                        raise
                    logger.warning("workers: the group's port was taken before rank 0 bound it; again on another")
        return UniProcExecutor(Worker(self.config, self.model_config, self.device, self.dtype, **kw))

    @property
    def runner(self) -> ModelRunner:
        """The in-process worker's model runner (tests and tools read its tensors; there is no other worker yet)."""
        worker = getattr(self.executor, "driver_worker", None)
        if worker is None:
            raise RuntimeError("this engine's worker is not in this process")
        return worker.runner

    @property
    def proposer(self) -> Proposer | None:
        """The host-side draft proposer (n-gram; tests plant others); None: the MTP head's drafts, or none."""
        return self.drafts.proposer if self.drafts is not None else None

    @proposer.setter
    def proposer(self, proposer: Proposer | None) -> None:
        assert self.drafts is not None, "not speculating"
        self.drafts.proposer = proposer

    @property
    def eos_token_ids(self) -> set[int]:
        """The ids that end a request unless ``ignore_eos``: the output processor's (one copy, which stops)."""
        return self.output_processor.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: set[int]) -> None:
        self.output_processor.eos_token_ids = ids

    def _load_default_sampling_params(self) -> dict[str, Any]:
        defaults, source = generation_defaults(self.config.model, self.config.generation_config,
                                               self.config.override_generation_config)
        for key, neutral in UNSUPPORTED_GENERATION_KEYS.items():
            value = defaults.pop(key, None)
            if value is not None and float(value) != neutral:
                logger.warning("%s sets %s=%s, which hyserve does not support yet: it is NOT applied (pass "
                               "--generation-config vllm to ignore the file)", source, key, value)
        if defaults:
            SamplingParams(**defaults)  # a bad value in the file fails here, at startup, naming the field
            logger.info("default sampling parameters from %s: %s (a request's own values win; "
                        "--generation-config vllm ignores the file)", source, defaults)
        else:
            logger.info("default sampling parameters: SamplingParams' own (%s)",
                        "--generation-config vllm" if self.config.generation_config == "vllm"
                        else "no generation_config.json values")
        return defaults

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the checkpoint's generation_config.json defaults (vLLM's name)."""
        return SamplingParams(**self.default_sampling_params)

    @staticmethod
    def _load_tokenizer(model_dir: str) -> Tokenizer | None:
        try:
            return Tokenizer.from_model_dir(model_dir)
        except FileNotFoundError:
            logger.warning("no tokenizer.json in %s: only token-id prompts are accepted and no text is returned",
                           model_dir)
            return None

    def _resolve_snapshots_inside_rows(self, infos: list[CacheInfo]) -> bool:
        """Whether chunks run past snapshot points (the recurrent layers write the snapshots inside them): where
        every rank's recurrent layers can, unless ``snapshots_inside_rows`` says otherwise."""
        wanted = self.config.snapshots_inside_rows
        able = all(i.row_snapshots or not i.has_recurrent_state for i in infos)
        if wanted and self.prefix_cache is None:
            raise ValueError("snapshots_inside_rows=True (--snapshots-inside-rows) places prefix-cache snapshots, "
                             "but prefix caching is off: drop it or enable prefix caching")
        if wanted and not able:
            raise ValueError(f"snapshots_inside_rows=True (--snapshots-inside-rows): {self.model_config.architecture} "
                             "has recurrent layers that cannot take a snapshot inside a prefill chunk here (PLE "
                             "layers; or, on CUDA in 16 bits, an fla-core other than the pinned one: the log says "
                             "which); unset it (chunks then end at snapshot points)")
        return self.prefix_cache is not None and able and wanted is not False

    def _resolve_max_model_len(self) -> int:
        capacity = self.block_pool.num_usable_blocks * self.config.block_size
        limit = self.model_config.max_position_embeddings
        asked = self.config.max_model_len
        if asked is None:
            if capacity < limit:
                logger.warning("the KV cache holds %d tokens, fewer than the model's %d: max_model_len set to %d",
                               capacity, limit, capacity)
            return min(limit, capacity)
        if asked > capacity:
            raise ValueError(f"max_model_len={asked} does not fit in the KV cache ({capacity} tokens); lower "
                             f"--max-model-len or give the cache more memory ({cache_memory_flag(self.device.type)})")
        return asked

    # ------------------------------------------------------------------ requests

    def encode_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer: pass {'prompt_token_ids': [...]} instead of text")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.encode_prompt(str(prompt["prompt"]))
            raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids' (got keys {sorted(prompt)})")
        if isinstance(prompt, list):
            return None, self._check_ids(prompt)
        raise ValueError(f"unsupported prompt type {type(prompt).__name__}; use str or {{'prompt_token_ids': [...]}}")

    def prepare_prompt(self, prompt: PromptType) -> PromptType:
        """``prompt`` with its images processed: ``{"prompt", "prompt_token_ids" (expanded), "multi_modal_inputs"}``,
        which ``add_request`` then takes without processing again; a prompt without images comes back as it is (and
        so does one ``add_request`` would refuse before its images: it refuses it then). Reads the engine's
        configuration only and is thread-safe (the processor cache locks), so callers prepare several prompts at
        once: the pixel pipeline is tens of milliseconds of one core per image."""
        if not has_raw_images(prompt):
            return prompt
        text, ids = self.encode_prompt(prompt)
        if not ids:
            return prompt
        ids, mm = self._multimodal_prompt(prompt, ids)
        if mm is None:
            return prompt
        prepared: dict[str, Any] = {"prompt_token_ids": ids, "multi_modal_inputs": mm}
        if text is not None:
            prepared["prompt"] = text
        return prepared

    def _multimodal_prompt(self, prompt: PromptType, ids: list[int]) -> tuple[list[int], MultimodalPrompt | None]:
        """A prompt dict's ``multi_modal_data`` (``{"image": image or [images]}``; PIL images, encoded bytes or
        data URLs): the ids with each image placeholder widened to its image's tokens, and the images' inputs."""
        prepared = prompt.get("multi_modal_inputs") if isinstance(prompt, dict) else None
        if prepared is not None:
            return ids, self._check_prepared(ids, prepared)
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if data is None:
            self._check_no_placeholders(ids)
            return ids, None
        if not isinstance(data, dict):
            raise ValueError(f"multi_modal_data must be a dict such as {{'image': [...]}} (got {type(data).__name__})")
        unknown = sorted(set(data) - set(MM_MODALITIES))
        if unknown:
            raise ValueError(f"multi_modal_data: modality {unknown[0]!r} is not served; the modalities are "
                             f"{', '.join(MM_MODALITIES)}")
        images = data.get("image")
        images = [] if images is None else list(images) if isinstance(images, list | tuple) else [images]
        if not images:
            self._check_no_placeholders(ids)
            return ids, None
        return self.prepare_images(ids, images)

    def prepare_images(self, ids: list[int], images: list[Any]) -> tuple[list[int], MultimodalPrompt]:
        """The ids with each image placeholder widened and the images' inputs (pixels, spans, M-RoPE positions).
        Reads the engine's configuration only, so a server runs it off the engine's thread and passes the result
        as ``{"prompt_token_ids": ids, "multi_modal_inputs": inputs}``."""
        mm_config = self.model_config.multimodal
        if self.model_config.image_refusal is not None:
            raise ValueError(self.model_config.image_refusal)
        if mm_config is None:
            raise ValueError("image input is off (--limit-mm-per-prompt image=0)" if self.config.image_limit == 0
                             else "this checkpoint has no vision tower (its config.json has no vision_config): "
                                  "image input needs a Qwen3_5ForConditionalGeneration checkpoint")
        limit = self.config.image_limit
        if len(images) > limit:
            raise ValueError(f"the prompt has {len(images)} images; at most {limit} per prompt are allowed "
                             "(--limit-mm-per-prompt)")
        loaded = [load_image(img, allowed_domains=self.config.allowed_media_domains or (),
                             allowed_local_path=self.config.allowed_local_media_path) for img in images]
        # A worker in this process on CUDA takes the pixels from pinned memory as they are (a copy made here, off
        # the engine's loop in a server); one in another process gets them pickled, and pins its own copy.
        pinned = self.device.type == "cuda" and isinstance(self.executor, UniProcExecutor)
        return build_multimodal_prompt(ids, loaded, self.config.model, mm_config, self.processor_cache, pinned)

    def _check_prepared(self, ids: list[int], prepared: Any) -> MultimodalPrompt:
        """``multi_modal_inputs`` from ``prepare_images``: its spans must be runs of image tokens of these ids."""
        mm_config = self.model_config.multimodal
        if self.model_config.image_refusal is not None:
            raise ValueError(self.model_config.image_refusal)
        if not isinstance(prepared, MultimodalPrompt) or mm_config is None:
            raise ValueError("multi_modal_inputs must come from prepare_images on an engine with image input")
        token = mm_config.image_token_id
        spans = [(im.span.offset, im.end) for im in prepared.images]
        if prepared.positions.shape != (3, len(ids)) or ids.count(token) != sum(b - a for a, b in spans) \
                or any(ids[a:b] != [token] * (b - a) for a, b in spans):
            raise ValueError("multi_modal_inputs do not match prompt_token_ids: pass the ids prepare_images returned")
        return prepared

    def _check_no_placeholders(self, ids: list[int]) -> None:
        """A prompt without images may not hold image placeholder tokens: the model would read them as an image
        that is not there (a user's text can spell the token)."""
        mm = self.model_config.multimodal
        if mm is not None and mm.image_token_id in ids:
            raise ValueError(f"the prompt holds {ids.count(mm.image_token_id)} image placeholder tokens "
                             f"(id {mm.image_token_id}) but no images")

    def _check_ids(self, ids: Any) -> list[int]:
        # In C loops (type, min, max): a long prompt's check costs microseconds, not a Python loop per token.
        if not isinstance(ids, (list, tuple)) or not set(map(type, ids)) <= {int}:  # bool's type is not int
            raise ValueError("prompt_token_ids must be a list of ints")
        vocab = self.model_config.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            bad = [t for t in ids if t < 0 or t >= vocab]
            raise ValueError(f"prompt_token_ids contains ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        return list(ids)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None) -> None:
        if self.is_shut_down:
            raise RuntimeError("this engine was shut down")
        params = params or self.get_default_sampling_params()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams (got {type(params).__name__})")
        self.check_sampling_params(params)
        params = self.with_bad_words_token_ids(params)
        if request_id in self.requests or request_id in self.parents.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.n > 1:
            self._add_parent(request_id, prompt, params)
            return
        text, ids = self.encode_prompt(prompt)
        if not ids:
            raise ValueError("the prompt is empty (0 tokens)")
        ids, mm = self._multimodal_prompt(prompt, ids)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, more than max_model_len={self.max_model_len} "
                             "allows (the prompt must leave room for at least one output token)")
        detok = self.output_processor.detokenizer(ids, params)
        grammar = self.structured_output.matcher(params.structured_outputs) if params.structured_outputs else None
        req = Request(request_id, text, ids, params, self._arrivals, detok, arrival_time=time.time())
        req.grammar = grammar
        if mm is not None:
            req.mm, req.image_spans = mm, tuple(im.span for im in mm.images)
        if params.prompt_logprobs is not None:
            req.prompt_logprob_rows = [None] * (len(ids) - 1)
        self._arrivals += 1
        self.requests[request_id] = req
        self.scheduler.add_request(req)
        self.metrics.on_request_added(len(ids))

    def _add_parent(self, request_id: str, prompt: PromptType, params: SamplingParams) -> None:
        """``n`` > 1: the n child requests (all or none), each with its own seed (``child_params``)."""
        parent = ParentRequest(request_id, params)
        if any(cid in self.requests for cid in parent.child_ids):
            raise ValueError(f"request id {request_id!r}: its child ids are already in use")
        added: list[str] = []
        try:
            for i, cid in enumerate(parent.child_ids):
                self.add_request(cid, prompt, child_params(params, i))
                added.append(cid)
        except BaseException:
            self.abort_request(added)
            raise
        self.parents.add(parent)

    def check_sampling_params(self, params: SamplingParams) -> None:
        """Refuse (ValueError naming the field) what SamplingParams alone cannot judge: values that depend on the
        model. The server calls this before queueing a request; add_request calls it too."""
        vocab = self.model_config.vocab_size
        if params.structured_outputs is not None:
            self.structured_output.compile(params.structured_outputs)  # ValueError naming what is wrong
        bad = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"stop_token_ids contains ids outside the vocabulary [0, {vocab}) (vocabulary size "
                             f"{vocab}): {bad[:5]}")
        message = self.with_bad_words_token_ids(params).out_of_vocab(vocab)
        if message is not None:
            raise ValueError(message)

    def with_bad_words_token_ids(self, params: SamplingParams) -> SamplingParams:
        """``params`` with its bad words tokenized by the model's tokenizer (vLLM's rule, see SamplingParams)."""
        if not params.bad_words:
            return params
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise ValueError("bad_words needs a tokenizer, and this checkpoint has none")
        return params.with_bad_words_token_ids(lambda text: tokenizer.encode(text, add_special_tokens=False))

    def abort_request(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        ids += [cid for rid in list(ids) for cid in self.parents.remove(rid)]  # a parent's abort aborts its children
        for rid in ids:
            req = self.requests.pop(rid, None)
            if req is None or req.is_finished:
                continue
            req.finish_reason = "abort"
            req.finished_time = time.time()
            self.scheduler.finish(req)
            self.metrics.on_request_finished("abort", req)

    def has_unfinished_requests(self) -> bool:
        """Requests waiting or running, a step whose result is not applied yet (async scheduling, pipeline
        micro-batches), or what the workers have not been sent yet: verify commits for the pipeline stages, finished
        requests to forget."""
        sched = self.scheduler
        return sched.has_unfinished_requests() or bool(self._in_flight) or sched.has_pending_commits \
            or sched.has_pending_finished

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    # ------------------------------------------------------------------ step

    def step(self) -> list[RequestOutput]:
        """Schedule a step, run it on the executor, apply its result: the outputs of the requests it touched (a
        request with ``n`` > 1 as one output of its children's completions: ``hyserve.engine.parallel_sampling``).

        With async scheduling the step is launched and the previous step's result is applied while it runs (the
        outputs returned are that step's): the host's work of both overlaps the device's. A request may then run
        one step past its end (EOS, a stop string): that step's tokens are dropped, never shown.
        """
        return self.parents.outputs(self._step())

    def _step(self) -> list[RequestOutput]:
        so = self.scheduler.schedule()
        outputs = self._on_scheduled(so)
        if not self.max_steps_in_flight:
            if so.is_empty:
                return outputs
            t0 = time.perf_counter()
            return outputs + self._on_result(so, self.executor.execute_model(so), t0)
        if not so.is_empty:
            self._in_flight.append((so, self.executor.execute_model_async(so), time.perf_counter()))
        while len(self._in_flight) > self.max_steps_in_flight or (self._in_flight and not so.rows):
            done, handle, t0 = self._in_flight.popleft()
            outputs += self._on_result(done, handle.result(), t0)
        return outputs

    def _on_scheduled(self, so: SchedulerOutput) -> list[RequestOutput]:
        """Per step, before it runs: requests that can never be admitted fail; first-scheduled times, prompt
        tokens computed, preemptions, the periodic stats line."""
        outputs: list[RequestOutput] = []
        for rid, why in so.failed:  # can never be admitted: an error now rather than a queue blocked forever
            req = self.requests[rid]
            req.error = why
            self._finish(req, "error")
            self._final_output(req, outputs)
        self.metrics.on_preemptions(len(so.preempted_req_ids))
        now = time.time()
        for row in so.rows:
            req = self.requests[row.req_id]
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            self.metrics.prompt_tokens_computed += max(0, min(row.end, req.num_prompt_tokens) - row.start)
        if self.stats_logger is not None:
            self.stats_logger.maybe_log(self)
        return outputs

    def _on_result(self, so: SchedulerOutput, ro: RunnerOutput, t0: float) -> list[RequestOutput]:
        """Apply step ``so``'s result ``ro`` (the scheduler's update) and build the outputs of its requests."""
        self._take_prompt_logprobs(so, ro)
        ran = self.scheduler.update_from_output(so, ro, self)
        verify = [i for i, row in enumerate(so.rows) if row.is_verify and i not in ro.errors]
        if self.drafts is not None:
            self._observe_spec(so, ro, verify, t0)
            if any(row.is_verify for row in so.rows):
                self.metrics.on_spec_step(so.num_spec_tokens)
        if verify:
            self.metrics.on_verify([so.rows[i].num_drafts for i in verify], [ro.num_accepted[i] for i in verify])
            if self.metrics.num_steps % 200 == 0 and self.metrics.spec_num_drafts:
                logger.info("speculative decoding: mean acceptance length %.2f over %d drafts",
                            self.metrics.mean_acceptance_length, self.metrics.spec_num_drafts)
        outputs: list[RequestOutput] = []
        for req in ran:
            self._emit(req, outputs)
            if req.is_finished:
                self.requests.pop(req.request_id, None)
        if so.rows:  # not a step that only carried verify commits to the pipeline stages
            self.metrics.on_step(so.num_tokens, sum(len(t) for t in ro.token_ids), time.perf_counter() - t0)
        return outputs

    def _observe_spec(self, so: SchedulerOutput, ro: RunnerOutput, verify: list[int], t0: float) -> None:
        """What the speculation-length policy learns from a step (``hyserve.speculative.adaptive``): the accepted
        counts of its verify rows, and, for a step whose rows all decode, that verified k_step drafts (in one row at
        least) and drafted as many, its duration at its k_step: the workers' own time of it
        (``hyserve.worker.step_timer``: its device time, reported with this or a later result), or, where they do not
        time steps (a pipeline), from its launch or the previous result, whichever is later. The host's interval is
        polluted where the host launched the next step before it read this result (a long eager prompt step: 0.2-0.9
        s on a 32 ms decode step on the seed's trace, which left k = 2 chosen at zero acceptance)."""
        assert self.drafts is not None
        policy = self.drafts.policy
        now = time.perf_counter()
        if verify:
            policy.observe_verify([so.rows[i].num_drafts for i in verify], [ro.num_accepted[i] for i in verify])
        # Timed only where the step verified and drafted its k_step (a step between two lengths is neither's).
        k = so.num_spec_tokens
        steady = so.num_drafting is None or so.num_drafting == k
        if so.rows and len(verify) == len(so.rows) and steady and max(so.rows[i].num_drafts for i in verify) == k:
            if ro.step_seconds is None:  # the workers do not time their steps (a pipeline): the host's interval
                policy.observe_step(len(so.rows), k, now - max(t0, self._last_result_time))
            else:
                self._untimed_steps[so.step_id] = (len(so.rows), k)
                while len(self._untimed_steps) > MAX_UNTIMED_STEPS:
                    self._untimed_steps.pop(next(iter(self._untimed_steps)))
        # The workers' own step times (hyserve.worker.step_timer), this step's or earlier ones' as they complete.
        for step_id, seconds in ro.step_seconds or ():
            timed = self._untimed_steps.pop(step_id, None)
            if timed is not None:
                policy.observe_step(timed[0], timed[1], seconds)
        self._last_result_time = now

    def _take_prompt_logprobs(self, so: SchedulerOutput, ro: RunnerOutput) -> None:
        """Each row's prompt logprobs into its request, by position (a chunk computed again after a preemption
        writes the same values again)."""
        for i, (lps, ranks, tops) in ro.prompt_logprobs.items():
            row = so.rows[i]
            req = self.requests.get(row.req_id)
            if req is None or req.prompt_logprob_rows is None:
                continue
            for j, entry in enumerate(zip(lps, ranks, tops, strict=True)):
                req.prompt_logprob_rows[row.start + j] = entry

    # ------------------------------------------------------------------ the scheduler's sink (StepSink)

    def append_tokens(self, req: Request, ro: RunnerOutput, i: int) -> str | None:
        """Hand row ``i``'s tokens to the output processor (the one path of new output tokens, plain and verify);
        the finish reason if ``req`` ends there. A failure here (detokenization, stop checks) is this request's
        alone: it ends with an error and the step goes on for the others."""
        try:
            new = NewTokens(list(ro.token_ids[i]))
            if ro.logprobs is not None and ro.logprobs[i]:
                new.logprobs = list(ro.logprobs[i])
                new.ranks = list(ro.ranks[i]) if ro.ranks is not None else None
                new.top_logprobs = list(ro.top_logprobs[i]) if ro.top_logprobs is not None else None
            previous_token_time = req.last_token_time
            reason = self.output_processor.append(req, new)
            self.metrics.requests.on_output_step(previous_token_time, req)
            return reason
        except Exception as e:  # any failure here is this request's alone
            logger.exception("request %s: taking its tokens failed", req.request_id)
            req.error = f"taking its tokens failed: {type(e).__name__}: {e}"
            return "error"

    def request_finished(self, req: Request, reason: str, error: str | None = None) -> None:
        """``req`` ends with ``reason``: its finish reason, time and metrics (the scheduler frees its memory)."""
        if reason == "error":
            logger.error("request %s: %s; finishing it with an error", req.request_id, error or req.error)
        req.finish_reason = reason
        req.finished_time = time.time()
        self.metrics.on_request_finished(reason, req)

    def _finish(self, req: Request, reason: str) -> None:
        self.request_finished(req, reason)
        self.scheduler.finish(req)

    def _final_output(self, req: Request, outputs: list[RequestOutput]) -> None:
        self.requests.pop(req.request_id, None)
        self._emit(req, outputs)

    def _emit(self, req: Request, outputs: list[RequestOutput]) -> None:
        """Append ``req``'s output of this step to ``outputs`` (FINAL_ONLY has none before the end)."""
        out = self.output_processor.make_output(req)
        if out is not None:
            outputs.append(out)

    def get_metrics(self) -> dict[str, float | list[float]]:
        return self.metrics.snapshot(self)

    def shutdown(self) -> None:
        """Abort every request and drop the model, its caches, CUDA graphs and step buffers (idempotent).

        Nothing in the engine refers back to it in a cycle, so once these references go the memory is freed by
        reference counting alone; on CUDA torch's cached blocks are then returned to the device.
        """
        if self.is_shut_down:
            return
        self.abort_request(list(self.requests))
        self.is_shut_down = True
        self._in_flight.clear()  # their requests are aborted: nothing reads their results
        self.executor.shutdown()
        for name in ("executor", "scheduler", "prefix_cache", "drafts", "block_pool", "state_slots"):
            self.__dict__.pop(name, None)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # Used by tests: every block and slot is back in its pool, and no rank holds a request, once nothing runs.
    def assert_no_leaks(self) -> None:
        pool, states = self.block_pool, self.state_slots
        if self.scheduler.has_unfinished_requests():
            raise AssertionError("requests are still running")
        while self.has_unfinished_requests():  # steps in flight, what the workers have not been sent yet
            self.step()
        if pool.num_free_blocks != pool.num_usable_blocks:
            raise AssertionError(f"KV blocks leaked: {pool.num_usable_blocks - pool.num_free_blocks}")
        if states.num_free_slots != states.num_slots:
            raise AssertionError(f"state slots leaked: {states.num_slots - states.num_free_slots}")
        leaks = self.prefix_cache.leaks() if self.prefix_cache is not None else None
        if leaks:
            raise AssertionError(f"prefix cache: {leaks}")
        held = self.executor.collective_rpc("held_requests")
        if any(held):
            raise AssertionError(f"workers hold finished requests (per rank): {held}")


def log_expert_parallel(tp: int, num_experts: int) -> None:
    """One INFO line on what ``enable_expert_parallel`` does here. The expert-parallel size is the tensor-parallel
    size (there is no data parallelism to multiply it by)."""
    if tp == 1:
        logger.info("enable_expert_parallel: nothing to change with tensor_parallel_size=1 (the expert-parallel "
                    "size is tensor_parallel_size; there is no data parallelism): one rank holds every expert")
    elif num_experts == 0:
        logger.info("enable_expert_parallel: nothing to change: the model has no routed experts")
    else:
        logger.info("enable_expert_parallel: each of the %d tensor-parallel ranks holds %d whole experts of %d "
                    "(expert-parallel size = tensor_parallel_size; there is no data parallelism)", tp,
                    num_experts // tp, num_experts)

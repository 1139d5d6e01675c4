"""The orchestration of one step on a worker: learn new requests, prepare, apply state ops, forward, sample, hand off.

Code here must be common to every model and every feature; a feature goes in its own module (docs/worker.md lists
the rooms and the path of a step through them). The runner owns the model and its caches and builds the rooms at
``initialize_cache``; each room owns its buffers and takes what it needs as arguments.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable

import torch
from torch import nn

from hyserve.cache.planner import CacheInfo, CacheLayout
from hyserve.cache.specs import AttentionSpec, CacheSpecs
from hyserve.cache.state_pool import StatePool
from hyserve.config import (
    DEFAULT_MAX_NUM_SEQS,
    EngineConfig,
    ModelConfig,
    default_max_num_batched_tokens,
    resolve_kv_cache_dtype,
)
from hyserve.distributed.parallel_state import (
    StageLink,
    is_first_stage,
    is_last_stage,
    pp_rank,
    pp_size,
    stage_layers,
    tp_size,
)
from hyserve.kernels.attention import sdpa
from hyserve.kernels.fp8 import check_fp8_device
from hyserve.layers.quantization import draft_head_quantization, quantization_summary
from hyserve.layers.sampler import Sampler, SamplingRow, token_seed
from hyserve.model import registry
from hyserve.model.base import CausalLM, KVCacheLayer
from hyserve.model.dummy_weights import load_dummy_weights
from hyserve.model.loader import draft_tensor_dtypes, load_weights
from hyserve.model.metadata import StepMetadata
from hyserve.sampling_params import SamplingParams
from hyserve.scheduler.output import PromptLogprobRows, RunnerOutput, ScheduledRow, SchedulerOutput
from hyserve.worker import cuda_graphs
from hyserve.worker.cuda_graphs import (
    MAX_VERIFY_GRAPH_TOKENS,
    GraphBody,
    GraphLogits,
    GraphSet,
    StepGraphs,
    capture_sizes,
    spec_kind,
    weak_forward,
)
from hyserve.worker.input_batch import InputBatch
from hyserve.worker.memory import (
    Parallelism,
    ProfileShape,
    WeightBytes,
    allocate_index_caches,
    allocate_kv,
    cache_budget,
    check_weights_fit,
    device_memory,
    graph_memory_estimate,
    held_bytes,
    profile_peak_activation,
    weight_bytes,
)
from hyserve.worker.mm_inputs import MMInputs
from hyserve.worker.pipeline_stage import StageCommits, StageIO
from hyserve.worker.prompt_logprobs import prompt_logprobs, wants_prompt_logprobs
from hyserve.worker.sampling_state import SamplingState
from hyserve.worker.spec_decode.mtp_drafter import MTPDrafter
from hyserve.worker.spec_decode.mtp_proposer import MTPProposer
from hyserve.worker.spec_decode.rejection_sampler import SpecRow
from hyserve.worker.spec_decode.verifier import Verifier, take_verified
from hyserve.worker.state_ops import StateOps
from hyserve.worker.step_result import StepResult, take_samples
from hyserve.worker.step_timer import StepTimer

logger = logging.getLogger("hyserve")

# What the profiler calls the parts of a step (``benchmarks/trace_gaps.py`` gives each kernel to the innermost range
# it was launched in): the step's kind around them, ``hyserve::vision`` inside the forward.
STEP_PARTS = ("state", "forward", "sample", "verify", "verify+mtp", "mtp")


def _named(part: str) -> contextlib.AbstractContextManager[object]:
    """The profiler's range for a part of a step; nothing while no profiler records (a step enters several)."""
    assert part in STEP_PARTS, part
    if not torch.autograd._profiler_enabled():
        return contextlib.nullcontext()
    return torch.profiler.record_function(f"hyserve::{part}")

# Sampled in place of a row whose own sampling inputs failed (its result is dropped).
_STAND_IN = SamplingParams(temperature=0.0)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, device: torch.device,
                 dtype: torch.dtype, num_speculative_tokens: int = 0, use_mtp: bool = False,
                 max_steps_in_flight: int = 1, spec_lengths: tuple[int, ...] = (),
                 synthetic_rates: tuple[float, ...] | None = None) -> None:
        self.config = config
        self.model_config = model_config
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        if device.type == "cuda":  # the long prefill rows' mask import, now rather than in a step (2 s of CPU)
            sdpa.preload()
        # What the device held before this instance allocated anything: the cache budget counts only this
        # instance's own weights, activations and non-torch memory against gpu_memory_utilization (vLLM's meaning).
        self._mem_baseline = device_memory(device)
        t0 = time.perf_counter()
        self.pp_size = pp_size()
        self.is_first_stage, self.is_last_stage = is_first_stage(), is_last_stage()
        use_mtp = use_mtp and self.is_last_stage
        # This rank's weights counted from the model and draft head built on the meta device: a checkpoint that
        # cannot fit is refused before anything is allocated, saying how much it needs.
        # The draft head's checkpoint tensors, from the headers once (the plan and the head built below read them).
        draft_layout = self._draft_tensor_layout() if use_mtp else {}
        self.planned_weights = self._plan_weights(use_mtp, draft_layout)
        if self._mem_baseline is not None:
            check_weights_fit(self.planned_weights, self._mem_baseline, config.gpu_memory_utilization,
                              Parallelism(config.tensor_parallel_size, config.pipeline_parallel_size,
                                          config.enable_expert_parallel, model_config.quantization is not None))
        # Every tensor that stays (the model's and the draft head's) is allocated before the load makes its
        # temporaries: one allocated after them is carved from the cached segments they freed and pins them, memory
        # neither free to the device nor usable by the caches (5 GiB of allocator slack on the 27B FP8 shape with
        # its MTP head, the head built after the load; cache_budget subtracts such slack).
        self.model = self._build_model()
        if self.pp_size > 1:
            self.model.drop_unused_embedding(draft_head=use_mtp)
        # the family's draft head (registry), run over the target's hidden states; built empty, loaded below
        self.mtp: nn.Module | None = self._build_mtp(draft_layout) if use_mtp else None
        if config.load_format == "dummy":
            draft_weights = load_dummy_weights(self.model, model_config, config.seed, with_draft_head=use_mtp)
        else:
            draft_weights = load_weights(self.model, config.model, model_config, with_draft_head=use_mtp)
        if self.mtp is not None:
            registry.draft_head(self.model_config).load(self.mtp, draft_weights)
        del draft_weights  # copied into the head: the checkpoint's tensors are not kept beside it
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the load's temporaries, back to the device
        # Pipeline parallelism: this stage's layers only; the last stage samples, verifies and drafts (MTP).
        self.stage = StageIO(StageLink() if self.pp_size > 1 else None, self.is_first_stage, self.is_last_stage)
        # Every cache below is sized and shaped from what the layers declare (hyserve.cache.specs).
        # The attention KV may be kept in FP8 (kv_cache_dtype); the recurrent state keeps its own dtypes.
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype, self.device)
        if self.kv_dtype != dtype:
            logger.info("KV cache in %s (a float32 scale per kv head: 1 unless the checkpoint gives them); the "
                        "recurrent state keeps its dtype", self.kv_dtype)
        specs = self.model.cache_specs(dtype)
        self.cache_specs: CacheSpecs = dataclasses.replace(
            specs, attention=tuple(dataclasses.replace(a, dtype=self.kv_dtype) for a in specs.attention))
        self.mtp_kv_layers = [m for m in self.mtp.modules() if isinstance(m, KVCacheLayer)] if self.mtp else []
        self.mtp_kv_specs: list[AttentionSpec] = [dataclasses.replace(layer.cache_spec(dtype), dtype=self.kv_dtype)
                                                  for layer in self.mtp_kv_layers]
        self._log_loaded(time.perf_counter() - t0)
        self.max_num_batched_tokens = int(config.max_num_batched_tokens or default_max_num_batched_tokens(device.type))
        self.max_num_seqs = config.max_num_seqs or DEFAULT_MAX_NUM_SEQS
        self.num_speculative_tokens = num_speculative_tokens
        # The shorter speculation lengths k_step < k a step may take (hyserve.speculative.adaptive): each has verify,
        # accept and behind graphs of its own (``cuda_graphs.spec_kind``), so a shorter step costs less.
        self.spec_lengths = tuple(sorted({j for j in spec_lengths if 0 <= j < num_speculative_tokens}))
        # speculative_config's synthetic acceptance (RejectionSampler.synthetic), None for the target's verdicts
        self.synthetic_rates = synthetic_rates
        # The MTP head drafts max(k_step, 1) tokens after a step at k_step, or none in a run of steps at 0 (the
        # first pass writes the MTP KV entries whatever it drafts; SpecLengthPolicy.drafting): draft graphs of each
        # such length. k where no step is shorter.
        lengths = {max(j, 1) for j in self.spec_lengths} | ({0} if 0 in self.spec_lengths else set())
        self.draft_lengths = tuple(sorted(lengths - {num_speculative_tokens}))
        # A stage before the last commits a verify step when its accepted counts arrive, up to a few steps later:
        # each uncommitted step keeps its candidates in a scratch set of its own.
        self.num_scratch_sets = max_steps_in_flight + 1 if num_speculative_tokens and not self.is_last_stage else 1
        self.graphs: StepGraphs | None = None
        self.use_graphs = self._use_graphs()
        self.max_model_len = 0  # set by initialize_cache
        self.last_hidden: torch.Tensor | None = None  # the last step's hidden states (the MTP head reads them)
        self.sampler = Sampler(device, seed=config.seed)
        # Sampling parameters of the requests this worker has been sent (SchedulerOutput.new_requests).
        self.requests: dict[str, SamplingParams] = {}
        self.step_timer = StepTimer(device)  # each step's own device time, for the speculation-length policy
        # Penalties, logit_bias, allowed_token_ids, bad words: histories and adjustments on the device.
        self.sampling_state = SamplingState(device, model_config.vocab_size, 0)  # sized by initialize_cache
        # Image input: each request's images and M-RoPE positions, and the encoder cache.
        self.mm = MMInputs(getattr(self.model, "visual", None), device, dtype, self.max_num_batched_tokens,
                           model_dir=config.model)
        # The rooms over the caches and the step buffers (initialize_cache).
        self.drafter: MTPDrafter | None = None
        self.mtp_proposer: MTPProposer | None = None
        self.verifier: Verifier | None = None
        # The step's prompt logprobs (rows asking SamplingParams.prompt_logprobs), taken by its RunnerOutput.
        self.step_prompt_logprobs: dict[int, PromptLogprobRows] = {}

    def _log_loaded(self, seconds: float) -> None:
        if self.pp_size > 1:
            start, end = stage_layers(self.model_config.num_hidden_layers)
            logger.info("pipeline stage %d of %d: decoder layers %d-%d (%d attention, %d recurrent)%s%s", pp_rank(),
                        self.pp_size, start, end - 1, len(self.cache_specs.attention),
                        len(self.cache_specs.recurrent), ", the embedding" if self.is_first_stage else "",
                        ", the final norm, LM head" + (" and MTP head" if self.mtp is not None else "")
                        if self.is_last_stage else "")
        else:
            logger.info("loaded %s (%.1fM parameters, %s) in %.1f s", self.config.model,
                        self.model_config.num_parameters() / 1e6, self.dtype, seconds)
        summary = quantization_summary(self.model, self.model_config.quantization, self.dtype)
        if summary is not None:
            logger.info(summary)

    def weight_bytes(self) -> dict[str, object]:
        """The planned bytes of this rank's weights (total and by part) and what the loaded model and draft head hold
        (their distinct storages)."""
        return {"planned": self.planned_weights.total, "parts": dict(self.planned_weights.parts),
                "held": held_bytes(self.model, self.mtp)}

    def cache_info(self) -> CacheInfo:
        return CacheInfo(self._kv_bytes_per_block(), self.cache_specs.state_bytes_per_slot,
                         bool(self.cache_specs.recurrent), self.num_scratch_sets, self._row_snapshots(),
                         self.cache_specs.scratch_bytes_per_position)

    def _row_snapshots(self) -> bool:
        """Whether this rank's recurrent layers can write prefix-cache snapshots inside prefill rows: each layer
        supports it, and on CUDA in 16 bits (fla's chunked path) the pinned fla-core is installed (else the log says
        why, and chunks end at snapshot points)."""
        layers = list(self.model.recurrent_layers())
        if not all(layer.supports_row_snapshots for layer in layers):
            return False
        if layers and self.device.type == "cuda" and self.dtype in (torch.bfloat16, torch.float16):
            from hyserve.kernels.fla_stages import fla_row_snapshots_unavailable

            reason = fla_row_snapshots_unavailable()
            if reason is not None:
                logger.warning("prefix-cache snapshots end prefill chunks (not taken inside rows): %s", reason)
                return False
        return True

    def determine_available_memory(self) -> int:
        """Bytes this worker can give the caches (``hyserve.worker.memory.cache_budget``)."""
        if self.device.type != "cuda":
            return int(self.config.cpu_cache_memory_bytes)
        assert self._mem_baseline is not None
        shape = ProfileShape(self.max_num_batched_tokens, self.max_num_seqs, self.block_size, self.is_first_stage,
                             self.is_last_stage, self.config.model, self.mm.encoder_cache_tokens)
        peak = profile_peak_activation(self.model, self.model_config, self.cache_specs, shape, self.device,
                                       self.dtype)
        sizes = self._graph_sizes()
        graphs = graph_memory_estimate(sizes, self._graph_logit_rows(sizes), self.num_speculative_tokens,
                                       self.model_config.vocab_size, self.model.activation_width(), self.dtype)
        return cache_budget(self.device, self.config.gpu_memory_utilization, self._mem_baseline, peak, graphs)

    def initialize_cache(self, layout: CacheLayout, max_model_len: int) -> None:
        """Allocate what ``layout`` says (KV blocks, state pool, verify scratch), the step buffers and the graphs."""
        self.layout = layout
        self.max_num_seqs = layout.max_num_seqs
        if self.device.type == "cuda":  # the budget counts memory torch has cached but not handed out as free: give
            torch.cuda.empty_cache()  # it back first, or the caches' large tensors may not find it (a batch-64 OOM)
        self.max_model_len = max_model_len
        self.sampling_state = SamplingState(self.device, self.model_config.vocab_size, max_model_len)
        k = self.num_speculative_tokens
        self.state_pool = StatePool(self.cache_specs.recurrent, layout.num_state_slots, self.device,
                                    num_snapshots=layout.num_snapshots,
                                    num_host_snapshots=layout.num_host_snapshots)
        self.kv_caches = allocate_kv(list(self.cache_specs.attention), layout.num_kv_blocks, self.block_size,
                                     self.device)
        # Indexed attention's per-token index keys: the same blocks and slots as the KV (None for other layers).
        self.index_caches = allocate_index_caches(list(self.cache_specs.attention), layout.num_kv_blocks,
                                                  self.block_size, self.device)
        self.model.bind_caches(self.kv_caches, self.state_pool.layers, self.index_caches)
        self.kv_caches_all = list(self.kv_caches)
        if self.mtp is not None:
            mtp_kv = allocate_kv(self.mtp_kv_specs, layout.num_kv_blocks, self.block_size, self.device)
            mtp_index = allocate_index_caches(self.mtp_kv_specs, layout.num_kv_blocks, self.block_size, self.device)
            for layer, (k_cache, v_cache), index in zip(self.mtp_kv_layers, mtp_kv, mtp_index, strict=True):
                layer.bind_kv(k_cache, v_cache)
                if index is not None:
                    layer.bind_index_cache(index)
            self.kv_caches_all += mtp_kv
        graphs = StepGraphs()
        pad = self.state_pool.pad_slot
        self.input_batch = InputBatch(self.device, self.max_num_batched_tokens, self.max_num_seqs, max_model_len,
                                      self.block_size, k, pad)
        self.stage.allocate(self.max_num_batched_tokens, self.model_config.residual_width, self.dtype, self.device,
                            self.model_config.stage_handover_parts)
        self.state_ops = StateOps(self.model, self.state_pool, self.input_batch, graphs, self.cache_specs, k,
                                  self.num_scratch_sets, self.max_num_seqs)
        self.stage_commits = StageCommits(self.state_ops, self.num_scratch_sets)
        if self.mtp is not None:
            self.drafter = MTPDrafter(self.mtp, self.model, self.input_batch, self.mm, graphs, k,
                                      self.model_config.residual_width, self.dtype, self.max_num_batched_tokens,
                                      self.max_num_seqs, pad)
            self.mtp_proposer = MTPProposer(k, self.drafter)
        if k:
            self.verifier = Verifier(self.input_batch, graphs, self.state_ops, self.drafter, self.mtp_proposer, k,
                                     self.config.seed, layout.num_state_slots, self.max_num_seqs,
                                     single_rank=self.pp_size == 1 and tp_size() == 1,
                                     synthetic_rates=self.synthetic_rates)
        self._init_graphs(graphs)

    # ------------------------------------------------------------------ setup

    def _use_graphs(self) -> bool:
        return not self.config.enforce_eager and (self.device.type == "cuda" or cuda_graphs.EMULATE)

    def _graph_sizes(self) -> dict[str, list[int]]:
        """Padded row counts to capture per graph kind (see ``cuda_graphs``)."""
        if not self.use_graphs:
            return {}
        user = self.config.cuda_graph_sizes
        k = self.num_speculative_tokens
        if not k:
            return {"decode": capture_sizes(min(self.max_num_seqs, self.max_num_batched_tokens), user)}
        q = k + 1
        limit = min(self.max_num_seqs, MAX_VERIFY_GRAPH_TOKENS // q, self.max_num_batched_tokens // q)
        if not self.is_last_stage:
            # A stage before the last keeps each uncommitted verify step's candidates in a scratch set of its own
            # (StageCommits): one verify graph per set, each writing its set.
            return {f"verify{i}": capture_sizes(limit, user) for i in range(self.num_scratch_sets)}
        sizes = {"verify": capture_sizes(limit, user)}
        for j in self.spec_lengths:  # rows of j + 1 tokens: the same batch sizes as the verify graphs of k + 1
            sizes[spec_kind("verify", j, k)] = list(sizes["verify"])
        if self.model.recurrent_layers():  # the commit of a verify graph's rows: every recurrent layer in one replay
            sizes["commit"] = list(sizes["verify"])
            # A step's candidate snapshots (prefix caching): every recurrent layer's copies in one replay.
            sizes["snapshot"] = list(sizes["verify"])
        if self.mtp is not None:
            sizes["mtp"] = capture_sizes(self.max_num_seqs, user)
            # The whole drafting of a verify step: the first pass over each row's k + 1 positions, then k - 1
            # one-token passes fed on the device.
            sizes["draft"] = capture_sizes(limit, user)
            for j in self.draft_lengths:  # the drafting after a shorter step: j passes
                sizes[spec_kind("draft", j, k)] = list(sizes["draft"])
            # The draft graph's inputs from the accepted counts on the device (the whole verify step enqueued).
            sizes["draft_fill"] = list(sizes["draft"])
            if self.pp_size == 1 and tp_size() == 1:  # rows behind rows in flight: their starts from the device
                sizes["behind"] = list(sizes["verify"])
                # The greedy acceptance of a whole verify step enqueued at once, with the next starts.
                sizes["accept"] = list(sizes["verify"])
                for j in self.spec_lengths:
                    sizes[spec_kind("behind", j, k)] = sizes[spec_kind("accept", j, k)] = list(sizes["verify"])
        return sizes

    def _graph_logit_rows(self, sizes: dict[str, list[int]]) -> int:
        if not self.is_last_stage:  # a stage before the last has no LM head: its graphs end at the stage's output
            return 0
        q = self.num_speculative_tokens + 1
        return max([s[-1] * (q if name in ("verify", "draft") else 1) for name, s in sizes.items() if s], default=0)

    def _build_model(self, device: torch.device | None = None) -> CausalLM:
        """The model on ``device`` (the runner's by default; ``meta`` to count its weights)."""
        device = device or self.device
        if self.model_config.quantization is not None and device.type != "meta":
            check_fp8_device(device)
        model_class = registry.model_class(self.model_config)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(device):
                model = model_class(self.model_config)
        finally:
            torch.set_default_dtype(prev)
        return model.eval().requires_grad_(False)

    def _plan_weights(self, use_mtp: bool, draft_layout: dict[str, torch.Tensor]) -> WeightBytes:
        """The bytes this rank's weights will take (``hyserve.worker.memory.weight_bytes``): the model and the draft
        head as they will be built, on the meta device; the head's layers quantized as its checkpoint tensors are
        (the dummy format's are unquantized)."""
        meta = torch.device("meta")
        model = self._build_model(meta)
        if self.pp_size > 1:
            model.drop_unused_embedding(draft_head=use_mtp)
        head = self._build_mtp(draft_layout, meta) if use_mtp else None
        return weight_bytes(model, head)

    def _draft_tensor_layout(self) -> dict[str, torch.Tensor]:
        """The draft head's checkpoint tensors as empty meta tensors of their dtypes, from the headers alone (the
        dummy format's head is unquantized: none)."""
        dtypes = {} if self.config.load_format == "dummy" else \
            draft_tensor_dtypes(self.config.model, self.model_config)
        return {name: torch.empty(0, dtype=d, device="meta") for name, d in dtypes.items()}

    def _kv_bytes_per_block(self) -> int:
        """K and V (and index keys, where kept) of one block in every KV-caching layer, the MTP head's included."""
        return self.cache_specs.kv_bytes_per_block(self.block_size) + sum(
            s.bytes_per_block(self.block_size) for s in self.mtp_kv_specs)

    def _build_mtp(self, tensors: dict[str, torch.Tensor], device: torch.device | None = None) -> nn.Module:
        """The draft head, empty, on ``device`` (the runner's by default); its layers quantized as its checkpoint
        ``tensors`` are (their dtypes alone count; ``hyserve.layers.quantization``)."""
        draft = registry.draft_head(self.model_config)
        cfg = dataclasses.replace(self.model_config, quantization=draft_head_quantization(
            self.model_config.quantization, tensors))
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(device or self.device):
                head = draft.build(cfg)
        finally:
            torch.set_default_dtype(prev)
        return head.eval().requires_grad_(False)

    def _init_graphs(self, graphs: StepGraphs) -> None:
        """Capture the graph kinds ``_graph_sizes`` plans, each room registering the bodies of its own kinds."""
        sizes = self._graph_sizes()
        if not any(sizes.values()):
            return
        # Every graph writes its logits into (a prefix of) these two buffers (the last stage's).
        self.graph_logits = GraphLogits(self.model, self._graph_logit_rows(sizes), self.model_config.vocab_size,
                                        self.dtype, self.device)
        k = self.num_speculative_tokens
        bodies = {"decode": GraphBody(weak_forward(self._graph_decode), lambda n: self.prepare([], pad_to=n))}
        for j in (k, *self.spec_lengths):  # the verify graphs of k drafts per row and of each shorter length
            bodies[spec_kind("verify", j, k)] = GraphBody(weak_forward(self._graph_verify, j + 1))
        for i in range(self.num_scratch_sets if not self.is_last_stage else 0):
            bodies[f"verify{i}"] = GraphBody(weak_forward(self._graph_verify_stage, i))
        bodies.update(self.state_ops.graph_bodies())
        if self.drafter is not None:
            bodies.update(self.drafter.graph_bodies(self.graph_logits, self.max_num_seqs,
                                                    self.model_config.residual_width, self.dtype, self.draft_lengths))
        if self.verifier is not None:
            bodies.update(self.verifier.graph_bodies(self.graph_logits, self.spec_lengths))
        emulate = self.device.type != "cuda"
        for name, s in sizes.items():
            graphs.add(GraphSet(name, s, bodies[name].forward, emulate))

        def step_pads(name: str) -> Callable[[int], object]:  # pad rows of the kind's verify layout, step buffers
            q = int(name.split("@")[1]) + 1 if "@" in name else k + 1
            return lambda n: self.prepare([], pad_to=n, pad_len=q)

        graphs.capture(self.device, {name: bodies[name].fill_pads or step_pads(name) for name in sizes})
        self.graphs = graphs

    # ------------------------------------------------------------------ graph forwards (read persistent buffers only)

    def _graph_decode(self, size: int) -> tuple[torch.Tensor, ...]:
        meta = self.input_batch.static_meta(self.input_batch.dev_bufs, size, size, 1)
        out = self.stage.forward(self.model, self.input_batch.dev_bufs["input_ids"][:size], meta)
        if isinstance(out, tuple):  # a stage before the last: what the next stage receives
            return out
        return (self.graph_logits(out),)

    def _graph_verify_stage(self, scratch_set: int, size: int) -> tuple[torch.Tensor, ...]:
        """``verify<i>`` graphs (a pipeline stage before the last): the stage's verify forward with its candidates
        in scratch set ``i``; returns the stage's output for the next stage."""
        self.state_ops.bind_scratch(scratch_set)
        q = self.num_speculative_tokens + 1
        batch = self.input_batch
        out = self.stage.forward(self.model, batch.dev_bufs["input_ids"][: size * q], batch.verify_static_meta(size))
        assert isinstance(out, tuple)
        return out

    def _graph_verify(self, q: int, size: int) -> tuple[torch.Tensor, ...]:
        """``verify`` graph (``q`` = k + 1) or ``verify@j`` (q = j + 1): ``size`` rows of q tokens."""
        batch = self.input_batch
        hidden = self.stage.forward(self.model, batch.dev_bufs["input_ids"][: size * q],
                                    batch.verify_static_meta(size, q))
        assert isinstance(hidden, torch.Tensor), "verify graphs run on the last stage only"
        return hidden, self.graph_logits(hidden)

    def _graph(self, kind: str, num_rows: int, fits: Callable[[], bool]) -> tuple[GraphSet, int] | None:
        return self.graphs.fitting(kind, num_rows, fits) if self.graphs is not None else None

    # ------------------------------------------------------------------ step

    def prepare(self, rows: list[ScheduledRow], pad_to: int | None = None, pad_len: int = 1,
                row_len: int | None = None) -> tuple[StepMetadata, torch.Tensor, torch.Tensor]:
        """Fill the persistent buffers for ``rows``; returns metadata, input ids and logits row indices (views).

        Verify rows (speculative decoding) must come first; every one of their real positions yields logits.
        ``pad_to`` (a captured graph's batch size) appends pad rows of ``pad_len`` tokens up to that many rows (see
        ``cuda_graphs``); the returned metadata then describes only the real rows. ``row_len`` (the verify graph's
        k + 1) lays every verify row out in ``row_len`` tokens: a row with fewer drafts is followed by masked tokens
        (no KV write, outputs never read; its context length counts them so that its real tokens keep their causal
        positions), and ``logits_indices`` lists the real tokens.
        """
        batch = self.input_batch
        step = batch.fill(rows, pad_to, pad_len, row_len, self.mm)
        if step.prev:
            batch.feed_previous_samples(step.prev)
        if self.verifier is not None:
            self.verifier.complete_inputs(step, pad_to, row_len)
        batch.record_fence()
        meta = batch.metadata(step)
        if step.mm_rows:
            assert pad_to is None, "a step reaching an image runs eagerly"
            # On a later pipeline stage the first one embedded the images.
            meta.mrope_positions, meta.image_embeds = self.mm.image_inputs(
                batch.host_bufs["positions"][: step.num_tokens], step.mm_rows, embed=self.is_first_stage)
        batch.last_meta = meta
        return meta, step.views["input_ids"], step.views["logits_indices"]

    def execute_model(self, so: SchedulerOutput) -> RunnerOutput:
        """Run step ``so`` and return its result, one entry per row of ``so``."""
        return self.execute_model_async(so).result()

    @torch.inference_mode()
    def execute_model_async(self, so: SchedulerOutput) -> StepResult:
        """Enqueue step ``so`` on the device; ``result()`` of the returned handle is its ``RunnerOutput``.

        In order: forget finished requests and learn new ones; the prefix cache's moves of evicted snapshots to the
        host (on a stage before the last, after the earlier steps' verify commits it applies); the state operations
        before the forward (slot resets, snapshot copy-ins); the forward; sampling of
        plain rows and acceptance of verify rows (the one place either happens); the verified-state commit; the
        snapshot copy-outs; the MTP head's drafts for the next step. A step without speculation returns before its
        sampled ids reach the host (they stay on the device, where the next step's ``PREVIOUS_SAMPLED`` inputs take
        them); a speculative step is complete when it returns (its drafts need the accepted tokens on the host).
        """
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            self.mm.prompts.pop(rid, None)
            self.sampling_state.remove_request(rid)
        for new in so.new_requests:
            self.requests[new.req_id] = new.sampling_params
            if self.is_last_stage:  # the stage that samples
                self.sampling_state.add_request(new.req_id, new.sampling_params, new.prompt_token_ids)
            if new.mm is not None:
                self.mm.prompts[new.req_id] = new.mm
        out = RunnerOutput(so.step_id, token_ids=[[] for _ in so.rows], num_accepted=[-1] * len(so.rows))
        if not self.is_last_stage:
            return self._execute_stage(so, out)
        if self.pp_size > 1:  # the last stage's time is not the step's
            return self._execute_last(so, out)
        timed = bool(so.rows)
        if timed:
            self.step_timer.begin()
        # The profiler's name for what the step launches (benchmarks/trace_gaps.py sums the device time by it).
        kind = "prompt" if any(not r.is_verify and r.num_new_tokens > 1 for r in so.rows) else "decode"
        with torch.profiler.record_function(f"hyserve::step({kind})"):
            result = self._execute_last(so, out)
        if timed:
            self.step_timer.end(so.step_id)
        out.step_seconds = self.step_timer.take()
        return result

    def _execute_last(self, so: SchedulerOutput, out: RunnerOutput) -> StepResult:
        """``execute_model_async`` on the stage that samples (the only one without pipeline parallelism)."""
        rows = so.rows
        with _named("state"):
            self.state_ops.offload_snapshots(so.snapshot_offloads)  # before anything of the step writes those entries
        if not rows:
            return StepResult(out)
        plain = [i for i, r in enumerate(rows) if r.samples and not r.is_verify]
        verify = [i for i, r in enumerate(rows) if r.is_verify]
        sampling_rows = [self._sampling_row(rows[i], i, out.errors) for i in plain]
        spec_rows = [self._spec_row(rows[i], i, out.errors) for i in verify]
        verifier = self.verifier
        # The drafts the MTP head proposes for the next step: max(k_step, 1), or k where no step is shorter.
        if not self.spec_lengths:
            num_drafts = self.num_speculative_tokens
        else:
            num_drafts = max(so.num_spec_tokens, 1) if so.num_drafting is None else so.num_drafting
        # Whether the whole verify step is enqueued at once; a row behind another otherwise needs its start first
        # (resolving it changes nothing the check reads: the scheduler sends a row behind only where it fits).
        chain = verifier.device_chain(rows, spec_rows, num_drafts) if verifier is not None else None
        if verifier is not None and chain is None and any(r.start_on_device for r in rows):
            rows = verifier.resolve_starts(rows)
        with _named("state"):
            self.state_ops.load_states(rows)
        with _named("forward"):
            logits = self._forward_spec(rows) if self.num_speculative_tokens else self._forward(rows, len(plain))
        n_verify = sum(rows[i].num_new_tokens for i in verify)
        out.prompt_logprobs, self.step_prompt_logprobs = self.step_prompt_logprobs, {}
        with _named("sample"):
            adjusted_v, adjusted = self._adjust_logits(rows, verify, plain, logits, n_verify)
            samp = self.sampler.sample(logits[n_verify:], sampling_rows, adjusted=adjusted) if plain else None
            if samp is not None:
                self.input_batch.remember_samples(rows, plain, samp.tokens)
        if verifier is None:
            with _named("state"):
                self.state_ops.save_snapshots(rows, out.num_accepted)
            return StepResult(out, plain, samp)
        if samp is not None:
            with _named("sample"):
                take_samples(out, plain, samp.result())
        if chain is not None:
            assert self.last_hidden is not None
            with _named("verify+mtp"):
                return verifier.verify_and_draft_on_device(rows, spec_rows, logits[:n_verify], self.last_hidden,
                                                           out, *chain, adjusted=adjusted_v, num_drafts=num_drafts)
        if verify:
            with _named("verify"):
                pending = verifier.accept(logits[:n_verify], spec_rows, adjusted=adjusted_v)
                take_verified(out, verify, pending.result())
        # The snapshots first: a candidate may be rebuilt from its slot's state before the step (RecurrentLayer.
        # snapshot_candidates).
        with _named("state"):
            self.state_ops.save_snapshots(rows, out.num_accepted)
            if verify:
                self.state_ops.commit_verified([out.num_accepted[i] for i in verify])
        if self.mtp_proposer is not None:
            assert self.last_hidden is not None
            # Structured output computes a request's masks from its drafts on the host: a step with such a row
            # brings its drafts to the host (they are kept on the device too).
            on_host = any(r.grammar_bitmask is not None for r in rows)
            with _named("mtp"):
                out.next_draft_token_ids = self.mtp_proposer.propose(rows, out, self.last_hidden,
                                                                     None if on_host else verifier.draft_slots,
                                                                     num_drafts)
            verifier.keep_drafts(rows, out.next_draft_token_ids)
        return StepResult(out)

    def _adjust_logits(self, rows: list[ScheduledRow], verify: list[int], plain: list[int], logits: torch.Tensor,
                       n_verify: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The step's inputs into the request histories, then the adjusted logits of its verify rows and of its
        plain rows (None where no row adjusts): ``SamplingState``."""
        state = self.sampling_state
        if not state.params:
            return None, None
        batch = self.input_batch
        starts = batch.dev_bufs["verify_starts"]
        state.record_inputs(rows, batch.dev_bufs["input_ids"], batch.np_bufs["query_start_loc"], starts)
        adjusted_v = state.adjust(logits[:n_verify], [rows[i] for i in verify], starts) if verify else None
        adjusted = state.adjust(logits[n_verify:], [rows[i] for i in plain]) if plain else None
        return adjusted_v, adjusted

    def _execute_stage(self, so: SchedulerOutput, out: RunnerOutput) -> StepResult:
        """Step ``so`` on a pipeline stage before the last: the verify commits that arrived with it (of earlier
        steps), the state operations, the forward (its output goes to the next stage), the snapshot copy-outs that
        do not depend on the accepted counts. Nothing is sampled here; the result is empty."""
        commits = self.stage_commits
        for step_id, num_accepted in so.verify_commits:
            commits.apply_commit(commits.pending_commit(step_id), num_accepted)
        # After the commits: they write earlier steps' candidate snapshots, which the scheduler has published
        # already (the last stage wrote its own in their steps), and one of those may be what moves now.
        self.state_ops.offload_snapshots(so.snapshot_offloads)
        rows = so.rows
        if not rows:
            return StepResult(out)
        verify = [i for i, r in enumerate(rows) if r.is_verify]
        if not verify:
            self.state_ops.load_states(rows)
            self._forward(rows, 0)  # a decode graph when the step fits one
            self.state_ops.save_snapshots(rows, out.num_accepted)
            return StepResult(out)
        scratch = commits.take_scratch_set(so.step_id)
        self.state_ops.load_states(rows)
        q = self.num_speculative_tokens + 1
        graph = self._graph(f"verify{scratch}", len(rows),
                            lambda: all(r.is_verify and r.start + q <= self.max_model_len
                                        and (self.is_first_stage or r.num_new_tokens == q) for r in rows))
        if graph is not None:
            graphs, size = graph
            meta, _, real = self.prepare(rows, pad_to=size, pad_len=q, row_len=q)
            self.stage.recv_stage_input(len(rows) * q)
            parts = graphs.run(size)
            self.stage.send(*(p[real] for p in parts))  # the real tokens only, as an eager step sends them
        else:
            meta, input_ids, _ = self.prepare(rows)
            self.stage.run_model(self.model, input_ids, meta)
        commits.keep(so.step_id, scratch, rows, verify, meta)
        self.state_ops.save_snapshots(rows, out.num_accepted)  # the accepted counts are unknown (-1): no candidates
        return StepResult(out)

    def held_requests(self) -> list[str]:
        """The ids of the requests this runner keeps anything of: sampling parameters, images (the scheduler's
        ``finished_req_ids`` take them out)."""
        return sorted(set(self.requests) | set(self.mm.prompts))

    @property
    def num_uncommitted_steps(self) -> int:
        return self.stage_commits.num_uncommitted_steps

    def _sampling_row(self, row: ScheduledRow, i: int, errors: dict[int, str]) -> SamplingRow:
        """Row ``row``'s sampling inputs; if they cannot be built, the row fails alone (a greedy stand-in is sampled
        so the batch keeps its shape, and its result is dropped)."""
        p = self.requests[row.req_id]
        try:
            banned = self._bans(row, p, 0)
            seed = None if p.seed is None else token_seed(p.seed, row.output_index)
            return SamplingRow(params=p, seed=seed, banned_token_ids=banned, grammar_mask=row.grammar_bitmask)
        except Exception as e:  # this row's inputs alone
            logger.exception("request %s: building its sampling row failed", row.req_id)
            errors[i] = f"building its sampling row failed: {type(e).__name__}: {e}"
            return SamplingRow(params=_STAND_IN)

    def _spec_row(self, row: ScheduledRow, i: int, errors: dict[int, str]) -> SpecRow:
        p = self.requests[row.req_id]
        k = row.num_drafts
        drafts = list(row.token_ids[1:])
        try:
            seeds: list[int | None] | None = None
            if p.seed is not None:
                seeds = [token_seed(p.seed, row.output_index + j) for j in range(k + 1)]
            banned = [self._bans(row, p, j) for j in range(k + 1)]
            return SpecRow(params=p, draft_token_ids=drafts, seeds=seeds,
                           banned_token_ids=banned if any(banned) else None, grammar_masks=row.grammar_bitmask)
        except Exception as e:  # this row's inputs alone
            logger.exception("request %s: building its verify row failed", row.req_id)
            errors[i] = f"building its verify row failed: {type(e).__name__}: {e}"
            return SpecRow(params=_STAND_IN, draft_token_ids=drafts)

    def _bans(self, row: ScheduledRow, p: SamplingParams, j: int) -> list[int]:
        """Ids banned at the row's output index + ``j`` (min_tokens); ValueError for an id outside the vocabulary,
        which would fail the sampler for every row of the step."""
        if row.output_index + j >= p.min_tokens or not row.banned_token_ids:
            return []
        banned = row.banned_token_ids
        vocab = self.model_config.vocab_size
        if not all(0 <= t < vocab for t in banned):
            raise ValueError(f"stop_token_ids / EOS ids {banned[:5]} reach outside the vocabulary [0, {vocab})")
        return banned

    def _forward(self, rows: list[ScheduledRow], num_sampling: int) -> torch.Tensor:
        """The forward of a step without verify rows; logits of the rows that sample (in row order)."""
        graph = self._graph("decode", len(rows), lambda: all(r.num_new_tokens == 1 and not r.is_verify
                                                             and not self.mm.reaches_image(r)
                                                             and not r.prompt_logprob_targets for r in rows))
        if graph is not None:
            decode, size = graph
            _, _, logits_indices = self.prepare(rows, pad_to=size)
            self.stage.recv_stage_input(len(rows))
            outs = decode.run(size)
            if not self.is_last_stage:
                self.stage.send(*(o[: len(rows)] for o in outs))
                return outs[0][:0]
            logits, = outs
            # One token per row: row i's logits are row i of the graph's output.
            return logits[: len(rows)] if num_sampling == len(rows) else logits[logits_indices]
        meta, input_ids, logits_indices = self.prepare(rows)
        hidden = self.stage.run_model(self.model, input_ids, meta)
        self._take_prompt_logprobs(rows, hidden)
        if not num_sampling:
            return hidden[:0]
        return self.model.compute_logits(hidden[logits_indices])

    def _forward_spec(self, rows: list[ScheduledRow]) -> torch.Tensor:
        """The forward of a step with verify rows first; logits for every verify position, then for sampling rows.

        The step's hidden states stay in ``last_hidden`` for the MTP pass. The verify graph of the step's longest
        row where one was captured for that length (``verify@j``: the step's k_step, or fewer where no row has as
        many drafts, as after a step that drafted fewer), else the graph of k drafts per row.
        """
        k = self.num_speculative_tokens
        graph, q = None, k + 1
        j = max((r.num_drafts for r in rows), default=k)
        if j in self.spec_lengths:
            q = j + 1
            graph = self._verify_graph(rows, spec_kind("verify", j, k), q)
        if graph is None:
            q = k + 1
            graph = self._verify_graph(rows, "verify", q)
        self.input_batch.verify_graph_size = graph[1] if graph is not None else None
        self.input_batch.verify_graph_q = q
        if graph is not None:
            verify, size = graph
            _, _, logits_indices = self.prepare(rows, pad_to=size, pad_len=q, row_len=q)
            self.stage.recv_stage_input(len(rows) * q)  # every row has k + 1 tokens here (see the graph's condition)
            hidden, logits = verify.run(size)
            if all(row.num_new_tokens == q for row in rows):
                n = len(rows) * q
                self.last_hidden = hidden[:n]
                return logits[:n]
            self.last_hidden = hidden[logits_indices]  # the real tokens, in row order, as the eager path returns
            return logits[logits_indices]
        meta, input_ids, logits_indices = self.prepare(rows)
        hidden = self.stage.run_model(self.model, input_ids, meta)
        self._take_prompt_logprobs(rows, hidden)
        self.last_hidden = hidden
        return self.model.compute_logits(hidden[logits_indices])

    def _verify_graph(self, rows: list[ScheduledRow], kind: str, q: int) -> tuple[GraphSet, int] | None:
        """The verify graphs of ``kind`` (rows of ``q`` tokens) and the padded size, if the step fits them: every
        row verifies with at most q tokens (rows with fewer drafts are laid out in q tokens, the rest masked; see
        prepare). A later pipeline stage receives the previous stage's tokens as they are: the graph's layout is
        theirs only when no row is short."""
        return self._graph(kind, len(rows),
                           lambda: all(r.is_verify and r.num_new_tokens <= q
                                       and r.latest_start + q <= self.max_model_len
                                       and (self.is_first_stage or r.num_new_tokens == q) for r in rows))

    def _take_prompt_logprobs(self, rows: list[ScheduledRow], hidden: torch.Tensor) -> None:
        """The prompt logprobs of the rows that ask (an eager forward: ``hidden`` holds every position)."""
        if self.is_last_stage and wants_prompt_logprobs(rows):
            self.step_prompt_logprobs = prompt_logprobs(self.model.compute_logits, hidden, rows, self.requests)

"""Owns the model, its caches and the step's persistent input buffers; runs one scheduled step.

Per-step host work is a fill of preallocated host arrays and one copy per buffer to the device. The device buffers
(input ids, positions, row offsets, context lengths, state slots, block tables, KV slot mapping) are allocated once at
their maximum size and a step uses a prefix of each (docs/design.md invariant 7), so a CUDA graph captured over
them stays valid.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from hyserve.cache.block_pool import BlockPool, cdiv
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
from hyserve.kernels.fp8 import check_fp8_device
from hyserve.layers.linear import ParallelLMHead
from hyserve.layers.quantization import draft_head_quantization, quantization_summary
from hyserve.layers.rejection_sampler import PendingSpec, RejectionSampler, SpecOutput, SpecRow
from hyserve.layers.sampler import PendingSample, Sampler, SamplerOutput, SamplingRow, token_seed
from hyserve.model import registry
from hyserve.model.base import CausalLM, KVCacheLayer
from hyserve.model.loader import load_weights
from hyserve.model.metadata import StepMetadata, VerifyMetadata
from hyserve.model.vision import VisionConfig
from hyserve.multimodal.image import ImageProcessorSettings
from hyserve.multimodal.inputs import ImageInput, MultimodalPrompt
from hyserve.sampling_params import SamplingParams
from hyserve.scheduler.output import (
    PREVIOUS_DRAFT,
    PREVIOUS_SAMPLED,
    RunnerOutput,
    ScheduledRow,
    SchedulerOutput,
    candidate_point,
)
from hyserve.speculative.mtp_proposer import MTPProposer
from hyserve.utils import device_tensor
from hyserve.worker import cuda_graphs
from hyserve.worker.cuda_graphs import MAX_VERIFY_GRAPH_TOKENS, GraphSet, StepGraphs, capture_sizes

logger = logging.getLogger("hyserve")

# Sampled in place of a row whose own sampling inputs failed (its result is dropped).
_STAND_IN = SamplingParams(temperature=0.0)

@dataclass(slots=True)
class MTPRow:
    """Positions [start, start + len(input_ids)) of one request for the MTP layer (see ``mtp_forward``)."""

    start: int
    input_ids: list[int]
    hidden_index: list[int]
    block_table: list[int]
    req_id: str | None = None  # a prompt with images: its positions and image rows (``mm_prompts``)


@dataclass(slots=True)
class ChainRow:
    """One verify row's drafting in the ``draft`` graph (``mtp_draft_chain``): the MTP layer over positions
    [start, start + len(input_ids)) (the accepted drafts and the correction; hidden states ``hidden_index``), then
    ``num_drafts`` - 1 more passes at the positions after; 0 drafts: the first pass only (its KV entries)."""

    start: int
    input_ids: list[int]
    hidden_index: list[int]
    block_table: list[int]
    num_drafts: int
    state_slot: int = -1  # the request's: its drafts row in ``draft_slots``
    shift: int = 0  # what the rotary position adds to the index (a prompt's rope_delta past its last image)


@dataclass(slots=True)
class PendingCommit:
    """A verify step that a pipeline stage other than the last ran before its accepted counts were known: the
    step's own verify-row slots and snapshot reservations, and the scratch set holding its candidates. Applied when
    the counts arrive (``SchedulerOutput.verify_commits``, by step id), whatever steps ran in between."""

    step_id: int
    scratch_set: int
    state_slots: torch.Tensor  # (verify rows,) this step's, not the buffer the next step overwrites
    candidates: list[tuple[int, int, int]]  # (verify row, position, snapshot entry) of candidate_snapshot


@dataclass(slots=True)
class DeviceMemory:
    """One reading of a CUDA device's memory (bytes); ``non_torch`` = used on the device minus torch's reserved."""

    total: int
    free: int
    reserved: int
    allocated: int
    non_torch: int


def largest_image_inputs(model_dir: str, cfg: VisionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero pixels and the grid of the largest square image the checkpoint's processor makes (its max_pixels):
    what the memory profile encodes."""
    settings = ImageProcessorSettings.from_checkpoint(model_dir)
    unit = settings.patch_size * settings.merge_size
    side = max(1, int(math.isqrt(settings.max_pixels) // unit)) * settings.merge_size  # patches per side
    grid = torch.tensor([[1, side, side]], dtype=torch.long)
    return torch.zeros(side * side, cfg.patch_dim), grid


# The encoder cache holds this many steps' token budget of image embeddings, and at least ENCODER_CACHE_MIN_TOKENS
# (8192 rows of a 27B model's 5120-wide bf16 embeddings: 84 MB; not counted in the memory plan yet).
ENCODER_CACHE_STEPS = 4
ENCODER_CACHE_MIN_TOKENS = 8192


def _device_memory(device: torch.device) -> DeviceMemory | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    return DeviceMemory(total, free, reserved, torch.cuda.memory_allocated(device), total - free - reserved)


def _weak_forward(method: Callable[..., tuple[torch.Tensor, ...]], *args: int
                  ) -> Callable[[int], tuple[torch.Tensor, ...]]:
    """``method(*args, size)`` called through a weak reference to its object (see ``_init_graphs``)."""
    ref = weakref.WeakMethod(method)

    def forward(size: int) -> tuple[torch.Tensor, ...]:
        bound = ref()
        if bound is None:
            raise RuntimeError("the model runner of this graph was released")
        return bound(*args, size)

    return forward


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, device: torch.device,
                 dtype: torch.dtype, num_speculative_tokens: int = 0, use_mtp: bool = False,
                 max_steps_in_flight: int = 1) -> None:
        self.config = config
        self.model_config = model_config
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        # What the device held before this instance allocated anything: the cache budget counts only this
        # instance's own weights, activations and non-torch memory against gpu_memory_utilization (vLLM's meaning).
        self._mem_baseline = _device_memory(device)
        t0 = time.perf_counter()
        self.model = self._build_model()
        self.pp_size = pp_size()
        self.is_first_stage, self.is_last_stage = is_first_stage(), is_last_stage()
        if self.pp_size > 1:
            self.model.drop_unused_embedding(draft_head=use_mtp)
        self.mtp_weights = load_weights(self.model, config.model, model_config)
        self.mtp: nn.Module | None = None  # the family's draft head (registry), run over the target's hidden states
        # Pipeline parallelism: this stage's layers only; the last stage samples, verifies and drafts (MTP).
        self.link = StageLink() if self.pp_size > 1 else None
        if use_mtp and self.is_last_stage:
            self.mtp = self._build_mtp()
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
        if self.pp_size > 1:
            start, end = stage_layers(model_config.num_hidden_layers)
            logger.info("pipeline stage %d of %d: decoder layers %d-%d (%d attention, %d recurrent)%s%s", pp_rank(),
                        self.pp_size, start, end - 1, len(self.cache_specs.attention),
                        len(self.cache_specs.recurrent), ", the embedding" if self.is_first_stage else "",
                        ", the final norm, LM head" + (" and MTP head" if self.mtp is not None else "")
                        if self.is_last_stage else "")
        else:
            logger.info("loaded %s (%.1fM parameters, %s) in %.1f s", config.model,
                        model_config.num_parameters() / 1e6, dtype, time.perf_counter() - t0)
        summary = quantization_summary(self.model, model_config.quantization, dtype)
        if summary is not None:
            logger.info(summary)
        self.max_num_batched_tokens = int(config.max_num_batched_tokens or default_max_num_batched_tokens(device.type))
        self.max_num_seqs = config.max_num_seqs or DEFAULT_MAX_NUM_SEQS
        self.num_speculative_tokens = num_speculative_tokens
        # A stage before the last commits a verify step when its accepted counts arrive, up to a few steps later:
        # each uncommitted step keeps its candidates in a scratch set of its own.
        self.num_scratch_sets = max_steps_in_flight + 1 if num_speculative_tokens and not self.is_last_stage else 1
        self._free_scratch_sets: list[int] = list(range(self.num_scratch_sets))
        self._scratch: list[list[dict[str, torch.Tensor]]] = []
        self._uncommitted: dict[int, PendingCommit] = {}
        self.graphs: StepGraphs | None = None
        self._verify_graph_size: int | None = None  # the padded size of the last step's verify graph, if it ran
        self.use_graphs = self._use_graphs()
        self.max_model_len = 0  # set by initialize_cache
        self.last_meta: StepMetadata | None = None
        self.last_hidden: torch.Tensor | None = None
        self._h2d_fence: torch.cuda.Event | None = None  # recorded after a step's copies out of host_bufs
        self._draft_fence: torch.cuda.Event | None = None  # the same for draft_host (_fill_draft_on_device)
        # Whether verify steps are enqueued whole (``_device_chain``): about 45 more launches per step, all while
        # the verify forward runs, against a host wait and a device idle gap; benchmarks compare both.
        self.use_device_chain = True
        # The last prepared step's verify drafts as fed (on the device), when some were PREVIOUS_DRAFT inputs.
        self.verify_draft_ids: torch.Tensor | None = None
        self.sampler = Sampler(device, seed=config.seed)
        self.rejection_sampler = RejectionSampler(device, seed=config.seed) if num_speculative_tokens else None
        self.mtp_proposer = MTPProposer(num_speculative_tokens) if self.mtp is not None else None
        # Sampling parameters of the requests this worker has been sent (SchedulerOutput.new_requests).
        self.requests: dict[str, SamplingParams] = {}
        # The last step's sampled ids on the device, and each sampling request's row among them.
        self._prev_sampled: torch.Tensor | None = None
        self._prev_rows: dict[str, int] = {}
        # Image input: each request's images and M-RoPE positions (from new_requests), and the vision tower's
        # outputs by image content hash, least recently used first, up to encoder_cache_tokens rows: a screenshot
        # repeated in later turns' prompts is encoded once.
        self.mm_prompts: dict[str, MultimodalPrompt] = {}
        self.encoder_cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.encoder_cache_tokens = max(ENCODER_CACHE_STEPS * self.max_num_batched_tokens, ENCODER_CACHE_MIN_TOKENS)
        self.num_images_encoded = 0

    def cache_info(self) -> CacheInfo:
        return CacheInfo(self._kv_bytes_per_block(), self.cache_specs.state_bytes_per_slot,
                         bool(self.cache_specs.recurrent), self.num_scratch_sets)

    def determine_available_memory(self) -> int:
        """Bytes this worker can give the caches (see ``_cache_budget``)."""
        return self._cache_budget()

    def initialize_cache(self, layout: CacheLayout, max_model_len: int) -> None:
        """Allocate what ``layout`` says (KV blocks, state pool, verify scratch), the step buffers and the graphs."""
        self.layout = layout
        self.max_num_seqs = layout.max_num_seqs
        self.state_pool = StatePool(self.cache_specs.recurrent, layout.num_state_slots, self.device,
                                    num_snapshots=layout.num_snapshots)
        self.kv_caches = self._allocate_kv(layout.num_kv_blocks)
        self.model.bind_caches(self.kv_caches, self.state_pool.layers)
        if self.mtp is not None:
            mtp_kv = self._allocate_kv(layout.num_kv_blocks, self.mtp_kv_specs)
            for layer, (k_cache, v_cache) in zip(self.mtp_kv_layers, mtp_kv, strict=True):
                layer.bind_kv(k_cache, v_cache)
            self.kv_caches_all = [*self.kv_caches, *mtp_kv]
        else:
            self.kv_caches_all = list(self.kv_caches)
        if self.num_speculative_tokens:
            self._allocate_verify_scratch(self.num_speculative_tokens + 1)
        # The drafts the MTP head's draft graph leaves on the device: row s holds the drafts of the request in state
        # slot s (the pad slot's row takes the pad rows'), read by its next verify row's PREVIOUS_DRAFT inputs. On a
        # single rank only: a pipeline's first stage, or another tensor-parallel rank, could not read this rank's.
        self.draft_slots: torch.Tensor | None = None
        # Beside them, per slot, what its last verify row's acceptance found: the next start (start + accepted + 1)
        # and the last token (the correction or the bonus). A verify row scheduled behind that row while it was in
        # flight (ScheduledRow.start_on_device) starts from these.
        self.verify_next_start: torch.Tensor | None = None
        self.verify_next_token: torch.Tensor | None = None
        if self.mtp is not None and self.pp_size == 1 and tp_size() == 1:
            self.draft_slots = torch.zeros((layout.num_state_slots + 1, self.num_speculative_tokens),
                                           dtype=torch.long, device=self.device)
            self.verify_next_start = torch.zeros(layout.num_state_slots + 1, dtype=torch.long, device=self.device)
            self.verify_next_token = torch.zeros(layout.num_state_slots + 1, dtype=torch.long, device=self.device)
        self.max_model_len = max_model_len
        self._allocate_buffers()
        self._init_graphs()

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
            # (PendingCommit): one verify graph per set, each writing its set.
            return {f"verify{i}": capture_sizes(limit, user) for i in range(self.num_scratch_sets)}
        sizes = {"verify": capture_sizes(limit, user)}
        if self.model.recurrent_layers():  # the commit of a verify graph's rows: every recurrent layer in one replay
            sizes["commit"] = list(sizes["verify"])
            # A step's candidate snapshots (prefix caching): every recurrent layer's copies in one replay.
            sizes["snapshot"] = list(sizes["verify"])
        if self.mtp is not None:
            sizes["mtp"] = capture_sizes(self.max_num_seqs, user)
            # The whole drafting of a verify step: the first pass over each row's k + 1 positions, then k - 1
            # one-token passes fed on the device.
            sizes["draft"] = capture_sizes(limit, user)
            # The draft graph's inputs from the accepted counts on the device (the whole verify step enqueued).
            sizes["draft_fill"] = list(sizes["draft"])
            if self.pp_size == 1 and tp_size() == 1:  # rows behind rows in flight: their starts from the device
                sizes["behind"] = list(sizes["verify"])
                # The greedy acceptance of a whole verify step enqueued at once, with the next starts.
                sizes["accept"] = list(sizes["verify"])
        return sizes

    def _graph_logit_rows(self, sizes: dict[str, list[int]]) -> int:
        if not self.is_last_stage:  # a stage before the last has no LM head: its graphs end at the stage's output
            return 0
        q = self.num_speculative_tokens + 1
        return max([s[-1] * (q if name in ("verify", "draft") else 1) for name, s in sizes.items() if s], default=0)

    def _graph_memory_estimate(self) -> int:
        """Bytes the graphs take beyond the caches: the shared logits buffers (model dtype and float32) and the
        pool of their activations."""
        sizes = self._graph_sizes()
        if not sizes:
            return 0
        cfg = self.model_config
        elem = torch.finfo(self.dtype).bits // 8
        width = self.model.activation_width()
        tokens = max(s[-1] * (self.num_speculative_tokens + 1) for s in sizes.values() if s)
        rows = self._graph_logit_rows(sizes)
        return rows * cfg.vocab_size * (4 + elem) + tokens * 16 * width * elem + 64 * 2**20

    def _build_model(self) -> CausalLM:
        if self.model_config.quantization is not None:
            check_fp8_device(self.device)
        model_class = registry.model_class(self.model_config)
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = model_class(self.model_config)
        finally:
            torch.set_default_dtype(prev)
        return model.eval().requires_grad_(False)

    def _kv_bytes_per_block(self) -> int:
        """K and V of one block in every KV-caching layer, the MTP head's included."""
        return self.cache_specs.kv_bytes_per_block(self.block_size) + sum(
            s.bytes_per_block(self.block_size) for s in self.mtp_kv_specs)

    def _build_mtp(self) -> nn.Module:
        draft = registry.draft_head(self.model_config)
        # The head's layers are quantized as its checkpoint tensors are (hyserve.layers.quantization).
        cfg = dataclasses.replace(self.model_config, quantization=draft_head_quantization(
            self.model_config.quantization, self.mtp_weights))
        prev = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                head = draft.build(cfg)
        finally:
            torch.set_default_dtype(prev)
        draft.load(head, self.mtp_weights)
        return head.eval().requires_grad_(False)

    def _cache_budget(self) -> int:
        """Bytes for the KV cache, state pool and snapshots.

        CUDA, as vLLM's ``gpu_memory_utilization``: this instance may use ``total * utilization`` of the card; the
        cache gets that minus what the instance itself already holds (weights, non-torch memory such as cuBLAS
        workspaces, both measured against the baseline taken before loading), its profiled activation peak and the
        CUDA graphs' estimate. Other processes and other instances in this process are not subtracted; instead the
        share asked for must be free, so two instances at 0.45 each fit on one card and a second one at 0.9 is
        refused with a message that says what holds the memory.
        """
        if self.device.type != "cuda":
            return int(self.config.cpu_cache_memory_bytes)
        util = self.config.gpu_memory_utilization
        base = self._mem_baseline
        assert base is not None
        peak = self._profile_peak_activation()
        now = _device_memory(self.device)
        assert now is not None
        total = now.total
        weights = max(0, now.allocated - base.allocated)
        non_torch = max(0, now.non_torch - base.non_torch)
        graphs = self._graph_memory_estimate()
        requested = int(total * util)
        # Free to this instance at the baseline: the device's free memory and what torch's allocator had cached
        # but not handed out (a shut-down instance's memory is there until empty_cache).
        free_at_start = base.free + base.reserved - base.allocated
        if requested > free_at_start:
            raise ValueError(
                f"gpu_memory_utilization={util} asks for {requested / 2**30:.2f} GiB of the {total / 2**30:.2f} GiB "
                f"device, but only {free_at_start / 2**30:.2f} GiB was free when this instance started (other "
                f"processes or other LLM instances in this process hold {(total - free_at_start) / 2**30:.2f} GiB); "
                "lower --gpu-memory-utilization, or release the other instance first (LLM.shutdown() or `with "
                "LLM(...) as llm:`)")
        budget = requested - weights - non_torch - peak - graphs
        logger.info("memory: total %.1f GiB, this instance may use %.1f GiB (gpu_memory_utilization %.2f): weights "
                    "%.2f GiB, non-torch %.2f GiB, activation peak %.2f GiB, CUDA graphs (estimate) %.2f GiB, cache "
                    "budget %.2f GiB", total / 2**30, requested / 2**30, util, weights / 2**30, non_torch / 2**30,
                    peak / 2**30, graphs / 2**30, budget / 2**30)
        if budget <= 0:
            raise ValueError("no GPU memory left for the KV cache and state pool; raise --gpu-memory-utilization "
                             "or lower --max-num-batched-tokens")
        return budget

    def _profile_peak_activation(self) -> int:
        """Run a full-size prefill on throwaway caches and measure the activation memory it peaks at."""
        n = self.max_num_batched_tokens
        pool = StatePool(self.cache_specs.recurrent, 1, self.device)
        kv = self._allocate_kv(cdiv(n, self.block_size) + 1)
        self.model.bind_caches(kv, pool.layers)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        meta = StepMetadata(
            positions=torch.arange(n, device=self.device),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=self.device),
            state_slots=torch.zeros(1, dtype=torch.long, device=self.device),
            block_tables=torch.arange(1, cdiv(n, self.block_size) + 1, dtype=torch.int32,
                                      device=self.device).unsqueeze(0),
            slot_mapping=torch.arange(self.block_size, self.block_size + n, device=self.device),
            max_query_len=n, max_seq_len=n,
        )
        ids = torch.randint(0, self.model_config.vocab_size, (n,), device=self.device)
        inter = None
        if not self.is_first_stage:
            h = self.model_config.hidden_size
            inter = (torch.randn(n, h, dtype=self.dtype, device=self.device),
                     torch.randn(n, h, dtype=self.dtype, device=self.device))
        hidden = self.model(ids, meta, inter) if inter is not None else self.model(ids, meta)
        if self.is_last_stage:
            self.model.compute_logits(hidden[-min(n, self.max_num_seqs):])
        tower = getattr(self.model, "visual", None)
        if tower is not None:  # the largest image the processor makes, encoded beside the step's activations
            pixels, grid = largest_image_inputs(self.config.model, tower.cfg)
            tower(pixels.to(self.device, self.dtype), grid)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del pool, kv, meta, hidden
        torch.cuda.empty_cache()
        if tower is not None:  # the encoder cache when full
            peak += self.encoder_cache_tokens * tower.cfg.out_hidden_size * self.dtype.itemsize
        return int(peak)

    def _allocate_kv(self, num_blocks: int, specs: list[AttentionSpec] | None = None
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(K, V) of (num_blocks, block_size, num_kv_heads, head_dim) per spec (default: the model's layers)."""
        specs = list(self.cache_specs.attention) if specs is None else specs
        out = []
        for spec in specs:
            shape = (num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim)
            out.append((torch.zeros(shape, dtype=spec.dtype, device=self.device),
                        torch.zeros(shape, dtype=spec.dtype, device=self.device)))
        return out

    def _allocate_verify_scratch(self, positions: int) -> None:
        """Per recurrent layer and declared tensor: (max_num_seqs, positions, *shape), a candidate per position (one
        such set per ``num_scratch_sets``)."""
        self._scratch = [[spec.allocate((self.max_num_seqs, positions), self.device)
                          for spec in self.cache_specs.recurrent] for _ in range(self.num_scratch_sets)]
        self._bind_scratch(0)

    def _bind_scratch(self, index: int) -> None:
        for layer, tensors in zip(self.model.recurrent_layers(), self._scratch[index], strict=True):
            layer.bind_verify_scratch(tensors)

    def _init_graphs(self) -> None:
        sizes = self._graph_sizes()
        if not any(sizes.values()):
            return
        cfg = self.model_config
        # Every graph writes its logits into (a prefix of) these two buffers (the last stage's).
        rows = self._graph_logit_rows(sizes)
        self.logits_lowp = torch.empty(rows, cfg.vocab_size, dtype=self.dtype, device=self.device)
        self.logits_f32 = torch.empty(rows, cfg.vocab_size, dtype=torch.float32, device=self.device)
        if self.mtp is not None:
            self.mtp_hidden_in = torch.zeros(self.max_num_seqs, cfg.hidden_size, dtype=self.dtype,
                                             device=self.device)
        emulate = self.device.type != "cuda"
        # Weak: the runner owns its graph sets, and a bound method held there would make a cycle that keeps the
        # runner (weights, caches, graph pool) alive after its last reference is dropped, until a gc pass.
        forwards = {"decode": _weak_forward(self._graph_decode), "verify": _weak_forward(self._graph_verify),
                    "mtp": _weak_forward(self._graph_mtp), "draft": _weak_forward(self._graph_draft),
                    "commit": _weak_forward(self._graph_commit), "snapshot": _weak_forward(self._graph_snapshot),
                    "draft_fill": _weak_forward(self._graph_draft_fill), "behind": _weak_forward(self._graph_behind),
                    "accept": _weak_forward(self._graph_accept)}
        q = self.num_speculative_tokens + 1
        fill_pads = {"decode": lambda n: self.prepare([], pad_to=n),
                     "verify": lambda n: self.prepare([], pad_to=n, pad_len=q),
                     "mtp": lambda n: self._fill_mtp([], pad_to=n),
                     "draft": lambda n: self._fill_draft([], pad_to=n),
                     "commit": lambda n: self._fill_commit([], n),
                     "snapshot": lambda n: self._snapshot_pads(n),
                     "draft_fill": lambda n: self._draft_fill_pads(n),
                     "behind": lambda n: self.prepare([], pad_to=n, pad_len=q),
                     "accept": lambda n: self.prepare([], pad_to=n, pad_len=q)}
        for i in range(self.num_scratch_sets if not self.is_last_stage else 0):
            forwards[f"verify{i}"] = _weak_forward(self._graph_verify_stage, i)
            fill_pads[f"verify{i}"] = fill_pads["verify"]
        self.graphs = StepGraphs({name: GraphSet(name, s, forwards[name], emulate) for name, s in sizes.items()})
        self.graphs.capture(self.device, fill_pads)

    # ------------------------------------------------------------------ graph forwards (read persistent buffers only)

    def _static_meta(self, bufs: dict[str, torch.Tensor], rows: int, tokens: int, query_len: int) -> StepMetadata:
        slots = bufs["state_slots"] if "state_slots" in bufs else bufs["seq_lens"]
        return StepMetadata(
            positions=bufs["positions"][:tokens], query_start_loc=bufs["query_start_loc"][: rows + 1],
            seq_lens=bufs["seq_lens"][:rows], state_slots=slots[:rows], block_tables=bufs["block_tables"][:rows],
            slot_mapping=bufs["slot_mapping"][:tokens], max_query_len=query_len, max_seq_len=self.max_model_len,
        )

    def _logits_into_buffers(self, hidden: torch.Tensor) -> torch.Tensor:
        n = hidden.shape[0]
        lowp = self.logits_lowp[:n]
        head = self.model.lm_head
        if isinstance(head, ParallelLMHead) and head.sharded:  # TP: this rank's vocabulary, then all ranks'
            lowp.copy_(head.gather(torch.mm(hidden, head.weight.t())))
        else:
            torch.mm(hidden, head.weight.t(), out=lowp)
        out = self.logits_f32[:n]
        out.copy_(lowp)
        return out

    def _stage_forward(self, input_ids: torch.Tensor, meta: StepMetadata) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The model over a graph's static inputs: a later pipeline stage's input is the previous stage's output,
        received into ``pp_in`` before the replay; a stage before the last returns its (residual, pending)."""
        if self.is_first_stage:
            return self.model(input_ids, meta)  # type: ignore[no-any-return]
        t = input_ids.shape[0]
        return self.model(input_ids, meta, (self.pp_in[:t, 0], self.pp_in[:t, 1]))  # type: ignore[no-any-return]

    def _graph_decode(self, size: int) -> tuple[torch.Tensor, ...]:
        meta = self._static_meta(self.dev_bufs, size, size, 1)
        out = self._stage_forward(self.dev_bufs["input_ids"][:size], meta)
        if isinstance(out, tuple):  # a stage before the last: what the next stage receives
            return out
        return (self._logits_into_buffers(out),)

    def _verify_static_meta(self, size: int) -> StepMetadata:
        q = self.num_speculative_tokens + 1
        d = self.dev_bufs
        meta = self._static_meta(d, size, size * q, q)
        meta.verify = VerifyMetadata(
            num_rows=size, num_tokens=size * q, max_query_len=q, query_start_loc=meta.query_start_loc,
            state_slots=meta.state_slots, rest_query_start_loc=d["rest_query_start_loc"][:1],
            rest_state_slots=d["state_slots"][size:size], rest_max_query_len=0,
        )
        return meta

    def _graph_verify_stage(self, scratch_set: int, size: int) -> tuple[torch.Tensor, ...]:
        """``verify<i>`` graphs (a pipeline stage before the last): the stage's verify forward with its candidates
        in scratch set ``i``; returns the stage's output for the next stage."""
        self._bind_scratch(scratch_set)
        q = self.num_speculative_tokens + 1
        out = self._stage_forward(self.dev_bufs["input_ids"][: size * q], self._verify_static_meta(size))
        assert isinstance(out, tuple)
        return out

    def _graph_verify(self, size: int) -> tuple[torch.Tensor, ...]:
        q = self.num_speculative_tokens + 1
        meta = self._verify_static_meta(size)
        hidden = self._stage_forward(self.dev_bufs["input_ids"][: size * q], meta)
        assert isinstance(hidden, torch.Tensor), "verify graphs run on the last stage only"
        return hidden, self._logits_into_buffers(hidden)

    def _graph_mtp(self, size: int) -> tuple[torch.Tensor, ...]:
        assert self.mtp is not None
        meta = self._static_meta(self.mtp_dev, size, size, 1)
        out = self.mtp(self.mtp_dev["input_ids"][:size], self.mtp_hidden_in[:size], meta,
                       self.model.input_embeddings())
        return out, self._logits_into_buffers(out).argmax(dim=-1)

    def _graph_commit(self, size: int) -> tuple[torch.Tensor, ...]:
        """``commit`` graph: every recurrent layer's commit of ``size`` verify rows (slots and accepted counts from
        the persistent buffers; -1 rows, pads included, are left alone)."""
        slots, acc = self.dev_bufs["state_slots"][:size], self.dev_bufs["num_accepted"][:size]
        for layer in self.model.recurrent_layers():
            layer.commit_verified(slots, acc)
        return ()

    def _graph_draft(self, size: int) -> tuple[torch.Tensor, ...]:
        """``draft`` graph: the MTP layer over ``size`` rows of k + 1 positions (masked tails), each row's output at
        its last real position, then k - 1 one-token passes, each fed the previous pass's greedy token and output;
        the k tokens of every row and the first pass's outputs land in persistent buffers."""
        assert self.mtp is not None
        k = self.num_speculative_tokens
        q = k + 1
        d = self.draft_dev
        embed = self.model.input_embeddings()
        meta = StepMetadata(positions=d["positions"][: size * q], query_start_loc=d["query_start_loc"][: size + 1],
                            seq_lens=d["seq_lens"][:size], state_slots=d["seq_lens"][:size],
                            block_tables=d["block_tables"][:size], slot_mapping=d["slot_mapping"][: size * q],
                            max_query_len=q, max_seq_len=self.max_model_len)
        out = self.mtp(d["input_ids"][: size * q], self.draft_hidden_in[: size * q], meta, embed)
        h = out.index_select(0, d["last_index"][:size])
        self.draft_first_hidden[:size].copy_(h)
        tok = self._logits_into_buffers(h).argmax(dim=-1)
        self.draft_tokens[:size, 0].copy_(tok)
        for j in range(1, k):
            meta = StepMetadata(positions=d["chain_positions"][j - 1, :size],
                                query_start_loc=d["chain_query_start_loc"][: size + 1],
                                seq_lens=d["chain_seq_lens"][j - 1, :size], state_slots=d["seq_lens"][:size],
                                block_tables=d["block_tables"][:size],
                                slot_mapping=d["chain_slot_mapping"][j - 1, :size], max_query_len=1,
                                max_seq_len=self.max_model_len)
            h = self.mtp(tok, h, meta, embed)
            tok = self._logits_into_buffers(h).argmax(dim=-1)
            self.draft_tokens[:size, j].copy_(tok)
        return self.draft_tokens[:size], self.draft_first_hidden[:size]

    def _allocate_buffers(self) -> None:
        t, r = self.max_num_batched_tokens, self.max_num_seqs
        self.max_blocks_per_seq = cdiv(self.max_model_len, self.block_size)
        pin = self.device.type == "cuda"

        def host(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, pin_memory=pin)

        def dev(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=self.device)

        names = {
            "input_ids": ((t,), torch.long), "positions": ((t,), torch.long), "slot_mapping": ((t,), torch.long),
            "query_start_loc": ((r + 1,), torch.int32), "seq_lens": ((r,), torch.int32),
            "state_slots": ((r,), torch.long), "block_tables": ((r, self.max_blocks_per_seq), torch.int32),
            "logits_indices": ((t,), torch.long), "rest_query_start_loc": ((r + 1,), torch.int32),
            "num_accepted": ((r,), torch.long), "prev_at": ((r,), torch.long), "prev_src": ((r,), torch.long),
            "verify_starts": ((r,), torch.long),  # each verify row's start (behind rows': set on the device)
            "snap": ((r, 3), torch.long),  # the snapshot graph's (verify row, candidate position, entry) triples
            "behind": ((r,), torch.long),  # 1: the verify row's start is on the device (the behind graph's input)
            "draft_count": ((r,), torch.long),  # the accept graph's input: each verify row's number of drafts
        }
        if self.link is not None and not self.is_first_stage:  # the previous stage's (residual, pending) per token
            self.pp_in = dev((t, 2, self.model_config.hidden_size), self.dtype)
        self.host_bufs = {k: host(s, d) for k, (s, d) in names.items()}
        self.dev_bufs = {k: dev(s, d) for k, (s, d) in names.items()}
        self.np_bufs = {k: v.numpy() for k, v in self.host_bufs.items()}
        if self.mtp is not None:  # the MTP pass has its own set, so it never clobbers the step's metadata
            mt = t + r
            mtp_names = {"input_ids": (mt,), "positions": (mt,), "slot_mapping": (mt,), "hidden_index": (mt,),
                         "query_start_loc": (r + 1,), "seq_lens": (r,), "last_index": (r,),
                         "block_tables": (r, self.max_blocks_per_seq)}
            dtypes = {"query_start_loc": torch.int32, "seq_lens": torch.int32, "block_tables": torch.int32}
            self.mtp_host = {k: host(sh, dtypes.get(k, torch.long)) for k, sh in mtp_names.items()}
            self.mtp_dev = {k: dev(sh, dtypes.get(k, torch.long)) for k, sh in mtp_names.items()}
            self.mtp_np = {k: v.numpy() for k, v in self.mtp_host.items()}
            if self.num_speculative_tokens:  # the draft graph's own set
                k = self.num_speculative_tokens
                q, c = k + 1, max(k - 1, 1)
                draft_names = {"input_ids": (r * q,), "positions": (r * q,), "slot_mapping": (r * q,),
                               "hidden_index": (r * q,), "query_start_loc": (r + 1,), "seq_lens": (r,),
                               "last_index": (r,), "block_tables": (r, self.max_blocks_per_seq),
                               "chain_positions": (c, r), "chain_slot_mapping": (c, r), "chain_seq_lens": (c, r),
                               "chain_query_start_loc": (r + 1,),
                               # the count-independent inputs of _fill_draft_on_device
                               "slot_table": (r, 2 * k), "row_start": (r,), "row_first": (r,), "row_limit": (r,),
                               "row_slot": (r,), "row_shift": (r,),
                               # the draft_fill graph's inputs from the device: counts, emitted tokens
                               "acc": (r,), "emitted": (r, q)}
                dtypes.update(chain_seq_lens=torch.int32, chain_query_start_loc=torch.int32)
                self.draft_host = {k: host(sh, dtypes.get(k, torch.long)) for k, sh in draft_names.items()}
                self.draft_dev = {k: dev(sh, dtypes.get(k, torch.long)) for k, sh in draft_names.items()}
                # The draft fill's per-row inputs, as rows of one tensor each side: one copy per step.
                self.draft_rows_host = host((len(DRAFT_ROW_INPUTS), r), torch.long)
                self.draft_rows_dev = dev((len(DRAFT_ROW_INPUTS), r), torch.long)
                for j, name in enumerate(DRAFT_ROW_INPUTS):
                    self.draft_host[name], self.draft_dev[name] = self.draft_rows_host[j], self.draft_rows_dev[j]
                self.draft_np = {k: v.numpy() for k, v in self.draft_host.items()}
                # Fixed layouts: the first pass k + 1 tokens per row, the chained passes one.
                self.draft_np["query_start_loc"][:] = np.arange(r + 1) * q
                self.draft_np["chain_query_start_loc"][:] = np.arange(r + 1)
                for name in ("query_start_loc", "chain_query_start_loc"):
                    self.draft_dev[name].copy_(self.draft_host[name])
                h = self.model_config.hidden_size
                self.draft_hidden_in = dev((r * q, h), self.dtype)
                self.draft_last_hidden = dev((r * q, h), self.dtype)  # the verify step's hidden states, copied
                self.draft_first_hidden = dev((r, h), self.dtype)
                self.draft_tokens = dev((r, k), torch.long)
                self.draft_slots_index = dev((r,), torch.long)
                self.accept_summary = dev((r, q + 1), torch.long)  # the accept graph's (count, emitted) per row

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
        if self._h2d_fence is not None:
            # The pinned host buffers are one set: the previous step's copies out of them must have run before they
            # are written again (with steps in flight nothing else orders the two; the wait is almost always over).
            self._h2d_fence.synchronize()
        nb = self.np_bufs
        bs = self.block_size
        t = 0
        n_sample = 0
        max_q = 0
        max_s = 0
        num_verify = num_verify_tokens = max_q_verify = 0
        nb["query_start_loc"][0] = 0
        prev: list[tuple[int, int]] = []  # (token index, row of the previous step) of PREVIOUS_SAMPLED inputs
        draft_at: list[int] = []  # token index of every verify row's drafts, in row order
        drafts_fed: list[tuple[int, int]] = []  # (token index, flat index into draft_slots) of PREVIOUS_DRAFT inputs
        mm_rows: list[tuple[int, int, int, MultimodalPrompt]] = []  # (first token index, start, length, prompt)
        behind: list[tuple[int, int, int]] = []  # (row, first token index, state slot) of rows with the start on device
        for i, row in enumerate(rows):
            n, start, end = row.num_new_tokens, row.start, row.end
            mm = self._mm(row.req_id)
            # A prompt with images: a 1-D position past its last image is the index + rope_delta (the KV slot stays
            # the index); a chunk before that end takes three-axis positions (below).
            shift = 0
            if mm is not None:
                shift = mm.position_shift(start)
                if mm.needs_axes(start):
                    mm_rows.append((t, start, n, mm))
            ids = row.token_ids
            if row.is_verify:
                assert i == num_verify, "verify rows must come first"
                nb["verify_starts"][i] = start
                nb["behind"][i] = row.start_on_device
                nb["draft_count"][i] = n - 1
                if row.start_on_device:  # its start-dependent inputs are set on the device below
                    assert mm is None and n == self.num_speculative_tokens + 1, "a row behind one has all k drafts"
                    behind.append((i, t, row.state_slot))
                nb["input_ids"][t : t + n] = ids
                draft_at.extend(range(t + 1, t + n))
                if PREVIOUS_DRAFT in ids:
                    k = self.num_speculative_tokens
                    drafts_fed.extend((t + j, row.state_slot * k + j - 1) for j in range(1, n)
                                      if ids[j] == PREVIOUS_DRAFT)
                nb["logits_indices"][n_sample : n_sample + n] = np.arange(t, t + n)
                n_sample += n
                num_verify += 1
                num_verify_tokens += n if row_len is None else row_len
                max_q_verify = max(max_q_verify, n if row_len is None else row_len)
            elif n == 1:  # decode: scalar writes (per-row numpy temporaries cost more than the row itself)
                nb["input_ids"][t] = ids[0]
                if ids[0] == PREVIOUS_SAMPLED:
                    prev.append((t, self._prev_rows[row.req_id]))
            else:
                nb["input_ids"][t : t + n] = ids
            table = row.block_table
            if row.start_on_device:
                pass  # positions, KV slots and context length: set from the start on the device (below)
            elif n == 1:
                nb["positions"][t] = start + shift
                nb["slot_mapping"][t] = table[start // bs] * bs + start % bs
            else:
                pos = np.arange(start, end, dtype=np.int64)
                nb["positions"][t : t + n] = pos + shift
                nb["slot_mapping"][t : t + n] = np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs
            nb["block_tables"][i, : len(table)] = table
            nb["block_tables"][i, len(table) :] = BlockPool.NULL_BLOCK
            nb["seq_lens"][i] = end
            nb["state_slots"][i] = row.state_slot
            t += n
            if row_len is not None and n < row_len:
                assert row.is_verify and start + row_len <= self.max_model_len, "row_len is for verify rows"
                m = row_len - n
                nb["input_ids"][t : t + m] = 0
                nb["positions"][t : t + m] = np.arange(end, start + row_len) + shift
                nb["slot_mapping"][t : t + m] = -1
                nb["seq_lens"][i] = start + row_len
                t += m
            nb["query_start_loc"][i + 1] = t
            if row.samples and not row.is_verify:
                nb["logits_indices"][n_sample] = t - 1
                n_sample += 1
            max_q = max(max_q, n)
            max_s = max(max_s, row.latest_start + n)
        r = len(rows)
        rest = r - num_verify
        if num_verify:
            nb["rest_query_start_loc"][: rest + 1] = nb["query_start_loc"][num_verify : r + 1] - num_verify_tokens
        sizes = {"input_ids": t, "positions": t, "slot_mapping": t, "query_start_loc": r + 1, "seq_lens": r,
                 "state_slots": r, "block_tables": r, "logits_indices": n_sample,
                 "rest_query_start_loc": rest + 1 if num_verify else 0, "verify_starts": num_verify,
                 "behind": num_verify, "draft_count": num_verify}
        copies = dict(sizes)
        if pad_to is not None and pad_to > r:
            assert num_verify in (0, r), "a padded step has verify rows only, or none"
            self._fill_pads(nb, copies, t, r, pad_to, pad_len)
            if num_verify:
                nb["behind"][r:pad_to] = 0
                nb["draft_count"][r:pad_to] = 0
                copies["behind"] = copies["draft_count"] = pad_to
        views = {}
        for name, size in sizes.items():
            if copies[name]:  # (an empty copy launches nothing on CUDA either)
                self.dev_bufs[name][: copies[name]].copy_(self.host_bufs[name][: copies[name]], non_blocking=True)
            views[name] = self.dev_bufs[name][:size]
        if prev:
            self._feed_previous_samples(prev)
        if behind:
            graphs = self.graphs.get("behind") if self.graphs is not None and row_len is not None else None
            if graphs is not None and pad_to in graphs.sizes:  # the verify graph's layout: row i at i * row_len
                graphs.run(pad_to)
            else:
                self._start_behind(behind)
        self.verify_draft_ids = None
        if drafts_fed:
            self._feed_device_drafts(drafts_fed)
            # The drafts as the forward reads them: what acceptance compares with (the host has placeholders).
            self.verify_draft_ids = self.dev_bufs["input_ids"][device_tensor(draft_at, self.device, torch.long)]
        if self.device.type == "cuda":
            self._h2d_fence = torch.cuda.Event()
            self._h2d_fence.record()
        nblk = cdiv(max_s, bs)
        meta = StepMetadata(
            positions=views["positions"], query_start_loc=views["query_start_loc"], seq_lens=views["seq_lens"],
            state_slots=views["state_slots"], block_tables=views["block_tables"][:, :nblk],
            slot_mapping=views["slot_mapping"], max_query_len=max_q, max_seq_len=max_s,
            query_start_loc_cpu=self.host_bufs["query_start_loc"][: r + 1] if pad_to is None else None,
        )
        if num_verify:
            slots = views["state_slots"]
            rest_max_q = max((row.num_new_tokens for row in rows[num_verify:]), default=0)
            meta.verify = VerifyMetadata(
                num_rows=num_verify, num_tokens=num_verify_tokens, max_query_len=max_q_verify,
                query_start_loc=views["query_start_loc"][: num_verify + 1], state_slots=slots[:num_verify],
                rest_query_start_loc=views["rest_query_start_loc"], rest_state_slots=slots[num_verify:],
                rest_max_query_len=rest_max_q,
                rest_query_start_loc_cpu=self.host_bufs["rest_query_start_loc"][: rest + 1] if pad_to is None
                else None,
            )
        if mm_rows:
            assert pad_to is None, "a step reaching an image runs eagerly"
            # On a later pipeline stage the first one embedded the images.
            meta.mrope_positions, meta.image_embeds = self._image_inputs(
                self.host_bufs["positions"][:t], mm_rows, embed=self.is_first_stage)
        self.last_meta = meta
        return meta, views["input_ids"], views["logits_indices"]

    # ------------------------------------------------------------------ image input

    def _image_inputs(self, host_positions: torch.Tensor, mm_rows: list[tuple[int, int, int, MultimodalPrompt]],
                      lookahead: int = 0, embed: bool = True
                      ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """A step's (3, T) positions and its image rows, for ``mm_rows`` = (first token index, start, length, prompt).

        Each listed row starting before its prompt's last image takes the prompt's three axes, every other token its
        1-D position (``host_positions``) on each axis. With ``embed``, the token at position p reads the encoder row
        of sequence index p + ``lookahead`` where that is an image placeholder (the target: 0; the MTP head, which
        consumes the next token: 1); a row that cuts an image's span takes the rows of its part."""
        positions = host_positions.clone().expand(3, -1).contiguous()
        index: list[torch.Tensor] = []
        embeds: list[torch.Tensor] = []
        for t0, start, n, mm in mm_rows:
            if mm.needs_axes(start):
                positions[:, t0 : t0 + n] = mm.axes(start, start + n)
            if not embed:
                continue
            lo, hi = start + lookahead, start + n + lookahead
            for im in mm.overlapping(lo, hi):
                a, b = max(lo, im.span.offset), min(hi, im.end)
                embeds.append(self._span_rows(im, a, b))
                index.append(torch.arange(t0 + a - lo, t0 + b - lo))
        mrope = positions.to(self.device, non_blocking=True)
        if not embeds:
            return mrope, None
        return mrope, (torch.cat(index).to(self.device), torch.cat(embeds))

    def _span_rows(self, im: ImageInput, a: int, b: int) -> torch.Tensor:
        """The encoder rows of ``im``'s placeholder tokens [a, b) (sequence indices inside its span)."""
        return self._image_embeddings(im)[a - im.span.offset : b - im.span.offset]

    def _image_embeddings(self, im: ImageInput) -> torch.Tensor:
        """The vision tower's (placeholder count, hidden) output for ``im``, from the encoder cache or encoded now."""
        key = im.span.content_hash
        cached = self.encoder_cache.get(key)
        if cached is not None:
            self.encoder_cache.move_to_end(key)
            return cached
        tower = getattr(self.model, "visual", None)
        assert isinstance(tower, nn.Module), "a stage without the vision tower needs no image rows"
        grid = torch.tensor([im.grid_thw], dtype=torch.long)
        rows = tower(torch.from_numpy(im.pixel_values).to(self.device, self.dtype), grid)
        if rows.shape[0] != im.span.length:
            raise RuntimeError(f"the vision tower gave {rows.shape[0]} rows for an image of {im.span.length} "
                               "placeholder tokens")
        self.num_images_encoded += 1
        self.encoder_cache[key] = rows
        held = sum(r.shape[0] for r in self.encoder_cache.values())
        while held > self.encoder_cache_tokens and len(self.encoder_cache) > 1:
            _, old = self.encoder_cache.popitem(last=False)
            held -= old.shape[0]
        return rows

    def _graph(self, kind: str, num_rows: int, fits: Callable[[], bool]) -> tuple[GraphSet, int] | None:
        """The captured graphs of ``kind`` and the padded size for ``num_rows`` rows, if the step ``fits`` them."""
        graphs = self.graphs.get(kind) if self.graphs is not None else None
        if graphs is None or not num_rows or not fits():
            return None
        size = graphs.padded_size(num_rows)
        return None if size is None else (graphs, size)

    def _fill_pads(self, nb: dict[str, np.ndarray], copies: dict[str, int], t: int, r: int, pad_to: int,
                   q: int) -> None:
        """Rows ``[r, pad_to)`` become pad rows of ``q`` tokens from token ``t``: positions 0.., KV writes skipped,
        the null block for attention, the pad slot for recurrent state (``cuda_graphs``); ``copies`` grows to cover
        them."""
        n = pad_to - r
        nb["input_ids"][t : t + n * q] = 0
        nb["positions"][t : t + n * q] = np.tile(np.arange(q), n)
        nb["slot_mapping"][t : t + n * q] = -1
        nb["query_start_loc"][r + 1 : pad_to + 1] = t + q * np.arange(1, n + 1)
        nb["seq_lens"][r:pad_to] = q
        if "state_slots" in nb:
            nb["state_slots"][r:pad_to] = self.state_pool.pad_slot
        nb["block_tables"][r:pad_to, : cdiv(q, self.block_size)] = BlockPool.NULL_BLOCK
        for name in ("input_ids", "positions", "slot_mapping"):
            copies[name] = t + n * q
        for name in ("seq_lens", "state_slots", "block_tables"):
            if name in copies:
                copies[name] = pad_to
        copies["query_start_loc"] = pad_to + 1

    # ------------------------------------------------------------------ execute_model

    def execute_model(self, so: SchedulerOutput) -> RunnerOutput:
        """Run step ``so`` and return its result, one entry per row of ``so``."""
        return self.execute_model_async(so).result()

    @torch.inference_mode()
    def execute_model_async(self, so: SchedulerOutput) -> StepResult:
        """Enqueue step ``so`` on the device; ``result()`` of the returned handle is its ``RunnerOutput``.

        In order: forget finished requests and learn new ones; the state operations before the forward (slot resets,
        snapshot copy-ins); the forward; sampling of plain rows and acceptance of verify rows (the one place either
        happens); the verified-state commit; the snapshot copy-outs; the MTP head's drafts for the next step. A
        step without speculation returns before its sampled ids reach the host (they stay on the device, where the
        next step's ``PREVIOUS_SAMPLED`` inputs take them); a speculative step is complete when it returns (its
        drafts need the accepted tokens on the host).
        """
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            self.mm_prompts.pop(rid, None)
        for new in so.new_requests:
            self.requests[new.req_id] = new.sampling_params
            if new.mm is not None:
                self.mm_prompts[new.req_id] = new.mm
        rows = so.rows
        out = RunnerOutput(so.step_id, token_ids=[[] for _ in rows], num_accepted=[-1] * len(rows))
        if not self.is_last_stage:
            return self._execute_stage(so, out)
        if not rows:
            return StepResult(out)
        plain = [i for i, r in enumerate(rows) if r.samples and not r.is_verify]
        verify = [i for i, r in enumerate(rows) if r.is_verify]
        sampling_rows = [self._sampling_row(rows[i], i, out.errors) for i in plain]
        spec_rows = [self._spec_row(rows[i], i, out.errors) for i in verify]
        # Whether the whole verify step is enqueued at once; a row behind another otherwise needs its start first
        # (resolving it changes nothing the check reads: the scheduler sends a row behind only where it fits).
        chain = self._device_chain(rows, spec_rows)
        if chain is None and any(r.start_on_device for r in rows):
            rows = self._resolve_starts(rows)
        self._load_states(rows)
        if self.num_speculative_tokens:
            logits = self._forward_spec(rows)
        else:
            logits = self._forward(rows, len(plain))
        n_verify = sum(rows[i].num_new_tokens for i in verify)
        samp = self.sampler.sample(logits[n_verify:], sampling_rows) if plain else None
        if samp is not None:
            self._remember_samples(rows, plain, samp.tokens)
        if not self.num_speculative_tokens:
            self._save_snapshots(rows, out.num_accepted)
            return StepResult(out, plain, samp)
        if samp is not None:
            self._take_samples(out, plain, samp.result())
        if chain is not None:
            return self._verify_and_draft_on_device(rows, spec_rows, logits[:n_verify], out, *chain)
        if verify:
            assert self.rejection_sampler is not None
            pending = self.rejection_sampler.launch(logits[:n_verify], spec_rows, draft_ids=self.verify_draft_ids)
            self._advance_verified(pending.accepted, pending.emitted)
            self._take_verified(out, verify, pending.result())
            self._commit_verified([out.num_accepted[i] for i in verify])
        self._save_snapshots(rows, out.num_accepted)
        if self.mtp_proposer is not None:
            out.next_draft_token_ids = self.mtp_proposer.propose(self, rows, out)
            self._keep_drafts(rows, out.next_draft_token_ids)
        return StepResult(out)

    # ------------------------------------------------------------------ a verify step on the device

    def _device_chain(self, rows: list[ScheduledRow], spec_rows: list[SpecRow]) -> tuple[GraphSet, int] | None:
        """The ``draft`` graphs and size if this step's acceptance, commit, snapshots and drafting can all be
        enqueued before its result comes to the host: one rank (drafts kept in ``draft_slots``), every row a verify
        row the draft graph takes, no row asking for logprobs (those read logits the draft graph overwrites)."""
        if not self.use_device_chain or self.draft_slots is None or self.mtp_proposer is None or not rows:
            return None
        q = self.num_speculative_tokens + 1
        if not all(r.is_verify and r.latest_start + q <= self.max_model_len for r in rows):
            return None
        if any(s.params.logprobs is not None for s in spec_rows):
            return None
        return self.draft_chain_graph(len(rows))

    def _verify_and_draft_on_device(self, rows: list[ScheduledRow], spec_rows: list[SpecRow], logits: torch.Tensor,
                                    out: RunnerOutput, graphs: GraphSet, size: int) -> StepResult:
        """Acceptance, commit of the accepted candidates, candidate snapshots and the whole drafting, enqueued on
        the device in that order, each reading the accepted counts there. The result waits for the acceptance's
        copy to the host: the commit and drafting run on, and the next step can be enqueued behind them, while
        the host applies this one."""
        assert self.rejection_sampler is not None and self.mtp_proposer is not None
        pending = self._accept_in_graph(rows, spec_rows, size)
        if pending is None:
            pending = self.rejection_sampler.launch(logits, spec_rows, draft_ids=self.verify_draft_ids)
            self._advance_verified(pending.accepted, pending.emitted)
        accepted = pending.accepted
        if out.errors:  # rows whose sampling inputs failed: their state advances, their drafting is skipped
            failed = device_tensor([i in out.errors for i in range(len(rows))], self.device, torch.bool)
        else:
            failed = None
        self._commit_verified(accepted)
        self._save_snapshots(rows, accepted)
        self._fill_draft_on_device(rows, accepted, pending.emitted, failed, size)
        tokens, first = graphs.run(size)
        n = len(rows)
        assert self.draft_slots is not None
        slots = self.draft_slots_index[:n]
        self.draft_slots.index_copy_(0, slots, tokens[:n])
        first = first[:n].clone()  # the next replay overwrites the graph's output; tests read it after
        proposer = self.mtp_proposer
        k = self.num_speculative_tokens
        # What the host learns, once the acceptance's copy is in (StepResult.result). A row behind another has
        # its start on the device: it is reported with k drafts, which the scheduler trims as the device did
        # (DraftManager.num_drafts is the device's count).
        starts = [None if r.start_on_device else r.start for r in rows]
        limits = [r.draft_limit for r in rows]
        ids = [r.req_id for r in rows]

        def finish() -> None:
            self._take_verified(out, list(range(n)), pending.result())
            proposer.first_hidden = {}
            drafts: list[list[int]] = [[] for _ in range(n)]
            for i in range(n):
                if i in out.errors or out.num_accepted[i] < 0:
                    continue
                start = starts[i]
                num = k if start is None else max(0, min(k, limits[i] - (start + out.num_accepted[i] + 2)))
                if num:
                    drafts[i] = [PREVIOUS_DRAFT] * num
                    proposer.first_hidden[ids[i]] = first[i]
            out.next_draft_token_ids = drafts

        return StepResult(out, finish=finish)

    def _accept_in_graph(self, rows: list[ScheduledRow], spec_rows: list[SpecRow], size: int) -> PendingSpec | None:
        """The greedy acceptance of a verify graph's step and ``_advance_verified`` in one replay of the ``accept``
        graph (``_graph_accept``), with one copy of the counts and tokens to the host; None where it does not
        apply (a row that samples or has banned tokens, or the verify graph did not run at ``size``): then the
        rejection sampler decides, as it does everywhere else."""
        graphs = self.graphs.get("accept") if self.graphs is not None else None
        if graphs is None or self._verify_graph_size != size or size not in graphs.sizes:
            return None
        if not all(r.params.is_greedy and r.banned_token_ids is None for r in spec_rows):
            return None
        n = len(rows)
        graphs.run(size)  # each row's number of drafts: from prepare
        summary = self.accept_summary[:n]
        host = summary.to("cpu", non_blocking=True) if self.device.type == "cuda" else summary.clone()
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return PendingSpec(summary[:, 0], summary[:, 1:], host, event, None)

    def _graph_accept(self, size: int) -> tuple[torch.Tensor, ...]:
        """``accept`` graph: greedy acceptance of ``size`` verify rows of k + 1 positions from the verify graph's
        logits and fed tokens, as ``RejectionSampler.launch`` decides it for greedy rows without bans (first
        maximum; a row whose logits at its stopping position are not finite is an error row, -1), into
        ``accept_summary`` (per row: the count, then the emitted tokens, the last one at column count); then each
        row's next start and last token into its slot's entries (``_advance_verified``)."""
        assert self.verify_next_start is not None and self.verify_next_token is not None
        k = self.num_speculative_tokens
        q = k + 1
        best, tok = self.logits_f32[: size * q].max(dim=1)
        finite = torch.isfinite(best).view(size, q)
        tok = tok.view(size, q)
        drafts = self.dev_bufs["input_ids"][: size * q].view(size, q)[:, 1:]
        count = self.dev_bufs["draft_count"][:size]
        j = torch.arange(k, device=self.device)
        accept = (tok[:, :k] == drafts) & (j.unsqueeze(0) < count.unsqueeze(1)) & finite[:, :k]
        num_acc = accept.to(torch.int32).cumprod(dim=1).sum(dim=1).long().unsqueeze(1)
        bad = ~finite.gather(1, num_acc).squeeze(1)
        out = self.accept_summary[:size]
        emitted = out[:, 1:]
        emitted[:, :k].copy_(drafts)
        emitted.scatter_(1, num_acc, tok.gather(1, num_acc))
        accepted = torch.where(bad, -1, num_acc.squeeze(1))
        out[:, 0].copy_(accepted)
        self._advance_verified(accepted, emitted)
        return ()

    def _fill_draft_on_device(self, rows: list[ScheduledRow], accepted: torch.Tensor, emitted: torch.Tensor,
                              failed: torch.Tensor | None, pad_to: int) -> None:
        """The ``draft`` graph's inputs for the verify rows of this step, with their accepted counts on the device.
        The host fills what depends on neither the counts nor the starts (block tables, each row's first hidden
        state, drafts row, position shift and draft limit); the counts, the emitted tokens and the step's hidden
        states are copied into the ``draft_fill`` graph's inputs, whose one replay lays out the rest
        (``_graph_draft_fill``). A row that drafts nothing (an error) is masked like a pad row."""
        n = len(rows)
        if self._draft_fence is not None:
            # The last fill's copies out of these pinned buffers were enqueued after a wait the host no longer makes:
            # they must have run before the buffers are written again.
            self._draft_fence.synchronize()
        nb = self.draft_np
        null = BlockPool.NULL_BLOCK
        first = 0
        for i, row in enumerate(rows):
            table = row.block_table
            nb["row_shift"][i] = self.position_shift(row.req_id, row.start)  # 0 for a row behind: text only
            nb["block_tables"][i, : len(table)] = table
            nb["block_tables"][i, len(table) :] = null
            nb["row_first"][i] = first  # the row's first token in the step's hidden states
            nb["row_limit"][i] = row.draft_limit - 1  # less the start, on the device
            nb["row_slot"][i] = row.state_slot
            first += row.num_new_tokens
        self._draft_pad_rows(n, pad_to)
        d = self.draft_dev
        d["block_tables"][:pad_to].copy_(self.draft_host["block_tables"][:pad_to], non_blocking=True)
        self.draft_rows_dev.copy_(self.draft_rows_host, non_blocking=True)  # all rows: one contiguous copy
        if self.device.type == "cuda":
            self._draft_fence = torch.cuda.Event()
            self._draft_fence.record()
        acc = accepted if failed is None else torch.where(failed, -1, accepted)
        d["acc"][:n].copy_(acc)
        d["acc"][n:pad_to].fill_(-1)  # pad rows draft nothing
        d["emitted"][:n, : emitted.shape[1]].copy_(emitted)  # columns past a row's tokens are masked anyway
        assert self.last_hidden is not None
        self.draft_last_hidden[: self.last_hidden.shape[0]].copy_(self.last_hidden)
        graphs = self.graphs.get("draft_fill") if self.graphs is not None else None
        if graphs is not None and pad_to in graphs.sizes:
            graphs.run(pad_to)
        else:
            self._graph_draft_fill(pad_to)

    def _draft_fill_pads(self, size: int) -> None:
        """The draft_fill graph's inputs as pad rows only (capture)."""
        self._draft_pad_rows(0, size)
        self.draft_dev["block_tables"][:size].copy_(self.draft_host["block_tables"][:size])
        self.draft_rows_dev.copy_(self.draft_rows_host)
        self.draft_dev["acc"][:size].fill_(-1)

    def _draft_pad_rows(self, n: int, pad_to: int) -> None:
        """Rows ``[n, pad_to)`` of the draft fill's host inputs as pad rows: the null block, no shift."""
        nb = self.draft_np
        nb["block_tables"][n:pad_to, : cdiv(self.num_speculative_tokens + 1, self.block_size)] = BlockPool.NULL_BLOCK
        nb["row_shift"][n:pad_to] = 0
        nb["row_first"][n:pad_to] = 0
        nb["row_limit"][n:pad_to] = 0
        nb["row_slot"][n:pad_to] = self.state_pool.pad_slot

    def _graph_draft_fill(self, size: int) -> tuple[torch.Tensor, ...]:
        """``draft_fill`` graph: the ``draft`` graph's inputs for ``size`` rows from the persistent buffers: the
        accepted counts (``acc``, -1 for rows that draft nothing, pads included), the emitted tokens, the starts
        (``verify_starts``), the host's per-row inputs and the step's hidden states. A row that drafts nothing
        starts at 0 with no KV writes; every one of them is laid out like a pad row."""
        k = self.num_speculative_tokens
        q, bs = k + 1, self.block_size
        d = self.draft_dev
        acc = d["acc"][:size]
        valid = acc >= 0
        start = torch.where(valid, self.dev_bufs["verify_starts"][:size], 0)
        d["row_start"][:size].copy_(start)
        d["row_limit"][:size].sub_(start)
        d["seq_lens"][:size].copy_(start + q)
        span = torch.arange(2 * k, device=self.device)
        pos = start.unsqueeze(1) + span  # (rows, 2k): the row's next 2k positions
        d["positions"][: size * q].copy_((pos[:, :q] + d["row_shift"][:size].unsqueeze(1)).view(-1))
        tables = d["block_tables"][:size].long()
        col = pos // bs
        blk = tables.gather(1, col.clamp(max=tables.shape[1] - 1))
        inside = (col < tables.shape[1]) & (blk != BlockPool.NULL_BLOCK)  # past the request's blocks: no slot
        slot_table = torch.where(inside, blk * bs + pos % bs, -1)
        d["slot_table"][:size].copy_(slot_table)
        m = torch.where(valid, acc + 1, 0)  # first-pass tokens per row: the accepted drafts and the last token
        last = (m - 1).clamp(min=0)
        o = torch.arange(q, device=self.device)
        real = o.unsqueeze(0) < m.unsqueeze(1)
        d["input_ids"][: size * q].copy_(torch.where(real, d["emitted"][:size], 0).view(-1))
        index = torch.where(valid.unsqueeze(1), d["row_first"][:size].unsqueeze(1)
                            + torch.minimum(o.unsqueeze(0), last.unsqueeze(1)), 0).view(-1)
        d["hidden_index"][: size * q].copy_(index)
        d["slot_mapping"][: size * q].copy_(torch.where(real, slot_table[:, :q], -1).view(-1))
        d["last_index"][:size].copy_(torch.arange(size, device=self.device) * q + last)
        num_drafts = torch.where(valid, (d["row_limit"][:size] - m).clamp(0, k), 0)
        if k > 1:
            j = torch.arange(1, k, device=self.device).unsqueeze(1)  # (k - 1, 1)
            p = d["row_start"][:size].unsqueeze(0) + last.unsqueeze(0) + j  # (k - 1, rows)
            active = j < num_drafts.unsqueeze(0)
            chain_slots = slot_table.gather(1, (last.unsqueeze(0) + j).clamp(max=2 * k - 1).t()).t()
            d["chain_positions"][:, :size].copy_(torch.where(active, p + d["row_shift"][:size].unsqueeze(0), 0))
            d["chain_slot_mapping"][:, :size].copy_(torch.where(active, chain_slots, -1))
            d["chain_seq_lens"][:, :size].copy_(torch.where(active, p + 1, 1).to(d["chain_seq_lens"].dtype))
        self.draft_slots_index[:size].copy_(torch.where(valid, d["row_slot"][:size], self.state_pool.pad_slot))
        torch.index_select(self.draft_last_hidden, 0, d["hidden_index"][: size * q],
                           out=self.draft_hidden_in[: size * q])
        return ()

    # ------------------------------------------------------------------ pipeline stages

    def _run_model(self, input_ids: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        """This stage's forward of a step laid out by ``prepare``: after the previous stage's output arrives, and
        sent on to the next stage (the last stage returns the hidden states; the others an empty tensor)."""
        if self.link is None:
            return self.model(input_ids, meta)
        inter = None
        if not self.is_first_stage:
            t = input_ids.shape[0]
            self._recv_stage_input(t)
            inter = (self.pp_in[:t, 0], self.pp_in[:t, 1])
        out = self.model(input_ids, meta, inter)
        if self.is_last_stage:
            return out
        self.link.send(*out)
        return input_ids.new_empty((0,))

    def _recv_stage_input(self, num_tokens: int) -> None:
        """The previous stage's output of this step's ``num_tokens`` tokens, into ``pp_in`` (graphs read it there)."""
        if self.link is not None and not self.is_first_stage:
            self.link.recv_into(self.pp_in[:num_tokens])

    def _execute_stage(self, so: SchedulerOutput, out: RunnerOutput) -> StepResult:
        """Step ``so`` on a pipeline stage before the last: the verify commits that arrived with it (of earlier
        steps), the state operations, the forward (its output goes to the next stage), the snapshot copy-outs that
        do not depend on the accepted counts. Nothing is sampled here; the result is empty."""
        for step_id, num_accepted in so.verify_commits:
            self._apply_commit(self._pending_commit(step_id), num_accepted)
        rows = so.rows
        if not rows:
            return StepResult(out)
        verify = [i for i, r in enumerate(rows) if r.is_verify]
        if not verify:
            self._load_states(rows)
            self._forward(rows, 0)  # a decode graph when the step fits one
            self._save_snapshots(rows, out.num_accepted)
            return StepResult(out)
        if not self._free_scratch_sets:
            raise RuntimeError(f"step {so.step_id}: every verify scratch set holds an uncommitted step "
                               f"({sorted(self._uncommitted)}); more steps are in flight than planned")
        scratch = self._free_scratch_sets.pop(0)
        self._bind_scratch(scratch)
        self._load_states(rows)
        q = self.num_speculative_tokens + 1
        graph = self._graph(f"verify{scratch}", len(rows),
                            lambda: all(r.is_verify and r.start + q <= self.max_model_len
                                        and (self.is_first_stage or r.num_new_tokens == q) for r in rows))
        if graph is not None:
            graphs, size = graph
            meta, _, real = self.prepare(rows, pad_to=size, pad_len=q, row_len=q)
            self._recv_stage_input(len(rows) * q)
            x, pending = graphs.run(size)
            assert self.link is not None
            self.link.send(x[real], pending[real])  # the real tokens only, as an eager step sends them
        else:
            meta, input_ids, _ = self.prepare(rows)
            self._run_model(input_ids, meta)
        assert meta.verify is not None
        cands = []
        for i in verify:
            if rows[i].candidate_snapshot is not None:
                point, entry = rows[i].candidate_snapshot  # type: ignore[misc]
                cands.append((i, point - rows[i].start - 1, entry))
        self._uncommitted[so.step_id] = PendingCommit(so.step_id, scratch, meta.verify.state_slots.clone(), cands)
        self._save_snapshots(rows, out.num_accepted)  # the accepted counts are unknown (-1): no candidates yet
        return StepResult(out)

    def _pending_commit(self, step_id: int) -> PendingCommit:
        """The uncommitted verify step ``step_id`` (its own slots and scratch set, not the latest step's)."""
        pending = self._uncommitted.pop(step_id, None)
        if pending is None:
            raise RuntimeError(f"accepted counts for step {step_id}, which has no uncommitted verify rows here "
                               f"(uncommitted: {sorted(self._uncommitted)})")
        return pending

    def _apply_commit(self, pending: PendingCommit, num_accepted: list[int]) -> None:
        """Live slots of ``pending``'s verify rows take candidate ``num_accepted[r]`` (-1: untouched), and its
        candidate snapshots whose position the accepted length reached are copied out; then its scratch set is
        free."""
        n = len(num_accepted)
        if n != pending.state_slots.shape[0]:
            raise RuntimeError(f"step {pending.step_id}: {n} accepted counts for {pending.state_slots.shape[0]} "
                               "verify rows")
        self._bind_scratch(pending.scratch_set)
        acc = device_tensor(num_accepted, self.device, torch.long)
        for layer in self.model.recurrent_layers():
            layer.commit_verified(pending.state_slots, acc)
        cands = [(r, p, e) for r, p, e in pending.candidates if num_accepted[r] >= p]
        self._snapshot_candidates([r for r, _, _ in cands], [p for _, p, _ in cands], [e for _, _, e in cands])
        self._free_scratch_sets.append(pending.scratch_set)

    def held_requests(self) -> list[str]:
        """The ids of the requests this runner keeps anything of: sampling parameters, images (the scheduler's
        ``finished_req_ids`` take them out)."""
        return sorted(set(self.requests) | set(self.mm_prompts))

    @property
    def num_uncommitted_steps(self) -> int:
        return len(self._uncommitted)

    def _sampling_row(self, row: ScheduledRow, i: int, errors: dict[int, str]) -> SamplingRow:
        """Row ``row``'s sampling inputs; if they cannot be built, the row fails alone (a greedy stand-in is sampled
        so the batch keeps its shape, and its result is dropped)."""
        p = self.requests[row.req_id]
        try:
            banned = self._bans(row, p, 0)
            seed = None if p.seed is None else token_seed(p.seed, row.output_index)
            return SamplingRow(params=p, seed=seed, banned_token_ids=banned)
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
                           banned_token_ids=banned if any(banned) else None)
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

    @staticmethod
    def _take_samples(out: RunnerOutput, idx: list[int], samp: SamplerOutput) -> None:
        errors = set(samp.error_rows)
        for j, i in enumerate(idx):
            if i in out.errors:
                continue
            if j in errors:
                out.errors[i] = "non-finite logits (NaN/inf)"
                continue
            out.token_ids[i] = [int(samp.token_ids[j])]
            if samp.logprobs is not None:
                lps, ranks, tops = out.logprob_lists()
                lps[i] = [float(samp.logprobs[j])]
                ranks[i] = [samp.ranks[j]] if samp.ranks is not None else [None]
                tops[i] = [samp.top_logprobs[j]] if samp.top_logprobs is not None else [[]]

    @staticmethod
    def _take_verified(out: RunnerOutput, idx: list[int], spec: SpecOutput) -> None:
        errors = set(spec.error_rows)
        for j, i in enumerate(idx):
            if j in errors:
                out.errors.setdefault(i, "non-finite logits (NaN/inf) while verifying drafts")
                continue  # the live state is left as it was (-1)
            out.num_accepted[i] = spec.num_accepted[j]
            if i in out.errors:
                continue  # its state advances (the batch ran), its tokens are dropped
            tokens = out.token_ids[i] = [int(t) for t in spec.token_ids[j]]
            if spec.logprobs is not None:
                lps, ranks, tops = out.logprob_lists()
                lps[i] = [float(x) for x in spec.logprobs[j]]
                ranks[i] = list(spec.ranks[j]) if spec.ranks is not None else [None] * len(tokens)
                tops[i] = list(spec.top_logprobs[j]) if spec.top_logprobs is not None else [[] for _ in tokens]

    def _forward(self, rows: list[ScheduledRow], num_sampling: int) -> torch.Tensor:
        """The forward of a step without verify rows; logits of the rows that sample (in row order)."""
        graph = self._graph("decode", len(rows), lambda: all(r.num_new_tokens == 1 and not r.is_verify
                                                             and not self._reaches_image(r) for r in rows))
        if graph is not None:
            decode, size = graph
            _, _, logits_indices = self.prepare(rows, pad_to=size)
            self._recv_stage_input(len(rows))
            outs = decode.run(size)
            if not self.is_last_stage:
                assert self.link is not None
                self.link.send(outs[0][: len(rows)], outs[1][: len(rows)])
                return outs[0][:0]
            logits, = outs
            # One token per row: row i's logits are row i of the graph's output.
            return logits[: len(rows)] if num_sampling == len(rows) else logits[logits_indices]
        meta, input_ids, logits_indices = self.prepare(rows)
        hidden = self._run_model(input_ids, meta)
        if not num_sampling:
            return hidden[:0]
        return self.model.compute_logits(hidden[logits_indices])

    def _mm(self, req_id: str | None) -> MultimodalPrompt | None:
        """Request ``req_id``'s images and positions, if its prompt has images."""
        return self.mm_prompts.get(req_id) if req_id is not None and self.mm_prompts else None

    def position_shift(self, req_id: str, start: int) -> int:
        """What request ``req_id``'s 1-D rotary positions add to the index from ``start`` on (its rope_delta past
        its prompt's last image; 0 for a text prompt)."""
        mm = self._mm(req_id)
        return mm.position_shift(start) if mm is not None else 0

    def _mtp_reaches_image(self, row: MTPRow) -> bool:
        """Whether an MTP pass row needs three-axis positions or an image row as its input."""
        mm = self._mm(row.req_id)
        return mm is not None and mm.reaches(row.start, len(row.input_ids), lookahead=1)

    def _reaches_image(self, row: ScheduledRow) -> bool:
        """Whether ``row`` starts before its prompt's last image ends (three-axis positions, image embeddings)."""
        mm = self._mm(row.req_id)
        return mm is not None and mm.needs_axes(row.start)

    def _load_states(self, rows: list[ScheduledRow]) -> None:
        # A request's slot starts from zeros, or from the snapshot of its prefix hit (copied, never shared).
        self.state_pool.reset([r.state_slot for r in rows if r.reset_state])
        loads = [(r.load_snapshot, r.state_slot) for r in rows if r.load_snapshot is not None]
        self.state_pool.copy([e for e, _ in loads], [s for _, s in loads])

    def _forward_spec(self, rows: list[ScheduledRow]) -> torch.Tensor:
        """The forward of a step with verify rows first; logits for every verify position, then for sampling rows.

        The step's hidden states stay in ``last_hidden`` for the MTP pass.
        """
        q = self.num_speculative_tokens + 1
        # Every row verifies (rows with fewer drafts are laid out in k + 1 tokens, the rest masked; see prepare).
        # A later pipeline stage receives the previous stage's tokens as they are: the graph's layout (every row
        # k + 1 tokens) is theirs only when no row is short.
        graph = self._graph("verify", len(rows),
                            lambda: all(r.is_verify and r.latest_start + q <= self.max_model_len
                                        and (self.is_first_stage or r.num_new_tokens == q) for r in rows))
        self._verify_graph_size = graph[1] if graph is not None else None
        if graph is not None:
            verify, size = graph
            _, _, logits_indices = self.prepare(rows, pad_to=size, pad_len=q, row_len=q)
            self._recv_stage_input(len(rows) * q)  # every row has k + 1 tokens here (see the graph's condition)
            hidden, logits = verify.run(size)
            if all(row.num_new_tokens == q for row in rows):
                n = len(rows) * q
                self.last_hidden = hidden[:n]
                return logits[:n]
            self.last_hidden = hidden[logits_indices]  # the real tokens, in row order, as the eager path returns
            return logits[logits_indices]
        meta, input_ids, logits_indices = self.prepare(rows)
        hidden = self._run_model(input_ids, meta)
        self.last_hidden = hidden
        return self.model.compute_logits(hidden[logits_indices])

    def _save_snapshots(self, rows: list[ScheduledRow], num_accepted: list[int] | torch.Tensor) -> None:
        """The step's snapshot copy-outs (entries the scheduler reserved): a row's slot after the forward, or a
        verify row's candidate state at the reserved position if the accepted length reached it. With the counts
        on the device (the device chain) every candidate is copied, an unreached one into the pad slot (nobody's)
        instead of its entry, which the scheduler then releases."""
        device_counts = num_accepted if isinstance(num_accepted, torch.Tensor) else None
        on_device = device_counts is not None
        src, dst = [], []
        cand_rows, cand_pos, cand_dst = [], [], []
        behind_rows, behind_dst = [], []
        for i, row in enumerate(rows):
            if row.snapshot_entry is not None:
                src.append(row.state_slot)
                dst.append(row.snapshot_entry)
            if row.candidate_snapshot is not None and row.start_on_device:
                assert on_device, "a row behind another with its start on the host"
                behind_rows.append(i)
                behind_dst.append(row.candidate_snapshot[1])
            elif row.candidate_snapshot is not None:
                point, entry = row.candidate_snapshot
                j = point - row.start - 1
                if on_device or num_accepted[i] >= j:
                    cand_rows.append(i)  # verify rows come first: row i is verify row i
                    cand_pos.append(j)
                    cand_dst.append(entry)
        self.state_pool.copy(src, dst)
        self._snapshot_candidates(cand_rows, cand_pos, cand_dst, device_counts, behind_rows, behind_dst)

    def _remember_samples(self, rows: list[ScheduledRow], idx: list[int], tokens: torch.Tensor) -> None:
        """Keep this step's sampled ids on the device for the next step's ``PREVIOUS_SAMPLED`` inputs, indexed by
        request id (the next step's rows are in another order: docs/design.md invariant 13)."""
        self._prev_rows = {rows[i].req_id: j for j, i in enumerate(idx)}
        self._prev_sampled = tokens

    def _feed_previous_samples(self, prev: list[tuple[int, int]]) -> None:
        """Input tokens that the previous step sampled, taken on the device (the host may not know them yet):
        ``prev`` = (token index in this step, row of the previous step's samples)."""
        assert self._prev_sampled is not None, "PREVIOUS_SAMPLED without a previous step"
        n = len(prev)
        nb = self.np_bufs
        nb["prev_at"][:n] = [t for t, _ in prev]
        nb["prev_src"][:n] = [j for _, j in prev]
        at = self.dev_bufs["prev_at"][:n]
        src = self.dev_bufs["prev_src"][:n]
        at.copy_(self.host_bufs["prev_at"][:n], non_blocking=True)
        src.copy_(self.host_bufs["prev_src"][:n], non_blocking=True)
        self.dev_bufs["input_ids"].index_copy_(0, at, self._prev_sampled.index_select(0, src))

    def _feed_device_drafts(self, fed: list[tuple[int, int]]) -> None:
        """Verify-row inputs that the MTP head left on the device (``PREVIOUS_DRAFT``): ``fed`` = (token index in
        this step, flat index into ``draft_slots``: state slot * k + draft number)."""
        assert self.draft_slots is not None, "PREVIOUS_DRAFT inputs without device drafts"
        at = device_tensor([t for t, _ in fed], self.device, torch.long)
        src = device_tensor([j for _, j in fed], self.device, torch.long)
        self.dev_bufs["input_ids"].index_copy_(0, at, self.draft_slots.view(-1).index_select(0, src))

    def _start_behind(self, behind: list[tuple[int, int, int]]) -> None:
        """Verify rows scheduled behind their request's verify row in flight (``behind``: row, first token index,
        state slot): their start and first token are what that row's acceptance left in the slot's entries; their
        positions, KV slots and context lengths follow from the start, through their block tables on the device."""
        assert self.verify_next_start is not None and self.verify_next_token is not None
        q = self.num_speculative_tokens + 1
        bs = self.block_size
        d = self.dev_bufs
        row, at, slot = device_tensor([x for b in behind for x in b], self.device, torch.long).view(-1, 3).unbind(1)
        start = self.verify_next_start.index_select(0, slot)
        d["verify_starts"].index_copy_(0, row, start)  # verify rows come first: row i is verify row i
        d["input_ids"].index_copy_(0, at, self.verify_next_token.index_select(0, slot))
        o = torch.arange(q, device=self.device)
        pos = start.unsqueeze(1) + o  # (rows, q)
        tok = (at.unsqueeze(1) + o).view(-1)
        d["positions"].index_copy_(0, tok, pos.view(-1))
        tables = d["block_tables"].index_select(0, row).long()
        d["slot_mapping"].index_copy_(0, tok, (tables.gather(1, pos // bs) * bs + pos % bs).view(-1))
        d["seq_lens"].index_copy_(0, row, (start + q).to(d["seq_lens"].dtype))

    def _graph_behind(self, size: int) -> tuple[torch.Tensor, ...]:
        """``behind`` graph: ``_start_behind`` for a verify graph's ``size`` rows (row i's tokens at i * (k + 1)),
        the rows behind flagged in the persistent ``behind`` buffer; the others, pads included, are left as the
        host laid them out."""
        assert self.verify_next_start is not None and self.verify_next_token is not None
        q, bs = self.num_speculative_tokens + 1, self.block_size
        d = self.dev_bufs
        flag = d["behind"][:size] > 0
        slots = d["state_slots"][:size]
        start = torch.where(flag, self.verify_next_start.index_select(0, slots), d["verify_starts"][:size])
        d["verify_starts"][:size].copy_(start)
        pos = start.unsqueeze(1) + torch.arange(q, device=self.device)  # (rows, q)
        moved = flag.unsqueeze(1)
        positions = d["positions"][: size * q].view(size, q)
        positions.copy_(torch.where(moved, pos, positions))
        tables = d["block_tables"][:size].long()
        slots_kv = tables.gather(1, (pos // bs).clamp(max=tables.shape[1] - 1)) * bs + pos % bs
        mapping = d["slot_mapping"][: size * q].view(size, q)
        mapping.copy_(torch.where(moved, slots_kv, mapping))
        seq_lens = d["seq_lens"][:size]
        seq_lens.copy_(torch.where(flag, start + q, seq_lens.long()).to(seq_lens.dtype))
        first = d["input_ids"][: size * q].view(size, q)[:, 0]
        first.copy_(torch.where(flag, self.verify_next_token.index_select(0, slots), first))
        return ()

    def _resolve_starts(self, rows: list[ScheduledRow]) -> list[ScheduledRow]:
        """``rows`` with each row behind a verify row in flight replaced by a copy that has its start and first
        token, read from the device (a wait for the step before): for a step whose drafting comes to the host,
        which then needs the starts (rows that are not verify rows, no draft graph of its size). The step then
        runs as if they had been scheduled with them."""
        assert self.verify_next_start is not None and self.verify_next_token is not None
        behind = [i for i, r in enumerate(rows) if r.start_on_device]
        slots = device_tensor([rows[i].state_slot for i in behind], self.device, torch.long)
        starts = self.verify_next_start.index_select(0, slots).tolist()
        tokens = self.verify_next_token.index_select(0, slots).tolist()
        out = list(rows)
        for i, start, token in zip(behind, starts, tokens, strict=True):
            row = rows[i]
            cand = row.candidate_snapshot
            if cand is not None:  # as the scheduler will place it (Scheduler._place)
                point = candidate_point(start, row.num_new_tokens, self.block_size)
                cand = (point, cand[1]) if point is not None else None
            out[i] = dataclasses.replace(row, start=start, max_start=start, start_on_device=False,
                                         token_ids=[token, *row.token_ids[1:]], candidate_snapshot=cand)
        return out

    def _advance_verified(self, accepted: torch.Tensor, emitted: torch.Tensor) -> None:
        """Each verify row's next start and last token into its slot's entries, from the accepted counts on the
        device (``emitted``: each row's tokens, the last one at column accepted): what a row behind it reads."""
        if self.verify_next_start is None or self.verify_next_token is None or not accepted.numel():
            return
        n = accepted.shape[0]
        slots = self.dev_bufs["state_slots"][:n]
        a = accepted.clamp(min=0)  # an error row's request ends: what it leaves is never read
        self.verify_next_start.index_copy_(0, slots, self.dev_bufs["verify_starts"][:n] + a + 1)
        self.verify_next_token.index_copy_(0, slots, emitted.gather(1, a.unsqueeze(1)).squeeze(1))

    def _keep_drafts(self, rows: list[ScheduledRow], drafts: list[list[int]]) -> None:
        """Drafts that came to the host (the drafting passes ran one by one) also go to their rows of
        ``draft_slots``, where a verify row scheduled behind this step reads them."""
        if self.draft_slots is None:
            return
        k = self.num_speculative_tokens
        fill = [(r.state_slot, d) for r, d in zip(rows, drafts, strict=True) if d and PREVIOUS_DRAFT not in d]
        if fill:
            slots = device_tensor([s for s, _ in fill], self.device, torch.long)
            values = [t for _, d in fill for t in (*d, *[0] * (k - len(d)))]
            self.draft_slots.index_copy_(0, slots, device_tensor(values, self.device, torch.long).view(-1, k))

    def _fill_mtp(self, rows: list[MTPRow], pad_to: int | None = None) -> tuple[StepMetadata, dict[str, torch.Tensor]]:
        """Fill the MTP pass's persistent buffers for ``rows`` (plus pad rows up to ``pad_to``); metadata and views."""
        nb = self.mtp_np
        bs = self.block_size
        t = 0
        max_q = max_s = 0
        nb["query_start_loc"][0] = 0
        mm_rows: list[tuple[int, int, int, MultimodalPrompt]] = []
        for i, row in enumerate(rows):
            n = len(row.input_ids)
            table = row.block_table
            mm = self._mm(row.req_id)
            shift = 0
            if mm is not None:
                shift = mm.position_shift(row.start)
                if mm.reaches(row.start, n, lookahead=1):
                    mm_rows.append((t, row.start, n, mm))
            if n == 1:  # drafting passes: scalar writes
                nb["input_ids"][t] = row.input_ids[0]
                nb["hidden_index"][t] = row.hidden_index[0]
                nb["positions"][t] = row.start + shift
                nb["slot_mapping"][t] = table[row.start // bs] * bs + row.start % bs
            else:
                nb["input_ids"][t : t + n] = row.input_ids
                nb["hidden_index"][t : t + n] = row.hidden_index
                pos = np.arange(row.start, row.start + n, dtype=np.int64)
                nb["positions"][t : t + n] = pos + shift
                nb["slot_mapping"][t : t + n] = np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs
            nb["block_tables"][i, : len(table)] = table
            nb["block_tables"][i, len(table) :] = BlockPool.NULL_BLOCK
            nb["seq_lens"][i] = row.start + n
            t += n
            nb["query_start_loc"][i + 1] = t
            nb["last_index"][i] = t - 1
            max_q, max_s = max(max_q, n), max(max_s, row.start + n)
        r = len(rows)
        sizes = {"input_ids": t, "positions": t, "slot_mapping": t, "hidden_index": t, "query_start_loc": r + 1,
                 "seq_lens": r, "last_index": r, "block_tables": r}
        copies = dict(sizes)
        if pad_to is not None and pad_to > r:
            self._fill_pads(nb, copies, t, r, pad_to, 1)
        v = {}
        for name, size in sizes.items():
            self.mtp_dev[name][: copies[name]].copy_(self.mtp_host[name][: copies[name]], non_blocking=True)
            v[name] = self.mtp_dev[name][:size]
        meta = StepMetadata(positions=v["positions"], query_start_loc=v["query_start_loc"], seq_lens=v["seq_lens"],
                            state_slots=v["seq_lens"], block_tables=v["block_tables"][:, : cdiv(max_s, bs)],
                            slot_mapping=v["slot_mapping"], max_query_len=max_q, max_seq_len=max_s)
        if mm_rows:
            assert pad_to is None, "an MTP pass reaching an image runs eagerly"
            meta.mrope_positions, meta.image_embeds = self._image_inputs(self.mtp_host["positions"][:t], mm_rows,
                                                                         lookahead=1)
        return meta, v

    @torch.inference_mode()
    def mtp_forward(self, rows: list[MTPRow], hidden_src: torch.Tensor) -> torch.Tensor:
        """Run the MTP layer over each row's positions; returns its output at each row's last position (R, h).

        Row i covers positions [start, start + n): input token ``input_ids[j]`` is the token at position
        start + j + 1 and its hidden state is ``hidden_src[hidden_index[j]]``. The MTP KV entries of those
        positions are (re)written in the request's blocks.
        """
        assert self.mtp is not None
        meta, v = self._fill_mtp(rows)
        out = self.mtp(v["input_ids"], hidden_src[v["hidden_index"]], meta, self.model.input_embeddings())
        return out[v["last_index"]]

    @torch.inference_mode()
    def mtp_greedy_tokens(self, mtp_hidden: torch.Tensor) -> list[int]:
        return self.model.compute_logits(mtp_hidden).argmax(dim=-1).tolist()

    @torch.inference_mode()
    def mtp_draft(self, rows: list[MTPRow], hidden_src: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """``mtp_forward`` and the greedy draft token of each row; a captured graph when every row has one token."""
        graph = self._graph("mtp", len(rows), lambda: all(len(r.input_ids) == 1 and not self._mtp_reaches_image(r)
                                                          for r in rows))
        if graph is None:
            out = self.mtp_forward(rows, hidden_src)
            return out, self.mtp_greedy_tokens(out)
        graphs, size = graph
        _, v = self._fill_mtp(rows, pad_to=size)
        torch.index_select(hidden_src, 0, v["hidden_index"], out=self.mtp_hidden_in[: len(rows)])
        out, tokens = graphs.run(size)
        # A copy: the next replay overwrites the graph's output, and callers keep rows of it across passes.
        return out[: len(rows)].clone(), tokens[: len(rows)].tolist()

    def draft_chain_graph(self, num_rows: int) -> tuple[GraphSet, int] | None:
        """The ``draft`` graphs and padded size for a verify step of ``num_rows`` rows, if captured for it."""
        return self._graph("draft", num_rows, lambda: True)

    def _fill_draft(self, rows: list[ChainRow], pad_to: int) -> torch.Tensor:
        """Fill the draft graph's buffers for ``rows`` plus pad rows up to ``pad_to``; the hidden-state indices.

        Row i's first pass is laid out in k + 1 tokens from token i * (k + 1) (tail masked: no KV write, its
        context length counting it, as verify rows are); chained pass j runs at position start + n - 1 + j for a
        row of n first-pass tokens, masked (no KV write, position 0) where the row wants fewer than j + 1 drafts.
        Pad rows are masked everywhere and read the null block.
        """
        k = self.num_speculative_tokens
        q = k + 1
        if self._draft_fence is not None:  # see _fill_draft_on_device
            self._draft_fence.synchronize()
        nb = self.draft_np
        bs = self.block_size
        null = BlockPool.NULL_BLOCK
        for i in range(pad_to):
            t = i * q
            row = rows[i] if i < len(rows) else None
            n = len(row.input_ids) if row is not None else 0
            if row is None:
                nb["input_ids"][t : t + q] = 0
                nb["hidden_index"][t : t + q] = 0
                nb["positions"][t : t + q] = np.arange(q)
                nb["slot_mapping"][t : t + q] = -1
                nb["block_tables"][i, : cdiv(q, bs)] = null
                nb["seq_lens"][i] = q
                nb["last_index"][i] = t
                nb["chain_positions"][:, i] = 0
                nb["chain_slot_mapping"][:, i] = -1
                nb["chain_seq_lens"][:, i] = 1
                continue
            table = np.asarray(row.block_table, dtype=np.int64)
            pos = np.arange(row.start, row.start + q, dtype=np.int64)
            nb["input_ids"][t : t + n] = row.input_ids
            nb["input_ids"][t + n : t + q] = 0
            nb["hidden_index"][t : t + n] = row.hidden_index
            nb["hidden_index"][t + n : t + q] = row.hidden_index[-1]
            nb["positions"][t : t + q] = pos + row.shift
            nb["slot_mapping"][t : t + n] = table[pos[:n] // bs] * bs + pos[:n] % bs
            nb["slot_mapping"][t + n : t + q] = -1
            nb["block_tables"][i, : len(table)] = table
            nb["block_tables"][i, len(table) :] = null
            nb["seq_lens"][i] = row.start + q
            nb["last_index"][i] = t + n - 1
            last = row.start + n - 1
            for j in range(1, k):
                p = last + j
                if j < row.num_drafts:
                    nb["chain_positions"][j - 1, i] = p + row.shift
                    nb["chain_slot_mapping"][j - 1, i] = table[p // bs] * bs + p % bs
                    nb["chain_seq_lens"][j - 1, i] = p + 1
                else:
                    nb["chain_positions"][j - 1, i] = 0
                    nb["chain_slot_mapping"][j - 1, i] = -1
                    nb["chain_seq_lens"][j - 1, i] = 1
        for name in ("input_ids", "hidden_index", "positions", "slot_mapping"):
            self.draft_dev[name][: pad_to * q].copy_(self.draft_host[name][: pad_to * q], non_blocking=True)
        for name in ("seq_lens", "last_index", "block_tables"):
            self.draft_dev[name][:pad_to].copy_(self.draft_host[name][:pad_to], non_blocking=True)
        for name in ("chain_positions", "chain_slot_mapping", "chain_seq_lens"):
            self.draft_dev[name][:, :pad_to].copy_(self.draft_host[name][:, :pad_to], non_blocking=True)
        if self.device.type == "cuda":
            self._draft_fence = torch.cuda.Event()
            self._draft_fence.record()
        return self.draft_dev["hidden_index"][: pad_to * q]

    @torch.inference_mode()
    def mtp_draft_chain(self, rows: list[ChainRow], hidden_src: torch.Tensor, graphs: GraphSet, size: int
                        ) -> tuple[torch.Tensor, list[list[int]]]:
        """The drafting of a verify step in one replay of the ``draft`` graph (``size`` padded rows): the first
        pass's output at each row's last position (R, h) and each row's ``num_drafts`` greedy tokens (one
        device-to-host copy)."""
        index = self._fill_draft(rows, size)
        torch.index_select(hidden_src, 0, index, out=self.draft_hidden_in[: size * (self.num_speculative_tokens + 1)])
        tokens, first = graphs.run(size)
        n = len(rows)
        if self.draft_slots is not None:  # they stay on the device, in each request's drafts row: no host sync
            slots = device_tensor([r.state_slot for r in rows], self.device, torch.long)
            self.draft_slots.index_copy_(0, slots, tokens[:n])
            return first[:n].clone(), [[PREVIOUS_DRAFT] * r.num_drafts for r in rows]
        drafts = tokens[:n].tolist()
        return first[:n].clone(), [d[: r.num_drafts] for d, r in zip(drafts, rows, strict=True)]

    def _fill_commit(self, num_accepted: list[int], size: int) -> None:
        """The accepted counts of the verify rows, then -1 up to ``size`` rows (pad rows commit nothing)."""
        n = len(num_accepted)
        host = self.np_bufs["num_accepted"]
        host[:n] = num_accepted
        host[n:size] = -1
        self.dev_bufs["num_accepted"][:size].copy_(self.host_bufs["num_accepted"][:size], non_blocking=True)

    def _commit_verified(self, num_accepted: list[int] | torch.Tensor) -> None:
        """Live slots of the last step's verify rows take candidate ``num_accepted[r]`` (-1: leave untouched): one
        replay of the ``commit`` graph when the verify graph ran the step (its pad rows are on the pad slot). The
        counts come from the host, or are already on the device (the device chain)."""
        vm = self.last_meta.verify if self.last_meta is not None else None
        if vm is None:
            return
        n = len(num_accepted)
        assert n == vm.num_rows
        size = self._verify_graph_size
        graphs = self.graphs.get("commit") if self.graphs is not None and size is not None else None
        use_graph = graphs is not None and size in graphs.sizes
        buf = self.dev_bufs["num_accepted"]
        if isinstance(num_accepted, torch.Tensor):
            buf[:n].copy_(num_accepted)
            if use_graph:
                buf[n:size].fill_(-1)  # pad rows commit nothing
        elif use_graph:
            self._fill_commit(num_accepted, size)  # type: ignore[arg-type]
        else:
            self.np_bufs["num_accepted"][:n] = num_accepted
            buf[:n].copy_(self.host_bufs["num_accepted"][:n], non_blocking=True)
        if use_graph:
            graphs.run(size)  # type: ignore[union-attr,arg-type]
            return
        for layer in self.model.recurrent_layers():
            layer.commit_verified(vm.state_slots, buf[:n])

    def _snapshot_candidates(self, rows: list[int], positions: list[int], entries: list[int],
                             accepted: torch.Tensor | None = None, behind_rows: list[int] | None = None,
                             behind_entries: list[int] | None = None) -> None:
        """Fill snapshot ``entries`` from verify row ``rows[i]``'s candidate state after position ``positions[i]``;
        with ``accepted`` (counts on the device), only where it reached that position, the others into the pad
        slot. ``behind_rows`` (rows whose start is on the device) take the last block boundary they reach as their
        point, as the scheduler will (``Scheduler._place``); one that reaches none copies into the pad slot."""
        behind_rows, behind_entries = behind_rows or [], behind_entries or []
        n = len(rows) + len(behind_rows)
        if not n:
            return
        graphs = self.graphs.get("snapshot") if self.graphs is not None else None
        size = graphs.padded_size(n) if graphs is not None else None
        pad = self.state_pool.pad_slot
        # (row, position, entry) per candidate, one copy; pads (with a graph) copy row 0's candidate into the pad
        # slot. A row behind's position is set on the device below.
        flat = [x for c in zip(rows, positions, entries, strict=True) for x in c]
        flat += [x for c in zip(behind_rows, [0] * len(behind_rows), behind_entries, strict=True) for x in c]
        flat += [0, 0, pad] * ((size or n) - n)
        snap = device_tensor(flat, self.device, torch.long).view(-1, 3)
        if size is not None:
            self.dev_bufs["snap"][:size].copy_(snap)
            snap = self.dev_bufs["snap"][:size]
        r, p, e = snap[:n].unbind(1)
        if behind_rows:
            assert accepted is not None
            b = r[len(rows) :]
            start = self.dev_bufs["verify_starts"].index_select(0, b)
            q = self.num_speculative_tokens + 1
            j = ((start + q) // self.block_size) * self.block_size - start - 1  # -1: no boundary reached
            p[len(rows) :].copy_(j.clamp(min=0))
            e[len(rows) :].copy_(torch.where(j >= 0, e[len(rows) :], pad))
        if accepted is not None:
            e.copy_(torch.where(accepted.index_select(0, r) >= p, e, pad))
        if graphs is not None and size is not None:
            graphs.run(size)  # every recurrent layer's copies in one replay
            return
        for layer in self.model.recurrent_layers():
            layer.snapshot_candidates(r, p, e)

    def _snapshot_pads(self, size: int) -> None:
        """The snapshot graph's inputs as pads only (capture): row 0's candidate 0 into the pad slot."""
        self.dev_bufs["snap"][:size].copy_(torch.tensor([0, 0, self.state_pool.pad_slot]))

    def _graph_snapshot(self, size: int) -> tuple[torch.Tensor, ...]:
        """``snapshot`` graph: every recurrent layer's candidate snapshots of ``size`` (row, position, entry)
        triples from the persistent ``snap`` buffer (pads: into the pad slot)."""
        r, p, e = self.dev_bufs["snap"][:size].unbind(1)
        for layer in self.model.recurrent_layers():
            layer.snapshot_candidates(r, p, e)
        return ()


# The draft fill's per-row host inputs (ModelRunner._fill_draft_on_device), packed as the rows of one tensor.
DRAFT_ROW_INPUTS = ("row_first", "row_limit", "row_slot", "row_shift")


class StepResult:
    """A step enqueued on the device (``ModelRunner.execute_model_async``); ``result()`` is its ``RunnerOutput``."""

    def __init__(self, out: RunnerOutput, plain: list[int] | None = None, samp: PendingSample | None = None,
                 finish: Callable[[], None] | None = None) -> None:
        self._out = out
        self._plain = plain or []
        self._samp = samp
        self._finish = finish  # what fills the rest of ``out`` once the device's results are on the host

    def result(self) -> RunnerOutput:
        if self._samp is not None:
            ModelRunner._take_samples(self._out, self._plain, self._samp.result())
            self._samp = None
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return self._out

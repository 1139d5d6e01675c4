"""The worker's memory: what the device holds, the activation peak of a full-size step, the cache budget that is
left (vLLM's ``gpu_memory_utilization``), and the KV cache tensors themselves."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from hyserve.cache.block_pool import cdiv
from hyserve.cache.specs import AttentionSpec, CacheSpecs
from hyserve.cache.state_pool import StatePool
from hyserve.config import ModelConfig
from hyserve.model.base import CausalLM
from hyserve.model.metadata import StepMetadata
from hyserve.worker.mm_inputs import largest_image_inputs

logger = logging.getLogger("hyserve")


@dataclass(slots=True)
class DeviceMemory:
    """One reading of a CUDA device's memory (bytes); ``non_torch`` = used on the device minus torch's reserved."""

    total: int
    free: int
    reserved: int
    allocated: int
    non_torch: int


def device_memory(device: torch.device) -> DeviceMemory | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    return DeviceMemory(total, free, reserved, torch.cuda.memory_allocated(device), total - free - reserved)


def allocate_kv(specs: list[AttentionSpec], num_blocks: int, block_size: int, device: torch.device
                ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(K, V) of (num_blocks, block_size, num_kv_heads, head_dim) per spec."""
    out = []
    for spec in specs:
        shape = (num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        out.append((torch.zeros(shape, dtype=spec.dtype, device=device),
                    torch.zeros(shape, dtype=spec.dtype, device=device)))
    return out


def allocate_index_caches(specs: list[AttentionSpec], num_blocks: int, block_size: int, device: torch.device
                          ) -> list[torch.Tensor | None]:
    """Per spec: the (num_blocks, block_size, index_dim) index-key cache in its ``index_dtype`` where the spec keeps
    index keys (``index_dim > 0``), else None. Same blocks and slots as the spec's K and V."""
    out: list[torch.Tensor | None] = []
    for spec in specs:
        if spec.index_dim:
            out.append(torch.zeros((num_blocks, block_size, spec.index_dim), dtype=spec.index_dtype, device=device))
        else:
            out.append(None)
    return out


@dataclass(slots=True)
class ProfileShape:
    """What the activation profile runs: a prefill of ``num_tokens`` tokens on this pipeline stage."""

    num_tokens: int
    max_num_seqs: int
    block_size: int
    is_first_stage: bool
    is_last_stage: bool
    model_dir: str  # the checkpoint's image processor sizes the largest image
    encoder_cache_tokens: int


def profile_peak_activation(model: CausalLM, model_config: ModelConfig, specs: CacheSpecs, shape: ProfileShape,
                            device: torch.device, dtype: torch.dtype) -> int:
    """Run a full-size prefill on throwaway caches and measure the activation memory it peaks at."""
    n, bs = shape.num_tokens, shape.block_size
    pool = StatePool(specs.recurrent, 1, device)
    kv = allocate_kv(list(specs.attention), cdiv(n, bs) + 1, bs, device)
    index = allocate_index_caches(list(specs.attention), cdiv(n, bs) + 1, bs, device)
    model.bind_caches(kv, pool.layers, index)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    meta = StepMetadata(
        positions=torch.arange(n, device=device),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        state_slots=torch.zeros(1, dtype=torch.long, device=device),
        block_tables=torch.arange(1, cdiv(n, bs) + 1, dtype=torch.int32, device=device).unsqueeze(0),
        slot_mapping=torch.arange(bs, bs + n, device=device),
        max_query_len=n, max_seq_len=n,
    )
    ids = torch.randint(0, model_config.vocab_size, (n,), device=device)
    inter = None
    if not shape.is_first_stage:
        h = model_config.residual_width
        inter = (torch.randn(n, h, dtype=dtype, device=device), torch.randn(n, h, dtype=dtype, device=device))
    hidden = model(ids, meta, inter) if inter is not None else model(ids, meta)
    if shape.is_last_stage:
        model.compute_logits(hidden[-min(n, shape.max_num_seqs):])
    tower = getattr(model, "visual", None)
    if tower is not None:  # the largest image the processor makes, encoded beside the step's activations
        pixels, grid = largest_image_inputs(shape.model_dir, tower.cfg)
        tower(pixels.to(device, dtype), grid)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del pool, kv, index, meta, hidden
    torch.cuda.empty_cache()
    if tower is not None:  # the encoder cache when full
        peak += shape.encoder_cache_tokens * tower.cfg.out_hidden_size * dtype.itemsize
    return int(peak)


def cache_budget(device: torch.device, util: float, base: DeviceMemory, peak: int, graphs: int) -> int:
    """Bytes for the KV cache, state pool and snapshots on a CUDA device.

    As vLLM's ``gpu_memory_utilization``: this instance may use ``total * utilization`` of the card; the cache gets
    that minus what the instance itself already holds (weights, non-torch memory such as cuBLAS workspaces, both
    measured against the baseline ``base`` taken before loading), its profiled activation ``peak`` and the CUDA
    graphs' estimate ``graphs``. Other processes and other instances in this process are not subtracted; instead the
    share asked for must be free, so two instances at 0.45 each fit on one card and a second one at 0.9 is refused
    with a message that says what holds the memory.

    Torch's allocator may hold memory it has not handed out in segments that also hold live tensors (the profile
    emptied its cache first, so what is left is such slack, from loading): neither free to the device nor usable by
    the caches' large tensors, it is subtracted too (16.8 GiB after a dummy load of the 35B-A3B bf16 shape, where a
    batch-64 cache that counted it as room ran out of memory).
    """
    now = device_memory(device)
    assert now is not None
    total = now.total
    weights = max(0, now.allocated - base.allocated)
    non_torch = max(0, now.non_torch - base.non_torch)
    slack = max(0, (now.reserved - now.allocated) - (base.reserved - base.allocated))
    requested = check_requested_is_free(util, base)
    budget = requested - weights - non_torch - slack - peak - graphs
    logger.info("memory: total %.1f GiB, this instance may use %.1f GiB (gpu_memory_utilization %.2f): weights "
                "%.2f GiB, non-torch %.2f GiB, allocator slack %.2f GiB, activation peak %.2f GiB, CUDA graphs "
                "(estimate) %.2f GiB, cache budget %.2f GiB", total / 2**30, requested / 2**30, util,
                weights / 2**30, non_torch / 2**30, slack / 2**30, peak / 2**30, graphs / 2**30, budget / 2**30)
    if budget <= 0:
        raise ValueError("no GPU memory left for the KV cache and state pool; raise --gpu-memory-utilization "
                         "or lower --max-num-batched-tokens")
    return budget


# The parts of a model's weights that the error names, by the first module name segment that marks them.
_PARTS = (("experts", "experts"), ("self_attn", "attention"), ("linear_attn", "GDN"), ("mlp", "MLP"),
          ("embed_tokens", "embedding"), ("lm_head", "LM head"), ("visual", "vision tower"))


@dataclass(slots=True)
class WeightBytes:
    """The bytes of one rank's weights (parameters and buffers, each distinct tensor once), by part: ``experts``
    (the routed experts), ``MLP`` (dense; a MoE block's router and shared expert are ``router and shared expert``),
    ``attention``, ``GDN``,
    ``embedding``, ``LM head``, ``vision tower``, ``MTP head`` and ``other`` (norms, rotary tables)."""

    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        shown = sorted(((n, b) for n, b in self.parts.items() if b), key=lambda nb: -nb[1])
        return ", ".join(f"{name} {format_bytes(b)}" for name, b in shown)


def format_bytes(n: int) -> str:
    """``n`` bytes in GiB with one decimal, or in MiB / KiB below one GiB / MiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _part_of(name: str) -> str:
    segments = name.split(".")
    for key, part in _PARTS:
        if key in segments:
            return part
    return "other"


def weight_bytes(model: nn.Module, draft_head: nn.Module | None = None) -> WeightBytes:
    """The bytes ``model`` (and ``draft_head``) hold in parameters and buffers, from their shapes and dtypes alone
    (a model built on the meta device counts as the loaded one): each tensor once (a tied LM head is the
    embedding), FP8 weights at one byte and their float32 scales at four."""
    parts: dict[str, int] = {}
    seen: set[int] = set()
    for module, prefix in ((model, ""), (draft_head, "mtp.")):
        if module is None:
            continue
        named = [*module.named_parameters(remove_duplicate=True), *module.named_buffers(remove_duplicate=True)]
        for name, t in named:
            if id(t) in seen:
                continue
            seen.add(id(t))
            part = "MTP head" if prefix else _part_of(name)
            parts[part] = parts.get(part, 0) + t.numel() * t.element_size()
    if "experts" in parts and "MLP" in parts:  # a MoE block's other tensors
        parts["router and shared expert"] = parts.pop("MLP")
    return WeightBytes(parts)


def held_bytes(*modules: nn.Module | None) -> int:
    """The bytes of the distinct storages under ``modules``' parameters and buffers (what a loaded model holds)."""
    storages: dict[int, int] = {}
    for module in modules:
        if module is None:
            continue
        for t in [*module.parameters(), *module.buffers()]:
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


@dataclass(slots=True, frozen=True)
class Parallelism:
    """How the weights are split (for the remedies an error names)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    expert_parallel: bool = False
    quantized: bool = False


def free_at_start(base: DeviceMemory) -> int:
    """Free to this instance at the baseline: the device's free memory and what torch's allocator had cached but
    not handed out (a shut-down instance's memory is there until empty_cache)."""
    return base.free + base.reserved - base.allocated


def check_requested_is_free(util: float, base: DeviceMemory) -> int:
    """``total * util`` (bytes this instance may use), refused when more than that was not free at the baseline."""
    total, free = base.total, free_at_start(base)
    requested = int(total * util)
    if requested > free:
        raise ValueError(
            f"gpu_memory_utilization={util} asks for {requested / 2**30:.2f} GiB of the {total / 2**30:.2f} GiB "
            f"device, but only {free / 2**30:.2f} GiB was free when this instance started (other "
            f"processes or other LLM instances in this process hold {(total - free) / 2**30:.2f} GiB); "
            "lower --gpu-memory-utilization, or release the other instance first (LLM.shutdown() or `with "
            "LLM(...) as llm:`)")
    return requested


def check_weights_fit(need: WeightBytes, base: DeviceMemory, util: float, parallel: Parallelism) -> None:
    """Before loading: refuse weights that do not fit in this instance's share of the device (``total * util``),
    with their bytes by part and the remedies."""
    requested = check_requested_is_free(util, base)
    if need.total <= requested:
        return
    world = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
    rank = " on this rank" if world > 1 else ""
    whole = need.total * world
    gpus = -(-whole // max(requested, 1))
    experts = need.parts.get("experts", 0)
    moe = " (add --enable-expert-parallel to place E/N whole experts on each rank)" \
        if experts and not parallel.expert_parallel else ""
    remedies = [f"split them over more GPUs with --tensor-parallel-size N{moe} or --pipeline-parallel-size N (at "
                f"least {gpus} GPUs at this utilization)"]
    if not parallel.quantized:
        remedies.append("load an FP8 checkpoint or quantize as it loads (--quantization fp8: the linear weights "
                        "in about half the bytes)")
    if util < 0.95:
        remedies.append("raise --gpu-memory-utilization")
    raise ValueError(
        f"the model's weights need {format_bytes(need.total)}{rank} ({need.describe()}) but "
        f"gpu_memory_utilization={util} of {format_bytes(base.total)} leaves {format_bytes(requested)}, before "
        f"the KV cache, recurrent state and activations; " + "; ".join(remedies))


def graph_memory_estimate(sizes: dict[str, list[int]], logit_rows: int, num_speculative_tokens: int,
                          vocab_size: int, activation_width: int, dtype: torch.dtype) -> int:
    """Bytes the graphs take beyond the caches: the shared logits buffers (model dtype and float32) and the pool of
    their activations."""
    if not sizes:
        return 0
    elem = torch.finfo(dtype).bits // 8
    tokens = max(s[-1] * (num_speculative_tokens + 1) for s in sizes.values() if s)
    # The verify graphs of shorter speculation lengths (``verify@j``) keep their hidden-state outputs in the pool,
    # one per captured size.
    kept = sum(sum(s) * (int(name.split("@")[1]) + 1) for name, s in sizes.items() if name.startswith("verify@"))
    return (logit_rows * vocab_size * (4 + elem) + tokens * 16 * activation_width * elem
            + kept * activation_width * elem + 64 * 2**20)

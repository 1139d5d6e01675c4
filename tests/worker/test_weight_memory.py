"""The weight-memory plan (``hyserve.worker.memory.weight_bytes``, ``check_weights_fit``): before loading, each rank
counts its weights from the model (and draft head) built on the meta device, and a checkpoint that cannot fit in
``total x gpu_memory_utilization`` is refused before anything is allocated, naming what it needs.

* the planned bytes equal what the loaded model and MTP head hold (their distinct storages) for dense Qwen3.5,
  Qwen3.5-MoE in both expert layouts (with MTP), Qwen3-Next (dense and sparse layers), tensor parallel 2 and expert
  parallel on 2 gloo ranks (each rank its own share), a pipeline stage, and block FP8 (one byte per weight, float32
  scales);
* the MoE count is the config's parameter count (routed experts included) at the model dtype;
* with a device faked small (``device_memory`` patched on the CPU) the engine refuses the checkpoint before loading,
  and the message names the bytes by part, the device's total, the utilization and the remedies; the real
  Qwen3.5-35B-A3B and Qwen3-Next-80B-A3B shapes (config only, counted on the meta device) against an H200;
* the cache budget after loading takes the MoE block's activation width, and its profiled peak holds for any
  routing.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hyserve.model.qwen3_5_moe_config import qwen3_5_moe_config
from hyserve.model.registry import load_model_config
from hyserve.testing.engine import make_llm
from hyserve.testing.families import CheckpointCache
from hyserve.testing.fp8 import write_fp8_checkpoint
from hyserve.testing.qwen3_5_moe import QWEN3_5_MOE
from hyserve.testing.qwen3_next import QWEN3_NEXT
from hyserve.worker import model_runner
from hyserve.worker.memory import DeviceMemory, Parallelism, WeightBytes, check_weights_fit, format_bytes

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import shapes

MOE, NEXT = QWEN3_5_MOE.name, QWEN3_NEXT.name
GIB = 2**30


def _rank_bytes(llm: Any) -> list[dict[str, Any]]:
    return list(llm.llm_engine.executor.collective_rpc("weight_bytes"))


def _independent_held(llm: Any) -> int:
    """The loaded model's and head's parameters and buffers, each storage once (computed here, not by hyserve)."""
    runner = llm.llm_engine.runner
    seen: dict[int, int] = {}
    for module in (runner.model, runner.mtp):
        if module is None:
            continue
        for t in [*module.parameters(), *module.buffers()]:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("family,kw,mtp", [
    ("qwen3_5", {}, False), ("qwen3_5", {}, True), (MOE, {"layout": "fused"}, True),
    (MOE, {"layout": "per_expert"}, False), (NEXT, {"decoder_sparse_step": 2}, True),
])
def test_planned_bytes_are_what_the_loaded_model_holds(ckpts: CheckpointCache, family: str, kw: dict[str, Any],
                                                       mtp: bool) -> None:
    path = ckpts.get("causal", "gdn3_attn1", family=family, with_mtp=True, **kw)
    spec = {"method": "mtp", "num_speculative_tokens": 1} if mtp else None
    llm = make_llm(path, speculative_config=spec)
    [got] = _rank_bytes(llm)
    assert got["planned"] == got["held"] == _independent_held(llm)
    assert (llm.llm_engine.runner.mtp is not None) == mtp and ("MTP head" in got["parts"]) == mtp
    if family == MOE:
        cfg = qwen3_5_moe_config(load_model_config(path))
        # The config's parameter count (every layer's router, experts, shared expert) at float32, MTP aside.
        text = sum(b for part, b in got["parts"].items() if part not in ("MTP head",))
        assert got["parts"]["experts"] == cfg.num_hidden_layers * cfg.num_experts * 3 * cfg.hidden_size \
            * cfg.moe_intermediate_size * 4
        assert text >= cfg.num_parameters() * 4 > got["parts"]["experts"] > 0


@pytest.mark.parametrize("layout,ep", [("fused", False), pytest.param("per_expert", True, marks=pytest.mark.slow)])
def test_each_tensor_parallel_rank_counts_its_own_share(ckpts: CheckpointCache, layout: str, ep: bool) -> None:
    """Two gloo ranks: each rank's plan is what its loaded model holds; expert parallel halves the experts' bytes
    (whole experts), plain tensor parallel each expert's intermediate dimension: both half of one process's."""
    path = ckpts.get("causal", "attn_first", family=MOE, layout=layout, num_experts_per_tok=3, with_mtp=True)
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    one = make_llm(path, speculative_config=spec)
    [single] = _rank_bytes(one)
    llm = make_llm(path, tensor_parallel_size=2, enable_expert_parallel=ep, speculative_config=spec,
                   max_num_batched_tokens=16)
    try:
        ranks = _rank_bytes(llm)
    finally:
        llm.llm_engine.shutdown()
    assert len(ranks) == 2
    for r in ranks:
        assert r["planned"] == r["held"]
        assert 2 * r["parts"]["experts"] == single["parts"]["experts"]


def test_a_pipeline_stage_counts_its_own_layers(ckpts: CheckpointCache) -> None:
    path = ckpts.get("causal", "attn_last_gdn_run", family=MOE, layout="per_expert", with_mtp=True)
    llm = make_llm(path, pipeline_parallel_size=2, max_num_batched_tokens=16,
                   speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    try:
        ranks = _rank_bytes(llm)
    finally:
        llm.llm_engine.shutdown()
    assert [r["planned"] for r in ranks] == [r["held"] for r in ranks]
    assert "MTP head" in ranks[1]["parts"] and "MTP head" not in ranks[0]["parts"]


@pytest.mark.parametrize("quantize_mtp", [True, False])
def test_block_fp8_counts_one_byte_per_weight_and_its_scales(tmp_path: Path, quantize_mtp: bool) -> None:
    path = write_fp8_checkpoint(tmp_path / "fp8", "block", form="conditional", with_mtp=True, seed=11,
                                quantize_mtp=quantize_mtp)
    llm = make_llm(path, dtype="bfloat16", speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    [got] = _rank_bytes(llm)
    assert got["planned"] == got["held"] == _independent_held(llm)
    fp8 = [p for p in llm.llm_engine.runner.model.parameters() if p.dtype == torch.float8_e4m3fn]
    assert fp8, "nothing was quantized"


def _fake_device(total: int, free: int | None = None) -> DeviceMemory:
    free = total if free is None else free
    return DeviceMemory(total=total, free=free, reserved=0, allocated=0, non_torch=total - free)


def test_a_checkpoint_that_cannot_fit_is_refused_before_loading(ckpts: CheckpointCache,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The device read as 1 MiB: the engine stops before building the model, naming the bytes."""
    path = ckpts.get("causal", "gdn3_attn1", family=MOE, layout="fused")
    one = make_llm(path)
    [got] = _rank_bytes(one)
    built: list[object] = []
    monkeypatch.setattr(model_runner, "device_memory", lambda device: _fake_device(2**20))
    monkeypatch.setattr(model_runner, "load_weights", lambda *a, **k: built.append(a))
    with pytest.raises(ValueError) as err:
        make_llm(path, gpu_memory_utilization=0.5)
    msg = str(err.value)
    assert not built
    assert f"the model's weights need {format_bytes(got['planned'])} (experts " in msg
    assert "gpu_memory_utilization=0.5 of 1.0 MiB leaves 512.0 KiB" in msg
    assert "--tensor-parallel-size" in msg and "--enable-expert-parallel" in msg and "--quantization fp8" in msg


def _meta_plan(tmp_path: Path, shape: str, fp8: bool = False, tp: int = 1) -> WeightBytes:
    """A benchmark shape's weights (config.json only) counted on the meta device, as one rank of ``tp``."""
    from hyserve.distributed import parallel_state
    from hyserve.worker.memory import weight_bytes

    d = tmp_path / shape
    shapes.write_moe_config(str(d), shape, fp8=fp8)
    cfg = load_model_config(str(d))
    monkey = pytest.MonkeyPatch()
    monkey.setattr(parallel_state, "_TP_SIZE", tp)
    try:
        prev = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        from hyserve.model import registry
        with torch.device("meta"):
            model = registry.model_class(cfg)(cfg)
    finally:
        torch.set_default_dtype(prev)
        monkey.undo()
    return weight_bytes(model)


H200 = _fake_device(int(139.7 * GIB))


def test_the_real_moe_shapes_against_an_h200(tmp_path: Path) -> None:
    """Qwen3.5-35B-A3B in bf16 fits one H200 at 0.9; Qwen3-Next-80B-A3B's shape in bf16 does not (about 149 GiB),
    and the message says so by part; as two tensor-parallel ranks it fits."""
    small = _meta_plan(tmp_path, "35b-a3b")
    assert 60 * GIB < small.total < 70 * GIB and small.parts["experts"] > 0.9 * small.total
    check_weights_fit(small, H200, 0.9, Parallelism())
    big = _meta_plan(tmp_path, "next-80b")
    with pytest.raises(ValueError) as err:
        check_weights_fit(big, H200, 0.9, Parallelism())
    msg = str(err.value)
    assert f"the model's weights need {format_bytes(big.total)} (experts {format_bytes(big.parts['experts'])}, " \
        in msg
    assert "gpu_memory_utilization=0.9 of 139.7 GiB leaves 125.7 GiB" in msg
    half = _meta_plan(tmp_path, "next-80b", tp=2)
    assert abs(half.parts["experts"] * 2 - big.parts["experts"]) == 0
    check_weights_fit(half, H200, 0.9, Parallelism(tensor_parallel_size=2))


def test_a_share_that_is_not_free_is_refused_before_loading() -> None:
    need = WeightBytes({"experts": GIB})
    with pytest.raises(ValueError, match=r"only 50.00 GiB was free"):
        check_weights_fit(need, _fake_device(100 * GIB, free=50 * GIB), 0.9, Parallelism())


def test_the_cache_budget_subtracts_the_allocators_slack(monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory torch reserved but did not hand out, left after the profile emptied its cache (slack in segments
    holding live tensors), is not room for the caches: the budget is that much smaller; slack that was there at the
    baseline is not subtracted twice."""
    from hyserve.worker import memory

    base = DeviceMemory(total=100 * GIB, free=100 * GIB, reserved=0, allocated=0, non_torch=0)
    tight = DeviceMemory(total=100 * GIB, free=40 * GIB, reserved=60 * GIB, allocated=60 * GIB, non_torch=0)
    slack = DeviceMemory(total=100 * GIB, free=40 * GIB, reserved=60 * GIB, allocated=50 * GIB, non_torch=0)
    dev = torch.device("cuda")
    monkeypatch.setattr(memory, "device_memory", lambda device: tight)
    assert memory.cache_budget(dev, 0.9, base, GIB, 0) == 90 * GIB - 60 * GIB - GIB
    monkeypatch.setattr(memory, "device_memory", lambda device: slack)
    assert memory.cache_budget(dev, 0.9, base, GIB, 0) == 90 * GIB - 50 * GIB - 10 * GIB - GIB
    slack_at_base = DeviceMemory(total=100 * GIB, free=96 * GIB, reserved=4 * GIB, allocated=0, non_torch=0)
    assert memory.cache_budget(dev, 0.9, slack_at_base, GIB, 0) == 90 * GIB - 50 * GIB - 6 * GIB - GIB


def test_the_cache_budget_keeps_room_for_the_moe_block(ckpts: CheckpointCache) -> None:
    """After loading, the budget subtracts the MoE block's activations: the CUDA-graph estimate takes the block's
    width (k expert rows per token), and the profiled peak holds whatever the routing, since the fused experts'
    buffers are sized by the token count alone (every expert on one row, or all pairs on one expert: the same
    padded rows)."""
    from hyserve.kernels.moe import align_pairs_ref

    path = ckpts.get("causal", "gdn3_attn1", family=MOE, layout="fused", num_experts_per_tok=3)
    runner = make_llm(path).llm_engine.runner
    model, cfg = runner.model, qwen3_5_moe_config(runner.model_config)
    dense_width = max(cfg.hidden_size, cfg.conv_dim + cfg.linear_value_dim, 2 * cfg.num_attention_heads * cfg.head_dim)
    assert model.activation_width() == max(dense_width, 3 * 2 * cfg.moe_intermediate_size, 3 * cfg.hidden_size)
    tokens, k, experts = 64, 8, 256
    spread = torch.arange(tokens * k).reshape(tokens, k) % experts
    one = torch.zeros(tokens, k, dtype=torch.long) + torch.arange(k)  # every token on the same k experts
    assert align_pairs_ref(spread, experts, 0, 16)[0].shape == align_pairs_ref(one, experts, 0, 16)[0].shape


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_the_draft_head_is_allocated_before_the_loads_temporaries(ckpts: CheckpointCache, load_format: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tensor that stays is allocated before the load makes its temporaries: a head built after them is carved
    from the segments they freed in torch's CUDA caching allocator and pins them (5 GiB of slack, taken from the
    cache budget, on the 27B FP8 shape with MTP). The head is built on the runner's device before either loader
    runs, and loaded with the checkpoint's tensors afterwards (its outputs are checked against transformers by the
    MTP tests)."""
    events: list[str] = []
    build, dummy, real = model_runner.ModelRunner._build_mtp, model_runner.load_dummy_weights, \
        model_runner.load_weights

    def spy_build(self: Any, tensors: dict[str, torch.Tensor], device: torch.device | None = None) -> Any:
        if device is None or device.type != "meta":
            events.append("build head")
        return build(self, tensors, device)

    def spy(loader: Any) -> Any:
        def load(*args: Any, **kw: Any) -> Any:
            events.append("load")
            return loader(*args, **kw)
        return load

    monkeypatch.setattr(model_runner.ModelRunner, "_build_mtp", spy_build)
    monkeypatch.setattr(model_runner, "load_dummy_weights", spy(dummy))
    monkeypatch.setattr(model_runner, "load_weights", spy(real))
    path = ckpts.get("causal", "gdn3_attn1", with_mtp=True)
    llm = make_llm(path, load_format=load_format, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    assert events == ["build head", "load"]
    head = llm.llm_engine.runner.mtp
    assert head is not None and all(torch.isfinite(p).all() and p.abs().sum() > 0 for p in head.parameters()
                                    if p.is_floating_point() and p.dim() > 1)

"""FP8 mixture-of-experts experts (issue 31): Qwen's block FP8 (fused and per-expert layouts), compressed-tensors
FP8 per channel (per-expert layout; some layers with one scale per tensor) and online FP8 of a bf16 checkpoint, on
tiny Qwen3.5-MoE checkpoints (``hyserve.testing.fp8_moe``) with an MTP head whose MoE block is FP8 too.

The yardstick is transformers' ``Qwen3_5MoeForCausalLM`` holding the dequantized weights, with the activation
quantization emulated on the quantized ``nn.Linear`` layers and in the experts' own loop (per token, or per token
and 128-group, before ``gate_up`` and before ``down``). Both sides compute the same FP8 arithmetic in float32, so
almost every log-prob agrees to 1e-5. Not all: requantizing every layer's input turns a float32 difference of
order 1e-7 into a whole e4m3 step wherever a value straddles a rounding boundary, and these random tiny models
amplify it (a 1e-6 relative change of the reference's own embedding moves one of its log-probs by 2e-2, measured).
So: mean |difference| <= 1e-2, max <= 0.1, and the reference's argmax wherever its top two logits are more than 0.1
apart (measured: mean 1e-6 to 1.4e-3, max 1.7e-2). A sabotaged load (a per-tensor expert scale not expanded to its
rows) fails the check.

Also: FP8 KV cache with prefix caching, MTP speculation (planted drafts, accepted) and async scheduling together;
tensor parallel 2 and expert parallel on gloo; each rank's block-FP8 experts are exactly its slice of the
checkpoint's (in process); the fused Triton kernels (interpreter) read the loaded scales as the reference does;
``load_format="dummy"`` with an FP8 config; refusals (block slices off the grid, static input scales, experts
quantized unalike, a missing expert scale); on CUDA, the experts against the CPU path.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe

from hyserve import SamplingParams
from hyserve.distributed import parallel_state
from hyserve.kernels.moe import dequantize_experts
from hyserve.layers.linear import LinearBase
from hyserve.layers.moe import Experts
from hyserve.layers.quantization import experts as experts_method
from hyserve.layers.quantization import parse_quantization_config
from hyserve.model.loader import copy_into
from hyserve.model.registry import load_model_config
from hyserve.testing import read_checkpoint_tensors
from hyserve.testing.engine import drive, make_llm, random_prompts
from hyserve.testing.families import CheckpointCache
from hyserve.testing.fp8 import FP8, assert_close_to_fp8_reference, dequantize, load_engine_model, quantization_config
from hyserve.testing.fp8_moe import (
    FP8_KV,
    assert_fp8_kv_features_compose,
    dequantize_stacked,
    load_fp8_moe_reference,
    prefix_sharing_arrivals,
    write_fp8_moe_checkpoint,
)
from hyserve.testing.qwen3_5_moe import QWEN3_5_MOE, stack_experts

PER_TENSOR_LAYERS = r"model\.layers\.[23]\."
CASES: dict[str, dict[str, Any]] = {
    # moe_intermediate_size 128: each expert's gate and up rows are whole 128-row blocks.
    "block_fused": dict(fmt="block", layout="fused", moe_intermediate_size=128),
    "block_per_expert": dict(fmt="block", layout="per_expert", moe_intermediate_size=128, num_experts_per_tok=3),
    # Per channel; layers 2 and 3 (their experts too: one scale per expert and projection) per tensor.
    "ct_per_expert": dict(fmt="ct_dynamic", layout="per_expert", tensor_scale_layers=PER_TENSOR_LAYERS),
    # Fused: experts.gate_up_proj_scale [E, 2I] per channel, [E] per tensor in layers 2 and 3.
    "ct_fused": dict(fmt="ct_dynamic", layout="fused", tensor_scale_layers=PER_TENSOR_LAYERS, num_experts_per_tok=3),
    # 256 = two ranks' slices of two blocks each (the in-process slice check).
    "block_tp": dict(fmt="block", layout="per_expert", moe_intermediate_size=256),
    "block_tp_fused": dict(fmt="block", layout="fused", moe_intermediate_size=256),
}
MTP = {"method": "mtp", "num_speculative_tokens": 2}
MEAN_TOL = 1e-2  # mean |log-prob difference| of the chosen tokens
MAX_TOL = 0.1  # the largest one
MARGIN = 0.1  # reference top-2 logit gap above which the chosen token must be the reference's argmax
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
PROMPTS = random_prompts(3, [9, 30, 17], seed=5)


class Checkpoints:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.paths: dict[str, str] = {}
        self.refs: dict[tuple[str, int, bool], Any] = {}

    def get(self, case: str) -> str:
        if case not in self.paths:
            kw = dict(CASES[case])
            self.paths[case] = write_fp8_moe_checkpoint(self.root / case, kw.pop("fmt"), seed=11, **kw)
        return self.paths[case]

    def reference(self, case: str, tp: int = 1, ep: bool = False) -> Any:
        if (case, tp, ep) not in self.refs:
            self.refs[case, tp, ep] = load_fp8_moe_reference(self.get(case), tp, expert_parallel=ep)
        return self.refs[case, tp, ep]


@pytest.fixture(scope="module")
def moe_ckpts(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("fp8_moe"))


def assert_close_to_reference(ref: Any, runs: list[tuple[list[int], Any]]) -> None:
    assert_close_to_fp8_reference(ref, runs, MEAN_TOL, MAX_TOL, MARGIN)


def _check(llm: Any, ref: Any, prompts: list[list[int]] = PROMPTS) -> None:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert_close_to_reference(ref, list(zip(prompts, outs, strict=True)))


def _experts(module: torch.nn.Module) -> list[Experts]:
    return [m for m in module.modules() if isinstance(m, Experts)]


# ------------------------------------------------------------------------------------------------ end to end


@pytest.mark.parametrize("case", ["block_fused", "block_per_expert", "ct_per_expert", "ct_fused"])
def test_greedy_matches_the_fp8_reference(moe_ckpts: Checkpoints, case: str) -> None:
    llm = make_llm(moe_ckpts.get(case), max_num_batched_tokens=16, speculative_config=MTP)
    _check(llm, moe_ckpts.reference(case))
    runner = llm.llm_engine.runner
    experts = _experts(runner.model)
    assert len(experts) == 4 and all(e.gate_up_proj.dtype == FP8 and e.down_proj.dtype == FP8 for e in experts)
    scales = [e.method.scales(e) for e in experts]
    if case.startswith("block"):
        assert all(s.block == (128, 128) and s.w13.shape == (6, 2, 1) and s.w2.shape == (6, 1, 1) for s in scales)
    else:  # per channel, layers 2 and 3 per tensor: every row of an expert's projection has its scale
        assert all(s.block is None and s.w13.shape == (6, 64) and s.w2.shape == (6, 64) for s in scales)
        assert [e.method.scheme.weight for e in experts] == ["channel", "channel", "tensor", "tensor"]
        tensors = read_checkpoint_tensors(moe_ckpts.get(case))
        s13 = scales[2].w13
        for e in range(6):
            if case == "ct_fused":  # one scale per expert for gate and up together
                one = tensors["model.layers.2.mlp.experts.gate_up_proj_scale"][e]
                assert torch.equal(s13[e], one.expand(64))
                continue
            gate = tensors[f"model.layers.2.mlp.experts.{e}.gate_proj.weight_scale"]
            up = tensors[f"model.layers.2.mlp.experts.{e}.up_proj.weight_scale"]
            assert gate.shape == (1,) and torch.equal(s13[e], torch.cat([gate.expand(32), up.expand(32)]))
    for block in (m for m in runner.model.modules() if hasattr(m, "shared_expert_gate")):
        assert block.gate.weight.dtype == torch.float32 and block.shared_expert_gate.weight.dtype == torch.float32
        assert block.shared_expert.down_proj.weight.dtype == FP8
    assert all(e.gate_up_proj.dtype == FP8 for e in _experts(runner.mtp))
    assert llm.get_metrics()["hyserve:spec_decode_num_draft_tokens"] > 0


@pytest.mark.parametrize("layout", ["fused", "per_expert"])
def test_online_fp8_quantizes_the_experts_per_channel(ckpts: CheckpointCache, layout: str) -> None:
    """``quantization="fp8"`` on a bf16 MoE checkpoint: experts (either layout, one expert at a time) and linear
    layers per output channel, router and shared-expert gate kept."""
    path = ckpts.get("causal", "gdn3_attn1", family=QWEN3_5_MOE.name, layout=layout, dtype=torch.bfloat16)
    llm = make_llm(path, max_num_batched_tokens=16, quantization="fp8")
    _check(llm, load_fp8_moe_reference(path, online=True))
    experts = _experts(llm.llm_engine.runner.model)
    assert all(e.gate_up_proj.dtype == FP8 and e.method.scheme.online for e in experts)
    w = stack_experts(read_checkpoint_tensors(path))["model.layers.0.mlp.experts.down_proj"].float()
    torch.testing.assert_close(experts[0].down_proj_scale, w.abs().amax(dim=-1) / 448)


@contextlib.contextmanager
def fp8_kv_emulated(ref: torch.nn.Module) -> Iterator[None]:
    """Within: ``ref`` attends to keys and values rounded to FP8 as the cache stores them (scale 1)."""
    original = modeling_qwen3_5_moe.apply_rotary_pos_emb

    def rnd(x: torch.Tensor) -> torch.Tensor:
        return x.clamp(-448, 448).to(FP8).to(x.dtype)

    def rope(q, k, *args, **kwargs):  # type: ignore[no-untyped-def]
        q, k = original(q, k, *args, **kwargs)
        return q, rnd(k)

    hooks = [m.register_forward_hook(lambda mod, inp, out: rnd(out))
             for name, m in ref.named_modules() if name.endswith("self_attn.v_proj")]
    modeling_qwen3_5_moe.apply_rotary_pos_emb = rope
    try:
        yield
    finally:
        modeling_qwen3_5_moe.apply_rotary_pos_emb = original
        for h in hooks:
            h.remove()


def test_fp8_kv_prefix_caching_mtp_and_async_compose(moe_ckpts: Checkpoints, plant_drafts: Any) -> None:
    """FP8 experts with an FP8 KV cache: the plain run matches the reference with both quantizations emulated; with
    prefix caching, MTP (planted drafts, some accepted) and async scheduling the tokens are the plain run's."""
    path = moe_ckpts.get("block_fused")
    ref = moe_ckpts.reference("block_fused")
    arrivals = prefix_sharing_arrivals(GREEDY)
    plain = drive(make_llm(path, **FP8_KV).llm_engine, arrivals)
    prompts = {rid: prompt for batch in arrivals.values() for rid, prompt, _ in batch}
    with fp8_kv_emulated(ref):
        assert_close_to_reference(ref, [(prompts[rid], out) for rid, out in plain.items()])
    assert_fp8_kv_features_compose(path, arrivals, plain, plant_drafts, MTP)


def test_the_kv_check_sees_an_unquantized_cache(moe_ckpts: Checkpoints) -> None:
    """The emulated FP8 KV reference is one a float32 cache does not match (the check above has teeth)."""
    ref = moe_ckpts.reference("block_fused")
    llm = make_llm(moe_ckpts.get("block_fused"), max_num_batched_tokens=32)
    prompt = random_prompts(1, [53], seed=1)[0]
    out = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    with fp8_kv_emulated(ref), pytest.raises(AssertionError, match=r"log-prob differences|reference argmax"):
        assert_close_to_reference(ref, [(prompt, out)])


def test_tensor_and_expert_parallel_2_match_the_reference(moe_ckpts: Checkpoints) -> None:
    """Two gloo ranks: each expert's intermediate slice (per-channel scales with their rows, per-tensor ones
    expanded), then whole experts (expert parallel); the MTP head's experts too. A rank quantizes its slice of the
    ``down`` input per token (the reference emulates it); under expert parallelism the whole input."""
    for ep in (False, True):
        llm = make_llm(moe_ckpts.get("ct_per_expert"), tensor_parallel_size=2, enable_expert_parallel=ep,
                       max_num_batched_tokens=16, speculative_config=MTP)
        _check(llm, moe_ckpts.reference("ct_per_expert", 2, ep))
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("case,ep", [("block_tp", False), ("block_tp_fused", False), ("block_tp", True)])
def test_each_rank_holds_its_slice_of_the_block_fp8_experts(moe_ckpts: Checkpoints, monkeypatch: pytest.MonkeyPatch,
                                                            case: str, ep: bool) -> None:
    """Both ranks of two, built here: the experts of layer 1 dequantized with the scales the rank loaded are exactly
    its rows of gate and up and its columns of down of the checkpoint's dequantized experts (expert parallel: its
    experts whole)."""
    path = moe_ckpts.get(case)
    tensors = read_checkpoint_tensors(path)
    prefix = "model.layers.1.mlp.experts"
    mine = {n[len(prefix) + 1:]: t for n, t in tensors.items() if n.startswith(prefix + ".")}
    if CASES[case]["layout"] == "fused":
        full13, full2 = (dequantize_stacked(tensors, f"{prefix}.{n}") for n in ("gate_up_proj", "down_proj"))
    else:
        plain = {n: dequantize(tensors, n.removesuffix(".weight")) for n in tensors
                 if n.startswith(prefix) and n.endswith(".weight")}
        stacked = stack_experts(plain)
        full13, full2 = stacked[f"{prefix}.gate_up_proj"], stacked[f"{prefix}.down_proj"]
    quant = load_model_config(path).quantization
    monkeypatch.setattr(parallel_state, "_TP_SIZE", 2)
    monkeypatch.setattr(parallel_state, "_EXPERT_PARALLEL", ep)
    for rank in (0, 1):
        monkeypatch.setattr(parallel_state, "_TP_RANK", rank)
        ex = Experts(6, 64, 256, quant, prefix)
        targets = {**dict(ex.named_parameters()), **{n: v for n, (_, v) in ex.checkpoint_parts().items()}}
        for name, t in mine.items():
            if name not in ex.foreign_parts():
                copy_into(targets[name], t)
        s = ex.method.scales(ex)
        got13, got2 = (dequantize_experts(w, sc, s.block) for w, sc in ((ex.gate_up_proj, s.w13),
                                                                        (ex.down_proj, s.w2)))
        if ep:
            want13, want2 = full13[3 * rank : 3 * rank + 3], full2[3 * rank : 3 * rank + 3]
        else:
            i = slice(128 * rank, 128 * rank + 128)
            want13 = torch.cat([full13[:, i], full13[:, 256:][:, i]], dim=1)
            want2 = full2[:, :, i]
        assert torch.equal(got13, want13) and torch.equal(got2, want2)


def test_dummy_weights_with_an_fp8_config(moe_ckpts: Checkpoints, tmp_path: Path) -> None:
    """``load_format="dummy"`` from a config.json holding the FP8 quantization_config (per channel and per tensor
    groups): FP8 experts with their scales, one process and expert parallel on two ranks giving the same tokens."""
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(os.path.join(moe_ckpts.get("ct_per_expert"), "config.json"), bare / "config.json")
    outs = []
    for tp, ep in ((1, False), (2, True)):
        llm = make_llm(str(bare), load_format="dummy", seed=0, tensor_parallel_size=tp, enable_expert_parallel=ep)
        if tp == 1:
            experts = _experts(llm.llm_engine.runner.model)
            assert experts and all(e.gate_up_proj.dtype == FP8 for e in experts)
            assert all(float(e.method.scales(e).w13.min()) == pytest.approx(1e-3) for e in experts)
            assert float(experts[0].gate_up_proj.float().std()) > 0.1
        got = llm.generate([{"prompt_token_ids": p} for p in random_prompts(2, [5, 12], seed=2)], GREEDY,
                           use_tqdm=False)
        outs.append([o.outputs[0].token_ids for o in got])
        llm.llm_engine.shutdown()
    assert outs[0] == outs[1]


# ------------------------------------------------------------------------------------------------ sabotage


def test_a_per_tensor_scale_not_expanded_to_its_rows_is_caught(moe_ckpts: Checkpoints,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage: an expert's per-tensor scale written into its first row only (the other rows keep what the
    allocation held, here zeros): the reference check fails."""

    def first_row_only(target: torch.Tensor, scale: torch.Tensor) -> None:
        target.zero_()
        target[:1].copy_(scale.reshape(1, 1))

    monkeypatch.setattr(experts_method, "fill_rows", first_row_only)
    llm = make_llm(moe_ckpts.get("ct_per_expert"), max_num_batched_tokens=16)
    with pytest.raises(AssertionError, match=r"logprob|reference argmax"):
        _check(llm, moe_ckpts.reference("ct_per_expert"))


# ------------------------------------------------------------------------------------------------ refusals


def test_block_slices_off_the_block_grid_are_refused(moe_ckpts: Checkpoints, monkeypatch: pytest.MonkeyPatch) -> None:
    quant = load_model_config(moe_ckpts.get("block_fused")).quantization
    monkeypatch.setattr(parallel_state, "_TP_SIZE", 2)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts: block FP8 experts need each rank's "
                                         r"slice of the intermediate size 128 to be whole 128x128 blocks.*this "
                                         r"rank's slice is \[0, 64\); use a --tensor-parallel-size.*"
                                         r"--enable-expert-parallel"):
        Experts(6, 64, 128, quant, "model.layers.0.mlp.experts")
    monkeypatch.setattr(parallel_state, "_EXPERT_PARALLEL", True)  # whole experts: fine
    assert Experts(6, 64, 128, quant, "model.layers.0.mlp.experts").gate_up_proj.shape == (3, 256, 64)


def test_static_input_scales_and_unalike_experts_are_refused() -> None:
    static = parse_quantization_config({"quantization_config": quantization_config("ct_static", [])},
                                       "Qwen3_5MoeForCausalLM")
    assert static is not None
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts: FP8 experts with static per-tensor input "
                                         r"scales .* are not supported"):
        experts_method.experts_method_for(static, "model.layers.0.mlp.experts", 6)
    unalike = parse_quantization_config({"quantization_config": quantization_config(
        "ct_dynamic", ["model.layers.0.mlp.experts.3.down_proj"])}, "Qwen3_5MoeForCausalLM")
    assert unalike is not None
    with pytest.raises(ValueError, match=r"experts' projections are quantized differently"):
        experts_method.experts_method_for(unalike, "model.layers.0.mlp.experts", 6)
    assert experts_method.experts_method_for(unalike, "model.layers.1.mlp.experts", 6).quantized


def test_a_missing_expert_scale_is_named(moe_ckpts: Checkpoints, tmp_path: Path) -> None:
    from safetensors.torch import save_file

    path = str(tmp_path / "c")
    shutil.copytree(moe_ckpts.get("block_per_expert"), path)
    tensors = read_checkpoint_tensors(path)
    del tensors["model.layers.1.mlp.experts.2.up_proj.weight_scale_inv"]
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensor.*model\.layers\.1\.mlp\.experts\.2\.up_proj\."
                                         r"weight_scale_inv"):
        make_llm(path)


def test_linear_layers_of_the_moe_model_are_fp8(moe_ckpts: Checkpoints, caplog: pytest.LogCaptureFixture) -> None:
    """The dense projections (attention, GDN, shared expert) are FP8 as in the dense model; the ignore list's
    GDN in_proj_a / in_proj_b, the routers and shared-expert gates stay float32; the startup log counts the FP8
    experts' layers and bytes."""
    with caplog.at_level("INFO", logger="hyserve"):
        llm = make_llm(moe_ckpts.get("block_fused"))
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("quantization:"))
    tensors = {k: v for k, v in read_checkpoint_tensors(moe_ckpts.get("block_fused")).items() if k.startswith("model.")}
    fp8_bytes = sum(t.numel() for t in tensors.values() if t.dtype == FP8)
    assert "25 linear layers in FP8, 14 kept in float32" in line and "the experts of 4 MoE layers in FP8" in line
    assert f"FP8 weights {fp8_bytes / 2**20:.2f} MiB" in line
    layers = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, LinearBase)]
    fp8 = {m.part_name(p): m.weight.dtype == FP8 for m in layers for p in m.parts}
    assert all(v != n.endswith(("in_proj_a", "in_proj_b", "mlp.gate", "shared_expert_gate")) for n, v in fp8.items())


# ------------------------------------------------------------------------------------------------ Triton path

# Run under TRITON_INTERPRET=1 in a subprocess: each loaded checkpoint's FP8 experts (their scales as the loader
# leaves them: stacked views, channel or block) through the fused Triton kernels and through the reference.
INTERPRETER_CHECK = """
import json, sys
import torch
from hyserve.testing.triton_interpreter import patch_triton_interpreter
patch_triton_interpreter()
from hyserve.kernels.moe import fused_experts_ref
from hyserve.layers.moe import Experts, route
from hyserve.model.loader import load_weights
from hyserve.model.qwen3_5_moe import Qwen3_5MoeForCausalLM
from hyserve.model.registry import load_model_config
out = []
for path in sys.argv[1:]:
    cfg = load_model_config(path)
    model = Qwen3_5MoeForCausalLM(cfg).eval()
    load_weights(model, path, cfg)
    gen = torch.Generator().manual_seed(0)
    for ex in [m for m in model.modules() if isinstance(m, Experts)][:2]:
        x = torch.randn(9, 64, generator=gen)
        w, ids = route(torch.randn(9, 6, generator=gen), 2, True)
        with torch.no_grad():
            got = ex(x, w, ids)
            want = fused_experts_ref(x, ex.gate_up_proj, ex.down_proj, w, ids, 0, ex.method.scales(ex))
        out.append([float((got - want).abs().max()), float(want.abs().max())])
print(json.dumps(out))
"""


def test_the_triton_kernels_read_the_loaded_scales(moe_ckpts: Checkpoints) -> None:
    """The fused kernels (Triton interpreter) on the experts as loaded, block and per-channel/per-tensor, give the
    reference's routed sums: the scales' layout is the one the kernels read."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH",
                                                                                                       "")]))
    paths = [moe_ckpts.get("block_fused"), moe_ckpts.get("ct_per_expert")]
    proc = subprocess.run([sys.executable, "-c", INTERPRETER_CHECK, *paths], env=env, cwd=root, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 4 and all(err <= 1e-5 * top for err, top in results), results


# ------------------------------------------------------------------------------------------------ CUDA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", ["block_fused", "ct_per_expert"])
def test_cuda_experts_match_the_cpu_path(moe_ckpts: Checkpoints, case: str) -> None:
    """The checkpoint loaded onto CUDA (bf16 model: the fused Triton W8A8 kernels) against the same checkpoint on
    the CPU (the float32 reference path), expert layer by layer on the same bf16 inputs and routing: only the
    GEMMs' summation order and the bf16 rounding of ``silu(gate) * up`` and of the output differ."""
    from hyserve.layers.moe import route
    from hyserve.model.qwen3_5_moe import Qwen3_5MoeForCausalLM

    path = moe_ckpts.get(case)
    gpu = load_engine_model(Qwen3_5MoeForCausalLM, path, "cuda", torch.bfloat16)
    cpu = load_engine_model(Qwen3_5MoeForCausalLM, path)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for c, g in zip(_experts(cpu), _experts(gpu), strict=True):
            for tokens in (1, 7, 300):
                x = torch.randn(tokens, 64, generator=gen).bfloat16()
                weights, ids = route(torch.randn(tokens, 6, generator=gen), 2, True)
                want = c(x.float(), weights, ids)
                got = g(x.cuda(), weights.cuda(), ids.cuda()).float().cpu()
                # An activation whose bf16 rounding differs lands on the next FP8 value (6 % apart): a few outputs
                # move by up to that much of one term; the rest agree to the bf16 roundings. "A few": two, or one in
                # a thousand on the larger batches (on the H200 one output in 448 moved at 7 tokens).
                err, top = (got - want).abs(), float(want.abs().max())
                assert float(err.max()) <= 0.1 * top, (tokens, float(err.max()), top)
                outliers = int((err > 3e-2 * top).sum())
                assert outliers <= max(2, err.numel() // 1000), (tokens, outliers, err.numel())

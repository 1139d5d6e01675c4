"""FP8 (compressed-tensors) checkpoints of the Mamba2 families (issue 33 item 3): Nemotron-H (Mamba2, attention,
MLP and MoE blocks with per-expert experts), Granite-4.0-H (fused experts ``input_linear`` / ``output_linear`` with
[E, N, 1] scales, as llm-compressor's Granite-4 recipe saves them) and Falcon-H1, quantized from the tiny float
checkpoints with their releases' ``ignore`` lists (``hyserve.testing.fp8_mamba2``).

The yardstick is each family's transformers model holding the dequantized weights, every FP8 layer's input
quantized to FP8 and back (float32, CPU, teacher-forced). Requantizing every layer's input turns float32
differences of order 1e-7 (a chunked prefill's scan order, measured: layer outputs agree to 2e-6 before) into whole
e4m3 steps wherever a value straddles a rounding boundary, so these use tests/model/test_fp8.py's tolerances
(mean |log-prob difference| <= 0.15, max <= 1.5, the reference's argmax where its top two logits are more than 0.5
apart). Also: modules in ``ignore`` stay in the model dtype (NVIDIA's attention and adjacent Mamba layers;
Granite's experts), block FP8, sabotages caught (an expert's scale given to another; a module quantized that the
config's ``ignore`` names), and the refusals (modelopt's format; Granite experts left bf16 that the config targets).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from hyserve import SamplingParams
from hyserve.kernels.fp8 import FP8_DTYPE
from hyserve.layers.linear import LinearBase
from hyserve.testing.engine import SlotRecorder, drive, make_llm, random_prompts
from hyserve.testing.fp8 import assert_close_to_fp8_reference
from hyserve.testing.fp8_mamba2 import (
    FALCON_H1,
    GRANITE_H,
    NEMOTRON_H,
    RELEASE_IGNORE,
    load_fp8_mamba2_reference,
    write_fp8_mamba2_checkpoint,
)
from hyserve.testing.nemotron_h import NEMOTRON_H_PATTERNS
from hyserve.testing.scenarios import assert_same_outputs, scenario, scenario_engine
from hyserve.testing.speculative import OracleProposer

MEAN_TOL, MAX_TOL, MARGIN = 0.15, 1.5, 0.5  # tests/model/test_fp8.py's
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
PROMPTS = random_prompts(4, [9, 30, 17, 23], seed=5)
NEMOTRON_MOE = NEMOTRON_H_PATTERNS["moe"]  # M E * M E
# NVIDIA's FP8 recipe keeps attention and the Mamba layers beside it in bf16 (docs/fp8_facts.md section 11).
NVIDIA_LIKE = [*RELEASE_IGNORE[NEMOTRON_H], r"re:.*mixer\.[qkvo]_proj$",
               r"re:backbone\.layers\.3\.mixer\.(in|out)_proj$"]
CASES: dict[str, dict[str, Any]] = {
    "nemotron_h": dict(family=NEMOTRON_H, layer_types=NEMOTRON_MOE),
    "granite": dict(family=GRANITE_H),
    "falcon_h1": dict(family=FALCON_H1),
    "nemotron_h_block": dict(family=NEMOTRON_H, fmt="ct_block", layer_types=NEMOTRON_MOE),
    "nemotron_h_nvidia_ignore": dict(family=NEMOTRON_H, layer_types=NEMOTRON_MOE, ignore=NVIDIA_LIKE),
    # llm-compressor's Granite-4 variant that skips the whole MoE block
    "granite_moe_ignored": dict(family=GRANITE_H, ignore=["re:.*lm_head", "re:.*block_sparse_moe"]),
}


class Checkpoints:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.paths: dict[str, str] = {}
        self.refs: dict[str, Any] = {}

    def get(self, case: str) -> str:
        if case not in self.paths:
            kw = dict(CASES[case])
            family = kw.pop("family")
            self.paths[case] = write_fp8_mamba2_checkpoint(self.root / case, family, kw.pop("fmt", "ct_dynamic"),
                                                           seed=3, **kw)
        return self.paths[case]

    def reference(self, case: str) -> Any:
        if case not in self.refs:
            self.refs[case] = load_fp8_mamba2_reference(self.get(case), CASES[case]["family"])
        return self.refs[case]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("fp8_mamba2"))


def _check(llm: Any, ref: Any) -> None:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert_close_to_fp8_reference(ref, list(zip(PROMPTS, outs, strict=True)), MEAN_TOL, MAX_TOL, MARGIN, min_clear=6)


def _methods(model: torch.nn.Module) -> dict[str, bool]:
    """Linear layer name -> quantized."""
    return {n: m.method.quantized for n, m in model.named_modules() if isinstance(m, LinearBase)}


@pytest.mark.parametrize("case", ["nemotron_h", "granite", "falcon_h1", "nemotron_h_block"])
def test_greedy_matches_the_fp8_reference(ckpts: Checkpoints, case: str) -> None:
    llm = make_llm(ckpts.get(case), max_num_batched_tokens=16)
    model = llm.llm_engine.runner.model
    quantized = _methods(model)
    mamba = [n for n in quantized if n.endswith(("mixer.in_proj", "mamba.in_proj", "mixer.out_proj", "mamba.out_proj"))]
    assert mamba and all(quantized[n] for n in mamba)
    assert not any(quantized[n] for n in quantized if "router" in n)
    for name, p in model.named_parameters():
        if "conv1d" in name or "norm" in name or "embed" in name or name.endswith(".gate.weight"):
            assert p.dtype != FP8_DTYPE, name
    experts = [p for n, p in model.named_parameters() if n.endswith(("experts.up_proj", "experts.gate_up_proj"))]
    assert all(p.dtype == FP8_DTYPE for p in experts) and (experts or case == "falcon_h1")
    _check(llm, ckpts.reference(case))


def test_ignored_modules_stay_unquantized(ckpts: Checkpoints) -> None:
    """NVIDIA's kind of list (attention and the Mamba2 layer beside it in bf16), and Granite's MoE block ignored:
    those layers keep the model dtype (Granite's experts too), the rest is FP8, and both match their reference."""
    llm = make_llm(ckpts.get("nemotron_h_nvidia_ignore"), max_num_batched_tokens=16)
    quantized = _methods(llm.llm_engine.runner.model)
    kept = {n for n, q in quantized.items() if not q}
    assert kept == {f"backbone.layers.2.mixer.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")} | \
        {"backbone.layers.3.mixer.in_proj", "backbone.layers.3.mixer.out_proj"}, kept
    assert quantized["backbone.layers.0.mixer.in_proj"]
    _check(llm, ckpts.reference("nemotron_h_nvidia_ignore"))

    llm = make_llm(ckpts.get("granite_moe_ignored"), max_num_batched_tokens=16)
    model = llm.llm_engine.runner.model
    assert all(_methods(model)[n] for n in _methods(model) if "router" not in n)
    experts = [p for n, p in model.named_parameters() if n.endswith("experts.gate_up_proj")]
    assert experts and all(p.dtype == torch.float32 for p in experts)
    _check(llm, ckpts.reference("granite_moe_ignored"))


@pytest.mark.parametrize("case", ["nemotron_h", "granite"])
def test_an_expert_scale_given_to_another_expert_is_caught(ckpts: Checkpoints, case: str) -> None:
    llm = make_llm(ckpts.get(case), max_num_batched_tokens=16)
    model = llm.llm_engine.runner.model
    name = "experts.up_proj_scale" if case == "nemotron_h" else "experts.gate_up_proj_scale"
    scales = [p for n, p in model.named_parameters() if n.endswith(name)]
    assert scales
    with torch.no_grad():
        for s in scales:  # every expert takes its neighbour's scales
            s.copy_(s.roll(1, dims=0))
    with pytest.raises(AssertionError, match=r"log-prob differences|reference argmax"):
        _check(llm, ckpts.reference(case))


def test_scheduling_scenario_on_fp8_nemotron_h(ckpts: Checkpoints) -> None:
    """The scheduling scenario (staggered arrivals sharing prefixes so the Mamba2 snapshots hit, chunked prefill,
    an abort, preemption) on the FP8 Nemotron-H checkpoint (Mamba2, MoE and attention blocks): run plainly it matches
    the FP8 reference; with n-gram drafts accepted and rejected, async scheduling and rows on other slots it gives
    the plain run's outputs."""
    path = ckpts.get("nemotron_h")
    arrivals, aborts, prompts = scenario(path)
    engine = scenario_engine(path, "plain")
    plain = drive(engine, arrivals, aborts)
    engine.assert_no_leaks()
    metrics = engine.get_metrics()
    assert metrics["hyserve:num_preemptions"] > 0 and metrics["hyserve:prefix_cache_hits"] > 0  # type: ignore[operator]
    assert "c" not in plain  # aborted
    greedy = [(prompts[r], o) for r, o in plain.items() if r != "d"]  # d is sampled
    assert_close_to_fp8_reference(ckpts.reference("nemotron_h"), greedy, MEAN_TOL, MAX_TOL, MARGIN, min_clear=6)

    engine = scenario_engine(path, "ngram", async_scheduling=True)
    slots = SlotRecorder(engine)
    conts = {rid: out.outputs[0].token_ids for rid, out in plain.items() if rid != "d"}
    engine.proposer = OracleProposer({"c": [], "d": [], **conts}, {rid: [0, 3, 1, 2] for rid in conts}, vocab=440)
    got = drive(engine, arrivals, aborts)
    engine.assert_no_leaks()
    assert slots.saw_non_identity()
    assert set(got) == set(plain)
    assert_same_outputs({r: o for r, o in got.items() if r != "d"}, {r: o for r, o in plain.items() if r != "d"})
    metrics = engine.get_metrics()
    accepted = metrics["hyserve:spec_decode_num_accepted_tokens"]
    drafted = metrics["hyserve:spec_decode_num_draft_tokens"]
    assert 0 < accepted < drafted  # type: ignore[operator]


def _set_config(path: str, edit: Any) -> None:
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path, encoding="utf-8") as f:
        raw = json.load(f)
    edit(raw)
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(raw, f)


def test_a_quantized_module_the_config_ignores_is_refused(tmp_path: Path) -> None:
    """The checkpoint's attention is FP8 but its config lists it in ``ignore``: refused at load, naming it."""
    path = write_fp8_mamba2_checkpoint(tmp_path / "ckpt", NEMOTRON_H, layer_types=NEMOTRON_H_PATTERNS["m_attn_m_mlp"])
    _set_config(path, lambda raw: raw["quantization_config"]["ignore"].append(r"re:.*mixer\.[qkvo]_proj$"))
    with pytest.raises(ValueError, match=r"backbone\.layers\.1\.mixer\.[qkvo]_proj\.weight is FP8"):
        make_llm(path)


def test_granite_experts_left_unquantized_but_targeted_are_refused(tmp_path: Path) -> None:
    """A Granite checkpoint quantized without linearizing the experts (bf16 ``input_linear``) under a config whose
    ``Linear`` target names them: refused, pointing at the ignore list."""
    path = write_fp8_mamba2_checkpoint(tmp_path / "ckpt", GRANITE_H,
                                       ignore=["re:.*lm_head", "re:.*block_sparse_moe"])
    _set_config(path, lambda raw: raw["quantization_config"].update(ignore=["re:.*lm_head",
                                                                            "re:.*block_sparse_moe.router"]))
    with pytest.raises(ValueError, match=r"input_linear\.weight is F32 in the checkpoint.*ignore"):
        make_llm(path)


def test_online_fp8_quantizes_granite_experts_as_they_load(tmp_path: Path) -> None:
    """``quantization="fp8"`` on a float Granite-4.0-H checkpoint (once refused): every linear layer but the router
    and the fused experts per channel, at load (the online experts' numbers: tests/model/test_fp8_moe.py)."""
    from hyserve.testing.granitemoehybrid import write_tiny_granitemoehybrid_checkpoint

    path = write_tiny_granitemoehybrid_checkpoint(tmp_path / "ckpt", seed=3)
    llm = make_llm(path, quantization="fp8", max_num_batched_tokens=16)
    model = llm.llm_engine.runner.model
    assert all(q for n, q in _methods(model).items() if "router" not in n)
    assert all(p.dtype == FP8_DTYPE for n, p in model.named_parameters() if n.endswith("experts.gate_up_proj"))
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:1]], GREEDY, use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == GREEDY.max_tokens


def test_modelopt_fp8_is_refused_by_name(tmp_path: Path) -> None:
    """NVIDIA's own FP8 releases of Nemotron-H are ModelOpt checkpoints (``quant_method: modelopt``): refused,
    naming the format and what is supported."""
    path = write_fp8_mamba2_checkpoint(tmp_path / "ckpt", NEMOTRON_H, layer_types=NEMOTRON_H_PATTERNS["m_attn_m_mlp"])
    _set_config(path, lambda raw: raw.update(quantization_config={"quant_method": "modelopt", "quant_algo": "FP8"}))
    with pytest.raises(ValueError, match=r"unsupported quant_method 'modelopt'.*compressed-tensors"):
        make_llm(path)

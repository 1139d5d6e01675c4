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
config's ``ignore`` names), and the refusals (Granite experts left bf16 that the config targets). NVIDIA ModelOpt FP8
(static per-tensor input scales, ``exclude_modules`` wildcards, ``hf_quant_config.json``): against the reference with
each layer's input quantized with its ``input_scale``; input scales given to other layers are caught; other
``quant_algo`` values are refused by name. ModelOpt FP8 experts (Nemotron 3's releases): every expert's own weight
scale, the activations quantized with the maximum over the layer's experts of their ``up_proj`` / ``down_proj``
input scales (as vLLM does), on the CPU path (and on the fused kernels under the interpreter:
tests/kernels/test_moe_engine.py); an expert's own scale in place of the maximum and the ``down`` scale used for
``up`` are caught, and a checkpoint lacking experts' input scales is refused naming them.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from hyserve import SamplingParams
from hyserve.kernels.fp8 import FP8_DTYPE
from hyserve.layers.linear import LinearBase
from hyserve.model.base import KVCacheLayer
from hyserve.model.loader import finish_loading
from hyserve.testing.engine import SlotRecorder, drive, make_llm, random_prompts
from hyserve.testing.files import read_checkpoint_tensors
from hyserve.testing.fp8 import assert_close_to_fp8_reference
from hyserve.testing.fp8_mamba2 import (
    FALCON_H1,
    GRANITE_H,
    NEMOTRON_H,
    RELEASE_IGNORE,
    load_fp8_mamba2_reference,
    write_fp8_mamba2_checkpoint,
)
from hyserve.testing.fp8_mamba2 import MODELOPT_EXCLUDE as MODELOPT_DEFAULT
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
    """Linear layer name (the checkpoint's: each part of a merged GEMM by its own) -> quantized."""
    return {m.part_name(p): m.method.quantized for m in model.modules() if isinstance(m, LinearBase) for p in m.parts}


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


# NVIDIA ModelOpt FP8 (NVIDIA's own Nemotron-H / Nemotron 3 FP8 releases): per-tensor weight scales and static
# input scales; exclude_modules as fnmatch wildcards: the head, the conv, the experts (as some lists do; FP8 experts:
# the ``modelopt_experts`` checkpoint below), and, by wildcard, the Mamba2 layer 3 (``backbone.layers.3.mixer.*``:
# its in_proj and out_proj stay in the model dtype).
MODELOPT_EXCLUDE = [*MODELOPT_DEFAULT, "*mixer.experts.*", "backbone.layers.3.mixer.*"]


@pytest.fixture(scope="module")
def modelopt(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    path = write_fp8_mamba2_checkpoint(tmp_path_factory.mktemp("modelopt") / "ckpt", NEMOTRON_H, "modelopt",
                                       ignore=MODELOPT_EXCLUDE, layer_types=NEMOTRON_MOE, seed=3, kv_scales=True)
    return path, load_fp8_mamba2_reference(path, NEMOTRON_H)


def test_modelopt_fp8_matches_the_static_fp8_reference(modelopt: tuple[str, Any]) -> None:
    """A ModelOpt FP8 Nemotron-H checkpoint: every linear layer that exclude_modules does not name is FP8 with its
    static input scale (against transformers with the weights dequantized and each FP8 layer's input quantized with
    the checkpoint's ``input_scale``); the wildcard-excluded Mamba2 layer and the experts stay in the model dtype;
    the attention's ``k_proj.k_scale`` / ``v_proj.v_scale`` are read (and not used with the default cache dtype)."""
    path, ref = modelopt
    llm = make_llm(path, max_num_batched_tokens=16)
    model = llm.llm_engine.runner.model
    quantized = _methods(model)
    kept = {n for n, q in quantized.items() if not q}
    assert kept == {"backbone.layers.3.mixer.in_proj", "backbone.layers.3.mixer.out_proj"}, kept
    assert quantized["backbone.layers.0.mixer.in_proj"] and quantized["backbone.layers.2.mixer.k_proj"]
    statics = [m for m in model.modules() if isinstance(m, LinearBase) and hasattr(m, "input_scale")]
    assert statics and {m.part_name(p) for m in statics for p in m.parts} == {n for n, q in quantized.items() if q}
    experts = [p for n, p in model.named_parameters() if n.endswith("experts.up_proj")]
    assert experts and all(p.dtype == torch.float32 for p in experts)
    tensors = read_checkpoint_tensors(path)
    attn = {n: m for n, m in model.named_modules() if isinstance(m, KVCacheLayer)}
    assert list(attn) == ["backbone.layers.2.mixer"] and attn["backbone.layers.2.mixer"].k_scale is None
    _check(llm, ref)

    fp8_cache = make_llm(path, max_num_batched_tokens=16, kv_cache_dtype="fp8").llm_engine.runner.model
    layer = fp8_cache.get_submodule("backbone.layers.2.mixer")
    for which in "kv":
        got = getattr(layer, f"{which}_scale").float().cpu().reshape(-1)
        want = tensors[f"backbone.layers.2.mixer.{which}_proj.{which}_scale"].float().reshape(-1)
        assert torch.equal(got, want.expand_as(got)), (which, got, want)

    with torch.no_grad():  # sabotage: every static layer takes another layer's input scale
        maxes = [m.input_scale_max for m in statics]
        values = [t.clone() for t in maxes]
        for t, v in zip(maxes, values[1:] + values[:1], strict=True):
            t.copy_(v)
    with pytest.raises(AssertionError, match=r"log-prob differences|reference argmax"):
        _check(llm, ref)


def test_modelopt_config_forms_and_refusals(modelopt: tuple[str, Any], tmp_path: Path) -> None:
    """hf_quant_config.json (older ModelOpt checkpoints) parses as config.json's quantization_config does; another
    quant_algo or kv_cache_quant_algo and unknown fields are refused by name."""
    from hyserve.layers.quantization.modelopt import ModelOptFp8Config
    from hyserve.model.registry import load_model_config

    path, _ = modelopt
    expected = load_model_config(path).quantization
    assert isinstance(expected, ModelOptFp8Config) and expected.kv_cache_quant_algo == "FP8"
    older = tmp_path / "older"
    shutil.copytree(path, older)
    qc = _pop_config(str(older))
    with open(older / "hf_quant_config.json", "w", encoding="utf-8") as f:
        json.dump({"producer": qc.pop("producer"), "quantization": {k: v for k, v in qc.items()
                                                                    if k != "quant_method"}}, f)
    assert load_model_config(str(older)).quantization == expected

    for edit, match in [
        (dict(quant_algo="NVFP4"), r"ModelOpt quant_algo 'NVFP4' is not supported; supported: 'FP8'"),
        (dict(quant_algo="FP8_PB_WO"), r"ModelOpt quant_algo 'FP8_PB_WO' is not supported"),
        (dict(kv_cache_quant_algo="NVFP4"), r"kv_cache_quant_algo 'NVFP4' is not supported"),
        (dict(group_size=16), r"unsupported field\(s\) 'group_size'"),
    ]:
        bad = tmp_path / f"bad_{len(os.listdir(tmp_path))}"
        shutil.copytree(path, bad)
        _set_config(str(bad), lambda raw, edit=edit: raw["quantization_config"].update(edit))
        with pytest.raises(ValueError, match=match):
            load_model_config(str(bad))



def _pop_config(path: str) -> dict[str, Any]:
    popped: dict[str, Any] = {}
    _set_config(path, lambda raw: popped.update(raw.pop("quantization_config")))
    return popped


@pytest.fixture(scope="module")
def modelopt_experts(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    """The MoE pattern with FP8 experts (exclude_modules: the head and the conv alone, as NVIDIA's releases)."""
    path = write_fp8_mamba2_checkpoint(tmp_path_factory.mktemp("modelopt_experts") / "ckpt", NEMOTRON_H, "modelopt",
                                       layer_types=NEMOTRON_MOE, seed=3)
    return path, load_fp8_mamba2_reference(path, NEMOTRON_H)


def _expert_modules(model: torch.nn.Module) -> dict[str, Any]:
    return {n: m for n, m in model.named_modules() if n.endswith("mixer.experts")}


def _moe_block_error(model: torch.nn.Module, ref: Any, layer: int) -> float:
    """The MoE block ``layer``'s output against the reference's block on the same input (the reference's own input
    to it over two prompts), max |difference| / max |output|: one block, no requantization downstream, so a static
    scale's error is not lost in the end-to-end tolerances (the two compute the same FP8 numbers: 0 on the CPU path,
    the order of float32 sums on the kernels)."""
    captured: dict[str, torch.Tensor] = {}
    mixer = ref.model.layers[layer].mixer
    hook = mixer.register_forward_pre_hook(lambda _m, args: captured.setdefault("x", args[0].detach().clone()))
    with torch.no_grad():
        ref(input_ids=torch.tensor([PROMPTS[1] + PROMPTS[3]]), use_cache=False)
    hook.remove()
    x = captured["x"]
    with torch.no_grad():
        want = mixer(x)[0]
        got = model.get_submodule(f"backbone.layers.{layer}.mixer")(x[0])
    return float((got.float() - want).abs().max() / want.abs().max())


def test_modelopt_fp8_experts_match_the_static_fp8_reference(modelopt_experts: tuple[str, Any]) -> None:
    """ModelOpt FP8 experts: FP8 weights with each expert's own scale, the input to ``up`` quantized with the maximum
    over the layer's experts of their ``up_proj.input_scale`` and the activation before ``down`` with that of their
    ``down_proj.input_scale`` (the reference: transformers' dequantized experts quantizing with the same maxima),
    end to end and block by block; under ``TRITON_INTERPRET=1`` on the fused kernels
    (tests/kernels/test_moe_engine.py)."""
    path, ref = modelopt_experts
    llm = make_llm(path, max_num_batched_tokens=16)
    model = llm.llm_engine.runner.model
    assert all(_methods(model).values())
    experts = _expert_modules(model)
    assert list(experts) == ["backbone.layers.1.mixer.experts", "backbone.layers.4.mixer.experts"]
    tensors = read_checkpoint_tensors(path)
    for name, m in experts.items():
        assert m.up_proj.dtype == FP8_DTYPE and m.down_proj.dtype == FP8_DTYPE
        for proj in ("up_proj", "down_proj"):
            each = torch.stack([tensors[f"{name}.{e}.{proj}.input_scale"].float() for e in range(8)])
            assert len(set(each.tolist())) > 1  # the experts' scales differ: their maximum is a choice
            assert torch.equal(getattr(m, f"{proj}_input_scale").cpu(), each)
            assert torch.equal(getattr(m, f"{proj}_input_scale_max").cpu(), each.max().reshape(1))
            weight_scales = torch.stack([tensors[f"{name}.{e}.{proj}.weight_scale"].float() for e in range(8)])
            assert torch.equal(getattr(m, f"{proj}_scale")[:, 0].cpu(), weight_scales)  # each expert's own
    for layer in (1, 4):
        assert _moe_block_error(model, ref, layer) <= 1e-4
    _check(llm, ref)


def test_modelopt_fp8_experts_with_the_wrong_static_scale_are_caught(modelopt_experts: tuple[str, Any]) -> None:
    """Every MoE block quantizing with one expert's own scales (the first's, or the smallest) instead of the
    maxima, or ``up``'s input with ``down``'s scale: the block's output moves by percents (the test above allows
    1e-4)."""
    path, ref = modelopt_experts
    llm = make_llm(path, max_num_batched_tokens=16)
    model = llm.llm_engine.runner.model
    experts = _expert_modules(model)
    sabotages = {
        "the first expert's own": lambda m, proj: getattr(m, f"{proj}_input_scale")[0],
        "the smallest expert's own": lambda m, proj: getattr(m, f"{proj}_input_scale").min(),
        "down's for up": lambda m, proj: getattr(m, "down_proj_input_scale_max")[0],
    }
    for what, wrong in sabotages.items():
        with torch.no_grad():
            for m in experts.values():
                for proj in ("up_proj", "down_proj") if what != "down's for up" else ("up_proj",):
                    getattr(m, f"{proj}_input_scale_max").copy_(wrong(m, proj))
        for layer in (1, 4):
            assert _moe_block_error(model, ref, layer) > 1e-2, (what, layer)
        finish_loading(model)  # the maxima again
        assert _moe_block_error(model, ref, 1) <= 1e-4


def test_modelopt_experts_lacking_input_scales_are_refused(modelopt_experts: tuple[str, Any], tmp_path: Path) -> None:
    """One expert's ``input_scale`` missing, or every expert's: refused at load, naming the tensor."""
    path, _ = modelopt_experts
    tensors = read_checkpoint_tensors(path)
    cases = {
        "one": ({"backbone.layers.4.mixer.experts.5.down_proj.input_scale"},
                r"backbone\.layers\.4\.mixer\.experts\.5\.down_proj\.input_scale"),
        "all": ({n for n in tensors if ".experts." in n and n.endswith(".input_scale")},
                r"backbone\.layers\.1\.mixer\.experts\.0\.up_proj\.input_scale is missing.*ModelOpt FP8"),
    }
    for case, (dropped, match) in cases.items():
        bad = tmp_path / case
        shutil.copytree(path, bad)
        save_file({n: t for n, t in tensors.items() if n not in dropped}, str(bad / "model.safetensors"),
                  metadata={"format": "pt"})
        with pytest.raises(ValueError, match=match):
            make_llm(str(bad))

"""Issue 31's benchmark preparation on the CPU: the MoE shapes ``shapes.py`` writes config-only (Qwen3.5-35B-A3B in the
VLM form vLLM needs, Qwen3-Next-80B-A3B as its own config; bf16 and Qwen's block FP8) parse with hyserve's own parsers
and give the published sizes, and ``peer_bench.py``'s batch-1 bound counts the weights a token reads (attention,
GDN, router, shared expert, its top-k experts, the LM head) by hand on tiny configs, from config.json and from
checkpoints in both expert layouts; ``peer_bench.py measure`` runs hyserve on a config-only MoE shape (dummy
weights) as the session's moe phase does, and the session script has its MoE phases. The moe-agent and moe-spec
phases run with ``python3`` a recorder: their commands parse with the scripts' own parsers (both engines, vLLM in
its default mode, the same planted acceptance); ``spec_decode_bench.py --shared-engines`` plants drafts on a tiny
dummy-weight MoE shape; ``peer_bench.py moe-report`` makes one table of synthetic files of every phase.
``moe_check.py``'s float32 rule, on a tiny checkpoint's own greedy rows: router flips planted at near-ties are found
and explain the rows (one, or two combined; none above the gap threshold), rows from perturbed weights are not."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from hyserve.layers.quantization import parse_quantization_config
from hyserve.model.qwen3_5_moe_config import parse_qwen3_5_moe_config, qwen3_5_moe_config
from hyserve.model.qwen3_next_config import parse_qwen3_next_config
from hyserve.model.registry import load_model_config
from hyserve.testing.families import CheckpointCache
from hyserve.testing.qwen3_5_moe import QWEN3_5_MOE

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import moe_check
import peer_bench
import shapes

SESSION = Path(__file__).parents[2] / "benchmarks" / "peer_session.sh"


@pytest.mark.parametrize("name,fp8", [("35b-a3b", False), ("35b-a3b", True), ("next-80b", False), ("next-80b", True)])
def test_the_moe_shapes_parse_with_hyserves_parsers(tmp_path: Path, name: str, fp8: bool) -> None:
    """35B-A3B in the VLM form (Qwen3.5-MoE, its processor files beside it), Next-80B as Qwen3-Next's own text-only
    config; both the published sizes, and in FP8 the bf16 layers of Qwen's releases named in the checkpoint's form."""
    shapes.write_moe_config(str(tmp_path), name, fp8=fp8)
    raw = json.loads((tmp_path / "config.json").read_text())
    next_ = name == "next-80b"
    cfg = load_model_config(str(tmp_path))  # the registry's parser, and the quantization_config's
    assert cfg.quantization == parse_quantization_config(raw, cfg.architecture)
    if next_:
        assert raw["architectures"] == ["Qwen3NextForCausalLM"] and "vision_config" not in raw
        assert dataclasses.replace(cfg, quantization=None) == parse_qwen3_next_config(raw)
        assert cfg.multimodal is None
    else:
        for f in ("preprocessor_config.json", "video_preprocessor_config.json"):
            assert (tmp_path / f).is_file()
        assert raw["architectures"] == ["Qwen3_5MoeForConditionalGeneration"] and "vision_config" in raw
        assert dataclasses.replace(cfg, quantization=None) == parse_qwen3_5_moe_config(raw)
        assert cfg.multimodal is not None and cfg.multimodal.image_token_id < cfg.vocab_size
    moe = qwen3_5_moe_config(cfg)
    want = shapes.MOE_SHAPES[name]
    for key in ("num_hidden_layers", "hidden_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                "shared_expert_intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                "vocab_size"):
        assert getattr(moe, key) == want[key], key
    assert cfg.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * (cfg.num_hidden_layers // 4)
    assert cfg.mtp_num_hidden_layers == 1 and not cfg.tie_word_embeddings
    billions = moe.num_parameters() / 1e9
    assert 34 < billions < 36 if name == "35b-a3b" else 79 < billions < 81
    quant = cfg.quantization
    assert (quant is not None) == fp8
    if quant is None:
        return
    qc = raw["quantization_config"]
    assert (qc["quant_method"], qc["weight_block_size"], qc["activation_scheme"]) == ("fp8", [128, 128], "dynamic")
    gdn_kept = ["in_proj_ba"] if next_ else ["in_proj_a", "in_proj_b"]
    kept = ["lm_head", "model.layers.0.mlp.gate", "model.layers.0.mlp.shared_expert_gate", "mtp.layers.0.mlp.gate",
            "mtp.layers.0.mlp.shared_expert_gate", *(f"model.layers.0.linear_attn.{m}" for m in gdn_kept)]
    gdn_converted = ["in_proj_qkvz"] if next_ else ["in_proj_qkv", "in_proj_z"]
    converted = ["model.layers.0.linear_attn.out_proj", "model.layers.3.self_attn.q_proj",
                 "model.layers.3.self_attn.o_proj", "model.layers.5.mlp.shared_expert.down_proj",
                 "model.layers.5.mlp.experts", "mtp.fc", *(f"model.layers.0.linear_attn.{m}" for m in gdn_converted)]
    assert not any(quant.linear_method(n).quantized for n in kept)
    assert all(quant.linear_method(n).quantized for n in converted)
    if not next_:  # the vision tower, named as the checkpoint names it (vLLM builds it with the checkpoint's
        # quantization; hyserve keeps it unquantized whatever the config says)
        assert {"model.visual.blocks.0.attn.qkv", "model.visual.merger.linear_fc2"} <= set(qc["modules_to_not_convert"])


def hand_step_bytes(c: dict[str, Any], elem: int = 2, fp8: bool = False) -> int:
    """One batch-1 decode step's weight bytes of a Qwen3.5-MoE text config, by hand: attention and GDN layers, two
    norms a layer, the router, top-k of the experts, the shared expert and its gate, the final norm and the LM head
    (the input embedding not read). ``fp8``: the projections, shared expert and experts in block FP8 (a byte a
    weight, float32 scales per 128 x 128 block); the router, gates, GDN a / b, norms and LM head in bf16."""
    h, nh, nkv, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    nk, nv, dk, dv = (c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"],
                      c["linear_value_head_dim"])
    e, k, i, s, vocab = (c["num_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"],
                         c["shared_expert_intermediate_size"], c["vocab_size"])
    conv = 2 * nk * dk + nv * dv

    def mat(rows: int, cols: int) -> float:
        if not fp8:
            return rows * cols * elem
        return rows * cols + math.ceil(rows / 128) * math.ceil(cols / 128) * 4

    attention = mat(2 * nh * hd, h) + 2 * mat(nkv * hd, h) + mat(h, nh * hd) + 2 * hd * elem
    gdn = (mat(conv, h) + mat(nv * dv, h) + 2 * nv * h * elem + conv * c["linear_conv_kernel_dim"] * elem
           + 2 * nv * elem + dv * elem + mat(h, nv * dv))  # dt_bias, A_log, the output norm
    moe = e * h * elem + k * (2 * mat(i, h) + mat(h, i)) + 2 * mat(s, h) + mat(h, s) + h * elem
    n = c["num_hidden_layers"]
    n_attn = n // c.get("full_attention_interval", 4)
    total = n_attn * attention + (n - n_attn) * gdn + n * (moe + 2 * h * elem) + h * elem + vocab * h * elem
    return round(total)


TINY: dict[str, Any] = dict(
    shapes.SHAPE_35B_A3B, vocab_size=1024, hidden_size=256, num_hidden_layers=8, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
    linear_value_head_dim=64, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128,
    shared_expert_intermediate_size=256)


@pytest.mark.parametrize("fp8", [False, True])
def test_the_bound_counts_the_active_weights_from_config_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               fp8: bool) -> None:
    """A tiny Qwen3.5-MoE config (16 experts, top 4) as ``write_moe_config`` writes it: the dummy-load bound's bytes
    are the hand count, FP8 too (counted from the bf16 build while hyserve builds no FP8 experts)."""
    monkeypatch.setitem(shapes.MOE_SHAPES, "tiny-moe", TINY)
    shapes.write_moe_config(str(tmp_path), "tiny-moe", fp8=fp8)
    assert peer_bench.moe_active_share(str(tmp_path)) == 4 / 16
    got = peer_bench.weight_bytes_per_step(str(tmp_path), "dummy")
    assert got == hand_step_bytes(TINY, fp8=fp8)
    all_experts = hand_step_bytes(dict(TINY, num_experts_per_tok=16), fp8=fp8)
    assert all_experts - got == pytest.approx(12 * 8 * 3 * 128 * 256 * (1 if fp8 else 2), rel=0.02)


@pytest.mark.parametrize("layout", ["fused", "per_expert"])
def test_the_bound_counts_the_active_weights_of_a_checkpoint(ckpts: CheckpointCache, layout: str) -> None:
    """A tiny checkpoint (float32, 6 experts, top 3, an MTP layer that a step does not read) in either expert
    layout: the same hand count, at four bytes a weight."""
    path = ckpts.get("causal", "gdn3_attn1", family=QWEN3_5_MOE.name, layout=layout, num_experts_per_tok=3,
                     with_mtp=True)
    raw = json.loads((Path(path) / "config.json").read_text())
    got = peer_bench.weight_bytes_per_step(path)
    assert peer_bench.moe_active_share(path) == 3 / raw["num_experts"]
    layer_types = raw["layer_types"]
    n_attn = layer_types.count("full_attention")
    assert n_attn * 4 == len(layer_types)  # the hand count's 3 : 1 pattern
    assert got == hand_step_bytes(dict(raw, full_attention_interval=4), elem=4)


def test_the_session_has_the_moe_phases() -> None:
    text = SESSION.read_text()
    for phase in ("moe)", "moe-vllm)", "moe-check)", "moe-agent)", "moe-spec)"):
        assert f"\n  {phase}" in text, phase
    assert "tests/kernels/test_moe_kernels.py" in text and "moe_kernel_bench.py" in text
    import subprocess

    subprocess.run(["bash", "-n", str(SESSION)], check=True)


@pytest.mark.slow  # budget: a benchmark script; the MoE dummy-weight tests stay
def test_peer_bench_measures_a_config_only_moe_shape_on_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                 ) -> None:
    """The moe phase's command on a tiny MoE shape written as the real ones are (config only, VLM form): hyserve makes
    the weights at load and measures decode and prefill."""
    import subprocess

    monkeypatch.setitem(shapes.MOE_SHAPES, "tiny-moe", TINY)
    model, out = tmp_path / "m", tmp_path / "hyserve.json"
    shapes.write_moe_config(str(model), "tiny-moe")
    script = Path(__file__).parents[2] / "benchmarks" / "peer_bench.py"
    subprocess.run([sys.executable, str(script), "measure", "--engine", "hyserve", "--model", str(model), "--device",
                    "cpu", "--dtype", "float32", "--out", str(out), "--measures", "decode,bound,prefill",
                    "--load-format", "dummy", "--batches", "1,2", "--decode-tokens", "12", "--decode-prompt-len", "16",
                    "--prefill-prompts", "2",
                    "--prefill-len", "64", "--max-model-len", "1024"], check=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True)
    res = json.loads(out.read_text())
    assert not res["errors"] and res["figures"]["decode_bs1_tok_s"] > 0 and res["figures"]["prefill_tok_s"] > 0


# ------------------------------------------------------------------------------ the agent trace and MTP phases

FAKE_PYTHON = """#!/usr/bin/env bash
# records each call: the engine-core mode variable, then the arguments, NUL-separated, one call a line
printf '%s' "VLLM_MP=${VLLM_ENABLE_V1_MULTIPROCESSING-unset}" >> "$CALLS"
for a in "$@"; do printf '\\0%s' "$a" >> "$CALLS"; done
printf '\\n' >> "$CALLS"
"""


def run_phase(tmp_path: Path, *phase: str) -> list[tuple[str, list[str]]]:
    """``peer_session.sh PHASE...`` with ``python3`` a recorder: each python call's mode variable and arguments."""
    import subprocess

    bin_dir, out, calls = tmp_path / "bin", tmp_path / "out", tmp_path / "calls"
    bin_dir.mkdir(exist_ok=True)
    out.mkdir(exist_ok=True)
    (bin_dir / "python3").write_text(FAKE_PYTHON)
    (bin_dir / "python3").chmod(0o755)
    calls.write_bytes(b"")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(out), "CALLS": str(calls),
           "HOME": str(tmp_path), "MOE_DONE": str(tmp_path / "done")}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    subprocess.run(["bash", str(SESSION), *phase], check=True, env=env, cwd=SESSION.parents[1], capture_output=True)
    recorded = []
    for line in calls.read_bytes().decode().splitlines():
        mode, *argv = line.split("\0")
        recorded.append((mode, argv))
    return [(m, a) for m, a in recorded if a and a[0].endswith(("peer_bench.py", "spec_decode_bench.py"))]


def test_the_moe_agent_phase_runs_both_engines_on_the_35b_shape(tmp_path: Path) -> None:
    """moe-agent: hyserve's then vLLM's agent trace (prefix caching) on the config-only 35B-A3B bf16 directory with
    dummy weights, vLLM in its default mode (the engine core in its own process), each command parsed by
    peer_bench.py's own parser."""
    calls = run_phase(tmp_path, "moe-agent")
    assert [a[0] for _, a in calls] == ["benchmarks/peer_bench.py"] * 2
    parsed = [peer_bench.build_parser().parse_args(a[1:]) for _, a in calls]
    assert [p.engine for p in parsed] == ["hyserve", "vllm"]
    for p in parsed:
        assert (p.cmd, p.model, p.measures, p.load_format) == ("measure", "/tmp/m35", "agent", "dummy")
        assert p.out.endswith(f"{p.engine}_35b_a3b_agent.json")
    assert parsed[1].vllm_gdn_prefill_backend == "triton"  # no FlashInfer JIT cache here
    assert [m for m, _ in calls] == ["VLLM_MP=unset"] * 2


def test_the_moe_spec_phase_plants_the_same_acceptance_in_both_engines(tmp_path: Path) -> None:
    """moe-spec: hyserve's spec_decode_bench.py (each draft token's verdict drawn at 80 %, dummy weights, batch 1
    and 32, k = 3), then vLLM's spec measure with its synthetic rejection sampling at the same per-position rates;
    a run marked done is not made again, and `moe-spec vllm` makes vLLM's alone."""
    import spec_decode_bench

    calls = run_phase(tmp_path, "moe-spec")
    assert [a[0] for _, a in calls] == ["benchmarks/spec_decode_bench.py", "benchmarks/peer_bench.py"]
    ours = spec_decode_bench.build_parser().parse_args(calls[0][1][1:])
    assert (ours.model, ours.load_format, ours.device, ours.dtype) == ("/tmp/m35", "dummy", "cuda", "bfloat16")
    assert (ours.k, ours.rates, ours.batches, ours.prompt_len, ours.max_tokens) == (3, "0.8", "1,32", 512, 128)
    assert ours.shared_engines and ours.synthetic and ours.no_diagnosis and ours.gpu_memory_utilization == 0.85
    assert not ours.no_rows_behind and not ours.no_device_chain  # hyserve's default path
    peer = peer_bench.build_parser().parse_args(calls[1][1][1:])
    assert (peer.engine, peer.model, peer.measures, peer.load_format) == ("vllm", "/tmp/m35", "spec", "dummy")
    assert (peer.spec_batches, peer.decode_tokens) == ("1,32", ours.max_tokens)
    spec = json.loads(peer.speculative_config)
    assert spec == peer_bench.synthetic_mtp_config(3, float(ours.rates))
    assert peer_bench.planted_acceptance(spec)["spec_planted_acceptance_length"] == pytest.approx(2.952)
    assert calls[1][0] == "VLLM_MP=unset"
    (tmp_path / "done").mkdir(exist_ok=True)
    (tmp_path / "done" / "hyserve_35b_a3b_spec").touch()  # done in an earlier call on this machine
    assert [a[0] for _, a in run_phase(tmp_path, "moe-spec")] == ["benchmarks/peer_bench.py"]
    (tmp_path / "done" / "hyserve_35b_a3b_spec").unlink()
    assert [a[0] for _, a in run_phase(tmp_path, "moe-spec", "vllm")] == ["benchmarks/peer_bench.py"]


@pytest.mark.slow  # 13 s: benchmark tooling, the suite's budget
def test_spec_decode_bench_plants_on_a_dummy_moe_shape_with_shared_engines(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The moe-spec phase's hyserve command on a tiny config-only MoE shape (dummy weights and MTP head, the same in
    the plain and the speculative engine): one engine of each for both batches, rows for each, drafts accepted."""
    import subprocess

    monkeypatch.setitem(shapes.MOE_SHAPES, "tiny-moe", TINY)
    model, out = tmp_path / "m", tmp_path / "spec"
    shapes.write_moe_config(str(model), "tiny-moe")
    script = Path(__file__).parents[2] / "benchmarks" / "spec_decode_bench.py"
    subprocess.run([sys.executable, str(script), "--model", str(model), "--load-format", "dummy", "--device", "cpu",
                    "--dtype", "float32", "--shared-engines", "--no-diagnosis", "--k", "3", "--rates", "0.8",
                    "--batches", "1,2", "--prompt-len", "24", "--max-tokens", "12", "--out", str(out)],
                   env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True)  # 1 where outputs parted
    res = json.loads((out / "spec_decode.json").read_text())
    assert res["meta"]["method"] == "mtp" and res["meta"]["load_format"] == "dummy" and res["meta"]["shared_engines"]
    assert [(r["batch"], r["acceptance_target"]) for r in res["rows"]] == [(1, 0.8), (2, 0.8)]
    assert all(r["decode_tok_s"] > 0 and r["no_spec_tok_s"] > 0 for r in res["rows"])
    assert max(r["draft_acceptance"] for r in res["rows"]) > 0.2  # planted drafts accepted


def test_moe_report_makes_one_table_of_both_engines(tmp_path: Path) -> None:
    """peer_bench.py moe-report on synthetic files of every phase: measure files of both engines (decode, bound,
    prefill; agent; vLLM's spec with its synthetic acceptance), hyserve's spec_decode.json, and a failed vLLM
    measure: one row per shape and measure, ratios > 1 where hyserve is better (lower wall inverted), no ratio
    for the bound and the acceptance lengths, the failure listed."""
    import subprocess

    def measure(engine: str, model: str, figures: dict[str, float], **extra: Any) -> dict[str, Any]:
        return {"engine": engine, "model": model, "figures": figures, "errors": {}, "version": f"{engine}-v",
                "device": "NVIDIA H200", "date": "2026-12-04", **extra}

    vllm_meta = {"vllm_mode": "default (engine core in its own process)", "vllm_gdn_prefill_backend": "triton"}
    files = {
        "hyserve_35b_a3b.json": measure("hyserve", "/tmp/m35", {"decode_bs1_tok_s": 240.0, "decode_bs32_tok_s": 2100.0,
                                                                "bound_bs1_tok_s": 700.0, "prefill_tok_s": 34000.0}),
        "vllm_35b_a3b.json": measure("vllm", "/tmp/m35", {"decode_bs1_tok_s": 200.0, "decode_bs32_tok_s": 4200.0,
                                                          "bound_bs1_tok_s": 710.0, "prefill_tok_s": 17000.0},
                                     **vllm_meta),
        "hyserve_35b_a3b_fp8.json": measure("hyserve", "/tmp/m35_fp8", {"decode_bs1_tok_s": 250.0}),
        "hyserve_35b_a3b_agent.json": measure("hyserve", "/tmp/m35", {"agent_wall_s": 3.0, "agent_cached_share": 0.8}),
        "vllm_35b_a3b_agent.json": measure("vllm", "/tmp/m35", {"agent_wall_s": 6.0, "agent_cached_share": 0.7},
                                           **vllm_meta),
        "vllm_35b_a3b_spec.json": measure("vllm", "/tmp/m35", {
            "plain_decode_bs1_tok_s": 200.0, "spec_decode_bs1_tok_s": 400.0, "spec_speedup_bs1": 2.0,
            "plain_decode_bs32_tok_s": 4000.0, "spec_decode_bs32_tok_s": 6000.0, "spec_speedup_bs32": 1.5,
            **peer_bench.planted_acceptance(peer_bench.synthetic_mtp_config(3, 0.8))}, **vllm_meta),
        "vllm_next80b_fp8.json": dict(measure("vllm", "/tmp/m80_fp8", {}), errors={"decode,bound,prefill": "OOM"}),
    }
    spec_rows = [{"batch": b, "acceptance_target": rate, "k": 3, "draft_acceptance": 0.65,
                  "mean_tokens_per_step": 2.9 if rate == 0.8 else 1.0, "decode_tok_s": tps, "no_spec_tok_s": base,
                  "speedup": tps / base, "outputs_identical": True}
                 for b, base, tps in ((1, 240.0, 600.0), (32, 2000.0, 3600.0)) for rate in (0.0, 0.8)]
    (tmp_path / "hyserve_35b_a3b_spec").mkdir()
    (tmp_path / "hyserve_35b_a3b_spec" / "spec_decode.json").write_text(json.dumps(
        {"meta": {"model": "/tmp/m35", "device": "NVIDIA H200", "date": "2026-12-04"}, "rows": spec_rows}))
    for name, content in files.items():
        (tmp_path / name).write_text(json.dumps(content))
    paths = [str(tmp_path / n) for n in files] + [str(tmp_path / "hyserve_35b_a3b_spec" / "spec_decode.json")]
    script = Path(__file__).parents[2] / "benchmarks" / "peer_bench.py"
    subprocess.run([sys.executable, str(script), "moe-report", *paths, "--out", str(tmp_path / "rep")], check=True,
                   capture_output=True)
    rep = json.loads((tmp_path / "rep" / "moe_peer.json").read_text())
    got = {(e["model"], e["measure"]): e for e in rep["entries"]}
    assert got["m35", "decode_bs1_tok_s"]["ratio"] == pytest.approx(1.2)
    assert got["m35", "decode_bs32_tok_s"]["ratio"] == pytest.approx(0.5)
    assert got["m35", "prefill_tok_s"]["ratio"] == pytest.approx(2.0)
    assert got["m35", "bound_bs1_tok_s"]["ratio"] is None
    assert got["m35", "agent_wall_s"]["ratio"] == pytest.approx(2.0)  # lower is better: vLLM's wall / ours
    assert got["m35", "spec_speedup_bs1"]["hyserve"] == pytest.approx(2.5)  # the 0.8 rows, not the 0.0 ones
    assert got["m35", "spec_speedup_bs1"]["ratio"] == pytest.approx(1.25)
    assert got["m35", "spec_speedup_bs32"]["ratio"] == pytest.approx(1.2)
    assert got["m35", "plain_decode_bs32_tok_s"]["vllm"] == 4000.0
    length = got["m35", "spec_acceptance_length_bs32"]
    assert (length["hyserve"], length["vllm"], length["ratio"]) == (2.9, pytest.approx(2.952), None)
    assert got["m35_fp8", "decode_bs1_tok_s"]["vllm"] is None and got["m35_fp8", "decode_bs1_tok_s"]["ratio"] is None
    assert rep["entries"][0]["model"] == "m35"  # the shapes in MOE_MODELS' order
    assert rep["errors"] == ["m80_fp8 vllm decode,bound,prefill: OOM"]
    md = (tmp_path / "rep" / "moe_peer.md").read_text()
    assert "| 35B-A3B bf16 | decode batch 1, tok/s | 240 | 200 | 1.20x |" in md
    assert "| 35B-A3B bf16 | MTP k = 3 planted at 80 %, batch 32, speedup over plain | 1.800 | 1.500 | 1.20x |" in md
    assert "vllm_mode default (engine core in its own process)" in md
    assert "- m80_fp8 vllm decode,bound,prefill: OOM" in md


class _ClockedEngine:
    """An engine whose ``generate`` advances a fake clock: a one-token run takes ``slow_first`` seconds the first
    time (a shape compiled on first use), 0.01 s after; an N-token run 0.01 + 0.002 (N - 1) s."""

    def __init__(self, clock: list[float], slow_first: float) -> None:
        self.clock, self.slow_first, self.one_token_runs = clock, slow_first, 0

    def generate(self, prompts: list[list[int]], n: int) -> None:
        if n == 1:
            self.one_token_runs += 1
        first_one = n == 1 and self.one_token_runs == 1
        self.clock[0] += self.slow_first if first_one else 0.01 + 0.002 * (n - 1)


@pytest.mark.parametrize("slow_first", [0.01, 1.0, 99.0])
def test_decode_rate_retakes_a_timing_a_slow_one_token_run_spoiled(monkeypatch: pytest.MonkeyPatch,
                                                                    slow_first: float) -> None:
    """A one-token run slower than the N-token run after it (vLLM's FP8 batch 8 on 2026-12-03 read 1e12 tok/s) does
    not make the rate: the fastest of two timings each does; a difference never positive is an error, not a
    figure."""
    clock = [0.0]
    monkeypatch.setattr(peer_bench, "_timed", lambda fn: (lambda t0: (fn(), clock[0] - t0)[1])(clock[0]))
    eng = _ClockedEngine(clock, slow_first)
    errors: dict[str, str] = {}
    out = peer_bench.measure_decode(eng, peer_bench.Prompts(100), [8], 65, prompt_len=4,  # type: ignore[arg-type]
                                    errors=errors)
    assert out == pytest.approx({"decode_bs8_tok_s": 8 * 64 / (0.002 * 64)}) and not errors
    never = _ClockedEngine(clock, 0.0)
    never.generate = lambda prompts, n: clock.__setitem__(0, clock[0] + (1.0 if n == 1 else 0.5))  # type: ignore
    out = peer_bench.measure_decode(never, peer_bench.Prompts(100), [8], 65, prompt_len=4,  # type: ignore[arg-type]
                                    errors=errors)
    assert out == {} and "not positive in 3 tries" in errors["decode_bs8"]


def _positions(lps: list[float], argmax: list[int], margin: list[float]) -> dict[str, Any]:
    import torch

    return {"lp": torch.tensor(lps, dtype=torch.float64), "argmax": torch.tensor(argmax),
            "margin": torch.tensor(margin, dtype=torch.float64)}


def test_the_bf16_peer_rule_measures_the_engine_by_the_references_own_bf16() -> None:
    """``moe_check.BF16_PEER_RULE``: an engine as far from the float32 reference as transformers' bf16 model passes;
    one 2x further, or parting from the float32 argmax at a clear position where the bf16 model does not, fails; a
    control (an altered float32 reference) is judged by the intact reference's yardstick, so it cannot pass on the
    bf16 model's distance to the altered one."""
    rule = moe_check.BF16_PEER_RULE
    ref32 = [_positions([-1.0, -2.0, -0.5, -3.0], [5, 6, 7, 8], [1.0, 0.1, 1.0, 1.0])]
    ref16 = [_positions([-1.1, -2.1, -0.4, -3.1], [5, 9, 7, 8], [1.0, 0.1, 1.0, 1.0])]  # parts at an unclear one
    rows = [([5, 6, 7, 8], None)]
    near = [[-1.1, -1.9, -0.6, -2.9]]
    assert rule.score(near, rows, ref32, ref16)["pass"]
    assert not rule.score([[-1.2, -1.8, -0.7, -2.8]], rows, ref32, ref16)["pass"]  # twice the bf16 model's error
    parted = [([5, 6, 9, 9], None)]  # two clear positions parted (one allowed beyond the bf16 model's none)
    r = rule.score(near, parted, ref32, ref16)
    assert (r["tokens_checked"], r["tokens_mismatched"], r["mismatches_allowed"], r["pass"]) == (3, 2, 1, False)
    assert rule.score(near, [([5, 6, 9, 8], None)], ref32, ref16)["pass"]
    altered = [_positions([-3.0, -4.0, -2.5, -5.0], [9, 9, 9, 9], [1.0, 1.0, 1.0, 1.0])]
    assert rule.score(near, rows, altered, ref16, yardstick32=ref32)["pass"] is False
    assert rule.score(near, rows, altered, ref16)["pass"]  # why: the bf16 model is as far from the altered one


@pytest.fixture(scope="module")
def tiny_moe_ref(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """transformers' float32 model of ``moe_check.TINY_MOE`` (``write_moe_checkpoint`` on the CPU), its GDN layers
    on transformers' own PyTorch functions as the check runs them."""
    import torch
    from transformers import Qwen3_5MoeForCausalLM

    path = str(tmp_path_factory.mktemp("moe") / "moe")
    moe_check.write_moe_checkpoint(path, moe_check.TINY_MOE, "cpu")
    with moe_check.torch_gdn_reference():
        yield Qwen3_5MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


FLIP_PROMPT_LEN, FLIP_TOKENS = 24, 16


def _flip_prompt() -> list[int]:
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randint(0, moe_check.TINY_MOE["vocab_size"], (FLIP_PROMPT_LEN,), generator=g).tolist()


def _greedy(ref: Any, prompt: list[int], flips: Any = ()) -> tuple[list[int], list[float]]:
    """An engine row made by the reference itself with ``flips``: its greedy tokens and their logprobs."""
    import torch

    ids = list(prompt)
    for _ in range(FLIP_TOKENS):
        ids.append(int(moe_check.router_gaps(ref, ids, "cpu", flips)[0][-1].argmax()))
    logp = torch.log_softmax(moe_check.router_gaps(ref, ids, "cpu", flips)[0][len(prompt) - 1 : -1].double(), -1)
    toks = ids[len(prompt) :]
    return toks, [float(logp[i, t]) for i, t in enumerate(toks)]


# A planted flip must move a logprob by this much or part at a clear position: other flips move the tiny model's
# logprobs by about 1e-3 and could otherwise take an error just past FP32_RULE's 3e-3 back under it.
PLANTED_RULE = moe_check.ClearMarginRule(margin=moe_check.FP32_RULE.margin, logprob_tol=1e-2, mismatches_per=None)


def _fails(ref: Any, prompt: list[int], row: tuple[list[int], list[float]], flips: Any = (),
           rule: Any = moe_check.FP32_RULE) -> bool:
    logits = moe_check.router_gaps(ref, prompt + row[0], "cpu", flips)[0][len(prompt) - 1 :]
    return not rule.passes(moe_check.score_positions(logits, row[0], row[1], rule.margin))


def _plant(ref: Any, prompt: list[int], kept: Any = (), tokens: range | None = None
           ) -> tuple[Any, tuple[list[int], list[float]]]:
    """The smallest-gap (token, layer) pair, its token in ``tokens`` (default: any), whose flip (beside ``kept``)
    makes the reference's own greedy row fail ``PLANTED_RULE`` against the reference with ``kept`` only; and that
    row."""
    import torch

    toks, _ = _greedy(ref, prompt, kept)
    gaps = moe_check.router_gaps(ref, prompt + toks, "cpu", kept)[1][:, : len(prompt) - 1 + FLIP_TOKENS]
    for j in torch.argsort(gaps.flatten()).tolist():
        layer, token = divmod(j, gaps.shape[1])
        if tokens is None or token in tokens:
            flip = moe_check.Flip(token, layer, float(gaps[layer, token]))
            row = _greedy(ref, prompt, [*kept, flip])
            if _fails(ref, prompt, row, kept, PLANTED_RULE):
                return flip, row
    raise AssertionError("no flip matters")


@pytest.fixture(scope="module")
def planted(tiny_moe_ref: Any) -> tuple[list[int], Any, tuple[list[int], list[float]]]:
    prompt = _flip_prompt()
    return (prompt, *_plant(tiny_moe_ref, prompt))


def _flips(r: dict[str, Any]) -> list[tuple[int, int]]:
    return [(f["token"], f["layer"]) for p in r["router_flips"] for f in p["flips"]]


def test_a_flip_takes_the_next_expert_at_its_row_only(tiny_moe_ref: Any) -> None:
    """What the experts receive with a flip at (token 5, layer 2): at row 5 the router's top k - 1 and its (k + 1)-th
    expert (by its float32 softmax), the k weights renormalized; the other rows of layers 0 to 2 and the rows before
    5 of every layer as without the flip (their weights after layer 2 within float32 rounding); the reported gap is the
    k-th minus the (k + 1)-th logit."""
    import torch

    layers, k = tiny_moe_ref.model.layers, moe_check.TINY_MOE["num_experts_per_tok"]
    seen: list[tuple[torch.Tensor, ...]] = []
    handles = [layer.mlp.experts.register_forward_pre_hook(lambda _m, a: seen.append(tuple(a))) for layer in layers]
    try:
        ids = _flip_prompt()[:12]
        _, gaps = moe_check.router_gaps(tiny_moe_ref, ids, "cpu")
        moe_check.router_gaps(tiny_moe_ref, ids, "cpu", [moe_check.Flip(5, 2, 0.0)])
    finally:
        for h in handles:
            h.remove()
    plain, flipped = seen[: len(layers)], seen[len(layers) :]
    for n, ((x, idx, w), (_, fidx, fw)) in enumerate(zip(plain, flipped, strict=True)):
        rows = [r for r in range(len(ids)) if r < 5 or n < 2 or (n == 2 and r != 5)]  # what it cannot reach
        assert torch.equal(idx[rows], fidx[rows]), n
        # Bit for bit up to the flip's layer. After it an expert that gained or lost row 5 multiplies another number of
        # rows, and a CPU BLAS may block (and round) the others' products apart by that count (an AMX Xeon did).
        assert torch.equal(w[rows], fw[rows]) if n <= 2 else torch.allclose(w[rows], fw[rows], rtol=0, atol=1e-6), n
        if n == 2:
            weight = layers[2].mlp.gate.weight.detach()
            logits = x[5] @ weight.T
            order = torch.argsort(torch.softmax(logits, -1), descending=True)
            chosen = torch.cat([order[: k - 1], order[k : k + 1]])
            assert not torch.equal(idx[5], fidx[5]) and torch.equal(fidx[5], chosen)
            probs = torch.softmax(logits, -1)[chosen]
            assert torch.allclose(fw[5], probs / probs.sum(), rtol=0, atol=1e-7)
            exact = x[5].double() @ weight.double().T
            assert float(gaps[2, 5]) == pytest.approx(float(exact[order[k - 1]] - exact[order[k]]), abs=1e-12)


def test_a_router_flip_at_a_near_tie_explains_a_float32_parting(tiny_moe_ref: Any, planted: Any) -> None:
    """An engine row that took one router choice the other way (the reference's own greedy row with the flip) fails
    ``FP32_RULE`` against the reference; ``score_with_router_flips`` finds that flip among the near-ties (the gap
    threshold just above its gap) and passes the prompt, with the totals still the unflipped reference's."""
    prompt, flip, row = planted
    rows = [row, _greedy(tiny_moe_ref, prompt[:9])]  # a second prompt that passes as it is
    r = moe_check.score_with_router_flips(tiny_moe_ref, [prompt, prompt[:9]], rows, "cpu",
                                          tie_gap=flip.gap * 1.01, max_tries=40)
    assert not r["pass_unflipped"] and r["tokens_checked"] > 0, r
    assert (r["prompts_failing"], r["prompts_explained_by_router_flips"], r["pass"]) == (1, 1, True), r
    assert r["router_flips"][0]["prompt"] == 0 and (flip.token, flip.layer) in _flips(r), (flip, r)
    got = next(f for f in r["router_flips"][0]["flips"] if (f["token"], f["layer"]) == (flip.token, flip.layer))
    assert got["gap"] == pytest.approx(flip.gap, rel=1e-9)
    assert 1 <= r["flip_passes"] <= 40 and "router_ties" in r


def test_a_flip_above_the_tie_gap_is_not_tried(tiny_moe_ref: Any, planted: Any,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The same row with the threshold just below the planted flip's gap: every flip tried has a gap below the
    threshold, the planted one is not among them, and the prompt stays unexplained."""
    prompt, flip, row = planted
    passes: list[list[Any]] = []
    real = moe_check.router_gaps

    def recording(ref: Any, ids: list[int], device: str, flips: Any = ()) -> Any:
        if flips:
            passes.append(list(flips))
        return real(ref, ids, device, flips)

    monkeypatch.setattr(moe_check, "router_gaps", recording)
    r = moe_check.score_with_router_flips(tiny_moe_ref, [prompt], [row], "cpu", tie_gap=flip.gap * 0.99,
                                          max_tries=40)
    assert (r["prompts_failing"], r["prompts_explained_by_router_flips"], r["pass"]) == (1, 0, False), r
    # The unexplained prompt's first failure is described, the planted flip among its smallest router gaps.
    (u,) = r["unexplained"]
    assert u["prompt"] == 0 and u["first_failure"] is not None and u["token"] == row[0][u["first_failure"]], u
    assert (flip.token, flip.layer) in {(t, layer) for t, layer, _ in u["smallest_gaps"]}, (flip, u)
    assert u["parted"] or u["logprob_err"] >= moe_check.FP32_RULE.logprob_tol, u
    tried = {(f.token, f.layer, f.gap) for p in passes for f in p}
    assert len(passes) == r["flip_passes"] and all(g < flip.gap * 0.99 for _, _, g in tried), tried
    assert (flip.token, flip.layer) not in {(t, layer) for t, layer, _ in tried}, tried


@pytest.mark.slow  # about 6 s: the suite's budget (one flip's search is checked by default)
def test_two_flips_combine_greedily(tiny_moe_ref: Any, planted: Any) -> None:
    """An engine row with two flips, the second after the first's failure: the first flip alone moves the first
    failure later and is kept, the second then explains the prompt; with one flip allowed it stays unexplained."""
    prompt = planted[0]
    first, row1 = _plant(tiny_moe_ref, prompt, tokens=range(len(prompt) + 4))
    logits = moe_check.router_gaps(tiny_moe_ref, prompt + row1[0], "cpu")[0][len(prompt) - 1 :]
    fail = moe_check.first_failure(logits, row1[0], row1[1], moe_check.FP32_RULE)
    assert fail is not None and fail < FLIP_TOKENS - 4, (first, fail)
    second, row = _plant(tiny_moe_ref, prompt, [first], tokens=range(len(prompt) + fail, len(prompt) + FLIP_TOKENS))
    gap = max(first.gap, second.gap) * 1.01
    r = moe_check.score_with_router_flips(tiny_moe_ref, [prompt], [row], "cpu", tie_gap=gap, max_tries=60)
    assert r["pass"] and _flips(r) == [(first.token, first.layer), (second.token, second.layer)], (first, second, r)
    r1 = moe_check.score_with_router_flips(tiny_moe_ref, [prompt], [row], "cpu", tie_gap=gap, max_tries=60,
                                           max_flips=1)
    assert not r1["pass"] and r1["prompts_failing"] == 1, r1


def test_router_flips_do_not_explain_perturbed_weights(tiny_moe_ref: Any) -> None:
    """Rows from the reference with every layer's shared-expert gate shifted by 0.05 (its weights' spread: 0.02)
    fail ``FP32_RULE`` by about as much as a flip moves a logprob (errors up to 4e-3 and 8e-3); no flip explains
    them, whatever the threshold (every pair a candidate, every try spent)."""
    import copy

    import torch

    sabotaged = copy.deepcopy(tiny_moe_ref)
    with torch.no_grad():
        for layer in sabotaged.model.layers:
            layer.mlp.shared_expert_gate.weight += 0.05
    prompts = [_flip_prompt(), _flip_prompt()[:9]]
    rows = [_greedy(sabotaged, p) for p in prompts]
    r = moe_check.score_with_router_flips(tiny_moe_ref, prompts, rows, "cpu", tie_gap=1.0, max_tries=8)
    assert not r["pass_unflipped"] and r["prompts_failing"] == 2 and r["max_logprob_abs_err"] < 0.02, r
    assert r["prompts_explained_by_router_flips"] == 0 and not r["pass"], r
    assert r["flip_passes"] == 8 * r["prompts_failing"], r


def test_the_state_dtype_runs_are_named_only_and_pass_the_flag(tmp_path: Path) -> None:
    """`moe 35b_a3b_bf16state` (hyserve with vLLM's default state dtype) and `moe-vllm 35b_a3b_fp32state` (vLLM
    with hyserve's): each one measure passing --mamba-ssm-cache-dtype, parsed by peer_bench.py's own parser; a phase
    without the name runs neither."""
    for phase, engine, dtype in (("moe", "hyserve", "bfloat16"), ("moe-vllm", "vllm", "float32")):
        name = f"35b_a3b_{'bf16' if dtype == 'bfloat16' else 'fp32'}state"
        calls = run_phase(tmp_path, phase, name)
        assert len(calls) == 1
        p = peer_bench.build_parser().parse_args(calls[0][1][1:])
        assert (p.engine, p.model, p.mamba_ssm_cache_dtype) == (engine, "/tmp/m35", dtype)
        assert p.out.endswith(f"{engine}_{name}.json")
        (tmp_path / "done").mkdir(exist_ok=True)
        for f in (tmp_path / "done").iterdir():
            f.unlink()
    assert not any(p.mamba_ssm_cache_dtype for p in (peer_bench.build_parser().parse_args(a[1:])
                                                     for _, a in run_phase(tmp_path, "moe", "35b_a3b")))


def test_only_a_built_gdn_prefill_module_makes_vllm_take_flashinfer(tmp_path: Path) -> None:
    """moe-vllm keeps vLLM on its Triton GDN prefill unless FlashInfer's GDN prefill module is built here: another
    built module (the FP8 block GEMM an FP8 run leaves, in the caches stash-caches restores) is not that (it would
    send vLLM into an 8-minute JIT inside a timed call)."""
    ops = tmp_path / ".cache" / "flashinfer" / "0.6.12" / "90a" / "cached_ops"
    (ops / "fp8_blockscale_gemm_90").mkdir(parents=True)
    (ops / "fp8_blockscale_gemm_90" / "fp8_blockscale_gemm_90.so").write_bytes(b"\0")
    calls = run_phase(tmp_path, "moe-vllm", "35b_a3b")
    assert peer_bench.build_parser().parse_args(calls[0][1][1:]).vllm_gdn_prefill_backend == "triton"
    (ops / "gdn_prefill_sm90").mkdir()
    (ops / "gdn_prefill_sm90" / "gdn_prefill_sm90.so").write_bytes(b"\0")
    for f in (tmp_path / "done").iterdir():
        f.unlink()
    calls = run_phase(tmp_path, "moe-vllm", "35b_a3b")
    assert peer_bench.build_parser().parse_args(calls[0][1][1:]).vllm_gdn_prefill_backend is None

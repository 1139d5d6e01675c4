"""Issue 33's benchmark preparation on the CPU: the Mamba2 shapes ``shapes.py`` writes config-only (Nemotron-H-8B,
Nemotron 3 Nano 30B-A3B, the releases' form) parse with hyserve's parser and transformers' ``NemotronHConfig`` and
have the published sizes; ``peer_bench.py``'s batch-1 bound counts what a step reads of them (Mamba2 mixers,
attention, MLP, router, shared expert, the top-k experts, the LM head; not the input embedding) as a hand count
does; a shrunken copy of each runs the session's hyserve commands on the CPU with dummy weights; the mamba2 phases
run both engines' commands (vLLM in its default mode, its own mamba cache mode for Nemotron-H) and go on where an
earlier call stopped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from hyserve.config import FULL_ATTENTION, LINEAR_ATTENTION
from hyserve.model.nemotron_h_config import MLP, MOE, NemotronHConfig
from hyserve.model.registry import load_model_config

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
sys.path.insert(0, os.path.dirname(__file__))

import peer_bench
import shapes
from test_moe_bench import SESSION, run_phase

# (shape, its directory in the session, blocks M / * / - / E, parameters in billions (with both embeddings))
PUBLISHED = {"nemotron-h-8b": ("/tmp/n8b", (24, 4, 24, 0), 8.10),
             "nemotron3-nano-30b-a3b": ("/tmp/n30", (23, 6, 0, 23), 31.58)}
SMALL = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16, chunk_size=16,
             max_position_embeddings=2048, num_hidden_layers=6)
SHRUNK = {"nemotron-h-8b": dict(SMALL, intermediate_size=128, hybrid_override_pattern="M-M*M-"),
          "nemotron3-nano-30b-a3b": dict(SMALL, intermediate_size=64, hybrid_override_pattern="MEM*EM",
                                         n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                         moe_shared_expert_intermediate_size=64)}


def hand_step_bytes(cfg: dict[str, Any]) -> int:
    """Bytes of bf16 weights a batch-1 step reads, from config.json by hand: per Mamba2 block in_proj (z, x, B, C,
    dt), conv1d weight and bias, A_log / D / dt_bias, the gated norm, out_proj; attention q, k, v, o; the MLP's up and
    down; per MoE block the router (and its float32 correction bias), the shared expert and k experts' up and down;
    each block's norm, the final norm and the LM head."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    heads, hd, g, n = cfg["mamba_num_heads"], cfg["mamba_head_dim"], cfg["n_groups"], cfg["ssm_state_size"]
    inner = heads * hd
    conv = inner + 2 * g * n
    mamba = h * (2 * inner + 2 * g * n + heads) + conv * cfg["conv_kernel"] + conv + 3 * heads + inner + inner * h
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    per_block = {"M": mamba, "*": 2 * h * q + 2 * h * kv, "-": 2 * h * cfg["intermediate_size"]}
    elems, extra = h + v * h, 0
    for c in cfg["hybrid_override_pattern"]:
        elems += h
        if c == "E":
            e = cfg["n_routed_experts"]
            elems += e * h + 2 * h * cfg["moe_shared_expert_intermediate_size"]
            elems += cfg["num_experts_per_tok"] * 2 * h * cfg["moe_intermediate_size"]
            extra += 4 * e
        else:
            elems += per_block[c]
    return 2 * elems + extra


@pytest.mark.parametrize("name", list(shapes.MAMBA2_SHAPES))
def test_the_mamba2_shapes_parse_and_have_the_published_sizes(tmp_path: Path, name: str) -> None:
    from transformers import AutoConfig

    raw = shapes.write_mamba2_config(str(tmp_path), name)
    assert json.loads((tmp_path / "config.json").read_text()) == raw
    cfg = load_model_config(str(tmp_path))
    assert isinstance(cfg, NemotronHConfig) and cfg.architecture == "NemotronHForCausalLM"
    _, blocks, billions = PUBLISHED[name]
    assert tuple(cfg.layer_types.count(t) for t in (LINEAR_ATTENTION, FULL_ATTENTION, MLP, MOE)) == blocks
    assert cfg.num_parameters() / 1e9 == pytest.approx(billions, abs=0.01)
    ref = AutoConfig.from_pretrained(str(tmp_path))  # transformers' NemotronHConfig, as vLLM 0.24 reads it
    assert type(ref).__name__ == "NemotronHConfig"
    assert ref.hybrid_override_pattern == raw["hybrid_override_pattern"] and ref.num_hidden_layers == 52
    assert (ref.n_groups, ref.conv_kernel, ref.chunk_size, ref.head_dim) == (8, 4, 128, 128)
    assert ref.mamba_ssm_cache_dtype == "float32"


@pytest.mark.parametrize("name", list(shapes.MAMBA2_SHAPES))
def test_the_bound_counts_what_a_nemotron_step_reads(tmp_path: Path, name: str) -> None:
    """The dummy-load bound (hyserve's model built on the meta device) is the hand count: the Nano's routed experts
    by 6 of 128, neither shape's input embedding (before issue 33 the Nano's bound read every expert: 63.2 GB)."""
    raw = shapes.write_mamba2_config(str(tmp_path), name)
    got = peer_bench.weight_bytes_per_step(str(tmp_path), "dummy")
    print(f"{name}: peer_bench {got:,} B, hand {hand_step_bytes(raw):,} B")
    assert got == hand_step_bytes(raw)
    moe = "E" in raw["hybrid_override_pattern"]
    assert peer_bench.moe_active_share(str(tmp_path)) == (6 / 128 if moe else 1.0)
    assert got == (6_455_515_520 if moe else 15_127_963_648)


@pytest.mark.slow  # 25 s: benchmark tooling, the suite's budget
@pytest.mark.parametrize("name", list(shapes.MAMBA2_SHAPES))
def test_a_shrunken_copy_runs_the_sessions_hyserve_commands_on_the_cpu(tmp_path: Path, name: str) -> None:
    """The mamba2 phase's two hyserve runs (decode / bound / prefill, then the agent trace with prefix caching) on
    the shape shrunken to a few blocks of the same kinds, config only, dummy weights, the SSM state in float32."""
    model = tmp_path / "m"
    shapes.write_mamba2_config(str(model), name, **SHRUNK[name])
    script = Path(__file__).parents[2] / "benchmarks" / "peer_bench.py"
    common = ["--engine", "hyserve", "--model", str(model), "--device", "cpu", "--dtype", "float32",
              "--load-format", "dummy", "--mamba-ssm-cache-dtype", "float32", "--max-model-len", "1024"]
    runs = {"main": ["--measures", "decode,bound,prefill", "--batches", "1,2", "--decode-tokens", "12",
                     "--decode-prompt-len", "16", "--prefill-prompts", "2", "--prefill-len", "64"],
            "agent": ["--measures", "agent", "--agent-scale", "tiny"]}
    for tag, args in runs.items():
        out = tmp_path / f"{tag}.json"
        subprocess.run([sys.executable, str(script), "measure", *common, "--out", str(out), *args], check=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True)
        res = json.loads(out.read_text())
        assert not res["errors"] and res["ssm_state_dtype"] == "float32"
        fig = res["figures"]
        if tag == "main":
            assert fig["decode_bs1_tok_s"] > 0 and fig["decode_bs2_tok_s"] > 0 and fig["prefill_tok_s"] > 0
        else:
            assert fig["agent_wall_s"] > 0 and fig["agent_cached_share"] > 0.3  # turns reuse earlier prompts


def test_vllm_keeps_its_own_mamba_cache_mode_for_nemotron_h(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With prefix caching vLLM gets no mamba_cache_mode for Nemotron-H (its own choice, "all"), "align" for the GDN
    shapes as before, the flag's where given; its front end's cache settings are kept."""
    seen: list[dict[str, Any]] = []

    class FakeLLM:
        def __init__(self, model: str, **kw: Any) -> None:
            seen.append(kw)
            cache = types.SimpleNamespace(block_size=16, mamba_cache_mode=kw.get("mamba_cache_mode", "all"))
            self.llm_engine = types.SimpleNamespace(vllm_config=types.SimpleNamespace(cache_config=cache))

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=FakeLLM, SamplingParams=object,
                                                                   __version__="0.24.0"))
    nemotron, qwen = tmp_path / "n", tmp_path / "q"
    shapes.write_mamba2_config(str(nemotron), "nemotron-h-8b")
    qwen.mkdir()
    (qwen / "config.json").write_text(json.dumps({"model_type": "qwen3_next", "vocab_size": 512}))
    eng = peer_bench.Engine("vllm", str(nemotron), "cuda", "bfloat16", enable_prefix_caching=True)
    assert "mamba_cache_mode" not in seen[-1] and eng.cache["mamba_cache_mode"] == "all"
    peer_bench.Engine("vllm", str(qwen), "cuda", "bfloat16", enable_prefix_caching=True)
    assert seen[-1]["mamba_cache_mode"] == "align"
    peer_bench.Engine("vllm", str(nemotron), "cuda", "bfloat16", enable_prefix_caching=True,
                      vllm_mamba_cache_mode="align")
    assert seen[-1]["mamba_cache_mode"] == "align" and "vllm_mamba_cache_mode" not in seen[-1]


@pytest.mark.parametrize("phase", ["mamba2", "mamba2-vllm"])
def test_the_mamba2_phases_run_both_shapes_and_go_on_where_they_stopped(tmp_path: Path, phase: str) -> None:
    calls = run_phase(tmp_path, phase)
    parsed = [peer_bench.build_parser().parse_args(a[1:]) for _, a in calls]
    engine = "vllm" if phase.endswith("vllm") else "hyserve"
    assert [(p.model, os.path.basename(p.out)) for p in parsed] == [
        ("/tmp/n8b", f"{engine}_n8b.json"), ("/tmp/n8b", f"{engine}_n8b_agent.json"),
        ("/tmp/n30", f"{engine}_n30.json"), ("/tmp/n30", f"{engine}_n30_agent.json")]
    for p in parsed:
        assert (p.engine, p.load_format, p.mamba_ssm_cache_dtype) == (engine, "dummy", "float32")
        assert p.vllm_gdn_prefill_backend is None and p.vllm_mamba_cache_mode is None  # vLLM's own choices
    main = parsed[0]
    assert (main.measures, main.batches, main.prefill_prompts, main.prefill_len) == (
        "decode,bound,prefill", "1,8,32,64", 32, 2048)
    assert parsed[1].measures == "agent" and parsed[1].agent_scale == "full"
    assert {m for m, _ in calls} == {"VLLM_MP=unset"}  # vLLM in its default mode
    done = tmp_path / "done"
    (done / f"{engine}_n8b").touch()  # made in an earlier call on this warm machine
    assert [os.path.basename(a[a.index("--out") + 1]) for _, a in run_phase(tmp_path, phase)] == [
        f"{engine}_n8b_agent.json", f"{engine}_n30.json", f"{engine}_n30_agent.json"]
    assert [os.path.basename(a[a.index("--out") + 1]) for _, a in run_phase(tmp_path, phase, "n30_agent")] == [
        f"{engine}_n30_agent.json"]


def test_the_session_has_the_mamba2_phases() -> None:
    text = SESSION.read_text()
    assert "\n  mamba2|mamba2-vllm)" in text
    subprocess.run(["bash", "-n", str(SESSION)], check=True)


def test_moe_report_names_the_mamba2_shapes(tmp_path: Path) -> None:
    files = []
    for engine, tok_s, share in (("hyserve", 300.0, 0.6), ("vllm", 250.0, 0.2)):
        for name, fig in (("n30", {"decode_bs1_tok_s": tok_s}), ("n30_agent", {"agent_cached_share": share})):
            path = tmp_path / f"{engine}_{name}.json"
            model = "/tmp/n30"
            path.write_text(json.dumps({"engine": engine, "model": model, "figures": fig, "errors": {},
                                        "version": "x", "vllm_cache_agent": {"mamba_cache_mode": "all"}}))
            files.append(str(path))
    entries = peer_bench.moe_report(files, str(tmp_path / "r"), title="Issue 33")
    assert {(e["shape"], e["measure"], round(e["ratio"], 2)) for e in entries} == {
        ("Nemotron 3 Nano 30B-A3B bf16", "decode_bs1_tok_s", 1.2),
        ("Nemotron 3 Nano 30B-A3B bf16", "agent_cached_share", 3.0)}
    assert (tmp_path / "r" / "moe_peer.md").read_text().startswith("# Issue 33")

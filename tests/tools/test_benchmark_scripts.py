"""The benchmark scripts that GPU sessions run with little device time: the random-shape checkpoint writer, the
speculative-decoding benchmark, the multi-GPU check and the side-by-side peer script, on shrunken shapes on the CPU,
so that a broken script shows here and not on the GPU."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import shapes
import spec_decode_bench

from hyserve import LLM, SamplingParams

SMALL = dict(shapes.SHAPE_2B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
             head_dim=16, num_attention_heads=4, num_key_value_heads=2, linear_key_head_dim=16,
             linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)


def greedy(llm: LLM, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1), use_tqdm=False)
    c = out[0].outputs[0]
    assert c.logprobs is not None
    margins = []
    for lp in c.logprobs:
        vals = sorted((v.logprob for v in lp.values()), reverse=True)
        margins.append(vals[0] - vals[1] if len(vals) > 1 else float("inf"))
    return c.token_ids, margins


@pytest.mark.parametrize("init", ["spread", "stable"])
def test_shapes_writes_a_loadable_checkpoint_with_mtp(tmp_path: Path, init: str) -> None:
    path = str(tmp_path / init)
    n = shapes.write_spread_checkpoint(path, SMALL, mtp=True, embed_std=1.0 if init == "stable" else None)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    assert cfg["mtp_num_hidden_layers"] == 1 and cfg["num_hidden_layers"] == 8
    assert cfg["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert n > 0
    torch.set_num_threads(1)
    llm = LLM(model=path, device="cpu", dtype="float32",
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    prompt = list(range(3, 40))
    toks, margins = greedy(llm, prompt, 12)
    assert len(toks) == 12
    if init == "stable":
        # The dominant tied embedding: every token predicts itself, by a wide margin (what keeps bf16 greedy stable).
        assert toks == [prompt[-1]] * 12
        assert min(margins) > 5.0


def test_transformers_init_gets_an_mtp_shard(tmp_path: Path) -> None:
    path = str(tmp_path / "t")
    shapes.write_random_checkpoint(path, SMALL, device="cpu", mtp=True)
    with open(os.path.join(path, "model.safetensors.index.json"), encoding="utf-8") as f:
        weight_map = json.load(f)["weight_map"]
    assert weight_map["mtp.fc.weight"] == "mtp.safetensors"
    assert not os.path.exists(os.path.join(path, "model.safetensors"))  # it would shadow the index
    llm = LLM(model=path, device="cpu", dtype="float32",
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert len(greedy(llm, list(range(3, 20)), 4)[0]) == 4


@pytest.mark.slow  # 24 s of the default run's budget; the engine's own tests plant drafts (tests/speculative)
def test_spec_decode_bench_plants_the_acceptance(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = str(tmp_path / "m")
    shapes.write_spread_checkpoint(model, SMALL, mtp=True, embed_std=1.0)
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["spec_decode_bench.py", "--model", model, "--device", "cpu", "--batches", "2",
                                      "--max-tokens", "24", "--prompt-len", "32", "--out", str(out)])
    assert spec_decode_bench.main() == 0  # non-zero when outputs differ from the plain run
    rows = json.loads((out / "spec_decode.json").read_text())["rows"]
    by_rate = {r["acceptance_target"]: r for r in rows}
    assert by_rate[0.0]["draft_acceptance"] == 0.0
    # 90 % of draft tokens right: the fraction accepted is (0.9 + 0.81 + 0.73) / 3 = 0.81 in expectation.
    assert 0.6 < by_rate[0.9]["draft_acceptance"] < 0.98
    assert all(r["outputs_identical"] for r in rows)
    assert (out / "spec_decode.md").exists()
    k = spec_decode_bench.build_parser().get_default("k")
    assert all(set(r["k_steps"]) == {str(k)} for r in rows)  # --adaptive off by default: every step at k


@pytest.mark.slow  # budget: a benchmark script; the adaptive k's engine tests stay
def test_spec_decode_bench_reports_the_k_chosen_per_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--adaptive on``: the engine chooses each step's speculation length; each row reports its timed steps by
    k_step (its first steps at a batch size explore every k), and the outputs are still plain decoding's."""
    model = str(tmp_path / "m")
    shapes.write_spread_checkpoint(model, SMALL, mtp=True, embed_std=1.0)
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["spec_decode_bench.py", "--model", model, "--device", "cpu", "--batches", "2",
                                      "--max-tokens", "12", "--prompt-len", "16", "--rates", "0,0.9",
                                      "--adaptive", "on", "--out", str(out)])
    assert spec_decode_bench.main() == 0
    data = json.loads((out / "spec_decode.json").read_text())
    assert data["meta"]["adaptive"] == "on"
    for r in data["rows"]:
        assert r["outputs_identical"] and r["k_steps"] and set(r["k_steps"]) <= {"0", "1", "2", "3"}
    assert "steps by k" in (out / "spec_decode.md").read_text()


def test_profile_step_sorts_kernels_into_families() -> None:
    """Kernel names of a 9B decode step on an H100 (2026-12-06) go to their families, summed per step."""
    import profile_step

    kernels = [("nvjet_sm90_tst_192x64_64x6_2x1_v_bz_TNT", 71_125.0), ("_gdn_decode_fused_kernel", 51_949.0),
               ("void cublasLt::splitKreduce_kernel<32, 16, int, float>", 2_263.0),
               ("_paged_decode_kernel", 14_304.0), ("_paged_decode_reduce_kernel", 800.0),
               ("_norm_rope_kernel", 714.0), ("_store_kv_kernel", 387.0), ("_add_rms_norm_kernel", 6_182.0),
               ("_silu_mul_kernel", 3_982.0), ("void at::native::index_elementwise_kernel<128, 4>", 9_380.0),
               ("Memcpy HtoD (Pinned -> Device)", 435.0), ("_causal_conv1d_fwd_kernel", 30.0),
               ("_mamba2_recurrent_kernel", 60.0), ("_fused_moe_kernel", 90.0), ("something_new", 3.0)]
    got = profile_step.families(kernels, steps=30)
    assert got == pytest.approx({
        "GEMMs": (71_125 + 2_263) / 30e3, "GDN (and fla chunk kernels)": 51_949 / 30e3,
        "attention": (14_304 + 800 + 714 + 387) / 30e3, "torch eager (indexing, copies, sampling)": 9_380 / 30e3,
        "norms, activations, FP8 quantization": (6_182 + 3_982) / 30e3, "memcpy, memset": 435 / 30e3,
        "conv": 30 / 30e3, "Mamba2": 60 / 30e3, "MoE": 90 / 30e3, "other": 3 / 30e3})
    assert list(got)[:2] == ["GEMMs", "GDN (and fla chunk kernels)"]  # largest first
    text = profile_step.format_families(got)
    assert text.splitlines()[0] == "kernel time by family:" and "GEMMs" in text.splitlines()[1]


def _write_trace(path: Path, events: list[tuple[str, str, float]]) -> None:
    """A torch.profiler Chrome trace of ``(category, name, duration us)`` events, gzipped where the name says so."""
    import gzip

    trace = {"traceEvents": [{"ph": "X", "cat": cat, "name": name, "ts": i, "dur": dur}
                             for i, (cat, name, dur) in enumerate(events)] + [{"ph": "M", "name": "process_name"}]}
    data = json.dumps(trace).encode()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)


def test_step_profile_is_the_decode_steps_difference_of_two_traces(tmp_path: Path) -> None:
    """The profile measure's arithmetic: kernels summed by name from each trace (CPU events left out, kernels of one
    name added up), the prefill-only run subtracted from the run with 24 more steps, over 24, by family (vLLM's
    kernel names among them)."""
    import peer_bench

    first, whole = tmp_path / "a.pt.trace.json", tmp_path / "b.pt.trace.json.gz"
    _write_trace(first, [("kernel", "nvjet_sm90_tst_64x8", 600.0), ("kernel", "nvjet_sm90_tst_64x8", 400.0),
                         ("kernel", "chunk_gated_delta_rule_fwd_kernel_h", 300.0), ("cpu_op", "aten::mm", 9e6)])
    _write_trace(whole, [("kernel", "nvjet_sm90_tst_64x8", 1000.0 + 24 * 50), ("kernel",
                          "chunk_gated_delta_rule_fwd_kernel_h", 300.0),
                         ("kernel", "fused_recurrent_gated_delta_rule_packed_decode_kernel", 24 * 30.0),
                         ("kernel", "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", 24 * 5.0),
                         ("kernel", "_causal_conv1d_update_kernel", 24 * 4.0),
                         ("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 24 * 1.0), ("cpu_op", "aten::mm", 9e6)])
    assert peer_bench.trace_kernel_us(str(first)) == {"nvjet_sm90_tst_64x8": 1000.0,
                                                      "chunk_gated_delta_rule_fwd_kernel_h": 300.0}
    got = peer_bench.step_profile(peer_bench.trace_kernel_us(str(first)), peer_bench.trace_kernel_us(str(whole)), 24)
    assert got["kernel_ms_per_step"] == pytest.approx((50 + 30 + 5 + 4 + 1) / 1e3)
    assert got["families_ms_per_step"] == pytest.approx({
        "GEMMs": 0.05, "GDN (and fla chunk kernels)": 0.03, "torch.compile fused kernels": 0.005, "conv": 0.004,
        "memcpy, memset": 0.001})
    assert got["top_kernels_us_per_step"][0] == ["nvjet_sm90_tst_64x8", 50.0]


def test_vllm_profiled_reads_the_trace_its_engine_core_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's side of ``Engine.profiled``: its profiler is configured at construction (the engine core's worker
    writes one trace a start/stop), and the measure reads the trace that call wrote, not an older one."""
    import types

    import peer_bench

    made: dict[str, object] = {}

    class FakeLLM:
        def __init__(self, model: str, dtype: str, **kw: object) -> None:
            made.update(kw)

        def start_profile(self) -> None:
            made["started"] = True

        def stop_profile(self) -> None:
            _write_trace(tmp_path / "prof" / "EngineCore_0.200.pt.trace.json.gz",
                         [("kernel", "fused_recurrent_gated_delta_rule_packed_decode_kernel", 7.0)])

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=FakeLLM, SamplingParams=dict,
                                                                  __version__="stand-in"))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "qwen3_5_text"}))
    (tmp_path / "prof").mkdir()
    _write_trace(tmp_path / "prof" / "EngineCore_0.100.pt.trace.json.gz", [("kernel", "older_kernel", 9.0)])
    eng = peer_bench.Engine("vllm", str(tmp_path / "m"), "cuda", "bfloat16", profile_dir=str(tmp_path / "prof"))
    config = made["profiler_config"]
    assert isinstance(config, dict) and config["profiler"] == "torch"
    assert config["torch_profiler_dir"] == str(tmp_path / "prof") and config["ignore_frontend"] is True
    assert eng.profiled(lambda: None) == {"fused_recurrent_gated_delta_rule_packed_decode_kernel": 7.0}
    assert made["started"] is True
    plain = peer_bench.Engine("vllm", str(tmp_path / "m"), "cuda", "bfloat16")
    with pytest.raises(RuntimeError, match="profile_dir"):
        plain.profiled(lambda: None)


def test_plot_step_families_reads_both_engines_profiles(tmp_path: Path) -> None:
    """``plot_step_families.py`` takes the profile measure's files (their ``profiles``) beside profile_step.py's."""
    import plot_step_families

    peer = {"engine": "vllm", "profiles": [{"batch": 64, "label": "vllm, batch 64",
                                            "families_ms_per_step": {"GEMMs": 6.0, "conv": 0.2}}]}
    ours = [{"batch": 64, "families_ms_per_step": {"GEMMs": 6.1}}]
    (tmp_path / "v.json").write_text(json.dumps(peer))
    (tmp_path / "h.json").write_text(json.dumps(ours))
    got = plot_step_families.bars([str(tmp_path / "h.json"), str(tmp_path / "v.json")])
    assert got == [("batch 64", {"GEMMs": 6.1}), ("vllm, batch 64", {"GEMMs": 6.0, "conv": 0.2})]


@pytest.mark.slow  # 14 s: benchmark tooling, the suite's budget
def test_profile_step_and_decode_plot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import plot_decode
    import profile_step

    out = tmp_path / "prof"
    # --extra's max_model_len takes the engine's (the peer runs' model length sizes the decode attention's launches)
    monkeypatch.setattr(sys, "argv", ["profile_step.py", "--device", "cpu", "--batch", "1,3", "--steps", "3",
                                      "--prompt-len", "16", "--extra", '{"max_model_len": 512}', "--out", str(out)])
    profile_step.main()
    torch.set_num_threads(1)
    runs = json.loads((out / "profile_step.json").read_text())
    assert [r["batch"] for r in runs] == [1, 3]
    for r in runs:
        assert r["wall_ms_per_step"] > 0 and r["kernel_ms_per_step"] is None  # no device kernels on the CPU
        assert "llm_engine.py" in r["cprofile"] and "(step)" in r["cprofile"]
    results = {"device": "test", "copy_bandwidth_Bps": 4e12, "2b_params": 2e9, "transformers_generate_bs1_tok_s": 10.0,
               "decode_bs1_tok_s": 400.0}
    (tmp_path / "gpu_check.json").write_text(json.dumps(results))
    png = tmp_path / "decode.png"
    monkeypatch.setattr(sys, "argv", ["plot_decode.py", str(tmp_path / "gpu_check.json"), "--eager",
                                      str(out / "profile_step.json"), "--out", str(png)])
    plot_decode.main()
    assert png.stat().st_size > 1000


def test_host_overhead_measures_each_kind(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import host_overhead

    from hyserve.worker import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "EMULATE", False)  # main() turns it on; monkeypatch restores it after
    monkeypatch.setattr(sys, "argv", ["host_overhead.py", "--batches", "2", "--steps", "3"])
    host_overhead.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| decode") or
            line.startswith("| speculative")]
    assert len(rows) == 3 and all(float(r.split("|")[3]) > 0 for r in rows)  # decode, MTP, MTP with rows behind


@pytest.mark.slow  # 20 s: benchmark tooling, the suite's budget
def test_multi_gpu_check_runs_tp2_and_pp2_on_the_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The 2-GPU script on the CPU (gloo) with a tiny checkpoint: T=2 and P=2 agree with one rank, and every number
    is there."""
    import multi_gpu_check

    from hyserve.testing import write_tiny_checkpoint

    model = write_tiny_checkpoint(tmp_path / "m")
    monkeypatch.setattr(sys, "argv", ["multi_gpu_check.py", "--device", "cpu", "--dtype", "float32", "--model", model,
                                      "--batches", "1,4", "--max-tokens", "8", "--prefill-len", "64",
                                      "--num-prefill", "2", "--out", str(tmp_path)])
    assert multi_gpu_check.main() == 0
    res = json.loads((tmp_path / "multi_gpu_check.json").read_text())
    assert set(res["correctness"]) == {"tp2", "pp2"}
    for check in res["correctness"].values():
        assert check["pass"] and all(p["agree_tokens"] == 8 for p in check["prompts"])
    for tp in ("tp1", "tp2", "pp2"):
        assert res[tp]["prefill_tok_s"] > 0 and res[tp]["decode_bs1_tok_s"] > 0 and res[tp]["decode_bs4_tok_s"] > 0


def test_multi_gpu_check_fails_a_parting_that_is_not_a_near_tie() -> None:
    import multi_gpu_check

    one = [{"token_ids": [1, 2, 3], "margins": [5.0, 0.1, 5.0]}, {"token_ids": [4, 5], "margins": [5.0, 5.0]}]
    assert multi_gpu_check.compare(one, [{"token_ids": [1, 2, 9]}, {"token_ids": [4, 5]}], 0.25)["pass"] is False
    assert multi_gpu_check.compare(one, [{"token_ids": [1, 7, 9]}, {"token_ids": [4, 5]}], 0.25)["pass"] is True


@pytest.mark.slow  # about 20 s of benchmark tooling (the suite's budget)
def test_peer_bench_writes_measures_and_reports_on_the_cpu(tmp_path: Path) -> None:
    """The side-by-side script's hyserve half on a tiny VLM-form checkpoint it writes (vision tower, MTP layer,
    processor files), then its report against a stand-in peer file: both figures and the ratio per measure, with
    lower-is-better measures inverted."""
    import subprocess

    script = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "peer_bench.py")
    model, out = str(tmp_path / "m"), tmp_path / "hyserve.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, script, "write", "--shape", "tiny", "--out", model, "--device", "cpu"],
                   check=True, env=env, capture_output=True)
    for name in ("preprocessor_config.json", "video_preprocessor_config.json", "mtp.safetensors"):
        assert (tmp_path / "m" / name).is_file()
    subprocess.run([sys.executable, script, "measure", "--engine", "hyserve", "--model", model, "--device", "cpu",
                    "--dtype", "float32", "--out", str(out), "--measures", "decode,prefill,agent,profile",
                    "--batches", "1,2", "--profile-batches", "1,2", "--profile-steps", "3",
                    "--decode-tokens", "12", "--decode-prompt-len", "16", "--prefill-prompts", "2",
                    "--prefill-len", "48", "--agent-scale", "tiny", "--max-model-len", "2048"],
                   check=True, env=env, capture_output=True)
    mtp_out = tmp_path / "hyserve_mtp.json"  # a second process: the warm start, the agent trace with MTP
    subprocess.run([sys.executable, script, "measure", "--engine", "hyserve", "--model", model, "--device", "cpu",
                    "--dtype", "float32", "--out", str(mtp_out), "--measures", "start,agent", "--agent-scale", "tiny",
                    "--max-model-len", "2048", "--speculative-config",
                    '{"method": "mtp", "num_speculative_tokens": 2}'], check=True, env=env, capture_output=True)
    mtp_figs = json.loads(mtp_out.read_text())["figures"]
    assert mtp_figs["start_warm_s"] > 0 and mtp_figs["agent_mtp_wall_s"] > 0 and "agent_wall_s" not in mtp_figs
    assert 1 <= mtp_figs["agent_mtp_mean_acceptance_length"] <= 3
    ours = json.loads(out.read_text())
    figs = ours["figures"]
    assert figs["decode_bs1_tok_s"] > 0 and figs["prefill_tok_s"] > 0 and figs["agent_wall_s"] > 0
    assert 0 < figs["agent_cached_share"] < 1  # the shared prefix and earlier turns hit
    # the profile measure's hyserve branch: torch.profiler in this process; the CPU runs no device kernels
    assert [(p["batch"], p["steps"], p["skipped_steps"], p["kernel_ms_per_step"]) for p in ours["profiles"]] == [
        (1, 3, 8, 0.0), (2, 3, 8, 0.0)]
    peer = dict(ours, engine="vllm", version="stand-in",
                figures={"prefill_tok_s": figs["prefill_tok_s"] / 2, "agent_wall_s": figs["agent_wall_s"] * 4})
    (tmp_path / "vllm.json").write_text(json.dumps(peer))
    failed = dict(peer, figures={}, errors={"agent": "ValueError: not supported"})
    (tmp_path / "vllm_agent.json").write_text(json.dumps(failed))
    subprocess.run([sys.executable, script, "report", str(out), str(mtp_out), str(tmp_path / "vllm.json"),
                    str(tmp_path / "vllm_agent.json"), "--out", str(tmp_path / "rep")],
                   check=True, env=env, capture_output=True)
    entries = {e["measure"]: e for e in json.loads((tmp_path / "rep" / "peer.json").read_text())["entries"]}
    assert entries["prefill_tok_s"]["ratio"] == pytest.approx(2.0)
    assert entries["agent_wall_s"]["ratio"] == pytest.approx(4.0)  # lower is better: vLLM's wall / ours
    assert entries["decode_bs1_tok_s"]["vllm"] is None and entries["decode_bs1_tok_s"]["ratio"] is None
    assert entries["agent_mtp_wall_s"]["hyserve"] == mtp_figs["agent_mtp_wall_s"]  # the files of one engine merge
    assert entries["start_warm_s"]["hyserve"] == mtp_figs["start_warm_s"]
    assert entries["agent"]["label"] == "vllm failed: ValueError: not supported"  # a failure is a row, not a gap
    assert "| m | prefill 32 x 2048, tok/s |" in (tmp_path / "rep" / "peer.md").read_text()


@pytest.mark.slow  # 30 s: benchmark tooling, the suite's budget
def test_peer_bench_quantizes_and_measures_fp8_on_the_cpu(tmp_path: Path) -> None:
    """The FP8 half of the side-by-side script: a written checkpoint quantized (compressed-tensors FP8_DYNAMIC), the
    quantized copy measured with the FP8 KV cache on the agent trace; the report labels the FP8 KV rows."""
    import subprocess

    from safetensors import safe_open

    script = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "peer_bench.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    src, fp8 = str(tmp_path / "m"), str(tmp_path / "m_fp8")
    subprocess.run([sys.executable, script, "write", "--shape", "tiny", "--out", src, "--device", "cpu"],
                   check=True, env=env, capture_output=True)
    subprocess.run([sys.executable, script, "quantize", "--src", src, "--out", fp8, "--format", "ct_dynamic"],
                   check=True, env=env, capture_output=True)
    config = json.loads((tmp_path / "m_fp8" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    with safe_open(str(tmp_path / "m_fp8" / "model.safetensors"), framework="pt") as f:
        dtypes = {n: f.get_slice(n).get_dtype() for n in f.keys()}
    assert dtypes["model.language_model.layers.0.mlp.down_proj.weight"] == "F8_E4M3"
    assert "model.language_model.layers.0.mlp.down_proj.weight_scale" in dtypes
    out = tmp_path / "fp8.json"
    subprocess.run([sys.executable, script, "measure", "--engine", "hyserve", "--model", fp8, "--device", "cpu",
                    "--dtype", "float32", "--out", str(out), "--measures", "decode,agent", "--batches", "1",
                    "--decode-tokens", "12", "--decode-prompt-len", "16", "--agent-scale", "tiny",
                    "--max-model-len", "2048", "--kv-cache-dtype", "fp8"], check=True, env=env, capture_output=True)
    figs = json.loads(out.read_text())["figures"]
    assert figs["decode_bs1_tok_s"] > 0 and 0 < figs["agent_kvfp8_cached_share"] < 1
    subprocess.run([sys.executable, script, "report", str(out), "--out", str(tmp_path / "rep")], check=True, env=env,
                   capture_output=True)
    report = (tmp_path / "rep" / "peer.md").read_text()
    assert "| m_fp8 | agent trace, FP8 KV cache, prompt tokens from cache |" in report


def test_fp8_check_fails_only_a_parting_where_bf16_was_sure() -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    from fp8_check import compare

    base = [([1, 2, 3], [{1: -0.1, 9: -3.0}, {2: -0.7, 8: -0.8}, {3: -0.1, 7: -4.0}]),
            ([4, 5], [{4: -0.2, 6: -2.5}, {5: -0.1, 6: -3.0}])]
    near_tie = [([1, 8, 3], [{1: -0.12}, {8: -0.6}, {3: -0.1}]), ([4, 5], [{4: -0.2}, {5: -0.15}])]
    res = compare(base, near_tie, clear_margin=0.5)
    assert res["pass"] and res["near_tie_partings"] == 1 and res["clear_margin_partings"] == 0
    assert res["tokens_agreed_before_parting"] == 3 / 5
    assert abs(res["chosen_logprob_max_abs_diff"] - 0.05) < 1e-9
    sure = [([1, 2, 3], [{1: -0.1}, {2: -0.7}, {3: -0.1}]), ([6, 5], [{6: -0.2}, {5: -0.1}])]
    res = compare(base, sure, clear_margin=0.5)
    assert not res["pass"] and res["clear_margin_partings"] == 1


@pytest.mark.slow  # about 7 s: the suite's budget (the planted acceptance is checked by default)
def test_spec_decode_bench_draws_the_acceptance_with_synthetic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    """``--synthetic``: each draft token's verdict drawn at the rate (the speculative config's synthetic method),
    whatever the drafts (the random MTP head's own here): at 1 every draft is accepted, at 0 none, in between about
    the rate's walk."""
    model = str(tmp_path / "m")
    shapes.write_random_checkpoint(model, SMALL, device="cpu", mtp=True)
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["spec_decode_bench.py", "--model", model, "--device", "cpu", "--batches", "2",
                                      "--max-tokens", "40", "--prompt-len", "16", "--rates", "0,0.7,1",
                                      "--synthetic", "--shared-engines", "--out", str(out)])
    assert spec_decode_bench.main() == 0
    rows = {r["acceptance_target"]: r for r in json.loads((out / "spec_decode.json").read_text())["rows"]}
    assert rows[0.0]["draft_acceptance"] == 0.0 and rows[1.0]["draft_acceptance"] == 1.0
    k = spec_decode_bench.build_parser().get_default("k")  # k + 1 a step, less where a request's end cuts drafts
    assert k + 0.5 < rows[1.0]["mean_tokens_per_step"] <= k + 1
    # at 0.7 a draft is kept if it and those before it are drawn: (0.7 + 0.49 + 0.343) / 3 = 0.51 in expectation
    assert 0.3 < rows[0.7]["draft_acceptance"] < 0.75
    assert all(r["outputs_identical"] is None for r in rows.values())
    assert spec_decode_bench.synthetic_spec({"method": "mtp", "num_speculative_tokens": 2}, 0.5) == {
        "method": "mtp", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic",
        "synthetic_acceptance_rates": [0.5, 0.25]}


def test_ptx_count_reads_the_conv_paths_instructions() -> None:
    """``ptx_count.py`` compiles the conv's two prefill paths for sm_90 as a launch specializes them: the block
    inside a row takes vectorized loads only and fewer instructions an output than the row's first block, which
    reads the window element by element."""
    pytest.importorskip("triton")
    import ptx_count

    inside, first = ptx_count.conv_report([(32, 128, 4)])
    assert inside["path"] == "inside a row" and inside["warp_instr_per_output"] < first["warp_instr_per_output"]
    assert inside["memory"].get("ld.global.v4.b32", 0) >= 4 and first["memory"].get("ld.global.b16", 0) > 64


def test_ptx_count_reports_the_gdn_decode_launches_registers_and_buffered_tiles() -> None:
    """``ptx_count.py --gdn-decode``: the 9B's walk compiled as the card specializes it holds no state tile in shared
    memory, the persistent launch at 3 stages buffers two ahead; neither spills; two programs an SM by registers."""
    pytest.importorskip("triton")
    import ptx_count

    walk, persist = ptx_count.gdn_decode_report(["walk 128 x 4", "persistent 128 x 4, 3 stages"])
    assert walk["launch"] == "walk 128 x 4" and walk["state_tiles_buffered"] == []
    assert persist["state_tiles_buffered"] == [2] and persist["shared_bytes"] > 2 * 128 * 128 * 2
    for row in (walk, persist):
        assert row["spill_stores"] == row["spill_loads"] == 0 and 128 < row["registers"] <= 255
        assert row["programs_an_sm_by_registers"] == 2


def test_ptx_count_reports_the_gdn_verify_launch() -> None:
    """``ptx_count.py --gdn-verify``: the engine's verify launch (32 x 4) on a bf16 state compiled with the verify's
    own card values (scratch and stash strides among them), without spills."""
    pytest.importorskip("triton")
    import ptx_count

    (row,) = ptx_count.gdn_verify_report([("bf16", 32, 4)])
    assert row["launch"] == "verify bf16 state, 32 x 4" and row["spill_stores"] == row["spill_loads"] == 0
    assert 64 < row["registers"] <= 255 and row["programs_an_sm_by_registers"] >= 2


@pytest.mark.slow  # budget: a benchmark script; the shared-memory handoff tests stay
def test_step_handoff_bench_times_both_ways() -> None:
    """``step_handoff_bench.py``: a step with a screenshot's pixels sent to a worker process through the pipe and
    through the executor's step pickler (shared memory), the worker's reading of the pixels checked both ways."""
    import subprocess

    root = Path(__file__).parents[2]
    proc = subprocess.run([sys.executable, "benchmarks/step_handoff_bench.py", "--repeat", "1"], cwd=root,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for how in ("pipe: send", "pipe: answered", "shared memory, fresh: send", "shared memory, pooled: answered"):
        assert f"  {how} " in proc.stdout, proc.stdout
    assert "leaked" not in proc.stderr, proc.stderr  # the resource tracker names segments never unlinked


@pytest.mark.slow  # about 80 s of the interpreter
def test_fp8_gemm_bench_smoke_at_chosen_rows(tmp_path: Path) -> None:
    """``fp8_gemm_bench.py --cpu-smoke --rows``: the chosen row counts alone, every layer's GEMM within FP8
    rounding of the reference, and each row's cuBLASLt rate and time per row."""
    import subprocess

    root = Path(__file__).parents[2]
    out = tmp_path / "fp8_gemm.json"
    proc = subprocess.run([sys.executable, "benchmarks/fp8_gemm_bench.py", "--cpu-smoke", "--rows", "70",
                           "--no-sweep", "--out", str(out)], cwd=root, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, TRITON_INTERPRET="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert rows and {r["m"] for r in rows} == {70}
    for r in rows:
        assert r["triton_rel_err"] < 0.1 and r["scaled_mm_us_per_row"] > 0 and r["scaled_mm_tflops"] > 0, r

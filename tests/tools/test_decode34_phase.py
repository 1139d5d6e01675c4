"""``benchmarks/peer_session.sh decode34`` / ``decode34-vllm`` / ``decode34-split`` / ``decode34-layout`` /
``decode34-upfront`` / ``decode34-persist`` (issue 34's decode and prefill pairs, the GDN decode's two launches, the
GDN state's two layouts, the walk's two forms, the persistent launch) with ``python3`` a recorder:
which runs each phase makes, on which directory, with which switch in the environment, each command parsed by
peer_bench.py's own parser; a run marked done is not made again."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import peer_bench

SESSION = Path(__file__).parents[2] / "benchmarks" / "peer_session.sh"
RECORDER = """#!/usr/bin/env bash
# one call a line: the switches, then the arguments, NUL-separated
printf '%s' "${HYSERVE_DECODE_GEMM-unset},${HYSERVE_FP8_FUSED_QUANT-unset},${VLLM_ENABLE_V1_MULTIPROCESSING-unset}" \\
    >> "$CALLS"
printf ',%s,%s,%s,%s' "${HYSERVE_GDN_DECODE_SPLIT-unset}" "${HYSERVE_GDN_STATE_LAYOUT-unset}" \\
    "${HYSERVE_GDN_DECODE_UPFRONT-unset}" "${HYSERVE_GDN_DECODE_PERSIST-unset}" >> "$CALLS"
for a in "$@"; do printf '\\0%s' "$a" >> "$CALLS"; done
printf '\\n' >> "$CALLS"
"""


def _run(tmp_path: Path, phase: str, *args: str, script: str = "benchmarks/peer_bench.py",
         env_extra: dict[str, str] | None = None) -> list[tuple[str, list[str]]]:
    bin_dir, out, calls = tmp_path / "bin", tmp_path / "out", tmp_path / "calls"
    bin_dir.mkdir(exist_ok=True)
    out.mkdir(exist_ok=True)
    (bin_dir / "python3").write_text(RECORDER)
    (bin_dir / "python3").chmod(0o755)
    calls.write_bytes(b"")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(out), "CALLS": str(calls),
           "HOME": str(tmp_path), "MOE_DONE": str(tmp_path / "done"), **(env_extra or {})}
    for var in ("VLLM_ENABLE_V1_MULTIPROCESSING", "HYSERVE_DECODE_GEMM", "HYSERVE_FP8_FUSED_QUANT",
                "HYSERVE_GDN_DECODE_SPLIT", "HYSERVE_GDN_STATE_LAYOUT", "HYSERVE_GDN_DECODE_UPFRONT",
                "HYSERVE_GDN_DECODE_PERSIST"):
        env.pop(var, None)
    subprocess.run(["bash", str(SESSION), phase, *args], check=True, env=env, cwd=SESSION.parents[1],
                   capture_output=True)
    recorded = []
    for line in calls.read_bytes().decode().splitlines():
        switches, *argv = line.split("\0")
        if argv and argv[0] == script and argv[1] == "measure":
            recorded.append((switches, argv))
    return recorded


def test_decode34_runs_the_defaults_the_bf16_states_and_the_switch(tmp_path: Path) -> None:
    calls = _run(tmp_path, "decode34")
    parsed = [(s, peer_bench.build_parser().parse_args(a[1:])) for s, a in calls]
    runs = [(s, Path(p.out).name, p.model, p.measures, p.load_format) for s, p in parsed]
    unset = ",".join(["unset"] * 7)
    assert runs == [
        (unset, "hyserve_9b.json", "/tmp/p9b", "decode,bound,prefill", "auto"),
        (unset, "hyserve_9b_bf16state.json", "/tmp/p9b", "decode,bound", "auto"),
        (unset, "hyserve_27b_fp8.json", "/tmp/s27", "decode,bound,prefill", "dummy"),
        (unset, "hyserve_27b_fp8_bf16state.json", "/tmp/s27", "decode,bound", "dummy"),
        ("unset,0,unset,unset,unset,unset,unset", "hyserve_27b_fp8_unfused.json", "/tmp/s27", "decode,bound", "dummy"),
    ]
    assert all(p.batches == "1,8,32,64" and p.engine == "hyserve" for _, p in parsed)
    # the GDN state in the model's dtype, as vLLM's default stores it, in those runs alone
    assert [p.mamba_ssm_cache_dtype for _, p in parsed] == [None, "auto", None, "auto", None]
    (tmp_path / "done").mkdir(exist_ok=True)
    (tmp_path / "done" / "hyserve_9b").touch()  # done in an earlier call on this machine
    assert [Path(a[a.index("--out") + 1]).name for _, a in _run(tmp_path, "decode34")] == [
        "hyserve_9b_bf16state.json", "hyserve_27b_fp8.json", "hyserve_27b_fp8_bf16state.json",
        "hyserve_27b_fp8_unfused.json"]


def test_decode34_vllm_runs_its_default_mode_on_the_same_directories(tmp_path: Path) -> None:
    calls = _run(tmp_path, "decode34-vllm")
    parsed = [(s, peer_bench.build_parser().parse_args(a[1:])) for s, a in calls]
    assert [(s, p.engine, p.model, p.load_format) for s, p in parsed] == [
        ("unset,unset,unset,unset,unset,unset,unset", "vllm", "/tmp/p9b", "auto"),
        ("unset,unset,unset,unset,unset,unset,unset", "vllm", "/tmp/s27", "dummy")]
    # no FlashInfer GDN prefill module on this machine: vLLM's Triton prefill (its JIT outlasted a call)
    assert [p.vllm_gdn_prefill_backend for _, p in parsed] == ["triton", "triton"]
    built = tmp_path / ".cache" / "flashinfer" / "90" / "gdn_prefill_sm90.so"
    built.parent.mkdir(parents=True)
    built.touch()
    again = [peer_bench.build_parser().parse_args(a[1:]) for _, a in _run(tmp_path, "decode34-vllm")]
    assert [p.vllm_gdn_prefill_backend for p in again] == [None, None]  # its default, FlashInfer


def test_prefill34_profiles_both_shapes_and_times_the_conv(tmp_path: Path) -> None:
    """``prefill34``: the conv's prefill bench, then the prefill profile (with its device gaps) on the 2B and the 9B
    directory, each into its own folder of ``$OUT``."""
    _run(tmp_path, "prefill34")
    argvs = [line.split("\0")[1:] for line in (tmp_path / "calls").read_bytes().decode().splitlines()]
    conv = [a for a in argvs if a and a[0] == "benchmarks/conv_prefill_bench.py"]
    assert [a[a.index("--out") + 1] for a in conv] == [str(tmp_path / "out")]
    profiles = [a for a in argvs if a and a[0] == "benchmarks/profile_prefill.py"]
    assert [(a[a.index("--model") + 1], Path(a[a.index("--out") + 1]).name) for a in profiles] == [
        ("/tmp/p2b", "prefill_2b"), ("/tmp/p9b", "prefill_9b")]


def _switch_runs(tmp_path: Path, phase: str, field: int) -> list[tuple[str, str, str, str, str, str | None]]:
    """A switch phase's runs: (the switch at ``field`` of the recorded environment, JSON name, model, measures, load
    format, state dtype); every one hyserve's at batch 1 / 8 / 32 / 64."""
    parsed = [(s, peer_bench.build_parser().parse_args(a[1:])) for s, a in _run(tmp_path, phase)]
    assert all(p.batches == "1,8,32,64" and p.engine == "hyserve" for _, p in parsed)
    return [(s.split(",")[field], Path(p.out).name, p.model, p.measures, p.load_format, p.mamba_ssm_cache_dtype)
            for s, p in parsed]


def test_decode34_split_runs_the_two_gdn_launches_on_bf16_states(tmp_path: Path) -> None:
    assert _switch_runs(tmp_path, "decode34-split", 3) == [
        ("0", "hyserve_9b_bf16state_walk.json", "/tmp/p9b", "decode,bound", "auto", "auto"),
        ("1", "hyserve_9b_bf16state_split.json", "/tmp/p9b", "decode,bound", "auto", "auto"),
        ("0", "hyserve_27b_fp8_bf16state_walk.json", "/tmp/s27", "decode,bound", "dummy", "auto"),
        ("1", "hyserve_27b_fp8_bf16state_split.json", "/tmp/s27", "decode,bound", "dummy", "auto"),
    ]


def test_decode34_layout_runs_the_two_gdn_state_layouts_on_bf16_states(tmp_path: Path) -> None:
    assert _switch_runs(tmp_path, "decode34-layout", 4) == [
        ("key", "hyserve_9b_bf16state_key.json", "/tmp/p9b", "decode,bound", "auto", "auto"),
        ("value", "hyserve_9b_bf16state_value.json", "/tmp/p9b", "decode,bound", "auto", "auto"),
        ("key", "hyserve_27b_fp8_bf16state_key.json", "/tmp/s27", "decode,bound", "dummy", "auto"),
        ("value", "hyserve_27b_fp8_bf16state_value.json", "/tmp/s27", "decode,bound", "dummy", "auto"),
    ]
    # the launch switch left to the engine's rule
    assert {s.split(",")[3] for s, _ in _run(tmp_path, "decode34-layout")} == {"unset"}


def test_decode34_upfront_runs_the_walks_two_forms_on_bf16_states(tmp_path: Path) -> None:
    assert _switch_runs(tmp_path, "decode34-upfront", 5) == [
        ("0", "hyserve_9b_bf16state_asis.json", "/tmp/p9b", "decode,bound", "auto", "auto"),
        ("1", "hyserve_9b_bf16state_upfront.json", "/tmp/p9b", "decode,bound", "auto", "auto"),
        ("0", "hyserve_27b_fp8_bf16state_asis.json", "/tmp/s27", "decode,bound", "dummy", "auto"),
        ("1", "hyserve_27b_fp8_bf16state_upfront.json", "/tmp/s27", "decode,bound", "dummy", "auto"),
    ]
    # the launch and the layout left to the engine's rule and default
    assert {tuple(s.split(",")[3:5]) for s, _ in _run(tmp_path, "decode34-upfront")} == {("unset", "unset")}


def test_decode34_persist_runs_the_engine_without_the_persistent_launch_beside_its_rule(tmp_path: Path) -> None:
    assert _switch_runs(tmp_path, "decode34-persist", 6) == [
        ("0", "hyserve_9b_bf16state_launches.json", "/tmp/p9b", "decode,bound", "auto", "auto"),
        ("unset", "hyserve_9b_bf16state_rule.json", "/tmp/p9b", "decode,bound", "auto", "auto"),
        ("0", "hyserve_27b_fp8_bf16state_launches.json", "/tmp/s27", "decode,bound", "dummy", "auto"),
        ("unset", "hyserve_27b_fp8_bf16state_rule.json", "/tmp/s27", "decode,bound", "dummy", "auto"),
    ]
    # the other switches left to the engine's rule and defaults
    assert {tuple(s.split(",")[3:6]) for s, _ in _run(tmp_path, "decode34-persist")} == {("unset",) * 3}


def test_profile34_profiles_both_engines_on_the_9b_with_bf16_states(tmp_path: Path) -> None:
    """``profile34``: hyserve's then vLLM's decode step profile on the 9B directory, batch 1 and 64, the GDN state in
    bf16 (vLLM's like), vLLM in its default mode (no in-process switch); ``profile34 vllm`` runs vLLM's alone, and a
    run marked done is not made again."""
    calls = _run(tmp_path, "profile34")
    parsed = [(s, peer_bench.build_parser().parse_args(a[1:])) for s, a in calls]
    assert [(s, p.engine, p.model, Path(p.out).name) for s, p in parsed] == [
        (",".join(["unset"] * 7), "hyserve", "/tmp/p9b", "hyserve_9b_profile.json"),
        (",".join(["unset"] * 7), "vllm", "/tmp/p9b", "vllm_9b_profile.json")]
    assert all((p.measures, p.profile_batches, p.mamba_ssm_cache_dtype) == ("profile", "1,64", "auto")
               for _, p in parsed)
    assert [p.engine for _, p in parsed if p.vllm_gdn_prefill_backend == "triton"] == ["vllm"]
    assert [peer_bench.build_parser().parse_args(a[1:]).engine for _, a in _run(tmp_path, "profile34", "vllm")] == [
        "vllm"]
    (tmp_path / "done").mkdir(exist_ok=True)
    (tmp_path / "done" / "vllm_9b_profile").touch()  # done in an earlier call on this machine
    assert _run(tmp_path, "profile34", "vllm") == []
    assert [peer_bench.build_parser().parse_args(a[1:]).engine for _, a in _run(tmp_path, "profile34")] == [
        "hyserve"]


def test_seed_passes_its_engine_flags_as_one_argument(tmp_path: Path) -> None:
    """``SEED_ENGINE_FLAGS`` reaches seed_bench.py as one ``--engine-flags`` value (word-split, it would be read as
    flags of seed_bench.py itself), beside ``SEED_ARGS``' own arguments; without it, no ``--engine-flags``."""
    import seed_bench

    flags = "--mamba-ssm-cache-dtype auto --snapshot-memory-fraction 0.35"
    calls = _run(tmp_path, "seed", script="benchmarks/seed_bench.py",
                 env_extra={"SEED_ENGINE_FLAGS": flags, "SEED_ARGS": "--k 0", "SEED_NAME": "seed_bf16"})
    [(_, argv)] = calls
    args = seed_bench.build_parser().parse_args(argv[1:])
    got = (args.engine, args.engine_flags, args.k, Path(args.out).name)
    assert got == ("hyserve", flags, 0, "hyserve_seed_bf16.json")
    [(_, argv)] = _run(tmp_path, "seed", script="benchmarks/seed_bench.py")
    assert "--engine-flags" not in argv

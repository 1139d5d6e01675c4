"""The CPU checks of the kernel benches a device session runs: ``attention_decode_bench.py --check`` (the paged
decode kernel against the reference with every split live and with splits past the rows' context, under the
interpreter), ``gdn_state_bench.py --check`` (the delta rule in both state layouts against its reference) and
``gdn_decode_bench.py``'s launch argument."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import gdn_decode_bench

ROOT = Path(__file__).parents[2]


@pytest.mark.slow  # 45 s of the default run's budget; the kernels' own interpreter tests keep every path
def test_attention_decode_bench_check_agrees_with_the_reference() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "benchmarks/attention_decode_bench.py", "--check"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # both forms ran: the rows' own length (two splits) and a graph's model length (four, two of them empty)
    assert "max_seq_len 601:" in proc.stdout and "max_seq_len 2000:" in proc.stdout, proc.stdout


@pytest.mark.slow  # budget: a benchmark script's check
def test_gdn_state_bench_check_agrees_with_the_reference() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "benchmarks/gdn_state_bench.py", "--check"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    # three head shapes, each layout: the rule within float32 rounding of the reference, the copy leaving the pool
    assert len(lines) == 6 and sum("layout v" in line for line in lines) == 3, proc.stdout
    assert all("copy intact True" in line for line in lines), proc.stdout


def test_gdn_decode_bench_reads_value_block_by_warps() -> None:
    parse = gdn_decode_bench.parse_launch
    assert parse("64x8") == (64, 8, False, False, False, False, 0, False)
    assert parse("32") == (32, 4, False, False, False, False, 0, False)  # the shipped warps
    assert parse("32x1") == (32, 1, False, False, False, False, 0, False)  # one warp, not one pass
    assert parse("32x1s") == (32, 1, True, False, False, False, 0, False)  # heads split
    assert parse("64x4se") == (64, 4, True, True, False, False, 0, False)  # split, state tile first
    assert parse("64x4s1") == (64, 4, True, False, True, False, 0, False)  # one pass
    assert parse("32x1se1") == (32, 1, True, True, True, False, 0, False)
    assert parse("128x4u") == (128, 4, False, False, False, True, 0, False)  # the walk, loads first
    assert parse("128x8u").kwargs() == dict(
        block_v=128, num_warps=8, split=False, early_state=False, one_pass=False, upfront=True, persist=False, stages=3,
        roll_inside=False)
    assert parse("128x4p") == (128, 4, False, False, False, False, 3, False)  # persistent, 3 stages
    assert parse("128x4p2").kwargs()["stages"] == 2
    assert parse("128x4p2").kwargs()["persist"] is True
    assert gdn_decode_bench.name(32, 4) == "bv32" and gdn_decode_bench.name(128, 16) == "bv128w16"
    assert gdn_decode_bench.name(32, 4, True) == "bv32w4s" and gdn_decode_bench.name(32, 1, True) == "bv32w1s"
    assert gdn_decode_bench.name(64, 4, True, True) == "bv64w4se"
    assert gdn_decode_bench.name(64, 4, True, False, True) == "bv64w4s1"
    assert gdn_decode_bench.name(128, 4, upfront=True) == "bv128u"
    assert gdn_decode_bench.name(128, 8, upfront=True) == "bv128w8u"
    assert gdn_decode_bench.name(128, 4, persist=3) == "bv128p3"
    # one stage, the windows rolled in the loop (no second launch)
    assert parse("128x4p1r") == (128, 4, False, False, False, False, 1, True)
    assert parse("128x4p1r").kwargs()["roll_inside"] is True
    assert gdn_decode_bench.name(*gdn_decode_bench.parse_launch("128x4p1r")) == "bv128p1r"
    for bad in ("48x4", "64x6", "0x4", "32x1ss", "32x1e", "32x1see", "32x1s11", "32x1e1", "64x4su", "128x4uu",
                "64x4sp", "128x4up", "128x4p0", "128x4pp", "128x4p3r", "128x4r", "128x4ur"):
        with pytest.raises(SystemExit, match=r"powers of two|BVxWs|forms of the walk|already the UPFRONT|one stage"):
            gdn_decode_bench.parse_launch(bad)


def test_plot_decode_pair_reads_both_files_by_batch(tmp_path: Path) -> None:
    import json

    import plot_decode_pair

    a = {"engine": "hyserve", "figures": {"decode_bs1_tok_s": 150.0, "decode_bs64_tok_s": 7000.0, "bound_bs1_tok_s": 1}}
    b = {"engine": "vllm", "figures": {"decode_bs1_tok_s": 100.0, "decode_bs8_tok_s": 900.0, "decode_bs64_tok_s": 7e3}}
    for name, run in (("a.json", a), ("b.json", b)):
        (tmp_path / name).write_text(json.dumps(run))
    assert plot_decode_pair.decode_figures(str(tmp_path / "a.json")) == ("hyserve", {1: 150.0, 64: 7000.0})
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for labels in ([], ["--labels", "value-major", "key-major"]):
        proc = subprocess.run([sys.executable, "benchmarks/plot_decode_pair.py", str(tmp_path / "a.json"),
                               str(tmp_path / "b.json"), "--out", str(tmp_path / "p.png"), *labels], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and (tmp_path / "p.png").stat().st_size > 0, proc.stderr
        (tmp_path / "p.png").unlink()


def test_plot_step_families_stacks_each_runs_families(tmp_path: Path) -> None:
    import json

    import plot_step_families

    runs = [{"batch": 1, "families_ms_per_step": {"GEMMs": 5.6, "attention": 0.1}},
            {"batch": 64, "label": "b64", "families_ms_per_step": {"GEMMs": 6.1, "GDN": 1.7}},
            {"batch": 3, "families_ms_per_step": None}]  # a CPU run: no kernels, no bar
    (tmp_path / "a.json").write_text(json.dumps(runs))
    assert plot_step_families.bars([str(tmp_path / "a.json")]) == [
        ("batch 1", {"GEMMs": 5.6, "attention": 0.1}), ("b64", {"GEMMs": 6.1, "GDN": 1.7})]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "benchmarks/plot_step_families.py", str(tmp_path / "a.json"), "--out",
           str(tmp_path / "s.png")]
    for extra, ok in (([], True), (["--labels", "one", "two"], True), (["--labels", "one"], False)):
        proc = subprocess.run([*cmd, *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert (proc.returncode == 0) == ok, proc.stderr
    assert (tmp_path / "s.png").stat().st_size > 0
    (tmp_path / "b.json").write_text(json.dumps(runs[2:]))
    proc = subprocess.run([*cmd[:2], str(tmp_path / "b.json"), *cmd[3:]], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "families_ms_per_step" in proc.stderr


def test_gdn_decode_bench_value_major_pool_is_the_same_view() -> None:
    import torch

    from hyserve.kernels.gdn.decode import as_value_major

    t = torch.randn(3, 2, 4, 6)
    v = as_value_major(t)
    assert torch.equal(v, t) and v.stride() == (48, 24, 1, 4)  # each head's (Dk, Dv) state stored transposed
    assert v.clone().stride() == v.stride()  # the bench's pool copies keep the layout they time


def test_plot_gdn_layout_takes_the_launch_each_layouts_rule_picks(tmp_path: Path) -> None:
    import json

    import plot_gdn_layout

    def row(batch: int, layout: str, **times: float) -> dict:
        return {"shape": "9b", "batch": batch, "layout": layout, **{f"fused_{k}_us": v for k, v in times.items()}}

    rows = [row(1, "k", bv32w2s=7.0, bv32=11.0, bv64w4s=8.0), row(8, "k", bv32w2s=16.0, bv32=14.0, bv64w4s=17.0),
            row(64, "k", bv32w2s=130.0, bv32=113.0, bv64w4s=97.0),
            row(1, "v", bv128=6.0, bv64=8.0), row(8, "v", bv128=9.0, bv64=10.0), row(64, "v", bv128=76.0, bv64=78.0)]
    (tmp_path / "b.json").write_text(json.dumps({"rows": rows}))
    assert plot_gdn_layout.chosen_times(str(tmp_path / "b.json"), "k") == {
        ("9b", 1): 7.0, ("9b", 8): 14.0, ("9b", 64): 97.0}  # split 32 x 2, walk, split 64 x 4
    assert plot_gdn_layout.chosen_times(str(tmp_path / "b.json"), "v") == {
        ("9b", 1): 6.0, ("9b", 8): 9.0, ("9b", 64): 78.0}  # the walk, 128 wide up to 256 pairs, 64 beyond
    (tmp_path / "short.json").write_text(json.dumps({"rows": [row(64, "v", bv128=76.0)]}))
    with pytest.raises(SystemExit, match="did not time fused_bv64_us"):
        plot_gdn_layout.chosen_times(str(tmp_path / "short.json"), "v")

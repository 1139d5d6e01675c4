"""``hyserve bench``: offline on a tiny checkpoint it writes the result JSON with the documented keys, consistent
numbers and a plot; percentiles; the plot is skipped with a message without matplotlib; ``--url`` against an
in-process fake server (streamed completions)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

import pytest

from hyserve.testing.families import CheckpointCache
from hyserve.tools import bench

DOCUMENTED_KEYS = {
    "backend", "model", "url", "num_prompts", "input_len", "output_len", "concurrency", "temperature", "completed",
    "failed", "duration_s", "total_input_tokens", "total_output_tokens", "request_throughput", "output_throughput",
    "total_token_throughput", "ttfts", "tpots", "e2els", "input_lens", "output_lens", "errors", "engine", "metrics",
} | {f"{s}_{m}_ms" for s in ("mean", "median", "p50", "p90", "p99") for m in ("ttft", "tpot", "e2el")}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hyserve")
    bench.register(p.add_subparsers(dest="command", required=True))
    return p


def run_bench(argv: list[str]) -> tuple[int, dict[str, Any]]:
    args = parser().parse_args(["bench", *argv])
    rc = args.func(args)
    with open(args.result_json, encoding="utf-8") as f:
        return rc, json.load(f)


def test_help_lists_every_flag_with_its_default() -> None:
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    for action in sub.choices["bench"]._actions:
        if action.option_strings and action.dest != "help":
            assert action.help and "default" in action.help.lower(), action.option_strings


def test_percentile_interpolates_like_numpy() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]
    assert bench.percentile(xs, 50) == 2.5
    assert bench.percentile(xs, 0) == 1.0 and bench.percentile(xs, 100) == 4.0
    assert math.isclose(bench.percentile(xs, 90), 3.7)
    assert math.isnan(bench.percentile([], 50))
    r = bench.build_result([bench.RequestTiming(10, 1, 0.1, 0.1), bench.RequestTiming(10, error="boom")], 1.0,
                           backend="offline")
    assert r["completed"] == 1 and r["failed"] == 1 and r["mean_tpot_ms"] is None and r["tpots"] == []


def test_offline_bench_writes_the_documented_json_and_a_plot(ckpts: CheckpointCache, tmp_path, capsys) -> None:
    path = ckpts.get()
    png = tmp_path / "b.png"
    rc, r = run_bench([path, "--num-prompts", "6", "--input-len", "24", "--output-len", "5", "--concurrency", "4",
                       "--max-num-batched-tokens", "40", "--result-json", str(tmp_path / "b.json"),
                       "--plot", str(png)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert DOCUMENTED_KEYS <= set(r), DOCUMENTED_KEYS - set(r)
    assert r["backend"] == "offline" and r["completed"] == 6 and r["failed"] == 0 and r["concurrency"] == 4
    assert r["output_lens"] == [5] * 6 and r["total_output_tokens"] == 30 and r["total_input_tokens"] == 144
    assert len(r["ttfts"]) == len(r["tpots"]) == len(r["e2els"]) == 6
    assert all(0 < t <= e for t, e in zip(r["ttfts"], r["e2els"]))
    for m in ("ttft", "tpot", "e2el"):
        assert 0 < r[f"p50_{m}_ms"] <= r[f"p90_{m}_ms"] <= r[f"p99_{m}_ms"]
        assert r[f"median_{m}_ms"] == r[f"p50_{m}_ms"]
    assert math.isclose(r["output_throughput"], 30 / r["duration_s"])
    assert math.isclose(r["request_throughput"], 6 / r["duration_s"])
    assert r["metrics"]["hyserve:generation_tokens"] == 30 and r["engine"]["max_num_batched_tokens"] == 40
    assert "Output token throughput (tok/s)" in out and "P99 TTFT (ms)" in out
    pytest.importorskip("matplotlib")
    assert png.stat().st_size > 0


def test_plot_is_skipped_without_matplotlib(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    r = bench.build_result([bench.RequestTiming(10, 3, 0.1, 0.3)], 1.0, backend="offline")
    assert bench.plot(r, str(tmp_path / "x.png")) is False
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "x.png")


def test_bench_against_a_server(ckpts: CheckpointCache, tmp_path, monkeypatch) -> None:
    pytest.importorskip("httpx")
    from test_soak import FakeServer, use_fake_server

    from hyserve import LLM

    path = ckpts.get()
    server = FakeServer(LLM(path))
    use_fake_server(monkeypatch, bench, server)
    rc, r = run_bench(["--url", "http://fake:8000", "--vocab-size", "400", "--num-prompts", "4", "--input-len", "16",
                       "--output-len", "3", "--concurrency", "2", "--result-json", str(tmp_path / "s.json")])
    assert rc == 0, r["errors"]
    assert r["backend"] == "server" and r["completed"] == 4 and r["output_lens"] == [3] * 4
    assert r["served_model_name"] == "tiny" and server.num_completions == 5  # 4 + the warm-up
    assert r["mean_ttft_ms"] is not None and r["mean_tpot_ms"] is not None and r["metrics"] is None

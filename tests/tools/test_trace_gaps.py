"""``benchmarks/trace_gaps.py``: the device's idle gaps in a profiler trace, each put down to its cause. Synthetic
traces in the chrome format torch's profiler writes (kernels with their launch's correlation id, the runtime and
driver calls, the host ops), with one gap of each kind planted at a known place and length, and a real trace of the
CPU profiler (no device events) read without error."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import trace_gaps

TID = 11


def op(name: str, ts: float, dur: float) -> dict[str, Any]:
    return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": TID, "ts": ts, "dur": dur}


def launch(corr: int, ts: float, name: str = "cudaLaunchKernel", cat: str = "cuda_runtime") -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": TID, "ts": ts, "dur": 2.0,
            "args": {"correlation": corr}}


def kernel(corr: int, ts: float, dur: float, cat: str = "kernel") -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": f"k{corr}", "pid": 0, "tid": 7, "ts": ts, "dur": dur,
            "args": {"correlation": corr, "stream": 7}}


def planted() -> list[dict[str, Any]]:
    """Kernels 1-6 on one stream. Gaps: 1 -> 2 none (back to back); 2 -> 3: 40 us, the host in ``aten::item`` in a
    stream sync that returned inside the gap, then launching from ``aten::index_select`` (a sync); 3 -> 4: 100 us, the
    host busy in ``hyserve::prepare`` when the device ran dry, launching from ``aten::mm`` after it (the host);
    4 -> 5: 30 us, launched long before, started late (the device); 5 -> 6 a 3 us gap, under the threshold; 6 a copy
    launched by a Triton kernel's driver call after the device ran dry."""
    ev: list[dict[str, Any]] = []
    ev += [op("aten::mm", 0, 5), launch(1, 1), kernel(1, 10, 50)]
    ev += [op("aten::mm", 6, 5), launch(2, 7), kernel(2, 60, 40)]                # busy 10 .. 100
    ev += [op("aten::item", 20, 125), {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "pid": 1,
                                       "tid": TID, "ts": 22, "dur": 110}]         # returns at 132, in the gap
    ev += [op("aten::index_select", 136, 6), launch(3, 138), kernel(3, 140, 20)]  # gap 100 .. 140 (40 us): sync
    ev += [op("hyserve::prepare", 150, 105), op("aten::mm", 258, 5), launch(4, 259)]
    ev += [kernel(4, 260, 30)]                                                   # gap 160 .. 260 (100 us): host
    ev += [op("aten::add", 265, 4), launch(5, 266), kernel(5, 320, 10)]         # gap 290 .. 320 (30 us): device
    ev += [op("triton_launch", 330, 4), launch(6, 331, "cuLaunchKernelEx", "cuda_driver")]
    ev += [kernel(6, 333, 5, "gpu_memcpy")]                                      # gap 330 .. 333 (3 us): ignored
    return ev


def test_each_planted_gap_is_found_and_put_down_to_its_cause() -> None:
    rep = trace_gaps.device_gaps(planted(), min_gap_us=5.0)
    assert rep["gaps"] == 3
    assert rep["window_us"] == pytest.approx(328.0)
    assert rep["busy_us"] == pytest.approx(50 + 40 + 20 + 30 + 10 + 5)
    assert rep["idle_us"] == pytest.approx(328.0 - 155.0)
    assert rep["by_kind_us"] == pytest.approx({"host": 100.0, "sync": 40.0, "device": 30.0})
    rows = {r["kind"]: r for r in rep["top"]}
    assert [r["kind"] for r in rep["top"]] == ["host", "sync", "device"]  # the largest first
    assert rows["host"]["launched_by"] == "aten::mm" and rows["host"]["host_at_idle"] == "hyserve::prepare"
    assert rows["sync"]["launched_by"] == "aten::index_select"
    assert rows["sync"]["host_at_idle"] == "aten::item (cudaStreamSynchronize)"
    assert rows["device"]["launched_by"] == "aten::add" and rows["device"]["count"] == 1
    text = trace_gaps.format_gaps(rep)
    assert "hyserve::prepare" in text and "sync" in text


def test_the_device_time_by_kernel_and_family() -> None:
    """Each kernel's summed duration and count, largest first, in its family (names as ``kernel_families.py``
    sorts them); the copy is a memcpy."""
    ev = planted()
    names = {1: "nvjet_sm90_tst_192x64", 2: "chunk_gated_delta_rule_fwd", 3: "nvjet_sm90_tst_192x64",
             4: "paged_attention_prefill", 5: "rms_norm_kernel", 6: "Memcpy DtoH (Device -> Pinned)"}
    for e in ev:
        if e.get("cat") in ("kernel", "gpu_memcpy"):
            e["name"] = names[e["args"]["correlation"]]
    rep = trace_gaps.device_gaps(ev, top_kernels=3)
    assert rep["top_kernels"] == [
        {"name": "nvjet_sm90_tst_192x64", "family": "GEMMs", "us": 70.0, "count": 2},
        {"name": "chunk_gated_delta_rule_fwd", "family": "GDN (and fla chunk kernels)", "us": 40.0, "count": 1},
        {"name": "paged_attention_prefill", "family": "attention", "us": 30.0, "count": 1}]
    assert rep["device_us_by_family"] == {"GEMMs": 70.0, "GDN (and fla chunk kernels)": 40.0, "attention": 30.0,
                                          "norms, activations, FP8 quantization": 10.0, "memcpy, memset": 5.0}


def test_the_device_time_by_the_annotation_that_launched_it() -> None:
    """Each kernel goes to the innermost ``hyserve::`` range the host was in at its launch (by correlation id): a
    prompt step launched kernels 1 and 3, the vision tower inside it kernel 2, a decode step kernels 4 and 5; the
    copy was launched outside any, and a range of another name does not count."""
    ev = planted()
    note = {"ph": "X", "cat": "user_annotation", "pid": 1, "tid": TID}
    ev += [note | {"name": "hyserve::step(prompt)", "ts": 0, "dur": 140},
           note | {"name": "hyserve::vision", "ts": 5, "dur": 4},
           note | {"name": "hyserve::step(decode)", "ts": 250, "dur": 30},
           note | {"name": "other", "ts": 328, "dur": 9}]
    rep = trace_gaps.device_gaps(ev)
    by = rep["device_us_by_annotation"]
    assert {n: v["us"] for n, v in by.items()} == {"hyserve::step(prompt)": 70.0, "hyserve::vision": 40.0,
                                                   "hyserve::step(decode)": 40.0, trace_gaps.UNATTRIBUTED: 5.0}
    assert list(by) == ["hyserve::step(prompt)", "hyserve::vision", "hyserve::step(decode)", trace_gaps.UNATTRIBUTED]
    assert [k["name"] for k in by["hyserve::step(decode)"]["top_kernels"]] == ["k4", "k5"]
    assert "hyserve::vision" in trace_gaps.format_gaps(rep)


def test_a_lower_threshold_counts_the_short_gap() -> None:
    rep = trace_gaps.device_gaps(planted(), min_gap_us=1.0)
    assert rep["gaps"] == 4
    assert rep["by_kind_us"]["host"] == pytest.approx(103.0)  # the copy's launch came after the device ran dry


def test_overlapping_streams_are_busy_time_not_gaps() -> None:
    """A kernel on a second stream that runs inside another's span leaves no gap and adds no busy time twice."""
    ev = [launch(1, 0), kernel(1, 10, 100), launch(2, 1), kernel(2, 20, 30), launch(3, 2), kernel(3, 110, 10)]
    rep = trace_gaps.device_gaps(ev)
    assert rep["gaps"] == 0 and rep["busy_us"] == pytest.approx(110.0) and rep["idle_us"] == pytest.approx(0.0)


def test_a_cpu_only_profile_reads_as_no_device_time(tmp_path: Any) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(8).add_(1).sum()
    rep = trace_gaps.gaps_of_profile(prof, str(tmp_path / "t.json"))
    assert rep["gaps"] == 0 and rep["window_us"] == 0.0 and rep["top"] == []


def test_flash_attention_is_attention_though_its_name_says_cutlass() -> None:
    """FlashAttention's prefill kernel names ``cutlass::bfloat16_t`` among its template arguments: it is attention,
    not a GEMM (the 2026-12-07 seed profile filed 0.20 s of it under GEMMs); cutlass's GEMMs stay GEMMs."""
    from kernel_families import family_of

    flash = ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<256, 64, 64, 4, false, false, "
             "cutlass::bfloat16_t, Flash_kernel_traits<256, 64, 64, 4, cutlass::bfloat16_t> >, false, true>")
    assert family_of(flash) == "attention"
    assert family_of("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128") == "attention"
    assert family_of("cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8") == "GEMMs"
    assert family_of("nvjet_sm90_qqtst_128x128_128x6_1x1_h_bz_coopA_algo2_ovscale_TNT") == "GEMMs"

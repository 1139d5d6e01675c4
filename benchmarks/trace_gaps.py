"""Where the device sat idle in a torch profiler trace, and why: the gaps between its kernels (and copies), each
put down to the host (the next kernel was launched after the device had run dry), to a host sync (the host was
waiting on the device, then launched late), or to the device (launched in time, started late: a wait between
streams, a full launch queue), with the host op that launched the kernel after the gap and the one the host was in
when the device ran dry.

A trace profiled with ``ProfilerActivity.CPU`` and ``CUDA`` (``prof.export_chrome_trace(path)``, then
:func:`device_gaps` over its ``traceEvents``): ``profile_step.py`` and ``profile_prefill.py`` print and save it.
What a piecewise CUDA graph would close is the ``host`` share (launch cost and host work between launches); a
``sync`` gap closes only where the sync goes.

Note: the profiler's CPU-side recording costs a few microseconds per op, so ``host`` gaps are somewhat larger under
it than in an unprofiled run.

    python benchmarks/trace_gaps.py trace.json [--min-gap-us 5]
"""

from __future__ import annotations

import argparse
import bisect
import json
from collections import defaultdict
from typing import Any

__all__ = ["GapReport", "device_gaps", "format_gaps"]

GapReport = dict[str, Any]

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_API_CATS = ("cuda_runtime", "cuda_driver")
HOST_OP_CATS = ("cpu_op", "user_annotation")
# Host calls that block until the device (or a stream, or an event) is done.
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize")


def _is_sync(name: str) -> bool:
    return name in SYNC_CALLS


class _Ops:
    """The host ops of one thread, for "which op was the host in at time t" (the innermost one that holds t)."""

    def __init__(self, ops: list[dict[str, Any]]) -> None:
        self.ops = sorted(ops, key=lambda e: (e["ts"], -e.get("dur", 0.0)))
        self.starts = [e["ts"] for e in self.ops]

    def innermost(self, t: float, scan: int = 4000) -> str | None:
        i = bisect.bisect_right(self.starts, t) - 1
        seen = 0
        while i >= 0 and seen < scan:  # the latest-starting op that still runs at t is the innermost one
            e = self.ops[i]
            if e["ts"] + e.get("dur", 0.0) >= t:
                return str(e["name"])
            i -= 1
            seen += 1
        return None


def device_gaps(events: list[dict[str, Any]], min_gap_us: float = 5.0, top: int = 15,
                top_kernels: int = 30) -> GapReport:
    """The device's idle time in ``events`` (a chrome trace's ``traceEvents``), gap by gap of at least
    ``min_gap_us``, summed by cause and by host op; and its busy time by kernel family and kernel
    (:func:`device_time`). Times in microseconds."""
    dev = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS),
                 key=lambda e: e["ts"])
    if not dev:
        return {"window_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "gaps": 0, "by_kind_us": {}, "top": [],
                "device_us_by_family": {}, "top_kernels": [], "device_us_by_annotation": {}}
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in HOST_API_CATS and isinstance(e.get("args"), dict) and "correlation" in e["args"]}
    syncs_by_tid: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("cat") in HOST_API_CATS and _is_sync(str(e.get("name"))):
            syncs_by_tid[e.get("tid")].append(e)
    ops_by_tid: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in HOST_OP_CATS:
            ops_by_tid[e.get("tid")].append(e)
    ops = {tid: _Ops(v) for tid, v in ops_by_tid.items()}

    busy = 0.0
    end = dev[0]["ts"]
    first = dev[0]["ts"]
    by_kind: dict[str, float] = defaultdict(float)
    by_cause: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    n_gaps = 0
    for e in dev:
        start, stop = e["ts"], e["ts"] + e.get("dur", 0.0)
        gap = start - end
        if gap >= min_gap_us:
            n_gaps += 1
            kind, launched_by, host_at_idle = _cause(e, end, launches, syncs_by_tid, ops)
            by_kind[kind] += gap
            acc = by_cause[(kind, launched_by, host_at_idle)]
            acc[0] += gap
            acc[1] += 1
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    window = end - first
    rows = sorted(by_cause.items(), key=lambda kv: -kv[1][0])[:top]
    return {"window_us": window, "busy_us": busy, "idle_us": window - busy, "gaps": n_gaps,
            "min_gap_us": min_gap_us, "by_kind_us": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
            "top": [{"kind": k, "launched_by": lb, "host_at_idle": hi, "us": v[0], "count": v[1]}
                    for (k, lb, hi), v in rows]} | device_time(dev, top_kernels) | \
        device_time_by_annotation(dev, launches, events)


ANNOTATION_PREFIX = "hyserve::"  # the runner's record_function ranges: a step by its kind, the vision tower
UNATTRIBUTED = "(no hyserve annotation)"


def device_time_by_annotation(dev: list[dict[str, Any]], launches: dict[Any, dict[str, Any]],
                              events: list[dict[str, Any]], top: int = 8) -> dict[str, Any]:
    """The device time of ``dev`` by the innermost ``hyserve::`` annotation (``torch.profiler.record_function``) the
    host was in when it launched each kernel (its launch found by correlation id; a CUDA graph's kernels by the
    graph's launch): per annotation, the summed microseconds, the kernel families and the ``top`` kernels."""
    notes_by_tid: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and \
                str(e.get("name", "")).startswith(ANNOTATION_PREFIX):
            notes_by_tid[e.get("tid")].append(e)
    notes = {tid: _Ops(v) for tid, v in notes_by_tid.items()}
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in dev:
        corr = e.get("args", {}).get("correlation") if isinstance(e.get("args"), dict) else None
        launch = launches.get(corr)
        ops = notes.get(launch.get("tid")) if launch is not None else None
        name = ops.innermost(launch["ts"]) if ops is not None and launch is not None else None
        groups[name or UNATTRIBUTED].append(e)
    out = {}
    for name, evs in sorted(groups.items(), key=lambda kv: -sum(e.get("dur", 0.0) for e in kv[1])):
        t = device_time(evs, top)
        out[name] = {"us": sum(e.get("dur", 0.0) for e in evs), "by_family": t["device_us_by_family"],
                     "top_kernels": t["top_kernels"]}
    return {"device_us_by_annotation": out}


def device_time(dev: list[dict[str, Any]], top: int) -> dict[str, Any]:
    """What the device ran in ``dev`` (its kernels, copies and sets): the summed durations by kernel family
    (``kernel_families.py``) and the ``top`` kernels by summed duration (names cut to 120 characters), in
    microseconds. Kernels on two streams at once both count, so the sum may exceed the busy time."""
    from kernel_families import family_of

    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in dev:
        acc = by_name[str(e.get("name"))[:120]]
        acc[0] += e.get("dur", 0.0)
        acc[1] += 1
    by_family: dict[str, float] = defaultdict(float)
    for name, (us, _) in by_name.items():
        by_family[family_of(name)] += us
    kernels = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {"device_us_by_family": dict(sorted(by_family.items(), key=lambda kv: -kv[1])),
            "top_kernels": [{"name": n, "family": family_of(n), "us": v[0], "count": v[1]} for n, v in kernels]}


def _cause(e: dict[str, Any], idle_from: float, launches: dict[Any, dict[str, Any]],
           syncs_by_tid: dict[Any, list[dict[str, Any]]], ops: dict[Any, _Ops]) -> tuple[str, str, str]:
    """(kind, the host op that launched ``e``, the host op at ``idle_from``) of the gap that ends at ``e``."""
    corr = e.get("args", {}).get("correlation") if isinstance(e.get("args"), dict) else None
    launch = launches.get(corr)
    if launch is None:
        return "unknown", "?", "?"
    tid = launch.get("tid")
    thread_ops = ops.get(tid)
    launched_by = (thread_ops.innermost(launch["ts"]) if thread_ops else None) or str(launch.get("name"))
    host_at_idle = (thread_ops.innermost(idle_from) if thread_ops else None) or "?"
    if launch["ts"] < idle_from:
        return "device", launched_by, host_at_idle
    for s in syncs_by_tid.get(tid, ()):  # a sync that returned while the device was idle: the host had waited
        s_end = s["ts"] + s.get("dur", 0.0)
        if idle_from <= s_end <= launch["ts"]:
            in_op = (thread_ops.innermost(s["ts"]) if thread_ops else None) or str(s.get("name"))
            return "sync", launched_by, f"{in_op} ({s.get('name')})"
    return "host", launched_by, host_at_idle


def format_gaps(report: GapReport) -> str:
    """A short table of :func:`device_gaps`' report."""
    ms = 1e3
    lines = [f"device window {report['window_us'] / ms:.2f} ms, busy {report['busy_us'] / ms:.2f} ms, idle "
             f"{report['idle_us'] / ms:.2f} ms in {report['gaps']} gaps of >= {report.get('min_gap_us', 0)} us"]
    for kind, us in report["by_kind_us"].items():
        lines.append(f"  {kind:8s} {us / ms:9.2f} ms")
    lines.append("  kind      ms      gaps  launched by  |  host at idle")
    for row in report["top"]:
        lines.append(f"  {row['kind']:8s} {row['us'] / ms:7.2f} {row['count']:6d}  {row['launched_by'][:50]}  |  "
                     f"{row['host_at_idle'][:60]}")
    lines.append("device time by annotation (ms), its largest kernel families")
    for name, part in report.get("device_us_by_annotation", {}).items():
        fams = ", ".join(f"{f} {us / ms:.1f}" for f, us in list(part["by_family"].items())[:4])
        lines.append(f"  {name[:40]:40s} {part['us'] / ms:9.2f}  {fams}")
    return "\n".join(lines)


def trace_events(path: str) -> list[dict[str, Any]]:
    """The ``traceEvents`` of a Chrome trace from torch.profiler, ``.json`` or gzipped ``.json.gz``."""
    import gzip

    with (gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else open(path, encoding="utf-8")) as f:
        return list(json.load(f).get("traceEvents", []))


def gaps_of_profile(prof: Any, path: str, min_gap_us: float = 5.0) -> GapReport:
    """Export ``prof`` (a finished ``torch.profiler.profile`` with CPU and CUDA activities) to ``path`` and read
    its gaps."""
    prof.export_chrome_trace(path)
    return device_gaps(trace_events(path), min_gap_us)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--min-gap-us", type=float, default=5.0)
    args = ap.parse_args()
    print(format_gaps(device_gaps(trace_events(args.trace), args.min_gap_us)))


if __name__ == "__main__":
    main()

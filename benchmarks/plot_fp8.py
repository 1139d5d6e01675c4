"""Plot of benchmarks/fp8_gemm_bench.py's results: the linear layers' time of one forward per kernel and row count,
against the weights' read time at the copy bandwidth (the bound), for each model shape.

    python benchmarks/plot_fp8.py benchmarks/results/h200/fp8_2026-12-01/fp8_gemm.json \\
        --bandwidth 4.158e12 --out benchmarks/results/h200/fp8_gemm.png
"""

from __future__ import annotations

import argparse
import json
from typing import Any

KERNELS = {  # label: (time keys summed per projection)
    "bf16 (cuBLAS)": ("bf16_us",),
    "FP8 channel, Triton GEMM": ("quant_us", "triton_us"),
    "FP8 channel, cuBLASLt": ("quant_us", "scaled_mm_us"),
    "FP8 128x128 block, Triton GEMM": ("quant_group_us", "triton_block_us"),
    "FP8 channel, Triton GEMM quantizing in its loop": ("triton_fused_us",),  # decode row counts only
}


def totals(rows: list[dict[str, Any]], shape: str, bandwidth: float) -> dict[str, dict[int, float]]:
    """``{label: {M: microseconds of one forward's projections}}``, plus the FP8 and bf16 bounds."""
    out: dict[str, dict[int, float]] = {k: {} for k in (*KERNELS, "FP8 bound", "bf16 bound")}
    for r in rows:
        if r["shape"] != shape:
            continue
        m, layers = r["m"], r["layers"]
        for label, keys in KERNELS.items():
            if all(k in r for k in keys):
                out[label][m] = out[label].get(m, 0.0) + sum(r[k] for k in keys) * layers
        read = r["n"] * r["k"] * layers / bandwidth * 1e6
        out["FP8 bound"][m] = out["FP8 bound"].get(m, 0.0) + read
        out["bf16 bound"][m] = out["bf16 bound"].get(m, 0.0) + 2 * read
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    ap.add_argument("--bandwidth", type=float, required=True, help="copy bandwidth, bytes/s (read + write)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(args.results) as f:
        data = json.load(f)
    shapes = sorted({r["shape"] for r in data["rows"]})
    fig, axes = plt.subplots(1, len(shapes), figsize=(6.5 * len(shapes), 4.6))
    for ax, shape in zip(axes if len(shapes) > 1 else [axes], shapes, strict=True):
        t = totals(data["rows"], shape, args.bandwidth)
        ms = sorted(t["bf16 (cuBLAS)"])
        base = [t["bf16 (cuBLAS)"][m] for m in ms]
        for label in KERNELS:
            points = [(i, t[label][m] / base[i]) for i, m in enumerate(ms) if m in t[label]]
            if points:
                ax.plot(*zip(*points, strict=True), "-o", label=label)
        decode = [i for i, m in enumerate(ms) if m <= 64]  # the weights' read bounds decode only; prefill computes
        ax.plot(decode, [t["FP8 bound"][ms[i]] / base[i] for i in decode], "--", label="FP8 weights' read time")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(range(len(ms)), [str(m) for m in ms])
        ax.set_xlabel("rows (tokens) per GEMM")
        ax.set_ylabel("time of one forward's projections / bf16's")
        ax.set_title(f"{shape} shape: linear layers, {data['device']}")
        ax.set_ylim(0, 1.8)
        ax.grid(alpha=0.3)
    fig.axes[0].legend(fontsize=8, loc="upper left")
    fig.suptitle(f"FP8 GEMMs against bf16 (torch {data['torch']}, triton {data['triton']}; lower is faster)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()

"""Plot issue 31's H200 figures: the fused MoE kernels' expert-weight bandwidth by token count, and the 35B-A3B
shape's decode throughput beside its batch-1 bound.

    python benchmarks/plot_moe.py benchmarks/results/h200/moe_2026-12-03
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main(folder: Path) -> None:
    kernels = json.loads((folder / "moe_kernels.json").read_text())["rows"]
    runs = {name: json.loads((folder / f"hyserve_{name}.json").read_text())["figures"]
            for name in ("35b_a3b", "35b_a3b_fp8") if (folder / f"hyserve_{name}.json").exists()}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for shape in sorted({r["shape"] for r in kernels}):
        for dtype in sorted({r["dtype"] for r in kernels}):
            rows = [r for r in kernels if r["shape"] == shape and r["dtype"] == dtype]
            if rows:
                ax1.plot([r["tokens"] for r in rows], [r["bandwidth_gb_s"] for r in rows], marker="o",
                         label=f"{shape} {dtype}")
    ax1.set_xscale("log")
    ax1.set_xlabel("tokens in the step")
    ax1.set_ylabel("chosen experts' weight bytes / time, GB/s")
    ax1.set_title("one MoE layer's routed experts (CUDA graph replay)")
    ax1.legend(fontsize=8)
    batches = [1, 8, 32, 64]
    width = 0.38
    for i, (name, f) in enumerate(runs.items()):
        xs = [j + (i - 0.5) * width for j in range(len(batches))]
        ax2.bar(xs, [f[f"decode_bs{b}_tok_s"] for b in batches], width, label=f"hyserve {name}")
        ax2.hlines(f["bound_bs1_tok_s"], xs[0] - width / 2, xs[0] + width / 2, colors="k", linestyles="--")
    ax2.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax2.set_ylabel("decode tok/s (prompt 512)")
    ax2.set_title("35B-A3B shape, dummy weights (dashes: batch-1 bound)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / "moe.png", dpi=110)


if __name__ == "__main__":
    main(Path(sys.argv[1]))

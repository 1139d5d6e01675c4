"""Bar chart of batch-1 decode speed on the 2B shape from a ``gpu_check.py`` results file (and, optionally, a
``profile_step.py`` eager run): transformers ``generate``, hyserve eager, hyserve with CUDA graphs, the
weights-bandwidth bound.

    python benchmarks/plot_decode.py benchmarks/results/h200/gpu_check_graphs.json \
        --eager benchmarks/results/h200/profile_step_eager_bs1.json --out benchmarks/results/h200/decode_bs1.png
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gpu_check")
    ap.add_argument("--eager", default=None, help="profile_step.py results of an enforce_eager run at batch 1")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    with open(args.gpu_check) as f:
        r = json.load(f)
    bound = r["copy_bandwidth_Bps"] / (r["2b_params"] * 2)
    bars = [("transformers\ngenerate", r["transformers_generate_bs1_tok_s"])]
    if args.eager:
        with open(args.eager) as f:
            eager = json.load(f)[0]
        bars.append(("hyserve\neager", 1e3 / eager["wall_ms_per_step"]))
    bars += [("hyserve\nCUDA graphs", r["decode_bs1_tok_s"]), ("weights-bandwidth\nbound", bound)]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    colors = ["#999999"] * (len(bars) - 2) + ["#1f77b4", "#2ca02c"]
    ax.bar([b[0] for b in bars], [b[1] for b in bars], color=colors)
    for i, (_, v) in enumerate(bars):
        ax.text(i, v, f"{v:,.0f}\n({v / bound:.1%})", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("decode tokens/s, batch 1")
    ax.set_ylim(0, bound * 1.2)
    ax.set_title(f"Qwen3.5-2B shape, bf16, {r['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()

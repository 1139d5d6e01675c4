"""The seed's deployment in several engine configurations: requests/s and prefix-cache hit rate of each
``seed_bench.py measure`` file, side by side, with each run's ratio over the last file's (the reference, e.g. vLLM's).

    python benchmarks/plot_seed_variants.py hyserve_seed.json hyserve_seed_bf16.json vllm_seed.json \
        --labels "hyserve defaults" "hyserve bf16 state" "vLLM" --title "27B FP8, H100" --out variants.png
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def seed_figures(path: str) -> dict[str, Any]:
    """The file's engine, requests/s, prefix-cache hit rate and the ideal one."""
    with open(path, encoding="utf-8") as f:
        run = json.load(f)
    fig = run["figures"]
    return {"engine": run.get("engine", path), "requests_per_s": float(fig["requests_per_s"]),
            "hit": float(fig["prefix_hit_rate"]), "ideal": float(fig.get("prefix_hit_rate_ideal", 0.0))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+", help="the last one is the reference of the ratios")
    ap.add_argument("--labels", nargs="+", help="one per file (default: each file's engine)")
    ap.add_argument("--title", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.labels and len(args.labels) != len(args.files):
        raise SystemExit(f"{len(args.labels)} labels for {len(args.files)} files")
    runs = [seed_figures(p) for p in args.files]
    labels = args.labels or [r["engine"] for r in runs]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ref = runs[-1]["requests_per_s"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    xs = range(len(runs))
    colors = ["tab:blue"] * (len(runs) - 1) + ["tab:gray"]
    bars = left.bar(xs, [r["requests_per_s"] for r in runs], color=colors)
    for bar, r in zip(bars, runs, strict=True):
        left.annotate(f"{r['requests_per_s']:.2f}\n{r['requests_per_s'] / ref:.2f}x", (bar.get_x() + 0.4,
                      bar.get_height()), ha="center", va="bottom", fontsize=8)
    left.set_ylabel("requests/s")
    left.set_ylim(0, 1.25 * max(r["requests_per_s"] for r in runs))
    bars = right.bar(xs, [r["hit"] for r in runs], color=colors)
    for bar, r in zip(bars, runs, strict=True):
        right.annotate(f"{r['hit']:.3f}", (bar.get_x() + 0.4, bar.get_height()), ha="center", va="bottom",
                       fontsize=8)
    ideal = max(r["ideal"] for r in runs)
    if ideal:
        right.axhline(ideal, color="tab:green", linestyle="--", label=f"every snapshot kept: {ideal:.3f}")
        right.legend(loc="lower right", fontsize=8)
    right.set_ylabel("prefix-cache hit rate")
    right.set_ylim(0, 0.75)
    for ax in (left, right):
        ax.set_xticks(list(xs), labels, rotation=20, ha="right", fontsize=8)
    fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()

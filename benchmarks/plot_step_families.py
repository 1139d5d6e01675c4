"""A decode step's kernel time by family, one stacked bar per profile, from ``profile_step.py``'s JSON files (their
``families_ms_per_step``), each bar labelled with its total.

    python benchmarks/plot_step_families.py step_b1.json step_b64.json --labels "batch 1" "batch 64" \
        --title "9B bf16, H100" --out step.png

``peer_bench.py measure --measures profile`` files (hyserve's or vLLM's, their ``profiles``) are read the same way.
A file may hold several runs (``--batch 1,64``): each is a bar, labelled by its ``label`` or ``batch N`` unless
``--labels`` names them all, in file order; runs without a breakdown (the CPU's) are left out.
"""

from __future__ import annotations

import argparse
import json


def bars(paths: list[str]) -> list[tuple[str, dict[str, float]]]:
    """``(label, ms per step by family)`` of every run of the files that has a family breakdown, in file order."""
    out = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            runs = json.load(f)
        if isinstance(runs, dict) and "profiles" in runs:  # peer_bench.py measure --measures profile: either engine
            runs = runs["profiles"]
        for run in runs if isinstance(runs, list) else [runs]:
            fams = run.get("families_ms_per_step")
            if fams:
                out.append((run.get("label") or f"batch {run['batch']}", {k: float(v) for k, v in fams.items()}))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--labels", nargs="+", help="one per bar, in file order")
    ap.add_argument("--title", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    runs = bars(args.files)
    if not runs:
        raise SystemExit("no run with families_ms_per_step in the files (profile_step.py on CUDA writes it)")
    if args.labels:
        if len(args.labels) != len(runs):
            raise SystemExit(f"{len(args.labels)} labels for {len(runs)} bars")
        runs = [(label, fams) for label, (_, fams) in zip(args.labels, runs)]
    families = sorted({f for _, fams in runs for f in fams}, key=lambda f: -max(fams.get(f, 0.0) for _, fams in runs))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2.0 * len(runs) + 4.5, 4.2))
    xs = range(len(runs))
    bottom = [0.0] * len(runs)
    for i, fam in enumerate(families):
        heights = [fams.get(fam, 0.0) for _, fams in runs]
        ax.bar(xs, heights, bottom=bottom, label=fam, color=f"C{i % 10}", width=0.6)
        bottom = [b + h for b, h in zip(bottom, heights)]
    for x, total in zip(xs, bottom):
        ax.text(x, total, f"{total:.2f} ms", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [label for label, _ in runs], fontsize=8)
    ax.set_ylabel("kernel ms per step")
    ax.set_title(args.title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()

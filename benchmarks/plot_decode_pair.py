"""Decode tokens/s by batch of two engines' ``peer_bench.py measure`` files, side by side, with the first's ratio
over the second above each pair (a start-time ratio would dwarf them in ``peer_bench.py report``'s chart).

    python benchmarks/plot_decode_pair.py hyserve_9b_bf16state.json vllm_9b.json --title "9B bf16, H100" \
        --out decode_9b.png
    python benchmarks/plot_decode_pair.py value.json key.json --labels value-major key-major --out layout.png
"""

from __future__ import annotations

import argparse
import json


def decode_figures(path: str) -> tuple[str, dict[int, float]]:
    """The file's engine and its ``decode_bs<N>_tok_s`` figures by batch."""
    with open(path, encoding="utf-8") as f:
        run = json.load(f)
    figures = run.get("figures", run)
    by_batch = {int(k[len("decode_bs"):-len("_tok_s")]): float(v) for k, v in figures.items()
                if k.startswith("decode_bs") and k.endswith("_tok_s")}
    return str(run.get("engine", path)), by_batch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("first")
    ap.add_argument("second")
    ap.add_argument("--title", default="")
    ap.add_argument("--labels", nargs=2, metavar=("FIRST", "SECOND"),
                    help="the two bars' names (default: each file's engine)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    (name_a, a), (name_b, b) = decode_figures(args.first), decode_figures(args.second)
    if args.labels:
        name_a, name_b = args.labels
    batches = sorted(set(a) & set(b))
    if not batches:
        raise SystemExit("no batch measured by both files")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(batches), figsize=(2.2 * len(batches) + 1, 3.2))
    for ax, n in zip(axes if len(batches) > 1 else [axes], batches, strict=True):
        ax.bar([0, 1], [a[n], b[n]], color=["tab:blue", "tab:gray"])
        ax.set_xticks([0, 1], [name_a, name_b])
        ax.set_title(f"batch {n}: {a[n] / b[n]:.2f}x", fontsize=10)
        ax.tick_params(axis="y", labelsize=8)
    axes_list = axes if len(batches) > 1 else [axes]
    axes_list[0].set_ylabel("decode tokens/s")
    fig.suptitle(args.title, fontsize=11)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()

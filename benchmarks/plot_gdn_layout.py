"""One GDN layer's decode launch by batch on the two state layouts, from ``gdn_decode_bench.py`` files: on the
key-major pool the launch ``decode_launch`` picks for it, on the value-major pool the one it picks for that, each
bar labelled with its microseconds, the value-major bar with its gain.

    python benchmarks/plot_gdn_layout.py gdn_kv.json gdn_v_sweep.json --title "bf16 states, H100" --out layout.png

The first file must hold the key-major rows (``--state-layout k``), the second the value-major ones; each must have
timed the launches the rule picks (``--launch 32x2s 32x4 64x4s`` for the key-major pool, ``64x4 128x4`` for the
value-major one).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hyserve.kernels.gdn.decode import decode_launch

HEADS = {"2b": 16, "9b": 32, "27b": 48}


def launch_key(split: bool, bv: int | None, warps: int, upfront: bool = False) -> str:
    """``gdn_decode_bench.py``'s result key of a launch (its ``name``; None is the walk's 32-wide default, or the
    head's whole width, 128, for an UPFRONT walk)."""
    bv = (128 if upfront else 32) if bv is None else bv
    return (f"fused_{f'bv{bv}' if warps == 4 and not split else f'bv{bv}w{warps}'}{'s' if split else ''}"
            f"{'u' if upfront else ''}_us")


def chosen_times(path: str, layout: str) -> dict[tuple[str, int], float]:
    """{(shape, batch): us} of the launch ``decode_launch`` picks on ``layout``'s pool."""
    with open(path, encoding="utf-8") as f:
        rows = json.load(f)["rows"]
    out = {}
    for row in rows:
        if row.get("layout", "k") != layout:
            continue
        # the layouts' launches as the rule picked them then: the walk's UPFRONT form (2026-12-06, later) came after
        key = launch_key(*decode_launch(row["batch"], HEADS[row["shape"]], value_major=layout == "v", upfront=False))
        if key not in row:
            raise SystemExit(f"{path}: {row['shape']} batch {row['batch']} did not time {key}")
        out[(row["shape"], row["batch"])] = float(row[key])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("key_major")
    ap.add_argument("value_major")
    ap.add_argument("--title", default="")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    k, v = chosen_times(args.key_major, "k"), chosen_times(args.value_major, "v")
    shapes = sorted({s for s, _ in k if (s, _) in v}, key=list(HEADS).index)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 3.4), squeeze=False)
    for ax, shape in zip(axes[0], shapes, strict=True):
        batches = sorted(b for s, b in k if s == shape and (s, b) in v)
        xs = range(len(batches))
        for off, (times, label) in zip((-0.2, 0.2), ((k, "key-major"), (v, "value-major")), strict=True):
            heights = [times[(shape, b)] for b in batches]
            bars = ax.bar([x + off for x in xs], heights, 0.4, label=label)
            for bar, b in zip(bars, batches, strict=True):
                gain = "" if times is k else f"\n{k[(shape, b)] / times[(shape, b)]:.2f}x"
                ax.annotate(f"{times[(shape, b)]:.1f}{gain}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(xs), [str(b) for b in batches])
        ax.set_xlabel("batch")
        ax.set_ylabel("us a layer")
        ax.set_title(f"{shape.upper()} heads ({HEADS[shape]})")
        ax.legend(fontsize=8)
    fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()

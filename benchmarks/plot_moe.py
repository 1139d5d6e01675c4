"""Plot issue 31's H200 figures: the fused MoE kernels' expert-weight bandwidth by token count, and the 35B-A3B
shape's decode throughput beside its batch-1 bound; issue 33's Nemotron shapes (n8b, n30) likewise.

    python benchmarks/plot_moe.py benchmarks/results/h200/moe_2026-12-03
    python benchmarks/plot_moe.py benchmarks/results/h200/mamba2_DATE --title "Nemotron shapes" --out mamba2.png
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

# The measure files' run names plotted (peer_session.sh's moe and mamba2 phases)
RUNS = ("35b_a3b", "35b_a3b_fp8", "next80b_fp8", "n8b", "n30")


def main(folder: Path, others: list[Path] | None = None, title: str = "MoE shapes", out: str = "moe.png") -> None:
    """Left: the kernels' bandwidth where ``moe_kernels.json`` is there, else prefill and the agent trace beside
    vLLM's; right: decode by batch for every engine and shape with a JSON in the folder, and for ``others`` (runs of
    another session, labelled so). A figure a run lacks (a failed measure) is left out of its bars."""
    runs = {f"{engine} {name}": json.loads(path.read_text())["figures"]
            for engine in ("hyserve", "vllm") for name in RUNS
            if (path := folder / f"{engine}_{name}.json").exists()}
    for path in others or []:
        res = json.loads(path.read_text())
        runs[f"{path.stem.replace('_', ' ', 1)} ({res.get('date', '?')}, {path.parent.name})"] = res["figures"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5))
    if (folder / "moe_kernels.json").exists():
        _kernels(ax1, json.loads((folder / "moe_kernels.json").read_text())["rows"])
    elif (folder / "moe_peer.json").exists():
        _ratios(ax1, json.loads((folder / "moe_peer.json").read_text())["entries"])
    else:
        _prefill_and_agent(ax1, folder, runs)
    batches = [1, 8, 32, 64]
    width = 0.8 / max(len(runs), 1)
    for i, (name, f) in enumerate(runs.items()):
        xs = [j + (i - (len(runs) - 1) / 2) * width for j in range(len(batches))]
        ax2.bar(xs, [f.get(f"decode_bs{b}_tok_s", float("nan")) for b in batches], width, label=name)
        if "bound_bs1_tok_s" in f:
            ax2.hlines(f["bound_bs1_tok_s"], xs[0] - width / 2, xs[0] + width / 2, colors="k", linestyles="--")
    ax2.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax2.set_ylabel("decode tok/s (prompt 512)")
    ax2.set_title(f"{title}, dummy weights (dashes: batch-1 bound)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / out, dpi=110)


def _kernels(ax: plt.Axes, kernels: list[dict]) -> None:
    for shape in sorted({r["shape"] for r in kernels}):
        for dtype in sorted({r["dtype"] for r in kernels}):
            rows = [r for r in kernels if r["shape"] == shape and r["dtype"] == dtype]
            if rows:
                ax.plot([r["tokens"] for r in rows], [r["bandwidth_gb_s"] for r in rows], marker="o",
                        label=f"{shape} {dtype}")
    ax.set_xscale("log")
    ax.set_xlabel("tokens in the step")
    ax.set_ylabel("chosen experts' weight bytes / time, GB/s")
    ax.set_title("one MoE layer's routed experts (CUDA graph replay)")
    ax.legend(fontsize=8)


def _ratios(ax: plt.Axes, entries: list[dict]) -> None:
    """hyserve / vLLM for every point of ``peer_bench.py moe-report`` with both figures (the agent trace's wall
    inverted there already: above 1 is hyserve faster), with the parity line and the issue's 1.1x goal."""
    rows = [e for e in entries if e.get("ratio") is not None and "share" not in e["measure"]
            and "acceptance" not in e["label"] and "cache" not in e["label"]]
    ys = range(len(rows))
    ax.barh(ys, [e["ratio"] for e in rows], color=["C0" if e["ratio"] >= 1 else "C3" for e in rows])
    labels = [re.sub(r"\s*\(.*?\)|, tok/s|, wall s", "", e["label"]) for e in rows]
    ax.set_yticks(ys, [f"{e['shape']}: {label}" for e, label in zip(rows, labels)], fontsize=6)
    ax.invert_yaxis()
    ax.axvline(1.0, color="k", linewidth=0.8)
    ax.axvline(1.1, color="k", linestyle="--", linewidth=0.8)
    ax.set_xlabel("hyserve / vLLM 0.24 default mode (dashes: the 1.1x goal)")
    ax.set_title("every measured point, beside vLLM")


def _prefill_and_agent(ax: plt.Axes, folder: Path, runs: dict[str, dict]) -> None:
    """Prefill tok/s and the agent trace's tokens per wall second (prompt tokens / wall is not known here, so the
    bars are 1 / wall, normalized to hyserve's), each engine beside the other."""
    agent = {engine: json.loads(path.read_text())["figures"]["agent_wall_s"]
             for engine in ("hyserve", "vllm") if (path := folder / f"{engine}_35b_a3b_agent.json").exists()}
    names = [n for n in runs if n.endswith("35b_a3b")]
    base = runs[names[0]]["prefill_tok_s"] if names else 1.0
    labels, values = [], []
    for n in names:
        labels.append(f"prefill\n{n.split()[0]}")
        values.append(runs[n]["prefill_tok_s"] / base)
    if agent:
        first = next(iter(agent.values()))
        for engine, wall in agent.items():
            labels.append(f"agent trace\n{engine}")
            values.append(first / wall)
    ax.bar(range(len(values)), values, color=["C0", "C1"] * (len(values) // 2 + 1))
    ax.set_xticks(range(len(values)), labels, fontsize=8)
    ax.set_ylabel("speed relative to hyserve (higher is faster)")
    ax.set_title("35B-A3B bf16: prefill 32 x 2048, agent trace (1 / wall)")


if __name__ == "__main__":  # plot_moe.py FOLDER [JSON of another session ...] [--title T] [--out NAME.png]
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("folder", type=Path)
    ap.add_argument("others", nargs="*", type=Path)
    ap.add_argument("--title", default="MoE shapes")
    ap.add_argument("--out", default="moe.png")
    a = ap.parse_args()
    main(a.folder, a.others, a.title, a.out)

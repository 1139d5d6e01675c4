"""agent_images.png: the screenshot agent trace of this session, both engines (run from the project root)."""

import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

D = "benchmarks/results/h200/images_2026-12-02"
RUNS = [("8 conversations", "", "cache_bound.json"), ("32 conversations", "_c32", "cache_bound_c32.json")]
ENGINES = [("hyserve", "hyserve_2b_agent_images"), ("vLLM 0.24", "vllm_2b_agent_images")]


def figures(name: str) -> dict:
    with open(f"{D}/{name}.json", encoding="utf-8") as fh:
        return json.load(fh)["figures"]


fig, (hit, wall, ttft) = plt.subplots(1, 3, figsize=(12, 3.8))
for i, (_label, suffix, bound_file) in enumerate(RUNS):
    bound = figures(bound_file[:-5])["agent_images_cacheable_share"]
    hit.hlines(100 * bound, i - 0.4, i + 0.4, colors="black", linestyles="--",
               label="bound: any prefix cache" if i == 0 else None)
    for j, (engine, stem) in enumerate(ENGINES):
        f = figures(stem + suffix)
        tag = "agent_images" + suffix
        x = i + (j - 0.5) * 0.35
        color = f"C{j}"
        hit.bar(x, 100 * f[f"{tag}_cached_share"], 0.35, color=color, label=engine if i == 0 else None)
        wall.bar(x, f[f"{tag}_wall_s"], 0.35, color=color, label=engine if i == 0 else None)
        ttft.bar(x, f[f"{tag}_ttft_p90_s"], 0.35, color=color, alpha=0.35)
        ttft.bar(x, f[f"{tag}_ttft_p50_s"], 0.35, color=color, label=engine if i == 0 else None)
for ax, title in ((hit, "prompt tokens from cache, %"), (wall, "wall s (4 turns)"),
                  (ttft, "TTFT s: p50 (solid), p90 (light)")):
    ax.set_xticks(range(len(RUNS)), [r[0] for r in RUNS])
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
hit.set_ylim(0, 70)
wall.set_ylim(0, 34)
ttft.set_ylim(0, 21)
fig.suptitle("Screenshot agent trace, 2B shape with a real-size vision tower, one H200, 2026-12-02", fontsize=10)
fig.tight_layout()
fig.savefig(f"{D}/agent_images.png", dpi=110)

"""decode.png: the 2B shape's decode figures of this session (run from the project root)."""

import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

D = "benchmarks/results/h200/fp8_2026-12-02b"
RUNS = [("hyserve bf16", "hyserve_2b"), ("hyserve FP8 (compressed-tensors)", "hyserve_2b_ct"),
        ("hyserve FP8 (block)", "hyserve_2b_blk"), ("vLLM 0.24 FP8 (compressed-tensors)", "vllm_2b_ct")]
BATCHES = [1, 8, 32, 64]
WIDTH = 0.2

fig, ax = plt.subplots(figsize=(7, 4))
for i, (label, name) in enumerate(RUNS):
    with open(f"{D}/{name}.json", encoding="utf-8") as fh:
        f = json.load(fh)["figures"]
    ax.bar([j + (i - 1.5) * WIDTH for j in range(len(BATCHES))], [f[f"decode_bs{b}_tok_s"] for b in BATCHES], WIDTH,
           label=label)
ax.set_xticks(range(len(BATCHES)), [f"batch {b}" for b in BATCHES])
ax.set_yscale("log")
ax.set_ylabel("decode tok/s (log)")
ax.set_title("2B shape decode, one H200, 2026-12-02, same session")
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(f"{D}/decode.png", dpi=110)

import json, sys, matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
D = "benchmarks/results/h200/fp8_2026-12-02b"
runs = [("hyserve bf16", "hyserve_2b"), ("hyserve FP8 (compressed-tensors)", "hyserve_2b_ct"),
        ("hyserve FP8 (block)", "hyserve_2b_blk"), ("vLLM 0.24 FP8 (compressed-tensors)", "vllm_2b_ct")]
bs = [1, 8, 32, 64]
fig, ax = plt.subplots(figsize=(7, 4))
w = 0.2
for i, (label, name) in enumerate(runs):
    f = json.load(open(f"{D}/{name}.json"))["figures"]
    ax.bar([j + (i - 1.5) * w for j in range(4)], [f[f"decode_bs{b}_tok_s"] for b in bs], w, label=label)
ax.set_xticks(range(4), [f"batch {b}" for b in bs]); ax.set_yscale("log"); ax.set_ylabel("decode tok/s (log)")
ax.set_title("2B shape decode, one H200, 2026-12-02, same session"); ax.legend(fontsize=8)
fig.tight_layout(); fig.savefig(f"{D}/decode.png", dpi=110)

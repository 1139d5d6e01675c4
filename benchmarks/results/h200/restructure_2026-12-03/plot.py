"""Decode step time before and after the restructuring (this folder's README): async scheduling, and the three
synchronous runs of each tree (host-bound, so they scatter). python plot.py -> restructure.png"""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

BATCHES = [1, 8, 32, 64]
ASYNC = {"before": [2.115, 2.328, 2.860, 3.467], "after": [2.116, 2.327, 2.847, 3.464]}
SYNC = {"before": [[2.326, 2.701, 3.593, 4.612], [2.514, 2.951, 3.970, 5.157], [2.307, 2.629, 3.496, 5.010]],
        "after": [[2.643, 2.950, 3.732, 5.190], [2.490, 2.747, 3.540, 4.521], [2.312, 2.821, 3.896, 4.443]]}
fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
x = range(len(BATCHES))
for ax, title in zip(axes, ("async scheduling (one run each)", "synchronous (three runs each)")):
    for off, (tree, color) in zip((-0.18, 0.18), (("before", "tab:gray"), ("after", "tab:blue"))):
        if title.startswith("async"):
            ax.bar([i + off for i in x], ASYNC[tree], width=0.34, color=color, label=tree)
        else:
            runs = SYNC[tree]
            med = [sorted(r[i] for r in runs)[1] for i in x]
            lo = [med[i] - min(r[i] for r in runs) for i in x]
            hi = [max(r[i] for r in runs) - med[i] for i in x]
            ax.bar([i + off for i in x], med, width=0.34, color=color, label=f"{tree} (median, range)",
                   yerr=[lo, hi], capsize=3)
    ax.set_xticks(list(x), [str(b) for b in BATCHES])
    ax.set_xlabel("batch")
    ax.set_title(title)
    ax.legend(loc="upper left")
axes[0].set_ylabel("decode step (ms), 2B shape, bf16, H200")
fig.suptitle("Before (57c8014) and after the worker/kernel restructuring, one H200, back to back")
fig.tight_layout()
fig.savefig(__file__.replace("plot.py", "restructure.png"), dpi=110)

"""Decode step time and tokens/s, synchronous against async scheduling, before and after the scheduler/worker split.

Run on a CUDA machine (one H200 here), on a random-weight model of the Qwen3.5-2B shape in bfloat16:

    python benchmarks/async_bench.py --out DIR [--before TREE] [--batches 1,8,32,64]

``--before TREE`` names a directory holding an older ``hyserve`` package (e.g. ``git archive <commit> hyserve``):
it is measured too, synchronously (it has no async scheduling). Each variant runs in its own process on the same
checkpoint. For each batch size B: B requests of 512 prompt tokens decode (greedy, CUDA graphs); once every row
decodes, ``--steps`` engine steps are timed back to back (no synchronization between them, so async scheduling can
overlap). Reported per step: wall time, the GPU time of one decode graph replay at that batch (timed alone with CUDA
events), the exposed host time (wall minus replay: what the GPU waits for), and for this tree the host's busy time
(wall minus the time the host blocks waiting for sampled ids).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))


def measure(model: str, variant: str, batches: list[int], steps: int) -> dict[str, Any]:
    import torch
    from decode_window import decode_window

    import hyserve
    from hyserve import LLM

    print(f"variant {variant}: hyserve from {os.path.dirname(hyserve.__file__)}", file=sys.stderr, flush=True)

    blocked = [0.0]
    original_sync = torch.cuda.Event.synchronize

    def timed_sync(self: Any) -> None:
        t = time.perf_counter()
        original_sync(self)
        blocked[0] += time.perf_counter() - t

    torch.cuda.Event.synchronize = timed_sync  # type: ignore[method-assign]
    kw: dict[str, Any] = {}
    if variant != "before":
        kw["async_scheduling"] = variant in ("async", "mp-async")
    if variant == "mp-async":
        kw["distributed_executor_backend"] = "mp"
    llm = LLM(model=model, device="cuda", dtype="bfloat16", max_num_seqs=max(batches), max_model_len=4096,
              max_num_batched_tokens=8192, gpu_memory_utilization=0.5, **kw)
    eng = llm.llm_engine
    g = torch.Generator().manual_seed(1)
    out: dict[str, Any] = {"variant": variant, "package": os.path.dirname(hyserve.__file__), "rows": []}
    for batch in [batches[0], *batches]:  # the first batch once more as a warm-up
        wall, tokens = decode_window(eng, batch, steps, g, on_start=lambda: blocked.__setitem__(0, 0.0))
        wait = blocked[0]
        replay_ms = None
        if variant != "mp-async":  # the graphs live in this process
            graphs = eng.runner.graphs.sets["decode"]
            size = graphs.padded_size(batch)
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            graphs.run(size)
            ev0.record()
            for _ in range(20):
                graphs.run(size)
            ev1.record()
            torch.cuda.synchronize()
            replay_ms = ev0.elapsed_time(ev1) / 20
        row = {"batch": batch, "steps": steps, "step_ms": 1e3 * wall / steps, "tok_s": tokens / wall,
               "graph_replay_ms": replay_ms,
               "exposed_host_ms": 1e3 * wall / steps - replay_ms if replay_ms is not None else None,
               # The engine's own host time (the worker's, in its process, is not seen from here with mp).
               "host_busy_ms": 1e3 * (wall - wait) / steps if variant in ("sync", "async") else None}
        out["rows"].append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    out["rows"] = out["rows"][1:]
    return out


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| variant | batch | step (ms) | decode tok/s | graph replay (ms) | exposed host (ms) | host busy (ms) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for res in results:
        for r in res["rows"]:
            def f(x: float | None) -> str:
                return f"{x:.3f}" if x is not None else "n/a"

            lines.append(f"| {res['variant']} | {r['batch']} | {r['step_ms']:.3f} | {r['tok_s']:.1f} | "
                         f"{f(r['graph_replay_ms'])} | {f(r['exposed_host_ms'])} | {f(r['host_busy_ms'])} |")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for res in results:
        b = [r["batch"] for r in res["rows"]]
        ax[0].plot(b, [r["step_ms"] for r in res["rows"]], marker="o", label=res["variant"])
        ax[1].plot(b, [r["tok_s"] for r in res["rows"]], marker="o", label=res["variant"])
    timed = next(res for res in results if all(r["graph_replay_ms"] is not None for r in res["rows"]))
    ax[0].plot([r["batch"] for r in timed["rows"]], [r["graph_replay_ms"] for r in timed["rows"]], ls="--",
               color="gray", label="graph replay")
    for a, title in ((ax[0], "decode step (ms)"), (ax[1], "decode tokens/s")):
        a.set_xscale("log", base=2)
        a.set_xlabel("batch")
        a.set_title(title)
        a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/h200")
    ap.add_argument("--before", default=None, help="directory with an older hyserve package (measured sync)")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--name", default="async_scheduling", help="results file name (without extension)")
    ap.add_argument("--variants", default="sync,async", help="of this tree: sync, async, mp-async (worker process)")
    ap.add_argument("--model", default=None, help="(internal) checkpoint to measure")
    ap.add_argument("--variant", default=None, help="(internal) before | sync | async | mp-async")
    ap.add_argument("--plot", default=None, help="draw the plot of a results JSON written earlier, and exit")
    args = ap.parse_args()
    if args.plot:
        with open(args.plot) as f:
            plot(json.load(f)["results"], os.path.splitext(args.plot)[0] + ".png")
        return 0
    batches = [int(x) for x in args.batches.split(",")]
    if args.variant is not None:
        print(json.dumps(measure(args.model, args.variant, batches, args.steps)))
        return 0

    import torch
    from shapes import SHAPE_2B, write_random_checkpoint

    os.makedirs(args.out, exist_ok=True)
    model = os.path.join(tempfile.mkdtemp(), "qwen35-2b-shape")
    write_random_checkpoint(model, SHAPE_2B)
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(here)
    variants = [("before", os.path.abspath(args.before))] if args.before else []
    variants += [(v, repo) for v in args.variants.split(",")]
    results = []
    for name, tree in variants:
        assert os.path.isdir(os.path.join(tree, "hyserve")), f"no hyserve package in {tree}"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--model", model, "--variant", name,
                               "--batches", args.batches, "--steps", str(args.steps)],
                              env=env, capture_output=True, text=True, cwd=tree)
        if proc.returncode != 0:
            print(proc.stderr[-4000:], file=sys.stderr)
            raise SystemExit(f"variant {name} failed")
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(table(results[-1:]), flush=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=repo).stdout.strip()
    meta = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "python": platform.python_version(), "git_commit": commit or None, "date": time.strftime("%Y-%m-%d"),
            "model": "random-weight Qwen3.5-2B shape, bf16", "prompt_tokens": 512, "steps": args.steps}
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)
    with open(os.path.join(args.out, f"{args.name}.md"), "w") as f:
        f.write("# Decode step: synchronous vs async scheduling\n\n")
        f.write("\n".join(f"- {k}: {v}" for k, v in meta.items()) + "\n\n" + table(results) + "\n")
    try:
        plot(results, os.path.join(args.out, f"{args.name}.png"))
    except ImportError as e:  # the plot can be drawn later from the JSON (benchmarks/async_bench.py --plot)
        print(f"no plot: {e}", file=sys.stderr)
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

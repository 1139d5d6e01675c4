"""Host time of the screenshot agent trace's image processing: without the processor cache, with it, and with it on
several threads (as ``LLM.generate`` prepares a call's image prompts).

The front end's part of every image request: hash, resize, normalise and cut into patches
(``build_multimodal_prompt``), for every request of ``peer_bench.py``'s screenshot trace, in the order the engine gets
them, once with ``--mm-processor-cache-gb`` at its default (4 GiB) and once at 0. No model runs: the trace's prompts
do not depend on the outputs before each screenshot (``peer_bench.cache_bound``), and the outputs' ids are stand-ins.

    python benchmarks/peer_bench.py write --shape 2b --vision real --no-weights --device cpu --out /tmp/p2bv_files
    python benchmarks/processor_cache_bench.py --model /tmp/p2bv_files --out benchmarks/results/cpu/processor_cache
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import peer_bench as pb

from hyserve.config import DEFAULT_MM_PROCESSOR_CACHE_GB
from hyserve.model.registry import load_model_config
from hyserve.multimodal.image import ImageProcessorSettings
from hyserve.multimodal.inputs import build_multimodal_prompt
from hyserve.multimodal.processor_cache import GIB, ProcessorCache


def trace_requests(model: str, scale: str, n: int, seed: int = 0) -> list[list[tuple[list[int], list[Any]]]]:
    """Per turn, each request's prompt ids (one placeholder per image) and images, as ``measure_agent_images``
    builds them, with ``output_len`` stand-in tokens as each earlier turn's output."""
    trace, convs, shots = pb.screenshot_conversations(model, scale, n, seed)
    builder = pb.PromptBuilder(model)
    turns = []
    for turn in range(trace.turns):
        batch = []
        for c in convs:
            outputs = [[0] * c.output_lens[t] for t in range(turn)]
            messages, pieces = c.chat(turn, outputs)
            batch.append((builder.ids(messages, pieces), [shots[c.conv_id, k] for k in c.visible(turn)]))
        turns.append(batch)
    return turns


def run(model: str, turns: list[list[tuple[list[int], list[Any]]]], gib: float, threads: int = 1
        ) -> dict[str, float]:
    mm = load_model_config(model).multimodal
    assert mm is not None, f"{model} has no vision_config"
    cache = ProcessorCache(ImageProcessorSettings.from_checkpoint(model), int(gib * GIB))
    per_turn = []
    pixel_bytes = 0
    for batch in turns:
        t0 = time.perf_counter()
        # A turn's prompts live together, as its requests do in the engine (their pixels until encoded)
        if threads > 1:  # as LLM.generate prepares a call's image prompts (LLM._prepare_images)
            with ThreadPoolExecutor(max_workers=threads) as pool:
                held = list(pool.map(lambda r: build_multimodal_prompt(r[0], r[1], model, mm, cache), batch))
        else:
            held = [build_multimodal_prompt(ids, images, model, mm, cache) for ids, images in batch]
        per_turn.append(time.perf_counter() - t0)
        pixel_bytes += sum(im.pixel_values.nbytes for _, prompt in held for im in prompt.images)
        del held
    return {"seconds": sum(per_turn), "seconds_per_turn": per_turn, "images": cache.queries,  # type: ignore[dict-item]
            "images_processed": cache.queries - cache.hits, "hits": cache.hits, "cache_bytes": cache.num_bytes,
            "pixel_bytes": pixel_bytes}


def first_touch_ms(nbytes: int, n: int = 40) -> dict[str, float]:
    """Milliseconds to fill an ``nbytes`` array: ``n`` of them kept (fresh memory each time, as a cache that grows
    takes it) and ``n`` freed after each (the allocator reuses the memory, as processing without a cache does)."""
    import numpy as np

    out = {}
    for label, keep in (("kept", True), ("reused", False)):
        held = []
        t0 = time.perf_counter()
        for _ in range(n):
            a = np.empty(nbytes // 4, dtype=np.float32)
            a[:] = 1.0
            if keep:
                held.append(a)
        out[f"fill_ms_{label}"] = (time.perf_counter() - t0) / n * 1e3
        del held
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a --vision real checkpoint (write --no-weights is enough)")
    ap.add_argument("--scale", choices=sorted(pb.SCREENSHOT_TRACES), default="full")
    ap.add_argument("--concurrency", default="8,32")
    ap.add_argument("--threads", type=int, default=max(1, len(os.sched_getaffinity(0))),
                    help="threads for the threaded run (LLM.generate uses one per CPU; default: this machine's)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of each; the median is reported")
    ap.add_argument("--out", default=None, help="writes OUT.json and OUT.md")
    args = ap.parse_args()
    import torch

    res: dict[str, Any] = {"command": " ".join(sys.argv), "commit": pb.git_commit(),
                           "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
                                      f"torch {torch.__version__}, {torch.get_num_threads()} threads",
                           "date": time.strftime("%Y-%m-%d"), "runs": {}}
    # First, while the process has touched little memory: what memory the allocator must take from the system
    # costs, against memory it reuses (a cache that grows takes the former for every image it keeps)
    one = run(args.model, [trace_requests(args.model, args.scale, 1)[0][:1]], 0.0)
    res["pixel_bytes_per_image"] = one["pixel_bytes"] // max(one["images"], 1)
    res["memory"] = first_touch_ms(res["pixel_bytes_per_image"])
    print(f"one image's pixel rows ({res['pixel_bytes_per_image'] / 2**20:.1f} MiB) filled: "
          f"{res['memory']['fill_ms_kept']:.1f} ms in fresh memory, {res['memory']['fill_ms_reused']:.1f} ms reused")
    for n in (int(x) for x in args.concurrency.split(",")):
        turns = trace_requests(args.model, args.scale, n)
        run(args.model, turns[:1], 0.0)  # warm: imports, the processor's construction
        # Alternating rounds, the median of each: the first touch of fresh memory is costly on a VM, and which run
        # gets it depends on what ran before (seen here: 2.7-4.4 s for the same run at 8 conversations)
        rounds: dict[str, list[dict[str, Any]]] = {"no_cache": [], "cache": [], "cache_threads": []}
        for _ in range(args.rounds):
            rounds["no_cache"].append(run(args.model, turns, 0.0))
            rounds["cache"].append(run(args.model, turns, DEFAULT_MM_PROCESSOR_CACHE_GB))
            rounds["cache_threads"].append(run(args.model, turns, DEFAULT_MM_PROCESSOR_CACHE_GB, args.threads))
        plain, cached, threaded = (sorted(rounds[k], key=lambda r: r["seconds"])[len(rounds[k]) // 2]
                                   for k in ("no_cache", "cache", "cache_threads"))
        res["runs"][n] = {"cache": cached, "no_cache": plain, "speedup": plain["seconds"] / cached["seconds"],
                          "cache_threads": threaded, "threads": args.threads,
                          "speedup_threads": plain["seconds"] / threaded["seconds"],
                          "seconds_all_rounds": {k: [r["seconds"] for r in v] for k, v in rounds.items()}}
        print(f"{n} conversations: {plain['seconds']:.2f} s without the cache ({plain['images_processed']} images "
              f"processed), {cached['seconds']:.2f} s with it ({cached['images_processed']} processed, "
              f"{cached['hits']} hits): {res['runs'][n]['speedup']:.2f}x; on {args.threads} threads "
              f"{threaded['seconds']:.2f} s: {res['runs'][n]['speedup_threads']:.2f}x", flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".json", "w", encoding="utf-8") as f:
            json.dump(res, f, indent=2)
        lines = ["# Image processing of the screenshot agent trace, with and without the processor cache", "",
                 f"Command: `{res['command']}`; commit {res['commit']}; {res['machine']}; {res['date']}.", "",
                 "Seconds: the median of alternating rounds (all rounds in the JSON).", "",
                 "| conversations | requests | images | processed, no cache | s | processed, cache | s | speedup | "
                 "cache, threads | s | speedup |",
                 "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for n, r in res["runs"].items():
            c, p = r["cache"], r["no_cache"]
            lines.append(f"| {n} | {n * pb.SCREENSHOT_TRACES[args.scale].turns} | {c['images']} | "
                         f"{p['images_processed']} | {p['seconds']:.2f} | {c['images_processed']} | "
                         f"{c['seconds']:.2f} | {r['speedup']:.2f}x | {r['threads']} | "
                         f"{r['cache_threads']['seconds']:.2f} | {r['speedup_threads']:.2f}x |")
        m = res["memory"]
        lines += ["", f"One image's pixel rows are {res['pixel_bytes_per_image'] / 2**20:.1f} MiB (float32). Filling "
                      f"that much fresh memory took {m['fill_ms_kept']:.1f} ms here, reused memory "
                      f"{m['fill_ms_reused']:.1f} ms: a cache keeps each image it processes, so each miss pays the "
                      "first figure where processing without a cache pays the second."]
        with open(args.out + ".md", "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

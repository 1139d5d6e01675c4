"""Where a decode step's time goes: host (Python, launches) against device (kernels), at a chosen batch; with
``--prefill-prompts P`` where a prefill of P prompts of ``--prompt-len`` tokens goes instead (its steps' kernels
summed, after the same prefill once untimed: compiles, autotuning).

Runs a model to steady decode, then times ``--steps`` engine steps three ways: wall time per step, the GPU kernel
time per step (torch profiler, sum of device kernel durations), and the host functions that take the most time
(cProfile, by own time and by cumulative time). A step whose wall time is far above its kernel time is host-bound;
the profiled steps' device gaps are put down to the host, a sync or the device (``trace_gaps.py``: ``gaps`` in the
JSON).

    python benchmarks/shapes.py --shape 2b --out /tmp/m2b
    python benchmarks/profile_step.py --model /tmp/m2b --device cuda --dtype bfloat16 --batch 1 --out $OUT
    python benchmarks/profile_step.py --model /tmp/m2b --device cuda --dtype bfloat16 --prefill-prompts 32 \
        --prompt-len 2048 --out $OUT
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from kernel_families import families, family_of, format_families  # noqa: F401  (benchmarks/ is on the path)
from trace_gaps import format_gaps, gaps_of_profile

from hyserve import LLM, SamplingParams
from hyserve.testing import write_tiny_checkpoint


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _engine(model: str, device: str, dtype: str, rows: int, max_model_len: int, extra: dict[str, Any]) -> Any:
    """An engine for ``rows`` sequences at once, on 0.9 of the card and of ``max_model_len`` unless ``extra`` says
    otherwise (its ``max_model_len`` sets the decode attention's graph-sized launches, as in the peer runs)."""
    llm = LLM(model=model, device=device, dtype=dtype, max_num_seqs=max(8, rows),
              **{"max_model_len": max_model_len, "gpu_memory_utilization": 0.9, **extra})
    return llm.llm_engine


def _kernels(prof: Any) -> tuple[float, int, str]:
    """The profiler's device kernels: their time in all (ms), their launches, the table of the costliest."""
    cuda = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    return (sum(e.self_device_time_total for e in cuda) / 1e3, sum(e.count for e in cuda),
            prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30))


def _families_of(prof: Any, steps: int) -> dict[str, float]:
    return families([(e.key, e.self_device_time_total) for e in prof.key_averages() if e.device_type.name == "CUDA"],
                    steps)


def run(model: str, device: str, dtype: str, batch: int, steps: int, prompt_len: int,
        extra: dict[str, Any]) -> dict[str, Any]:
    eng = _engine(model, device, dtype, batch, 4096, extra)
    if eng.max_num_seqs < batch:  # the planner lowers it where the caches do not fit: the profile would be of fewer
        raise SystemExit(f"batch {batch}: only {eng.max_num_seqs} sequences fit the cache budget (raise "
                         "gpu_memory_utilization through --extra, or lower the batch)")
    vocab = eng.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=10 * steps + 64, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"p{i}", {"prompt_token_ids": torch.randint(0, vocab, (prompt_len,), generator=g).tolist()},
                        params)
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    for _ in range(5):
        eng.step()
    _sync(device)

    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    _sync(device)
    wall = (time.perf_counter() - t0) / steps

    kernel_ms = None
    if device == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                eng.step()
            _sync(device)
        total_ms, total_launches, top_kernels = _kernels(prof)
        kernel_ms, launches = total_ms / steps, total_launches / steps
        by_family: dict[str, float] | None = _families_of(prof, steps)
        gaps = gaps_of_profile(prof, os.path.join(tempfile.mkdtemp(), "trace.json"))
    else:
        launches, top_kernels, gaps, by_family = None, "", None, None

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        eng.step()
    _sync(device)
    pr.disable()
    s = io.StringIO()
    st = pstats.Stats(pr, stream=s)
    st.sort_stats("tottime").print_stats(35)
    st.sort_stats("cumulative").print_stats(45)
    eng.abort_request([f"p{i}" for i in range(batch)])
    return {"batch": batch, "wall_ms_per_step": wall * 1e3, "kernel_ms_per_step": kernel_ms,
            "kernels_per_step": launches, "families_ms_per_step": by_family, "top_kernels": top_kernels,
            "gaps": gaps, "cprofile": s.getvalue()}


def run_prefill(model: str, device: str, dtype: str, prompts: int, prompt_len: int,
                extra: dict[str, Any]) -> dict[str, Any]:
    """``prompts`` prompts of ``prompt_len`` random tokens to their first token, twice (fresh prompts each time: no
    prefix hits); the second under the profiler: wall and kernel time in all, launches, the top kernels."""
    eng = _engine(model, device, dtype, prompts, max(4096, prompt_len + 64), extra)
    vocab = eng.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def prefill(tag: str) -> int:
        for i in range(prompts):
            ids = torch.randint(0, vocab, (prompt_len,), generator=g).tolist()
            eng.add_request(f"{tag}{i}", {"prompt_token_ids": ids}, params)
        steps = 0
        while eng.has_unfinished_requests():
            eng.step()
            steps += 1
        _sync(device)
        return steps

    prefill("warm")
    t0 = time.perf_counter()
    steps = prefill("timed")
    wall = time.perf_counter() - t0
    kernel_ms: float | None = None
    launches: int | None = None
    top_kernels = ""
    gaps = None
    by_family: dict[str, float] | None = None
    if device == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            prefill("prof")
        kernel_ms, launches, top_kernels = _kernels(prof)
        by_family = _families_of(prof, 1)
        gaps = gaps_of_profile(prof, os.path.join(tempfile.mkdtemp(), "trace.json"))
    return {"prefill_prompts": prompts, "prompt_len": prompt_len, "steps": steps, "wall_ms": wall * 1e3,
            "tok_s": prompts * prompt_len / wall, "kernel_ms": kernel_ms, "kernels": launches,
            "families_ms": by_family, "top_kernels": top_kernels, "gaps": gaps}


def _run_apart(batch: int, model: str) -> dict[str, Any]:
    """This script run again for one batch (``--batch``, ``--model`` and ``--out`` replaced, the other arguments
    kept) in a process of its own; its result, its output passed through."""
    argv = list(sys.argv[1:])
    for flag in ("--batch", "--out", "--model"):
        while flag in argv:
            i = argv.index(flag)
            del argv[i : i + 2]
    out = tempfile.mkdtemp()
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--batch", str(batch), "--out", out,
                           "--model", model],
                          capture_output=True, text=True)
    sys.stdout.write(proc.stdout)
    if proc.returncode:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"batch {batch}: the profile's process exited with {proc.returncode}")
    with open(os.path.join(out, "profile_step.json")) as f:
        return json.load(f)[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint dir (default: a tiny random one)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", default="1")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--extra", default="{}", help="JSON of extra LLM(...) arguments")
    ap.add_argument("--out", default=None)
    ap.add_argument("--prefill-prompts", type=int, default=0,
                    help="profile a prefill of this many prompts of --prompt-len tokens instead of decode steps")
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    model = args.model
    if model is None:
        model = tempfile.mkdtemp()
        write_tiny_checkpoint(model, layer_types=["linear_attention"] * 3 + ["full_attention"])
    results = []
    if args.prefill_prompts:
        r = run_prefill(model, args.device, args.dtype, args.prefill_prompts, args.prompt_len, json.loads(args.extra))
        print(f"prefill {args.prefill_prompts} x {args.prompt_len}: {r['steps']} steps, wall {r['wall_ms']:.1f} ms "
              f"({r['tok_s']:.0f} tok/s), kernels {r['kernel_ms']} ms, {r['kernels']} launches", flush=True)
        if r["families_ms"]:
            print(format_families(r["families_ms"]).replace("ms/step", "ms"))
        print(r["top_kernels"])
        if r["gaps"]:
            print(format_gaps(r["gaps"]))
        results.append(r)
    batches = [] if args.prefill_prompts else [int(x) for x in args.batch.split(",")]
    for b in batches:
        if len(batches) > 1:  # each batch's engine in a process of its own: one process holding two does not fit
            results.append(_run_apart(b, model))  # its output passed through
            continue
        r = run(model, args.device, args.dtype, b, args.steps, args.prompt_len, json.loads(args.extra))
        print(f"batch {b}: wall {r['wall_ms_per_step']:.2f} ms/step, kernels {r['kernel_ms_per_step']} ms/step, "
              f"{r['kernels_per_step']} kernels/step", flush=True)
        if r["families_ms_per_step"]:
            print(format_families(r["families_ms_per_step"]))
        print(r["top_kernels"])
        if r["gaps"]:
            print(format_gaps(r["gaps"]))
        print(r["cprofile"][:12000])
        results.append(r)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "profile_step.json"), "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()

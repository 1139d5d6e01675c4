"""hyserve against vLLM on the same machine, checkpoint and prompts: the measures of issue 14 in one script.

Three subcommands, so that each engine runs in a process of its own (one after the other on one GPU):

    python benchmarks/peer_bench.py write --shape 2b --out /tmp/p2b            # VLM form, real head dims, MTP layer
    python benchmarks/peer_bench.py measure --engine hyserve --model /tmp/p2b --out $OUT/hyserve_2b.json
    PYTHONPATH=/tmp/vsite python benchmarks/peer_bench.py measure --engine vllm --model /tmp/p2b \\
        --out $OUT/vllm_2b.json                                                 # ../shared/peer/README.md
    python benchmarks/peer_bench.py report $OUT/*.json --out benchmarks/results/h200   # peer.json, peer.md, peer.png

``write`` builds transformers' ``Qwen3_5ForConditionalGeneration`` (text model of the shape, a one-block vision
tower, as vLLM wants the VLM form with its preprocessor files) with random bf16 weights and one random MTP layer.
``measure`` runs, through the engine's own ``LLM`` and ``SamplingParams``:

- ``start``: seconds to build the ``LLM`` in a process of its own, run after a first one (compile caches warm;
  the first process records its own start as ``first_start_s``);
- ``decode``: tokens/s at each ``--batches`` size, prompts of 512 random ids, greedy, ``ignore_eos``, as
  ``batch * (N - 1) / (t(N) - t(1))`` with fresh prompts for each timing (no prefix-cache hit);
- ``bound``: the batch-1 weights-bandwidth bound measured in the same process: the device's copy bandwidth
  (read + write) over the bytes of weights a decode step reads (every text-model tensor and the LM head, not the
  input embedding table unless it is the tied LM head);
- ``prefill``: 32 fresh prompts of 2048 tokens, one output token, after a warm-up of the same shape;
- ``agent``: (``agent_mtp_*`` with ``--speculative-config``) a closed-loop agent trace (8 conversations x 4
  turns sharing a 1.7k-token prefix, every turn's prompt the previous turn's prompt + its actual output + a new
  message) with prefix caching on: wall seconds and the share of prompt tokens served from the cache
  (``RequestOutput.num_cached_tokens``);
- ``spec``: decode tokens/s with ``--speculative-config`` against the same run without it (a trained head:
  the packaged model), at each ``--spec-batches`` size.

A measure that fails is recorded under ``errors`` (the file keeps the others; the exit status is 1).
``report`` merges each engine's files of one model, pairs hyserve's and vLLM's and writes one entry per measure
with both figures and the ratio, the card, versions and the git commit.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                 linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                 linear_conv_kernel_dim=4, partial_rotary_factor=0.25, tie_word_embeddings=True,
                 max_position_embeddings=8192),
}


def _shape(name: str) -> dict[str, Any]:
    if name == "2b":
        from shapes import SHAPE_2B

        return dict(SHAPE_2B)
    if name == "9b":  # Qwen3.5-9B's text shape: 32 layers (8 gated attention), untied LM head
        return dict(vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                    num_attention_heads=16, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                    linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                    linear_conv_kernel_dim=4, partial_rotary_factor=0.25, tie_word_embeddings=False,
                    max_position_embeddings=32768)
    return dict(SHAPES[name])


# ---------------------------------------------------------------------------------------------------------- write


def write(shape_name: str, out: str, device: str, seed: int = 0) -> None:
    import torch
    from shapes import add_random_mtp
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig

    shape = _shape(shape_name)
    text = Qwen3_5TextConfig(**shape, layer_types=None)
    vision = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=shape["hidden_size"])
    cfg = Qwen3_5Config(text_config=text.to_dict(), vision_config=vision,
                        tie_word_embeddings=shape["tie_word_embeddings"])
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3_5ForConditionalGeneration(cfg).to(torch.bfloat16)
    with torch.no_grad():  # transformers leaves the zero-centred norms at identity: spread them a little
        for name, p in model.named_parameters():
            if name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight", "language_model.norm.weight")):
                p.normal_(0.0, 0.1)
    model.save_pretrained(out)
    del model
    add_random_mtp(out, text, seed)
    from transformers import Qwen2VLImageProcessor

    Qwen2VLImageProcessor().save_pretrained(out)  # vLLM's VLM front end reads the processor files
    with open(os.path.join(out, "video_preprocessor_config.json"), "w", encoding="utf-8") as f:
        json.dump(_read_json(os.path.join(out, "preprocessor_config.json")), f, indent=2)
    print(f"wrote {shape_name} shape (VLM form, MTP layer) to {out}")


def quantize(src: str, out: str, fmt: str) -> None:
    """``src`` copied to ``out`` with its linear layers in FP8 (``hyserve.testing_fp8.quantize_checkpoint``: what the
    FP8 releases keep in bf16 stays so, the MTP head is quantized like the text model); both engines load
    the result without a flag."""
    import shutil

    from hyserve.testing_fp8 import quantize_checkpoint

    shutil.copytree(src, out)
    quantize_checkpoint(out, fmt)
    print(f"quantized {src} to {out} ({fmt})")


# ---------------------------------------------------------------------------------------------------------- measure


class Engine:
    """The two engines behind one surface: build, generate from token ids, shut down."""

    def __init__(self, name: str, model: str, device: str, dtype: str, **kw: Any) -> None:
        self.name = name
        t0 = time.perf_counter()
        if name == "hyserve":
            from hyserve import LLM, SamplingParams

            self.llm = LLM(model=model, device=device, dtype=dtype, **kw)
            self.version = _git_commit()
        else:
            import vllm
            from vllm import LLM, SamplingParams  # type: ignore[no-redef]

            if kw.get("enable_prefix_caching"):
                kw.setdefault("mamba_cache_mode", "align")  # vLLM's prefix caching on hybrids
            kw.pop("cpu_cache_memory_bytes", None)
            self.llm = LLM(model=model, dtype=dtype, limit_mm_per_prompt={"image": 0, "video": 0}, **kw)
            self.version = vllm.__version__
        self.start_s = time.perf_counter() - t0
        self.SamplingParams = SamplingParams

    def generate(self, prompts: list[list[int]], max_tokens: int | list[int]) -> list[Any]:
        lens = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
        params = [self.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
        return self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    def spec_stats(self) -> dict[str, float]:
        """Mean acceptance length (1 + accepted drafts per verify row) over the engine's life, where it reports
        one offline (hyserve's counters; vLLM's read 0 in offline runs)."""
        if self.name != "hyserve":
            return {}
        m = self.llm.get_metrics()
        drafts = float(m.get("hyserve:spec_decode_num_drafts", 0) or 0)  # type: ignore[arg-type]
        accepted = float(m.get("hyserve:spec_decode_num_accepted_tokens", 0) or 0)  # type: ignore[arg-type]
        return {"spec_mean_acceptance_length": 1 + accepted / drafts} if drafts else {}

    def shutdown(self) -> None:
        if self.name == "hyserve":
            self.llm.shutdown()
        del self.llm


def _git_commit() -> str:
    """The checkout's commit, with ``+changes`` when tracked files differ from it (the device machine's copy of a
    working tree can carry an older HEAD than the files it runs)."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=here,
                              check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                 text=True, cwd=here, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head}+changes" if changed else head


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn: Callable[[], Any]) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t0


class Prompts:
    def __init__(self, vocab: int, seed: int = 0) -> None:
        import random

        self.rng = random.Random(seed)
        self.vocab = vocab

    def fresh(self, n: int, length: int) -> list[list[int]]:
        return [[self.rng.randrange(self.vocab) for _ in range(length)] for _ in range(n)]


def measure_decode(eng: Engine, prompts: Prompts, batches: list[int], n: int, prompt_len: int = 512
                   ) -> dict[str, float]:
    eng.generate(prompts.fresh(max(batches), prompt_len), 4)  # warm-up
    out = {}
    for b in batches:
        eng.generate(prompts.fresh(b, prompt_len), n)  # this batch's shapes compiled / captured
        t1 = _timed(lambda b=b: eng.generate(prompts.fresh(b, prompt_len), 1))
        tn = _timed(lambda b=b: eng.generate(prompts.fresh(b, prompt_len), n))
        out[f"decode_bs{b}_tok_s"] = b * (n - 1) / max(tn - t1, 1e-9)
    return out


def weight_bytes_per_step(model: str) -> int:
    """Bytes of the tensors a decode step reads: the text model and the LM head, not the input embedding (unless
    it is the tied LM head), not the vision tower or the MTP layer."""
    from safetensors import safe_open

    from hyserve.model.loader import checkpoint_files

    sizes = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "I64": 8, "I32": 4}
    cfg = _read_json(os.path.join(model, "config.json"))
    tied = bool(cfg.get("tie_word_embeddings", cfg.get("text_config", {}).get("tie_word_embeddings", False)))
    total = 0
    for path in checkpoint_files(model):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if "visual" in name or name.startswith("mtp."):
                    continue
                if name.endswith("embed_tokens.weight") and not tied:
                    continue
                s = f.get_slice(name)
                numel = 1
                for d in s.get_shape():
                    numel *= d
                total += numel * sizes.get(s.get_dtype(), 2)
    return total


def copy_bandwidth() -> float:
    """Device-to-device copy bytes/s, read + write (a 2 GiB buffer, median of 10)."""
    import torch

    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    times = []
    for _ in range(10):
        times.append(_timed(lambda: b.copy_(a)))
    return 2 * a.numel() / sorted(times)[5]


def measure_prefill(eng: Engine, prompts: Prompts, n: int, length: int) -> dict[str, float]:
    eng.generate(prompts.fresh(n, length), 1)  # warm-up: every shape of the timed run
    wall = _timed(lambda: eng.generate(prompts.fresh(n, length), 1))
    return {"prefill_tok_s": n * length / wall}


def measure_agent(eng: Engine, vocab: int, scale: str) -> dict[str, float]:
    from hyserve.tools.workload import AgentTraceSpec, make_conversations

    spec = AgentTraceSpec(name="peer", system_prefix_len=1700, num_conversations=8, concurrency=8, turns=(4, 4),
                          first_message_len=(600, 900), message_len=(200, 400), output_len=(32, 64),
                          max_prompt_len=8192)
    if scale == "tiny":
        spec = AgentTraceSpec(name="peer-tiny", system_prefix_len=110, num_conversations=4, concurrency=4,
                              turns=(3, 3), first_message_len=(40, 60), message_len=(20, 40), output_len=(4, 8),
                              max_prompt_len=1024)
    convs = make_conversations(spec, seed=0, vocab_size=vocab)
    prompts_total = cached = 0
    outputs: dict[int, list[list[int]]] = {c.conv_id: [] for c in convs}
    t0 = time.perf_counter()
    for turn in range(max(c.num_turns for c in convs)):
        live = [c for c in convs if turn < c.num_turns]
        batch = [c.prompt(turn, outputs[c.conv_id]) for c in live]
        outs = eng.generate(batch, [c.output_lens[turn] for c in live])
        for c, p, o in zip(live, batch, outs, strict=True):
            outputs[c.conv_id].append(list(o.outputs[0].token_ids))
            prompts_total += len(p)
            cached += int(getattr(o, "num_cached_tokens", 0) or 0)
    return {"agent_wall_s": time.perf_counter() - t0, "agent_cached_share": cached / max(prompts_total, 1)}


def measure(args: argparse.Namespace) -> int:
    """Run the chosen measures and write their figures; 1 if one of them failed (its error is in the file)."""
    import torch

    cuda = args.device == "cuda"
    common: dict[str, Any] = {"max_model_len": args.max_model_len}
    if cuda:
        common["gpu_memory_utilization"] = args.gpu_memory_utilization
    measures = args.measures.split(",")
    res: dict[str, Any] = {"engine": args.engine, "model": args.model, "command": " ".join(sys.argv),
                           "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                           "date": time.strftime("%Y-%m-%d"), "hyserve_commit": _git_commit(), "figures": {}}
    fig = res["figures"]
    batches = [int(b) for b in args.batches.split(",")]
    errors = res["errors"] = {}

    def attempt(name: str, fn: Callable[[], None]) -> None:
        """Run measure ``name``; a failure is recorded (the file keeps what the other measures found)."""
        try:
            fn()
        except Exception as e:  # an engine that cannot run a measure: its error is the result
            import traceback

            errors[name] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        _release()

    def main_group() -> None:
        eng = Engine(args.engine, args.model, args.device, args.dtype, enable_prefix_caching=False,
                     max_num_seqs=max([*batches, args.prefill_prompts]), **common)
        res["version"] = eng.version
        fig["first_start_s"] = eng.start_s
        prompts = Prompts(_vocab(args.model))
        if "decode" in measures:
            fig.update(measure_decode(eng, prompts, batches, args.decode_tokens))
        if "bound" in measures and cuda:
            wb = weight_bytes_per_step(args.model)
            bw = copy_bandwidth()
            fig.update(weight_bytes=wb, copy_bandwidth_bytes_s=bw, bound_bs1_tok_s=bw / wb)
            if "decode_bs1_tok_s" in fig:
                fig["decode_bs1_share_of_bound"] = fig["decode_bs1_tok_s"] / fig["bound_bs1_tok_s"]
        if "prefill" in measures:
            fig.update(measure_prefill(eng, prompts, args.prefill_prompts, args.prefill_len))
        eng.shutdown()

    def start() -> None:  # its own process, after a first one: compile caches warm
        eng = Engine(args.engine, args.model, args.device, args.dtype, enable_prefix_caching=False, **common)
        res.setdefault("version", eng.version)
        fig["start_warm_s"] = eng.start_s
        eng.shutdown()

    def agent() -> None:
        kw = dict(common, enable_prefix_caching=True)
        tag = "agent"
        if args.speculative_config:
            kw["speculative_config"] = json.loads(args.speculative_config)
            tag = "agent_mtp"
        if args.kv_cache_dtype != "auto":  # the seed's --kv-cache-dtype fp8 question: does the hit rate hold?
            kw["kv_cache_dtype"] = args.kv_cache_dtype
            tag += "_kvfp8"
        eng = Engine(args.engine, args.model, args.device, args.dtype, **kw)
        res.setdefault("version", eng.version)
        fig.update({k.replace("agent", tag, 1): v
                    for k, v in measure_agent(eng, _vocab(args.model), args.agent_scale).items()})
        fig.update({k.replace("spec", tag, 1): v for k, v in eng.spec_stats().items()})
        eng.shutdown()

    def spec() -> None:
        spec_batches = [int(b) for b in args.spec_batches.split(",")]
        for label, kw in (("plain", {}), ("spec", {"speculative_config": json.loads(args.speculative_config)})):
            eng = Engine(args.engine, args.model, args.device, args.dtype, enable_prefix_caching=False,
                         max_num_seqs=max(spec_batches), **common, **kw)
            res.setdefault("version", eng.version)
            for k, v in measure_decode(eng, Prompts(_vocab(args.model), 1), spec_batches, args.decode_tokens).items():
                fig[f"{label}_{k}"] = v
            if label == "spec":
                fig.update(eng.spec_stats())
            eng.shutdown()
            _release()
        for b in spec_batches:
            fig[f"spec_speedup_bs{b}"] = fig[f"spec_decode_bs{b}_tok_s"] / fig[f"plain_decode_bs{b}_tok_s"]

    if {"decode", "bound", "prefill"} & set(measures):
        attempt("decode,bound,prefill", main_group)
    if "start" in measures:
        attempt("start", start)
    if "agent" in measures:
        attempt("agent", agent)
    if "spec" in measures and args.speculative_config:
        attempt("spec", spec)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(res, f, indent=2)
    print(json.dumps(res, indent=2))
    return 1 if errors else 0


def _read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _vocab(model: str) -> int:
    """Random prompt ids are drawn below this: the vocabulary, cut below the vision tokens' ids (both engines
    refuse image placeholders that come without images)."""
    cfg = _read_json(os.path.join(model, "config.json"))
    vision = [int(cfg[k]) for k in ("vision_start_token_id", "vision_end_token_id", "image_token_id",
                                     "video_token_id") if k in cfg]
    return min([int(cfg.get("text_config", cfg).get("vocab_size")), *vision])


def _release() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------- report

# measure -> (higher is better, label)
_FIGURES = {
    "decode_bs1_tok_s": (True, "decode batch 1, tok/s"), "decode_bs8_tok_s": (True, "decode batch 8, tok/s"),
    "decode_bs32_tok_s": (True, "decode batch 32, tok/s"), "decode_bs64_tok_s": (True, "decode batch 64, tok/s"),
    "decode_bs1_share_of_bound": (True, "batch-1 decode, share of the bandwidth bound"),
    "prefill_tok_s": (True, "prefill 32 x 2048, tok/s"), "agent_wall_s": (False, "agent trace, wall s"),
    "agent_cached_share": (True, "agent trace, prompt tokens from cache"),
    "agent_mtp_wall_s": (False, "agent trace with MTP, wall s"),
    "agent_mtp_cached_share": (True, "agent trace with MTP, prompt tokens from cache"),
    "agent_kvfp8_wall_s": (False, "agent trace, FP8 KV cache, wall s"),
    "agent_kvfp8_cached_share": (True, "agent trace, FP8 KV cache, prompt tokens from cache"),
    "start_warm_s": (False, "engine start (warm caches), s"),
    "spec_speedup_bs1": (True, "speculation vs plain, batch 1"),
    "spec_speedup_bs8": (True, "speculation vs plain, batch 8"),
    "spec_mean_acceptance_length": (True, "speculation, mean acceptance length"),
    "bound_bs1_tok_s": (True, "batch-1 weights-bandwidth bound (measured in each run), tok/s"),
    "first_start_s": (False, "engine start, first process on the machine, s"),
}
_NO_RATIO = {"bound_bs1_tok_s"}  # a property of the card measured in each engine's run, not of the engine


def report(files: list[str], out: str) -> None:
    runs = [_read_json(p) for p in files]
    by_model: dict[str, dict[str, dict[str, Any]]] = {}
    # Where each figure comes from: the file and engine version of the run that measured it (a later file's figure
    # replaces an earlier one's; files from several device sessions can be merged, and each row says which).
    source: dict[tuple[str, str, str], str] = {}
    for path, r in zip(files, runs, strict=True):
        model = os.path.basename(r["model"].rstrip("/"))
        folder = os.path.basename(os.path.dirname(os.path.abspath(path)))
        run = f"{folder}/{os.path.basename(path)} ({r.get('version')})"
        for key in r["figures"]:
            source[(model, r["engine"], key)] = run
    for r in runs:  # several files of one engine and model (one process per measure group) merge
        slot = by_model.setdefault(os.path.basename(r["model"].rstrip("/")), {})
        if r["engine"] in slot:
            merged = slot[r["engine"]]
            merged["figures"] = {**merged["figures"], **r["figures"]}
            merged["errors"] = {**merged.get("errors", {}), **r.get("errors", {})}
            merged["command"] = f"{merged['command']} ; {r['command']}"
            merged["version"] = r.get("version") or merged.get("version")  # the latest run's
        else:
            slot[r["engine"]] = dict(r)
    entries = []
    for model, engines in sorted(by_model.items()):
        ours, peer = engines.get("hyserve", {}).get("figures", {}), engines.get("vllm", {}).get("figures", {})
        for key, (higher, label) in _FIGURES.items():
            if key not in ours and key not in peer:
                continue
            a, b = ours.get(key), peer.get(key)
            ratio = None
            if a is not None and b and key not in _NO_RATIO:
                ratio = a / b if higher else b / a  # > 1: hyserve is better
            entries.append({"model": model, "measure": key, "label": label, "hyserve": a, "vllm": b, "ratio": ratio,
                            "hyserve_run": source.get((model, "hyserve", key)),
                            "vllm_run": source.get((model, "vllm", key))})
        for engine, r in sorted(engines.items()):
            for name, why in r.get("errors", {}).items():
                entries.append({"model": model, "measure": name, "label": f"{engine} failed: {why}"[:300],
                                "hyserve": None, "vllm": None, "ratio": None})
    meta = {"files": files, "hyserve_commit": _git_commit(),
            "engines": {f"{m}/{e}": {k: r.get(k) for k in ("version", "device", "torch", "date", "command")}
                        for m, es in by_model.items() for e, r in es.items()}}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "peer.json"), "w", encoding="utf-8") as f:
        json.dump({"meta": meta, "entries": entries}, f, indent=2)
    lines = ["# hyserve against vLLM, same machine, checkpoint and prompts", "",
             f"hyserve commit {meta['hyserve_commit']}; " + "; ".join(
                 f"{k}: {v.get('version')} on {v.get('device')} ({v.get('date')})" for k, v in meta["engines"].items()),
             "", "| model | measure | hyserve | vLLM | hyserve better by | runs (hyserve; vLLM) |",
             "| --- | --- | ---: | ---: | ---: | --- |"]

    def fmt(x: Any) -> str:
        return "-" if x is None else (f"{x:,.3f}" if abs(x) < 10 else f"{x:,.0f}")

    for e in entries:
        ratio = "-" if e["ratio"] is None else f"{e['ratio']:.2f}x"
        runs_cell = "; ".join(x for x in (e.get("hyserve_run"), e.get("vllm_run")) if x) or "-"
        lines.append(f"| {e['model']} | {e['label']} | {fmt(e['hyserve'])} | {fmt(e['vllm'])} | {ratio} | "
                     f"{runs_cell} |")
    with open(os.path.join(out, "peer.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rated = [e for e in entries if e["ratio"] is not None]
    if rated:
        fig, ax = plt.subplots(figsize=(7, 0.35 * len(rated) + 1.2))
        ax.barh([f"{e['model']}: {e['label']}" for e in rated], [e["ratio"] for e in rated])
        ax.axvline(1.0, color="grey", ls="--", lw=0.8)
        ax.set_xlabel("hyserve better by (x)")
        fig.tight_layout()
        fig.savefig(os.path.join(out, "peer.png"), dpi=120)
        plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("--shape", choices=["tiny", "2b", "9b"], default="2b")
    w.add_argument("--out", required=True)
    w.add_argument("--device", default="cuda")
    m = sub.add_parser("measure")
    m.add_argument("--engine", choices=["hyserve", "vllm"], required=True)
    m.add_argument("--model", required=True)
    m.add_argument("--out", required=True)
    m.add_argument("--device", default="cuda")
    m.add_argument("--dtype", default="bfloat16")
    m.add_argument("--measures", default="decode,bound,prefill,agent",
                   help="comma-separated; start (the warm start) belongs in a process of its own, after a first")
    m.add_argument("--batches", default="1,8,32,64")
    m.add_argument("--decode-tokens", type=int, default=128)
    m.add_argument("--prefill-prompts", type=int, default=32)
    m.add_argument("--prefill-len", type=int, default=2048)
    m.add_argument("--agent-scale", choices=["full", "tiny"], default="full")
    m.add_argument("--speculative-config", default=None, help="JSON; the agent trace and the spec measure use it")
    m.add_argument("--spec-batches", default="1,8")
    m.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="the agent trace's KV cache (both engines take the same name)")
    m.add_argument("--max-model-len", type=int, default=8192)
    m.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    q = sub.add_parser("quantize", help="copy a written checkpoint and quantize its linear layers to FP8")
    q.add_argument("--src", required=True)
    q.add_argument("--out", required=True)
    q.add_argument("--format", choices=["ct_dynamic", "block"], default="ct_dynamic",
                   help="compressed-tensors FP8_DYNAMIC (channel weights, per-token activations) or Qwen's block FP8")
    r = sub.add_parser("report")
    r.add_argument("files", nargs="+")
    r.add_argument("--out", default="benchmarks/results/h200")
    args = ap.parse_args()
    if args.cmd == "write":
        write(args.shape, args.out, args.device)
    elif args.cmd == "quantize":
        quantize(args.src, args.out, args.format)
    elif args.cmd == "measure":
        return measure(args)
    else:
        report(args.files, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

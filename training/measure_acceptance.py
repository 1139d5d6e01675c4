"""Mean MTP acceptance length of a checkpoint, measured with hyserve, and a greedy spec-on == spec-off check.

For each k, the held-out prompts of ``heldout_prompts.json`` (written by ``train_default_model.py`` next to the
checkpoint) are generated greedily with ``speculative_config={"method": "mtp", "num_speculative_tokens": k}``;
the mean acceptance length is ``1 + accepted / drafts`` from the engine's metrics
(``hyserve:spec_decode_num_accepted_tokens`` / ``hyserve:spec_decode_num_drafts``): the tokens one verify step
emits on average. Every output must equal the output without speculation, token for token.

    python training/measure_acceptance.py                      # hyserve/default_model, CPU, k = 1, 2, 3
    python training/measure_acceptance.py --device cuda --model DIR

Results go to ``acceptance_report.json`` and the acceptance section of ``TRAINING.md`` in the checkpoint directory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from hyserve import LLM, SamplingParams  # noqa: E402

DEFAULT_MODEL = os.path.join(_REPO, "hyserve", "default_model")
PROMPTS_JSON = "heldout_prompts.json"
REPORT_JSON = "acceptance_report.json"
REPORT_MD = "TRAINING.md"
ACCEPTANCE_BEGIN = "<!-- acceptance:begin -->"
ACCEPTANCE_END = "<!-- acceptance:end -->"
ACCEPTED = "hyserve:spec_decode_num_accepted_tokens"
DRAFTS = "hyserve:spec_decode_num_drafts"
DRAFT_TOKENS = "hyserve:spec_decode_num_draft_tokens"
PER_POS = "hyserve:spec_decode_num_accepted_tokens_per_pos"


def load_prompts(model_dir: str, limit: int = 0) -> list[list[int]]:
    path = os.path.join(model_dir, PROMPTS_JSON)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: it is written by training/train_default_model.py")
    with open(path, encoding="utf-8") as f:
        prompts = [list(p["prompt_token_ids"]) for p in json.load(f)["prompts"]]
    return prompts[:limit] if limit else prompts


def generate(model_dir: str, prompts: list[list[int]], max_tokens: int, *, device: str, dtype: str,
             k: int = 0) -> tuple[list[list[int]], dict[str, Any], float]:
    """Greedy outputs (token ids) for every prompt; with ``k`` > 0, MTP speculation with k drafts per step."""
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    llm = LLM(model=model_dir, device=device, dtype=dtype, speculative_config=spec, max_num_seqs=len(prompts))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    return [list(o.outputs[0].token_ids) for o in outs], llm.get_metrics(), wall


def acceptance(metrics: dict[str, Any]) -> dict[str, Any]:
    drafts = float(metrics[DRAFTS])
    accepted = float(metrics[ACCEPTED])
    return {
        "drafts": int(drafts),
        "draft_tokens": int(float(metrics[DRAFT_TOKENS])),
        "accepted_tokens": int(accepted),
        "accepted_per_pos": [int(x) for x in metrics[PER_POS]],  # type: ignore[union-attr]
        "mean_acceptance_length": 1.0 + accepted / drafts if drafts else float("nan"),
    }


def measure(model_dir: str, ks: list[int], *, device: str = "cpu", dtype: str = "auto", max_tokens: int = 64,
            num_prompts: int = 0) -> dict[str, Any]:
    prompts = load_prompts(model_dir, num_prompts)
    base, _, base_wall = generate(model_dir, prompts, max_tokens, device=device, dtype=dtype)
    results: dict[str, Any] = {
        "model": os.path.relpath(model_dir, _REPO) if model_dir.startswith(_REPO) else model_dir,
        "device": device, "dtype": dtype, "prompts": len(prompts), "max_tokens": max_tokens,
        "generated_tokens": sum(len(o) for o in base), "baseline_wall_s": base_wall, "k": {},
    }
    for k in ks:
        outs, metrics, wall = generate(model_dir, prompts, max_tokens, device=device, dtype=dtype, k=k)
        mismatched = [i for i, (a, b) in enumerate(zip(outs, base, strict=True)) if a != b]
        entry = acceptance(metrics)
        entry.update({"greedy_equal": not mismatched, "mismatched_prompts": mismatched, "wall_s": wall})
        results["k"][str(k)] = entry
    return results


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"Measured by `training/measure_acceptance.py` with hyserve ({results['device']}, dtype "
        f"{results['dtype']}): {results['prompts']} held-out prompts (`{PROMPTS_JSON}`), greedy, up to "
        f"{results['max_tokens']} new tokens each ({results['generated_tokens']} tokens in all). Acceptance length "
        "= 1 + accepted / drafts: the tokens one verify step emits on average (k + 1 at most). A small model's "
        "greedy output repeats itself, which is easy to draft: compare these numbers across checkpoints on the "
        "same prompts only.",
        "",
        "| k | mean acceptance length | accepted / draft tokens | accepted per draft position | "
        "greedy output == no speculation |",
        "| --- | --- | --- | --- | --- |",
    ]
    for k, e in results["k"].items():
        equal = "yes" if e["greedy_equal"] else f"NO: prompts {e['mismatched_prompts']}"
        lines.append(f"| {k} | {e['mean_acceptance_length']:.3f} | {e['accepted_tokens']} / {e['draft_tokens']} | "
                     f"{e['accepted_per_pos']} | {equal} |")
    return "\n".join(lines)


def update_markdown(model_dir: str, results: dict[str, Any]) -> bool:
    path = os.path.join(model_dir, REPORT_MD)
    if not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if ACCEPTANCE_BEGIN not in text or ACCEPTANCE_END not in text:
        return False
    head, rest = text.split(ACCEPTANCE_BEGIN, 1)
    _, tail = rest.split(ACCEPTANCE_END, 1)
    with open(path, "w", encoding="utf-8") as f:
        f.write(head + ACCEPTANCE_BEGIN + "\n" + markdown(results) + "\n" + ACCEPTANCE_END + tail)
    return True


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="checkpoint directory (default: hyserve/default_model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", help="auto: float32 on the CPU, the checkpoint's dtype on CUDA")
    p.add_argument("--k", type=int, nargs="+", default=[1, 2, 3], help="numbers of speculative tokens")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=0, help="first N prompts only (0: all)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-write", action="store_true", help="print only; do not write the report files")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = os.path.abspath(args.model)
    results = measure(model_dir, args.k, device=args.device, dtype=args.dtype, max_tokens=args.max_tokens,
                      num_prompts=args.num_prompts)
    print(markdown(results))
    if not args.no_write:
        with open(os.path.join(model_dir, REPORT_JSON), "w", encoding="utf-8") as f:
            json.dump(results, f, indent=2)
            f.write("\n")
        update_markdown(model_dir, results)
    if not all(e["greedy_equal"] for e in results["k"].values()):
        raise SystemExit("greedy output with MTP speculation differs from the output without")
    return results


if __name__ == "__main__":
    main()

"""What a grammar costs per step: the host's mask computation (``GrammarMatcher.masks``) for a decode row and a
verify row of k drafts, and the device's application of the masks to the logits (``apply_grammar_masks``).

The vocabulary: ``--tokenizer DIR`` (a checkpoint's tokenizer.json), or a synthetic byte-level vocabulary of
``--vocab`` tokens (default 248,320, Qwen3.5's size: random ASCII words of 1-12 bytes, with the digits, letters and
JSON punctuation as single tokens too), which is what the mask computation walks.

    python benchmarks/grammar_cost.py [--device cuda] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import torch

from hyserve.layers.sampler import apply_grammar_masks
from hyserve.structured_output.grammar import GrammarCompiler
from hyserve.structured_output.matcher import GrammarMatcher
from hyserve.structured_output.params import StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {
    "action": {"enum": ["click", "type", "scroll", "done"]},
    "x": {"type": "integer"}, "y": {"type": "integer"}, "text": {"type": "string", "maxLength": 64}},
    "required": ["action", "x", "y"], "additionalProperties": False}
CONSTRAINTS = {
    "json_schema": StructuredOutputsParams(json=SCHEMA),
    "json_object": StructuredOutputsParams(json_object=True),
    "regex": StructuredOutputsParams(regex=r"[A-Z][a-z]{2,8}( [a-z]{1,8}){0,6}\."),
    "choice": StructuredOutputsParams(choice=["yes", "no", "not sure"]),
}


def synthetic_tokenizer_json(vocab: int, seed: int = 0) -> tuple[str, int]:
    """A byte-level BPE tokenizer.json with ``vocab`` tokens (no merges: the masks walk the vocabulary alone)."""
    from tokenizers import pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_map = {b: c for b, c in zip(range(256), sorted(alphabet, key=lambda c: _byte_of(c)), strict=True)}
    rng = random.Random(seed)
    tokens = {byte_map[b]: b for b in range(256)}
    chars = "abcdefghijklmnopqrstuvwxyz     ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789{}[]\":,._-"
    while len(tokens) < vocab - 1:
        word = "".join(rng.choice(chars) for _ in range(rng.randint(2, 12)))
        tokens.setdefault("".join(byte_map[b] for b in word.encode()), len(tokens))
    eos = len(tokens)
    model = {"type": "BPE", "vocab": tokens, "merges": []}
    added = {"id": eos, "content": "<|im_end|>", "special": True, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False}
    doc = {"version": "1.0", "added_tokens": [added],
           "normalizer": None, "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                                 "use_regex": True},
           "post_processor": None, "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                                               "use_regex": True}, "model": model}
    return json.dumps(doc), eos


def _byte_of(c: str) -> int:
    from tokenizers import decoders  # noqa: F401  (the byte-level table is GPT-2's)

    n = ord(c)
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    if n in printable:
        return n
    extra = [b for b in range(256) if b not in printable]
    return extra[n - 256]


def walk(matcher: GrammarMatcher, vocab: int, steps: int, k: int, seed: int) -> tuple[list[float], int]:
    """Masks of ``steps`` rows (1 + k positions each, drafts drawn from the allowed tokens), timing each call; the
    chosen tokens are consumed as a run would."""
    from hyserve.structured_output.bitmask import allowed, unpack

    rng = random.Random(seed)
    times = []
    done = 0
    for _ in range(steps):
        if matcher.is_terminated:
            break
        first = allowed(unpack(matcher.masks([]), vocab), vocab)[0].nonzero().flatten().tolist()
        drafts = [rng.choice(first)] * k if k else []
        t0 = time.perf_counter()
        matcher.masks(drafts)
        times.append(time.perf_counter() - t0)
        matcher.consume([rng.choice(first)])
        done += 1
    return times, done


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--vocab", type=int, default=248_320)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.tokenizer:
        with open(f"{args.tokenizer}/tokenizer.json", encoding="utf-8") as f:
            tok_json = f.read()
        vocab, eos = args.vocab, [0]
    else:
        tok_json, eos_id = synthetic_tokenizer_json(args.vocab)
        vocab, eos = args.vocab, [eos_id]
    t0 = time.perf_counter()
    compiler = GrammarCompiler(tok_json, vocab, eos)
    _ = compiler.ll_tokenizer
    result: dict[str, Any] = {"vocab": vocab, "tokenizer_build_s": time.perf_counter() - t0, "host": {}, "device": {}}
    for name, params in CONSTRAINTS.items():
        t0 = time.perf_counter()
        grammar = compiler.compile(params)
        compile_s = time.perf_counter() - t0
        row: dict[str, Any] = {"compile_ms": 1e3 * compile_s}
        for k in (0, 3):
            times, n = walk(GrammarMatcher(compiler, grammar), vocab, args.steps, k, seed=1)
            row[f"mask_us_k{k}"] = 1e6 * statistics.median(times) if times else None
            row[f"mask_us_k{k}_p90"] = 1e6 * sorted(times)[int(0.9 * (len(times) - 1))] if times else None
            row[f"steps_k{k}"] = n
        result["host"][name] = row
        print(name, {k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    device = torch.device(args.device)
    packed = GrammarMatcher(compiler, compiler.compile(CONSTRAINTS["json_schema"])).masks([])
    for rows in (int(r) for r in args.rows.split(",")):
        logits = torch.randn(rows, vocab, device=device)
        for _ in range(3):
            apply_grammar_masks(logits, list(range(rows)), [packed] * rows, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        n = 20
        for _ in range(n):
            apply_grammar_masks(logits, list(range(rows)), [packed] * rows, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        result["device"][str(rows)] = 1e6 * (time.perf_counter() - t0) / n
        print(f"apply {rows} rows on {device}: {result['device'][str(rows)]:.0f} us", flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()

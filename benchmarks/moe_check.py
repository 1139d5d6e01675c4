"""Issue 31's check on the card: a 2B-active Qwen3.5-MoE shape served on CUDA against transformers' own
``Qwen3_5MoeForCausalLM`` in float32, teacher-forced on hyserve's greedy tokens.

* float32 (``--dtype float32``): ``FP32_RULE``, as the tiny float32 checks (every clear position's argmax, logprobs
  within 3e-3). Triton's dots on float32 operands default to TF32: the script sets ``TRITON_F32_DEFAULT=ieee`` for
  any dot that leaves its precision to the default (hyserve's own kernels pass ``input_precision``, and a float32
  engine takes its recurrent GDN kernel for every row, not fla's). This is the check of the kernels' arithmetic at
  the real shape.
* Either way the reference runs its GDN layers through transformers' own PyTorch functions
  (``torch_gdn_reference``), not fla's kernel (which transformers takes when fla is installed, as here: hyserve's
  prefill calls the same kernel, and a reference sharing it could not see its faults; on 2026-12-03 its float32
  form with IEEE dots also ran past five minutes inside the reference).
* bf16 (the default): ``BF16_PEER_RULE``, beside transformers' own bf16 model scored on the same tokens. The dense
  checks' fixed tolerance (``gpu_check.BF16_RULE``) does not fit a random MoE model: bf16 rounding flips router
  choices near ties and transformers' own bf16 model fails it (see ``Bf16PeerRule``).

    python benchmarks/moe_check.py --out DIR                      # on the H200 (about 40 GB of GPU memory)
    python benchmarks/moe_check.py --out DIR --shape tiny --device cpu --dtype float32   # the test's form

The shape (``SHAPE_MOE_2B``) is the 35B-A3B text model's (hidden 2048, 3 GDN : 1 gated attention, experts of 512,
top 8, a shared expert of 512, routing in float32 with renormalized top-k) at 24 layers and 64 experts: about 2.5B
parameters read per token, 5.6B in all, so its bf16 checkpoint (11 GB) and transformers' float32 copy (22 GB) fit
beside hyserve on one card and on the machine's disk. transformers' random init, with the zero-centred norms spread
(as ``shapes.write_random_checkpoint``) and the routers' rows drawn wider (``ROUTER_STD``): at transformers' 0.02
the router logits are near-uniform and every top-k choice a near-tie; the wider rows spread them as a trained
router's are (bf16 rounding still flips the choices nearest a tie: the bf16 rule above).

Twelve prompts of 5 to 1,000 tokens decode together for 32 tokens: prefill chunks past 64 tokens (the shared
expert apart, its dense GEMMs), decode at 12 rows (the shared expert stacked in the experts' kernels, the sorted
order) and, as rows finish, fewer. CUDA graphs and prefix caching on (the engine's defaults).

The control: the same outputs scored against the reference with its shared experts' down projections zeroed must
fail the rule, or show a mean logprob error at least ``CONTROL_RATIO`` times larger: the comparison sees the shared
expert (the part this issue's kernels changed last). Result ``moe_2b_vs_fp32_reference`` in ``moe_check.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from gpu_check import FP32_RULE, ClearMarginRule, score_positions
from shapes import SHAPE_35B_A3B

from hyserve import LLM, SamplingParams
from hyserve.testing import reference_logits

SHAPE_MOE_2B: dict[str, Any] = {
    **{k: v for k, v in SHAPE_35B_A3B.items() if k not in ("mtp_num_hidden_layers", "rope_parameters")},
    "num_hidden_layers": 24, "num_experts": 64, "max_position_embeddings": 32768,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
}
TINY_MOE: dict[str, Any] = {
    **SHAPE_MOE_2B, "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "max_position_embeddings": 4096,
}
MOE_SHAPES = {"2b-active": SHAPE_MOE_2B, "tiny": TINY_MOE}
ROUTER_STD = 0.06  # router logits' spread about 45 x this at hidden 2048 (RMS-normed inputs)
PROMPT_LENS = (300, 17, 1000, 64, 5, 130, 9, 700, 33, 1, 250, 80)
MAX_TOKENS = 32
CONTROL_RATIO = 3.0


def write_moe_checkpoint(path: str, shape: dict[str, Any], device: str, seed: int = 0) -> dict[str, int]:
    """transformers' ``Qwen3_5MoeForCausalLM`` with random bf16 weights (norms spread, routers wider), saved to
    ``path``; returns its parameter count and the count a token reads (its top-k experts of each layer)."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    cfg = Qwen3_5MoeTextConfig(**shape, layer_types=None)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3_5MoeForCausalLM(cfg).to(torch.bfloat16)
    zero_centred = ("layernorm.weight", "q_norm.weight", "k_norm.weight", "model.norm.weight")
    total = active = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(zero_centred):
                p.normal_(0.0, 0.1)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, ROUTER_STD)
            total += p.numel()
            experts = ".mlp.experts." in name
            active += p.numel() * shape["num_experts_per_tok"] // shape["num_experts"] if experts else p.numel()
    model.save_pretrained(path)
    del model
    _free(device)
    return {"params": total, "active_params": active}


def generate(path: str, device: str, dtype: str, seed: int = 1, prompt_lens: tuple[int, ...] = PROMPT_LENS,
             max_tokens: int | tuple[int, ...] = MAX_TOKENS) -> tuple[list[list[int]], list[Any]]:
    """hyserve's greedy outputs (tokens, their logprobs) on prompts of ``prompt_lens``, each ``max_tokens`` long
    (or its own length: rows then finish at different steps and the decode batch shrinks)."""
    llm = LLM(model=path, device=device, dtype=dtype, max_num_seqs=16, max_model_len=4096,
              max_num_batched_tokens=2048, gpu_memory_utilization=0.4 if device == "cuda" else 0.9)
    vocab = llm.llm_engine.model_config.vocab_size
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in prompt_lens]
    lens = max_tokens if isinstance(max_tokens, tuple) else (max_tokens,) * len(prompts)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1) for n in lens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    rows = [(o.outputs[0].token_ids, [o.outputs[0].logprobs[i][t].logprob  # type: ignore[index]
                                      for i, t in enumerate(o.outputs[0].token_ids)]) for o in outs]
    llm.llm_engine.assert_no_leaks()
    del llm
    _free(device)
    return prompts, rows


def score(ref: Any, prompts: list[list[int]], rows: list[Any], rule: ClearMarginRule, device: str) -> dict[str, Any]:
    """The rule's totals over every prompt (``score_positions`` each), and whether they pass."""
    tot = {"tokens_checked": 0, "tokens_mismatched": 0, "tokens_scored": 0, "max_logprob_abs_err": 0.0,
           "sum_logprob_abs_err": 0.0}
    with torch.no_grad():
        for prompt, (toks, lps) in zip(prompts, rows, strict=True):
            logits = reference_logits(ref, prompt + list(toks), device=device)
            s = score_positions(logits[len(prompt) - 1 :], list(toks), lps, rule.margin)
            for k in ("tokens_checked", "tokens_mismatched", "tokens_scored", "sum_logprob_abs_err"):
                tot[k] += s[k]
            tot["max_logprob_abs_err"] = max(tot["max_logprob_abs_err"], s["max_logprob_abs_err"])
    tot["mean_logprob_abs_err"] = tot["sum_logprob_abs_err"] / max(tot["tokens_scored"], 1)
    tot["pass"] = rule.passes(tot)
    return tot


def router_gaps(ref: Any, token_ids: list[int], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One uncached reference pass: its logits (``reference_logits``) and, per position, the smallest gap over the
    layers between the router's k-th and (k + 1)-th logits (float64 from the router's float32 input): where it is
    about float32's rounding of a logit, a summation order other than the reference's may pick another expert.
    ``(len(token_ids), vocab)``, ``(len(token_ids),)``."""
    gaps: list[torch.Tensor] = []

    def hook(mod: Any, args: tuple[Any, ...], _out: Any) -> None:
        x = args[0].reshape(-1, args[0].shape[-1]).double()
        top = torch.topk(x @ mod.weight.double().T, mod.top_k + 1, dim=-1).values
        gaps.append((top[:, -2] - top[:, -1]).cpu())

    handles = [layer.mlp.gate.register_forward_hook(hook) for layer in ref.model.layers
               if hasattr(layer.mlp, "gate")]
    try:
        with torch.no_grad():
            logits = reference_logits(ref, token_ids, device=device)
    finally:
        for h in handles:
            h.remove()
    return logits, torch.stack(gaps).min(dim=0).values


def router_tie_report(ref: Any, prompts: list[list[int]], rows: list[Any], margin: float,
                      device: str) -> dict[str, Any]:
    """Where the float32 engine parts from the reference at a clear position, the smallest router gap over every
    token up to it (a flipped expert choice anywhere before reaches it through attention and the GDN state), beside
    the same figure at the positions that agree: the diagnostic for a float32 parting."""
    parted, agreed = [], []
    with torch.no_grad():
        for prompt, (toks, _) in zip(prompts, rows, strict=True):
            logits, gaps = router_gaps(ref, prompt + list(toks), device)
            logp = torch.log_softmax(logits[len(prompt) - 1:].double(), -1)
            upto = torch.cummin(gaps, dim=0).values[len(prompt) - 1:]
            for i, tok in enumerate(toks):
                top2 = torch.topk(logp[i], 2)
                if float(top2.values[0] - top2.values[1]) <= margin:
                    continue
                if int(top2.indices[0]) == tok:
                    agreed.append(float(upto[i]))
                else:
                    parted.append(float(upto[i]))
                    break
    q = torch.tensor(agreed or [float("nan")], dtype=torch.float64)
    return {"parted_min_router_gap_so_far": parted,
            "agreed_min_router_gap_so_far_quantiles": {str(p): float(torch.quantile(q, p)) for p in (0.1, 0.5, 0.9)}}


def teacher_forced_logprobs(ref: Any, prompts: list[list[int]], rows: list[Any], device: str) -> list[dict[str, Any]]:
    """Per output position of each row, under ``ref`` teacher-forced on the row's tokens: the logprob of the engine's
    token, the reference's argmax and its top-1 over top-2 margin (every position: the reference sees the engine's
    prefix, so nothing stops at a parting)."""
    out = []
    with torch.no_grad():
        for prompt, (toks, _) in zip(prompts, rows, strict=True):
            logp = torch.log_softmax(reference_logits(ref, prompt + list(toks), device=device)[len(prompt) - 1:]
                                     .double(), dim=-1)[: len(toks)]
            top2 = torch.topk(logp, 2, dim=-1)
            out.append({"lp": logp.gather(1, torch.tensor(list(toks))[:, None]).squeeze(1),
                        "argmax": top2.indices[:, 0], "margin": top2.values[:, 0] - top2.values[:, 1]})
    return out


class Bf16PeerRule(NamedTuple):
    """A bf16 engine against the float32 reference, measured by the reference's own bf16 copy on the same tokens.

    In a random MoE model bf16 rounding moves the logits more than in a dense one: a router choice near a tie flips
    and the hidden state takes another expert (transformers' own bf16 model against its float32 one, 4 layers of the
    2B-active shape: logprob error mean 0.057, max 0.53, argmax agreeing at 84 % of positions), so a fixed tolerance
    either fails a correct engine or passes a wrong one. The engine passes when its mean logprob error against the
    float32 reference is at most ``ratio`` times the bf16 reference's, and its greedy tokens part from the float32
    argmax at clear positions (margin above ``margin``) at most ``extra_per`` more often than the bf16 reference's
    argmax does (at least one more allowed)."""

    ratio: float
    margin: float
    extra_per: int

    def score(self, engine_lps: list[list[float]], rows: list[Any], ref32: list[dict[str, Any]],
              ref16: list[dict[str, Any]], yardstick32: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The engine against ``ref32``; the allowance from ``ref16`` against ``yardstick32`` (default ``ref32``;
        a control scores the engine against an altered reference and keeps the intact one's yardstick)."""
        yard = ref32 if yardstick32 is None else yardstick32
        e_h = torch.cat([(torch.tensor(lps, dtype=torch.float64) - r["lp"]).abs()
                         for lps, r in zip(engine_lps, ref32, strict=True)])
        e_b = torch.cat([(b["lp"] - r["lp"]).abs() for b, r in zip(ref16, yard, strict=True)])
        toks = torch.cat([torch.tensor(list(t)) for t, _ in rows])
        clear = torch.cat([r["margin"] > self.margin for r in ref32])
        h_miss = int(((toks != torch.cat([r["argmax"] for r in ref32])) & clear).sum())
        yard_clear = torch.cat([r["margin"] > self.margin for r in yard])
        b_miss = int(((torch.cat([b["argmax"] for b in ref16]) != torch.cat([r["argmax"] for r in yard]))
                      & yard_clear).sum())
        checked = int(clear.sum())
        allowed = b_miss + max(1, checked // self.extra_per)
        r = {"tokens_scored": int(e_h.numel()), "tokens_checked": checked, "tokens_mismatched": h_miss,
             "bf16_reference_mismatched": b_miss, "mismatches_allowed": allowed,
             "mean_logprob_abs_err": float(e_h.mean()), "max_logprob_abs_err": float(e_h.max()),
             "bf16_reference_mean_logprob_abs_err": float(e_b.mean()),
             "bf16_reference_max_logprob_abs_err": float(e_b.max())}
        r["pass"] = bool(r["mean_logprob_abs_err"] <= self.ratio * r["bf16_reference_mean_logprob_abs_err"]
                         and h_miss <= allowed)
        return r


BF16_PEER_RULE = Bf16PeerRule(ratio=1.5, margin=0.25, extra_per=50)


def moe_check(path: str, device: str = "cuda", dtype: str = "bfloat16", **generate_kw: Any) -> dict[str, Any]:
    """``generate`` on ``path``, scored against transformers' float32 model, then against a control (the reference
    without its shared experts) that must fail. A float32 engine: ``FP32_RULE`` (every clear position's argmax,
    logprobs within 3e-3). A bf16 engine: ``BF16_PEER_RULE``, beside transformers' own bf16 model on the same
    tokens. ``pass``: the first passes and the control does not."""
    prompts, rows = generate(path, device, dtype, **generate_kw)
    print(f"engine done ({time.strftime('%T')}); the reference in float32", flush=True)
    with torch_gdn_reference():
        return _score_against_reference(path, prompts, rows, device, dtype)


def _score_against_reference(path: str, prompts: list[list[int]], rows: list[Any], device: str,
                             dtype: str) -> dict[str, Any]:
    from transformers import Qwen3_5MoeForCausalLM

    ref = Qwen3_5MoeForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    if dtype == "float32":
        r = {**score(ref, prompts, rows, FP32_RULE, device), "rule": FP32_RULE._asdict()}
        if r["tokens_mismatched"]:
            r["router_ties"] = router_tie_report(ref, prompts, rows, FP32_RULE.margin, device)
            print(f"router ties: {r['router_ties']}", flush=True)
        zero_shared_experts(ref)
        control = score(ref, prompts, rows, FP32_RULE, device)
    else:
        ref32 = teacher_forced_logprobs(ref, prompts, rows, device)
        zero_shared_experts(ref)
        ref32_control = teacher_forced_logprobs(ref, prompts, rows, device)
        del ref
        _free(device)
        print(f"float32 reference done ({time.strftime('%T')}); transformers' bf16", flush=True)
        ref16_model = Qwen3_5MoeForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
        ref16 = teacher_forced_logprobs(ref16_model, prompts, rows, device)
        del ref16_model
        lps = [list(lp) for _, lp in rows]
        r = {**BF16_PEER_RULE.score(lps, rows, ref32, ref16), "rule": BF16_PEER_RULE._asdict()}
        control = BF16_PEER_RULE.score(lps, rows, ref32_control, ref16, yardstick32=ref32)
    sees = (not control["pass"]
            or control["mean_logprob_abs_err"] >= CONTROL_RATIO * max(r["mean_logprob_abs_err"], 1e-12))
    return {**r, "dtype": dtype, "control_without_shared_experts": control,
            "control_sees_the_shared_expert": sees, "pass": bool(r["pass"] and sees)}


def zero_shared_experts(ref: Any) -> None:
    with torch.no_grad():
        for layer in ref.model.layers:
            layer.mlp.shared_expert.down_proj.weight.zero_()


@contextlib.contextmanager
def torch_gdn_reference() -> Iterator[None]:
    """transformers' Qwen3.5-MoE modeling on its own PyTorch GDN functions while the block runs: with fla installed
    its module-level ``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule`` call fla's kernels (the
    choice is made at import); their undecorated PyTorch bodies are put back in their place."""
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as mod

    names = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
    saved = {n: getattr(mod, n) for n in names}
    try:
        for n, f in saved.items():
            setattr(mod, n, inspect.unwrap(f))
        yield
    finally:
        for n, f in saved.items():
            setattr(mod, n, f)


def _free(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", choices=sorted(MOE_SHAPES), default="2b-active")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--model", help="an existing checkpoint of the shape (else one is written to a temporary dir)")
    args = ap.parse_args()
    if args.dtype == "float32":  # Triton's dots on float32 operands default to TF32 (the reference's fla kernels)
        os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
    os.makedirs(args.out, exist_ok=True)
    results: dict[str, Any] = {"device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
                               "torch": torch.__version__, "shape": args.shape,
                               "shape_fields": MOE_SHAPES[args.shape]}
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or os.path.join(tmp, "moe")
        if not args.model:
            results.update(write_moe_checkpoint(path, MOE_SHAPES[args.shape], args.device))
        r = results["moe_2b_vs_fp32_reference"] = moe_check(path, args.device, args.dtype)
    beside = ""
    if "bf16_reference_mean_logprob_abs_err" in r:
        beside = (f" (transformers bf16: {r['bf16_reference_mismatched']} mismatched, mean "
                  f"{r['bf16_reference_mean_logprob_abs_err']:.3g}, max {r['bf16_reference_max_logprob_abs_err']:.3g})")
    print(f"MoE {args.shape} {args.dtype} vs transformers fp32: {r['tokens_mismatched']}/{r['tokens_checked']} clear "
          f"positions mismatched, logprob err max {r['max_logprob_abs_err']:.3g} mean {r['mean_logprob_abs_err']:.3g}"
          f"{beside}; "
          f"control without shared experts: mean {r['control_without_shared_experts']['mean_logprob_abs_err']:.3g}, "
          f"pass {r['control_without_shared_experts']['pass']}; pass {r['pass']}", flush=True)
    with open(os.path.join(args.out, "moe_check.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2)
    return 0 if r["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())

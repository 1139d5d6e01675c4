"""Issue 31's check on the card: a 2B-active Qwen3.5-MoE shape served on CUDA against transformers' own
``Qwen3_5MoeForCausalLM`` in float32, teacher-forced on hyserve's greedy tokens.

* float32 (``--dtype float32``): ``FP32_RULE`` per prompt, as the tiny float32 checks (every clear position's
  argmax, logprobs within 3e-3), and a prompt that fails it passes where router flips explain it
  (``score_with_router_flips``). A router's k-th and (k + 1)-th logits within ``TIE_GAP`` of each other are a
  near-tie that another correct float32 summation order may take the other way: the token takes another expert and
  every later position differs, past any tolerance (the card's three partings of 317 followed such ties). From a
  failing prompt's first failure (a clear parting or a logprob error of 3e-3 or more) the (token, layer) pairs at or
  before its row with a gap below ``TIE_GAP`` are tried, smallest gap first: each try reruns the reference with that
  choice taken the other way (the k-th expert replaced by the (k + 1)-th, the weights renormalized as the router
  does) and rescores the same engine tokens and logprobs; one passing ``FP32_RULE`` on the whole prompt explains it,
  one moving the first failure later is kept and the search goes on from there (``MAX_FLIPS`` combined,
  ``MAX_FLIP_TRIES`` passes a prompt). The totals are the unflipped reference's. Triton's dots on float32 operands
  default to TF32: the script sets ``TRITON_F32_DEFAULT=ieee`` for any dot that leaves its precision to the default
  (hyserve's own kernels pass ``input_precision``, and a float32 engine takes its recurrent GDN kernel for every row,
  not fla's). This is the check of the kernels' arithmetic at the real shape.
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
fail the rule (in float32 after the same search for router flips: it is judged no more strictly than the engine),
or show a mean logprob error at least ``CONTROL_RATIO`` times larger: the comparison sees the shared expert (the part
this issue's kernels changed last). Result ``moe_2b_vs_fp32_reference`` in ``moe_check.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
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
# TIE_GAP: a router gap (k-th minus (k + 1)-th logit) below it is a near-tie that another correct float32 summation
# order may take the other way. The logits are ~2.7 (the largest ~7; float32's spacing there 2.4e-7 to 4.8e-7), two
# orders of a 2048-term dot differ by ~1e-6 to 1e-5, and the card's three partings followed gaps of 1.3e-5, 4.6e-6
# and 4.0e-6: 1e-4 is ~8x the largest. Yet it takes few pairs: 10 of 14,800 (token, layer) gaps (0.07 %; median
# 0.15) at the 2B-active shape's routers (4 of its layers, four prompts of 700 to 1,000 tokens, on the CPU), about
# 17 over the 24 layers of a 1,000-token prompt; none of 1,840 at the tiny test shape's (hidden 64, 8 experts).
TIE_GAP = 1e-4
MAX_FLIP_TRIES = 6  # flipped reference passes per failing prompt (about 1.5 s each at 1,000 tokens on the card)
MAX_FLIPS = 2  # flips combined in one explanation


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


class Flip(NamedTuple):
    """One router choice taken the other way: at token ``token`` (prompt + output coordinates) the router of
    ``model.layers[layer]`` takes its (k + 1)-th expert instead of its k-th; ``gap`` is their logits' difference."""

    token: int
    layer: int
    gap: float


def router_gaps(ref: Any, token_ids: list[int], device: str,
                flips: Sequence[Flip] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """One uncached reference pass (``reference_logits``) with ``flips`` applied: its logits and, per layer and
    token, the gap between the router's k-th and (k + 1)-th logits (float64 from the router's float32 input; inf
    where a layer has no router). Where a gap is about float32's rounding of a logit, a summation order other than
    the reference's may pick the other expert. A flip replaces, at its row only, the router's k-th index by its
    (k + 1)-th (by the router's own float32 softmax) and renormalizes the k scores as the router does (float32 sum,
    cast to the logits' dtype); the router sees the batch flattened, one row a token, and a flip past the tokens
    does nothing. ``(len(token_ids), vocab)``, ``(len(ref.model.layers), len(token_ids))``."""
    layers = ref.model.layers
    gaps = torch.full((len(layers), len(token_ids)), float("inf"), dtype=torch.float64)
    rows: dict[int, list[int]] = {}
    for f in flips:
        rows.setdefault(f.layer, []).append(f.token)

    def hook(n: int, mod: Any, args: tuple[Any, ...], out: tuple[torch.Tensor, ...]) -> Any:
        x = args[0].reshape(-1, args[0].shape[-1]).double()
        top = torch.topk(x @ mod.weight.double().T, mod.top_k + 1, dim=-1).values
        gaps[n] = (top[:, -2] - top[:, -1]).cpu()
        if n not in rows:
            return None
        logits, scores, idx = out
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        scores, idx = scores.clone(), idx.clone()
        for t in (t for t in rows[n] if t < len(probs)):
            order = torch.topk(probs[t], mod.top_k + 1).indices
            chosen = torch.cat([order[: mod.top_k - 1], order[mod.top_k :]])
            value = probs[t, chosen]
            scores[t], idx[t] = (value / value.sum()).to(logits.dtype), chosen
        return logits, scores, idx

    handles = [layer.mlp.gate.register_forward_hook(functools.partial(hook, n)) for n, layer in enumerate(layers)
               if hasattr(layer.mlp, "gate")]
    try:
        with torch.no_grad():
            logits = reference_logits(ref, token_ids, device=device)
    finally:
        for h in handles:
            h.remove()
    return logits, gaps


def first_failure(logits: torch.Tensor, toks: list[int], lps: list[float], rule: ClearMarginRule) -> int | None:
    """The first output position at which a rule allowing no mismatch fails (``score_positions``' definitions:
    the engine's logprob ``rule.logprob_tol`` or more from the reference's, or a clear position's argmax not the
    engine's token), ``None`` where the prompt passes; row i of ``logits`` predicts ``toks[i]``."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    for i, tok in enumerate(toks):
        row = logp[i]
        top2 = torch.topk(row, 2)
        parted = int(top2.indices[0]) != tok
        if abs(lps[i] - float(row[tok])) >= rule.logprob_tol or (
                parted and float(top2.values[0] - top2.values[1]) > rule.margin):
            return i
        if parted and float(top2.values[0] - row[tok]) > rule.margin:
            return None  # score_positions stops here
    return None


def failure_details(logits: torch.Tensor, tok: int, lp: float, gaps: torch.Tensor, n: int = 5) -> dict[str, Any]:
    """What one first failure looks like: the engine's token and logprob against the reference's (``logprob_err``),
    the reference's argmax and its top-1 over top-2 margin, whether the argmax parts from the engine's token, and
    the ``n`` smallest router gaps ``(token, layer, gap)`` up to that row (``gaps`` (layers, rows up to it)): a
    parting just after a gap a little above the tie threshold reads differently from one with no small gap."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    top2 = torch.topk(logp, 2)
    flat = gaps.flatten()
    k = min(n, int(torch.isfinite(flat).sum()))
    small = torch.topk(flat, k, largest=False)
    width = gaps.shape[1]
    return {"token": int(tok), "engine_logprob": float(lp), "reference_logprob": float(logp[tok]),
            "logprob_err": abs(float(lp) - float(logp[tok])), "reference_argmax": int(top2.indices[0]),
            "reference_margin": float(top2.values[0] - top2.values[1]), "parted": int(top2.indices[0]) != tok,
            "smallest_gaps": [(int(i) % width, int(i) // width, float(v))
                              for v, i in zip(small.values, small.indices, strict=True)]}


def explain_by_router_flips(ref: Any, prompt: list[int], toks: list[int], lps: list[float], device: str,
                            rule: ClearMarginRule = FP32_RULE, *, tie_gap: float = TIE_GAP,
                            max_tries: int = MAX_FLIP_TRIES, max_flips: int = MAX_FLIPS,
                            unflipped: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, Any]:
    """Whether router choices taken the other way at near-ties explain one prompt's failure of ``rule``.

    From the prompt's first failure (output i, reference row ``len(prompt) - 1 + i``) the (token, layer) pairs at
    or before that row whose router gap is below ``tie_gap`` are candidates, smallest gap first (the flips already
    kept excluded); each try is one reference pass with the kept flips plus the candidate, rescoring the same engine
    tokens and logprobs. A try that passes ``rule`` explains the prompt; the first try that moves the first failure
    later is kept while fewer than ``max_flips`` are kept, and the search starts again from the new failure (gaps of
    that pass); at most ``max_tries`` tries in all. ``unflipped``: ``router_gaps`` of the prompt without flips, if
    already computed. Returns ``explained``, ``first_failure`` (unflipped; ``None`` where the prompt passes),
    ``flips`` (those that explain it, else ``[]``) and ``tries``."""
    assert rule.mismatches_per is None, "a rule allowing mismatches has no first failure"
    ids, row0 = list(prompt) + list(toks), len(prompt) - 1
    logits, gaps = unflipped if unflipped is not None else router_gaps(ref, ids, device)
    fail = first_failure(logits[row0:], list(toks), lps, rule)
    out: dict[str, Any] = {"explained": fail is None, "first_failure": fail, "flips": [], "tries": 0}
    if fail is not None:
        out["failure"] = failure_details(logits[row0 + fail], toks[fail], lps[fail], gaps[:, : row0 + fail + 1])
    kept: list[Flip] = []
    while fail is not None:
        upto = gaps[:, : row0 + fail + 1].clone()
        for f in kept:
            upto[f.layer, f.token] = float("inf")
        layer, token = torch.nonzero(upto < tie_gap, as_tuple=True)
        order = torch.argsort(upto[layer, token], stable=True)
        moved = None
        for j in order.tolist()[: max_tries - out["tries"]]:
            out["tries"] += 1
            cand = Flip(int(token[j]), int(layer[j]), float(upto[layer[j], token[j]]))
            lg, gp = router_gaps(ref, ids, device, [*kept, cand])
            new = first_failure(lg[row0:], list(toks), lps, rule)
            if new is None:
                out.update(explained=True, flips=[*kept, cand])
                return out
            if new > fail and len(kept) + 1 < max_flips:
                moved = cand, lg, gp, new
                break
        if moved is None:
            return out
        cand, logits, gaps, fail = moved
        kept.append(cand)
    return out


def score_with_router_flips(ref: Any, prompts: list[list[int]], rows: list[Any], device: str,
                            rule: ClearMarginRule = FP32_RULE, *, tie_gap: float = TIE_GAP,
                            max_tries: int = MAX_FLIP_TRIES, max_flips: int = MAX_FLIPS,
                            label: str = "float32") -> dict[str, Any]:
    """``rule`` per prompt (``score_positions``, ``rule.passes`` on the prompt's totals), each failing prompt then
    searched for an explanation by router flips (``explain_by_router_flips``). The totals (``tokens_checked``,
    ``tokens_mismatched``, logprob errors) are the unflipped reference's and ``pass_unflipped`` is ``rule`` on
    them; ``pass``: every failing prompt explained. ``router_flips``: per explained prompt (its index) the flips,
    ``(token, layer, gap)``; ``unexplained``: per other failing prompt its first failure (``failure_details``);
    ``flip_passes``: the reference passes the search took. ``router_ties`` (where a
    prompt fails): the smallest router gap over every layer and token up to each prompt's first clear parting
    (a flipped choice anywhere before reaches it through attention and the GDN state), beside the quantiles of the
    same figure at the clear positions that agree."""
    tot: dict[str, Any] = {"tokens_checked": 0, "tokens_mismatched": 0, "tokens_scored": 0,
                           "max_logprob_abs_err": 0.0, "sum_logprob_abs_err": 0.0}
    failing, explained, flip_passes = 0, 0, 0
    flips: list[dict[str, Any]] = []
    unexplained: list[dict[str, Any]] = []
    parted: list[float] = []
    agreed: list[float] = []
    for n, (prompt, (toks, lps)) in enumerate(zip(prompts, rows, strict=True)):
        toks, row0 = list(toks), len(prompt) - 1
        logits, gaps = router_gaps(ref, list(prompt) + toks, device)
        s = score_positions(logits[row0:], toks, lps, rule.margin)
        for k in ("tokens_checked", "tokens_mismatched", "tokens_scored", "sum_logprob_abs_err"):
            tot[k] += s[k]
        tot["max_logprob_abs_err"] = max(tot["max_logprob_abs_err"], s["max_logprob_abs_err"])
        _gap_so_far(logits[row0:], toks, gaps, row0, rule.margin, parted, agreed)
        if rule.passes(s):
            continue
        failing += 1
        e = explain_by_router_flips(ref, prompt, toks, lps, device, rule, tie_gap=tie_gap, max_tries=max_tries,
                                    max_flips=max_flips, unflipped=(logits, gaps))
        flip_passes += e["tries"]
        if e["explained"]:
            explained += 1
            flips.append({"prompt": n, "flips": [f._asdict() for f in e["flips"]]})
        else:
            unexplained.append({"prompt": n, "first_failure": e["first_failure"], **e.get("failure", {})})
        print(f"{label}: prompt {n} ({len(prompt)} + {len(toks)} tokens) fails at output {e['first_failure']}; "
              + (f"explained by router flips {[tuple(f) for f in e['flips']]}" if e["explained"] else "not explained")
              + f" ({e['tries']} flipped passes, {time.strftime('%T')})", flush=True)
    tot["mean_logprob_abs_err"] = tot["sum_logprob_abs_err"] / max(tot["tokens_scored"], 1)
    tot["pass_unflipped"] = rule.passes(tot)
    tot.update(prompts_failing=failing, prompts_explained_by_router_flips=explained, router_flips=flips,
               flip_passes=flip_passes, unexplained=unexplained)
    if failing:
        q = torch.tensor(agreed or [float("nan")], dtype=torch.float64)
        tot["router_ties"] = {"parted_min_router_gap_so_far": parted, "agreed_min_router_gap_so_far_quantiles":
                              {str(p): float(torch.quantile(q, p)) for p in (0.1, 0.5, 0.9)}}
    tot["pass"] = failing == explained
    return tot


def _gap_so_far(logits: torch.Tensor, toks: list[int], gaps: torch.Tensor, row0: int, margin: float,
                parted: list[float], agreed: list[float]) -> None:
    """``router_ties``' figures of one prompt, appended: the smallest gap over the layers and the tokens up to each
    clear position that agrees, and up to its first clear parting."""
    upto = torch.cummin(gaps.min(dim=0).values, dim=0).values[row0:]
    logp = torch.log_softmax(logits.double(), -1)
    for i, tok in enumerate(toks):
        top2 = torch.topk(logp[i], 2)
        if float(top2.values[0] - top2.values[1]) <= margin:
            continue
        if int(top2.indices[0]) != tok:
            parted.append(float(upto[i]))
            return
        agreed.append(float(upto[i]))


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
    without its shared experts) that must fail. A float32 engine: ``score_with_router_flips``, ``FP32_RULE`` per
    prompt (every clear position's argmax, logprobs within 3e-3) and each failing prompt passing only where flipping
    at most ``MAX_FLIPS`` router choices within ``TIE_GAP`` of a tie, up to its first failure, makes the reference
    pass it on the same tokens (``prompts_failing``, ``prompts_explained_by_router_flips``, ``router_flips``; the
    totals and ``pass_unflipped`` are the unflipped reference's); the control is searched the same way. A bf16
    engine: ``BF16_PEER_RULE``, beside transformers' own bf16 model on the same tokens. ``pass``: the first passes
    and the control does not."""
    prompts, rows = generate(path, device, dtype, **generate_kw)
    print(f"engine done ({time.strftime('%T')}); the reference in float32", flush=True)
    with torch_gdn_reference():
        return _score_against_reference(path, prompts, rows, device, dtype)


def _score_against_reference(path: str, prompts: list[list[int]], rows: list[Any], device: str,
                             dtype: str) -> dict[str, Any]:
    from transformers import Qwen3_5MoeForCausalLM

    ref = Qwen3_5MoeForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    if dtype == "float32":
        rule = {**FP32_RULE._asdict(), "tie_gap": TIE_GAP, "max_flip_tries": MAX_FLIP_TRIES, "max_flips": MAX_FLIPS}
        r = {**score_with_router_flips(ref, prompts, rows, device), "rule": rule}
        if "router_ties" in r:
            print(f"router ties: {r['router_ties']}", flush=True)
        zero_shared_experts(ref)
        control = score_with_router_flips(ref, prompts, rows, device, label="control")
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

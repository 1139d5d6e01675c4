"""GPU check: the CUDA path against the torch reference, then first throughput numbers beside the bandwidth bound.

Run on a CUDA machine (one H200 here):

    python benchmarks/gpu_check.py --out results/

1. Ceilings measured in the same run: device-to-device copy bandwidth and bf16 matmul rate.
2. Correctness. Tiny random checkpoints (several layer patterns, both checkpoint forms): hyserve on CUDA (float32,
   fast kernels) against transformers' uncached float32 forward, teacher-forced on hyserve's greedy output: every
   greedy token must be the reference's argmax (where the reference's top-2 margin is clear) and each chosen token's
   logprob must match. The same on a random-weight model of the Qwen3.5-2B shape in bfloat16 (tolerances of bf16).
3. Throughput on the 2B shape (bf16): prefill tokens/s; decode tokens/s at batch 1 and 64, against the
   weights-bandwidth bound (weights bytes read per step / measured copy bandwidth) and against transformers'
   ``generate`` on the same model at batch 1.
4. Images (``image_check``, CUDA only here): the tiny VLM (``write_tiny_vlm_checkpoint`` with an MTP layer) served in
   float32 on CUDA with CUDA graphs, prefix caching, 16-token chunks (cutting inside every image span) and MTP k = 2:
   one image, two images, and a three-turn episode of sliding two-screenshot prompts whose later turns hit the
   prefix cache; every greedy token must equal transformers' (``reference_vlm_greedy``, float32 on the CPU, in a
   process without CUDA) and every prompt's expanded ids the ones the tokenizer and transformers' image processor
   give. Joins ``all_correctness_pass``. ``--images-only`` runs this alone (gpu_check_images.json).
5. The 2B-shape VLM (``--vlm-2b DIR``: a checkpoint of ``peer_bench.py write --shape 2b --vision real``, its
   real-size tower, processor files and tokenizer; ``vlm_check``): four ChatML prompts with one or two noise images
   (640x360, 320x320), the third resuming from the first's cached prefix, served in bf16 on CUDA (CUDA graphs,
   prefix caching, default chunking), greedy for 32 tokens; transformers' ``Qwen3_5ForConditionalGeneration`` in
   float32 on CUDA, teacher-forced on hyserve's tokens, must agree on clear-margin positions by the 2B text check's
   rule (``BF16_RULE``), and every prompt's expanded ids must be the ones built from transformers' processor grids.
   The same outputs against the reference given other images (``control_other_images``) must show that the
   comparison sees the images: the rule fails there, or the mean logprob error is at least ``IMAGES_SEEN_RATIO``
   times larger.
   Result ``vlm_2b_vs_fp32_reference``; joins ``all_correctness_pass``. ``--vlm-2b DIR --vlm-2b-only`` runs it
   alone (gpu_check_vlm_2b.json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, NamedTuple

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hyserve import LLM, SamplingParams
from hyserve.testing import load_reference_model, reference_logits, write_tiny_checkpoint

sys.path.insert(0, os.path.dirname(__file__))
from shapes import SHAPE_2B, write_random_checkpoint

OUT_DIR = "benchmarks/results"
OUT_NAME = "gpu_check.json"


def save(results: dict[str, Any]) -> None:
    """Write what is measured so far: a run stopped by a time limit still leaves its numbers."""
    with open(os.path.join(OUT_DIR, OUT_NAME), "w") as f:
        json.dump(results, f, indent=2)


def measure_ceilings() -> dict[str, float]:
    n = 2 * 1024**3
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ev0.record()
    for _ in range(10):
        b.copy_(a)
    ev1.record()
    torch.cuda.synchronize()
    bw = 2 * n * 10 / (ev0.elapsed_time(ev1) / 1e3)
    del a, b
    x = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    y = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        x @ y
    torch.cuda.synchronize()
    ev0.record()
    for _ in range(10):
        x @ y
    ev1.record()
    torch.cuda.synchronize()
    flops = 2 * 8192**3 * 10 / (ev0.elapsed_time(ev1) / 1e3)
    return {"copy_bandwidth_Bps": bw, "bf16_matmul_flops": flops}


class ClearMarginRule(NamedTuple):
    """How a teacher-forced comparison is judged. A position is clear where the reference's top-1 logprob beats its
    top-2 by more than ``margin``; on clear positions the engine's greedy token must be the reference's argmax,
    except for at most max(1, clear // ``mismatches_per``) of them (``None``: none), and every scored token's logprob
    must be within ``logprob_tol`` of the reference's. A prompt is scored up to its first clear divergence (later
    positions are conditioned on a different prefix)."""

    margin: float
    logprob_tol: float
    mismatches_per: int | None

    def passes(self, r: dict[str, Any]) -> bool:
        allowed = 0 if self.mismatches_per is None else max(1, r["tokens_checked"] // self.mismatches_per)
        return bool(r["tokens_mismatched"] <= allowed and r["max_logprob_abs_err"] < self.logprob_tol)


BF16_RULE = ClearMarginRule(margin=0.25, logprob_tol=0.3, mismatches_per=50)  # bf16 engine, float32 reference
FP32_RULE = ClearMarginRule(margin=1e-3, logprob_tol=3e-3, mismatches_per=None)  # float32 both (tiny_reference's)


def score_positions(logits: torch.Tensor, toks: list[int], lps: list[float], margin: float) -> dict[str, Any]:
    """One prompt's greedy output ``toks`` (the engine's logprobs ``lps``) against the reference's ``logits``, row i
    predicting ``toks[i]`` (the rows from the prompt's last position on), by ``ClearMarginRule``'s definitions."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    checked = mismatched = scored = 0
    max_lp_err = sum_lp_err = 0.0
    for i, tok in enumerate(toks):
        row = logp[i]
        top2 = torch.topk(row, 2)
        scored += 1
        err = abs(lps[i] - float(row[tok]))
        max_lp_err, sum_lp_err = max(max_lp_err, err), sum_lp_err + err
        if float(top2.values[0] - top2.values[1]) > margin:
            checked += 1
            mismatched += int(int(top2.indices[0]) != tok)
        if int(top2.indices[0]) != tok and float(top2.values[0] - row[tok]) > margin:
            break  # diverged: later positions are conditioned on a different prefix anyway
    return {"tokens_checked": checked, "tokens_mismatched": mismatched, "max_logprob_abs_err": max_lp_err,
            "sum_logprob_abs_err": sum_lp_err, "tokens_scored": scored}


def teacher_forced_check(llm: LLM, ref: Any, prompts: list[list[int]], max_tokens: int, ref_device: str,
                         margin: float) -> dict[str, float]:
    """Greedy-generate with hyserve, then score prompt+output with the reference in one uncached forward."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    checked = mismatched = 0
    max_lp_err = 0.0
    for prompt, out in zip(prompts, outs, strict=True):
        toks = out.outputs[0].token_ids
        lps = [out.outputs[0].logprobs[i][t].logprob for i, t in enumerate(toks)]  # type: ignore[index]
        logits = reference_logits(ref, prompt + toks, device=ref_device)
        s = score_positions(logits[len(prompt) - 1 :], toks, lps, margin)
        checked += s["tokens_checked"]
        mismatched += s["tokens_mismatched"]
        max_lp_err = max(max_lp_err, s["max_logprob_abs_err"])
    return {"tokens_checked": checked, "tokens_mismatched": mismatched, "max_logprob_abs_err": max_lp_err}


def tiny_generate(workdir: str, device: str = "cuda") -> list[dict[str, Any]]:
    """hyserve on CUDA (float32) over tiny checkpoints; the reference is computed later in a process without fla.

    Each case runs twice: with the default GDN dispatch and with our exact-fp32 recurrent Triton kernel forced for
    every row. (The first H200 run used fla's chunked kernel in the default path and measured its TF32 rounding:
    logprob errors up to 0.16 against 3.3e-4 for the recurrent kernel; float32 models now take the recurrent kernel.)
    """
    import hyserve.kernels.gdn as gdn

    patterns = {
        "gdn3_attn1": ["linear_attention"] * 3 + ["full_attention"],
        "attn_first": ["full_attention", "linear_attention", "linear_attention", "full_attention"],
        "gdn_only_run": ["linear_attention"] * 5 + ["full_attention"],
    }
    g = torch.Generator().manual_seed(0)
    cases = []
    default_max = gdn.GDN_RECURRENT_MAX_QUERY_LEN
    for name, layers in patterns.items():
        for form in ("causal", "conditional"):
            d = os.path.join(workdir, f"{name}_{form}")
            write_tiny_checkpoint(d, form=form, layer_types=layers, seed=len(cases))
            for gdn_path, max_q in (("default", default_max), ("triton_recurrent", 10**9)):
                gdn.GDN_RECURRENT_MAX_QUERY_LEN = max_q
                llm = LLM(model=d, device=device, dtype="float32", max_num_batched_tokens=96, max_num_seqs=8,
                          num_kv_blocks=64, num_state_slots=8)
                vocab = llm.llm_engine.model_config.vocab_size
                gg = torch.Generator().manual_seed(len(cases) // 2)
                prompts = [torch.randint(0, vocab, (n,), generator=gg).tolist() for n in (5, 37, 80, 130, 1, 64)]
                params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                cases.append({"name": f"tiny_{name}_{form}_fp32_gdn_{gdn_path}", "path": d, "prompts": prompts,
                              "outputs": [o.outputs[0].token_ids for o in outs],
                              "logprobs": [[o.outputs[0].logprobs[i][t].logprob  # type: ignore[index]
                                            for i, t in enumerate(o.outputs[0].token_ids)] for o in outs]})
                del llm
    gdn.GDN_RECURRENT_MAX_QUERY_LEN = default_max
    del g
    return cases


def tiny_reference(cases_file: str) -> dict[str, Any]:
    """Score the recorded outputs with transformers' float32 forward on the CPU (torch fallbacks, no fla)."""
    with open(cases_file) as f:
        cases = json.load(f)
    results: dict[str, Any] = {}
    refs: dict[str, Any] = {}
    for case in cases:
        ref = refs.setdefault(case["path"], load_reference_model(case["path"]))
        checked = mismatched = 0
        max_err = 0.0
        for prompt, toks, lps in zip(case["prompts"], case["outputs"], case["logprobs"], strict=True):
            logp = torch.log_softmax(reference_logits(ref, prompt + toks).double(), dim=-1)
            for i, tok in enumerate(toks):
                row = logp[len(prompt) - 1 + i]
                top2 = torch.topk(row, 2)
                max_err = max(max_err, abs(lps[i] - float(row[tok])))
                if float(top2.values[0] - top2.values[1]) > 1e-3:
                    checked += 1
                    mismatched += int(int(top2.indices[0]) != tok)
        tol = 3e-3
        results[case["name"]] = {"tokens_checked": checked, "tokens_mismatched": mismatched,
                                 "max_logprob_abs_err": max_err, "tolerance": tol,
                                 "pass": mismatched == 0 and max_err < tol}
    return results


def shape_2b(results: dict[str, Any], workdir: str) -> None:
    from transformers import Qwen3_5ForCausalLM

    path = os.path.join(workdir, "qwen35-2b-shape")
    n_params = write_random_checkpoint(path, SHAPE_2B)
    results["2b_params"] = n_params

    # Half the card: the float32 transformers reference (8 GB) is loaded beside it.
    llm = LLM(model=path, device="cuda", dtype="bfloat16", max_num_seqs=64, max_model_len=4096,
              max_num_batched_tokens=8192, gpu_memory_utilization=0.5)
    results["2b_cache_layout"] = {"kv_blocks": llm.llm_engine.runner.layout.num_kv_blocks,
                                  "state_slots": llm.llm_engine.runner.layout.num_state_slots}
    save(results)
    eng = llm.llm_engine
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, SHAPE_2B["vocab_size"], (n,), generator=g).tolist() for n in (300, 17, 1000, 64)]
    ref = Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32).to("cuda").eval()
    r = teacher_forced_check(llm, ref, prompts, 32, "cuda", margin=BF16_RULE.margin)
    r["pass"] = BF16_RULE.passes(r)
    results["2b_bf16_vs_fp32_reference"] = r
    print(f"2B shape bf16 vs transformers fp32: {r}", flush=True)
    save(results)

    # transformers generate at batch 1 on the same weights (bf16), for the ratio.
    ref = ref.to(torch.bfloat16)
    ids = torch.tensor([prompts[2][:512]], device="cuda")
    ref.generate(ids, max_new_tokens=4, do_sample=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    ref.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)
    torch.cuda.synchronize()
    results["transformers_generate_bs1_tok_s"] = 32 / (time.perf_counter() - t0)
    print(f"transformers generate bs1: {results['transformers_generate_bs1_tok_s']:.1f} tok/s", flush=True)
    save(results)
    del ref
    torch.cuda.empty_cache()

    # Prefill throughput: 16 prompts of 2048 tokens, one output token each.
    long = [torch.randint(0, SHAPE_2B["vocab_size"], (2048,), generator=g).tolist() for _ in range(16)]
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in long[:2]], one, use_tqdm=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in long], one, use_tqdm=False)
    torch.cuda.synchronize()
    results["prefill_tok_s"] = 16 * 2048 / (time.perf_counter() - t0)
    print(f"prefill: {results['prefill_tok_s']:.0f} tok/s", flush=True)
    save(results)

    # Decode throughput (CUDA graphs, the default): time only the steps in which every row decodes.
    graphs = eng.runner.graphs
    results["cuda_graph_sizes"] = {n: s.sizes for n, s in graphs.sets.items()} if graphs is not None else None
    for batch in (1, 64):
        results[f"decode_bs{batch}_tok_s"] = decode_throughput(eng, batch, g)
        print(f"decode bs{batch}: {results[f'decode_bs{batch}_tok_s']:.1f} tok/s", flush=True)
        save(results)
    results["decode_graph_replays"] = graphs.num_replays if graphs is not None else 0
    eng.assert_no_leaks()
    del llm, eng, graphs
    torch.cuda.empty_cache()

    # The same at batch 1 without graphs, for the ratio.
    llm = LLM(model=path, device="cuda", dtype="bfloat16", max_num_seqs=64, max_model_len=4096,
              max_num_batched_tokens=8192, gpu_memory_utilization=0.5, enforce_eager=True)
    results["decode_bs1_eager_tok_s"] = decode_throughput(llm.llm_engine, 1, g)
    print(f"decode bs1 eager: {results['decode_bs1_eager_tok_s']:.1f} tok/s", flush=True)
    save(results)


def decode_throughput(eng: Any, batch: int, g: torch.Generator) -> float:
    ps = [torch.randint(0, SHAPE_2B["vocab_size"], (512,), generator=g).tolist() for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    for i, p in enumerate(ps):
        eng.add_request(f"dec{batch}-{i}", {"prompt_token_ids": p}, params)
    decode_time = 0.0
    decode_tokens = 0
    while eng.has_unfinished_requests():
        all_decode = all(r.num_computed_tokens > 0 and r.num_tokens - r.num_computed_tokens == 1
                         for r in eng.scheduler.running) and not eng.scheduler.waiting
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = eng.step()
        torch.cuda.synchronize()
        if all_decode:
            decode_time += time.perf_counter() - t0
            decode_tokens += len(outs)
    return decode_tokens / decode_time


# ---------------------------------------------------------------------------------------------------------- images

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
IMAGE_MAX_TOKENS = 8


def _user(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def image_batches() -> list[list[tuple[str, list[tuple[int, int, int]]]]]:
    """The image cases, in batches run one after another: (prompt text, images as (width, height, seed)).

    One image; two images of different sizes; then the seed's agent episode, three turns, each with the last two
    screenshots (the older one's placeholder replaced by text), so turns 1 and 2 resume from the prefix cache."""
    batches = [[(_user(f"{IMAGE}What is shown?"), [(40, 32, 1)]),
                (_user(f"Compare {IMAGE} with {IMAGE}, briefly."), [(48, 48, 2), (16, 40, 3)])]]
    system = ("<|im_start|>system\nYou operate a computer. Each turn shows the latest screens; give one action."
              "<|im_end|>\n")
    shots = [(48, 40, 10 + i) for i in range(3)]
    for turn in range(3):
        text = system
        for j in range(turn + 1):
            text += _user(f"Step {j}: {IMAGE if j >= turn - 1 else '[an earlier screen]'} what next?")
            if j < turn:
                text += f"I click step {j}.<|im_end|>\n"
        batches.append([(text, shots[max(0, turn - 1) : turn + 1])])
    return batches


def _pil(spec: list[int] | tuple[int, int, int]) -> Any:
    import io

    from PIL import Image

    from hyserve.testing import tiny_png

    return Image.open(io.BytesIO(tiny_png(*spec))).convert("RGB")


def image_generate(workdir: str, device: str) -> dict[str, Any]:
    """hyserve over ``image_batches`` on ``device`` (float32; CUDA graphs where there are any): the prompts, the
    engine's expanded prompt ids, greedy outputs and cached token counts, for ``image_reference`` to score."""
    from hyserve.testing import write_tiny_vlm_checkpoint

    path = write_tiny_vlm_checkpoint(os.path.join(workdir, "tiny_vlm_mtp"), seed=3, with_mtp=True)
    llm = LLM(model=path, device=device, dtype="float32", enable_prefix_caching=True, max_num_batched_tokens=16,
              max_num_seqs=8, num_kv_blocks=256, num_state_slots=8, recurrent_snapshot_interval=16,
              num_snapshot_slots=32, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    params = SamplingParams(temperature=0.0, max_tokens=IMAGE_MAX_TOKENS, ignore_eos=True)
    cases = []
    for b, batch in enumerate(image_batches()):
        prompts = [{"prompt": text, "multi_modal_data": {"image": [_pil(s) for s in imgs]}} for text, imgs in batch]
        outs = llm.generate(prompts, params, use_tqdm=False)
        for (text, imgs), o in zip(batch, outs, strict=True):
            cases.append({"batch": b, "text": text, "images": [list(s) for s in imgs],
                          "prompt_token_ids": list(o.prompt_token_ids), "output": list(o.outputs[0].token_ids),
                          "num_cached_tokens": int(o.num_cached_tokens or 0)})
    graphs = getattr(llm.llm_engine.runner, "graphs", None)
    replays = int(graphs.num_replays) if graphs is not None else 0
    drafts = float(llm.get_metrics().get("hyserve:spec_decode_num_drafts", 0) or 0)  # type: ignore[arg-type]
    llm.shutdown()
    return {"path": path, "device": device, "cases": cases, "cuda_graph_replays": replays, "mtp_drafts": drafts}


def image_reference(cases_file: str) -> dict[str, Any]:
    """Score ``image_generate``'s record against transformers on the CPU: each prompt's expanded ids (the tokenizer's
    ids, each image placeholder widened by the grid of transformers' image processor) and its greedy tokens
    (``reference_vlm_greedy``, uncached float32 forwards with the pixels) must equal the engine's; the episode's
    later turns (batches 2 and 3) must have hit the prefix cache."""
    from tokenizers import Tokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from hyserve.testing import reference_vlm_greedy, reference_vlm_model, vlm_special_token_ids

    with open(cases_file) as f:
        record = json.load(f)
    path = record["path"]
    ref = reference_vlm_model(path)
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    processor = Qwen2VLImageProcessorPil.from_pretrained(path)
    merge = int(processor.merge_size)
    pad = vlm_special_token_ids()["<|image_pad|>"]
    rows = []
    for case in record["cases"]:
        images = [_pil(s) for s in case["images"]]
        proc = processor(images=images, return_tensors="pt")
        counts = iter(int(t * h * w) // merge**2 for t, h, w in proc["image_grid_thw"].tolist())
        ids: list[int] = []
        for t in tok.encode(case["text"], add_special_tokens=False).ids:
            ids += [pad] * next(counts) if t == pad else [t]
        want = reference_vlm_greedy(ref, ids, proc["pixel_values"], proc["image_grid_thw"], len(case["output"]))
        rows.append({"batch": case["batch"], "images": len(images), "prompt_ids_match": ids == case["prompt_token_ids"],
                     "token_exact": want == case["output"], "num_cached_tokens": case["num_cached_tokens"]})
    resumed = [r["num_cached_tokens"] for r in rows if r["batch"] >= 2]
    ok = all(r["prompt_ids_match"] and r["token_exact"] for r in rows) and bool(resumed) and min(resumed) > 0
    return {"cases": rows, "num_cases": len(rows), "num_token_exact": sum(r["token_exact"] for r in rows),
            "max_images_per_prompt": max(r["images"] for r in rows), "resumed_cached_tokens": resumed,
            "cuda_graph_replays": record.get("cuda_graph_replays"), "mtp_drafts": record.get("mtp_drafts"),
            "device": record.get("device"), "pass": ok}


def image_check(workdir: str, device: str = "cuda", isolate_reference: bool = True) -> dict[str, Any]:
    """``image_generate`` on ``device``, then ``image_reference``: in a process without CUDA where
    ``isolate_reference`` (fla, if installed, is then out of transformers' way), else in this one."""
    cases_file = os.path.join(workdir, "image_cases.json")
    with open(cases_file, "w") as f:
        json.dump(image_generate(workdir, device), f)
    if not isolate_reference:
        return image_reference(cases_file)
    return reference_in_subprocess("--image-reference", cases_file)


def reference_in_subprocess(flag: str, cases_file: str) -> dict[str, Any]:
    """Run this script's reference ``flag`` on ``cases_file`` in a process without CUDA, where fla is not
    importable and transformers takes its pure-torch path; its last stdout line is the result."""
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.dirname(__file__), ".."), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, __file__, flag, cases_file], env=env, capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], flush=True)
        raise RuntimeError(f"reference process ({flag}) failed")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


# ------------------------------------------------------------------------------------------- the 2B-shape VLM

VLM_2B_MAX_TOKENS = 32
# The control of ``vlm_reference``: the same outputs scored against the reference given other images must fail the
# rule, or be at least this many times further off on average, else the comparison cannot see the images.
IMAGES_SEEN_RATIO = 2.0
VLM_2B_LLM_KWARGS: dict[str, Any] = {"max_model_len": 4096, "gpu_memory_utilization": 0.5}
_SYSTEM = ("<|im_start|>system\nYou operate a computer for the user. Each turn shows the latest screens; read them, "
           "then answer with exactly one action: click, type, scroll or wait, and the element it applies to."
           "<|im_end|>\n")


def vlm_2b_batches() -> list[list[tuple[str, list[tuple[int, int, int]]]]]:
    """The 2B VLM's cases, two batches run one after another: (ChatML prompt text, images as (width, height, seed)).

    One 640x360 screen; a 640x360 and a 320x320 image in one message; then the first case's conversation one turn
    on (same system text and screen, the assistant's answer, a new 320x320 screen: it resumes from the first case's
    cached prefix), and a user turn with one 320x320 image."""
    first = f"{_SYSTEM}<|im_start|>user\nScreen: {IMAGE} Which element should I click?<|im_end|>\n"
    return [[(first + "<|im_start|>assistant\n", [(640, 360, 101)]),
             (_user(f"Compare {IMAGE} with {IMAGE} and list what differs."), [(640, 360, 102), (320, 320, 103)])],
            [(first + "<|im_start|>assistant\nI click the search box.<|im_end|>\n"
              + _user(f"Now the screen is {IMAGE}. What next?"), [(640, 360, 101), (320, 320, 104)]),
             (_user(f"{IMAGE}Describe this image in one sentence."), [(320, 320, 105)])]]


def vlm_generate(path: str, device: str, dtype: str, batches: list[list[tuple[str, list[tuple[int, int, int]]]]],
                 max_tokens: int = VLM_2B_MAX_TOKENS, llm_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """hyserve on ``device`` in ``dtype`` (CUDA graphs on CUDA, prefix caching, default chunking) over ``batches``
    (text prompts with ``multi_modal_data`` images, encoded by hyserve's tokenizer), greedy for ``max_tokens``: each
    prompt's expanded ids, outputs, chosen-token logprobs and cached token count, for ``vlm_reference``."""
    llm = LLM(model=path, device=device, dtype=dtype, enable_prefix_caching=True, **(llm_kwargs or {}))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    cases = []
    for b, batch in enumerate(batches):
        prompts = [{"prompt": text, "multi_modal_data": {"image": [_pil(s) for s in imgs]}} for text, imgs in batch]
        outs = llm.generate(prompts, params, use_tqdm=False)
        for (text, imgs), o in zip(batch, outs, strict=True):
            c = o.outputs[0]
            toks = list(c.token_ids)
            cases.append({"batch": b, "text": text, "images": [list(s) for s in imgs],
                          "prompt_token_ids": list(o.prompt_token_ids), "output": toks,
                          "logprobs": [c.logprobs[i][t].logprob for i, t in enumerate(toks)],  # type: ignore[index]
                          "num_cached_tokens": int(o.num_cached_tokens or 0)})
    graphs = getattr(llm.llm_engine.runner, "graphs", None)
    replays = int(graphs.num_replays) if graphs is not None else 0
    llm.shutdown()
    del llm, graphs
    return {"path": path, "device": device, "dtype": dtype, "cases": cases, "cuda_graph_replays": replays}


@torch.no_grad()
def _vlm_logits(ref: Any, token_ids: list[int], pixel_values: torch.Tensor, grid_thw: torch.Tensor, device: str,
                start: int) -> torch.Tensor:
    """``reference_vlm_logits`` with the inputs on ``device``: rows ``start:`` of one uncached float32 forward."""
    input_ids = torch.tensor([token_ids], dtype=torch.long, device=device)
    mm_token_type_ids = (input_ids == ref.config.image_token_id).int()
    ref.model.rope_deltas = None
    out = ref(input_ids=input_ids, use_cache=False, pixel_values=pixel_values.float().to(device),
              image_grid_thw=grid_thw.to(device), mm_token_type_ids=mm_token_type_ids)
    return out.logits[0, start:].float().cpu()


def vlm_reference(record: dict[str, Any], rule: ClearMarginRule, reference_image: Any = None,
                  control: bool = False, control_image: Any = None) -> dict[str, Any]:
    """Score ``vlm_generate``'s record against transformers' ``Qwen3_5ForConditionalGeneration`` in float32 on the
    record's device (``reference_vlm_model``: torch's gated delta rule), teacher-forced: one forward over each prompt
    and the engine's output, pixel values from transformers' ``Qwen2VLImageProcessorPil.from_pretrained``, the prompt
    ids from the checkpoint's tokenizer (``tokenizers``) with each placeholder widened by the processor's grid; those
    ids must equal the engine's expanded ones, and the outputs pass ``rule`` (``score_positions``).

    ``reference_image`` (a test's sabotage) maps each image's (width, height, seed) to the one the reference sees.
    ``control``: also score the same outputs against the reference given other noise images of the same sizes
    (``control_image`` maps each spec to its stand-in, by default the seed + 1000; a test's sabotage gives the same
    image). The images are seen where the control fails ``rule``, or where its mean logprob error is at least
    ``IMAGES_SEEN_RATIO`` times the real comparison's (random bf16 weights leave few clear positions, and a tower
    that barely moves the logits would pass with any image); with ``control``, ``pass`` needs that too."""
    from tokenizers import Tokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from hyserve.testing import reference_vlm_model

    path, device = record["path"], record["device"]
    ref = reference_vlm_model(path).to(device)
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    processor = Qwen2VLImageProcessorPil.from_pretrained(path)
    merge = int(processor.merge_size)
    pad = int(ref.config.image_token_id)

    def score(model: Any, case: dict[str, Any], specs: list[tuple[int, int, int]]) -> tuple[list[int], dict[str, Any]]:
        proc = processor(images=[_pil(s) for s in specs], return_tensors="pt")
        counts = iter(int(t * h * w) // merge**2 for t, h, w in proc["image_grid_thw"].tolist())
        ids: list[int] = []
        for t in tok.encode(case["text"], add_special_tokens=False).ids:
            ids += [pad] * next(counts) if t == pad else [t]
        logits = _vlm_logits(model, ids + case["output"], proc["pixel_values"], proc["image_grid_thw"], device,
                             len(ids) - 1)
        return ids, score_positions(logits, case["output"], case["logprobs"], rule.margin)

    def totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {k: sum(r[k] for r in rows) for k in ("tokens_checked", "tokens_mismatched",
                                                                     "tokens_scored", "tokens")}
        out["max_logprob_abs_err"] = max(r["max_logprob_abs_err"] for r in rows)
        out["mean_logprob_abs_err"] = sum(r["sum_logprob_abs_err"] for r in rows) / max(out["tokens_scored"], 1)
        return out

    rows, others = [], []
    for case in record["cases"]:
        specs = [(int(w), int(h), int(seed)) for w, h, seed in case["images"]]
        if reference_image is not None:
            specs = [reference_image(*spec) for spec in specs]
        ids, s = score(ref, case, specs)
        rows.append({"batch": case["batch"], "images": case["images"], "prompt_len": len(ids),
                     "image_tokens": ids.count(pad), "prompt_ids_match": ids == case["prompt_token_ids"],
                     "num_cached_tokens": case["num_cached_tokens"], "tokens": len(case["output"]), **s})
        if control:
            other = [control_image(*spec) if control_image else (spec[0], spec[1], spec[2] + 1000) for spec in specs]
            others.append({"tokens": len(case["output"]), **score(ref, case, other)[1]})
    del ref
    if device == "cuda":
        torch.cuda.empty_cache()
    total = totals(rows)
    ids_ok = all(r["prompt_ids_match"] for r in rows)
    result = {"path": path, "device": device, "dtype": record["dtype"], "reference_dtype": "float32",
              "rule": rule._asdict(), "num_cases": len(rows),
              "max_images_per_prompt": max(len(r["images"]) for r in rows), **total, "prompt_ids_match": ids_ok,
              "cuda_graph_replays": record["cuda_graph_replays"], "cases": rows,
              "pass": ids_ok and total["tokens_checked"] > 0 and rule.passes(total)}
    if control:
        c = totals(others)
        seen = not rule.passes(c) or c["mean_logprob_abs_err"] >= IMAGES_SEEN_RATIO * total["mean_logprob_abs_err"]
        result["control_other_images"] = {**c, "rule_would_pass": rule.passes(c), "images_seen": seen}
        result["pass"] = result["pass"] and seen
    return result


def vlm_check(path: str, device: str = "cuda", dtype: str = "bfloat16",
              batches: list[list[tuple[str, list[tuple[int, int, int]]]]] | None = None,
              max_tokens: int | None = None, llm_kwargs: dict[str, Any] | None = None,
              rule: ClearMarginRule | None = None) -> dict[str, Any]:
    """``vlm_generate`` then ``vlm_reference``: by default the 2B-shape VLM's check (``vlm_2b_batches``, bf16 on
    CUDA against float32, ``BF16_RULE``, the 2B text check's); ``rule`` defaults to ``FP32_RULE`` for float32."""
    record = vlm_generate(path, device, dtype, batches if batches is not None else vlm_2b_batches(),
                          VLM_2B_MAX_TOKENS if max_tokens is None else max_tokens,
                          VLM_2B_LLM_KWARGS if llm_kwargs is None else llm_kwargs)
    return vlm_reference(record, rule or (FP32_RULE if dtype == "float32" else BF16_RULE), control=True)


def _vlm_summary(r: dict[str, Any]) -> str:
    return (f"2B VLM {r['dtype']} vs transformers fp32: {r['tokens_mismatched']}/{r['tokens_checked']} clear positions "
            f"mismatched ({r['tokens_scored']}/{r['tokens']} scored), logprob err max {r['max_logprob_abs_err']:.3g} "
            f"mean {r['mean_logprob_abs_err']:.3g}, "
            f"prompt ids match {r['prompt_ids_match']}, cached {[c['num_cached_tokens'] for c in r['cases']]}, "
            f"pass {r['pass']}; against other images: {r.get('control_other_images')}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--skip-2b", action="store_true")
    ap.add_argument("--skip-images", action="store_true")
    ap.add_argument("--images-only", action="store_true", help="only the image check (gpu_check_images.json)")
    ap.add_argument("--vlm-2b", metavar="DIR",
                    help="also check the 2B-shape VLM written by peer_bench.py write --shape 2b --vision real to DIR "
                         "(bf16 against transformers fp32 with images; after the other sections)")
    ap.add_argument("--vlm-2b-only", action="store_true", help="only the --vlm-2b check (gpu_check_vlm_2b.json)")
    ap.add_argument("--device", default="cuda", help="the --vlm-2b-only check's device (cpu: a test's)")
    ap.add_argument("--vlm-dtype", default="bfloat16", help="hyserve's dtype in the --vlm-2b check")
    ap.add_argument("--tiny-reference", help="(internal) score recorded tiny cases on the CPU, print JSON")
    ap.add_argument("--image-reference", help="(internal) score recorded image cases on the CPU, print JSON")
    args = ap.parse_args()
    if args.tiny_reference:
        print(json.dumps(tiny_reference(args.tiny_reference)))
        return 0
    if args.image_reference:
        print(json.dumps(image_reference(args.image_reference)))
        return 0
    global OUT_DIR, OUT_NAME
    OUT_DIR = args.out
    os.makedirs(args.out, exist_ok=True)
    if args.vlm_2b_only and not args.vlm_2b:
        ap.error("--vlm-2b-only needs --vlm-2b DIR")
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    results: dict[str, Any] = {"device": device_name, "torch": torch.__version__}
    if args.vlm_2b_only:
        OUT_NAME = "gpu_check_vlm_2b.json"
        r = results["vlm_2b_vs_fp32_reference"] = vlm_check(args.vlm_2b, args.device, args.vlm_dtype)
        print(_vlm_summary(r), flush=True)
        results["all_correctness_pass"] = bool(r["pass"])
        save(results)
        print(json.dumps(results, indent=2))
        return 0 if results["all_correctness_pass"] else 1
    if args.images_only:
        OUT_NAME = "gpu_check_images.json"
        results["image_tiny_vlm"] = image_check(tempfile.mkdtemp(), "cuda")
        results["all_correctness_pass"] = bool(results["image_tiny_vlm"]["pass"])
        save(results)
        print(json.dumps(results, indent=2))
        return 0 if results["all_correctness_pass"] else 1
    try:
        import transformers
        import triton

        results["triton"] = triton.__version__
        results["transformers"] = transformers.__version__
        import fla

        results["fla"] = getattr(fla, "__version__", "?")
    except ImportError as e:
        results["import_error"] = str(e)
    results.update(measure_ceilings())
    print(f"ceilings: {results['copy_bandwidth_Bps'] / 1e12:.2f} TB/s copy, "
          f"{results['bf16_matmul_flops'] / 1e12:.0f} TFLOP/s bf16", flush=True)
    save(results)
    workdir = tempfile.mkdtemp()
    cases_file = os.path.join(workdir, "cases.json")
    with open(cases_file, "w") as f:
        json.dump(tiny_generate(workdir), f)
    tiny = reference_in_subprocess("--tiny-reference", cases_file)
    for name, r in tiny.items():
        print(f"{name:45s} {r}", flush=True)
    results.update(tiny)
    ok = all(r["pass"] for r in tiny.values())
    save(results)
    if not args.skip_2b:
        with tempfile.TemporaryDirectory() as d:
            shape_2b(results, d)
        weight_bytes = results["2b_params"] * 2  # bf16; tied embeddings: lm_head reads the embedding matrix
        bound_bs1 = results["copy_bandwidth_Bps"] / weight_bytes
        results["weights_bandwidth_bound_bs1_tok_s"] = bound_bs1
        results["decode_bs1_fraction_of_bound"] = results["decode_bs1_tok_s"] / bound_bs1
        results["decode_bs1_vs_transformers"] = results["decode_bs1_tok_s"] / results["transformers_generate_bs1_tok_s"]
        ok &= bool(results["2b_bf16_vs_fp32_reference"]["pass"])
    if not args.skip_images:  # after the 2B figures: a run cut by its time limit keeps those
        img = results["image_tiny_vlm"] = image_check(workdir, "cuda")
        print(f"tiny VLM on CUDA against transformers: {img['num_token_exact']}/{img['num_cases']} token-exact, "
              f"resumed turns cached {img['resumed_cached_tokens']}, pass {img['pass']}", flush=True)
        ok &= bool(img["pass"])
        save(results)
    if args.vlm_2b:
        r = results["vlm_2b_vs_fp32_reference"] = vlm_check(args.vlm_2b, "cuda", args.vlm_dtype)
        print(_vlm_summary(r), flush=True)
        ok &= bool(r["pass"])
        save(results)
    results["all_correctness_pass"] = ok
    save(results)
    print(json.dumps(results, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""The shipped default model (``hyserve/default_model``): it loads with hyserve, matches transformers, and its MTP
head drafts tokens that hyserve accepts without changing the greedy output."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from hyserve import LLM, SamplingParams
from hyserve.model.registry import parse_model_config
from hyserve.testing import load_reference_model, mtp_shapes, read_checkpoint_tensors

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL_DIR = os.path.join(REPO, "hyserve", "default_model")
LOGIT_TOL = 1e-3  # float32 teacher forcing, hyserve vs transformers / the training-time MTP forward
MIN_ACCEPTANCE_K2 = 1.3
MAX_BYTES = 25 * 1024 * 1024

sys.path.insert(0, os.path.join(REPO, "training"))
import train_default_model as tdm  # noqa: E402


def heldout_prompts(n: int) -> list[list[int]]:
    with open(os.path.join(MODEL_DIR, "heldout_prompts.json"), encoding="utf-8") as f:
        return [list(p["prompt_token_ids"]) for p in json.load(f)["prompts"][:n]]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model=MODEL_DIR, device="cpu", dtype="float32", enable_prefix_caching=False, max_num_seqs=8)


def test_checkpoint_layout() -> None:
    with open(os.path.join(MODEL_DIR, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    assert raw["architectures"] == ["Qwen3_5ForConditionalGeneration"] and raw["model_type"] == "qwen3_5"
    cfg = parse_model_config(raw)
    assert cfg.mtp_num_hidden_layers == 1 and cfg.tie_word_embeddings and cfg.partial_rotary_factor == 0.25
    assert "linear_attention" in cfg.layer_types and "full_attention" in cfg.layer_types
    tensors = read_checkpoint_tensors(MODEL_DIR)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert all(n.startswith(("model.language_model.", "mtp.")) for n in tensors)
    ref_cfg = load_reference_model(MODEL_DIR).config
    assert {n: tuple(t.shape) for n, t in tensors.items() if n.startswith("mtp.")} == mtp_shapes(ref_cfg)
    size = sum(os.path.getsize(os.path.join(MODEL_DIR, f)) for f in os.listdir(MODEL_DIR))
    assert size <= MAX_BYTES, f"default model is {size} bytes"
    with open(os.path.join(MODEL_DIR, "generation_config.json"), encoding="utf-8") as f:
        eos = json.load(f)["eos_token_id"]
    assert len(eos) == 2


def test_logits_match_transformers_and_training_mtp() -> None:
    """hyserve's main logits against transformers' ``Qwen3_5ForCausalLM``, and its MTP head's logits against the MTP
    forward the training script optimised, at every position of a few prompts (teacher forced, float32)."""
    spec = LLM(model=MODEL_DIR, device="cpu", dtype="float32", enable_prefix_caching=False, max_num_seqs=4,
               speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    ref = tdm.load_model_with_mtp(MODEL_DIR)
    tok = spec.get_tokenizer()
    prompts = [*heldout_prompts(3), tok.encode("def fibonacci(n):\n    if n < 2:\n", add_special_tokens=False)]
    for ids in prompts:
        got, got_mtp, sampled = tdm.hyserve_logits(spec, ids)
        with torch.no_grad():
            want, want_mtp = ref.logits(torch.tensor([[*ids, sampled]]))
        diff = float((got - want[0, :-1]).abs().max())
        assert diff <= LOGIT_TOL, f"max |logit diff| {diff} > {LOGIT_TOL} on a {len(ids)}-token prompt"
        assert got_mtp is not None
        diff = float((got_mtp - want_mtp[0]).abs().max())
        assert diff <= LOGIT_TOL, f"MTP: max |logit diff| {diff} > {LOGIT_TOL} on a {len(ids)}-token prompt"


def test_generates_text_and_chat(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    ids = {t: tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    assert None not in ids.values()
    out = llm.generate(["import os\n"], SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0]
    assert out.outputs[0].token_ids and out.outputs[0].text
    chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0.0, max_tokens=4),
                    use_tqdm=False)[0]
    assert chat.prompt_token_ids[0] == ids["<|im_start|>"]


def test_mtp_speculation_greedy_equal_and_acceptance(llm: LLM) -> None:
    prompts = [{"prompt_token_ids": p} for p in heldout_prompts(8)]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    base = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    spec = LLM(model=MODEL_DIR, device="cpu", dtype="float32", max_num_seqs=8,
               speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    outs = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert outs == base
    m = spec.get_metrics()
    drafts = float(m["hyserve:spec_decode_num_drafts"])  # type: ignore[arg-type]
    accepted = float(m["hyserve:spec_decode_num_accepted_tokens"])  # type: ignore[arg-type]
    assert drafts > 0
    length = 1.0 + accepted / drafts
    assert length > MIN_ACCEPTANCE_K2, f"mean acceptance length with k=2 is {length:.3f}"

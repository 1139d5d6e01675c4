"""The engine end to end on tiny checkpoints, against transformers' uncached forward (teacher forcing).

Every test here uses non-identity row-to-slot mappings (the state pool hands slots out from the top, and staggered
arrivals and finishes make slots get reused out of order), and ends with every KV block and state slot free.
"""

from __future__ import annotations

import math

import pytest
import torch

from hyserve import LLM, SamplingParams
from hyserve.testing import reference_logits
from hyserve.testing.engine import LOGPROB_TOL, SlotRecorder, assert_matches_reference, drive, make_llm, random_prompts
from hyserve.testing.families import LAYER_PATTERNS, CheckpointCache

# ---------------------------------------------------------------------------------------------- correctness


@pytest.mark.parametrize("form", ["causal", "conditional"])
@pytest.mark.parametrize("pattern", list(LAYER_PATTERNS))
def test_greedy_matches_transformers(ckpts: CheckpointCache, form: str, pattern: str) -> None:
    path = ckpts.get(form, pattern)
    ref = ckpts.reference(path)
    # A small token budget: prompts are prefilled in chunks, mixed in one step with other rows' decodes.
    llm = make_llm(path, max_num_batched_tokens=24, max_num_seqs=4)
    prompts = random_prompts(6, [1, 7, 33, 60, 16, 17], seed=hash(pattern) % 1000)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, o in zip(prompts, outs, strict=True):
        assert o.prompt_token_ids == p and o.finished and o.outputs[0].finish_reason == "length"
        assert len(o.outputs[0].token_ids) == 12
        assert_matches_reference(ref, p, o)
    llm.llm_engine.assert_no_leaks()


def test_tied_sharded_checkpoint_matches_transformers(ckpts: CheckpointCache) -> None:
    path = ckpts.get("conditional", "gdn3_attn1", tie_word_embeddings=True, sharded=True)
    ref = ckpts.reference(path)
    llm = make_llm(path, max_num_batched_tokens=16)
    prompts = random_prompts(3, [9, 40, 3], seed=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0), use_tqdm=False)
    for p, o in zip(prompts, outs, strict=True):
        assert_matches_reference(ref, p, o)


def test_text_prompt_and_detokenized_output(ckpts: CheckpointCache) -> None:
    path = ckpts.get()
    ref = ckpts.reference(path)
    llm = make_llm(path)
    tok = llm.get_tokenizer()
    out = llm.generate("The quick brown fox", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                               logprobs=1), use_tqdm=False)[0]
    assert out.prompt == "The quick brown fox"
    assert out.prompt_token_ids == tok.encode("The quick brown fox")
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids)
    assert_matches_reference(ref, out.prompt_token_ids, out)


# ---------------------------------------------------------------------------------------------- batch invariance


def _params_for(i: int) -> SamplingParams:
    if i % 2 == 0:
        return SamplingParams(temperature=0.0, max_tokens=6 + 3 * i, ignore_eos=True)
    return SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=100 + i, max_tokens=6 + 3 * i, ignore_eos=True)


def test_output_independent_of_batch_chunking_and_arrival(ckpts: CheckpointCache) -> None:
    path = ckpts.get()
    prompts = random_prompts(6, [3, 25, 1, 48, 12, 30], seed=11)
    alone = {}
    for i, p in enumerate(prompts):
        llm = make_llm(path)
        alone[i] = llm.generate({"prompt_token_ids": p}, _params_for(i), use_tqdm=False)[0].outputs[0].token_ids
    scenarios = [
        (7, 3, [0, 1, 2, 3, 4, 5], 0),
        (16, 6, [5, 3, 1, 0, 2, 4], 1),
        (64, 2, [2, 4, 0, 5, 1, 3], 2),
        (5, 4, [1, 0, 3, 2, 5, 4], 3),
    ]
    for budget, max_seqs, order, stagger in scenarios:
        llm = make_llm(path, max_num_batched_tokens=budget, max_num_seqs=max_seqs)
        eng = llm.llm_engine
        rec = SlotRecorder(eng)
        arrivals: dict[int, list] = {}
        for k, i in enumerate(order):
            arrivals.setdefault(k * stagger, []).append((f"r{i}", prompts[i], _params_for(i)))
        final = drive(eng, arrivals)
        for i in range(len(prompts)):
            got = final[f"r{i}"].outputs[0].token_ids
            assert got == alone[i], f"budget={budget} order={order}: request {i} differs from its solo run"
        assert rec.saw_non_identity(), "test did not exercise row != slot"
        eng.assert_no_leaks()
    # Staggered finishes free slots in the middle of the pool; later arrivals must have reused them.
    assert rec.saw_slot_reuse()


def test_generate_accepts_one_params_per_prompt(ckpts: CheckpointCache) -> None:
    path = ckpts.get()
    prompts = random_prompts(3, [4, 9, 2], seed=3)
    llm = make_llm(path)
    params = [_params_for(i) for i in range(3)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate([{"prompt_token_ids": p} for p in prompts], params[:2], use_tqdm=False)


# ---------------------------------------------------------------------------------------------- memory pressure


def test_preemption_under_tiny_kv_budget_keeps_outputs(ckpts: CheckpointCache) -> None:
    path = ckpts.get("causal", "attn_both_ends")
    ref = ckpts.reference(path)
    prompts = random_prompts(6, [14, 20, 9, 17, 11, 19], seed=21)
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=1) if i % 2 == 0 else
              SamplingParams(temperature=1.0, seed=7 * i, max_tokens=20, ignore_eos=True) for i in range(6)]
    roomy = make_llm(path)
    expected = roomy.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    # 14 usable blocks of 4 tokens: each request needs up to 10, so running requests must be preempted.
    tight = make_llm(path, block_size=4, num_kv_blocks=15, num_state_slots=6, max_model_len=56,
                     max_num_batched_tokens=16, max_num_seqs=6)
    outs = tight.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert tight.get_metrics()["hyserve:num_preemptions"] > 0
    for i, (e, o) in enumerate(zip(expected, outs, strict=True)):
        assert o.outputs[0].token_ids == e.outputs[0].token_ids, f"request {i} changed under preemption"
        if i % 2 == 0:
            assert_matches_reference(ref, prompts[i], o)
    tight.llm_engine.assert_no_leaks()


def test_max_model_len_must_fit_kv_cache(ckpts: CheckpointCache) -> None:
    with pytest.raises(ValueError, match="max_model_len=100 does not fit in the KV cache"):
        make_llm(ckpts.get(), block_size=4, num_kv_blocks=10, max_model_len=100)


# ---------------------------------------------------------------------------------------------- aborts, errors


def test_abort_mid_prefill_and_mid_decode(ckpts: CheckpointCache) -> None:
    path = ckpts.get()
    prompts = random_prompts(5, [40, 6, 13, 22, 8], seed=31)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    solo = {i: make_llm(path).generate({"prompt_token_ids": prompts[i]}, greedy, use_tqdm=False)[0]
            for i in (2, 3, 4)}
    llm = make_llm(path, max_num_batched_tokens=8, max_num_seqs=3)
    eng = llm.llm_engine
    for i in range(3):
        eng.add_request(f"r{i}", {"prompt_token_ids": prompts[i]}, greedy)
    eng.step()
    a = eng.requests["r0"]
    assert 0 < a.num_computed_tokens < len(prompts[0]), "r0 should be mid-prefill"
    eng.abort_request("r0")  # mid-prefill
    while eng.requests["r1"].num_output_tokens < 3:
        eng.step()
    eng.abort_request("r1")  # mid-decode
    eng.abort_request("no-such-request")  # unknown ids are ignored, as in vLLM
    assert "r0" not in eng.requests and "r1" not in eng.requests
    final = drive(eng, {0: [("r3", prompts[3], greedy)], 2: [("r4", prompts[4], greedy)]})
    for i in (3, 4):
        assert final[f"r{i}"].outputs[0].token_ids == solo[i].outputs[0].token_ids
    m = llm.get_metrics()
    assert m["hyserve:request_aborted"] == 2 and m["hyserve:request_success"] == 3
    eng.assert_no_leaks()


def test_nonfinite_logits_end_the_request_with_error(ckpts: CheckpointCache) -> None:
    path = ckpts.get()
    prompts = random_prompts(3, [10, 12, 7], seed=41)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    solo = [make_llm(path).generate({"prompt_token_ids": p}, greedy, use_tqdm=False)[0].outputs[0].token_ids
            for p in prompts]
    llm = make_llm(path)
    eng = llm.llm_engine
    eng.add_request("bad", {"prompt_token_ids": prompts[0]}, greedy)
    eng.add_request("good", {"prompt_token_ids": prompts[1]}, greedy)
    eng.step()
    bad_slot = eng.requests["bad"].state_slot
    # Corrupt the live state of one request: its next logits are NaN. It must end with an error, not a token.
    eng.runner.state_pool.ssm_states[0][bad_slot].fill_(float("nan"))
    outs = {o.request_id: o for o in eng.step()}
    assert outs["bad"].finished and outs["bad"].outputs[0].finish_reason == "error"
    assert len(outs["bad"].outputs[0].token_ids) == 1  # the token sampled before the corruption, nothing more
    # A new request takes the freed slot: it must start from a clean state.
    final = drive(eng, {0: [("next", prompts[2], greedy)]})
    assert eng.state_slots.num_free_slots == eng.state_slots.num_slots
    assert final["good"].outputs[0].token_ids == solo[1]
    assert final["next"].outputs[0].token_ids == solo[2]
    assert llm.get_metrics()["hyserve:request_errors"] == 1
    eng.assert_no_leaks()


def test_bad_input_raises_value_error_naming_the_value(ckpts: CheckpointCache) -> None:
    path = ckpts.get()
    llm = make_llm(path, max_model_len=64)
    eng = llm.llm_engine
    with pytest.raises(ValueError, match=r"70 tokens.*max_model_len=64"):
        llm.generate({"prompt_token_ids": [1] * 70}, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": [1, 10**6]}, use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    eng.add_request("dup", [1, 2, 3])
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("dup", [1, 2, 3])
    eng.abort_request("dup")
    with pytest.raises(ValueError, match="speculative-config"):
        make_llm(path, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"pp_layer_partition \[2, 2\] needs pipeline_parallel_size=2"):
        make_llm(path, pp_layer_partition=[2, 2])
    with pytest.raises(TypeError, match="no_such_flag"):
        make_llm(path, no_such_flag=1)
    with pytest.raises(ValueError, match="dtype"):
        make_llm(path, dtype="int8")
    eng.assert_no_leaks()


# ---------------------------------------------------------------------------------------------- stopping


def test_stop_token_ids_eos_min_tokens_and_stop_strings(ckpts: CheckpointCache) -> None:
    path = ckpts.get()
    llm = make_llm(path)
    prompt = {"prompt_token_ids": random_prompts(1, [12], seed=51)[0]}
    full = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    toks, text = full.outputs[0].token_ids, full.outputs[0].text
    stop_tok = toks[4]
    first = toks.index(stop_tok)

    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[stop_tok]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == toks[: first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_tok

    eng = llm.llm_engine
    eng.eos_token_ids = {stop_tok}  # pretend the token is EOS
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == toks[: first + 1] and out.finish_reason == "stop" and out.stop_reason is None
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == toks and out.finish_reason == "length"
    # Below min_tokens EOS is banned: the greedy choice changes wherever EOS was the argmax.
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16, min_tokens=first + 2),
                       use_tqdm=False)[0].outputs[0]
    assert stop_tok not in out.token_ids[: first + 2]
    assert len(out.token_ids) >= first + 2

    eng.eos_token_ids = set()
    stop_str = text[len(text) // 3 : len(text) // 3 + 3]
    if stop_str and "\ufffd" not in stop_str:
        out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16, stop=[stop_str]),
                           use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop_str
        assert out.text == text[: text.find(stop_str)]
        out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16, stop=[stop_str],
                                                  include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
        assert out.text == text[: text.find(stop_str) + len(stop_str)]
    eng.assert_no_leaks()


def test_max_tokens_capped_by_max_model_len(ckpts: CheckpointCache) -> None:
    llm = make_llm(ckpts.get(), max_model_len=20)
    out = llm.generate({"prompt_token_ids": [5] * 15}, SamplingParams(temperature=0.0, max_tokens=100,
                                                                      ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"


# ---------------------------------------------------------------------------------------------- sampling


def test_seeded_sampling_reproducible_and_distinct(ckpts: CheckpointCache) -> None:
    path = ckpts.get()
    prompt = {"prompt_token_ids": random_prompts(1, [10], seed=61)[0]}
    llm = make_llm(path)
    runs = [llm.generate(prompt, SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids for s in (1, 1, 2)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    # Unseeded sampling follows the engine seed.
    a = make_llm(path, seed=3).generate(prompt, SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True),
                                        use_tqdm=False)[0].outputs[0].token_ids
    b = make_llm(path, seed=3).generate(prompt, SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True),
                                        use_tqdm=False)[0].outputs[0].token_ids
    assert a == b


def test_top_k_restricts_support_in_engine(ckpts: CheckpointCache) -> None:
    path = ckpts.get()
    ref = ckpts.reference(path)
    llm = make_llm(path)
    prompt = random_prompts(1, [9], seed=71)[0]
    params = [SamplingParams(temperature=1.5, top_k=2, seed=s, max_tokens=1) for s in range(40)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * 40, params, use_tqdm=False)
    logits = reference_logits(ref, prompt)[-1]
    top2 = set(torch.topk(logits, 2).indices.tolist())
    drawn = {o.outputs[0].token_ids[0] for o in outs}
    assert drawn <= top2 and len(drawn) == 2


def test_logprobs_top_n(ckpts: CheckpointCache) -> None:
    path = ckpts.get()
    ref = ckpts.reference(path)
    llm = make_llm(path)
    prompt = random_prompts(1, [9], seed=81)[0]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=3, logprobs=3,
                                                                    ignore_eos=True), use_tqdm=False)[0].outputs[0]
    logp = torch.log_softmax(reference_logits(ref, prompt + out.token_ids).double(), -1)
    for i, entry in enumerate(out.logprobs or []):
        want = torch.topk(logp[len(prompt) - 1 + i], 3)
        assert set(entry) == set(want.indices.tolist())
        for tid, lp in zip(want.indices.tolist(), want.values.tolist(), strict=True):
            assert math.isclose(entry[tid].logprob, lp, abs_tol=LOGPROB_TOL)
    assert out.cumulative_logprob is not None


# ---------------------------------------------------------------------------------------------- API surface


def test_chat_metrics_and_step_api(ckpts: CheckpointCache) -> None:
    path = ckpts.get()
    llm = make_llm(path)
    tok = llm.get_tokenizer()
    msgs = [{"role": "user", "content": "hi"}]
    out = llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt_token_ids == tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False)
    eng = llm.llm_engine
    eng.add_request("s1", {"prompt_token_ids": [3, 4, 5]}, SamplingParams(temperature=0.0, max_tokens=3,
                                                                          ignore_eos=True))
    seen = []
    while eng.has_unfinished_requests():
        for o in eng.step():
            seen.append(len(o.outputs[0].token_ids))
    assert seen == [1, 2, 3]  # cumulative outputs, one more token per step
    m = llm.get_metrics()
    assert m["hyserve:num_requests"] == 2
    assert m["hyserve:generation_tokens"] == 7
    assert m["hyserve:prompt_tokens"] == len(out.prompt_token_ids) + 3
    assert m["hyserve:spec_decode_num_accepted_tokens_per_pos"] == []
    eng.assert_no_leaks()


def test_default_model_loads_with_no_arguments() -> None:
    from hyserve.llm import DEFAULT_MODEL_DIR

    llm = LLM(device="cpu")
    assert llm.llm_engine.config.model == DEFAULT_MODEL_DIR
    out = llm.generate("def main():\n", SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) > 0 and out.outputs[0].text


def test_missing_model_directory() -> None:
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        LLM(model="/nonexistent/model/dir", device="cpu")

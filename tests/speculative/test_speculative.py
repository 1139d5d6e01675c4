"""Speculative decoding: greedy outputs identical with speculation on and off (and equal to transformers), with and
without prefix caching, chunked prefill, preemption and aborts; every acceptance length 0..k in one batch through a
test-only proposer; snapshots published from verified candidates; boundaries; refusals at startup.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch

from hyserve import SamplingParams
from hyserve.engine.llm_engine import LLMEngine
from hyserve.request import Request
from hyserve.testing.engine import (
    SlotRecorder,
    assert_matches_reference,
    drive,
    make_convs,
    make_llm,
    run_conversations,
    toks,
)
from hyserve.testing.families import CheckpointCache
from hyserve.testing.speculative import OracleProposer, record_drafts, solo_outputs
from hyserve.worker import cuda_graphs

K = 4


@pytest.fixture(autouse=True, params=["eager", "graphs"])
def graph_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test here runs twice: eagerly, and with the verify and MTP graphs (emulated on the CPU: the padded
    static forwards of ``hyserve.worker.cuda_graphs``)."""
    monkeypatch.setattr(cuda_graphs, "EMULATE", request.param == "graphs")
    return str(request.param)


def spec_llm(path: str, k: int = K, **kw: object):
    args: dict[str, object] = dict(speculative_config={"method": "ngram", "num_speculative_tokens": k,
                                                       "prompt_lookup_min": 1, "prompt_lookup_max": 3},
                                   recurrent_snapshot_interval=32, num_snapshot_slots=64)
    args.update(kw)
    return make_llm(path, **args)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1)






@pytest.mark.parametrize("caching", [False, True])
def test_ngram_greedy_identical_to_no_speculation(ckpts: CheckpointCache, caching: bool) -> None:
    path = ckpts.get()
    ref = ckpts.reference(path)
    # Repetitive prompts so that prompt lookup finds matches (and misses) often.
    rng = random.Random(5)
    base = toks(12, 6)
    prompts = {f"r{i}": (base * 4)[: 20 + 7 * i] + [rng.randrange(440) for _ in range(3)] for i in range(5)}
    want = solo_outputs(path, prompts, 24)
    llm = spec_llm(path, enable_prefix_caching=caching, max_num_batched_tokens=24, max_num_seqs=4)
    rec = SlotRecorder(llm.llm_engine)
    final = drive(llm.llm_engine, {2 * i: [(rid, p, greedy(24))] for i, (rid, p) in enumerate(prompts.items())})
    for rid, p in prompts.items():
        assert final[rid].outputs[0].token_ids == want[rid], rid
        assert_matches_reference(ref, p, final[rid])
    m = llm.get_metrics()
    assert m["hyserve:spec_decode_num_drafts"] > 0
    assert rec.saw_non_identity()
    llm.llm_engine.assert_no_leaks()


def test_every_acceptance_length_in_one_batch(ckpts: CheckpointCache, graph_mode: str) -> None:
    """A proposer that knows the answer, with errors planted so that rows accept 0..k drafts in the same step."""
    path = ckpts.get()
    prompts = {f"r{i}": toks(9 + 5 * i, 70 + i) for i in range(K + 1)}
    n = 30
    want = solo_outputs(path, prompts, n)
    llm = spec_llm(path, max_num_seqs=K + 1, max_num_batched_tokens=256)
    eng = llm.llm_engine
    plan = {f"r{i}": [(i + s) % (K + 1) for s in range(K + 1)] for i in range(K + 1)}
    eng.proposer = OracleProposer(want, plan, vocab=eng.model_config.vocab_size)
    rec = SlotRecorder(eng)
    final = drive(eng, {0: [(rid, p, greedy(n)) for rid, p in prompts.items()]})
    assert rec.saw_non_identity()
    for rid in prompts:
        assert final[rid].outputs[0].token_ids == want[rid], rid
    m = llm.get_metrics()
    forced = eng.proposer.forced  # type: ignore[attr-defined]
    full = [(a, k) for _, a, k in forced if k == K]
    assert {a for a, _ in full} == set(range(K + 1)), "not every acceptance length was exercised"
    # The engine's accepted counts agree with what the proposer forced.
    assert m["hyserve:spec_decode_num_accepted_tokens"] == sum(a for _, a, _ in forced)
    per_pos = m["hyserve:spec_decode_num_accepted_tokens_per_pos"]
    assert isinstance(per_pos, list) and per_pos[0] >= per_pos[-1]
    if graph_mode == "graphs":
        assert eng.runner.graphs is not None and eng.runner.graphs.sets["verify"].num_replays > 0
    eng.assert_no_leaks()


def test_acceptances_crossing_snapshot_positions_publish_verified_states(ckpts: CheckpointCache) -> None:
    """Verify steps cross 16-token boundaries; the snapshots taken there come from verified candidates. Later
    requests extending those outputs hit them and must produce exactly the no-cache output."""
    path = ckpts.get()
    prompts = {f"r{i}": toks(21 + 3 * i, 90 + i) for i in range(3)}
    n = 40
    want = solo_outputs(path, prompts, n)
    llm = spec_llm(path, max_num_batched_tokens=128)
    eng = llm.llm_engine
    eng.proposer = OracleProposer(want, {rid: [3, 1, 4, 0, 2] for rid in prompts}, vocab=eng.model_config.vocab_size)
    final = drive(eng, {0: [(rid, p, greedy(n)) for rid, p in prompts.items()]})
    for rid in prompts:
        assert final[rid].outputs[0].token_ids == want[rid]
    # Follow-up turns: prompt + output + a new message; they must hit snapshots inside the decoded region.
    follow = {f"f{rid}": prompts[rid] + want[rid] + toks(5, 99) for rid in prompts}
    want_f = solo_outputs(path, follow, 8)
    eng.proposer = OracleProposer(want_f, {}, vocab=eng.model_config.vocab_size)
    final_f = drive(eng, {0: [(rid, p, greedy(8)) for rid, p in follow.items()]})
    for rid, p in follow.items():
        assert final_f[rid].outputs[0].token_ids == want_f[rid]
        # the deepest boundary inside prompt + output (the last sampled token is never computed)
        assert final_f[rid].num_cached_tokens == ((len(p) - 5 - 1) // 16) * 16
    eng.assert_no_leaks()


def test_speculation_with_preemption_and_aborts(ckpts: CheckpointCache) -> None:
    path = ckpts.get("causal", "attn_both_ends")
    prompts = {f"r{i}": toks(30 + 4 * i, 110 + i) for i in range(4)}
    n = 24
    want = solo_outputs(path, prompts, n)
    llm = spec_llm(path, block_size=16, num_kv_blocks=13, max_model_len=192, max_num_batched_tokens=32,
                   max_num_seqs=4)
    eng = llm.llm_engine
    eng.proposer = OracleProposer(want, {rid: [2, 4, 0] for rid in prompts}, vocab=eng.model_config.vocab_size)
    final = drive(eng, {0: [(rid, p, greedy(n)) for rid, p in prompts.items()] + [("gone", toks(40, 120), greedy(n))]},
                  aborts={3: ["gone"]})
    assert llm.get_metrics()["hyserve:num_preemptions"] > 0
    for rid in prompts:
        assert final[rid].outputs[0].token_ids == want[rid], rid
    eng.assert_no_leaks()


def test_multi_turn_with_caching_and_speculation_matches_plain(ckpts: CheckpointCache) -> None:
    path = ckpts.get("conditional", "attn_first")
    convs = make_convs(3, 3, toks(40, 130), seed=131)
    plain = make_llm(path, enable_prefix_caching=False)
    want = run_conversations(plain.llm_engine, convs, out_len=10)
    both = spec_llm(path, max_num_batched_tokens=48)
    got = run_conversations(both.llm_engine, convs, out_len=10)
    assert got == want
    m = both.get_metrics()
    assert m["hyserve:prefix_cache_hits"] > 0
    both.llm_engine.assert_no_leaks()


def test_boundaries_max_tokens_eos_and_max_model_len(ckpts: CheckpointCache) -> None:
    path = ckpts.get()
    prompt = toks(12, 140)
    want = solo_outputs(path, {"x": prompt}, 16)["x"]
    llm = spec_llm(path, max_model_len=64)
    eng: LLMEngine = llm.llm_engine
    eng.proposer = OracleProposer({"a": want, "b": want, "c": want}, {}, vocab=eng.model_config.vocab_size)
    # max_tokens not a multiple of k + 1: never overshoots.
    final = drive(eng, {0: [("a", prompt, greedy(7))]})
    assert final["a"].outputs[0].token_ids == want[:7]
    # EOS inside accepted drafts ends the request there.
    stop = want[5]
    eng.eos_token_ids = {stop}
    final = drive(eng, {0: [("b", prompt, SamplingParams(temperature=0.0, max_tokens=16))]})
    assert final["b"].outputs[0].token_ids == want[: want.index(stop) + 1]
    assert final["b"].outputs[0].finish_reason == "stop"
    eng.eos_token_ids = set()
    # max_model_len: the request stops at the context limit.
    final = drive(eng, {0: [("c", toks(60, 141), SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))]})
    assert len(final["c"].outputs[0].token_ids) == 4 and final["c"].outputs[0].finish_reason == "length"
    eng.assert_no_leaks()


def test_seeded_sampling_with_speculation_is_reproducible(ckpts: CheckpointCache) -> None:
    path = ckpts.get()
    prompt = {"prompt_token_ids": toks(10, 150) * 2}
    params = SamplingParams(temperature=0.8, seed=9, max_tokens=16, ignore_eos=True)
    a = spec_llm(path).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    b = spec_llm(path, max_num_batched_tokens=7).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b and len(a) == 16


def test_refused_at_startup_with_the_flag(ckpts: CheckpointCache) -> None:
    path = ckpts.get()
    with pytest.raises(ValueError, match=r"mtp\.\* weights.*--speculative-config"):
        make_llm(path, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        make_llm(path, speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        make_llm(path, speculative_config={"method": "ngram", "num_speculative_tokens": 99})
    with pytest.raises(ValueError, match="method"):
        make_llm(path, speculative_config={"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        make_llm(path, speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5,
                                           "prompt_lookup_max": 2})


def test_verify_scratch_is_counted_in_the_cache_budget(ckpts: CheckpointCache,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Each sequence's k + 1 verify positions come out of the cache budget with its slot: a budget too small for
    the requested max_num_seqs lowers it (with a warning), one too small for a single sequence is refused. A GDN
    layer keeps per position its conv window and the delta rule's inputs (k, v, g, beta in float32), not a
    candidate SSM state: the bytes are counted here from the config by hand."""
    from hyserve.cache.state_pool import state_bytes_per_slot
    from hyserve.model.registry import load_model_config

    path = ckpts.get()
    cfg = load_model_config(path)
    per_slot = state_bytes_per_slot(cfg, torch.float32)
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    per_position = cfg.layer_types.count("linear_attention") * 4 * (
        cfg.conv_dim * (cfg.linear_conv_kernel_dim - 1) + hk * cfg.linear_key_head_dim
        + hv * cfg.linear_value_head_dim + 2 * hv)
    assert per_position < per_slot  # a position costs less than a candidate state did
    per_seq = per_slot + 4 * per_position
    sized = dict(num_kv_blocks=None, num_state_slots=None, enable_prefix_caching=False,
                 speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match=r"verify scratch \(4 positions\).*num_speculative_tokens"):
        make_llm(path, max_num_seqs=8, cpu_cache_memory_bytes=2 * per_slot, **sized)
    with caplog.at_level(logging.WARNING, logger="hyserve"):
        llm = make_llm(path, max_num_seqs=64, cpu_cache_memory_bytes=40 * per_seq, **sized)
    runner = llm.llm_engine.runner
    # Half the budget (20 sequences' worth) holds the pad slot and what is left of sequences of one slot + 4
    # positions.
    want = (20 * per_seq - per_slot) // per_seq
    assert runner.max_num_seqs == want and f"max_num_seqs lowered to {want}" in caplog.text
    stash = next(iter(runner.model.gdn_layers())).stash
    assert stash is not None and tuple(stash["v"].shape[:2]) == (want, 4)
    outs = llm.generate([{"prompt_token_ids": toks(20, i)} for i in range(24)],
                        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6] * 24


# ---------------------------------------------------------------------------------------------- MTP


def mtp_llm(path: str, **kw: object):
    return spec_llm(path, speculative_config={"method": "mtp", "num_speculative_tokens": 3}, **kw)


@pytest.mark.parametrize("caching", [False, True])
def test_mtp_greedy_identical_to_no_speculation(ckpts: CheckpointCache, caching: bool, graph_mode: str) -> None:
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    ref = ckpts.reference(path)
    prompts = {f"r{i}": toks(15 + 9 * i, 160 + i) for i in range(4)}
    want = solo_outputs(path, prompts, 20)
    llm = mtp_llm(path, enable_prefix_caching=caching, max_num_batched_tokens=24, max_num_seqs=3)
    final = drive(llm.llm_engine, {2 * i: [(rid, p, greedy(20))] for i, (rid, p) in enumerate(prompts.items())})
    for rid, p in prompts.items():
        assert final[rid].outputs[0].token_ids == want[rid]
        assert_matches_reference(ref, p, final[rid])
    m = llm.get_metrics()
    assert m["hyserve:spec_decode_num_draft_tokens"] > 0
    if graph_mode == "graphs":
        graphs = llm.llm_engine.runner.graphs
        assert graphs is not None
        assert graphs.sets["verify"].num_replays > 0 and graphs.sets["mtp"].num_replays > 0
        assert graphs.sets["draft"].num_replays > 0 and graphs.sets["commit"].num_replays > 0
    llm.llm_engine.assert_no_leaks()






def test_mtp_kv_recomputed_after_a_prefix_hit(ckpts: CheckpointCache) -> None:
    """Invariant 5: the MTP KV entry at L-1 depends on token L, so with MTP a block's key covers the token after it
    and b, which leaves a's path right after the third block, shares only two; the drafts of the hitting request are
    exactly those of a run without caching."""
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    shared = toks(48, 170)
    a = shared + toks(10, 171)
    b = shared + toks(12, 172)  # differs from a at position 48: the token after the hit
    runs = {}
    for caching in (True, False):
        llm = mtp_llm(path, enable_prefix_caching=caching, recurrent_snapshot_interval=16)
        seen = record_drafts(llm.llm_engine)
        final = drive(llm.llm_engine, {0: [("a", a, greedy(8))], 12: [("b", b, greedy(8))]})
        if caching:
            assert final["b"].num_cached_tokens == 32
        runs[caching] = (seen["b"], final["b"].outputs[0].token_ids)
    (cached, out_c), (plain, out_p) = runs[True], runs[False]
    assert out_c == out_p
    assert [d for d, _ in cached] == [d for d, _ in plain]
    for (_, hc), (_, hp) in zip(cached, plain, strict=True):
        assert hc is not None and hp is not None
        torch.testing.assert_close(hc, hp, rtol=1e-5, atol=1e-5)


def test_mtp_with_preemption_and_caching(ckpts: CheckpointCache) -> None:
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    prompts = {f"r{i}": toks(30 + 4 * i, 180 + i) for i in range(4)}
    want = solo_outputs(path, prompts, 24)
    llm = mtp_llm(path, block_size=16, num_kv_blocks=13, max_model_len=192, max_num_batched_tokens=32,
                  max_num_seqs=4)
    final = drive(llm.llm_engine, {0: [(rid, p, greedy(24)) for rid, p in prompts.items()]})
    assert llm.get_metrics()["hyserve:num_preemptions"] > 0
    for rid in prompts:
        assert final[rid].outputs[0].token_ids == want[rid]
    llm.llm_engine.assert_no_leaks()


def _mtp_kv(engine: LLMEngine, req: Request, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The MTP layer's cached keys and values of ``req``'s positions [0, n), read through its block table."""
    runner = engine.runner
    assert runner.mtp is not None
    attn = runner.mtp.attention
    assert attn.k_cache is not None and attn.v_cache is not None
    bs = runner.block_size
    pos = torch.arange(n)
    slots = torch.tensor(req.block_table)[pos // bs] * bs + pos % bs
    nb = attn.k_cache.shape[0]
    return (attn.k_cache.view(nb * bs, *attn.k_cache.shape[2:])[slots].clone(),
            attn.v_cache.view(nb * bs, *attn.v_cache.shape[2:])[slots].clone())


def _mtp_kv_after_prefill(engine: LLMEngine, prompts: list[list[int]]) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Run ``prompts[:-1]`` to completion one after another, then the last one until its prompt is computed;
    returns its cached-token count and the MTP KV of its prompt positions (all written by then)."""
    for i, p in enumerate(prompts[:-1]):
        drive(engine, {0: [(f"w{i}", p, greedy(4))]})
    z = prompts[-1]
    engine.add_request("z", {"prompt_token_ids": z}, greedy(4))
    req = engine.requests["z"]
    for _ in range(200):
        engine.step()
        if req.num_computed_tokens >= len(z):
            break
    assert req.num_computed_tokens >= len(z) and not req.is_finished
    k, v = _mtp_kv(engine, req, len(z))
    engine.abort_request("z")
    return req.num_cached_tokens, k, v


def _mtp_kv_while_decoding(path: str, prompt: list[int], spec: dict, decoded: int,
                           schedule: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One request decoded (greedy, synchronously) until ``decoded`` tokens are out; the MTP KV of its positions
    whose next token is known, and how many there are."""
    llm = make_llm(path, speculative_config=spec)
    eng = llm.llm_engine
    if schedule is not None:
        assert eng.drafts is not None
        eng.drafts.policy.script(schedule)
    eng.add_request("a", {"prompt_token_ids": prompt}, greedy(decoded + 8))
    while eng.requests["a"].num_output_tokens < decoded:
        eng.step()
    req = eng.requests["a"]
    n = req.num_tokens - 1  # position p's entry pairs it with token p + 1
    return (*_mtp_kv(eng, req, n), n)


@pytest.mark.parametrize("sabotaged", [False, True])
def test_steps_at_k0_write_the_mtp_kv_without_drafting(ckpts: CheckpointCache, monkeypatch: pytest.MonkeyPatch,
                                                       sabotaged: bool) -> None:
    """Steps at speculation length 0 draft nothing (``SpecLengthPolicy.drafting``: the MTP head's first pass
    without its LM head): the MTP KV entries of the positions they decode are still written, equal to those a run
    at k = 3 writes (invariant 5). A first pass skipped along with the drafts is caught."""
    from hyserve.worker.spec_decode.mtp_drafter import MTPDrafter
    from hyserve.worker.spec_decode.mtp_proposer import MTPProposer

    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    prompt = toks(21, 195)
    k_ref, v_ref, n_ref = _mtp_kv_while_decoding(path, prompt, {"method": "mtp", "num_speculative_tokens": 3}, 10)
    if sabotaged:
        graph_draft, propose = MTPDrafter._graph_draft, MTPProposer.propose

        def no_first_pass(self: MTPDrafter, passes: int, size: int) -> tuple[torch.Tensor, ...]:
            if passes:
                return graph_draft(self, passes, size)
            return self.draft_tokens[:size], self.draft_first_hidden[:size]

        def nothing_at_zero(self: MTPProposer, rows, out, last_hidden, draft_slots, num_drafts=None):  # type: ignore[no-untyped-def]
            return [[] for _ in rows] if num_drafts == 0 else propose(self, rows, out, last_hidden, draft_slots,
                                                                      num_drafts)

        monkeypatch.setattr(MTPDrafter, "_graph_draft", no_first_pass)
        monkeypatch.setattr(MTPProposer, "propose", nothing_at_zero)
    spec = {"method": "mtp", "num_speculative_tokens": 3, "adaptive": True}
    k0, v0, n0 = _mtp_kv_while_decoding(path, prompt, spec, 10, schedule=[0])
    n = min(n0, n_ref)
    assert n > len(prompt) + 5  # decoded positions among them
    # (float32 paths of other row layouts: within 1e-4; a missing entry is off by the entry itself)
    same = torch.allclose(k0[:n], k_ref[:n], atol=1e-4) and torch.allclose(v0[:n], v_ref[:n], atol=1e-4)
    assert same != sabotaged


def test_mtp_kv_through_a_hit_chain_from_two_branches_matches_from_scratch(ckpts: CheckpointCache) -> None:
    """Invariant 5 for every entry of a hit chain, not only the last: x and y split right after a block boundary
    (position 32), so the MTP entry at 31 differs between them; z follows y for 49 tokens and hits 48 through blocks
    that x and y published. Every MTP key and value of z's prompt must be what a from-scratch run computes."""
    path = ckpts.get("conditional", "gdn3_attn1", with_mtp=True)
    p32 = toks(32, 190)
    x = [*p32, 7, *toks(30, 191)]
    y = [*p32, 8, *toks(30, 192)]
    z = y[:49] + toks(9, 193)
    llm = mtp_llm(path, recurrent_snapshot_interval=16)
    hit, k, v = _mtp_kv_after_prefill(llm.llm_engine, [x, y, z])
    assert hit == 48, "z must hit through the chain the two branches published"
    scratch = mtp_llm(path, enable_prefix_caching=False)
    _, k_ref, v_ref = _mtp_kv_after_prefill(scratch.llm_engine, [z])
    for name, got, want in (("key", k, k_ref), ("value", v, v_ref)):
        err = (got - want).abs().amax(dim=(1, 2))
        bad = [int(i) for i in torch.nonzero(err > 1e-4).flatten()]
        assert not bad, f"MTP {name}s differ from a from-scratch run at positions {bad} (max {float(err.max()):.3g})"
    llm.llm_engine.assert_no_leaks()

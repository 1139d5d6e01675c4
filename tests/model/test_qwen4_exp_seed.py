"""Issue report 1's configuration ("Qwen3.8-Flash-Next": 14-33 % of requests looped) at tiny scale, every part of it
on at once, on Qwen4-Exp (CPU, float32, gloo): four pipeline stages with an uneven split (3,3,2,1 of nine layers, as
13,13,13,9 of 48: the last stage the shortest), MTP with four drafts (planted drafts, accepted and rejected), prefix
caching (hits restoring GDN and PLE snapshots), async scheduling, the stages' CUDA graphs (emulated in the workers),
eight sequences at once, staggered arrivals sharing a prefix, aborts, preemption (a small KV cache), chunked prefill
and EOS inside prompts (PLE restarts). The outputs must be, token for token and log-probability for log-probability,
those of one process running plain synchronous decoding, and that run must match transformers 5.24
(teacher-forced); nothing leaks and every stage applied every verify step's accepted counts.

The nine layers put attention (QSA) on stages 0, 1 and 2 and PLE on stages 0, 1 and 3: a stage with attention and no
PLE (2), one with PLE and no attention (3), two with both (0, 1).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from hyserve import SamplingParams
from hyserve.config import FULL_ATTENTION
from hyserve.distributed import parallel_state
from hyserve.engine.llm_engine import LLMEngine
from hyserve.model.registry import load_model_config
from hyserve.scheduler.output import PREVIOUS_DRAFT
from hyserve.testing.engine import assert_matches_reference, drive, make_llm, random_prompts
from hyserve.testing.qwen4_exp import Qwen4ExpReference, load_qwen4_exp_reference, write_tiny_qwen4_exp_checkpoint
from hyserve.testing.scenarios import assert_same_outputs

GDN, ATTN = "linear_attention", "full_attention"
NINE = [GDN, GDN, ATTN, GDN, GDN, ATTN, GDN, ATTN, GDN]
NINE_PLE = [2, 5, 9]  # 1-indexed
PARTITION = [3, 3, 2, 1]
MTP4 = {"method": "mtp", "num_speculative_tokens": 4}
ABORTED = ("c", "h")


@pytest.fixture(scope="module")
def nine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Qwen4ExpReference]]:
    """Nine layers with an MTP head (eight indexer heads: exact block-score ties rare) and the reference."""
    path = write_tiny_qwen4_exp_checkpoint(tmp_path_factory.mktemp("qwen4_seed") / "ckpt", layer_types=NINE,
                                           ple_layer_ids=NINE_PLE, indexer_n_heads=8, with_mtp=True)
    ref = load_qwen4_exp_reference(path)
    yield path, ref
    ref.close()


def _seed_scenario(path: str) -> tuple[dict[int, list], dict[int, list[str]], dict[str, list[int]]]:
    """Ten requests over twelve steps, up to eight at once: seven share a 37-token prefix (two of them a longer
    one), prompts up to 70 tokens (chunks), EOS inside three (PLE restarts, one inside the shared prefix), two
    aborted mid-flight ("c" mid-decode, "h" early)."""
    eos = load_model_config(path).ple_eos_token_id  # type: ignore[attr-defined]
    shared = random_prompts(1, [37], seed=41)[0]
    shared[20] = eos
    tails = random_prompts(8, [3, 20, 9, 14, 5, 26, 11, 2], seed=42)
    tails[1][4] = eos
    other = random_prompts(2, [61, 23], seed=43)
    other[0][30] = other[0][31] = eos
    prompts = {"a": shared + tails[0], "b": shared + tails[1], "c": other[0], "d": tails[2],
               "e": shared + tails[3], "f": shared + tails[4], "g": shared + tails[1][:9] + tails[5],
               "h": shared + tails[6], "i": other[1], "j": shared + tails[1][:9] + tails[7]}

    def greedy(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1)

    arrivals: dict[int, list] = {
        0: [("a", prompts["a"], greedy(14)), ("b", prompts["b"], greedy(9))],
        1: [("c", prompts["c"], greedy(40)), ("d", prompts["d"], greedy(12))],
        3: [("h", prompts["h"], greedy(30))],
        6: [("e", prompts["e"], greedy(5)), ("f", prompts["f"], greedy(20)), ("i", prompts["i"], greedy(16))],
        11: [("g", prompts["g"], greedy(14)), ("j", prompts["j"], greedy(18))],
    }
    return arrivals, {5: ["h"], 9: ["c"]}, prompts


def _engine(path: str, **kw: Any) -> LLMEngine:
    """Eight sequences in 14 KV blocks of 16 tokens (they preempt), a 32-token step budget (chunks), prefix caching
    with recurrent snapshots every 16 tokens."""
    llm = make_llm(path, max_num_batched_tokens=32, max_num_seqs=8, num_state_slots=8, num_kv_blocks=14,
                   block_size=16, enable_prefix_caching=True, recurrent_snapshot_interval=16, num_snapshot_slots=32,
                   **kw)
    return llm.llm_engine


def _plant_host_drafts(engine: LLMEngine, want: dict[str, list[int]]) -> None:
    """As tests/conftest.py's ``plant_drafts``, for an engine whose workers are other processes: after every step
    each running request's MTP drafts become its known continuation, the last one made wrong, so drafts are
    accepted and rejected. With pipeline stages the drafts come back to the host (never ``PREVIOUS_DRAFT``)."""
    update = engine.scheduler.update_from_output

    def plant(so, ro, sink):  # type: ignore[no-untyped-def]
        ran = update(so, ro, sink)
        for req in engine.scheduler.running:
            drafts = req.draft_token_ids
            if not drafts or req.request_id not in want:
                continue
            assert PREVIOUS_DRAFT not in drafts, "drafts left on the device under pipeline parallelism"
            cont = want[req.request_id][req.num_output_tokens:][: len(drafts)]
            cont = [*cont[:-1], (cont[-1] + 1) % 50] if len(cont) == len(drafts) and len(cont) > 1 else cont
            if cont:
                req.draft_token_ids = cont
        return ran

    engine.scheduler.update_from_output = plant  # type: ignore[method-assign]


def _metric(engine: LLMEngine, name: str) -> float:
    value = engine.get_metrics()[f"hyserve:{name}"]
    assert isinstance(value, int | float), (name, value)
    return float(value)


def test_the_layers_spread_over_the_stages(nine: tuple[str, Qwen4ExpReference]) -> None:
    cfg = load_model_config(nine[0])
    assert cfg.num_hidden_layers == sum(PARTITION) and cfg.mtp_num_hidden_layers == 1
    stages = [range(*parallel_state.stage_range(PARTITION, s)) for s in range(len(PARTITION))]
    attn = [any(cfg.layer_types[i] == FULL_ATTENTION for i in r) for r in stages]
    ple = [any(i + 1 in NINE_PLE for i in r) for r in stages]
    assert attn == [True, True, True, False] and ple == [True, True, False, True]


def test_seed_configuration_gives_the_plain_one_process_outputs(nine: tuple[str, Qwen4ExpReference],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    path, ref = nine
    arrivals, aborts, prompts = _seed_scenario(path)
    assert max(len(reqs) for reqs in arrivals.values()) <= 8 and sum(len(r) for r in arrivals.values()) == 10

    # One process, plain synchronous decoding: the reference run, itself checked against transformers.
    plain = _engine(path)
    want = drive(plain, arrivals, aborts)
    plain.assert_no_leaks()
    assert _metric(plain, "num_preemptions") > 0 and _metric(plain, "prefix_cache_hits") > 0
    plain.shutdown()
    assert set(want) == set(prompts) - set(ABORTED)
    for rid, out in want.items():
        assert_matches_reference(ref, prompts[rid], out)

    # The seed's configuration: the workers (other processes) read the graphs' emulation from the environment.
    monkeypatch.setenv("HYSERVE_EMULATE_CUDA_GRAPHS", "1")
    engine = _engine(path, pipeline_parallel_size=4, pp_layer_partition=PARTITION, speculative_config=MTP4,
                     async_scheduling=True)
    try:
        assert engine.max_steps_in_flight == 4
        assert len(engine.executor.pids) == 4  # type: ignore[attr-defined]
        _plant_host_drafts(engine, {rid: list(out.outputs[0].token_ids) for rid, out in want.items()})
        got = drive(engine, arrivals, aborts)
        engine.assert_no_leaks()
        assert engine.executor.collective_rpc("num_uncommitted_steps") == [0] * 4
        replays = engine.executor.collective_rpc("graph_replays")
        drafted, accepted = _metric(engine, "spec_decode_num_draft_tokens"), _metric(
            engine, "spec_decode_num_accepted_tokens")
        preemptions, hits = _metric(engine, "num_preemptions"), _metric(engine, "prefix_cache_hits")
    finally:
        engine.shutdown()
    assert set(got) == set(want)
    assert_same_outputs(got, want)
    assert 0 < accepted < drafted, (accepted, drafted)  # accepted, and the planted wrong ones rejected
    assert preemptions > 0 and hits > 0, (preemptions, hits)
    # Every stage replayed its verify graphs (one per scratch set on the stages before the last).
    assert all(sum(r.values()) > 0 for r in replays), replays
    assert torch.get_num_threads() >= 1

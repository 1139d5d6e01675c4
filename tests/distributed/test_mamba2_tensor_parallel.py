"""Tensor parallelism of the Mamba2 families on the CPU: two worker processes in a gloo group.

Each rank holds half of the Mamba2 heads (their z, x and dt rows of ``in_proj``, conv channels, ``A_log`` / ``D``
/ ``dt_bias``, gated-norm channels and ``out_proj`` columns) and the B/C groups they read: sharded (two groups, one
per rank) or shared (one group, both ranks); Granite-4.0-H's whole-width gated norm sums its squares over the
ranks. The other blocks shard as elsewhere: attention heads, MLP channels, each expert's channels and the shared
expert's. Checked against transformers (teacher-forced greedy tokens and logprobs): Nemotron-H with MoE, MLP and
attention blocks in both group layouts, Granite-4.0-H with experts, Falcon-H1 with its segment multipliers, the
gated norm and biases. Expert parallel 2 (``--enable-expert-parallel``: each rank 4 of the 8 experts whole, the
shared expert / MLP sliced) for Nemotron-H's MoE (grouped top-k routing with the correction bias) and Granite-4.0-H's
against transformers, a rank holding the wrong experts caught, experts that do not split refused. ModelOpt FP8
Nemotron-H with FP8 experts (static input scales) at TP 2 and EP 2 against the static-FP8 reference (slow).
Sabotaged ranks (the wrong B/C groups; the conv weight sliced without the groups' offset) are caught, and sizes that
do not split are refused by name before any worker starts.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from hyserve import SamplingParams
from hyserve.layers.mamba2 import check_mamba2_tensor_parallel, mamba2_group_range
from hyserve.testing.engine import assert_matches_reference, make_llm, random_prompts
from hyserve.testing.falcon_h1 import FALCON_H1
from hyserve.testing.families import CheckpointCache
from hyserve.testing.fp8 import assert_close_to_fp8_reference
from hyserve.testing.fp8_mamba2 import load_fp8_mamba2_reference, write_fp8_mamba2_checkpoint
from hyserve.testing.granitemoehybrid import GRANITE_H
from hyserve.testing.nemotron_h import NEMOTRON_H, NEMOTRON_H_PATTERNS

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
NEMOTRON_MOE = NEMOTRON_H_PATTERNS["moe"]
PROMPTS = random_prompts(3, [5, 19, 11], seed=8)

# (family, pattern, overrides): what each case covers
CASES = {
    # Mamba2 (2 groups: one per rank), MoE, attention
    "nemotron_h_sharded_groups": (NEMOTRON_H.name, "moe", {}),
    # Mamba2 (1 group on both ranks; the per-group norm is then the whole width), MLP, attention
    "nemotron_h_shared_group": (NEMOTRON_H.name, "m_attn_m_mlp", {"n_groups": 1}),
    # Mamba2 (2 groups) with the whole-width gated norm, attention, experts + shared MLP, tied head
    "granite": (GRANITE_H.name, "mamba_first", {}),
    # Mamba2 with the segment multipliers, the per-group norm, biases; attention with biases; MLP
    "falcon_h1": (FALCON_H1.name, "hybrid3", {"variant": "norm_before_gate"}),
}


def _path(ckpts: CheckpointCache, case: str) -> str:
    family, pattern, kw = CASES[case]
    return ckpts.get("causal", pattern, family=family, **kw)


def _generate(path: str, params: SamplingParams = GREEDY, **kw: object) -> list:
    llm = make_llm(path, tensor_parallel_size=2, max_num_batched_tokens=16, **kw)
    try:
        return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_matches_transformers(ckpts: CheckpointCache, case: str) -> None:
    path = _path(ckpts, case)
    got = _generate(path)
    ref = ckpts.reference(path)
    for prompt, out in zip(PROMPTS, got, strict=True):
        assert_matches_reference(ref, prompt, out)


_SABOTAGE = {
    # every rank reads the first rank's B/C groups (in_proj's rows and the conv's alike)
    "wrong_groups": """
        from hyserve.layers import mamba2

        right = mamba2.mamba2_group_range

        def first_ranks(num_heads, n_groups, rank=None, size=None):
            return right(num_heads, n_groups, 0, size)

        mamba2.mamba2_group_range = first_ranks
    """,
    # the conv weight's B and C rows taken from the first group whatever the rank's groups
    "conv_without_group_offset": """
        from hyserve.layers import mamba2, sharding

        init = mamba2.Mamba2Mixer.__init__

        def sabotaged(self, cfg, prefix, **kw):
            init(self, cfg, prefix, **kw)
            s = sharding.shard_of(self.conv1d.weight)
            if s is not None:
                x, b, c = s.ranges
                i, gn = cfg.mamba_num_heads * cfg.mamba_head_dim, cfg.n_groups * cfg.ssm_state_size
                n = b[1] - b[0]
                ranges = (x, (i, i + n), (i + gn, i + gn + n))
                sharding.set_shard(self.conv1d.weight, sharding.Shard(s.full_shape, 0, ranges))

        mamba2.Mamba2Mixer.__init__ = sabotaged
    """,
}


@pytest.mark.parametrize("sabotage", [pytest.param(s, marks=pytest.mark.slow) if s == "conv_without_group_offset"
                                      else s for s in _SABOTAGE])  # the second: slow (7 s)
def test_a_rank_with_the_wrong_group_slice_is_caught(ckpts: CheckpointCache, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch, sabotage: str) -> None:
    """Sabotage in the worker processes (through ``sitecustomize``); the outputs must differ from transformers'."""
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(_SABOTAGE[sabotage]))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("HYSERVE_WORKER_MULTIPROC_METHOD", "exec")  # sitecustomize: fresh interpreters
    path = _path(ckpts, "nemotron_h_sharded_groups")
    got = _generate(path)
    ref = ckpts.reference(path)
    with pytest.raises(AssertionError):
        for prompt, out in zip(PROMPTS, got, strict=True):
            assert_matches_reference(ref, prompt, out)


def test_group_ranges() -> None:
    # sharded: 4 groups of 2 heads over 2 ranks; shared: 2 groups of 4 heads over 4 ranks (2 ranks per group)
    assert [mamba2_group_range(8, 4, r, 2) for r in range(2)] == [(0, 2), (2, 4)]
    assert [mamba2_group_range(8, 2, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [mamba2_group_range(8, 1, r, 2) for r in range(2)] == [(0, 1), (0, 1)]


def test_sizes_that_do_not_split_are_refused(ckpts: CheckpointCache) -> None:
    with pytest.raises(ValueError, match=r"does not divide the Mamba2 heads \(mamba_num_heads=6\)"):
        check_mamba2_tensor_parallel(6, 16, 2, 4, None)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 and the Mamba2 groups \(n_groups=3\): one must"):
        check_mamba2_tensor_parallel(6, 16, 3, 2, None)
    # 2 groups over 4 ranks share them, but a per-group norm would then span 2 of the 4 ranks
    check_mamba2_tensor_parallel(8, 16, 2, 4, None)
    with pytest.raises(ValueError, match=r"gated norm's groups of 64 channels would span"):
        check_mamba2_tensor_parallel(8, 16, 2, 4, 64)
    check_mamba2_tensor_parallel(8, 16, 2, 4, 128)  # one group over the whole width: summed over the ranks
    # end to end, before any worker starts
    path = ckpts.get("causal", "m_attn_m_mlp", family=NEMOTRON_H.name, mamba_num_heads=6, n_groups=3)
    with pytest.raises(ValueError, match=r"n_groups=3"):
        make_llm(path, tensor_parallel_size=2)
    # expert parallel: whole experts per rank, 9 (in 3 groups) do not split over 2 ranks
    path = ckpts.get("causal", "moe", family=NEMOTRON_H.name, n_routed_experts=9, n_group=3)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide n_routed_experts=9"):
        make_llm(path, tensor_parallel_size=2, enable_expert_parallel=True)
    path = ckpts.get("causal", "mamba_first", family=GRANITE_H.name, num_local_experts=5)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide num_local_experts=5"):
        make_llm(path, tensor_parallel_size=2, enable_expert_parallel=True)


@pytest.mark.slow  # about 13 s each (the two gloo ranks)
@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "ep2"])
def test_modelopt_fp8_experts_over_two_ranks_match_the_static_fp8_reference(tmp_path: Path, ep: bool) -> None:
    """ModelOpt FP8 Nemotron-H (FP8 experts with static input scales, every linear layer FP8) over two ranks: TP,
    each rank its rows of every expert's ``up`` and columns of its ``down`` with the expert's per-tensor weight
    scale; EP, 4 whole experts each. The layer's static activation scales are the maxima over all 8 experts on
    both ranks (every expert's input scale is loaded everywhere); against the static-FP8 reference (one process:
    the same numbers, a static scale not depending on the rank's part)."""
    path = write_fp8_mamba2_checkpoint(tmp_path / "ckpt", NEMOTRON_H.name, "modelopt", layer_types=NEMOTRON_MOE,
                                       seed=3)
    got = _generate(path, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5),
                    enable_expert_parallel=ep)
    assert_close_to_fp8_reference(load_fp8_mamba2_reference(path, NEMOTRON_H.name),
                                  list(zip(PROMPTS, got, strict=True)), 0.15, 1.5, 0.5, min_clear=4)


@pytest.mark.parametrize("case", ["nemotron_h_sharded_groups", "granite"])
def test_ep2_matches_transformers(ckpts: CheckpointCache, caplog: pytest.LogCaptureFixture, case: str) -> None:
    """Expert parallel 2: each rank holds 4 of the 8 experts whole (Nemotron-H: 4 groups of 2, the top 2 groups by
    their best two biased scores, then the top 3 of those; Granite: a top-k softmax), computes the pairs routed to
    them and one all-reduce adds the ranks' sums and the shared expert's (MLP's) slices."""
    import logging

    path = _path(ckpts, case)
    with caplog.at_level(logging.INFO, logger="hyserve"):
        got = _generate(path, enable_expert_parallel=True)
    assert any("each of the 2 tensor-parallel ranks holds 4 whole experts of 8" in r.message for r in caplog.records)
    ref = ckpts.reference(path)
    for prompt, out in zip(PROMPTS, got, strict=True):
        assert_matches_reference(ref, prompt, out)


# Loaded first by the worker processes (PYTHONPATH): every rank's expert ids offset by one (rank r builds and loads
# experts [r E/T + 1, (r+1) E/T + 1) mod E, and computes the pairs of those ids).
_WRONG_EXPERTS = """
from hyserve.layers import sigmoid_moe

right = sigmoid_moe.expert_range


def offset(num_experts):
    start, end = right(num_experts)
    return (start + 1, end + 1) if end < num_experts else (start - 1, end - 1)


sigmoid_moe.expert_range = offset
"""


def test_ep2_with_a_rank_on_the_wrong_experts_is_caught(ckpts: CheckpointCache, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "sitecustomize.py").write_text(_WRONG_EXPERTS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("HYSERVE_WORKER_MULTIPROC_METHOD", "exec")  # sitecustomize: fresh interpreters
    path = _path(ckpts, "nemotron_h_sharded_groups")
    got = _generate(path, enable_expert_parallel=True)
    ref = ckpts.reference(path)
    with pytest.raises(AssertionError):
        for prompt, out in zip(PROMPTS, got, strict=True):
            assert_matches_reference(ref, prompt, out)

"""FP8 Qwen3-Next (as Qwen publishes Qwen3-Next-80B-A3B-Instruct-FP8): block FP8 (``weight_scale_inv``),
compressed-tensors FP8 per channel and online FP8, on tiny checkpoints written by transformers' ``save_pretrained``
(fused ``in_proj_qkvz`` / ``in_proj_ba``, experts one tensor per expert or stacked) and quantized by
``hyserve.testing.fp8_moe.write_fp8_next_checkpoint``, ``in_proj_ba``, the routers and the shared-expert gates kept
in bf16 as the release keeps them.

The fused projections are re-ordered from their key-head groups into Qwen3.5's [q | k | v | z] as they load; their
scales must follow. The release's pieces are whole 128-row blocks (head dims 128); the tiny heads here are 16 rows,
so the block checkpoints use 16 x 16 blocks (the CPU path computes any block size; the Triton GEMM takes 128).

* greedy tokens and log-probs match transformers' ``Qwen3NextForCausalLM`` holding the dequantized weights with the
  activation quantization emulated (``hyserve.testing.fp8_moe.load_fp8_moe_reference``; the tolerances of
  tests/model/test_fp8_moe.py), MTP on with its FP8 head. CHAOS: these tiny random models are chaotic on the longer
  prompts, the reference itself moving by up to 0.2 in a log-prob under a 1e-6 relative change of its embedding
  (measured; an engine float32 difference of 1e-7 straddling an e4m3 rounding boundary does the same), so the
  seeds are ones whose models are not (the engine then agrees to about 1e-5 at most positions), and the exact
  in_proj checks are the sharp ones;
* the loaded in_proj dequantized is exactly the re-ordered rows of the checkpoint's, on one rank and on each of two;
  a load whose block scales keep the checkpoint's row order (the sabotage) fails both that and the reference check;
* tensor parallel 2 on gloo (a key-head group and its scale rows per rank);
* FP8 KV cache, prefix caching, MTP (planted drafts, accepted) and async scheduling together give the plain run's
  tokens;
* ``load_format="dummy"`` from benchmarks/shapes.py's block-FP8 config (the real next-80b built on the meta device;
  a shrunk one with the real head dims served on one rank and on two);
* ``in_proj_ba`` in block FP8 too (a tensor of one row of blocks: every row takes its scales, whatever the order);
* pieces that are not whole blocks refused (a block larger than the heads; ``in_proj_ba`` over two rows of blocks).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hyserve import SamplingParams
from hyserve.distributed import parallel_state
from hyserve.layers.quantization import fp8 as fp8_method
from hyserve.layers.sharding import Shard, set_shard, shard_of
from hyserve.model.qwen3_next import Qwen3NextForCausalLM, fused_in_proj_rows
from hyserve.model.registry import load_model_config
from hyserve.testing import read_checkpoint_tensors
from hyserve.testing.engine import drive, make_llm, random_prompts
from hyserve.testing.families import CheckpointCache
from hyserve.testing.fp8 import FP8, assert_close_to_fp8_reference, dequantize, expand_block, load_engine_model
from hyserve.testing.fp8_moe import (
    FP8_KV,
    assert_fp8_kv_features_compose,
    load_fp8_moe_reference,
    prefix_sharing_arrivals,
    write_fp8_next_checkpoint,
)
from hyserve.testing.qwen3_next import QWEN3_NEXT

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import shapes

BLOCK = (16, 16)
CASES: dict[str, dict[str, Any]] = {
    "block_per_expert": dict(fmt="block", layout="per_expert"),
    "block_fused": dict(fmt="block", layout="fused", num_experts_per_tok=3),
    "ct_per_expert": dict(fmt="ct_dynamic", layout="per_expert"),
    # in_proj_ba in blocks too: its 8 rows are one row of blocks, shared by every row, whatever their order.
    # (Seed 5: see CHAOS.)
    "block_ba": dict(fmt="block", layout="per_expert", ba_in_fp8=True, shared_expert_intermediate_size=64, seed=5),
    # A shared expert of 64: two ranks' slices of 32, whole 16-row blocks.
    "block_tp": dict(fmt="block", layout="per_expert", shared_expert_intermediate_size=64),
}
MTP = {"method": "mtp", "num_speculative_tokens": 2}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
PROMPTS = random_prompts(3, [9, 30, 17], seed=5)
# Tiny key-head groups: 2 key heads of 16, 4 value heads of 16 (r = 2).
NK, NV, DK, DV = 2, 4, 16, 16


class Checkpoints:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.paths: dict[str, str] = {}
        self.refs: dict[tuple[str, int], Any] = {}

    def get(self, case: str) -> str:
        if case not in self.paths:
            kw = {"seed": 3, **CASES[case]}
            self.paths[case] = write_fp8_next_checkpoint(self.root / case, kw.pop("fmt"), block=BLOCK, **kw)
        return self.paths[case]

    def reference(self, case: str, tp: int = 1) -> Any:
        if (case, tp) not in self.refs:
            self.refs[case, tp] = load_fp8_moe_reference(self.get(case), tp)
        return self.refs[case, tp]


@pytest.fixture(scope="module")
def next_ckpts(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("fp8_next"))


def _check(llm: Any, ref: Any, prompts: list[list[int]] = PROMPTS) -> None:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert_close_to_fp8_reference(ref, list(zip(prompts, outs, strict=True)), 1e-2, 0.1, 0.1, min_clear=12)


@pytest.fixture
def scales_in_checkpoint_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage: a part's block scales take their rank's block rows in the checkpoint's order (sorted), not in the
    order of its weight rows' ranges: the re-order applied to the weight and not to its scales."""
    original = fp8_method.Fp8LinearMethod.part_tensors

    def part_tensors(self: Any, layer: Any, index: int, row_offset: int) -> dict[str, torch.Tensor]:
        out = original(self, layer, index, row_offset)
        scale = out.get(self.scheme.scale_name) if self.scheme.block is not None else None
        shard = shard_of(scale) if scale is not None else None
        if shard is not None and shard.dim == 0:
            set_shard(scale, Shard(shard.full_shape, 0, tuple(sorted(shard.ranges))))
        return out

    monkeypatch.setattr(fp8_method.Fp8LinearMethod, "part_tensors", part_tensors)


# ------------------------------------------------------------------------------------------------ end to end


@pytest.mark.parametrize("case", ["block_per_expert", "block_fused", "ct_per_expert", "block_ba"])
def test_greedy_matches_the_fp8_reference(next_ckpts: Checkpoints, case: str) -> None:
    llm = make_llm(next_ckpts.get(case), max_num_batched_tokens=16, speculative_config=MTP)
    _check(llm, next_ckpts.reference(case))
    model = llm.llm_engine.runner.model
    gdn = [m for m in model.modules() if hasattr(m, "in_proj") and hasattr(m.in_proj, "gemms")]
    assert len(gdn) == 3
    for m in gdn:
        if case == "block_ba":  # [q | k | v | z | b | a] in one FP8 GEMM: 192 + 8 rows, 13 rows of 16-row blocks
            (gemm,) = m.in_proj.gemms
            assert gemm.weight.dtype == FP8 and gemm.weight_scale_inv.shape == (13, 4)
            continue
        qkvz, ba = m.in_proj.gemms  # [q | k | v | z] in FP8, [b | a] in bf16: two GEMMs
        assert qkvz.weight.dtype == FP8 and ba.weight.dtype == torch.float32 and not ba.method.quantized
    for block in (m for m in model.modules() if hasattr(m, "shared_expert_gate")):
        assert block.gate.weight.dtype == torch.float32 and block.shared_expert_gate.weight.dtype == torch.float32
        assert block.shared_expert.down_proj.weight.dtype == FP8
    experts = [m for m in [*model.modules(), *llm.llm_engine.runner.mtp.modules()] if hasattr(m, "gate_up_proj")
               and isinstance(m.gate_up_proj, torch.Tensor)]
    assert len(experts) == 5 and all(e.gate_up_proj.dtype == FP8 for e in experts)
    assert llm.get_metrics()["hyserve:spec_decode_num_draft_tokens"] > 0


def test_online_fp8(ckpts: CheckpointCache) -> None:
    """``quantization="fp8"`` on a float32 Qwen3-Next checkpoint: every linear layer per output channel (the fused
    projections' per-channel scales follow their rows), the routers and shared-expert gates kept."""
    path = ckpts.get("causal", "gdn3_attn1", family=QWEN3_NEXT.name, with_mtp=True)
    llm = make_llm(path, max_num_batched_tokens=16, quantization="fp8")
    _check(llm, load_fp8_moe_reference(path, online=True))
    gemm = llm.llm_engine.runner.model.model.layers[0].mixer.in_proj.gemms[0]
    assert gemm.weight.dtype == FP8 and gemm.method.scheme.online


def _in_proj_check(path: str, tp: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank's loaded in_proj ([q | k | v | z], FP8 and its block scales, dequantized) is exactly its key-head
    groups' rows of the checkpoint's dequantized ``in_proj_qkvz``, re-ordered (and [b | a] of ``in_proj_ba`` after
    them where that is block FP8 too, one GEMM)."""
    tensors = read_checkpoint_tensors(path)
    monkeypatch.setattr(parallel_state, "_TP_SIZE", tp)
    for rank in range(tp):
        monkeypatch.setattr(parallel_state, "_TP_RANK", rank)
        model = load_engine_model(Qwen3NextForCausalLM, path)
        k_range = (rank * NK // tp, (rank + 1) * NK // tp)
        rows = dict(zip(("in_proj_qkvz", "in_proj_ba"), fused_in_proj_rows(NK, NV, DK, DV, k_range), strict=True))
        for i in (0, 1, 2):
            gemms = model.model.layers[i].mixer.in_proj.gemms
            got = gemms[0].weight.float() * expand_block(gemms[0].weight_scale_inv, gemms[0].weight.shape, BLOCK)
            want = []
            for name in ("in_proj_qkvz", "in_proj_ba")[: 3 - len(gemms)]:
                full = dequantize(tensors, f"model.layers.{i}.linear_attn.{name}", BLOCK)
                want.append(Shard(tuple(full.shape), 0, rows[name]).take(full))
            assert torch.equal(got, torch.cat(want)), (rank, i)


@pytest.mark.parametrize("case,tp", [("block_tp", 1), ("block_tp", 2), ("block_ba", 1), ("block_ba", 2)])
def test_each_ranks_in_proj_is_its_groups_rows_with_their_scales(next_ckpts: Checkpoints, case: str, tp: int,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    _in_proj_check(next_ckpts.get(case), tp, monkeypatch)


def test_tensor_parallel_2_matches_the_reference(next_ckpts: Checkpoints) -> None:
    """Two gloo ranks, one key-head group each (its rows of in_proj_qkvz and their block scales), the experts' and
    the shared expert's intermediate slices of whole blocks; MTP on."""
    llm = make_llm(next_ckpts.get("block_tp"), tensor_parallel_size=2, max_num_batched_tokens=16,
                   speculative_config=MTP)
    _check(llm, next_ckpts.reference("block_tp", 2))
    llm.llm_engine.shutdown()


def test_fp8_kv_prefix_caching_mtp_and_async_compose(next_ckpts: Checkpoints, plant_drafts: Any) -> None:
    """Block-FP8 weights with an FP8 KV cache: with prefix caching, MTP (planted drafts, some accepted) and async
    scheduling the tokens are the plain run's."""
    path = next_ckpts.get("block_per_expert")
    arrivals = prefix_sharing_arrivals(GREEDY)
    plain = drive(make_llm(path, **FP8_KV).llm_engine, arrivals)
    assert_fp8_kv_features_compose(path, arrivals, plain, plant_drafts, MTP)


# ------------------------------------------------------------------------------------------------ sabotage


def test_scales_left_in_checkpoint_order_are_caught(next_ckpts: Checkpoints, monkeypatch: pytest.MonkeyPatch,
                                                    scales_in_checkpoint_order: None) -> None:
    """The re-order applied to the weight rows but not to their block scales: the exact check and the reference
    check both fail."""
    with pytest.raises(AssertionError):
        _in_proj_check(next_ckpts.get("block_per_expert"), 1, monkeypatch)
    monkeypatch.setattr(parallel_state, "_TP_SIZE", 1)
    monkeypatch.setattr(parallel_state, "_TP_RANK", 0)
    llm = make_llm(next_ckpts.get("block_per_expert"), max_num_batched_tokens=16)
    with pytest.raises(AssertionError, match=r"log-prob differences|reference argmax"):
        _check(llm, next_ckpts.reference("block_per_expert"))


# ------------------------------------------------------------------------------------------------ shapes, refusals


def _next_fp8_config(tmp_path: Path, shrink: bool) -> Path:
    """benchmarks/shapes.py's ``--shape next-80b --config-only --fp8`` config.json; ``shrink``: the same head dims
    (128, the block) with few heads, layers and experts (two ranks' slices of 128) and a small vocabulary, the bf16 list
    remade for its layers as shapes.py makes it."""
    out = tmp_path / ("small" if shrink else "next-80b")
    raw = shapes.write_moe_config(str(out), "next-80b", fp8=True)
    if shrink:
        raw.update(vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                   head_dim=128, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
                   num_experts_per_tok=2, moe_intermediate_size=256, shared_expert_intermediate_size=256,
                   max_position_embeddings=4096)
        raw["quantization_config"]["modules_to_not_convert"] = shapes.fp8_modules_to_not_convert(raw, 0,
                                                                                               prefix="model")
        (out / "config.json").write_text(json.dumps(raw))
    return out


@pytest.mark.slow  # budget: the block FP8 tests on tiny shapes stay
def test_the_release_shape_builds_in_block_fp8(tmp_path: Path) -> None:
    """The real next-80b FP8 config builds (meta device): in_proj_qkvz in 128 x 128 blocks, in_proj_ba, the router
    and the shared-expert gate in bf16."""
    cfg = load_model_config(str(_next_fp8_config(tmp_path, shrink=False)))
    with torch.device("meta"):
        model = Qwen3NextForCausalLM(cfg)
    qkvz, ba = model.model.layers[0].mixer.in_proj.gemms
    assert qkvz.weight.dtype == FP8 and qkvz.weight_scale_inv.shape == (12288 // 128, 2048 // 128)
    assert not ba.method.quantized and not model.model.layers[0].mlp.gate.method.quantized
    assert not model.model.layers[0].mlp.shared_expert_gate.method.quantized


def test_dummy_weights_from_the_benchmarks_fp8_config(tmp_path: Path) -> None:
    """``load_format="dummy"`` on shapes.py's block-FP8 Qwen3-Next config (shrunk, 128-row heads): one rank and two
    (each its key-head group of one drawn fused tensor, with its scale rows) give the same tokens, MTP on."""
    bare = _next_fp8_config(tmp_path, shrink=True)
    outs = []
    for tp in (1, 2):
        llm = make_llm(str(bare), load_format="dummy", seed=0, tensor_parallel_size=tp, speculative_config=MTP)
        if tp == 1:
            qkvz = llm.llm_engine.runner.model.model.layers[0].mixer.in_proj.gemms[0]
            assert qkvz.weight.dtype == FP8 and float(qkvz.weight_scale_inv.min()) == pytest.approx(1e-3)
        got = llm.generate([{"prompt_token_ids": p} for p in random_prompts(2, [5, 12], seed=2)], GREEDY,
                           use_tqdm=False)
        outs.append([o.outputs[0].token_ids for o in got])
        llm.llm_engine.shutdown()
    assert outs[0] == outs[1]


@pytest.mark.parametrize("change,match", [
    ("block32", r"in_proj_qkvz: block FP8 with 32-row blocks, but each key-head group's q and k pieces are 16 rows"),
    ("ba_in_blocks", r"in_proj_ba: block FP8 with 4-row blocks, but each key-head group's b and a pieces are 2 rows "
                     r"and the tensor 8"),
])
def test_pieces_that_are_not_whole_blocks_are_refused(next_ckpts: Checkpoints, tmp_path: Path, change: str,
                                                      match: str) -> None:
    raw = json.loads(Path(next_ckpts.get("block_per_expert"), "config.json").read_text())
    qc = raw["quantization_config"]
    if change == "block32":
        qc["weight_block_size"] = [32, 32]
    else:  # 4-row blocks: q, k, v, z whole blocks; in_proj_ba's 8 rows two rows of blocks, b and a 2 rows each
        qc["weight_block_size"] = [4, 4]
        qc["modules_to_not_convert"] = [m for m in qc["modules_to_not_convert"] if not m.endswith("in_proj_ba")]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=match):
        Qwen3NextForCausalLM(load_model_config(str(tmp_path)))

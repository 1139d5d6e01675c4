"""``--load-format dummy``: random weights from config.json alone (hyserve.model.dummy_weights).

A directory holding only config.json (a tiny checkpoint with its safetensors and tokenizer removed) serves with
``load_format="dummy"``: greedy outputs are the same for one seed and differ for another, log-probabilities are
finite in float32 and bf16; every floating tensor of the model, its MTP head and its vision tower holds values of the
dummy ranges and is not constant (a constructor's zeros or ones, or ``torch.empty`` garbage, are caught: a loader
that skips one tensor fails ``test_a_skipped_tensor_is_caught``); the caches are planned as with the real weights;
FP8 configs get FP8 weights and scales (online FP8 quantizes the draw); two tensor-parallel ranks or pipeline
stages serve the single-process model's outputs; ``auto`` on such a directory fails with the missing-file error
and a load format not served is refused naming the flag (by ``LLM`` and by the command line's flag, whose
``dummy`` reaches the engine: ``hyserve bench`` runs such a directory).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hyserve.model.dummy_weights as dummy_weights
from hyserve import LLM, SamplingParams, cli
from hyserve.engine_args import llm_kwargs
from hyserve.kernels.fp8 import FP8_DTYPE
from hyserve.layers.norm import GatedRMSNorm
from hyserve.testing import write_tiny_checkpoint
from hyserve.testing.engine import make_llm
from hyserve.testing.fp8 import write_fp8_checkpoint
from hyserve.testing.qwen3_5_vlm import write_tiny_vlm_checkpoint

PROMPTS = [{"prompt_token_ids": [5, 17, 99, 3, 42, 7]}, {"prompt_token_ids": [250, 1, 2]}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3)
MTP = {"method": "mtp", "num_speculative_tokens": 1}


def config_only(src: str, dst: Path, keep: tuple[str, ...] = ("config.json",)) -> str:
    """A copy of checkpoint ``src`` holding only the files ``keep`` names."""
    dst.mkdir()
    for name in keep:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), dst / name)
    return str(dst)


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("real"), with_mtp=True)


@pytest.fixture(scope="module")
def bare(real: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return config_only(real, tmp_path_factory.mktemp("bare") / "m")


def run(llm: LLM) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    got = []
    for out in outs:
        c = out.outputs[0]
        assert len(c.token_ids) == GREEDY.max_tokens
        values = [lp.logprob for step in c.logprobs or [] for lp in step.values()]
        got.append((list(c.token_ids), values))
    return got


def bad_tensors(module: nn.Module, fp8_max: float = 1.0) -> list[str]:
    """Names of ``module``'s floating tensors that are not finite, are constant, or lie outside their dummy range
    (``fp8_max``: of the FP8 weights; online FP8 scales each row to the format's range)."""
    low, high = dummy_weights.DUMMY_LOW, dummy_weights.DUMMY_HIGH
    plain = {f"{n}.weight" for n, m in module.named_modules(remove_duplicate=False)
             if isinstance(m, GatedRMSNorm | nn.LayerNorm)}
    bad = []
    for name, t in module.state_dict().items():
        if not t.is_floating_point():
            continue
        x = t.float()
        if name.endswith(("weight_scale", "weight_scale_inv", "input_scale", "input_scale_max", "k_scale",
                          "v_scale")):
            ok = bool(torch.isfinite(x).all() and (x > 0).all())
        elif t.dtype == FP8_DTYPE:
            ok = bool(x.abs().max() <= fp8_max and x.std() > 0)
        elif name.endswith("A_log"):
            ok = bool((x >= 0).all() and (x <= math.log(16.0)).all() and x.std() > 0)
        elif name.endswith("dt_bias") or name in plain:
            lo, hi = dummy_weights.DT_BIAS_RANGE if name.endswith("dt_bias") else dummy_weights.PLAIN_GAIN_RANGE
            ok = bool((x >= lo).all() and (x <= hi).all() and x.std() > 0)
        else:
            ok = bool((x >= low).all() and (x <= high).all() and (x.numel() == 1 or x.std() > 0))
        if not ok:
            bad.append(name)
    return bad


def not_as_drawn(module: nn.Module, seed: int = 0, prefix: str = "") -> list[str]:
    """Names of ``module``'s unquantized float32 checkpoint tensors that differ from what ``dummy_tensors`` draws
    for them (a tensor the loader skipped keeps its constructor's values, or whatever memory it was given)."""
    targets = dummy_weights.checkpoint_tensors(module)
    device = torch.device("cpu")
    return [name for name, t in dummy_weights.dummy_tensors(module, targets, seed, prefix, torch.float32, device)
            if t.dtype == torch.float32 and not torch.equal(targets[name], t)]


@pytest.fixture(scope="module")
def seed0(bare: str) -> Iterator[tuple[LLM, list[tuple[list[int], list[float]]]]]:
    llm = make_llm(bare, load_format="dummy", seed=0, speculative_config=MTP)
    yield llm, run(llm)
    llm.shutdown()


def test_config_only_serves_deterministically_per_seed(bare: str, seed0: tuple[LLM, list]) -> None:
    _, first = seed0
    assert all(math.isfinite(v) for _, values in first for v in values)
    with make_llm(bare, load_format="dummy", seed=0, speculative_config=MTP) as again:
        assert run(again) == first
    with make_llm(bare, load_format="dummy", seed=1) as other:
        assert [t for t, _ in run(other)] != [t for t, _ in first]
    with make_llm(bare, load_format="dummy", seed=0, dtype="bfloat16") as half:
        assert all(math.isfinite(v) for _, values in run(half) for v in values)


def test_every_tensor_of_model_and_mtp_head_is_initialized(seed0: tuple[LLM, list]) -> None:
    runner = seed0[0].llm_engine.runner
    assert runner.mtp is not None
    assert bad_tensors(runner.model) == []
    assert bad_tensors(runner.mtp) == []
    assert not_as_drawn(runner.model) == []
    assert not_as_drawn(runner.mtp, prefix="mtp.") == []


@pytest.mark.parametrize("skipped", ["model.layers.0.input_layernorm.weight", "model.layers.0.mlp.down_proj.weight",
                                     "model.layers.0.linear_attn.A_log"])
def test_a_skipped_tensor_is_caught(bare: str, skipped: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A loader that leaves one tensor as the model's constructor made it is caught: by ``not_as_drawn`` always
    (``torch.empty`` may hand it a freed tensor of dummy values, which passes ``bad_tensors``), by ``bad_tensors``
    when the constructor's values are constant (norms, ``A_log``)."""
    real_copy: Callable[[torch.Tensor, torch.Tensor], None] = dummy_weights.copy_into
    targets: dict[int, str] = {}

    def sabotaged(target: torch.Tensor, tensor: torch.Tensor) -> None:
        if targets.get(id(target)) != skipped:
            real_copy(target, tensor)

    real_targets = dummy_weights.checkpoint_tensors

    def recording(module: nn.Module) -> dict[str, torch.Tensor]:
        out = real_targets(module)
        targets.update({id(t): n for n, t in out.items()})
        return out

    monkeypatch.setattr(dummy_weights, "copy_into", sabotaged)
    monkeypatch.setattr(dummy_weights, "checkpoint_tensors", recording)
    seed = 1000 + len(skipped)  # a seed no other engine here used: a freed model's memory holds other values
    with make_llm(bare, load_format="dummy", seed=seed) as llm:
        model = llm.llm_engine.runner.model
        assert not_as_drawn(model, seed) == [skipped]
        bad = {n.replace(".mixer.", ".linear_attn.") for n in bad_tensors(model)}  # ``mixer``: an alias
        assert bad == ({skipped} if not skipped.endswith("proj.weight") else bad & {skipped})


def test_caches_are_planned_as_with_the_real_weights(real: str, bare: str) -> None:
    kw = dict(num_kv_blocks=None, num_state_slots=None)
    with make_llm(real, **kw) as a, make_llm(bare, load_format="dummy", **kw) as b:
        la, lb = a.llm_engine.layout, b.llm_engine.layout
        assert (la.num_kv_blocks, la.num_state_slots, la.num_snapshots, la.max_num_seqs) == \
            (lb.num_kv_blocks, lb.num_state_slots, lb.num_snapshots, lb.max_num_seqs)


def test_vision_tower_and_mtp_head_of_a_conditional_checkpoint(tmp_path: Path) -> None:
    src = write_tiny_vlm_checkpoint(tmp_path / "vlm", with_mtp=True)
    bare = config_only(src, tmp_path / "bare", ("config.json", "preprocessor_config.json", "tokenizer.json",
                                                  "tokenizer_config.json"))
    with make_llm(bare, load_format="dummy", speculative_config=MTP) as llm:
        runner = llm.llm_engine.runner
        assert runner.model.visual is not None and runner.mtp is not None
        assert bad_tensors(runner.model) == [] and bad_tensors(runner.mtp) == []
        assert any(n.startswith("visual.") for n in runner.model.state_dict())
        assert len(run(llm)[0][0]) == GREEDY.max_tokens


@pytest.mark.parametrize("fmt", ["ct_dynamic", "block", "online"])
def test_fp8_configs_get_fp8_weights_and_scales(tmp_path: Path, fmt: str) -> None:
    """An FP8 quantization_config: FP8 weights and scales drawn as stored; online FP8 (``quantization="fp8"``):
    the unquantized draw quantized as it loads."""
    kw: dict[str, Any] = dict(hidden_size=128, intermediate_size=256)
    src = write_tiny_checkpoint(tmp_path / "fp8", **kw) if fmt == "online" else \
        write_fp8_checkpoint(tmp_path / "fp8", fmt, **kw)
    bare = config_only(src, tmp_path / "bare")
    online: dict[str, Any] = {"quantization": "fp8"} if fmt == "online" else {}
    with make_llm(bare, load_format="dummy", dtype="bfloat16", **online) as llm:
        model = llm.llm_engine.runner.model
        assert any(t.dtype == FP8_DTYPE for t in model.state_dict().values())
        assert bad_tensors(model, fp8_max=448.0 if online else 1.0) == []
        assert all(math.isfinite(v) for _, values in run(llm) for v in values)


@pytest.mark.parametrize("load_format", ["auto", "safetensors"])
def test_reading_weights_from_a_config_only_directory_fails_naming_the_files(bare: str, load_format: str) -> None:
    with pytest.raises(FileNotFoundError, match=r"no safetensors weights in .*model\.safetensors"):
        make_llm(bare, load_format=load_format)


@pytest.mark.parametrize("load_format", ["pt", "gguf", "random"])
def test_a_load_format_not_served_is_refused_naming_the_flag(bare: str, load_format: str) -> None:
    with pytest.raises(ValueError, match=f"'{load_format}' is not supported \\(--load-format\\)"):
        make_llm(bare, load_format=load_format)
    args = cli.build_parser().parse_args(["serve", bare, "--load-format", load_format])
    with pytest.raises(ValueError, match="--load-format"):
        llm_kwargs(args, bare)
    assert llm_kwargs(cli.build_parser().parse_args(["serve", bare, "--load-format", "dummy"]), bare)[
        "load_format"] == "dummy"


def test_hyserve_bench_runs_a_config_only_directory(bare: str, tmp_path: Path) -> None:
    """The command line end to end: ``hyserve bench DIR --load-format dummy`` on config.json alone."""
    out = tmp_path / "r.json"
    assert cli.main(["bench", bare, "--load-format", "dummy", "--device", "cpu", "--num-prompts", "2",
                     "--input-len", "8", "--output-len", "4", "--no-warmup", "--result-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"], result["total_output_tokens"]) == (2, 0, 8)


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2},
                                      pytest.param({"pipeline_parallel_size": 2}, marks=pytest.mark.slow)])  # budget
def test_ranks_and_stages_draw_one_same_model(bare: str, seed0: tuple[LLM, list], parallel: dict[str, int]) -> None:
    """Each tensor is drawn whole from its name's seed and sharded as a checkpoint's: two tensor-parallel ranks or
    two pipeline stages (worker processes, gloo) serve the single-process model's greedy outputs."""
    with make_llm(bare, load_format="dummy", seed=0, **parallel) as llm:
        assert [t for t, _ in run(llm)] == [t for t, _ in seed0[1]]


@pytest.mark.parametrize("tied", [True, False])
def test_peer_bench_counts_a_config_only_model_as_its_checkpoint(tmp_path: Path, tied: bool) -> None:
    """``peer_bench.py measure --load-format dummy``: the weights-bandwidth bound's bytes, counted from config.json,
    are those of the checkpoint it describes."""
    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    pb = importlib.import_module("peer_bench")
    src = write_tiny_checkpoint(tmp_path / "ck", dtype=torch.bfloat16, tie_word_embeddings=tied)
    bare = config_only(src, tmp_path / "bare")
    assert pb.weight_bytes_per_step(bare, "dummy") == pb.weight_bytes_per_step(src) > 0

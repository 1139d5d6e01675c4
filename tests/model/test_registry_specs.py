"""The model registry and the cache specs layers declare.

* The registry maps both Qwen3.5 architectures to the model class and refuses others, naming the supported ones.
* The specs collected from a built model equal the shapes computed here, independently, from config.json.
* The planner's bytes per KV block and per state slot, the state pool's tensors and the verify scratch are exactly
  what the specs say.
* A toy recurrent family registered here (another state layout, no attention) generates through the unchanged
  engine: its tensors are allocated, reset, carried across chunks and decode steps, and snapshotted by the pool.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from hyserve import SamplingParams
from hyserve.cache.specs import RecurrentStateSpec, StateTensorSpec
from hyserve.cache.state_pool import state_bytes_per_slot
from hyserve.config import ModelConfig
from hyserve.layers.gdn import state_layout_switch
from hyserve.model import registry
from hyserve.model.base import CausalLM, RecurrentLayer
from hyserve.model.metadata import StepMetadata
from hyserve.model.mtp import MTPHead
from hyserve.model.qwen3_5 import Qwen3_5ForCausalLM
from hyserve.model.qwen3_5_config import parse_qwen3_5_config
from hyserve.model.registry import load_model_config, parse_model_config
from hyserve.testing.engine import make_llm
from hyserve.testing.families import CheckpointCache
from hyserve.worker import model_runner

QWEN = ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM")


def _text(raw: dict[str, Any]) -> dict[str, Any]:
    return raw["text_config"] if raw.get("model_type") == "qwen3_5" else raw


def _expected(path: str, dtype: torch.dtype, extra_attention: int = 0) -> dict[str, Any]:
    """Cache shapes from config.json alone (the real GDN layout: conv window over [q | k | v], K - 1 inputs)."""
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        t = _text(json.load(f))
    nk, nv, dk, dv = (t["linear_num_key_heads"], t["linear_num_value_heads"], t["linear_key_head_dim"],
                      t["linear_value_head_dim"])
    conv = (2 * nk * dk + nv * dv, t["linear_conv_kernel_dim"] - 1)
    ssm = (nv, dk, dv)
    types = t["layer_types"]
    n_gdn, n_attn = types.count("linear_attention"), types.count("full_attention") + extra_attention
    head_dim = t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"]
    elem = torch.empty((), dtype=dtype).element_size()
    per_slot = n_gdn * (conv[0] * conv[1] * elem + ssm[0] * ssm[1] * ssm[2] * 4)
    return {"conv": conv, "ssm": ssm, "n_gdn": n_gdn, "n_attn": n_attn, "kv_heads": t["num_key_value_heads"],
            "head_dim": head_dim, "per_slot": per_slot, "elem": elem, "nk": nk, "dk": dk, "nv": nv, "dv": dv}


# ------------------------------------------------------------------------------------------------------ registry


@pytest.mark.parametrize("form", ["causal", "conditional"])
def test_registry_maps_both_qwen3_5_architectures(ckpts: CheckpointCache, form: str) -> None:
    assert set(QWEN) <= set(registry.supported_architectures())
    cfg = load_model_config(ckpts.get(form=form))
    assert cfg.architecture == ("Qwen3_5ForCausalLM" if form == "causal" else "Qwen3_5ForConditionalGeneration")
    assert registry.model_class(cfg) is Qwen3_5ForCausalLM
    for arch in QWEN:
        entry = registry.resolve_architecture(arch, "qwen3_5")
        assert entry.model_class is Qwen3_5ForCausalLM and entry.parse_config is parse_qwen3_5_config


def test_registry_refuses_unknown_architecture_naming_the_supported_ones() -> None:
    with pytest.raises(ValueError, match="unsupported architecture 'MambaForCausalLM'") as err:
        parse_model_config({"architectures": ["MambaForCausalLM"], "model_type": "mamba"})
    assert all(a in str(err.value) for a in QWEN)
    with pytest.raises(ValueError, match=r"unsupported architecture 'mamba'.*Qwen3_5ForCausalLM"):
        parse_model_config({"model_type": "mamba"})
    cfg = parse_qwen3_5_config({"model_type": "qwen3_5_text", "vocab_size": 8, "hidden_size": 8,
                                "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1,
                                "num_key_value_heads": 1})
    with pytest.raises(ValueError, match=r"'NoSuchModel'.*Qwen3_5ForConditionalGeneration"):
        registry.model_class(dataclasses.replace(cfg, architecture="NoSuchModel"))


# ------------------------------------------------------------------------------------------------------ specs


@pytest.mark.parametrize("pattern", ["gdn3_attn1", "attn_both_ends"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_specs_from_the_model_match_config_json(ckpts: CheckpointCache, pattern: str, dtype: torch.dtype) -> None:
    path = ckpts.get(pattern=pattern)
    want = _expected(path, dtype)
    cfg = load_model_config(path)
    with torch.device("meta"):
        model = registry.model_class(cfg)(cfg)
    specs = model.cache_specs(dtype)
    assert len(specs.recurrent) == want["n_gdn"] and len(specs.attention) == want["n_attn"]
    order = None if state_layout_switch() == "key" else (0, 2, 1)  # HYSERVE_GDN_STATE_LAYOUT=value: value-major
    for spec in specs.recurrent:
        assert spec.tensors == (StateTensorSpec("conv_state", want["conv"], dtype),
                                StateTensorSpec("ssm_state", want["ssm"], torch.float32, order))
    for a in specs.attention:
        assert (a.num_kv_heads, a.head_dim, a.dtype) == (want["kv_heads"], want["head_dim"], dtype)
    assert specs.state_bytes_per_slot == want["per_slot"] == state_bytes_per_slot(cfg, dtype)
    assert specs.kv_bytes_per_block(16) == want["n_attn"] * 2 * 16 * want["kv_heads"] * want["head_dim"] * want["elem"]


def test_planner_pool_and_scratch_follow_the_specs(ckpts: CheckpointCache) -> None:
    """MTP speculation: the MTP head's attention counts in the KV block; the verify scratch holds k + 1 positions of
    a GDN layer's scratch spec (the conv window, and the delta rule's inputs in float32 in place of the SSM state);
    pool entries are slots + the pad slot + snapshots."""
    path = ckpts.get(with_mtp=True)
    want = _expected(path, torch.float32, extra_attention=1)
    k = 2
    llm = make_llm(path, speculative_config={"method": "mtp", "num_speculative_tokens": k})
    runner = llm.llm_engine.runner
    lay = runner.layout
    assert lay.state_bytes_per_slot == want["per_slot"] == runner.state_pool.bytes_per_entry
    assert lay.kv_bytes_per_block == want["n_attn"] * 2 * runner.block_size * want["kv_heads"] * want["head_dim"] * 4
    pool = runner.state_pool
    entries = pool.num_slots + 1 + pool.num_snapshots
    assert pool.num_snapshots > 0 and len(pool.layers) == want["n_gdn"]
    for layer_state in pool.layers:
        assert {n: tuple(t.shape) for n, t in layer_state.items()} == {"conv_state": (entries, *want["conv"]),
                                                                       "ssm_state": (entries, *want["ssm"])}
        assert layer_state["ssm_state"].dtype == torch.float32
    # pool.<name>s lists a tensor name across layers, and each layer holds exactly the pool's tensors.
    assert [t.data_ptr() for t in pool.ssm_states] == [s["ssm_state"].data_ptr() for s in pool.layers]
    for layer, layer_state in zip(runner.model.recurrent_layers(), pool.layers, strict=True):
        assert layer.state is layer_state
        assert layer.verify_scratch is not None
        rows = (runner.max_num_seqs, k + 1)
        assert {n: tuple(t.shape) for n, t in layer.verify_scratch.items()} == {
            "conv_state": (*rows, *want["conv"]), "k": (*rows, want["nk"], want["dk"]),
            "v": (*rows, want["nv"], want["dv"]), "g": (*rows, want["nv"]), "beta": (*rows, want["nv"])}
        assert all(t.dtype == torch.float32 for n, t in layer.verify_scratch.items() if n != "conv_state")
    assert len(runner.kv_caches_all) == want["n_attn"]


def test_budgeted_planner_uses_spec_bytes(ckpts: CheckpointCache) -> None:
    """With a budget, snapshots and slots are counted in spec bytes: 0.2 of the budget buys budget // per_slot."""
    path = ckpts.get()
    per_slot = _expected(path, torch.float32)["per_slot"]
    budget = 400 * per_slot
    llm = make_llm(path, num_kv_blocks=None, num_state_slots=None, cpu_cache_memory_bytes=budget)
    lay = llm.llm_engine.runner.layout
    assert lay.num_snapshots == int(budget * 0.2) // per_slot


# ------------------------------------------------------------------------------------------------------ a toy family

TOY_ARCH = "ToyRecurrentForCausalLM"
ACC, WIN = 5, 3  # the toy state: a decaying accumulator of ACC channels and a window of the last WIN inputs


class ToyRecurrent(RecurrentLayer):
    """Per request: ``acc`` (ACC,) float32, ``acc = acc / 2 + x[:ACC]`` per token; ``window`` (WIN, 2) in the model
    dtype, the last WIN tokens' first two channels. The output adds both to the residual. Verify rows leave the
    live state alone and write the state after each of their positions into the verify scratch."""

    def cache_spec(self, dtype: torch.dtype) -> RecurrentStateSpec:
        return RecurrentStateSpec((StateTensorSpec("acc", (ACC,), torch.float32),
                                   StateTensorSpec("window", (WIN, 2), dtype)))

    def forward(self, x: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        acc, win = self.state["acc"], self.state["window"]
        qsl = meta.query_start_loc.tolist()
        num_verify = meta.verify.num_rows if meta.verify is not None else 0
        out = x.clone()
        for r, slot in enumerate(meta.state_slots.tolist()):
            a, w = acc[slot].clone(), win[slot].clone()
            for j, t in enumerate(range(qsl[r], qsl[r + 1])):
                a = a / 2 + x[t, :ACC].float()
                w = torch.cat([w[1:], x[t : t + 1, :2]])
                out[t, :ACC] += a.to(x.dtype)
                out[t, :2] += w.sum(0)
                if r < num_verify:
                    assert self.verify_scratch is not None
                    self.verify_scratch["acc"][r, j], self.verify_scratch["window"][r, j] = a, w
            if r >= num_verify:
                acc[slot], win[slot] = a, w
        return out


class ToyModel(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.mixers = nn.ModuleList([ToyRecurrent(), ToyRecurrent()])
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(self.embed.weight.shape, generator=gen))
            self.lm_head.weight.copy_(torch.randn(self.lm_head.weight.shape, generator=gen))

    def forward(self, input_ids: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        x = self.embed(input_ids)
        for m in self.mixers:
            x = m(x, meta)
        return x

    def input_embeddings(self) -> nn.Embedding:
        return self.embed

    def activation_width(self) -> int:
        return self.embed.embedding_dim


def toy_reference(model: ToyModel, ids: list[int]) -> list[int]:
    """Greedy next token after every prefix, one request from zero state, computed without the engine."""
    x = model.embed(torch.tensor(ids))
    for _ in model.mixers:
        a, w = torch.zeros(ACC), torch.zeros(WIN, 2)
        out = x.clone()
        for t in range(len(ids)):
            a = a / 2 + x[t, :ACC]
            w = torch.cat([w[1:], x[t : t + 1, :2]])
            out[t, :ACC] += a
            out[t, :2] += w.sum(0)
        x = out
    return model.compute_logits(x).argmax(-1).tolist()


def parse_toy(raw: dict[str, Any]) -> ModelConfig:
    return dataclasses.replace(parse_qwen3_5_config({**raw, "model_type": "qwen3_5_text"}), architecture=TOY_ARCH)


@pytest.fixture
def toy_family(ckpts: CheckpointCache, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A checkpoint directory naming the toy architecture, registered for this test only (no weights to load)."""
    path = os.path.join(str(tmp_path), "toy")
    shutil.copytree(ckpts.get(), path)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump({**raw, "architectures": [TOY_ARCH], "model_type": "toy"}, f)
    registry.register_model(TOY_ARCH, ToyModel, parse_toy, ("toy",))
    monkeypatch.setattr(model_runner, "load_weights", lambda model, model_dir, cfg, **kw: {})
    try:
        yield path
    finally:
        registry.unregister_model(TOY_ARCH)
    assert TOY_ARCH not in registry.supported_architectures()


def test_a_registered_toy_family_runs_on_its_own_state(toy_family: str) -> None:
    llm = make_llm(toy_family, max_num_batched_tokens=16, num_state_slots=3, num_snapshot_slots=4)
    runner = llm.llm_engine.runner
    assert isinstance(runner.model, ToyModel)
    pool = runner.state_pool
    entries = pool.num_slots + 1 + pool.num_snapshots
    assert runner.layout.state_bytes_per_slot == 2 * (ACC * 4 + WIN * 2 * 4)
    assert runner.layout.kv_bytes_per_block == 0 and runner.kv_caches == []
    assert [{n: tuple(t.shape) for n, t in s.items()} for s in pool.layers] == \
        [{"acc": (entries, ACC), "window": (entries, WIN, 2)}] * 2
    assert all(a is s["window"] for a, s in zip(pool.windows, pool.layers, strict=True))
    with pytest.raises(AttributeError):  # only declared names
        _ = pool.conv_states
    # Six requests over three slots with a 16-token budget: chunked prefill, slot reuse, zeroing on admission (the
    # short prompts come last, into reused slots, where stale state would change their outputs).
    prompts = [[(7 * i + j) % 400 for j in range(n)] for i, n in enumerate([20, 3, 33, 9, 2, 1])]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    model = runner.model
    assert isinstance(model, ToyModel)
    with torch.inference_mode():
        for p, out in zip(prompts, outs, strict=True):
            got = list(out.outputs[0].token_ids)
            assert len(got) == 6
            assert toy_reference(model, p + got)[len(p) - 1 : -1] == got
    # Prefix caching snapshotted the toy tensors: a repeated prompt hits and still matches.
    hits = llm.get_metrics()["hyserve:prefix_cache_snapshot_hits"]
    for layer_state in pool.layers:  # free slots hold garbage: a hit must overwrite every declared tensor
        for t in layer_state.values():
            t[: pool.num_slots].fill_(100.0)
    again = llm.generate([{"prompt_token_ids": prompts[2]}], SamplingParams(temperature=0.0, max_tokens=6,
                                                                           ignore_eos=True), use_tqdm=False)
    assert list(again[0].outputs[0].token_ids) == list(outs[2].outputs[0].token_ids)
    assert llm.get_metrics()["hyserve:prefix_cache_snapshot_hits"] > hits, "the repeated prompt missed"
    assert any(torch.count_nonzero(s["acc"][pool.snapshot_entry(0) :]) for s in pool.layers)


def test_toy_family_speculates_with_the_generic_commit(toy_family: str) -> None:
    """n-gram drafts over repetitive prompts: verify scratch of the toy tensors, the default commit of accepted
    candidates and the default snapshot of candidates, against the engine-free reference."""
    llm = make_llm(toy_family, num_state_slots=3, num_snapshot_slots=4,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    runner = llm.llm_engine.runner
    for layer in runner.model.recurrent_layers():
        assert layer.verify_scratch is not None
        assert tuple(layer.verify_scratch["window"].shape) == (runner.max_num_seqs, 3, WIN, 2)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    model = runner.model
    assert isinstance(model, ToyModel)
    firsts = [[1, 2, 3, 4] * 6, [5, 6, 5, 6, 5, 6, 5], [9, 8, 7, 9, 8, 7, 9, 8]]
    outs = llm.generate([{"prompt_token_ids": p} for p in firsts], greedy, use_tqdm=False)
    # The toy's state forgets (acc halves per token): a prompt repeating prompt + output makes the model repeat
    # itself, so the n-gram drafts get accepted.
    prompts = [p + list(o.outputs[0].token_ids) + p for p, o in zip(firsts, outs, strict=True)]
    outs += llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    with torch.inference_mode():
        for p, out in zip(firsts + prompts, outs, strict=True):
            got = list(out.outputs[0].token_ids)
            assert len(got) == 12 and toy_reference(model, p + got)[len(p) - 1 : -1] == got
    assert llm.get_metrics()["hyserve:spec_decode_num_accepted_tokens"] > 0, "no draft was accepted"


def test_draft_head_comes_from_the_family(toy_family: str) -> None:
    qwen = parse_model_config({"model_type": "qwen3_5_text", "vocab_size": 8, "hidden_size": 8,
                                  "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1,
                                  "num_key_value_heads": 1})
    assert registry.draft_head(qwen).build is MTPHead
    with pytest.raises(ValueError, match=f"{TOY_ARCH!r} has no MTP head"):
        registry.draft_head(load_model_config(toy_family))

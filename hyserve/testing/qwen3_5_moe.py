"""The Qwen3.5-MoE family's tiny checkpoints for tests, laid out as the real releases are, and their reference.

``write_tiny_moe_checkpoint`` writes config.json, safetensors weights, tokenizer files and generation_config.json in
either published form (``causal``: ``Qwen3_5MoeForCausalLM``, ``qwen3_5_moe_text``, tensors ``model.*``;
``conditional``: ``Qwen3_5MoeForConditionalGeneration``, ``qwen3_5_moe`` with ``text_config`` and a vision tower,
tensors ``model.language_model.*`` and ``model.visual.*``), with the experts in either layout (``fused``:
``mlp.experts.gate_up_proj`` [E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I], transformers' parameters;
``per_expert``: ``mlp.experts.{e}.gate_proj|up_proj|down_proj.weight``), optionally with an MTP head
(``mtp.*``, its one decoder layer with its own MoE block). Parameter names and shapes come from transformers'
``Qwen3_5MoeForCausalLM`` built on the meta device.

``load_moe_reference_model``: transformers' ``Qwen3_5MoeForCausalLM`` with the checkpoint's tensors, float32, CPU.
The fused layout loads with ``from_pretrained``; transformers 5.17 does not convert the per-expert layout for this
family (its conversion mapping only strips ``language_model.``), so a per-expert checkpoint's tensors are stacked
into the fused parameters here and loaded strictly. transformers' router always renormalizes the top-k weights;
for a config with ``norm_topk_prob: false`` the reference's routers are given the unrenormalized routing.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import types
from typing import Any

import torch
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe

from hyserve.testing.families import LAYER_PATTERNS, FamilyCheckpoints, register_family
from hyserve.testing.files import read_checkpoint_tensors, save_weights, write_json
from hyserve.testing.qwen3_5 import (
    conditional_name,
    config_json,
    init_tensor,
    mtp_shapes,
    tiny_text_config,
    use_torch_gated_delta_rule,
    visual_shapes,
    write_generation_config_and_tokenizer,
)

MOE_DEFAULTS: dict[str, Any] = {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                "shared_expert_intermediate_size": 48}
LAYOUTS = ("fused", "per_expert")


def tiny_moe_fields(layer_types: list[str]) -> dict[str, Any]:
    """Qwen3.5's tiny text config's fields (``hyserve.testing.qwen3_5.tiny_text_config``) with a small MoE, for
    the MoE families' configs."""
    dense = tiny_text_config(layer_types=layer_types).to_dict()
    kwargs = {k: dense[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers", "layer_types",
                                    "num_attention_heads", "num_key_value_heads", "head_dim", "linear_num_key_heads",
                                    "linear_key_head_dim", "linear_num_value_heads", "linear_value_head_dim",
                                    "linear_conv_kernel_dim", "rms_norm_eps", "max_position_embeddings",
                                    "rope_parameters", "eos_token_id", "tie_word_embeddings")}
    return {**kwargs, **MOE_DEFAULTS, "bos_token_id": None, "pad_token_id": None}


def tiny_moe_config(layer_types: list[str], **overrides: Any) -> Qwen3_5MoeTextConfig:
    """``tiny_moe_fields`` as a Qwen3.5-MoE text config; ``overrides`` replace any field."""
    return Qwen3_5MoeTextConfig(**{**tiny_moe_fields(layer_types), **overrides})


def build_moe_block(hidden: int, num_experts: int, top_k: int, inter: int, shared_inter: int, *,
                    device: str = "cpu", dtype: torch.dtype = torch.float32, quant: Any = None,
                    prefix: str = "model.layers.0.mlp") -> Any:
    """One ``hyserve.layers.moe.SparseMoeBlock`` (renormalized top-k) built where it runs, its parameters in
    ``dtype`` (FP8 where ``quant`` says) and uninitialized: as the engine builds models, since the stacked shared
    expert's views of the experts' storage do not survive a later ``.to()``."""
    from hyserve.layers.moe import SparseMoeBlock

    cfg = types.SimpleNamespace(hidden_size=hidden, num_experts=num_experts, num_experts_per_tok=top_k,
                                moe_intermediate_size=inter, shared_expert_intermediate_size=shared_inter,
                                norm_topk_prob=True, quantization=quant)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return SparseMoeBlock(cfg, prefix)
    finally:
        torch.set_default_dtype(default)


def moe_init(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Scales for the MoE block's tensors (stacked experts read over their last dim); the rest as Qwen3.5's."""
    if name.endswith("experts.gate_up_proj"):
        return torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
    if name.endswith("experts.down_proj"):
        return torch.randn(shape, generator=gen) * (0.5 / math.sqrt(shape[-1]))
    if name.endswith("mlp.gate.weight"):  # router: spread logits, so the top k are clear
        return torch.randn(shape, generator=gen) * (2.0 / math.sqrt(shape[-1]))
    return init_tensor(name, shape, gen)


def moe_shapes(config: Qwen3_5MoeTextConfig, with_mtp: bool) -> dict[str, tuple[int, ...]]:
    """transformers' ``Qwen3_5MoeForCausalLM`` parameters (meta device), and the MTP head's (Qwen3.5's head with
    the decoder layer's MLP replaced by an MoE block of the same names as the model's layers')."""
    with torch.device("meta"):
        model = Qwen3_5MoeForCausalLM(config)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    if not config.tie_word_embeddings:
        shapes.setdefault("lm_head.weight", (config.vocab_size, config.hidden_size))
    if with_mtp:
        dense = types.SimpleNamespace(**{k: getattr(config, k) for k in (
            "hidden_size", "head_dim", "num_attention_heads", "num_key_value_heads")}, intermediate_size=1)
        mtp = {n: s for n, s in mtp_shapes(dense).items() if ".mlp." not in n}  # type: ignore[arg-type]
        block = {n.removeprefix("model.layers.0."): s for n, s in shapes.items() if n.startswith("model.layers.0.mlp.")}
        mtp.update({f"mtp.layers.0.{n}": s for n, s in block.items()})
        shapes.update(mtp)
    return shapes


def split_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fused experts' tensors as one tensor per expert and projection (the per-expert layout)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith("experts.gate_up_proj"):
            base, i = name.removesuffix("gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :i].contiguous()
                out[f"{base}{e}.up_proj.weight"] = t[e, i:].contiguous()
        elif name.endswith("experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t
    return out


def stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of ``split_experts``."""
    out: dict[str, torch.Tensor] = {}
    per: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in tensors.items():
        parts = name.split(".")
        if len(parts) >= 4 and parts[-4] == "experts" and parts[-3].isdigit():
            base = ".".join(parts[:-3]) + "."
            per.setdefault(base, {}).setdefault(int(parts[-3]), {})[parts[-2]] = t
        else:
            out[name] = t
    for base, experts in per.items():
        order = [experts[e] for e in sorted(experts)]
        out[base + "gate_up_proj"] = torch.stack([torch.cat([p["gate_proj"], p["up_proj"]]) for p in order])
        out[base + "down_proj"] = torch.stack([p["down_proj"] for p in order])
    return out


def write_tiny_moe_checkpoint(
    path: str | os.PathLike[str], *, form: str = "causal", layer_types: list[str] | None = None,
    layout: str = "fused", with_mtp: bool = False, seed: int = 0, sharded: bool = False,
    dtype: torch.dtype = torch.float32, **overrides: Any,
) -> str:
    """Write a tiny random Qwen3.5-MoE checkpoint; ``overrides`` go to ``Qwen3_5MoeTextConfig``
    (``num_experts_per_tok=3``, ``norm_topk_prob=False``, ...)."""
    if form not in ("causal", "conditional") or layout not in LAYOUTS:
        raise ValueError(f"form must be causal or conditional, layout one of {LAYOUTS} (got {form!r}, {layout!r})")
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    norm_topk = overrides.pop("norm_topk_prob", None)
    config = tiny_moe_config(list(layer_types or LAYER_PATTERNS["gdn3_attn1"]), **overrides)
    gen = torch.Generator().manual_seed(seed)
    shapes = moe_shapes(config, with_mtp)
    tensors = {n: moe_init(n, s, gen).to(dtype).contiguous() for n, s in shapes.items()}
    if layout == "per_expert":
        tensors = split_experts(tensors)
    if form == "conditional":
        tensors = {conditional_name(n): t for n, t in tensors.items()}
        tensors.update({n: init_tensor(n, s, gen).to(dtype) for n, s in visual_shapes(config.hidden_size).items()})
    save_weights(path, tensors, sharded=sharded)
    raw = config_json(config, form=form, dtype=dtype, with_mtp=with_mtp)  # type: ignore[arg-type]
    text = raw if form == "causal" else raw["text_config"]
    text["model_type"] = "qwen3_5_moe_text"
    if norm_topk is not None:
        text["norm_topk_prob"] = bool(norm_topk)
    if form == "causal":
        raw["architectures"] = ["Qwen3_5MoeForCausalLM"]
    else:
        raw.update(architectures=["Qwen3_5MoeForConditionalGeneration"], model_type="qwen3_5_moe")
        raw["vision_config"]["model_type"] = "qwen3_5_moe_vision"
    write_json(os.path.join(path, "config.json"), raw)
    write_generation_config_and_tokenizer(path)
    return path


def _unnormalized_router_forward(self: Any, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """transformers' ``Qwen3_5MoeTopKRouter.forward`` without the renormalization (``norm_topk_prob: false``)."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = torch.nn.functional.linear(hidden_states, self.weight)
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    top, idx = torch.topk(probs, self.top_k, dim=-1)
    return logits, top.to(logits.dtype), idx


def use_torch_gated_delta_rules() -> None:
    """transformers' own PyTorch gated delta rule in its Qwen3.5 and Qwen3.5-MoE modeling files (see
    ``hyserve.testing.qwen3_5.use_torch_gated_delta_rule``)."""
    use_torch_gated_delta_rule()
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        setattr(modeling_qwen3_5_moe, name, inspect.unwrap(getattr(modeling_qwen3_5_moe, name)))


def load_moe_reference_model(path: str | os.PathLike[str]) -> Qwen3_5MoeForCausalLM:
    """transformers' ``Qwen3_5MoeForCausalLM`` holding the checkpoint in ``path``, float32, eval mode."""
    use_torch_gated_delta_rules()
    path = os.fspath(path)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    text = raw.get("text_config", raw)
    tensors = read_checkpoint_tensors(path)
    if any(".experts.0." in n for n in tensors):
        fields = {k: v for k, v in text.items() if k not in ("architectures", "model_type")}
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**fields))
        state = {("model." + n.removeprefix("model.language_model.")) if n.startswith("model.language_model.")
                 else n: t for n, t in stack_experts(tensors).items()
                 if not n.startswith(("mtp.", "model.visual."))}
        model.load_state_dict(state, strict=True)
        model = model.float()
    else:
        model = Qwen3_5MoeForCausalLM.from_pretrained(path, dtype=torch.float32, local_files_only=True)
    if not text.get("norm_topk_prob", True):
        for m in model.modules():
            if isinstance(m, modeling_qwen3_5_moe.Qwen3_5MoeTopKRouter):
                m.forward = types.MethodType(_unnormalized_router_forward, m)  # type: ignore[method-assign]
    return model.eval()


QWEN3_5_MOE = register_family(FamilyCheckpoints("qwen3_5_moe", write_tiny_moe_checkpoint, load_moe_reference_model,
                                                LAYER_PATTERNS))


def write_tiny_moe_vlm_checkpoint(path: str | os.PathLike[str], *, layout: str = "fused", with_mtp: bool = False,
                                  seed: int = 0, layer_types: list[str] | None = None, **overrides: Any) -> str:
    """A tiny ``Qwen3_5MoeForConditionalGeneration`` whose image path works end to end: the dense VLM checkpoint of
    ``write_tiny_vlm_checkpoint`` (tokenizer with the vision tokens, complete vision tower, M-RoPE, preprocessor
    config, image chat template) with its text model replaced by an MoE one (``overrides`` to
    ``Qwen3_5MoeTextConfig``)."""
    from hyserve.testing.qwen3_5_vlm import write_tiny_vlm_checkpoint

    path = write_tiny_vlm_checkpoint(path, with_mtp=with_mtp, seed=seed,
                                     layer_types=list(layer_types or LAYER_PATTERNS["gdn3_attn1"]))
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    text = {k: v for k, v in raw["text_config"].items() if k not in ("intermediate_size", "model_type", "dtype")}
    norm_topk = overrides.pop("norm_topk_prob", None)
    config = Qwen3_5MoeTextConfig(**{**text, **MOE_DEFAULTS, **overrides})
    gen = torch.Generator().manual_seed(seed + 7)
    moe = {n: moe_init(n, s, gen).contiguous() for n, s in moe_shapes(config, with_mtp).items()}
    if layout == "per_expert":
        moe = split_experts(moe)
    tensors = {n: t for n, t in read_checkpoint_tensors(path).items() if n.startswith("model.visual.")}
    tensors.update({conditional_name(n): t for n, t in moe.items()})
    os.remove(os.path.join(path, "model.safetensors"))
    save_weights(path, tensors, sharded=False)
    text_config = {**raw["text_config"], **MOE_DEFAULTS, **overrides, "model_type": "qwen3_5_moe_text"}
    text_config.pop("intermediate_size", None)
    if norm_topk is not None:
        text_config["norm_topk_prob"] = bool(norm_topk)
    raw.update(architectures=["Qwen3_5MoeForConditionalGeneration"], model_type="qwen3_5_moe", text_config=text_config)
    raw["vision_config"]["model_type"] = "qwen3_5_moe_vision"
    write_json(os.path.join(path, "config.json"), raw)
    return path


def load_moe_vlm_reference_model(path: str | os.PathLike[str]) -> Any:
    """transformers' ``Qwen3_5MoeForConditionalGeneration`` from the directory (fused layout), float32, eval."""
    from transformers import Qwen3_5MoeForConditionalGeneration

    use_torch_gated_delta_rules()
    model = Qwen3_5MoeForConditionalGeneration.from_pretrained(os.fspath(path), dtype=torch.float32,
                                                               local_files_only=True)
    return model.eval()


@torch.no_grad()
def reference_mtp(path: str, ref: Any, tokens: list[int], text_model: type, norm: type
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The MTP head's output (post-norm) and logits at every position i < len - 1 (predicting token i + 2),
    built from transformers' own modules of the family (``text_model``: its text model class, e.g.
    ``Qwen3_5MoeTextModel``; ``norm``: its RMSNorm): ``fc([pre_fc_norm_embedding(embed(t[i+1])),
    pre_fc_norm_hidden(h_i)])`` (``h``: the target's post-final-norm hidden states), then a one-layer text model
    (full attention, layer 0's feed-forward block) holding ``mtp.layers.0.*`` with ``mtp.norm`` as its final norm,
    then lm_head."""
    tensors = {n.removeprefix("mtp."): t for n, t in read_checkpoint_tensors(path).items() if n.startswith("mtp.")}
    if any(".experts.0." in n for n in tensors):
        tensors = stack_experts(tensors)
    cfg = type(ref.config)(**{**ref.config.to_dict(), "num_hidden_layers": 1, "layer_types": ["full_attention"]})
    mtp = text_model(cfg).float().eval()
    state = {n: t for n, t in tensors.items() if n.startswith(("layers.", "norm."))}
    state["embed_tokens.weight"] = ref.model.embed_tokens.weight
    mtp.load_state_dict(state, strict=True)
    h = cfg.hidden_size
    norm_e, norm_h = norm(h, cfg.rms_norm_eps), norm(h, cfg.rms_norm_eps)
    norm_e.weight.copy_(tensors["pre_fc_norm_embedding.weight"])
    norm_h.weight.copy_(tensors["pre_fc_norm_hidden.weight"])
    ids = torch.tensor([tokens])
    hidden = ref.model(input_ids=ids, use_cache=False).last_hidden_state[0, :-1]
    emb = ref.model.embed_tokens(ids[0, 1:])
    x = torch.nn.functional.linear(torch.cat([norm_e(emb), norm_h(hidden)], dim=-1), tensors["fc.weight"])
    out = mtp(inputs_embeds=x[None], use_cache=False).last_hidden_state[0]
    return out, ref.lm_head(out).float()


def check_mtp_drafts(llm: Any, path: str, ref: Any, text_model: type, norm: type, sabotaged: bool) -> None:
    """One request through ``llm`` (MTP k = 1): every draft is the argmax of ``reference_mtp``'s logits at its
    position and the head's output its output, unless ``sabotaged`` (then the outputs must differ)."""
    from hyserve import SamplingParams
    from hyserve.testing.engine import drive, random_prompts
    from hyserve.testing.speculative import record_drafts

    seen = record_drafts(llm.llm_engine)
    prompt = random_prompts(1, [19], seed=11)[0]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    out = drive(llm.llm_engine, {0: [("r", prompt, params)]})["r"].outputs[0].token_ids
    hidden, logits = reference_mtp(path, ref, prompt + out, text_model, norm)
    assert llm.get_metrics()["hyserve:spec_decode_num_accepted_tokens"] == 0  # a random head: one token a step
    # The n-th recorded draft came after the n-th step, when the request had n outputs: it predicts output n from
    # position len(prompt) + n - 2. A draft after every step but the last two (one token left, then done).
    assert len(seen["r"]) == len(out) - 2
    errors = []
    for n, (drafts, got) in enumerate(seen["r"], start=1):
        row = logits[len(prompt) + n - 2]
        assert sabotaged or float(row.max() - row[drafts[0]]) <= 2e-3, \
            f"draft {n}: {drafts[0]} vs {int(row.argmax())}"
        errors.append(float((got.float() - hidden[len(prompt) + n - 2]).abs().max()))
    assert (max(errors) > 1e-3) == sabotaged, errors

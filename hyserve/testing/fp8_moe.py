"""Tiny FP8 Qwen3.5-MoE checkpoints for tests, and the transformers reference that runs them (the MoE side of
``hyserve.testing.fp8``).

``write_fp8_moe_checkpoint`` writes a tiny bf16 Qwen3.5-MoE checkpoint (``hyserve.testing.qwen3_5_moe``, either
expert layout, with an MTP head) and quantizes it (``quantize_moe_checkpoint``): the dense projections and the
per-expert layout's 2-D expert weights as ``hyserve.testing.fp8.quantize_checkpoint`` quantizes linear layers, and
the fused layout's stacked experts one expert at a time: ``experts.gate_up_proj`` [E, 2I, H] with
``experts.gate_up_proj_scale_inv`` [E, ceil(2I / 128), ceil(H / 128)] (block, transformers' FP8 experts' names) or
``experts.gate_up_proj_scale`` [E, 2I] (compressed-tensors per channel; [E] per tensor), ``experts.down_proj`` and
its scale alike. The router (``mlp.gate``) and ``mlp.shared_expert_gate`` stay bf16, in the ignore list, as the
published -FP8 releases keep them. ``tensor_scale_layers`` (compressed-tensors): the modules whose names match this
regex get one scale per tensor (per expert and projection) instead of per channel, under a second config group.

``load_fp8_moe_reference``: transformers' ``Qwen3_5MoeForCausalLM`` (for a Qwen3-Next checkpoint,
``model_type: qwen3_next``, its ``Qwen3NextForCausalLM``; block FP8 in the checkpoint's ``weight_block_size``) holding
the dequantized weights, with the activation quantization emulated: forward pre-hooks on the quantized
``nn.Linear`` layers (``hyserve.testing.fp8``) and, for the experts (which transformers computes with its own loop
over ``gate_up_proj`` / ``down_proj``), a forward that quantizes each expert's input per token (or 128-group) before
``gate_up`` and its ``silu(gate) * up`` before ``down``. ``online=True``: the reference of a bf16 checkpoint under
``quantization="fp8"`` (every linear layer but the LM head, the router and the shared expert's gate, and the
experts, per output channel).
"""

from __future__ import annotations

import json
import os
import re
import types
from typing import Any

import torch
from safetensors.torch import save_file
from torch.nn import functional as F
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe
from transformers.models.qwen3_next import modeling_qwen3_next

from hyserve.testing.engine import drive, make_llm, random_prompts
from hyserve.testing.files import read_checkpoint_tensors
from hyserve.testing.fp8 import (
    BLOCK,
    FP8,
    FP8_MAX,
    block_scale,
    default_ignore,
    dequantize,
    emulate,
    expand_block,
    fake_quantize,
    is_linear_weight,
    per_row_scale,
    quantize_checkpoint,
    quantize_weight,
)
from hyserve.testing.qwen3_5_moe import stack_experts, use_torch_gated_delta_rules, write_tiny_moe_checkpoint

FUSED = ("experts.gate_up_proj", "experts.down_proj")
VLM_TEXT = "model.language_model."
_KEPT = r"(mlp\.gate|shared_expert_gate)"


def moe_ignore(fmt: str, tensors: dict[str, torch.Tensor]) -> list[str]:
    """``hyserve.testing.fp8.default_ignore`` and the routers and shared-expert gates (compressed-tensors as
    ``re:`` entries, as llm-compressor's MoE recipes write them; block FP8 by exact name)."""
    if fmt.startswith("ct_"):
        return [*default_ignore(fmt, tensors), r"re:.*mlp\.gate$", r"re:.*shared_expert_gate$"]
    kept = sorted(n.removesuffix(".weight") for n in tensors if re.search(rf"{_KEPT}\.weight$", n))
    return [*default_ignore(fmt, tensors), *kept]


def write_fp8_moe_checkpoint(path: str | os.PathLike[str], fmt: str, *, layout: str = "fused", with_mtp: bool = True,
                             seed: int = 0, layer_types: list[str] | None = None,
                             tensor_scale_layers: str | None = None, **overrides: Any) -> str:
    """A tiny FP8 Qwen3.5-MoE checkpoint (``fmt``: ``ct_dynamic`` or ``block``; ``overrides`` to the MoE config)."""
    path = write_tiny_moe_checkpoint(path, layout=layout, with_mtp=with_mtp, seed=seed, layer_types=layer_types,
                                     dtype=torch.bfloat16, **overrides)
    return quantize_moe_checkpoint(path, fmt, tensor_scale_layers=tensor_scale_layers)


# An FP8 KV cache, and chunks small enough that the shared prefix spans several.
FP8_KV: dict[str, Any] = dict(kv_cache_dtype="fp8", max_num_batched_tokens=32)


def prefix_sharing_arrivals(params: Any) -> dict[int, list[tuple[str, list[int], Any]]]:
    """``drive``'s arrivals: a request of 53 tokens, and at step 3 one extending it by 12 (its prefix cached)."""
    a = random_prompts(1, [53], seed=1)[0]
    return {0: [("a", a, params)], 3: [("b", a + random_prompts(1, [12], seed=2)[0], params)]}


def assert_fp8_kv_features_compose(path: str, arrivals: dict[int, list[tuple[str, list[int], Any]]],
                                   plain: dict[str, Any], plant_drafts: Any, speculative_config: dict[str, Any]
                                   ) -> None:
    """With an FP8 KV cache (``FP8_KV``), prefix caching, MTP (``plant_drafts``, the tests' fixture, planting
    ``plain``'s outputs as drafts) and async scheduling, ``path`` gives the tokens of ``plain`` (the same arrivals
    driven with ``FP8_KV`` alone), accepting drafts and hitting the prefix cache, and leaks nothing."""
    llm = make_llm(path, enable_prefix_caching=True, speculative_config=speculative_config, async_scheduling=True,
                   recurrent_snapshot_interval=16, num_snapshot_slots=32, **FP8_KV)
    assert all(k.dtype == FP8 for k, _ in llm.llm_engine.runner.kv_caches_all)
    plant_drafts(llm.llm_engine, {rid: list(out.outputs[0].token_ids) for rid, out in plain.items()})
    got = drive(llm.llm_engine, arrivals)
    assert {r: o.outputs[0].token_ids for r, o in got.items()} == {r: o.outputs[0].token_ids for r, o in plain.items()}
    metrics = llm.get_metrics()
    accepted, hits = metrics["hyserve:spec_decode_num_accepted_tokens"], metrics["hyserve:prefix_cache_hits"]
    assert isinstance(accepted, float | int) and isinstance(hits, float | int) and accepted > 0 and hits > 0
    llm.llm_engine.assert_no_leaks()


def write_fp8_next_checkpoint(path: str | os.PathLike[str], fmt: str, *, layout: str = "per_expert",
                              with_mtp: bool = True, seed: int = 0, block: tuple[int, int] = BLOCK,
                              ba_in_fp8: bool = False, **overrides: Any) -> str:
    """A tiny FP8 Qwen3-Next checkpoint (``hyserve.testing.qwen3_next``: transformers' ``save_pretrained``, fused
    ``in_proj_qkvz`` / ``in_proj_ba``, one tensor per expert; ``layout="fused"`` stacks the experts as
    transformers holds them) quantized as ``quantize_moe_checkpoint`` does, ``in_proj_ba`` kept in bf16 as the
    release keeps it (``ba_in_fp8``: quantized too). Block FP8 in ``block`` tiles: the tiny heads (16 rows) need
    16-row blocks for the scales to follow the key-head groups' re-order."""
    from hyserve.testing.qwen3_next import write_tiny_next_checkpoint

    path = write_tiny_next_checkpoint(path, with_mtp=with_mtp, seed=seed, **overrides)
    tensors = {n: t.to(torch.bfloat16) if t.is_floating_point() else t
               for n, t in read_checkpoint_tensors(path).items()}
    if layout == "fused":
        tensors = stack_experts(tensors)
    elif layout != "per_expert":
        raise ValueError(f"layout: fused or per_expert (got {layout!r})")
    for name in os.listdir(path):
        if name.endswith((".safetensors", ".index.json")):
            os.remove(os.path.join(path, name))
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    return quantize_moe_checkpoint(path, fmt, block=block, quantize="in_proj_ba" if ba_in_fp8 else None)


def _quantize_stacked(w: torch.Tensor, fmt: str, block: tuple[int, int] = BLOCK
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked experts [E, N, K] -> (FP8 weights, scales [E, ceil(N / bn), ceil(K / bk)] or [E, N])."""
    qs, scales = [], []
    for we in w:
        if fmt == "block":
            s = block_scale(we, torch.float32, block)
            qs.append(quantize_weight(we, expand_block(s, we.shape, block)))
        else:
            s = per_row_scale(we, torch.float32)
            qs.append(quantize_weight(we, s))
            s = s.squeeze(-1)
        scales.append(s)
    return torch.stack(qs), torch.stack(scales)


def dequantize_stacked(tensors: dict[str, torch.Tensor], name: str, block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """The float32 stacked experts ``name`` (``...experts.gate_up_proj``) from their FP8 weights and scales."""
    w = tensors[name]
    if f"{name}_scale_inv" in tensors:
        return torch.stack([we.float() * expand_block(s, we.shape, block)
                            for we, s in zip(w, tensors[f"{name}_scale_inv"], strict=True)])
    scale = tensors[f"{name}_scale"].float()
    return w.float() * (scale.reshape(-1, 1, 1) if scale.dim() == 1 else scale.unsqueeze(-1))


def quantize_moe_checkpoint(path: str, fmt: str, *, tensor_scale_layers: str | None = None,
                            block: tuple[int, int] = BLOCK, quantize: str | None = None) -> str:
    """Quantize the MoE checkpoint in ``path`` in place (see the module docstring; ``block``: block FP8's size;
    ``quantize``: a name the ignore list's entries containing it are dropped for, e.g. ``in_proj_ba``)."""
    if fmt not in ("ct_dynamic", "block"):
        raise ValueError(f"MoE FP8 test checkpoints: fmt ct_dynamic or block (got {fmt!r})")
    ignore = [e for e in moe_ignore(fmt, read_checkpoint_tensors(path)) if quantize is None or quantize not in e]
    quantize_checkpoint(path, fmt, ignore=ignore, block=block)
    tensors = read_checkpoint_tensors(path)
    suffix = "_scale_inv" if fmt == "block" else "_scale"
    for name in [n for n in tensors if n.endswith(FUSED)]:
        tensors[name], tensors[name + suffix] = _quantize_stacked(tensors[name], fmt, block)
    config_path = os.path.join(path, "config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    if tensor_scale_layers is not None:
        assert fmt == "ct_dynamic"
        _per_tensor_scales(tensors, tensor_scale_layers)
        qc = config["quantization_config"]
        group = qc["config_groups"]["group_0"]
        qc["config_groups"] = {
            "group_0": {**group, "targets": [f"re:(?!.*{tensor_scale_layers})"]},
            "group_1": {**group, "targets": [f"re:.*{tensor_scale_layers}"],
                        "weights": {**group["weights"], "strategy": "tensor"}}}
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    return path


def _per_tensor_scales(tensors: dict[str, torch.Tensor], pattern: str) -> None:
    """Requantize the modules matching ``pattern`` with one scale per tensor (per expert for stacked experts)."""
    for name in [n for n in tensors if n.endswith(".weight_scale") and re.match(pattern, n)]:
        module = name.removesuffix(".weight_scale")
        w = dequantize(tensors, module)
        s = (w.abs().amax().clamp(min=1e-10) / FP8_MAX).reshape(1)
        tensors[f"{module}.weight"], tensors[name] = quantize_weight(w, s), s
    for name in [n for n in tensors if n.endswith(FUSED) and re.match(pattern, n)]:
        w = dequantize_stacked(tensors, name)
        s = w.abs().amax(dim=(1, 2)).clamp(min=1e-10) / FP8_MAX
        tensors[name], tensors[f"{name}_scale"] = quantize_weight(w, s.reshape(-1, 1, 1)), s


def _online_quantized(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A bf16 checkpoint's tensors as ``quantization="fp8"`` quantizes them (per output channel), in the
    compressed-tensors form: every linear layer but the LM head, router and shared-expert gate, and the experts."""
    out = dict(tensors)
    for name, t in tensors.items():
        if name.startswith("mtp."):
            continue
        if is_linear_weight(name, t) and not re.search(rf"{_KEPT}\.weight$", name):
            scale = per_row_scale(t, torch.float32)
            out[name], out[name.removesuffix(".weight") + ".weight_scale"] = quantize_weight(t, scale), scale
        elif name.endswith(FUSED):
            out[name], out[f"{name}_scale"] = _quantize_stacked(t, "ct_dynamic")
    return out


def _dequantized_moe_model(tensors: dict[str, torch.Tensor], raw: dict[str, Any],
                           block: tuple[int, int]) -> Qwen3_5MoeForCausalLM | Qwen3NextForCausalLM:
    use_torch_gated_delta_rules()
    text = raw.get("text_config", raw)
    fields = {k: v for k, v in text.items() if k not in ("architectures", "model_type", "quantization_config")}
    model: Qwen3_5MoeForCausalLM | Qwen3NextForCausalLM
    if raw.get("model_type") == "qwen3_next":
        model = Qwen3NextForCausalLM(Qwen3NextConfig(**fields)).float().eval()
    else:
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**fields)).float().eval()
    plain: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.startswith(("mtp.", "model.visual.")) or name.endswith(
                (".weight_scale", ".weight_scale_inv", "_proj_scale", "_proj_scale_inv")):
            continue
        if t.dtype != FP8:
            plain[name] = t.float()
        elif name.endswith(FUSED):
            plain[name] = dequantize_stacked(tensors, name, block)
        else:
            plain[name] = dequantize(tensors, name.removesuffix(".weight"), block)
    state = {"model." + n[len(VLM_TEXT):] if n.startswith(VLM_TEXT) else n: t for n, t in stack_experts(plain).items()}
    model.load_state_dict(state, strict=True)
    return model


def experts_forward(mode: str, down_mode: str, down_group: int, group: int) -> Any:
    """transformers' ``Qwen3_5MoeExperts.forward`` with each expert's inputs quantized to FP8 and back."""

    def forward(self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            token_idx, pos = torch.where(top_k_index == e)
            if token_idx.numel() == 0:
                continue
            x = fake_quantize(hidden_states[token_idx], mode, group=group)
            gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
            act = fake_quantize(self.act_fn(gate) * up, down_mode, group=down_group)
            y = F.linear(act, self.down_proj[e]) * top_k_weights[token_idx, pos, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out

    return forward


def load_fp8_moe_reference(path: str | os.PathLike[str], tensor_parallel_size: int = 1, online: bool = False,
                           expert_parallel: bool = False) -> Qwen3_5MoeForCausalLM | Qwen3NextForCausalLM:
    """The reference of FP8 MoE checkpoint ``path`` (or of bf16 ``path`` under online FP8). With tensor
    parallelism a rank quantizes its slice of a row-parallel input per token (``hyserve.testing.fp8.emulate``),
    the experts' ``down`` input included: per ``I / tensor_parallel_size`` group (block groups are unchanged; with
    ``expert_parallel`` a rank holds whole experts: per token)."""
    path = os.fspath(path)
    tensors = read_checkpoint_tensors(path)
    if online:
        tensors = _online_quantized(tensors)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    size = (raw.get("quantization_config") or {}).get("weight_block_size") or BLOCK
    block = (int(size[0]), int(size[1]))
    model = _dequantized_moe_model(tensors, raw, block)
    vlm = any(n.startswith(VLM_TEXT) for n in tensors)

    def ckpt(name: str) -> str:
        return VLM_TEXT + name[len("model."):] if vlm and name.startswith("model.") else name

    modes: dict[str, tuple[str, float | None]] = {}
    for name, m in model.named_modules():
        module = ckpt(name)
        if isinstance(m, torch.nn.Linear) and tensors.get(f"{module}.weight", torch.empty(0)).dtype == FP8:
            modes[name] = ("group" if f"{module}.weight_scale_inv" in tensors else "token", None)
        elif isinstance(m, (modeling_qwen3_5_moe.Qwen3_5MoeExperts, modeling_qwen3_next.Qwen3NextExperts)):
            fused = tensors.get(f"{module}.gate_up_proj")
            first = tensors.get(f"{module}.0.gate_proj.weight")
            weight = fused if fused is not None else first
            if weight is None or weight.dtype != FP8:
                continue
            blocked = f"{module}.gate_up_proj_scale_inv" in tensors or \
                f"{module}.0.gate_proj.weight_scale_inv" in tensors
            mode = "group" if blocked else "token"
            down_mode, group = mode, block[1]
            if not blocked and tensor_parallel_size > 1 and not expert_parallel:
                down_mode, group = "group", m.intermediate_dim // tensor_parallel_size
            forward = experts_forward(mode, down_mode, group, block[1])
            m.forward = types.MethodType(forward, m)  # type: ignore[method-assign]
    return emulate(model, modes, tensor_parallel_size, block[1])  # type: ignore[arg-type,return-value]

"""Tiny FP8 checkpoints for tests, written as real ones are, and transformers references that run them.

``write_fp8_checkpoint`` writes a tiny random Qwen3.5 checkpoint (``hyserve.testing.write_tiny_checkpoint``, either
form, optionally with an MTP head) and quantizes its linear layers' weights in one of these formats, with the
``quantization_config`` such checkpoints carry (docs/fp8_facts.md):

* ``ct_dynamic``: compressed-tensors FP8_DYNAMIC: weights per output channel (``weight_scale`` ``(out, 1)``),
  activations dynamic per token;
* ``ct_static``: compressed-tensors FP8: one ``weight_scale`` per tensor (parts of a merged projection get
  different ones), a static ``input_scale`` per layer from a calibration pass (layers reading the same input get
  the same scale, as calibration gives them);
* ``block``: Qwen's block FP8 (``quant_method: "fp8"``): ``weight_scale_inv`` per 128x128 block, ceil-shaped for
  dimensions 128 does not divide, activations dynamic per token and 128-group (``block``: other block sizes, for
  tiny models whose heads must be whole blocks; the reference reads ``weight_block_size`` back).

Quantized are the linear projections (attention, GDN, MLP, MTP head); never the embedding, ``lm_head``, norms,
conv, gates or the vision tower; and not the layers in the ignore list (compressed-tensors ``ignore``, exact names
and ``re:`` patterns; block FP8 ``modules_to_not_convert``, exact names), matched against the checkpoint's names.

``load_fp8_reference`` (and ``load_online_fp8_reference`` for a bf16 checkpoint under ``quantization="fp8"``) is
transformers' ``Qwen3_5ForCausalLM`` holding the dequantized weights, with the activation quantization emulated by
forward pre-hooks on its quantized ``nn.Linear`` layers: the engine's FP8 layers must match it. The arithmetic here
is written independently of ``hyserve.kernels.fp8`` (same formulas: ``s = max(amax, 1e-10) / 448``,
``q = fp8(clamp(x / s))``) so that a mistake there is not mirrored here.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from hyserve.testing.files import read_checkpoint_tensors
from hyserve.testing.qwen3_5 import use_torch_gated_delta_rule, write_tiny_checkpoint

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
EPS = 1e-10
BLOCK = (128, 128)
FORMATS = ("ct_dynamic", "ct_static", "block")
VLM_TEXT = "model.language_model."

# Compressed-tensors' QuantizationArgs as llm-compressor writes them (every field, nulls included).
_CT_ARGS: dict[str, Any] = {
    "actorder": None, "block_structure": None, "dynamic": False, "group_size": None, "num_bits": 8,
    "observer": "minmax", "observer_kwargs": {}, "scale_dtype": None, "strategy": "channel", "symmetric": True,
    "type": "float", "zp_dtype": None}


def default_ignore(fmt: str, tensors: dict[str, torch.Tensor]) -> list[str]:
    """What real checkpoints keep in bf16 among the linear layers: ``lm_head`` and the GDN ``in_proj_a`` /
    ``in_proj_b`` (Qwen3-Next's fused ``in_proj_ba``; Qwen's own FP8 releases, docs/fp8_facts.md section 7);
    compressed-tensors as ``re:`` entries,
    with the vision tower's (``re:.*visual.*``, as the llm-compressor recipes and the published Qwen3.5
    FP8-dynamic checkpoints write it: an engine that builds the tower with the checkpoint's quantization needs it),
    block FP8 as the exact per-layer names ``modules_to_not_convert`` holds."""
    if fmt.startswith("ct_"):
        ab = r"re:.*linear_attn\.in_proj_(a|b|ba)$" if any(".in_proj_ba." in n for n in tensors) \
            else r"re:.*linear_attn\.in_proj_[ab]$"
        return ["lm_head", ab, "re:.*visual.*"]
    names = sorted(n.removesuffix(".weight") for n in tensors
                   if re.search(r"linear_attn\.in_proj_(a|b|ba)\.weight$", n))
    return ["lm_head", *names]


def is_linear_weight(name: str, tensor: torch.Tensor) -> bool:
    """A linear projection's weight: 2-D, not the embedding, LM head or vision tower."""
    return (name.endswith(".weight") and tensor.dim() == 2 and "embed_tokens" not in name
            and name != "lm_head.weight" and not name.startswith(("model.visual.", "visual.")))


def _ignored(module: str, entries: list[str], regex: bool) -> bool:
    for e in entries:
        if regex and e.startswith("re:"):
            if re.match(e[3:], module):
                return True
        elif e == module:
            return True
    return False


def per_row_scale(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (w.float().abs().amax(dim=1, keepdim=True).clamp(min=EPS) / FP8_MAX).to(dtype)


def quantize_weight(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def block_scale(w: torch.Tensor, dtype: torch.dtype, block: tuple[int, int] = BLOCK) -> torch.Tensor:
    n, k = w.shape
    bn, bk = block
    gn, gk = -(-n // bn), -(-k // bk)
    padded = torch.zeros(gn * bn, gk * bk)
    padded[:n, :k] = w.float().abs()
    amax = padded.view(gn, bn, gk, bk).amax(dim=(1, 3))
    return (amax.clamp(min=EPS) / FP8_MAX).to(dtype)


def expand_block(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int] = BLOCK) -> torch.Tensor:
    n, k = shape
    return scale.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]


def dequantize(tensors: dict[str, torch.Tensor], module: str, block: tuple[int, int] = BLOCK) -> torch.Tensor:
    """The float32 weight of quantized ``module`` (checkpoint name) from its FP8 weight and stored scales."""
    w = tensors[f"{module}.weight"]
    if f"{module}.weight_scale_inv" in tensors:
        return w.float() * expand_block(tensors[f"{module}.weight_scale_inv"], w.shape, block)
    scale = tensors[f"{module}.weight_scale"].float()
    return w.float() * (scale.reshape(1, 1) if scale.numel() == 1 else scale)


# ------------------------------------------------------------------------------------------------ writing


def write_fp8_checkpoint(
    path: str | os.PathLike[str],
    fmt: str,
    *,
    form: str = "causal",
    with_mtp: bool = False,
    quantize_mtp: bool = True,
    ignore: list[str] | None = None,
    scale_dtype: torch.dtype = torch.float32,
    seed: int = 0,
    layer_types: list[str] | None = None,
    dtype: torch.dtype = torch.bfloat16,
    **config_overrides: Any,
) -> str:
    """Write a tiny FP8 checkpoint in ``fmt`` (see ``FORMATS``) and return its path.

    ``ignore``: the format's list (compressed-tensors ``ignore``, block FP8 ``modules_to_not_convert``) in the
    checkpoint's names; ``None`` gives ``default_ignore``. ``quantize_mtp`` False leaves the MTP head in bf16 (as a
    quantizer that never loaded it does). ``scale_dtype``: the stored scales' dtype; ``dtype`` that of the tensors
    left unquantized.
    """
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS} (got {fmt!r})")
    path = write_tiny_checkpoint(path, form=form, with_mtp=with_mtp, seed=seed, layer_types=layer_types,
                                 dtype=dtype, **config_overrides)
    return quantize_checkpoint(path, fmt, quantize_mtp=quantize_mtp, ignore=ignore, scale_dtype=scale_dtype)


def quantize_checkpoint(path: str | os.PathLike[str], fmt: str, *, quantize_mtp: bool = True,
                        ignore: list[str] | None = None, scale_dtype: torch.dtype = torch.float32,
                        block: tuple[int, int] = BLOCK) -> str:
    """Quantize the Qwen3.5 checkpoint in ``path`` in place into ``fmt`` (the arguments as ``write_fp8_checkpoint``'s);
    the benchmarks turn their bf16 checkpoints of the real shapes into FP8 ones with it (``ct_static`` calibrates on
    a transformers model of the checkpoint: tiny ones only)."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS} (got {fmt!r})")
    path = os.fspath(path)
    tensors = read_checkpoint_tensors(path)
    entries = default_ignore(fmt, tensors) if ignore is None else list(ignore)
    regex = fmt.startswith("ct_")
    quantized = [n.removesuffix(".weight") for n, t in tensors.items() if is_linear_weight(n, t)
                 and not _ignored(n.removesuffix(".weight"), entries, regex)
                 and (quantize_mtp or not n.startswith("mtp."))]
    for module in quantized:
        w = tensors[f"{module}.weight"]
        if fmt == "block":
            scale = block_scale(w, scale_dtype, block)
            tensors[f"{module}.weight"] = quantize_weight(w, expand_block(scale, w.shape, block))
            tensors[f"{module}.weight_scale_inv"] = scale
        else:
            scale = per_row_scale(w, scale_dtype) if fmt == "ct_dynamic" else \
                (w.float().abs().amax().clamp(min=EPS) / FP8_MAX).reshape(1).to(scale_dtype)
            tensors[f"{module}.weight"] = quantize_weight(w, scale)
            tensors[f"{module}.weight_scale"] = scale
    if fmt == "ct_static":
        tensors.update(_calibrated_input_scales(path, tensors, quantized, scale_dtype))
    for name in os.listdir(path):
        if name.endswith((".safetensors", ".index.json")):
            os.remove(os.path.join(path, name))
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    config_path = os.path.join(path, "config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config(fmt, entries, block)
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    return path


def quantization_config(fmt: str, ignore: list[str], block: tuple[int, int] = BLOCK) -> dict[str, Any]:
    """The ``quantization_config`` of a checkpoint in ``fmt``, with the fields its producers write."""
    if fmt == "block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(block), "modules_to_not_convert": list(ignore)}
    static = fmt == "ct_static"
    weights = {**_CT_ARGS, "strategy": "tensor" if static else "channel"}
    acts = {**_CT_ARGS, "strategy": "tensor" if static else "token", "dynamic": not static,
            "observer": "static_minmax" if static else None}
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                      "output_activations": None, "format": "float-quantized"}},
        "ignore": list(ignore), "kv_cache_scheme": None, "global_compression_ratio": None, "sparsity_config": {},
        "transform_config": {}, "version": "0.12.2",
    }


def _calibrated_input_scales(path: str, tensors: dict[str, torch.Tensor], quantized: list[str],
                             scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Static ``input_scale`` per quantized layer: the amax of its input over a calibration pass of the dequantized
    model, / 448. The MTP head (which transformers does not run) takes the largest amax of the text model's."""
    model = _dequantized_model(path, tensors)
    amax: dict[str, float] = {}

    def record(name: str) -> Callable[..., None]:
        def hook(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            amax[name] = max(amax.get(name, 0.0), float(args[0].abs().max()))
        return hook

    handles = [m.register_forward_pre_hook(record(checkpoint_module(path, name)))
               for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 440, (2, 48), generator=gen), use_cache=False)
    for h in handles:
        h.remove()
    top = max(amax.values())
    return {f"{m}.input_scale": torch.tensor([amax.get(m, top) / FP8_MAX]).to(scale_dtype) for m in quantized}


# ------------------------------------------------------------------------------------------------ references


def assert_close_to_fp8_reference(ref: Any, runs: list[tuple[list[int], Any]], mean_tol: float, max_tol: float,
                                  margin: float, min_clear: int = 0) -> None:
    """Engine outputs ``runs`` ((prompt, request output) pairs, log-probs returned) against FP8 reference ``ref``:
    every returned log-prob within ``max_tol`` and on average ``mean_tol``; the chosen token the reference's argmax
    wherever its top two logits are more than ``margin`` apart (at least ``min_clear`` such positions)."""
    from hyserve.testing import reference_logits

    diffs: list[float] = []
    clear = 0
    for prompt, out in runs:
        toks = out.outputs[0].token_ids
        logits = reference_logits(ref, prompt + toks)
        logp = torch.log_softmax(logits.double(), dim=-1)
        for i, tok in enumerate(toks):
            row = logits[len(prompt) - 1 + i]
            top = row.topk(2).values
            if float(top[0] - top[1]) > margin:
                clear += 1
                assert tok == int(row.argmax()), f"token {i}: {tok}, reference argmax {int(row.argmax())} " \
                                                 f"(margin {float(top[0] - top[1]):.2f})"
            lps = out.outputs[0].logprobs
            assert lps is not None
            diffs += [abs(lp.logprob - float(logp[len(prompt) - 1 + i, t])) for t, lp in lps[i].items()]
    d = torch.tensor(diffs)
    assert clear >= min_clear, f"only {clear} clear-margin positions: the comparison would see little"
    assert float(d.mean()) <= mean_tol and float(d.max()) <= max_tol, \
        f"log-prob differences: mean {float(d.mean()):.2e} (<= {mean_tol}), max {float(d.max()):.2e} (<= {max_tol})"


def load_engine_model(model_cls: Callable[..., torch.nn.Module], path: str, device: str = "cpu",
                      dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """hyserve's ``model_cls`` of checkpoint ``path`` built on ``device`` in ``dtype`` (FP8 layers keep theirs),
    loaded, eval mode: for layer-by-layer comparisons of devices."""
    from hyserve.model.loader import load_weights
    from hyserve.model.registry import load_model_config

    cfg = load_model_config(path)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_cls(cfg).eval()
    finally:
        torch.set_default_dtype(prev)
    load_weights(model, path, cfg)
    return model


def checkpoint_module(path: str, model_name: str) -> str:
    """transformers' (``Qwen3_5ForCausalLM``) module name -> the checkpoint's in ``path``'s form."""
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        vlm = json.load(f).get("model_type") == "qwen3_5"
    if vlm and model_name.startswith("model."):
        return VLM_TEXT + model_name[len("model."):]
    return model_name


def _dequantized_model(path: str, tensors: dict[str, torch.Tensor]) -> Qwen3_5ForCausalLM:
    """transformers' model of ``path`` holding ``tensors``, FP8 weights dequantized, float32."""
    use_torch_gated_delta_rule()
    config = Qwen3_5TextConfig.from_pretrained(path)
    config.quantization_config = None
    model = Qwen3_5ForCausalLM(config).float().eval()
    state: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.startswith(("mtp.", "model.visual.", "visual.")) or name.endswith(
                (".weight_scale", ".weight_scale_inv", ".input_scale")):
            continue
        model_name = "model." + name[len(VLM_TEXT):] if name.startswith(VLM_TEXT) else name
        state[model_name] = dequantize(tensors, name.removesuffix(".weight")) if t.dtype == FP8 else t.float()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= ({"lm_head.weight"} if config.tie_word_embeddings else set()), missing
    return model


def fake_quantize(x: torch.Tensor, mode: str, input_scale: float | None = None, group: int = BLOCK[1]
                  ) -> torch.Tensor:
    """``x`` quantized to FP8 and back (float32 math, ``x.dtype`` out): ``token`` (one scale per row of the last
    dimension), ``group`` (per row and ``group``-wide slice), ``static`` (``input_scale``)."""
    xf = x.float()
    if mode == "static":
        assert input_scale is not None
        s = torch.tensor(input_scale)
        return ((xf / s).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * s).to(x.dtype)
    if mode == "token":
        s = xf.abs().amax(dim=-1, keepdim=True).clamp(min=EPS) / FP8_MAX
        return ((xf / s).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * s).to(x.dtype)
    assert mode == "group"
    k, g = x.shape[-1], group
    pad = (-k) % g
    xp = torch.nn.functional.pad(xf, (0, pad)).unflatten(-1, (-1, g))
    s = xp.abs().amax(dim=-1, keepdim=True).clamp(min=EPS) / FP8_MAX
    out = ((xp / s).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * s).flatten(-2)[..., :k]
    return out.to(x.dtype)


ROW_PARALLEL = ("o_proj", "out_proj", "down_proj")


def emulate(model: Qwen3_5ForCausalLM, modes: dict[str, tuple[str, float | None]],
             tensor_parallel_size: int, block_k: int = BLOCK[1]) -> Qwen3_5ForCausalLM:
    """Forward pre-hooks quantizing the input of each ``nn.Linear`` named in ``modes`` (model-side names). With
    tensor parallelism a row-parallel layer's ranks each hold a slice of the input and quantize it per token on their
    own (as vLLM does): per token and ``in / tensor_parallel_size`` group here. Block groups (``block_k``, 128) are
    unchanged: shards are whole groups."""
    def hook_for(mode: str, scale: float | None, group: int) -> Callable[..., tuple[torch.Tensor, ...]]:
        def hook(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
            return (fake_quantize(args[0], mode, scale, group), *args[1:])
        return hook

    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name in modes:
            mode, scale = modes[name]
            group = block_k
            if mode == "token" and tensor_parallel_size > 1 and name.rsplit(".", 1)[-1] in ROW_PARALLEL:
                mode, group = "group", m.in_features // tensor_parallel_size
            m.register_forward_pre_hook(hook_for(mode, scale, group))
    return model


def load_fp8_reference(path: str | os.PathLike[str], tensor_parallel_size: int = 1) -> Qwen3_5ForCausalLM:
    """The reference for FP8 checkpoint ``path``: dequantized weights, activations quantized as its format says
    on every layer whose checkpoint weight is FP8 (for ``tensor_parallel_size`` ranks: see ``emulate``)."""
    path = os.fspath(path)
    tensors = read_checkpoint_tensors(path)
    model = _dequantized_model(path, tensors)
    modes: dict[str, tuple[str, float | None]] = {}
    for name, m in model.named_modules():
        module = checkpoint_module(path, name)
        if not isinstance(m, torch.nn.Linear) or tensors.get(f"{module}.weight", torch.empty(0)).dtype != FP8:
            continue
        if f"{module}.weight_scale_inv" in tensors:
            modes[name] = ("group", None)
        elif f"{module}.input_scale" in tensors:
            modes[name] = ("static", float(tensors[f"{module}.input_scale"].float()))
        else:
            modes[name] = ("token", None)
    return emulate(model, modes, tensor_parallel_size)


def load_online_fp8_reference(path: str | os.PathLike[str], tensor_parallel_size: int = 1) -> Qwen3_5ForCausalLM:
    """The reference for bf16 checkpoint ``path`` under ``quantization="fp8"``: every linear layer but ``lm_head``
    with its weight quantized per output channel and dequantized, activations quantized per token."""
    path = os.fspath(path)
    tensors = read_checkpoint_tensors(path)
    for name, t in list(tensors.items()):
        if is_linear_weight(name, t) and not name.startswith("mtp."):
            scale = per_row_scale(t, torch.float32)
            tensors[name] = quantize_weight(t, scale)
            tensors[name.removesuffix(".weight") + ".weight_scale"] = scale
    model = _dequantized_model(path, tensors)
    modes: dict[str, tuple[str, float | None]] = {
        name: ("token", None) for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name != "lm_head"}
    return emulate(model, modes, tensor_parallel_size)

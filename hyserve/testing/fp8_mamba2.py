"""Tiny FP8 checkpoints of the Mamba2 families (Nemotron-H, Granite-4.0-H, Falcon-H1) for tests, written as
compressed-tensors releases are, and the transformers reference that runs them (the Mamba2 side of
``hyserve.testing.fp8``).

``write_fp8_mamba2_checkpoint`` writes a family's tiny float32 checkpoint (``hyserve.testing.nemotron_h``,
``granitemoehybrid``, ``falcon_h1``) and quantizes in place what llm-compressor quantizes with ``targets:
["Linear"]``: every ``nn.Linear`` of transformers' model (the Mamba2 ``in_proj`` / ``out_proj``, the attention and
MLP projections, Nemotron-H's per-expert ``experts.{e}.up_proj`` / ``down_proj`` and shared experts, Granite's
shared MLP, and Granite's fused experts ``block_sparse_moe.input_linear`` / ``output_linear`` [E, N, K], which the
llm-compressor Granite-4 recipe quantizes as linear layers and saves with a ``weight_scale`` [E, N, 1]), except the
modules the ``ignore`` list names (exact names and ``re:`` patterns, matched as compressed-tensors does). Never
quantized, as in transformers they are not ``nn.Linear``: the embedding, norms, the Mamba2 conv, Nemotron-H's router
(``mixer.gate``). The unquantized tensors stay float32.

Formats: ``ct_dynamic`` (FP8_DYNAMIC: ``weight_scale`` per output channel, activations per token),
``ct_block`` (FP8_BLOCK: ``weight_scale`` per ``block`` tile, activations per token and ``block[1]``-group; the tiny
models take 16 x 16 blocks, so each expert's rows are whole blocks) and ``modelopt`` (NVIDIA ModelOpt FP8:
``quant_method: "modelopt"``, ``quant_algo: "FP8"``, a scalar ``weight_scale`` per tensor and a static scalar
``input_scale`` per layer, calibrated as ModelOpt does on the float model: the amax of the layer's input over a
calibration batch / 448; Nemotron-H's per-expert ``experts.{e}.up_proj`` / ``down_proj`` each get their own, from
the tokens routed to that expert (an expert no calibration token chose takes the amax of all the layer's tokens);
``ignore`` is then the ``exclude_modules`` list, ``fnmatch`` wildcards, default ``MODELOPT_EXCLUDE``;
``kv_scales`` adds the attention layers' ``k_proj.k_scale`` / ``v_proj.v_scale`` and ``kv_cache_quant_algo:
"FP8"``; ``hf_quant_config`` writes the config as older ModelOpt checkpoints do, in
``hf_quant_config.json``).

``RELEASE_IGNORE``: each family's ``ignore`` list as the published recipes write them (docs/fp8_facts.md section
11). ``load_fp8_mamba2_reference``: the family's transformers model of a dequantized copy of the checkpoint
(float32, CPU), each quantized layer's input quantized to FP8 and back (forward pre-hooks; for the stacked experts
a forward that quantizes each expert's input and its activation before ``down``: per token, or, with static input
scales, Nemotron-H's experts with the maximum over the layer's experts of the ``up_proj`` / ``down_proj`` input
scales, as vLLM's ModelOpt FP8 MoE does).
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import types
from collections.abc import Callable
from typing import Any

import torch
from safetensors.torch import save_file
from torch.nn import functional as F

from hyserve.testing.files import read_checkpoint_tensors
from hyserve.testing.fp8 import (
    EPS,
    FP8,
    FP8_MAX,
    block_scale,
    emulate,
    expand_block,
    fake_quantize,
    per_row_scale,
    quantization_config,
    quantize_weight,
)

NEMOTRON_H, GRANITE_H, FALCON_H1 = "nemotron_h", "granitemoehybrid", "falcon_h1"
FAMILIES = (NEMOTRON_H, GRANITE_H, FALCON_H1)
FORMATS = ("ct_dynamic", "ct_block", "modelopt")
TINY_BLOCK = (16, 16)

RELEASE_IGNORE: dict[str, list[str]] = {
    # llm-compressor's Nemotron example (examples/quantization_w8a8_fp8/nemotron_3_5_lightning_example.py): the conv,
    # embedding, MoE latent projections, router, final norm and LM head (the router as an exact-suffix regex here).
    NEMOTRON_H: [r"re:.*conv1d.*", "backbone.embeddings", r"re:.*_latent_proj.*", r"re:.*mixer\.gate$",
                 "backbone.norm_f", "lm_head"],
    # llm-compressor's Granite-4 example (granite4_example.py): the LM head and the MoE router.
    GRANITE_H: ["re:.*lm_head", "re:.*block_sparse_moe.router"],
    # No published recipe found: the LM head, as llm-compressor's default examples.
    FALCON_H1: ["lm_head"],
}
# ModelOpt's kind of list for Nemotron-H: the head and the conv (not linear anyway); the MoE experts are FP8 with
# static input scales, as in NVIDIA's Nemotron 3 FP8 releases.
MODELOPT_EXCLUDE = ["lm_head", "*mixer.conv1d*"]
_FUSED_EXPERTS = re.compile(r".*\.block_sparse_moe\.(input|output)_linear\.weight$")


def _writer(family: str) -> Callable[..., str]:
    if family == NEMOTRON_H:
        from hyserve.testing.nemotron_h import write_tiny_nemotron_h_checkpoint
        return write_tiny_nemotron_h_checkpoint
    if family == GRANITE_H:
        from hyserve.testing.granitemoehybrid import write_tiny_granitemoehybrid_checkpoint
        return write_tiny_granitemoehybrid_checkpoint
    if family == FALCON_H1:
        from hyserve.testing.falcon_h1 import write_tiny_falcon_h1_checkpoint
        return write_tiny_falcon_h1_checkpoint
    raise ValueError(f"family must be one of {FAMILIES} (got {family!r})")


def _reference_loader(family: str) -> Callable[[str], torch.nn.Module]:
    if family == NEMOTRON_H:
        from hyserve.testing.nemotron_h import load_nemotron_h_reference
        return load_nemotron_h_reference
    if family == GRANITE_H:
        from hyserve.testing.granitemoehybrid import load_granitemoehybrid_reference
        return load_granitemoehybrid_reference
    from hyserve.testing.falcon_h1 import load_falcon_h1_reference
    return load_falcon_h1_reference


def is_quantizable(name: str, tensor: torch.Tensor) -> bool:
    """The weight of one of transformers' ``nn.Linear`` layers in these families (Granite's fused experts too)."""
    if not name.endswith(".weight") or ".layers." not in name:
        return False
    if _FUSED_EXPERTS.match(name):
        return tensor.dim() == 3
    return tensor.dim() == 2 and not name.endswith(".mixer.gate.weight")


def ignored(module: str, entries: list[str]) -> bool:
    """compressed-tensors' match of an ``ignore`` list: ``re:`` entries by ``re.match``, others exactly."""
    return any(re.match(e[3:], module) if e.startswith("re:") else e == module for e in entries)


def excluded(module: str, entries: list[str]) -> bool:
    """ModelOpt's match of ``exclude_modules``: ``fnmatch`` wildcards over the whole name (or a parent module's)."""
    return any(fnmatch.fnmatchcase(module, e) or module.startswith(e + ".") for e in entries)


def _quantize(w: torch.Tensor, fmt: str, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D weight -> (FP8 weight, scale: [N, 1] per channel, a scalar per tensor, or block scales)."""
    if fmt == "modelopt":
        scale = (w.float().abs().amax().clamp(min=EPS) / FP8_MAX).reshape(())
        return quantize_weight(w, scale), scale
    if fmt == "ct_dynamic":
        scale = per_row_scale(w, torch.float32)
        return quantize_weight(w, scale), scale
    scale = block_scale(w, torch.float32, block)
    return quantize_weight(w, expand_block(scale, w.shape, block)), scale


def write_fp8_mamba2_checkpoint(path: str | os.PathLike[str], family: str, fmt: str = "ct_dynamic", *,
                                ignore: list[str] | None = None, block: tuple[int, int] = TINY_BLOCK,
                                seed: int = 0, kv_scales: bool = False, hf_quant_config: bool = False,
                                **writer_kwargs: Any) -> str:
    """Write ``family``'s tiny checkpoint (``writer_kwargs``: its writer's, e.g. ``layer_types``) quantized in
    ``fmt`` with ``ignore`` (``None``: ``RELEASE_IGNORE``, or ``MODELOPT_EXCLUDE`` for ``modelopt``) and return its
    path (``kv_scales``, ``hf_quant_config``: ``modelopt`` only, see the module docstring)."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS} (got {fmt!r})")
    modelopt = fmt == "modelopt"
    if (kv_scales or hf_quant_config) and not modelopt:
        raise ValueError("kv_scales and hf_quant_config are for fmt='modelopt'")
    path = _writer(family)(path, seed=seed, **writer_kwargs)
    entries = list((MODELOPT_EXCLUDE if modelopt else RELEASE_IGNORE[family]) if ignore is None else ignore)
    skip = excluded if modelopt else ignored
    tensors = read_checkpoint_tensors(path)
    quantized = [n for n, t in tensors.items() if is_quantizable(n, t) and not skip(n.removesuffix(".weight"), entries)]
    if modelopt:
        tensors.update(_calibrate(path, family, [n.removesuffix(".weight") for n in quantized], kv_scales))
    for name in quantized:
        module = name.removesuffix(".weight")
        w = tensors[name]
        if w.dim() == 3:  # fused experts, one expert at a time; scales [E, N, 1] (or [E, N / bn, K / bk])
            if modelopt:
                raise ValueError(f"{module}: fused experts are not written in the modelopt format; exclude them")
            pieces = [_quantize(we, fmt, block) for we in w]
            tensors[name] = torch.stack([q for q, _ in pieces])
            tensors[f"{module}.weight_scale"] = torch.stack([s for _, s in pieces])
        else:
            tensors[name], tensors[f"{module}.weight_scale"] = _quantize(w, fmt, block)
    for file in os.listdir(path):
        if file.endswith((".safetensors", ".index.json")):
            os.remove(os.path.join(path, file))
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    config_path = os.path.join(path, "config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    if modelopt:
        fields = {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8" if kv_scales else None,
                  "exclude_modules": entries}
        producer = {"name": "modelopt", "version": "0.37.0"}
        if hf_quant_config:
            with open(os.path.join(path, "hf_quant_config.json"), "w", encoding="utf-8") as f:
                json.dump({"producer": producer, "quantization": fields}, f, indent=2)
            return path
        config["quantization_config"] = {"quant_method": "modelopt", **fields, "producer": producer}
        with open(config_path, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
            f.write("\n")
        return path
    qc = quantization_config("ct_dynamic", entries)
    if fmt == "ct_block":
        group = qc["config_groups"]["group_0"]
        group["weights"].update(strategy="block", block_structure=list(block))
        group["input_activations"].update(strategy="group", group_size=block[1])
    config["quantization_config"] = qc
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    return path


def _checkpoint_namer(tensors: dict[str, torch.Tensor]) -> Callable[[str], str]:
    """transformers' module name -> the checkpoint's (Nemotron-H's ``backbone.`` for transformers' ``model.``)."""
    backbone = any(n.startswith("backbone.") for n in tensors)

    def ckpt(name: str) -> str:
        return "backbone." + name[len("model."):] if backbone and name.startswith("model.") else name

    return ckpt


def _calibrate(path: str, family: str, modules: list[str], kv_scales: bool) -> dict[str, torch.Tensor]:
    """Static scales as ModelOpt's calibration gives them, from a batch through transformers' float model of
    ``path``: each of ``modules``' ``input_scale`` (the amax of its input / 448; layers reading one input get one
    scale), and with ``kv_scales`` every attention layer's ``k_proj.k_scale`` / ``v_proj.v_scale`` (the amax of
    its output / 448)."""
    model = _reference_loader(family)(path)
    ckpt = _checkpoint_namer(read_checkpoint_tensors(path))
    amax: dict[str, float] = {}

    def record(name: str, output: bool) -> Callable[..., None]:
        def hook(_m: torch.nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            x = out if output else args[0]
            amax[name] = max(amax.get(name, 0.0), float(x.detach().abs().max()))
        return hook

    def record_experts(prefix: str) -> Callable[..., None]:
        def hook(m: Any, args: tuple[torch.Tensor, ...], _out: torch.Tensor) -> None:
            x, top_k_index = args[0].detach(), args[1]
            for e in range(m.up_proj.shape[0]):
                tok = (top_k_index == e).any(-1)
                xe = x[tok] if bool(tok.any()) else x
                act = m.act_fn(F.linear(xe, m.up_proj[e].detach()))
                for proj, v in (("up_proj", xe), ("down_proj", act)):
                    key = f"{prefix}.{e}.{proj}"
                    amax[key] = max(amax.get(key, 0.0), float(v.abs().max()))
        return hook

    handles = []
    for name, m in model.named_modules():
        if isinstance(getattr(m, "up_proj", None), torch.nn.Parameter) and not hasattr(m, "gate_up_proj"):
            handles.append(m.register_forward_hook(record_experts(ckpt(name))))  # Nemotron-H's stacked experts
        if isinstance(m, torch.nn.Linear):
            handles.append(m.register_forward_hook(record(ckpt(name), False)))
            if kv_scales and name.endswith(("k_proj", "v_proj")):
                handles.append(m.register_forward_hook(record(ckpt(name) + ":out", True)))
    gen = torch.Generator().manual_seed(1234)
    vocab = int(model.config.vocab_size)  # type: ignore[union-attr, arg-type]
    with torch.no_grad():
        model(input_ids=torch.randint(0, vocab, (2, 40), generator=gen), use_cache=False)
    for h in handles:
        h.remove()
    out = {f"{m}.input_scale": torch.tensor(amax[m] / FP8_MAX) for m in modules if m in amax}
    missing = [m for m in modules if m not in amax]
    assert not missing, missing
    if kv_scales:
        for key, value in amax.items():
            if key.endswith(":out"):
                module = key.removesuffix(":out")
                out[f"{module}.{module.rsplit('.', 1)[1][0]}_scale"] = torch.tensor(max(value, EPS) / FP8_MAX)
    return out


def dequantize_weight(tensors: dict[str, torch.Tensor], module: str, block: tuple[int, int] | None = None
                      ) -> torch.Tensor:
    """The float32 weight of quantized ``module`` (2-D, or Granite's fused [E, N, K]) from its FP8 weight and
    ``weight_scale`` (per channel [.., N, 1]; with ``block``, block scales)."""
    w, s = tensors[f"{module}.weight"], tensors[f"{module}.weight_scale"].float()
    if block is None:
        return w.float() * s
    if w.dim() == 3:
        return torch.stack([we.float() * expand_block(se, we.shape, block) for we, se in zip(w, s, strict=True)])
    return w.float() * expand_block(s, w.shape, block)


def _block_of(config: dict[str, Any]) -> tuple[int, int] | None:
    if "config_groups" not in config.get("quantization_config", {}):  # modelopt
        return None
    weights = config["quantization_config"]["config_groups"]["group_0"]["weights"]
    block = weights.get("block_structure")
    return None if block is None else (int(block[0]), int(block[1]))


def _experts_forward(gated: bool, mode: str, group: int,
                     statics: tuple[float, float] | None = None) -> Callable[..., torch.Tensor]:
    """transformers' experts' forward (Nemotron-H's ungated ``up`` / ``down``, Granite's ``gate_up`` / ``down``)
    with each expert's input and its activation before ``down`` quantized to FP8 and back: as ``mode`` says, or
    with ``statics`` (the static scales of the input and of the activation, the same for every expert)."""
    s_in, s_act = statics if statics is not None else (None, None)
    mode = "static" if statics is not None else mode

    def forward(self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(hidden_states.shape, dtype=torch.float32)
        for e in range(self.num_experts):
            token_idx, pos = torch.where(top_k_index == e)
            if token_idx.numel() == 0:
                continue
            x = fake_quantize(hidden_states[token_idx], mode, s_in, group=group)
            if gated:
                gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
                act = self.act_fn(gate) * up
            else:
                act = self.act_fn(F.linear(x, self.up_proj[e]))
            y = F.linear(fake_quantize(act, mode, s_act, group=group), self.down_proj[e])
            out.index_add_(0, token_idx, (y * top_k_weights[token_idx, pos, None]).float())
        return out.to(hidden_states.dtype)

    return forward


def load_fp8_mamba2_reference(path: str | os.PathLike[str], family: str) -> torch.nn.Module:
    """transformers' model of FP8 checkpoint ``path`` (``family``) holding the dequantized weights, with the
    activations of every FP8 layer quantized as its scheme says (per token, per token and block-column group, or
    with its static ``input_scale``)."""
    path = os.fspath(path)
    tensors = read_checkpoint_tensors(path)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    block = _block_of(config)
    mode, group = ("token", 0) if block is None else ("group", block[1])
    plain = {n: (dequantize_weight(tensors, n.removesuffix(".weight"), block) if t.dtype == FP8 else t.float())
             for n, t in tensors.items() if not n.endswith((".weight_scale", ".input_scale", ".k_scale", ".v_scale"))}
    ref_dir = path.rstrip("/") + ".dequantized"
    shutil.rmtree(ref_dir, ignore_errors=True)
    shutil.copytree(path, ref_dir, ignore=shutil.ignore_patterns("*.safetensors", "hf_quant_config.json"))
    save_file({k: v.contiguous() for k, v in plain.items()}, os.path.join(ref_dir, "model.safetensors"),
              metadata={"format": "pt"})
    config.pop("quantization_config", None)
    with open(os.path.join(ref_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    model = _reference_loader(family)(ref_dir)
    ckpt = _checkpoint_namer(tensors)
    modes: dict[str, tuple[str, float | None]] = {}
    for name, m in model.named_modules():
        module = ckpt(name)
        if isinstance(m, torch.nn.Linear):
            if f"{module}.input_scale" in tensors:  # static (modelopt)
                modes[name] = ("static", float(tensors[f"{module}.input_scale"]))
            elif tensors.get(f"{module}.weight", torch.empty(0)).dtype == FP8:
                modes[name] = (mode, None)
        elif hasattr(m, "down_proj") and isinstance(m.down_proj, torch.nn.Parameter):  # stacked experts
            gated = hasattr(m, "gate_up_proj")
            first = f"{module.rsplit('.', 1)[0]}.input_linear.weight" if gated else f"{module}.0.up_proj.weight"
            if tensors[first].dtype == FP8:
                statics = None
                if f"{first.removesuffix('.weight')}.input_scale" in tensors:  # ModelOpt: the max over the experts
                    assert not gated, "static Granite experts: not written"
                    statics = tuple(max(float(tensors[f"{module}.{e}.{proj}.input_scale"])
                                        for e in range(m.up_proj.shape[0])) for proj in ("up_proj", "down_proj"))
                m.forward = types.MethodType(_experts_forward(gated, mode, group, statics),  # type: ignore[arg-type]
                                             m)  # type: ignore[method-assign]
    emulate(model, modes, 1, group or TINY_BLOCK[1])  # type: ignore[arg-type]
    return model


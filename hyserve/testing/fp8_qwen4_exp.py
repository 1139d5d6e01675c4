"""Tiny FP8 Qwen4-Exp checkpoints for tests, and transformers 5.24's reference on their dequantized weights (the
Qwen4-Exp side of ``hyserve.testing.fp8`` / ``hyserve.testing.fp8_moe``).

``quantize_qwen4_exp_checkpoint`` quantizes a tiny float32 Qwen4-Exp checkpoint (``hyserve.testing.qwen4_exp``: the
release layout, one tensor per expert and projection) in place, in ``block`` (Qwen's block FP8, ``weight_scale_inv``
per ``block`` tile, ``modules_to_not_convert`` by exact name) or ``ct_dynamic`` (compressed-tensors FP8_DYNAMIC,
``weight_scale`` per output channel, ``ignore`` as ``re:`` entries), with the formulas of ``hyserve.testing.fp8``.
Quantized: every 2-D linear weight (GDN, attention, the QSA indexer's ``index_qk_proj``, the routed experts, the
shared expert, the PLE ``key_proj`` / ``value_proj``, the hyper-connection linears) except what the ignore list keeps
(``qwen4_exp_ignore``: the LM head, the GDN ``in_proj_a`` / ``in_proj_b``, the routers and ``shared_expert_gate`` as
the released FP8 checkpoints keep them; and, unless ``quantize_hyper_connections``, the hyper-connection linears).
Never the embedding, norms, convs or the n-gram tables (``nn.Embedding``: no quantizer converts them).

``load_fp8_qwen4_exp_reference`` writes a dequantized copy of the checkpoint (float32 weights, no scales, no
``quantization_config``) and loads it in transformers 5.24's ``Qwen4ExpForCausalLM`` in a process of its own (this
module run with ``-m``: ``hyserve.testing.qwen4_exp_reference``'s server, whose ``load`` also emulates the activation
quantization): each linear layer whose checkpoint weight is FP8 quantizes its input to FP8 and back (per token, or
per token and ``block[1]``-wide group for block FP8) in a forward pre-hook, and each MoE layer's experts their
``gate_up`` and ``down`` inputs (``hyserve.testing.fp8_moe``'s experts forward). The modes travel in
``fp8_activations.json`` beside the dequantized weights.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import types
from typing import Any

import torch
from safetensors.torch import save_file

from hyserve.testing.files import read_checkpoint_tensors
from hyserve.testing.fp8 import (
    BLOCK,
    FP8,
    block_scale,
    default_ignore,
    dequantize,
    expand_block,
    per_row_scale,
    quantization_config,
    quantize_weight,
)
from hyserve.testing.qwen4_exp import Qwen4ExpReference

MODULE = "hyserve.testing.fp8_qwen4_exp"
ACTIVATIONS_FILE = "fp8_activations.json"
FORMATS = ("block", "ct_dynamic")
_KEPT = r"(mlp\.gate|shared_expert_gate)"
_HC = r"(attn_hyper_connection|mlp_hyper_connection|hyper_connection_mixer)\.(input_mix_weight_down|" \
      r"input_mix_weight_up|block_inject_weight)"
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.\d+\.(gate|up|down)_proj\.weight$")


def is_quantizable(name: str, tensor: torch.Tensor) -> bool:
    """A linear projection's weight: 2-D ``.weight``, not the embedding, LM head, n-gram tables or vision tower."""
    return (name.endswith(".weight") and tensor.dim() == 2 and "embed_tokens" not in name
            and "ngram_embedding" not in name and name != "lm_head.weight" and ".visual." not in name
            and not name.startswith(("visual.", "mtp.")))


def qwen4_exp_ignore(fmt: str, tensors: dict[str, torch.Tensor], quantize_hyper_connections: bool = False
                     ) -> list[str]:
    """The ignore list (compressed-tensors ``ignore``, ``re:`` entries; block FP8 ``modules_to_not_convert``, exact
    names) the released FP8 checkpoints carry: the LM head, the GDN ``in_proj_a`` / ``in_proj_b``, the routers and
    shared-expert gates; and the hyper-connection linears unless ``quantize_hyper_connections``."""
    hc = [] if quantize_hyper_connections else [rf"re:.*{_HC}$"]
    if fmt.startswith("ct_"):
        return [*default_ignore(fmt, tensors), r"re:.*mlp\.gate$", r"re:.*shared_expert_gate$", *hc]
    kept = _KEPT if quantize_hyper_connections else rf"({_KEPT}|{_HC})"
    names = sorted(n.removesuffix(".weight") for n in tensors if re.search(rf"{kept}\.weight$", n))
    return [*default_ignore(fmt, tensors), *names]


def _ignored(module: str, entries: list[str]) -> bool:
    return any(re.match(e[3:], module) if e.startswith("re:") else e == module for e in entries)


def quantize_qwen4_exp_checkpoint(path: str | os.PathLike[str], fmt: str, *, block: tuple[int, int] = BLOCK,
                                  quantize_hyper_connections: bool = False) -> list[str]:
    """Quantize the Qwen4-Exp checkpoint in ``path`` in place (see the module docstring); returns the quantized
    modules (checkpoint names)."""
    if fmt not in FORMATS:
        raise ValueError(f"Qwen4-Exp FP8 test checkpoints: fmt one of {FORMATS} (got {fmt!r})")
    path = os.fspath(path)
    tensors = read_checkpoint_tensors(path)
    entries = qwen4_exp_ignore(fmt, tensors, quantize_hyper_connections)
    quantized = sorted(n.removesuffix(".weight") for n, t in tensors.items()
                       if is_quantizable(n, t) and not _ignored(n.removesuffix(".weight"), entries))
    for module in quantized:
        w = tensors[f"{module}.weight"]
        if fmt == "block":
            scale = block_scale(w, torch.float32, block)
            tensors[f"{module}.weight"] = quantize_weight(w, expand_block(scale, w.shape, block))
            tensors[f"{module}.weight_scale_inv"] = scale
        else:
            scale = per_row_scale(w, torch.float32)
            tensors[f"{module}.weight"] = quantize_weight(w, scale)
            tensors[f"{module}.weight_scale"] = scale
    _write_tensors(path, tensors)
    _edit_config(path, lambda raw: raw.__setitem__("quantization_config", quantization_config(fmt, entries, block)))
    return quantized


def _write_tensors(path: str, tensors: dict[str, torch.Tensor]) -> None:
    for name in os.listdir(path):
        if name.endswith((".safetensors", ".index.json")):
            os.remove(os.path.join(path, name))
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})


def _edit_config(path: str, edit: Any) -> None:
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path, encoding="utf-8") as f:
        raw = json.load(f)
    edit(raw)
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(raw, f, indent=2)
        f.write("\n")


def write_dequantized_copy(path: str | os.PathLike[str], out: str | os.PathLike[str]) -> dict[str, list[Any]]:
    """``out``: the FP8 checkpoint ``path`` with every FP8 weight dequantized to float32, no scales and no
    ``quantization_config``, and ``fp8_activations.json``: ``{module: [mode, group]}`` for the reference's
    emulation (transformers' module names: a linear layer, or ``...mlp.experts`` for the stacked experts). Returns
    that mapping."""
    path, out = os.fspath(path), os.fspath(out)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    size = (raw.get("quantization_config") or {}).get("weight_block_size") or BLOCK
    block = (int(size[0]), int(size[1]))
    tensors = read_checkpoint_tensors(path)
    plain: dict[str, torch.Tensor] = {}
    modes: dict[str, list[Any]] = {}
    for name, t in tensors.items():
        if name.endswith((".weight_scale", ".weight_scale_inv", ".input_scale")):
            continue
        if t.dtype != FP8:
            plain[name] = t
            continue
        module = name.removesuffix(".weight")
        plain[name] = dequantize(tensors, module, block)
        mode = ["group", block[1]] if f"{module}.weight_scale_inv" in tensors else ["token", block[1]]
        expert = _EXPERT.match(name)
        modes[expert.group(1) if expert else module] = mode
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(path, out)
    _write_tensors(out, plain)
    _edit_config(out, lambda r: r.pop("quantization_config", None))
    with open(os.path.join(out, ACTIVATIONS_FILE), "w", encoding="utf-8") as f:
        json.dump(modes, f, indent=2, sort_keys=True)
    return modes


class Fp8Qwen4ExpReference(Qwen4ExpReference):
    """transformers 5.24's model of a dequantized copy (``write_dequantized_copy``) with the activation quantization
    emulated, in the session's process running this module (``shared_process(MODULE)``). ``emulated``:
    ``{module: mode}`` as the process installed them."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path, module=MODULE)
        self.emulated: dict[str, str] = self.info.get("fp8_emulated", {})


def load_fp8_qwen4_exp_reference(path: str | os.PathLike[str], dequantized: str | os.PathLike[str] | None = None
                                 ) -> Fp8Qwen4ExpReference:
    """The reference of FP8 checkpoint ``path``: its dequantized copy (written to ``dequantized``, default
    ``{path}-dequantized``) in transformers 5.24, activations quantized as the checkpoint's format says."""
    out = os.fspath(dequantized) if dequantized is not None else os.fspath(path).rstrip(os.sep) + "-dequantized"
    write_dequantized_copy(path, out)
    return Fp8Qwen4ExpReference(out)


# ------------------------------------------------------------------------------------------------ reference process


def _emulate(model: Any, path: str) -> dict[str, str]:
    """Install the activation quantization of ``path``'s ``fp8_activations.json`` on transformers' ``model``."""
    from hyserve.testing.fp8 import fake_quantize
    from hyserve.testing.fp8_moe import experts_forward

    file = os.path.join(path, ACTIVATIONS_FILE)
    if not os.path.exists(file):
        return {}
    with open(file, encoding="utf-8") as f:
        wanted: dict[str, list[Any]] = json.load(f)
    done: dict[str, str] = {}

    def hook_for(mode: str, group: int) -> Any:
        def hook(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
            return (fake_quantize(args[0], mode, None, group), *args[1:])
        return hook

    for ckpt, m in model.named_modules():  # transformers' names are the checkpoint's (either form)
        if ckpt not in wanted:
            continue
        mode, group = wanted[ckpt][0], int(wanted[ckpt][1])
        if isinstance(m, torch.nn.Linear):
            m.register_forward_pre_hook(hook_for(mode, group))
        elif hasattr(m, "gate_up_proj") and hasattr(m, "down_proj"):
            m.forward = types.MethodType(experts_forward(mode, mode, group, group), m)
        else:
            raise ValueError(f"{ckpt}: FP8 in the checkpoint, but transformers' module is a {type(m).__name__}")
        done[ckpt] = mode
    missing = sorted(set(wanted) - set(done))
    if missing:
        raise ValueError(f"no transformers module for the FP8 modules {missing[:4]}")
    return done


def main() -> None:
    from hyserve.testing import qwen4_exp_reference as server

    load = server.Reference.__init__

    def init(self: Any, path: str, attn_implementation: str = "eager") -> None:
        load(self, path, attn_implementation)
        self.info["fp8_emulated"] = _emulate(self.model, path)

    server.Reference.__init__ = init  # type: ignore[method-assign]
    server.main()


if __name__ == "__main__":
    main()

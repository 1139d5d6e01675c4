"""transformers 5.24's Qwen4-Exp as a reference, run in a subprocess: ``python -m hyserve.testing.qwen4_exp_reference``.

The main venv pins transformers 5.17, which has no ``qwen4_exp``; this module runs where transformers 5.24 comes first
on ``PYTHONPATH`` (``.venv/reference/transformers-5.24``, installed by scripts/setup.sh). It imports nothing of
hyserve, and transformers only inside the functions that need it, so the main venv may import its constants
(``hyserve.testing.qwen4_exp`` drives it).

Protocol: one JSON object per line on stdin, one JSON reply per line on stdout (``{"ok": true, ...}`` or
``{"ok": false, "error": "..."}``); tensors travel through ``.pt`` files whose paths the request names. Commands:

* ``write`` ``{path, form: causal|vlm, seed, text: {...}, vlm: {...}, attention_name}``: build the tiny config
  (``tiny_text_kwargs(**text)``; for ``vlm`` a ``Qwen4ExpConfig`` with a tiny vision tower and the ``vlm`` fields),
  create the model, give every parameter spread random values from a generator seeded with ``seed``
  (``init_tensor``), and ``save_pretrained`` it in float32: transformers' reverse conversions give the release layout
  (one tensor per expert and projection, the n-gram table in ``split_ngram_parts`` row shards
  ``ple.ple_embedding.ngram_embedding.shard_{i}.weight``). transformers writes ``indexed_attention`` into
  config.json's ``layer_types``; ``attention_name`` (default ``full_attention``, as the release) renames it.
* ``load`` ``{path, attn_implementation, model?}``: ``from_pretrained`` (the class of config.json's
  ``architectures``), float32, CPU, eval, transformers' PyTorch GDN and conv paths (never fla's), kept under the
  name ``model`` (default: ``path``) beside the models loaded before (one process serves every reference of a test
  session: transformers imports once). Replies with the loading info and the text config.
* ``unload`` ``{model}``: forget a loaded model.

``logits``, ``generate_cached`` and ``ngram_rows`` run on the model their ``model`` field names (default: the one
loaded last).
* ``logits`` ``{ids: [[...]], out, attention_mask?, images?}``: one uncached forward; float32 logits ``(B, T, V)``
  saved to ``out``. ``images`` (the VLM): a ``.pt`` of ``{pixel_values, image_grid_thw}`` for the placeholders of
  ``ids`` (already widened to each image's grid).
* ``generate_cached`` ``{ids: [...], prefill, out}``: the first ``prefill`` tokens in one cached forward, the rest one
  token at a time with the cache; the float32 logits of every position ``(T, V)`` saved to ``out``.
* ``ngram_rows`` ``{ids: [...], out, prefill?}``: the n-gram table rows each PLE layer looks up per token, ``{layer
  index: LongTensor (T, heads)}`` saved to ``out``; uncached, or with ``prefill`` cached as ``generate_cached``.
* ``quit``.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import sys
import traceback
from typing import Any

import torch

# The tiny tokenizer (hyserve.testing.tokenizer) has 451 ids, <|endoftext|> 448: the vocab covers it, the PLE
# restart token is it. hyserve.testing.qwen4_exp passes the tokenizer's ids explicitly and checks the size.
TINY_VOCAB = 512
TINY_EOS = 448
DEFAULT_LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
# The tiny VLM's vision tower (Qwen3.5's, hyserve.testing.qwen3_5_vlm.TINY_VLM_VISION); out_hidden_size = hidden_size.
TINY_VISION = {"depth": 2, "hidden_size": 32, "hidden_act": "gelu_pytorch_tanh", "intermediate_size": 64,
               "num_heads": 2, "in_channels": 3, "patch_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 2,
               "num_position_embeddings": 16}


def tiny_text_kwargs(**overrides: Any) -> dict[str, Any]:
    """The tiny ``Qwen4ExpTextConfig``'s fields; ``overrides`` replace any (``layer_types``, ``ple_layer_ids``, ...).

    Qwen3.5's tiny sizes (hidden 64, 4/2 heads of 16, GDN 2x16 keys and 4x16 values, partial rotary 0.5 with an
    interleaved M-RoPE section), 4 experts top-2 and a shared expert, 4 residual streams of rank 8, PLE on layer 2
    (1-indexed) with 2 hash heads per n-gram order and 1000-row tables in 4 shards, QSA with budget 8 in blocks of 4.
    """
    types = list(overrides.pop("layer_types", None) or DEFAULT_LAYER_TYPES)
    kwargs: dict[str, Any] = {
        "vocab_size": TINY_VOCAB,
        "hidden_size": 64,
        "num_hidden_layers": len(types),
        "layer_types": types,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_num_value_heads": 4,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "hc_count": 4,
        "hc_lowrank": 8,
        "ple_layer_ids": [2],
        "ple_embed_dim": 32,
        "ple_conv_kernel_size": 4,
        "ngram_size": 3,
        "heads_per_ngram": 2,
        "ngram_vocab_size_base": 1000,
        "make_ngram_vocab_size_divisible_by": 128,
        "split_ngram_parts": 4,
        "seed": 1234,
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 8,
        "indexer_compress_ratio": 4,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                            "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        "tie_word_embeddings": False,
        "eos_token_id": TINY_EOS,
        "bos_token_id": None,
        "pad_token_id": None,
    }
    kwargs.update(overrides)
    return kwargs


def init_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Spread random values for parameter ``name`` (in-memory name) that keep activations O(1) and logits several
    units apart (transformers' init: std 0.02, zero norms and a zero PLE conv, gives nearly flat logits and leaves
    paths untested)."""
    if ".visual." in name or name.startswith("visual."):
        if name.endswith("pos_embed.weight"):
            return torch.randn(shape, generator=gen) * 0.5
        if len(shape) == 1:
            base = 1.0 if name.split(".")[-2].startswith("norm") and name.endswith("weight") else 0.0
            return base + torch.randn(shape, generator=gen) * 0.1
        fan_in = math.prod(shape[1:])
        return torch.randn(shape, generator=gen) / math.sqrt(fan_in)
    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(0.5, 8.0, generator=gen).log_()
    if name.endswith("dt_bias"):
        return torch.randn(shape, generator=gen) * 0.5
    if name.endswith("linear_attn.norm.weight"):  # gated RMSNorm: plain ``w * x``
        return torch.empty(shape).uniform_(0.5, 1.5, generator=gen)
    if len(shape) == 1:  # zero-centred RMSNorms: ``(1 + w) * x`` (hc, PLE, q/k and indexer norms)
        return torch.empty(shape).uniform_(-0.5, 0.5, generator=gen)
    if name.endswith("conv1d.weight"):  # the GDN conv and the PLE conv (zero in transformers' init)
        return torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
    if name.endswith(("embed_tokens.weight", "ngram_embedding.weight")):
        return torch.randn(shape, generator=gen)
    if name == "lm_head.weight":
        return torch.randn(shape, generator=gen) * (4.0 / math.sqrt(shape[1]))
    if name.endswith("experts.gate_up_proj"):
        return torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
    if name.endswith("experts.down_proj"):
        return torch.randn(shape, generator=gen) * (0.5 / math.sqrt(shape[-1]))
    if name.endswith("mlp.gate.weight"):  # router: spread logits, so the top k are clear
        return torch.randn(shape, generator=gen) * (2.0 / math.sqrt(shape[-1]))
    scale = 0.5 if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")) else 1.0
    return torch.randn(shape, generator=gen) * (scale / math.sqrt(shape[1]))


def build_config(form: str, text: dict[str, Any], vlm: dict[str, Any]) -> Any:
    from transformers import Qwen4ExpConfig, Qwen4ExpTextConfig

    text_config = Qwen4ExpTextConfig(**tiny_text_kwargs(**text))
    if form == "causal":
        return text_config
    if form != "vlm":
        raise ValueError(f"form must be 'causal' or 'vlm' (got {form!r})")
    vlm = dict(vlm)
    vision = {**TINY_VISION, **vlm.pop("vision_config", {}), "out_hidden_size": text_config.hidden_size}
    return Qwen4ExpConfig(text_config=text_config.to_dict(), vision_config=vision,
                          tie_word_embeddings=bool(text_config.tie_word_embeddings), **vlm)


def use_torch_kernels() -> None:
    """transformers' own PyTorch GDN rule and causal convs even where fla / causal_conv1d are importable."""
    from transformers.models.qwen4_exp import modeling_qwen4_exp as m

    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                 "causal_conv1d_update"):
        setattr(m, name, inspect.unwrap(getattr(m, name)))


def write(req: dict[str, Any]) -> dict[str, Any]:
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpForConditionalGeneration

    form = req.get("form", "causal")
    config = build_config(form, req.get("text") or {}, req.get("vlm") or {})
    seed = int(req.get("seed", 0))
    cls = Qwen4ExpForCausalLM if form == "causal" else Qwen4ExpForConditionalGeneration
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # transformers' own init (overwritten below) draws from the global RNG
        model = cls(config).float()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(init_tensor(name, tuple(p.shape), gen))
    path = req["path"]
    model.save_pretrained(path)
    attention_name = req.get("attention_name", "full_attention")
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path, encoding="utf-8") as f:
        raw = json.load(f)
    text = raw.get("text_config", raw)
    text["layer_types"] = [attention_name if t == "indexed_attention" else t for t in text["layer_types"]]
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(raw, f, indent=2)
        f.write("\n")
    return {"path": path}


class Reference:
    """The loaded model and what the commands run on it."""

    def __init__(self, path: str, attn_implementation: str = "eager") -> None:
        from transformers import Qwen4ExpForCausalLM, Qwen4ExpForConditionalGeneration

        use_torch_kernels()
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            arch = (json.load(f).get("architectures") or ["Qwen4ExpForCausalLM"])[0]
        cls = Qwen4ExpForConditionalGeneration if arch == "Qwen4ExpForConditionalGeneration" else Qwen4ExpForCausalLM
        loaded: Any = cls.from_pretrained(path, dtype=torch.float32, attn_implementation=attn_implementation,
                                          local_files_only=True, output_loading_info=True)
        model, info = loaded
        self.model = model.eval()
        text = model.config.get_text_config()
        self.info = {"architecture": cls.__name__,
                     "loading_info": {k: sorted(map(str, v)) for k, v in info.items()},
                     "text_config": json.loads(text.to_json_string(use_diff=False))}

    def _forward(self, ids: torch.Tensor, **kw: Any) -> Any:
        return self.model(input_ids=ids, **kw)

    @torch.no_grad()
    def logits(self, req: dict[str, Any]) -> dict[str, Any]:
        ids = torch.tensor(req["ids"], dtype=torch.long)
        kw: dict[str, Any] = {"use_cache": False}
        if req.get("attention_mask") is not None:
            kw["attention_mask"] = torch.tensor(req["attention_mask"], dtype=torch.long)
        if req.get("images") is not None:  # the VLM: pixel values and grids; transformers makes the M-RoPE positions
            images = torch.load(req["images"], weights_only=True)
            kw.update(pixel_values=images["pixel_values"].float(), image_grid_thw=images["image_grid_thw"],
                      mm_token_type_ids=(ids == self.model.config.image_token_id).int())
            self.model.model.rope_deltas = None  # an earlier forward's must not shift these positions
        out = self._forward(ids, **kw).logits.float()
        torch.save(out.contiguous(), req["out"])
        return {"out": req["out"], "shape": list(out.shape)}

    def _cached_steps(self, ids: list[int], prefill: int) -> list[torch.Tensor]:
        from transformers import DynamicCache

        if not 1 <= prefill <= len(ids):
            raise ValueError(f"prefill {prefill} must be in [1, {len(ids)}]")
        cache = DynamicCache(config=self.model.config)
        chunks = [ids[:prefill]] + [[t] for t in ids[prefill:]]
        outs = []
        for chunk in chunks:
            out = self._forward(torch.tensor([chunk], dtype=torch.long), cache=cache, use_cache=True)
            outs.append(out.logits[0].float())
        return outs

    @torch.no_grad()
    def generate_cached(self, req: dict[str, Any]) -> dict[str, Any]:
        logits = torch.cat(self._cached_steps(list(req["ids"]), int(req["prefill"])))
        torch.save(logits.contiguous(), req["out"])
        return {"out": req["out"], "shape": list(logits.shape)}

    @torch.no_grad()
    def ngram_rows(self, req: dict[str, Any]) -> dict[str, Any]:
        rows: dict[int, list[torch.Tensor]] = {}
        hooks = []
        for name, module in self.model.named_modules():
            if name.endswith("ple.ple_embedding.ngram_embedding"):
                layer = int(name.split(".layers.")[1].split(".")[0])

                def hook(_m: Any, args: tuple[torch.Tensor, ...], _out: Any, layer: int = layer) -> None:
                    rows.setdefault(layer, []).append(args[0][0].clone())

                hooks.append(module.register_forward_hook(hook))
        try:
            ids = list(req["ids"])
            if req.get("prefill") is None:
                self._forward(torch.tensor([ids], dtype=torch.long), use_cache=False)
            else:
                self._cached_steps(ids, int(req["prefill"]))
        finally:
            for h in hooks:
                h.remove()
        out = {layer: torch.cat(parts) for layer, parts in rows.items()}
        torch.save(out, req["out"])
        return {"out": req["out"], "layers": sorted(out)}


def serve(inp: Any, out: Any) -> None:
    refs: dict[str, Reference] = {}
    last: str | None = None
    for line in inp:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            cmd = req.get("cmd")
            if cmd == "quit":
                out.write(json.dumps({"ok": True}) + "\n")
                out.flush()
                return
            reply: dict[str, Any]
            if cmd == "ping":
                import transformers

                reply = {"transformers": transformers.__version__, "torch": torch.__version__}
            elif cmd == "write":
                reply = write(req)
            elif cmd == "load":
                name = str(req.get("model") or req["path"])
                refs[name] = Reference(req["path"], req.get("attn_implementation", "eager"))
                last = name
                reply = {**refs[name].info, "model": name}
            elif cmd == "unload":
                refs.pop(str(req["model"]), None)
                reply = {}
            elif cmd in ("logits", "generate_cached", "ngram_rows"):
                wanted: str | None = req.get("model") or last
                if wanted is None or wanted not in refs:
                    raise RuntimeError(f"{cmd!r} before 'load'" if wanted is None else f"no model {wanted!r} loaded")
                reply = getattr(refs[wanted], cmd)(req)
            else:
                raise ValueError(f"unknown command {cmd!r}")
            msg = {"ok": True, **reply}
        except Exception:  # reported to the caller, which raises it
            msg = {"ok": False, "error": traceback.format_exc()}
        out.write(json.dumps(msg) + "\n")
        out.flush()


def main() -> None:
    # Replies go to the original stdout; anything else printed (by transformers or torch, Python or C) to stderr.
    proto = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sys.stdout = sys.stderr
    if os.environ.get("HYSERVE_REFERENCE_THREADS"):
        torch.set_num_threads(int(os.environ["HYSERVE_REFERENCE_THREADS"]))
    serve(sys.stdin, proto)


if __name__ == "__main__":
    main()

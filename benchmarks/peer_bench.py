"""hyserve against vLLM on the same machine, checkpoint and prompts: the measures of issue 14 in one script.

Three subcommands, so that each engine runs in a process of its own (one after the other on one GPU):

    python benchmarks/peer_bench.py write --shape 2b --out /tmp/p2b            # VLM form, real head dims, MTP layer
    python benchmarks/peer_bench.py write --shape 2b --vision real --out /tmp/p2bv   # + a real-size vision tower
    python benchmarks/peer_bench.py measure --engine hyserve --model /tmp/p2b --out $OUT/hyserve_2b.json
    PYTHONPATH=/tmp/vsite python benchmarks/peer_bench.py measure --engine vllm --model /tmp/p2b \\
        --out $OUT/vllm_2b.json                                                 # ../shared/peer/README.md
    python benchmarks/peer_bench.py report $OUT/*.json --out benchmarks/results/h200   # peer.json, peer.md, peer.png

``write`` builds transformers' ``Qwen3_5ForConditionalGeneration`` (text model of the shape, a one-block vision
tower, as vLLM wants the VLM form with its preprocessor files) with random bf16 weights and one random MTP layer.
``--vision real`` gives it a real-size Qwen3.5 vision tower (``VISIONS["real"]``) and what image input needs beside
it: a preprocessor_config.json matching the tower (Qwen3.5's pixel bounds), a video_preprocessor_config.json, and a
tokenizer (tokenizer.json, tokenizer_config.json with a ChatML chat template that renders image parts) whose special
tokens sit at the ids config.json names (Qwen3.5's: ``<|endoftext|>`` 248044 ... ``<|image_pad|>`` 248056): vLLM's
Qwen3-VL processor finds the image placeholder through the tokenizer, so image requests need one.
``measure`` runs, through the engine's own ``LLM`` and ``SamplingParams``:

- ``start``: seconds to build the ``LLM`` in a process of its own, run after a first one (compile caches warm;
  the first process records its own start as ``first_start_s``);
- ``decode``: tokens/s at each ``--batches`` size, prompts of 512 random ids, greedy, ``ignore_eos``, as
  ``batch * (N - 1) / (t(N) - t(1))`` with fresh prompts for each timing (no prefix-cache hit);
- ``bound``: the batch-1 weights-bandwidth bound measured in the same process: the device's copy bandwidth
  (read + write) over the bytes of weights a decode step reads (every text-model tensor and the LM head, not the
  input embedding table unless it is the tied LM head; of a MoE layer's routed experts only the top-k a token
  reads, ``step_bytes``: attention, GDN, router, shared expert and k experts per layer; with ``--load-format
  dummy``, on a ``write --no-weights`` or ``shapes.py --config-only``
  model whose weights both engines make at load, counted from config.json);
- ``prefill``: 32 fresh prompts of 2048 tokens, one output token, after a warm-up of the same shape;
- ``agent``: (``agent_mtp_*`` with ``--speculative-config``) a closed-loop agent trace (8 conversations x 4
  turns sharing a 1.7k-token prefix, every turn's prompt the previous turn's prompt + its actual output + a new
  message) with prefix caching on: wall seconds and the share of prompt tokens served from the cache
  (``RequestOutput.num_cached_tokens``);
- ``agent_images``: the seed's GUI-agent trace with screenshots (``SCREENSHOT_TRACES``; a ``--vision real``
  checkpoint, or any with a tokenizer holding the vision tokens): ``--agent-concurrency`` conversations (8, or 32)
  x 4 turns, all in flight, sharing a 1.7k-token system prefix; each turn's prompt is the conversation so far (the
  earlier messages and the actual outputs) + a new user message of random ids + its screenshot, rendered with the
  checkpoint's chat template, and carries the last 2 screenshots (1280x720 random-noise PNGs, one per conversation
  and step; the older ones' placeholders replaced by a short text), prefix caching on. Figures: wall seconds of the
  generate calls, share of prompt tokens (placeholders expanded) from the cache overall and per turn, output
  tokens/s, and TTFT mean / p50 / p90 from each turn's submission, read from ``RequestOutput.metrics`` (hyserve:
  ``first_token_time``; vLLM: ``arrival_time + first_token_latency``, kept only with ``disable_log_stats=False``,
  which this measure passes); ``notes`` names the source;
- ``spec``: decode tokens/s with ``--speculative-config`` against the same run without it (a trained head:
  the packaged model), at each ``--spec-batches`` size.
- ``profile``: where a decode step's device time goes at each ``--profile-batches`` size, by each engine's own
  profiler (hyserve's worker runs in this process, vLLM's in its engine core's, which writes a trace per
  ``start_profile`` / ``stop_profile``): two profiled runs on fresh prompts, ``1 + --profile-skip`` tokens each and
  ``--profile-steps`` more, their difference per step by kernel and by family (``kernel_families.py``), under
  ``profiles`` in the file (``plot_step_families.py`` draws them).

A measure that fails is recorded under ``errors`` (the file keeps the others; the exit status is 1).
``report`` merges each engine's files of one model, pairs hyserve's and vLLM's and writes one entry per measure
with both figures and the ratio, the card, versions and the git commit. ``moe-report`` does the same for issue 31's
MoE shapes in one table (``MOE_FIGURES``), taking hyserve's planted MTP runs from ``spec_decode_bench.py``'s
``spec_decode.json`` beside the measure files; ``synthetic-mtp`` prints vLLM's speculative config that accepts MTP
drafts at the rate ``spec_decode_bench.py`` plants (``synthetic_mtp_config``).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from shapes import VISION_27B  # benchmarks/ is on the path (above)

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                 linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                 linear_conv_kernel_dim=4, partial_rotary_factor=0.25, tie_word_embeddings=True,
                 max_position_embeddings=8192),
}


def _shape(name: str) -> dict[str, Any]:
    if name == "2b":
        from shapes import SHAPE_2B

        return dict(SHAPE_2B)
    if name == "27b":  # Qwen3.5-27B's text shape (shapes.py SHAPE_27B: its sources)
        from shapes import SHAPE_27B

        return dict(SHAPE_27B)
    if name == "9b":  # Qwen3.5-9B's text shape: 32 layers (8 gated attention), untied LM head
        return dict(vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                    num_attention_heads=16, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                    linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                    linear_conv_kernel_dim=4, partial_rotary_factor=0.25, tie_word_embeddings=False,
                    max_position_embeddings=32768)
    return dict(SHAPES[name])


# ---------------------------------------------------------------------------------------------------------- write


# The vision towers ``write`` can give the checkpoint (``out_hidden_size`` is always the text hidden size, as in every
# published Qwen3.5 config).
# - toy: one block, what vLLM needs to load the VLM form for text-only runs.
# - real: a real-size Qwen3.5 tower. Qwen3.5-2B's own vision_config is not confirmed (docs/vlm_facts.md section 4,
#   "Not confirmed: vision_config of the small releases"), so depth 24, hidden 1024, intermediate 4096 and 16 heads
#   are the sizes issue 16's task gives (331M parameters; not checked against a published checkpoint; the 27B class
#   has depth 27, hidden 1152, intermediate 4304). patch 16, temporal patch 2, spatial merge 2,
#   num_position_embeddings 2304, in_channels 3, gelu_pytorch_tanh and no deepstack are the published Qwen3.6-27B
#   vision_config (vlm_facts section 4, same qwen3_5 model type); transformers 5.17's Qwen3_5VisionConfig defaults
#   give the same values for every one of these.
VISIONS: dict[str, dict[str, Any]] = {
    "toy": dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2),
    "real": dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, patch_size=16, temporal_patch_size=2,
                 spatial_merge_size=2, num_position_embeddings=2304, in_channels=3, hidden_act="gelu_pytorch_tanh"),
}
# The 27B class's tower (shapes.py VISION_27B: depth 27, hidden 1152, intermediate 4304, 16 heads; the Qwen3.6-27B
# release's vision_config): what the seed's 27B model carries.
VISIONS["27b"] = dict(VISION_27B)
# A one-block tower of the real towers' patching (16 x 16 patches, 2 x 2 merge): a screenshot takes as many tokens as
# on the 27B (880 for 1280 x 720) at a cost the CPU runs (seed_bench.py's cache replay on the tiny text shape).
VISIONS["tiny16"] = dict(VISIONS["real"], depth=1, hidden_size=32, intermediate_size=64, num_heads=2)
# Pixel-area bounds of the real tower's preprocessor_config.json: Qwen/Qwen3.5-2B-Base's, verbatim in
# docs/vlm_facts.md section 4 (``size``: shortest_edge 65536 = 256^2, longest_edge 16777216 = 4096^2; areas, not
# edges), and those of its video_preprocessor_config.json (the Qwen3.6-27B report there).
QWEN35_IMAGE_PIXELS = (65536, 16777216)
QWEN35_VIDEO_PIXELS = (4096, 25165824)
# Qwen3.5's special tokens from <|endoftext|> on, in id order: 248044-248046 and the vision tokens 248053-248057 as
# docs/vlm_facts.md section 4 lists them (equal to Qwen3_5Config's defaults); the six between in Qwen2/Qwen3's order.
QWEN35_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                   "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                   "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
QWEN35_FIRST_SPECIAL = 248044
VISION_TOKEN_KEYS = {"vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>",
                     "image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>"}


def special_token_ids(vocab_size: int) -> dict[str, int]:
    """Where the written tokenizer puts ``QWEN35_SPECIALS``: Qwen3.5's ids where the vocabulary holds them, else the
    vocabulary's top ids (a shrunken test shape)."""
    n = len(QWEN35_SPECIALS)
    first = QWEN35_FIRST_SPECIAL if vocab_size >= QWEN35_FIRST_SPECIAL + n else vocab_size - n
    return {t: first + i for i, t in enumerate(QWEN35_SPECIALS)}


# The seed's checkpoint is compressed-tensors FP8_DYNAMIC (W8A8: FP8 weights with one scale per output channel,
# activations quantized per token at run time). What it keeps out of FP8 (docs/fp8_facts.md sections 5 and 7; the
# release's own ignore list is not known): the LM head; the GDN's small projections in_proj_a / in_proj_b (Qwen's
# FP8 releases keep them in bf16; vLLM registers Qwen3.5's in_proj_b as ``in_proj_ba``, hence the three names); the
# vision tower (``re:.*visual.*``, as the llm-compressor recipes and the published Qwen3.5 FP8-dynamic checkpoints
# write it); the MTP layer (``re:.*mtp\..*``: a quantizer that loads transformers' model never sees it, so a head
# added to a quantized checkpoint stays bf16; hyserve's dummy load makes it bf16, and this entry makes vLLM's
# ``mtp.*`` layers bf16 too). Not known: whether the release keeps the whole GDN block (``re:.*linear_attn.*``, the
# llm-compressor FP8_DYNAMIC recipes for Qwen3.5-MoE and Qwen3-Next) in bf16 instead of the two small projections.
SEED_FP8_IGNORE = ["lm_head", r"re:.*linear_attn\.in_proj_(a|b|ba)$", "re:.*visual.*", r"re:.*mtp\..*"]


def write(shape_name: str, out: str, device: str, seed: int = 0, vision: str = "toy", weights: bool = True,
          fp8: str | None = None) -> None:
    """The checkpoint of ``shape_name`` with ``vision``'s tower and an MTP layer; ``weights=False``: its files
    without weights (config.json, and the processor files and tokenizer of a non-toy tower), enough for
    ``cache-bound`` and ``--load-format dummy``. ``fp8="ct_dynamic"``: in the seed's compressed-tensors
    FP8_DYNAMIC form (``SEED_FP8_IGNORE`` kept in bf16): the weights written are quantized, and config.json carries
    the ``quantization_config`` either way (a dummy load then makes FP8 weights)."""
    if fp8 not in (None, "ct_dynamic"):
        raise ValueError(f"fp8 must be None or 'ct_dynamic' (got {fp8!r})")
    _write_bf16(shape_name, out, device, seed, vision, weights)
    if fp8 is None:
        return
    from hyserve.testing.fp8 import quantization_config, quantize_checkpoint

    if weights:
        quantize_checkpoint(out, fp8, ignore=list(SEED_FP8_IGNORE))
    else:
        path = os.path.join(out, "config.json")
        cfg = read_json(path)
        cfg["quantization_config"] = quantization_config(fp8, list(SEED_FP8_IGNORE))
        write_json(path, cfg)
    print(f"  in compressed-tensors FP8_DYNAMIC, kept in bf16: {SEED_FP8_IGNORE}")


def _write_bf16(shape_name: str, out: str, device: str, seed: int, vision: str, weights: bool) -> None:
    import torch
    from shapes import add_random_mtp
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig

    shape = _shape(shape_name)
    text = Qwen3_5TextConfig(**shape, layer_types=None)
    tower = dict(VISIONS[vision], out_hidden_size=shape["hidden_size"])
    extra: dict[str, int] = {}
    if vision != "toy":  # the vision token ids of the tokenizer written below (the toy form keeps the defaults)
        ids = special_token_ids(shape["vocab_size"])
        extra = {key: ids[token] for key, token in VISION_TOKEN_KEYS.items()}
    cfg = Qwen3_5Config(text_config=text.to_dict(), vision_config=tower,
                        tie_word_embeddings=shape["tie_word_embeddings"], **extra)
    if not weights:  # the MTP layer the weighted form carries (``--load-format dummy`` makes its weights too)
        cfg.text_config.mtp_num_hidden_layers = 1
        # the class, as a saved model writes it: without it vLLM takes the config for a pooling ``Qwen3_5Model``
        cfg.architectures = ["Qwen3_5ForConditionalGeneration"]
        cfg.save_pretrained(out)
        if vision != "toy":
            write_image_files(out, tower, shape["vocab_size"], int(shape["max_position_embeddings"]))
        print(f"wrote {shape_name} shape's files without weights ({vision} vision tower) to {out}")
        return
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3_5ForConditionalGeneration(cfg).to(torch.bfloat16)
    with torch.no_grad():  # transformers leaves the zero-centred norms at identity: spread them a little
        for name, p in model.named_parameters():
            if name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight", "language_model.norm.weight")):
                p.normal_(0.0, 0.1)
            elif vision != "toy" and name.startswith("model.visual."):
                _spread_vision(name, p)
    model.save_pretrained(out)
    del model
    add_random_mtp(out, text, seed)
    if vision == "toy":
        from transformers import Qwen2VLImageProcessor

        Qwen2VLImageProcessor().save_pretrained(out)  # vLLM's VLM front end reads the processor files
        with open(os.path.join(out, "video_preprocessor_config.json"), "w", encoding="utf-8") as f:
            json.dump(read_json(os.path.join(out, "preprocessor_config.json")), f, indent=2)
    else:
        write_image_files(out, tower, shape["vocab_size"], int(shape["max_position_embeddings"]))
    print(f"wrote {shape_name} shape (VLM form, {vision} vision tower, MTP layer) to {out}")


def _spread_vision(name: str, p: Any) -> None:
    """A vision-tower tensor moved off transformers' init (std 0.02, zero biases, unit LayerNorms) to unit gain, with
    small random biases and LayerNorm affines: images then move the text model's logits by O(1), as a trained
    tower's do, so a check comparing outputs with other images can tell them apart."""
    if name.endswith("pos_embed.weight"):
        p.normal_(0.0, 0.5)
    elif p.dim() == 1:
        base = 1.0 if name.split(".")[-2].startswith("norm") and name.endswith("weight") else 0.0
        p.normal_(base, 0.1)
    else:
        p.normal_(0.0, 1.0 / p[0].numel() ** 0.5)


def write_image_files(out: str, tower: dict[str, Any], vocab_size: int, model_max_length: int) -> None:
    """What image input needs beside the weights: preprocessor_config.json and video_preprocessor_config.json laid
    out as Qwen3.5's (``tower``'s patch, temporal patch and merge sizes; ``QWEN35_*_PIXELS``), and the tokenizer.

    The tokenizer is ``hyserve.testing``'s tiny byte-level BPE (448 ids; the approach of ``vlm_tokenizer_json``)
    with filler entries up to ``special_token_ids(vocab_size)``, where ``QWEN35_SPECIALS`` follow as special tokens:
    every id the random prompts use decodes, and the vision tokens have the ids config.json names (checked here).
    tokenizer_config.json carries ``hyserve.testing.VLM_CHAT_TEMPLATE`` (ChatML; an image part renders as
    ``<|vision_start|><|image_pad|><|vision_end|>``).
    """
    from tokenizers import Tokenizer

    from hyserve.testing import VLM_CHAT_TEMPLATE, tokenizer_config, tokenizer_json

    image = {"processor_class": "Qwen3VLProcessor", "do_resize": True, "do_rescale": True, "do_normalize": True,
             "do_convert_rgb": True, "resample": 3, "rescale_factor": 1 / 255, "image_mean": [0.5, 0.5, 0.5],
             "image_std": [0.5, 0.5, 0.5], "patch_size": int(tower["patch_size"]),
             "temporal_patch_size": int(tower["temporal_patch_size"]), "merge_size": int(tower["spatial_merge_size"])}
    write_json(os.path.join(out, "preprocessor_config.json"), {
        "image_processor_type": "Qwen2VLImageProcessorFast", **image,  # Qwen3.5-2B-Base's file names this class
        "size": {"shortest_edge": QWEN35_IMAGE_PIXELS[0], "longest_edge": QWEN35_IMAGE_PIXELS[1]}})
    write_json(os.path.join(out, "video_preprocessor_config.json"), {
        "video_processor_type": "Qwen3VLVideoProcessor", **image, "fps": 2, "min_frames": 4, "max_frames": 768,
        "do_sample_frames": True,
        "size": {"shortest_edge": QWEN35_VIDEO_PIXELS[0], "longest_edge": QWEN35_VIDEO_PIXELS[1]}})

    ids = special_token_ids(vocab_size)
    first = min(ids.values())
    tok = json.loads(tokenizer_json())
    vocab = tok["model"]["vocab"]
    base = max(vocab.values()) + 1
    if first < base:
        raise ValueError(f"vocab_size {vocab_size} leaves no room for the special tokens after {base} BPE ids")
    vocab.update({f"<|filler_{i}|>": i for i in range(base, first)})  # never produced: no merge builds them
    tok["added_tokens"] = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                            "normalized": False, "special": True} for t, i in ids.items()]
    text = json.dumps(tok, ensure_ascii=False)
    loaded = Tokenizer.from_str(text)
    wrong = {t: loaded.token_to_id(t) for t, i in ids.items() if loaded.token_to_id(t) != i}
    if wrong:
        raise AssertionError(f"the written tokenizer puts special tokens at other ids: {wrong}")
    with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(text)
    config = tokenizer_config(ids, model_max_length)
    for t, i in ids.items():
        config["added_tokens_decoder"][str(i)] = {"content": t, "lstrip": False, "normalized": False,
                                                  "rstrip": False, "single_word": False, "special": True}
    config["chat_template"] = VLM_CHAT_TEMPLATE
    write_json(os.path.join(out, "tokenizer_config.json"), config)
    model_cfg = read_json(os.path.join(out, "config.json"))
    for key, token in VISION_TOKEN_KEYS.items():
        if model_cfg.get(key) != ids[token]:
            raise AssertionError(f"config.json {key} is {model_cfg.get(key)}, the tokenizer's {token} is {ids[token]}")


def write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def quantize(src: str, out: str, fmt: str) -> None:
    """``src`` copied to ``out`` with its linear layers in FP8 (``hyserve.testing.fp8.quantize_checkpoint``: what the
    FP8 releases keep in bf16 stays so, the MTP head is quantized like the text model); both engines load
    the result without a flag."""
    import shutil

    from hyserve.testing.fp8 import quantize_checkpoint

    shutil.copytree(src, out)
    quantize_checkpoint(out, fmt)
    print(f"quantized {src} to {out} ({fmt})")


# ---------------------------------------------------------------------------------------------------------- measure


class Engine:
    """The two engines behind one surface: build, generate from token ids, shut down."""

    def __init__(self, name: str, model: str, device: str, dtype: str, **kw: Any) -> None:
        self.name = name
        self.cache: dict[str, Any] = {}
        t0 = time.perf_counter()
        # ``limit_mm_per_prompt``: images per prompt, for a measure that sends images (vLLM's is 0 otherwise);
        # ``disable_log_stats`` is vLLM's (False keeps RequestOutput.metrics; hyserve always fills it).
        images = kw.pop("limit_mm_per_prompt", None)
        log_stats_off = kw.pop("disable_log_stats", None)
        # where ``profiled`` leaves its traces (the profile measure); vLLM's profiler is set at construction
        self.profile_dir: str | None = kw.pop("profile_dir", None)
        if name == "hyserve":
            from hyserve import LLM, SamplingParams

            if images is not None:
                kw["limit_mm_per_prompt"] = images
            kw.pop("vllm_mamba_cache_mode", None)
            self.llm = LLM(model=model, device=device, dtype=dtype, **kw)
            self.version = git_commit()
        else:
            import vllm
            from vllm import LLM, SamplingParams  # type: ignore[no-redef]

            mode = kw.pop("vllm_mamba_cache_mode", None)
            if kw.get("enable_prefix_caching"):
                # vLLM's prefix caching on hybrids: "align" for the GDN models (what vLLM takes for a model without
                # "all" support); Nemotron-H supports "all", vLLM's own choice for it when prefix caching is on, so
                # its users get that: left to vLLM unless asked (--vllm-mamba-cache-mode)
                if mode:
                    kw["mamba_cache_mode"] = mode
                elif not is_nemotron_h(model):
                    kw["mamba_cache_mode"] = "align"
            kw.pop("cpu_cache_memory_bytes", None)
            if self.profile_dir:
                # the engine core's worker profiles itself (its own process); kernels only, no stacks, no front end
                kw["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": self.profile_dir,
                                         "torch_profiler_with_stack": False, "torch_profiler_use_gzip": True,
                                         "torch_profiler_dump_cuda_time_total": False, "ignore_frontend": True}
            if log_stats_off is not None:
                kw["disable_log_stats"] = log_stats_off
            # Images per prompt (none unless a measure sends some): a VLM-form checkpoint's; vLLM refuses the field
            # for a text-only model (Qwen3-Next)
            if "vision_config" in read_json(os.path.join(model, "config.json")):
                kw["limit_mm_per_prompt"] = {"image": 0, "video": 0, **(images or {})}
            self.llm = LLM(model=model, dtype=dtype, **kw)
            self.version = vllm.__version__
            self.cache = vllm_cache_settings(self.llm)
        self.start_s = time.perf_counter() - t0
        self.SamplingParams = SamplingParams

    def generate(self, prompts: list[list[int]] | list[dict[str, Any]], max_tokens: int | list[int]) -> list[Any]:
        """Greedy, ``ignore_eos``; a prompt is token ids or a prompt dict (``prompt_token_ids`` with
        ``multi_modal_data``), which both engines take alike."""
        lens = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
        params = [self.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lens]
        items = [p if isinstance(p, dict) else {"prompt_token_ids": p} for p in prompts]
        return self.llm.generate(items, params, use_tqdm=False)

    def profiled(self, fn: Callable[[], Any]) -> dict[str, float]:
        """Device microseconds by kernel name while ``fn`` runs, read from the engine's own profiler trace: hyserve's
        worker runs in this process (torch.profiler around ``fn``), vLLM's in its engine core's (its
        ``start_profile`` / ``stop_profile``, which write one trace file per call under ``profile_dir``)."""
        if not self.profile_dir:
            raise RuntimeError("profiled() needs an Engine built with profile_dir")
        if self.name == "hyserve":
            import torch
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            with profile(activities=acts) as prof:
                fn()
                _sync()
            path = os.path.join(self.profile_dir, f"hyserve.{time.time_ns()}.pt.trace.json")
            prof.export_chrome_trace(path)
            return trace_kernel_us(path)
        before = set(os.listdir(self.profile_dir))
        self.llm.start_profile()
        fn()
        self.llm.stop_profile()
        return trace_kernel_us(_new_trace(self.profile_dir, before))

    def spec_stats(self) -> dict[str, float]:
        """Mean acceptance length (1 + accepted drafts per verify row) over the engine's life, where it reports
        one offline (hyserve's counters; vLLM's read 0 in offline runs), and hyserve's steps by the speculation
        length each verified (``spec_steps_at_k<j>``: the k chosen per step, docs/async_spec.md)."""
        if self.name != "hyserve":
            return {}
        m = self.llm.get_metrics()
        drafts = float(m.get("hyserve:spec_decode_num_drafts", 0) or 0)  # type: ignore[arg-type]
        accepted = float(m.get("hyserve:spec_decode_num_accepted_tokens", 0) or 0)  # type: ignore[arg-type]
        out = {"spec_mean_acceptance_length": 1 + accepted / drafts} if drafts else {}
        per_k = m.get("hyserve:spec_decode_steps_per_k", [])
        for j, n in enumerate(per_k if isinstance(per_k, list) else []):
            out[f"spec_steps_at_k{j}"] = float(n)
        return out

    def shutdown(self) -> None:
        if self.name == "hyserve":
            self.llm.shutdown()
        del self.llm


def is_nemotron_h(model: str) -> bool:
    """Whether ``model``'s config.json is Nemotron-H's (``model_type: nemotron_h``: Mamba2, no GDN layers)."""
    cfg = read_json(os.path.join(model, "config.json"))
    return (cfg.get("text_config") or cfg).get("model_type") == "nemotron_h"


def vllm_cache_settings(llm: Any) -> dict[str, Any]:
    """What vLLM's front end settled of its cache config (its mamba cache mode and SSM state dtype after the model's
    own rules): best effort. The attention block size it forces up to a Mamba state's page is set later, in the
    engine core's process (its log: "Setting attention block size to N tokens")."""
    try:
        cache = llm.llm_engine.vllm_config.cache_config
    except AttributeError:
        return {}
    keys = ("block_size", "enable_prefix_caching", "mamba_cache_mode", "mamba_block_size", "mamba_ssm_cache_dtype",
            "mamba_cache_dtype", "cache_dtype")
    return {k: str(getattr(cache, k)) for k in keys if hasattr(cache, k)}


def git_commit() -> str:
    """The checkout's commit, with ``+changes`` when tracked files differ from it (the device machine's copy of a
    working tree can carry an older HEAD than the files it runs)."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=here,
                              check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                 text=True, cwd=here, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head}+changes" if changed else head


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn: Callable[[], Any]) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t0


class Prompts:
    def __init__(self, vocab: int, seed: int = 0) -> None:
        import random

        self.rng = random.Random(seed)
        self.vocab = vocab

    def fresh(self, n: int, length: int) -> list[list[int]]:
        return [[self.rng.randrange(self.vocab) for _ in range(length)] for _ in range(n)]


DECODE_TRIES = 3


def measure_decode(eng: Engine, prompts: Prompts, batches: list[int], n: int, prompt_len: int = 512,
                   errors: dict[str, str] | None = None) -> dict[str, float]:
    """Decode tokens/s at each batch, ``b * (n - 1) / (t(n) - t(1))`` over the fastest of at least two timings of
    each (a one-off delay, a compile or autotune on a shape's first use, would otherwise shorten or invert the
    difference: vLLM's FP8 batch 8 once read 1e12 tok/s); a difference still not positive after ``DECODE_TRIES``
    pairs is left out and named in ``errors``."""
    eng.generate(prompts.fresh(max(batches), prompt_len), 4)  # warm-up
    out = {}
    for b in batches:
        eng.generate(prompts.fresh(b, prompt_len), n)  # this batch's shapes compiled / captured
        t1s: list[float] = []
        tns: list[float] = []
        for attempt in range(DECODE_TRIES):
            t1s.append(_timed(lambda b=b: eng.generate(prompts.fresh(b, prompt_len), 1)))
            tns.append(_timed(lambda b=b: eng.generate(prompts.fresh(b, prompt_len), n)))
            if attempt >= 1 and min(tns) > min(t1s):
                out[f"decode_bs{b}_tok_s"] = b * (n - 1) / (min(tns) - min(t1s))
                break
        else:
            if errors is not None:
                errors[f"decode_bs{b}"] = (f"t({n}) - t(1) not positive in {DECODE_TRIES} tries: "
                                           f"t(1) {[round(t, 4) for t in t1s]}, t({n}) {[round(t, 4) for t in tns]}")
    return out


# A mixture-of-experts layer's routed experts (fused ``mlp.experts.gate_up_proj``, or ``mlp.experts.{e}.*``;
# Nemotron-H's ``E`` blocks: ``mixer.experts.{e}.up_proj`` / ``down_proj``, beside ``mixer.shared_experts.*`` and
# the router ``mixer.gate``, which are read whole): a token reads num_experts_per_tok of num_experts
# (n_routed_experts) of them.
EXPERTS = (".mlp.experts.", ".mixer.experts.")
# The input embedding, not read whole by a step (one row a token): Qwen's ``embed_tokens``, Nemotron-H's
# ``backbone.embeddings``; Qwen4-Exp's n-gram tables (``ngram_embedding``) likewise.
INPUT_EMBEDDINGS = ("embed_tokens.weight", "backbone.embeddings.weight")


def _has_moe_layers(text: dict[str, Any]) -> bool:
    """Whether a config's model has MoE layers: Nemotron-H's only where its pattern has ``E`` blocks (transformers
    writes n_routed_experts / num_experts_per_tok defaults into every NemotronH config, the dense ones too)."""
    if text.get("model_type") != "nemotron_h":
        return True
    listed = text.get("layers_block_type") or text.get("layer_types")
    return "E" in str(text.get("hybrid_override_pattern", "")) or bool(listed and "moe" in listed)


def moe_active_share(model: str) -> float:
    """``num_experts_per_tok / num_experts`` (Nemotron-H: ``n_routed_experts``) of a MoE checkpoint's config.json (the
    share of each layer's routed experts one token reads), 1.0 for a dense one."""
    cfg = read_json(os.path.join(model, "config.json"))
    text = cfg.get("text_config") or cfg
    experts = text.get("num_experts") or text.get("n_routed_experts")
    top_k = text.get("num_experts_per_tok")
    return int(top_k) / int(experts) if experts and top_k and _has_moe_layers(text) else 1.0


def step_bytes(tensors: list[tuple[str, int]], tied: bool, share: float) -> int:
    """Bytes one batch-1 decode step reads of ``tensors`` (name, bytes): every text-model tensor and the LM head, the
    input embedding only as the tied LM head, not the vision tower or the MTP layer, and of the routed experts the
    ``share`` a token routes to (``moe_active_share``: a layer's experts are equal in size, so top-k of E reads k / E
    of their bytes; the router, the shared expert and its gate are read whole). Qwen4-Exp's n-gram tables
    (``ngram_embedding``) are embeddings: a token reads one row of each, not counted, like the input embedding.
    Nemotron-H: every Mamba2 mixer (in_proj, conv1d, A_log, D, dt_bias, the gated norm, out_proj), attention, MLP,
    each MoE block's router and shared expert whole and its routed experts by ``share``; ``backbone.embeddings`` is
    the input embedding (its LM head is never tied)."""
    total = 0.0
    for name, nbytes in tensors:
        if "visual" in name or name.startswith("mtp."):
            continue
        embedding = name.endswith(INPUT_EMBEDDINGS)
        if (embedding or name.endswith("ngram_embedding.weight")) and not (tied and embedding):
            continue
        total += nbytes * share if any(e in name for e in EXPERTS) else nbytes
    return round(total)


def weight_bytes_per_step(model: str, load_format: str = "auto") -> int:
    """Bytes of the tensors a batch-1 decode step reads (``step_bytes``: of a MoE layer's routed experts, the top-k).
    ``load_format`` dummy: counted from config.json (``_config_weight_bytes``)."""
    from safetensors import safe_open

    from hyserve.model.loader import checkpoint_files

    if load_format == "dummy":
        return _config_weight_bytes(model)
    sizes = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "I64": 8, "I32": 4}
    cfg = read_json(os.path.join(model, "config.json"))
    tied = bool(cfg.get("tie_word_embeddings", cfg.get("text_config", {}).get("tie_word_embeddings", False)))
    tensors: list[tuple[str, int]] = []
    for path in checkpoint_files(model):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                s = f.get_slice(name)
                numel = 1
                for d in s.get_shape():
                    numel *= d
                tensors.append((name, numel * sizes.get(s.get_dtype(), 2)))
    return step_bytes(tensors, tied, moe_active_share(model))


def _config_weight_bytes(model: str) -> int:
    """``weight_bytes_per_step`` of a checkpoint that config.json describes (none on disk): hyserve's text model built
    on the meta device in bf16 (FP8 where its quantization_config quantizes), the same tensors counted; a
    quantized model hyserve cannot build yet (FP8 experts) is counted from its bf16 build (``_quantized_bytes``)."""
    import torch

    from hyserve.model import registry
    from hyserve.model.loader import checkpoint_tensors

    cfg = registry.load_model_config(model)

    def build(c: Any) -> Any:
        prev = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device("meta"):
                return registry.model_class(c)(c)
        finally:
            torch.set_default_dtype(prev)

    try:
        text = build(cfg)
        tensors = [(name, t.numel() * t.element_size()) for name, t in checkpoint_tensors(text).items()]
    except ValueError:
        if cfg.quantization is None:
            raise
        tensors = _quantized_bytes(build(dataclasses.replace(cfg, quantization=None)), cfg.quantization)
    return step_bytes(tensors, cfg.tie_word_embeddings, moe_active_share(model))


def _quantized_bytes(text: Any, quant: Any) -> list[tuple[str, int]]:
    """The checkpoint tensors of ``text`` (built unquantized) with the bytes ``quant`` gives them: each linear
    projection it quantizes, and each layer's routed experts unless it leaves ``mlp.experts`` out, in FP8 (one
    byte a weight) with float32 scales (one per ``weight_block_size`` block of each matrix, else one per row)."""
    import math

    from hyserve.layers.linear import LinearBase
    from hyserve.model.loader import checkpoint_tensors

    linear = {m.part_name(p) for m in text.modules() if isinstance(m, LinearBase) for p in m.parts}
    block = getattr(getattr(quant, "scheme", None), "block", None)
    out = []
    for name, t in checkpoint_tensors(text).items():
        module = name.rsplit(".", 1)[0]
        is_weight = (name.endswith(".weight") and module in linear) or any(e in name for e in EXPERTS)
        if not (is_weight and quant.linear_method(module).quantized):
            out.append((name, t.numel() * t.element_size()))
            continue
        *stack, rows, cols = t.shape
        mats = math.prod(stack)
        scales = math.ceil(rows / block[0]) * math.ceil(cols / block[1]) if block else rows
        out.append((name, t.numel() + mats * scales * 4))
    return out


def copy_bandwidth() -> float:
    """Device-to-device copy bytes/s, read + write (a 2 GiB buffer, median of 10)."""
    import torch

    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    times = []
    for _ in range(10):
        times.append(_timed(lambda: b.copy_(a)))
    return 2 * a.numel() / sorted(times)[5]


def trace_kernel_us(path: str) -> dict[str, float]:
    """Device microseconds by kernel name in a Chrome trace from torch.profiler (``.json`` or ``.json.gz``): its
    complete events of the device's categories (``trace_gaps.DEVICE_CATS``: kernels, memcpy, memset), kernels
    replayed inside CUDA graphs included."""
    from trace_gaps import DEVICE_CATS, trace_events

    out: dict[str, float] = {}
    for e in trace_events(path):
        if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS:
            out[e["name"]] = out.get(e["name"], 0.0) + float(e.get("dur", 0.0))
    return out


def _new_trace(directory: str, before: set[str], wait_s: float = 180.0) -> str:
    """The trace file that appeared in ``directory`` since ``before`` once its size stops changing (vLLM's worker
    writes it after ``stop_profile`` answers)."""
    deadline = time.monotonic() + wait_s
    last = (None, -1)
    while time.monotonic() < deadline:
        new = sorted(f for f in set(os.listdir(directory)) - before if ".pt.trace.json" in f)
        if new:
            path = os.path.join(directory, new[-1])
            size = os.path.getsize(path)
            if (path, size) == last and size > 0:
                return path
            last = (path, size)
        time.sleep(1.0)
    raise RuntimeError(f"no profiler trace appeared in {directory} within {wait_s:.0f} s")


PROFILE_TOP = 40


def step_profile(shorter: dict[str, float], longer: dict[str, float], steps: int) -> dict[str, Any]:
    """A decode step's kernels from two profiled runs of fresh prompts of one shape, ``longer`` ``steps`` decode
    steps past ``shorter``: their difference over ``steps`` is a decode step's device time by kernel (the prefill,
    the steps that mix it with decoding and the runs' ends cancel out), by family (``kernel_families``)."""
    from kernel_families import families

    per = {k: (longer.get(k, 0.0) - shorter.get(k, 0.0)) / steps for k in set(longer) | set(shorter)}
    top = sorted(per.items(), key=lambda kv: -abs(kv[1]))
    return {"kernel_ms_per_step": sum(per.values()) / 1e3,
            "families_ms_per_step": families(list(per.items()), steps=1),
            "top_kernels_us_per_step": [[name, round(us, 3)] for name, us in top[:PROFILE_TOP]],
            "kernels_left_out_of_top": max(0, len(top) - PROFILE_TOP)}


def measure_profile(eng: Engine, prompts: Prompts, batches: list[int], steps: int, prompt_len: int,
                    engine: str, skip: int = 8) -> list[dict[str, Any]]:
    """Where a decode step's device time goes at each batch, by the engine's own profiler: one unprofiled run of the
    shape first (graphs, compiles), then ``step_profile`` of two profiled runs on fresh prompts, of ``1 + skip`` and
    ``1 + skip + steps`` tokens each. Both runs' prompts are prefilled alike, in steps that may mix prefill chunks
    with the first rows' decoding (a 64 x 512 batch takes two steps of 16,384 tokens); ``skip`` decode steps put
    those behind both, so the difference is ``steps`` steps of every row decoding. One entry per batch, in
    ``plot_step_families.py``'s form (``label``, ``families_ms_per_step``)."""
    out = []
    for b in batches:
        eng.generate(prompts.fresh(b, prompt_len), 1 + skip + steps)
        one, more = prompts.fresh(b, prompt_len), prompts.fresh(b, prompt_len)
        shorter = eng.profiled(lambda p=one: eng.generate(p, 1 + skip))  # type: ignore[misc]
        longer = eng.profiled(lambda p=more: eng.generate(p, 1 + skip + steps))  # type: ignore[misc]
        out.append({"batch": b, "label": f"{engine}, batch {b}", "steps": steps, "skipped_steps": skip,
                    "prompt_len": prompt_len, **step_profile(shorter, longer, steps)})
    return out


def measure_prefill(eng: Engine, prompts: Prompts, n: int, length: int) -> dict[str, float]:
    eng.generate(prompts.fresh(n, length), 1)  # warm-up: every shape of the timed run
    wall = _timed(lambda: eng.generate(prompts.fresh(n, length), 1))
    return {"prefill_tok_s": n * length / wall}


def measure_agent(eng: Engine, vocab: int, scale: str) -> dict[str, float]:
    from hyserve.tools.workload import AgentTraceSpec, make_conversations

    spec = AgentTraceSpec(name="peer", system_prefix_len=1700, num_conversations=8, concurrency=8, turns=(4, 4),
                          first_message_len=(600, 900), message_len=(200, 400), output_len=(32, 64),
                          max_prompt_len=8192)
    if scale == "tiny":
        spec = AgentTraceSpec(name="peer-tiny", system_prefix_len=110, num_conversations=4, concurrency=4,
                              turns=(3, 3), first_message_len=(40, 60), message_len=(20, 40), output_len=(4, 8),
                              max_prompt_len=1024)
    convs = make_conversations(spec, seed=0, vocab_size=vocab)
    prompts_total = cached = 0
    outputs: dict[int, list[list[int]]] = {c.conv_id: [] for c in convs}
    t0 = time.perf_counter()
    for turn in range(max(c.num_turns for c in convs)):
        live = [c for c in convs if turn < c.num_turns]
        batch = [c.prompt(turn, outputs[c.conv_id]) for c in live]
        outs = eng.generate(batch, [c.output_lens[turn] for c in live])
        for c, p, o in zip(live, batch, outs, strict=True):
            outputs[c.conv_id].append(list(o.outputs[0].token_ids))
            prompts_total += len(p)
            cached += int(getattr(o, "num_cached_tokens", 0) or 0)
    return {"agent_wall_s": time.perf_counter() - t0, "agent_cached_share": cached / max(prompts_total, 1)}


# ---------------------------------------------------------------------------------------------------------- images


@dataclass(frozen=True)
class ScreenshotTrace:
    """Sizes of the seed's GUI-agent trace with screenshots (``measure_agent_images``). Ranges are inclusive and
    drawn uniformly; lengths are token ids. ``concurrency`` conversations are all in flight: a turn's requests go to
    the engine in one ``generate``, and the next turn is built from their actual outputs. Every request shows the
    last ``window`` screenshots: message 0 carries screenshots ``0 .. window-1``, message ``j >= 1`` screenshot
    ``j + window - 1``, and at turn ``t`` screenshots ``t .. t + window - 1`` are images, the older ones
    ``earlier_len`` ids of text."""

    prefix_len: int
    first_message_len: tuple[int, int]
    message_len: tuple[int, int]
    output_len: tuple[int, int]
    turns: int
    screen: tuple[int, int]  # width, height of every screenshot
    concurrency: int
    window: int = 2
    earlier_len: int = 8


SCREENSHOT_TRACES = {
    # The seed's: 1.7k shared prefix, 1280x720 screenshots (880 placeholder tokens each at patch 16, merge 2),
    # 20-100-token outputs in the seed (the agent measure's 32-64 here); prompts of about 4.3k-5.8k tokens.
    "full": ScreenshotTrace(prefix_len=1700, first_message_len=(600, 900), message_len=(200, 400),
                            output_len=(32, 64), turns=4, screen=(1280, 720), concurrency=8),
    "tiny": ScreenshotTrace(prefix_len=110, first_message_len=(20, 30), message_len=(10, 20), output_len=(4, 8),
                            turns=4, screen=(64, 48), concurrency=4),
}


def screenshot(seed: int, conv_id: int, index: int, size: tuple[int, int]) -> Any:
    """Screenshot ``index`` of conversation ``conv_id``: ``size`` (width, height) uniform RGB noise drawn from
    ``(seed, conv_id, index)``, encoded as a PNG and decoded back (a PIL RGB image)."""
    import numpy as np
    from PIL import Image

    w, h = size
    pixels = np.random.default_rng([seed, conv_id, index]).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="PNG", compress_level=1)
    img = Image.open(io.BytesIO(buf.getvalue()))
    return img.convert("RGB")


class ScreenshotConversation:
    """One conversation of a ``ScreenshotTrace``: its random messages (ids below ``vocab``), output lengths and the
    texts that stand in for screenshots out of the window, a pure function of ``(trace, conv_id, seed)``."""

    def __init__(self, trace: ScreenshotTrace, conv_id: int, prefix: list[int], vocab: int, seed: int = 0) -> None:
        rng = random.Random(f"peer-screenshots/{seed}/{conv_id}")

        def ids(n: int) -> list[int]:
            return [rng.randrange(vocab) for _ in range(n)]

        self.trace, self.conv_id, self.prefix = trace, conv_id, prefix
        self.messages = [ids(rng.randint(*trace.first_message_len))]
        self.messages += [ids(rng.randint(*trace.message_len)) for _ in range(trace.turns - 1)]
        self.output_lens = [rng.randint(*trace.output_len) for _ in range(trace.turns)]
        self.earlier = [ids(trace.earlier_len) for _ in range(self.num_screens)]

    @property
    def num_screens(self) -> int:
        return self.trace.turns + self.trace.window - 1

    def screens_of_message(self, j: int) -> list[int]:
        w = self.trace.window
        return list(range(w)) if j == 0 else [j + w - 1]

    def visible(self, turn: int) -> list[int]:
        """The screenshots turn ``turn`` shows as images, oldest first: the last ``window`` taken so far."""
        return list(range(turn, turn + self.trace.window))

    def chat(self, turn: int, outputs: list[list[int]]) -> tuple[list[dict[str, Any]], dict[str, list[int]]]:
        """Turn ``turn``'s messages for a chat template, each random text a sentinel string, and the sentinels' ids.

        system (the shared prefix), then per step ``j <= turn`` a user message (its text, then its screenshots:
        image parts if visible, else their stand-in text) and, before ``turn``, the assistant's actual output."""
        pieces: dict[str, list[int]] = {}

        def text(ids: list[int]) -> str:
            key = f"\x00{len(pieces)}\x00"
            pieces[key] = list(ids)
            return key

        shown = set(self.visible(turn))
        messages: list[dict[str, Any]] = [{"role": "system", "content": text(self.prefix)}]
        for j in range(turn + 1):
            parts: list[dict[str, Any]] = [{"type": "text", "text": text(self.messages[j])}]
            for k in self.screens_of_message(j):
                parts.append({"type": "image"} if k in shown else {"type": "text", "text": text(self.earlier[k])})
            messages.append({"role": "user", "content": parts})
            if j < turn:
                messages.append({"role": "assistant", "content": text(outputs[j])})
        return messages, pieces


_SENTINEL = re.compile("(\x00[0-9]+\x00)")
_CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.text }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"


class PromptBuilder:
    """Token ids of a ``ScreenshotConversation.chat`` turn, the same for both engines.

    With the checkpoint's tokenizer and chat template: the template's text, its literal pieces encoded by the
    tokenizer (special tokens, the vision tokens among them, as their ids), each sentinel replaced by its random ids.
    Without a chat template: the fixed ChatML layout (``<|im_start|>role\\n ... <|im_end|>\\n``, an image as
    ``<|vision_start|><|image_pad|><|vision_end|>``), encoded the same way. Without a tokenizer: that layout's
    vision tokens spelled with config.json's ids, the rest of its markup left out (hyserve serves that; vLLM needs
    a tokenizer to find the placeholders)."""

    def __init__(self, model: str) -> None:
        cfg = read_json(os.path.join(model, "config.json"))
        self.vision = {token: int(cfg[key]) for key, token in VISION_TOKEN_KEYS.items()}
        self.image_token_id = self.vision["<|image_pad|>"]
        self.tokenizer: Any = None
        self.template = False
        if os.path.isfile(os.path.join(model, "tokenizer.json")):
            from hyserve.tokenizer import Tokenizer

            self.tokenizer = Tokenizer.from_model_dir(model)
            self.template = bool(self.tokenizer.chat_template)
            for token, i in self.vision.items():
                if self.tokenizer.token_to_id(token) != i:
                    raise ValueError(f"{model}: the tokenizer's {token} is {self.tokenizer.token_to_id(token)}, "
                                     f"config.json says {i}")
        self.layout = "chat template" if self.template else "ChatML" if self.tokenizer else "bare (no tokenizer)"
        self._encoded: dict[str, list[int]] = {}

    def render(self, messages: list[dict[str, Any]]) -> str:
        if self.template:
            return str(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        import jinja2

        image = "<|vision_start|><|image_pad|><|vision_end|>"
        flat = [{"role": m["role"], "text": m["content"] if isinstance(m["content"], str) else "".join(
            image if p.get("type") == "image" else p["text"] for p in m["content"])} for m in messages]
        return jinja2.Template(_CHATML, keep_trailing_newline=True).render(messages=flat)

    def _literal(self, text: str) -> list[int]:
        if text not in self._encoded:
            if self.tokenizer is not None:
                self._encoded[text] = self.tokenizer.encode(text, add_special_tokens=False)
            else:
                names = "|".join(re.escape(t) for t in self.vision)
                self._encoded[text] = [self.vision[t] for t in re.findall(names, text)]
        return self._encoded[text]

    def ids(self, messages: list[dict[str, Any]], pieces: dict[str, list[int]]) -> list[int]:
        out: list[int] = []
        for part in _SENTINEL.split(self.render(messages)):
            out += pieces[part] if part in pieces else self._literal(part)
        images = sum(1 for m in messages if not isinstance(m["content"], str)
                     for p in m["content"] if p.get("type") == "image")
        if out.count(self.image_token_id) != images:
            raise AssertionError(f"{out.count(self.image_token_id)} image placeholders for {images} images")
        return out


def text_vocab(model: str) -> int:
    """Random text ids for the image trace are drawn below this: ``_vocab`` (below the vision tokens), and below
    the tokenizer's first added token if it has one (no chat markers or eos in the random text)."""
    limit = _vocab(model)
    path = os.path.join(model, "tokenizer.json")
    if os.path.isfile(path):
        added = [int(t["id"]) for t in read_json(path).get("added_tokens", [])]
        limit = min([limit, *added])
    return limit


def _first_token_wall(out: Any) -> tuple[float | None, str]:
    """When ``out``'s first token came (``time.time()`` seconds) and where that was read."""
    m = getattr(out, "metrics", None)
    if m is None:
        return None, "none: RequestOutput.metrics is None"
    t = getattr(m, "first_token_time", None)  # hyserve's RequestMetrics (vLLM's V0 one had it too)
    if t:
        return float(t), "RequestOutput.metrics.first_token_time"
    lat, arrival = getattr(m, "first_token_latency", None), getattr(m, "arrival_time", None)
    if lat and arrival:  # vLLM V1's RequestStateStats: arrival (time.time()) + latency to the first token's step
        return float(arrival) + float(lat), "RequestOutput.metrics.arrival_time + first_token_latency"
    return None, f"none: {type(m).__name__} has no first-token time"


def percentile(values: list[float], q: float) -> float:
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


class CacheBound:
    """The most prompt tokens any prefix cache could serve on a trace: each request's longest common prefix with
    what was computed before it (earlier turns' prompts and outputs, and the prompts of its own turn's requests
    sent before it: of requests sharing a prefix, one computes it), at most its prompt less one token (the last
    position must run to give logits). Sequences are expanded ids with every image placeholder keyed by the image
    (``keys``), so two different images never match; no block or snapshot granularity: an upper bound."""

    def __init__(self) -> None:
        import numpy as np

        self._np = np
        self.done: list[Any] = []  # computed sequences: earlier turns' prompt + output
        self.turn: list[Any] = []  # this turn's prompts so far
        self.tokens = 0

    @staticmethod
    def keys(expanded: list[int], pad: int, image_ids: list[int]) -> list[int]:
        """``expanded`` (placeholders widened) with the placeholder rows of image ``i`` replaced by keys below zero
        unique to (``image_ids[i]``, row): equal only where the same image's same row is."""
        spans = sum(1 for i, t in enumerate(expanded) if t == pad and (i == 0 or expanded[i - 1] != pad))
        if spans != len(image_ids):
            raise ValueError(f"{spans} placeholder spans for {len(image_ids)} images")
        out, image, row, prev = [], -1, 0, False
        for t in expanded:
            if t == pad:
                if not prev:
                    image, row = image + 1, 0
                out.append(-1 - (image_ids[image] * 1_000_000 + row))
                row += 1
            else:
                out.append(t)
            prev = t == pad
        return out

    def add(self, prompt: list[int]) -> int:
        """Count ``prompt``'s cacheable tokens; it joins this turn's prompts."""
        a = self._np.asarray(prompt, dtype=self._np.int64)
        best = 0
        for b in (*self.done, *self.turn):
            m = min(len(a), len(b))
            eq = a[:m] == b[:m]
            best = max(best, m if bool(eq.all()) else int(eq.argmin()))
        self.turn.append(a)
        n = min(best, len(prompt) - 1)
        self.tokens += n
        return n

    def end_turn(self, computed: list[list[int]]) -> None:
        """The turn's requests ended: their prompts and outputs (``computed``, in ``add`` order) are cached."""
        self.done += [self._np.asarray(c, dtype=self._np.int64) for c in computed]
        self.turn = []


class PromptsOnly:
    """An ``Engine`` stand-in for ``cache-bound``: no model; ``generate`` returns each prompt's expanded ids (one
    placeholder per image widened as hyserve's processor settings say) and ``max_tokens`` copies of token 0."""

    def __init__(self, model: str) -> None:
        from hyserve.multimodal.image import ImageProcessorSettings

        self.settings = ImageProcessorSettings.from_checkpoint(model)
        self.pad = PromptBuilder(model).image_token_id

    def generate(self, prompts: list[dict[str, Any]], max_tokens: list[int]) -> list[Any]:
        from types import SimpleNamespace

        from hyserve.multimodal.chat import image_token_count
        from hyserve.multimodal.image import expand_image_placeholders

        outs = []
        for p, n in zip(prompts, max_tokens, strict=True):
            counts = [image_token_count(img.size, self.settings) for img in p["multi_modal_data"]["image"]]
            ids = expand_image_placeholders(list(p["prompt_token_ids"]), counts, self.pad)
            outs.append(SimpleNamespace(prompt_token_ids=ids, outputs=[SimpleNamespace(token_ids=[0] * n)],
                                        num_cached_tokens=0, metrics=None))
        return outs


def cache_bound(model: str, scale: str, concurrency: int | None, out: str | None) -> dict[str, Any]:
    """``measure_agent_images``'s trace without an engine: its prompt tokens and the bound (``CacheBound``), which
    depend on the trace and the checkpoint's tokenizer and processor files alone (every prompt diverges from the
    ones before it ahead of any output)."""
    fig, notes = measure_agent_images(PromptsOnly(model), model, scale, concurrency)  # type: ignore[arg-type]
    keep = ("agent_images_cacheable_share", "agent_images_prompt_tokens_mean", "agent_images_requests",
            "agent_images_image_tokens_per_request")
    res = {"model": model, "command": " ".join(sys.argv), "hyserve_commit": git_commit(),
           "figures": {k: fig[k] for k in keep}, "notes": {"trace": notes["trace"], "layout": notes["prompt_layout"]}}
    if out:
        write_json(out, res)
    print(json.dumps(res, indent=2))
    return res


def screenshot_conversations(model: str, scale: str, concurrency: int | None = None, seed: int = 0
                             ) -> tuple[ScreenshotTrace, list[ScreenshotConversation], dict[tuple[int, int], Any]]:
    """The screenshot trace ``SCREENSHOT_TRACES[scale]`` for ``model``: its ``concurrency`` conversations (the
    scale's by default), sharing one random prefix, and every screenshot by (conversation, index)."""
    trace = SCREENSHOT_TRACES[scale]
    vocab = text_vocab(model)
    prefix_rng = random.Random(f"peer-screenshots/{seed}/prefix")
    prefix = [prefix_rng.randrange(vocab) for _ in range(trace.prefix_len)]
    convs = [ScreenshotConversation(trace, c, prefix, vocab, seed) for c in range(concurrency or trace.concurrency)]
    shots = {(c.conv_id, k): screenshot(seed, c.conv_id, k, trace.screen) for c in convs for k in range(c.num_screens)}
    return trace, convs, shots


def measure_agent_images(eng: Engine, model: str, scale: str, concurrency: int | None = None, seed: int = 0
                         ) -> tuple[dict[str, float], dict[str, Any]]:
    """The screenshot trace (``SCREENSHOT_TRACES[scale]``, ``concurrency`` conversations) through ``eng``: its
    figures (``agent_images_*``) and notes (the trace, the prompt layout, where TTFT was read).

    Screenshots and prompt ids are made outside the timed part; the wall is the sum of the turns' ``generate``
    calls. TTFT is each request's first token time less its turn's submission (the whole turn submitted at once:
    it includes waiting behind the turn's other requests, as a client sending them together sees it)."""
    trace, convs, shots = screenshot_conversations(model, scale, concurrency, seed)
    n = len(convs)
    vocab = text_vocab(model)
    image_uid = {key: i for i, key in enumerate(shots)}
    bound = CacheBound()
    builder = PromptBuilder(model)
    outputs: dict[int, list[list[int]]] = {c.conv_id: [] for c in convs}
    wall = 0.0
    prompt_tokens = cached = out_tokens = image_tokens = 0
    per_turn: list[tuple[int, int]] = []
    ttft: list[float] = []
    sources: set[str] = set()
    for turn in range(trace.turns):
        batch = []
        for c in convs:
            messages, pieces = c.chat(turn, outputs[c.conv_id])
            batch.append({"prompt_token_ids": builder.ids(messages, pieces),
                          "multi_modal_data": {"image": [shots[c.conv_id, k] for k in c.visible(turn)]}})
        _sync()
        submitted, t0 = time.time(), time.perf_counter()
        outs = eng.generate(batch, [c.output_lens[turn] for c in convs])
        _sync()
        wall += time.perf_counter() - t0
        turn_prompt = turn_cached = 0
        computed = []
        for c, o in zip(convs, outs, strict=True):
            toks = list(o.outputs[0].token_ids)
            outputs[c.conv_id].append(toks)
            out_tokens += len(toks)
            ids = list(o.prompt_token_ids)
            keyed = CacheBound.keys(ids, builder.image_token_id, [image_uid[c.conv_id, k] for k in c.visible(turn)])
            bound.add(keyed)
            computed.append(keyed + toks)
            turn_prompt += len(ids)
            turn_cached += int(getattr(o, "num_cached_tokens", 0) or 0)
            image_tokens += ids.count(builder.image_token_id)
            first, source = _first_token_wall(o)
            sources.add(source)
            if first is not None:
                ttft.append(first - submitted)
        bound.end_turn(computed)
        per_turn.append((turn_cached, turn_prompt))
        prompt_tokens += turn_prompt
        cached += turn_cached
    requests = n * trace.turns
    fig: dict[str, float] = {
        "agent_images_wall_s": wall, "agent_images_cached_share": cached / max(prompt_tokens, 1),
        "agent_images_cacheable_share": bound.tokens / max(prompt_tokens, 1),
        "agent_images_cached_of_cacheable": cached / max(bound.tokens, 1),
        "agent_images_out_tok_s": out_tokens / max(wall, 1e-9), "agent_images_requests": requests,
        "agent_images_prompt_tokens_mean": prompt_tokens / requests,
        "agent_images_image_tokens_per_request": image_tokens / requests,
    }
    for t, (c_t, p_t) in enumerate(per_turn):
        fig[f"agent_images_cached_share_turn{t}"] = c_t / max(p_t, 1)
    if len(ttft) == requests:
        fig.update(agent_images_ttft_mean_s=sum(ttft) / len(ttft), agent_images_ttft_p50_s=percentile(ttft, 0.5),
                   agent_images_ttft_p90_s=percentile(ttft, 0.9))
    notes = {"trace": {**asdict(trace), "conversations": n, "scale": scale}, "prompt_layout": builder.layout,
             "text_ids_below": vocab, "ttft_source": sorted(sources),
             "ttft": "first token time - the turn's submission (time.time()), every request of a turn submitted "
                     "together" if len(ttft) == requests else "not available from this engine's outputs"}
    return fig, notes


def measure(args: argparse.Namespace) -> int:
    """Run the chosen measures and write their figures; 1 if one of them failed (its error is in the file)."""
    import torch

    cuda = args.device == "cuda"
    common: dict[str, Any] = {"max_model_len": args.max_model_len}
    if args.load_format != "auto":  # both engines take vLLM's load_format ("dummy": a write --no-weights model)
        common["load_format"] = args.load_format
    if cuda:
        common["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.engine == "vllm" and args.vllm_mamba_cache_mode:
        common["vllm_mamba_cache_mode"] = args.vllm_mamba_cache_mode
    if args.engine == "vllm" and args.vllm_gdn_prefill_backend:
        # vLLM's GDN prefill kernel: FlashInfer's (its default on Hopper, JIT-built for 8-10 minutes on a fresh
        # machine) or its Triton/FLA one (no JIT); a decode step takes neither
        common["gdn_prefill_backend"] = args.vllm_gdn_prefill_backend
    if args.mamba_ssm_cache_dtype:  # the GDN state's stored dtype, both engines' name (vLLM's default: the model's)
        common["mamba_ssm_cache_dtype"] = args.mamba_ssm_cache_dtype
    measures = args.measures.split(",")
    res: dict[str, Any] = {"engine": args.engine, "model": args.model, "command": " ".join(sys.argv),
                           "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
                           "date": time.strftime("%Y-%m-%d"), "hyserve_commit": git_commit(), "figures": {}}
    nemotron = is_nemotron_h(args.model)
    if args.engine == "vllm":
        res["vllm_gdn_prefill_backend"] = "n/a (no GDN layers)" if nemotron else (
            args.vllm_gdn_prefill_backend or "auto (FlashInfer on Hopper)")
        res["vllm_mode"] = "in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0)" \
            if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" else "default (engine core in its own process)"
    res["ssm_state_dtype"] = args.mamba_ssm_cache_dtype or (
        "float32 (hyserve's default)" if args.engine == "hyserve" else
        "auto: config.json's mamba_ssm_cache_dtype, else float32 (vLLM's NemotronH rule)" if nemotron else
        "auto: the model's dtype (vLLM's default)")
    fig = res["figures"]
    batches = [int(b) for b in args.batches.split(",")]
    errors = res["errors"] = {}

    def attempt(name: str, fn: Callable[[], None]) -> None:
        """Run measure ``name``; a failure is recorded (the file keeps what the other measures found)."""
        try:
            fn()
        except Exception as e:  # an engine that cannot run a measure: its error is the result
            import traceback

            errors[name] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        _release()
        save()  # what the measures so far found survives a later one that runs past the call's limit

    def save() -> None:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=2)

    def main_group() -> None:
        kw = dict(common)
        if "profile" in measures:
            import tempfile

            kw["profile_dir"] = tempfile.mkdtemp(prefix=f"{args.engine}_profile_")
        eng = Engine(args.engine, args.model, args.device, args.dtype, enable_prefix_caching=args.prefix_caching,
                     max_num_seqs=max([*batches, args.prefill_prompts]), **kw)
        res["version"] = eng.version
        if eng.cache:
            res["vllm_cache"] = eng.cache
        fig["first_start_s"] = eng.start_s
        prompts = Prompts(_vocab(args.model))
        if "decode" in measures:
            fig.update(measure_decode(eng, prompts, batches, args.decode_tokens, args.decode_prompt_len, errors=errors))
        if "bound" in measures and cuda:
            wb = weight_bytes_per_step(args.model, args.load_format)
            bw = copy_bandwidth()
            fig.update(weight_bytes=wb, copy_bandwidth_bytes_s=bw, bound_bs1_tok_s=bw / wb)
            if moe_active_share(args.model) < 1:  # the bound counts a token's top-k experts, not all of them
                fig["moe_active_expert_share"] = moe_active_share(args.model)
            if "decode_bs1_tok_s" in fig:
                fig["decode_bs1_share_of_bound"] = fig["decode_bs1_tok_s"] / fig["bound_bs1_tok_s"]
        if "prefill" in measures:
            fig.update(measure_prefill(eng, prompts, args.prefill_prompts, args.prefill_len))
        if "profile" in measures:
            profile_batches = [int(b) for b in args.profile_batches.split(",")]
            res["profiles"] = measure_profile(eng, prompts, profile_batches, args.profile_steps,
                                              args.decode_prompt_len, args.engine, args.profile_skip)
        eng.shutdown()

    def start() -> None:  # its own process, after a first one: compile caches warm
        eng = Engine(args.engine, args.model, args.device, args.dtype, enable_prefix_caching=False, **common)
        res.setdefault("version", eng.version)
        fig["start_warm_s"] = eng.start_s
        eng.shutdown()

    def agent() -> None:
        kw = dict(common, enable_prefix_caching=True)
        tag = "agent"
        if args.speculative_config:
            kw["speculative_config"] = json.loads(args.speculative_config)
            tag = "agent_mtp"
        if args.kv_cache_dtype != "auto":  # the seed's --kv-cache-dtype fp8 question: does the hit rate hold?
            kw["kv_cache_dtype"] = args.kv_cache_dtype
            tag += "_kvfp8"
        eng = Engine(args.engine, args.model, args.device, args.dtype, **kw)
        res.setdefault("version", eng.version)
        if eng.cache:  # vLLM: its mamba cache mode with prefix caching on, the SSM state's dtype
            res[f"vllm_cache_{tag}"] = eng.cache
        fig.update({k.replace("agent", tag, 1): v
                    for k, v in measure_agent(eng, _vocab(args.model), args.agent_scale).items()})
        fig.update({k.replace("spec", tag, 1): v for k, v in eng.spec_stats().items()})
        eng.shutdown()

    def agent_images() -> None:
        trace = SCREENSHOT_TRACES[args.agent_scale]
        n = args.agent_concurrency or trace.concurrency
        kw = dict(common, enable_prefix_caching=True, limit_mm_per_prompt={"image": trace.window},
                  disable_log_stats=False)
        tag = "agent_images"
        if args.speculative_config:
            kw["speculative_config"] = json.loads(args.speculative_config)
            tag += "_mtp"
        if args.kv_cache_dtype != "auto":
            kw["kv_cache_dtype"] = args.kv_cache_dtype
            tag += "_kvfp8"
        if n != trace.concurrency:
            tag += f"_c{n}"
        eng = Engine(args.engine, args.model, args.device, args.dtype, **kw)
        res.setdefault("version", eng.version)
        figures, notes = measure_agent_images(eng, args.model, args.agent_scale, n)
        fig.update({k.replace("agent_images", tag, 1): v for k, v in figures.items()})
        fig.update({k.replace("spec", tag, 1): v for k, v in eng.spec_stats().items()})
        res.setdefault("notes", {})[tag] = notes
        eng.shutdown()

    def spec() -> None:
        spec_batches = [int(b) for b in args.spec_batches.split(",")]
        for label, kw in (("plain", {}), ("spec", {"speculative_config": json.loads(args.speculative_config)})):
            eng = Engine(args.engine, args.model, args.device, args.dtype, enable_prefix_caching=False,
                         max_num_seqs=max(spec_batches), **common, **kw)
            res.setdefault("version", eng.version)
            for k, v in measure_decode(eng, Prompts(_vocab(args.model), 1), spec_batches, args.decode_tokens).items():
                fig[f"{label}_{k}"] = v
            if label == "spec":
                fig.update(eng.spec_stats())
                fig.update(planted_acceptance(kw["speculative_config"]))
            eng.shutdown()
            _release()
        for b in spec_batches:
            fig[f"spec_speedup_bs{b}"] = fig[f"spec_decode_bs{b}_tok_s"] / fig[f"plain_decode_bs{b}_tok_s"]

    if {"decode", "bound", "prefill", "profile"} & set(measures):
        attempt("decode,bound,prefill,profile", main_group)
    if "start" in measures:
        attempt("start", start)
    if "agent" in measures:
        attempt("agent", agent)
    if "agent_images" in measures:
        attempt("agent_images", agent_images)
    if "spec" in measures and args.speculative_config:
        attempt("spec", spec)
    save()
    print(json.dumps(res, indent=2))
    return 1 if errors else 0


def synthetic_mtp_config(k: int, rate: float) -> dict[str, Any]:
    """vLLM's speculative config for MTP ``k`` whose drafts are accepted as the drafts ``spec_decode_bench.py``
    plants at ``rate`` (each draft token right with probability ``rate``, acceptance ending at the first wrong
    one): its synthetic rejection sampling (``rejection_sample_method="synthetic"``) with the per-position
    probabilities that the first ``i + 1`` drafts are all accepted, ``rate ** (i + 1)``. The MTP head still
    drafts every step (its cost is in the timing); the sampler accepts by these draws, not by the tokens."""
    return {"method": "mtp", "num_speculative_tokens": k, "rejection_sample_method": "synthetic",
            "synthetic_acceptance_rates": [round(rate ** (i + 1), 6) for i in range(k)]}


def planted_acceptance(spec: dict[str, Any]) -> dict[str, float]:
    """The mean acceptance length a synthetic (planted) speculative config asks for: 1 + the sum of its
    per-position rates, or its ``synthetic_acceptance_length``; nothing for a config that accepts by the tokens."""
    if spec.get("rejection_sample_method") != "synthetic":
        return {}
    if spec.get("synthetic_acceptance_length") is not None:
        return {"spec_planted_acceptance_length": float(spec["synthetic_acceptance_length"])}
    return {"spec_planted_acceptance_length": 1 + sum(float(r) for r in spec.get("synthetic_acceptance_rates") or [])}


def read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _vocab(model: str) -> int:
    """Random prompt ids are drawn below this: the vocabulary, cut below the vision tokens' ids (both engines
    refuse image placeholders that come without images)."""
    cfg = read_json(os.path.join(model, "config.json"))
    vision = [int(cfg[k]) for k in ("vision_start_token_id", "vision_end_token_id", "image_token_id",
                                     "video_token_id") if k in cfg]
    return min([int(cfg.get("text_config", cfg).get("vocab_size")), *vision])


def _release() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------- report

# measure -> (higher is better, label)
_FIGURES = {
    "decode_bs1_tok_s": (True, "decode batch 1, tok/s"), "decode_bs8_tok_s": (True, "decode batch 8, tok/s"),
    "decode_bs32_tok_s": (True, "decode batch 32, tok/s"), "decode_bs64_tok_s": (True, "decode batch 64, tok/s"),
    "decode_bs1_share_of_bound": (True, "batch-1 decode, share of the bandwidth bound"),
    "prefill_tok_s": (True, "prefill 32 x 2048, tok/s"), "agent_wall_s": (False, "agent trace, wall s"),
    "agent_cached_share": (True, "agent trace, prompt tokens from cache"),
    "agent_mtp_wall_s": (False, "agent trace with MTP, wall s"),
    "agent_mtp_cached_share": (True, "agent trace with MTP, prompt tokens from cache"),
    "agent_kvfp8_wall_s": (False, "agent trace, FP8 KV cache, wall s"),
    "agent_kvfp8_cached_share": (True, "agent trace, FP8 KV cache, prompt tokens from cache"),
    "start_warm_s": (False, "engine start (warm caches), s"),
    "spec_speedup_bs1": (True, "speculation vs plain, batch 1"),
    "spec_speedup_bs8": (True, "speculation vs plain, batch 8"),
    "spec_mean_acceptance_length": (True, "speculation, mean acceptance length"),
    "bound_bs1_tok_s": (True, "batch-1 weights-bandwidth bound (measured in each run), tok/s"),
    "first_start_s": (False, "engine start, first process on the machine, s"),
}
for _tag, _what in (("agent_images", "screenshot agent trace (8 x 4 turns, 2 x 1280x720)"),
                    ("agent_images_c32", "screenshot agent trace, 32 conversations"),
                    ("agent_images_mtp", "screenshot agent trace with MTP")):
    _FIGURES.update({
        f"{_tag}_wall_s": (False, f"{_what}, wall s"),
        f"{_tag}_cached_share": (True, f"{_what}, prompt tokens from cache"),
        f"{_tag}_cacheable_share": (True, f"{_what}, prompt tokens any prefix cache could serve (bound)"),
        f"{_tag}_cached_of_cacheable": (True, f"{_what}, tokens from cache / the bound"),
        f"{_tag}_ttft_mean_s": (False, f"{_what}, mean TTFT s"),
        f"{_tag}_ttft_p50_s": (False, f"{_what}, p50 TTFT s"),
        f"{_tag}_ttft_p90_s": (False, f"{_what}, p90 TTFT s"),
        f"{_tag}_out_tok_s": (True, f"{_what}, output tok/s"),
        f"{_tag}_image_tokens_per_request": (True, f"{_what}, image placeholder tokens per request"),
        f"{_tag}_prompt_tokens_mean": (True, f"{_what}, prompt tokens per request"),
    })
_NO_RATIO = {"bound_bs1_tok_s"}  # a property of the card measured in each engine's run, not of the engine
# Equal for both engines when they expand the image placeholders alike: a check on the trace, not a speed.
_NO_RATIO |= {k for k in _FIGURES if k.endswith(("_image_tokens_per_request", "_prompt_tokens_mean",
                                                  "_cacheable_share"))}


def report(files: list[str], out: str) -> None:
    runs = [read_json(p) for p in files]
    by_model: dict[str, dict[str, dict[str, Any]]] = {}
    # Where each figure comes from: the file and engine version of the run that measured it (a later file's figure
    # replaces an earlier one's; files from several device sessions can be merged, and each row says which).
    source: dict[tuple[str, str, str], str] = {}
    for path, r in zip(files, runs, strict=True):
        model = os.path.basename(r["model"].rstrip("/"))
        folder = os.path.basename(os.path.dirname(os.path.abspath(path)))
        run = f"{folder}/{os.path.basename(path)} ({r.get('version')})"
        for key in r["figures"]:
            source[(model, r["engine"], key)] = run
    for r in runs:  # several files of one engine and model (one process per measure group) merge
        slot = by_model.setdefault(os.path.basename(r["model"].rstrip("/")), {})
        if r["engine"] in slot:
            merged = slot[r["engine"]]
            merged["figures"] = {**merged["figures"], **r["figures"]}
            merged["errors"] = {**merged.get("errors", {}), **r.get("errors", {})}
            merged["command"] = f"{merged['command']} ; {r['command']}"
            merged["version"] = r.get("version") or merged.get("version")  # the latest run's
        else:
            slot[r["engine"]] = dict(r)
    entries = []
    for model, engines in sorted(by_model.items()):
        ours, peer = engines.get("hyserve", {}).get("figures", {}), engines.get("vllm", {}).get("figures", {})
        for key, (higher, label) in _FIGURES.items():
            if key not in ours and key not in peer:
                continue
            a, b = ours.get(key), peer.get(key)
            ratio = None
            if a is not None and b and key not in _NO_RATIO:
                ratio = a / b if higher else b / a  # > 1: hyserve is better
            entries.append({"model": model, "measure": key, "label": label, "hyserve": a, "vllm": b, "ratio": ratio,
                            "hyserve_run": source.get((model, "hyserve", key)),
                            "vllm_run": source.get((model, "vllm", key))})
        for engine, r in sorted(engines.items()):
            for name, why in r.get("errors", {}).items():
                entries.append({"model": model, "measure": name, "label": f"{engine} failed: {why}"[:300],
                                "hyserve": None, "vllm": None, "ratio": None})
    meta = {"files": files, "hyserve_commit": git_commit(),
            "engines": {f"{m}/{e}": {k: r.get(k) for k in ("version", "device", "torch", "date", "command")}
                        for m, es in by_model.items() for e, r in es.items()},
            "notes": {f"{os.path.basename(r['model'].rstrip('/'))}/{r['engine']}/{tag}": note
                      for r in runs for tag, note in r.get("notes", {}).items()}}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "peer.json"), "w", encoding="utf-8") as f:
        json.dump({"meta": meta, "entries": entries}, f, indent=2)
    lines = ["# hyserve against vLLM, same machine, checkpoint and prompts", "",
             f"hyserve commit {meta['hyserve_commit']}; " + "; ".join(
                 f"{k}: {v.get('version')} on {v.get('device')} ({v.get('date')})" for k, v in meta["engines"].items()),
             "", "| model | measure | hyserve | vLLM | hyserve better by | runs (hyserve; vLLM) |",
             "| --- | --- | ---: | ---: | ---: | --- |"]

    def fmt(x: Any) -> str:
        return "-" if x is None else (f"{x:,.3f}" if abs(x) < 10 else f"{x:,.0f}")

    for e in entries:
        ratio = "-" if e["ratio"] is None else f"{e['ratio']:.2f}x"
        runs_cell = "; ".join(x for x in (e.get("hyserve_run"), e.get("vllm_run")) if x) or "-"
        lines.append(f"| {e['model']} | {e['label']} | {fmt(e['hyserve'])} | {fmt(e['vllm'])} | {ratio} | "
                     f"{runs_cell} |")
    with open(os.path.join(out, "peer.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rated = [e for e in entries if e["ratio"] is not None]
    if rated:
        fig, ax = plt.subplots(figsize=(7, 0.35 * len(rated) + 1.2))
        ax.barh([f"{e['model']}: {e['label']}" for e in rated], [e["ratio"] for e in rated])
        ax.axvline(1.0, color="grey", ls="--", lw=0.8)
        ax.set_xlabel("hyserve better by (x)")
        fig.tight_layout()
        fig.savefig(os.path.join(out, "peer.png"), dpi=120)
        plt.close(fig)


# Issue 31's MoE shapes: the config-only directories peer_session.sh writes, and the table's figures (key, higher
# is better, label, ratio). The MTP rows: hyserve's from spec_decode_bench.py (drafts planted from the plain run at
# the rate, the acceptance reached measured), vLLM's from ``measure --measures spec`` with its synthetic rejection
# sampling at the same per-position rates (``synthetic_mtp_config``; the acceptance asked, not measured).
MOE_MODELS = {"m35": "35B-A3B bf16", "m35_fp8": "35B-A3B FP8", "m80_fp8": "Next-80B FP8",
              # issue 33's Mamba2 shapes (peer_session.sh mamba2 / mamba2-vllm)
              "n8b": "Nemotron-H-8B bf16", "n30": "Nemotron 3 Nano 30B-A3B bf16"}
MOE_TITLE = "Issue 31: hyserve against vLLM on the MoE shapes (dummy weights, one H200)"
MOE_FIGURES: list[tuple[str, bool, str, bool]] = [
    *((f"decode_bs{b}_tok_s", True, f"decode batch {b}, tok/s", True) for b in (1, 8, 32, 64)),
    ("bound_bs1_tok_s", True, "batch-1 weights-bandwidth bound, tok/s", False),
    ("decode_bs1_share_of_bound", True, "batch-1 decode, share of the bound", True),
    ("prefill_tok_s", True, "prefill 32 x 2048, tok/s", True),
    ("agent_wall_s", False, "agent trace (8 x 4 turns, 1.7k shared prefix, prefix caching), wall s", True),
    ("agent_cached_share", True, "agent trace, prompt tokens from cache", True),
    *(item for b in (1, 32) for item in (
        (f"plain_decode_bs{b}_tok_s", True, f"MTP run's plain decode, batch {b}, tok/s", True),
        (f"spec_decode_bs{b}_tok_s", True, f"MTP k = 3 planted at 80 %, batch {b}, tok/s", True),
        (f"spec_speedup_bs{b}", True, f"MTP k = 3 planted at 80 %, batch {b}, speedup over plain", True),
        (f"spec_acceptance_length_bs{b}", True,
         f"MTP, batch {b}, mean acceptance length (hyserve reached; vLLM asked)", False))),
]


def spec_decode_figures(run: dict[str, Any], rate: float) -> dict[str, Any]:
    """A ``spec_decode_bench.py`` result (``spec_decode.json``) as ``measure``'s figures, from its rows at planted
    ``rate``: per batch the plain and speculative decode tok/s, the speedup, the mean tokens a step (the acceptance
    length reached) and whether the outputs were the plain run's."""
    fig: dict[str, Any] = {}
    for r in run["rows"]:
        if abs(float(r["acceptance_target"]) - rate) > 1e-9:
            continue
        b = r["batch"]
        fig.update({f"plain_decode_bs{b}_tok_s": r["no_spec_tok_s"], f"spec_decode_bs{b}_tok_s": r["decode_tok_s"],
                    f"spec_speedup_bs{b}": r["speedup"], f"spec_acceptance_length_bs{b}": r["mean_tokens_per_step"],
                    f"spec_draft_acceptance_bs{b}": r["draft_acceptance"],
                    f"spec_outputs_identical_bs{b}": r["outputs_identical"]})
    return fig


def moe_report(files: list[str], out: str, rate: float = 0.8, title: str = MOE_TITLE) -> list[dict[str, Any]]:
    """One table of the MoE shapes' figures of both engines (``MOE_FIGURES``) with hyserve's ratio over vLLM (> 1:
    hyserve better), from ``measure`` files and ``spec_decode.json`` files (hyserve's planted MTP runs); a later
    file's figure replaces an earlier one's. Writes ``moe_peer.md`` and ``moe_peer.json`` under ``out``."""
    figs: dict[tuple[str, str], dict[str, Any]] = {}
    info: dict[tuple[str, str], dict[str, Any]] = {}
    errors: list[str] = []
    for path in files:
        r = read_json(path)
        if "rows" in r and "meta" in r:  # spec_decode_bench.py's
            engine, model, fig = "hyserve", r["meta"]["model"], spec_decode_figures(r, rate)
            meta = {"source": "spec_decode_bench.py", **{k: r["meta"].get(k) for k in ("device", "date", "torch")}}
        else:
            engine, model, fig = r["engine"], r["model"], dict(r.get("figures", {}))
            meta = {k: r.get(k) for k in ("version", "device", "date", "vllm_mode", "vllm_gdn_prefill_backend",
                                             "ssm_state_dtype", "vllm_cache_agent")}
            if "spec_planted_acceptance_length" in fig:  # vLLM's synthetic acceptance: the same at every batch
                for key in list(fig):
                    if key.startswith("spec_speedup_bs"):
                        fig[f"spec_acceptance_length_bs{key[len('spec_speedup_bs'):]}"] = \
                            fig["spec_planted_acceptance_length"]
            errors += [f"{os.path.basename(model.rstrip('/'))} {engine} {name}: {why}"[:300]
                       for name, why in r.get("errors", {}).items()]
        name = os.path.basename(model.rstrip("/"))
        figs.setdefault((name, engine), {}).update(fig)
        info.setdefault((name, engine), {}).update({k: v for k, v in meta.items() if v is not None})
    order = [m for m in MOE_MODELS if any(k[0] == m for k in figs)] + sorted({k[0] for k in figs} - set(MOE_MODELS))
    entries = []
    for model in order:
        ours, peer = figs.get((model, "hyserve"), {}), figs.get((model, "vllm"), {})
        for key, higher, label, rated in MOE_FIGURES:
            a, b = ours.get(key), peer.get(key)
            if a is None and b is None:
                continue
            ratio = (a / b if higher else b / a) if rated and a and b else None
            entries.append({"model": model, "shape": MOE_MODELS.get(model, model), "measure": key, "label": label,
                            "hyserve": a, "vllm": b, "ratio": ratio})
    engines = {f"{m}/{e}": v for (m, e), v in sorted(info.items())}
    os.makedirs(out, exist_ok=True)
    write_json(os.path.join(out, "moe_peer.json"), {"files": files, "hyserve_commit": git_commit(),
                                                       "engines": engines, "entries": entries, "errors": errors})

    def fmt(x: Any) -> str:
        return "-" if x is None else (f"{x:,.3f}" if abs(x) < 10 else f"{x:,.0f}")

    lines = [f"# {title}", "",
             *(f"- {k}: " + ", ".join(f"{a} {v}" for a, v in e.items()) for k, e in engines.items()), "",
             "The MTP rows: hyserve's verdicts drawn per draft token (spec_decode_bench.py --synthetic, step times of "
             "the steps where every row decodes), vLLM's synthetic rejection sampling at the same per-position rates "
             "(peer_bench.py measure --measures spec, batch x (N - 1) / (t(N) - t(1))): compare the speedups over "
             "each engine's own plain decode; the absolute tok/s come from two timing methods.", "",
             "| shape | measure | hyserve | vLLM | hyserve better by |", "| --- | --- | ---: | ---: | ---: |"]
    for e in entries:
        ratio = "-" if e["ratio"] is None else f"{e['ratio']:.2f}x"
        lines.append(f"| {e['shape']} | {e['label']} | {fmt(e['hyserve'])} | {fmt(e['vllm'])} | {ratio} |")
    if errors:
        lines += ["", "Failed measures:", "", *(f"- {x}" for x in errors)]
    with open(os.path.join(out, "moe_peer.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return entries


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("--shape", choices=["tiny", "2b", "9b", "27b"], default="2b")
    w.add_argument("--out", required=True)
    w.add_argument("--device", default="cuda")
    w.add_argument("--no-weights", action="store_true",
                   help="config, tokenizer and processor files only (measure it with --load-format dummy)")
    w.add_argument("--vision", choices=sorted(VISIONS), default="toy",
                   help="toy: a one-block tower (text-only runs); real: a real-size Qwen3.5 tower, its processor "
                        "files and a tokenizer with the vision tokens (image runs); 27b: the 27B class's tower "
                        "(depth 27, hidden 1152) with the same files")
    w.add_argument("--fp8", choices=["ct_dynamic"], default=None,
                   help="the seed's compressed-tensors FP8_DYNAMIC form (SEED_FP8_IGNORE kept in bf16); with "
                        "--no-weights only config.json's quantization_config (a dummy load makes FP8 weights)")
    m = sub.add_parser("measure")
    m.add_argument("--engine", choices=["hyserve", "vllm"], required=True)
    m.add_argument("--model", required=True)
    m.add_argument("--out", required=True)
    m.add_argument("--device", default="cuda")
    m.add_argument("--dtype", default="bfloat16")
    m.add_argument("--measures", default="decode,bound,prefill,agent",
                   help="comma-separated; start (the warm start) belongs in a process of its own, after a first; "
                        "agent_images (a --vision real checkpoint) is not in the default")
    m.add_argument("--batches", default="1,8,32,64")
    m.add_argument("--decode-tokens", type=int, default=128)
    m.add_argument("--decode-prompt-len", type=int, default=512,
                   help="the decode measure's prompt length (the figures' 512; the CPU tests take a few tokens, so "
                        "that the decode steps, not the prefill's noise, make t(N) - t(1))")
    m.add_argument("--profile-batches", default="1,64",
                   help="the profile measure's batches: a decode step's device time by kernel and family, by the "
                        "engine's own profiler (vLLM's in its engine core's process)")
    m.add_argument("--profile-steps", type=int, default=24)
    m.add_argument("--profile-skip", type=int, default=8,
                   help="decode steps in both profiled runs before the ones compared (the prefill's mixed steps)")
    m.add_argument("--prefill-prompts", type=int, default=32)
    m.add_argument("--prefill-len", type=int, default=2048)
    m.add_argument("--agent-scale", choices=["full", "tiny"], default="full")
    m.add_argument("--agent-concurrency", type=int, default=None,
                   help="agent_images: conversations, all in flight (default: the scale's, 8 at full scale)")
    m.add_argument("--speculative-config", default=None, help="JSON; the agent trace and the spec measure use it")
    m.add_argument("--spec-batches", default="1,8")
    m.add_argument("--mamba-ssm-cache-dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                   help="the GDN SSM state's stored dtype, passed to either engine (default: each engine's own: "
                        "float32 for hyserve, the model's dtype for vLLM)")
    m.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="the agent trace's KV cache (both engines take the same name)")
    m.add_argument("--max-model-len", type=int, default=8192)
    m.add_argument("--prefix-caching", action="store_true",
                   help="decode, bound and prefill with prefix caching on (its bookkeeping and the states it "
                        "snapshots; random prompts, so nothing is found in the cache)")
    m.add_argument("--load-format", choices=["auto", "safetensors", "dummy"], default="auto",
                   help="dummy: random weights from config.json alone (a `write --no-weights` model; the "
                        "weights-bandwidth bound still holds, outputs are not meaningful)")
    m.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    m.add_argument("--vllm-mamba-cache-mode", choices=["align", "all"], default=None,
                   help="vLLM's mamba_cache_mode with prefix caching on (default: align for the GDN models, vLLM's "
                        "own choice for Nemotron-H, 'all')")
    m.add_argument("--vllm-gdn-prefill-backend", choices=["flashinfer", "triton"], default=None,
                   help="vLLM's --gdn-prefill-backend (default: its own choice, FlashInfer on Hopper)")
    q = sub.add_parser("quantize", help="copy a written checkpoint and quantize its linear layers to FP8")
    q.add_argument("--src", required=True)
    q.add_argument("--out", required=True)
    q.add_argument("--format", choices=["ct_dynamic", "block"], default="ct_dynamic",
                   help="compressed-tensors FP8_DYNAMIC (channel weights, per-token activations) or Qwen's block FP8")
    b = sub.add_parser("cache-bound", help="the screenshot trace's prompt tokens any prefix cache could serve")
    b.add_argument("--model", required=True, help="a --vision real checkpoint (write --no-weights is enough)")
    b.add_argument("--agent-scale", choices=["full", "tiny"], default="full")
    b.add_argument("--agent-concurrency", type=int, default=None)
    b.add_argument("--out", default=None)
    r = sub.add_parser("report")
    r.add_argument("files", nargs="+")
    r.add_argument("--out", default="benchmarks/results/h200")
    mr = sub.add_parser("moe-report", help="issue 31: one table of the MoE shapes' figures of both engines, with "
                                           "ratios (measure files and spec_decode_bench.py's spec_decode.json)")
    mr.add_argument("files", nargs="+")
    mr.add_argument("--out", required=True)
    mr.add_argument("--rate", type=float, default=0.8, help="the planted rate of the MTP rows taken")
    mr.add_argument("--title", default=MOE_TITLE, help="the table's heading")
    s = sub.add_parser("synthetic-mtp", help="print vLLM's synthetic MTP speculative config (synthetic_mtp_config)")
    s.add_argument("--k", type=int, default=3)
    s.add_argument("--rate", type=float, default=0.8)
    return ap


def main() -> int:
    args = build_parser().parse_args()
    if args.cmd == "write":
        write(args.shape, args.out, args.device, vision=args.vision, weights=not args.no_weights, fp8=args.fp8)
    elif args.cmd == "quantize":
        quantize(args.src, args.out, args.format)
    elif args.cmd == "measure":
        return measure(args)
    elif args.cmd == "cache-bound":
        cache_bound(args.model, args.agent_scale, args.agent_concurrency, args.out)
    elif args.cmd == "moe-report":
        moe_report(args.files, args.out, args.rate, args.title)
    elif args.cmd == "synthetic-mtp":
        print(json.dumps(synthetic_mtp_config(args.k, args.rate)))
    else:
        report(args.files, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

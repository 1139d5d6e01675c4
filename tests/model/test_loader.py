"""Weight loading, tokenizer, stop ids and incremental detokenization on tiny written checkpoints.

Loads go into transformers' own ``Qwen3_5ForCausalLM`` (same parameter names as the engine's model) and are compared
with transformers' ``from_pretrained`` of the same directory.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer, Qwen3_5ForCausalLM, Qwen3_5TextConfig

from hyserve.model.loader import load_weights
from hyserve.model.registry import load_model_config
from hyserve.testing import (
    CHAT_TEMPLATE,
    ENDOFTEXT,
    IM_END,
    IM_START,
    load_reference_model,
    read_checkpoint_tensors,
    reference_greedy_check,
    reference_logits,
    special_token_ids,
    tokenizer_size,
    write_tiny_checkpoint,
)
from hyserve.tokenizer import IncrementalDetokenizer, Tokenizer, load_generation_config, stop_token_ids

MULTIBYTE_TEXT = "Hello 😀 world! 你好，世界。 naïve café 🚀🔥 def f(x):\n    return x  # ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"


def _fresh_model(model_dir: str, dtype: torch.dtype = torch.float32) -> Qwen3_5ForCausalLM:
    """A randomly initialized transformers model with the checkpoint's shapes (both forms' configs load)."""
    return Qwen3_5ForCausalLM(Qwen3_5TextConfig.from_pretrained(model_dir)).to(dtype).eval()


def _load(model_dir: str, dtype: torch.dtype = torch.float32) -> tuple[Qwen3_5ForCausalLM, dict[str, torch.Tensor]]:
    model = _fresh_model(model_dir, dtype)
    mtp = load_weights(model, model_dir, load_model_config(model_dir))
    return model, mtp


def _rewrite_weights(model_dir: str, tensors: dict[str, torch.Tensor]) -> None:
    for name in os.listdir(model_dir):
        if name.endswith(".safetensors") or name.endswith(".index.json"):
            os.remove(os.path.join(model_dir, name))
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(model_dir, "model.safetensors"))


def _edit_json(path: str, **updates: object) -> None:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    for key, value in updates.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)


# ----------------------------------------------------------------------------------------------- checkpoints


def test_checkpoint_writing_is_fast_and_deterministic(tmp_path: Path) -> None:
    t0 = time.perf_counter()
    a = write_tiny_checkpoint(tmp_path / "a", seed=3)
    assert time.perf_counter() - t0 < 1.0
    b = write_tiny_checkpoint(tmp_path / "b", seed=3)
    c = write_tiny_checkpoint(tmp_path / "c", seed=4)
    ta, tb, tc = (read_checkpoint_tensors(d) for d in (a, b, c))
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    assert not torch.equal(ta["model.embed_tokens.weight"], tc["model.embed_tokens.weight"])
    with open(os.path.join(a, "tokenizer.json")) as fa, open(os.path.join(c, "tokenizer.json")) as fc:
        assert fa.read() == fc.read()


@pytest.mark.parametrize("form", ["causal", "conditional"])
def test_config_parses_both_forms(tmp_path: Path, form: str) -> None:
    d = write_tiny_checkpoint(tmp_path, form=form, tie_word_embeddings=True, with_mtp=True, dtype=torch.bfloat16)
    cfg = load_model_config(d)
    assert cfg.architecture == ("Qwen3_5ForCausalLM" if form == "causal" else "Qwen3_5ForConditionalGeneration")
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert (cfg.hidden_size, cfg.head_dim, cfg.partial_rotary_factor, cfg.rope_theta) == (64, 16, 0.5, 10000.0)
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.conv_dim) == (2, 4, 128)
    assert cfg.tie_word_embeddings and cfg.mtp_num_hidden_layers == 1
    assert cfg.eos_token_id == [special_token_ids()[ENDOFTEXT]]
    assert cfg.torch_dtype == "bfloat16"
    assert cfg.vocab_size >= tokenizer_size()
    if form == "causal":
        assert cfg.multimodal is None
    else:
        mm = cfg.multimodal
        assert mm is not None and (mm.image_token_id, mm.vision_start_token_id, mm.vision_end_token_id) == (
            248056, 248053, 248054)
        assert mm.vision_config["depth"] == 1 and mm.vision_config["patch_size"] == 4
        assert mm.mrope_section == (11, 11, 10)  # the tiny config names none: transformers' default


def test_mrope_section_is_read_and_a_bad_one_named(tmp_path: Path) -> None:
    d = write_tiny_checkpoint(tmp_path, form="conditional")
    path = os.path.join(d, "config.json")
    with open(path) as f:
        raw = json.load(f)
    raw["text_config"]["rope_parameters"] = {"rope_type": "mrope", "mrope_section": [6, 5, 5]}
    with open(path, "w") as f:
        json.dump(raw, f)
    mm = load_model_config(d).multimodal
    assert mm is not None and mm.mrope_section == (6, 5, 5)
    raw["text_config"]["rope_parameters"]["mrope_section"] = [8, 8]
    with open(path, "w") as f:
        json.dump(raw, f)
    with pytest.raises(ValueError, match="mrope_section must be three"):
        load_model_config(d)


def test_reference_model_logits_are_spread(tmp_path: Path) -> None:
    d = write_tiny_checkpoint(tmp_path, tie_word_embeddings=True)
    ref = load_reference_model(d)
    ids = list(range(10, 40))
    logits = reference_logits(ref, ids)
    assert logits.shape == (30, 512) and logits.dtype == torch.float32
    assert float(logits.std(dim=-1).min()) > 1.0
    argmax = logits.argmax(dim=-1)
    assert len(set(argmax.tolist())) > 20  # not one token everywhere
    assert float((argmax == torch.tensor(ids)).float().mean()) < 0.2  # tokens do not just predict themselves


def test_reference_greedy_check(tmp_path: Path) -> None:
    ref = load_reference_model(write_tiny_checkpoint(tmp_path))
    prompt = [5, 6, 7]
    out: list[int] = []
    for _ in range(3):
        out.append(int(reference_logits(ref, prompt + out)[-1].argmax()))
    logits = reference_greedy_check(ref, prompt, out)
    assert logits.shape == (3, 512) and logits.argmax(dim=-1).tolist() == out
    wrong = [*out[:1], (out[1] + 1) % 512, out[2]]
    with pytest.raises(AssertionError, match="output token 1"):
        reference_greedy_check(ref, prompt, wrong)


# ----------------------------------------------------------------------------------------------- loading


@pytest.mark.parametrize("form", ["causal", "conditional"])
@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("tie", [False, True])
def test_load_matches_transformers(tmp_path: Path, form: str, sharded: bool, tie: bool) -> None:
    d = write_tiny_checkpoint(tmp_path, form=form, sharded=sharded, tie_word_embeddings=tie, seed=7)
    if sharded:
        assert os.path.isfile(os.path.join(d, "model.safetensors.index.json"))
        assert len([f for f in os.listdir(d) if f.endswith(".safetensors")]) == 3
    model, mtp = _load(d)
    ref = load_reference_model(d)
    got, want = model.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    assert mtp == {}


def test_loaded_model_logits_match_reference(tmp_path: Path) -> None:
    d = write_tiny_checkpoint(tmp_path, form="conditional", tie_word_embeddings=True, with_mtp=True)
    model, _ = _load(d)
    ids = [1, 2, 3, 4, 5]
    torch.testing.assert_close(reference_logits(model, ids), reference_logits(load_reference_model(d), ids))


def test_submodule_aliases_load_once(tmp_path: Path) -> None:
    """A model may register one mixer under two names (``linear_attn`` and ``mixer``): each tensor is one target."""
    d = write_tiny_checkpoint(tmp_path, tie_word_embeddings=True)
    model = _fresh_model(d)
    for layer in model.model.layers:
        layer.mixer = layer.linear_attn if hasattr(layer, "linear_attn") else layer.self_attn
    load_weights(model, d, load_model_config(d))
    on_disk = read_checkpoint_tensors(d)
    for name, param in model.named_parameters():
        assert torch.equal(param, on_disk[name]), name


def test_visual_tensors_skipped_with_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    d = write_tiny_checkpoint(tmp_path, form="conditional", sharded=True)
    assert any(k.startswith("model.visual.") for k in read_checkpoint_tensors(d))
    with caplog.at_level(logging.WARNING, logger="hyserve.model.loader"):
        _load(d)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1  # a model without a vision tower: the 21 tensors of the tiny tower are skipped
    assert "21 vision-tower tensors" in warnings[0].getMessage()


def test_vision_tower_loads_into_a_model_that_holds_one(tmp_path: Path) -> None:
    """hyserve's model of a checkpoint with a vision_config holds the tower: model.visual.X loads into visual.X, and
    the tower is complete (a checkpoint lacking one of its tensors is refused, naming it)."""
    from hyserve.model.qwen3_5 import Qwen3_5ForCausalLM as HyModel

    d = write_tiny_checkpoint(tmp_path / "ok", form="conditional")
    cfg = load_model_config(d)
    model = HyModel(cfg).eval()
    load_weights(model, d, cfg)
    on_disk = read_checkpoint_tensors(d)
    assert model.visual is not None
    for name, param in model.visual.state_dict().items():
        assert torch.equal(param, on_disk[f"model.visual.{name}"]), name
    tensors = dict(on_disk)
    del tensors["model.visual.merger.linear_fc2.weight"]
    _rewrite_weights(d, tensors)
    with pytest.raises(ValueError, match=r"visual\.merger\.linear_fc2\.weight"):
        load_weights(HyModel(cfg).eval(), d, cfg)


def test_causal_form_loads_without_warnings(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    d = write_tiny_checkpoint(tmp_path, with_mtp=True)
    with caplog.at_level(logging.WARNING, logger="hyserve.model.loader"):
        _load(d)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("form", ["causal", "conditional"])
def test_mtp_tensors_returned_in_model_dtype(tmp_path: Path, form: str) -> None:
    d = write_tiny_checkpoint(tmp_path, form=form, with_mtp=True, sharded=True)
    on_disk = {k: v for k, v in read_checkpoint_tensors(d).items() if k.startswith("mtp.")}
    model, mtp = _load(d, torch.bfloat16)
    assert mtp.keys() == on_disk.keys()
    assert "mtp.fc.weight" in mtp and mtp["mtp.fc.weight"].shape == (64, 128)
    assert "mtp.layers.0.self_attn.q_proj.weight" in mtp and "mtp.pre_fc_norm_hidden.weight" in mtp
    for name, tensor in mtp.items():
        assert tensor.dtype == torch.bfloat16 and tensor.device == model.lm_head.weight.device
        assert torch.equal(tensor, on_disk[name].to(torch.bfloat16)), name
    assert not any("mtp" in n for n, _ in model.named_parameters())


@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16])
def test_dtype_conversion_into_half_model(tmp_path: Path, model_dtype: torch.dtype) -> None:
    d = write_tiny_checkpoint(tmp_path, form="conditional")
    model, _ = _load(d, model_dtype)
    ref = load_reference_model(d)
    for name, tensor in ref.state_dict().items():
        got = model.state_dict()[name]
        assert got.dtype == model_dtype
        assert torch.equal(got, tensor.to(model_dtype)), name


def test_bfloat16_checkpoint_into_float32_model(tmp_path: Path) -> None:
    d = write_tiny_checkpoint(tmp_path, dtype=torch.bfloat16, with_mtp=True)
    on_disk = read_checkpoint_tensors(d)
    assert on_disk["model.norm.weight"].dtype == torch.bfloat16
    model, mtp = _load(d, torch.float32)
    for name, tensor in model.state_dict().items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, on_disk[name].float()), name
    assert mtp["mtp.fc.weight"].dtype == torch.float32


def test_tied_checkpoint_with_lm_head_ignores_it(tmp_path: Path) -> None:
    d = write_tiny_checkpoint(tmp_path, tie_word_embeddings=True)
    tensors = read_checkpoint_tensors(d)
    assert "lm_head.weight" not in tensors  # tied checkpoints are saved without it
    tensors["lm_head.weight"] = torch.randn(512, 64)
    _rewrite_weights(d, tensors)
    model, _ = _load(d)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.model.embed_tokens.weight, tensors["model.embed_tokens.weight"])


def test_tied_config_fills_a_separate_lm_head(tmp_path: Path) -> None:
    d = write_tiny_checkpoint(tmp_path, tie_word_embeddings=True)
    untied_model = Qwen3_5ForCausalLM(Qwen3_5TextConfig.from_pretrained(d, tie_word_embeddings=False))
    assert untied_model.lm_head.weight is not untied_model.model.embed_tokens.weight
    load_weights(untied_model, d, load_model_config(d))
    assert torch.equal(untied_model.lm_head.weight, read_checkpoint_tensors(d)["model.embed_tokens.weight"])


def test_progress_bar(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = write_tiny_checkpoint(tmp_path)
    cfg = load_model_config(d)
    load_weights(_fresh_model(d), d, cfg)  # small checkpoint: no bar by default
    assert "Loading weights" not in capsys.readouterr().err
    load_weights(_fresh_model(d), d, cfg, show_progress=True)
    assert "Loading weights" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------- errors


def test_missing_directory(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        load_model_config(missing)
    d = write_tiny_checkpoint(tmp_path / "ok")
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        load_weights(_fresh_model(d), missing, load_model_config(d))


def test_missing_config_json(tmp_path: Path) -> None:
    d = write_tiny_checkpoint(tmp_path)
    os.remove(os.path.join(d, "config.json"))
    with pytest.raises(FileNotFoundError, match=r"config\.json\ not\ found"):
        load_model_config(d)


def test_unsupported_architecture(tmp_path: Path) -> None:
    d = write_tiny_checkpoint(tmp_path)
    _edit_json(os.path.join(d, "config.json"), architectures=["LlamaForCausalLM"])
    with pytest.raises(ValueError, match="LlamaForCausalLM") as err:
        load_model_config(d)
    assert "Qwen3_5ForCausalLM" in str(err.value) and "Qwen3_5ForConditionalGeneration" in str(err.value)


def test_no_safetensors_files(tmp_path: Path) -> None:
    d = write_tiny_checkpoint(tmp_path)
    model, cfg = _fresh_model(d), load_model_config(d)
    os.remove(os.path.join(d, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="no safetensors weights"):
        load_weights(model, d, cfg)
    Path(d, "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"pytorch_model\.bin"):
        load_weights(model, d, cfg)


def test_index_references_missing_shard(tmp_path: Path) -> None:
    d = write_tiny_checkpoint(tmp_path, sharded=True)
    model, cfg = _fresh_model(d), load_model_config(d)
    os.remove(os.path.join(d, "model-00002-of-00003.safetensors"))
    with pytest.raises(FileNotFoundError, match=r"model\-00002\-of\-00003\.safetensors"):
        load_weights(model, d, cfg)


@pytest.mark.parametrize("form", ["causal", "conditional"])
def test_missing_tensors_listed(tmp_path: Path, form: str) -> None:
    """Named as the checkpoint names its tensors (the conditional form's text model is model.language_model.*)."""
    d = write_tiny_checkpoint(tmp_path, form=form)
    tensors = read_checkpoint_tensors(d)
    prefix = "model.layers.1." if form == "causal" else "model.language_model.layers.1."
    dropped = sorted(k for k in tensors if k.startswith(prefix))[:7]
    assert len(dropped) == 7
    _rewrite_weights(d, {k: v for k, v in tensors.items() if k not in dropped})
    with pytest.raises(ValueError, match="missing tensor") as err:
        _load(d)
    msg = str(err.value)
    assert sum(repr(name) in msg for name in dropped) == 5 and "and 2 more" in msg and "(7 in total)" in msg


def test_missing_lm_head_when_untied(tmp_path: Path) -> None:
    d = write_tiny_checkpoint(tmp_path, form="conditional")
    tensors = read_checkpoint_tensors(d)
    del tensors["lm_head.weight"]
    _rewrite_weights(d, tensors)
    with pytest.raises(ValueError, match=r"missing tensor.*'lm_head.weight'.*tie_word_embeddings=False"):
        _load(d)


def test_unexpected_tensor(tmp_path: Path) -> None:
    d = write_tiny_checkpoint(tmp_path, form="conditional")
    tensors = read_checkpoint_tensors(d)
    tensors["model.language_model.layers.0.mlp.bias_extra"] = torch.zeros(3)
    _rewrite_weights(d, tensors)
    with pytest.raises(ValueError, match=r"unexpected tensor.*model\.language_model\.layers\.0\.mlp\.bias_extra"):
        _load(d)


def test_shape_mismatch_names_both_shapes_and_loads_nothing(tmp_path: Path) -> None:
    d = write_tiny_checkpoint(tmp_path)
    tensors = read_checkpoint_tensors(d)
    name = "model.layers.0.linear_attn.conv1d.weight"
    assert tuple(tensors[name].shape) == (128, 1, 4)
    tensors[name] = torch.zeros(128, 4)
    _rewrite_weights(d, tensors)
    model = _fresh_model(d)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"shape mismatch for 'model\.layers\.0\.linear_attn\.conv1d\.weight'") as err:
        load_weights(model, d, load_model_config(d))
    assert "[128, 4]" in str(err.value) and "[128, 1, 4]" in str(err.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # checked before copying


def test_duplicate_tensor_from_both_prefixes(tmp_path: Path) -> None:
    d = write_tiny_checkpoint(tmp_path)
    tensors = read_checkpoint_tensors(d)
    tensors["model.language_model.norm.weight"] = tensors["model.norm.weight"].clone()
    _rewrite_weights(d, tensors)
    with pytest.raises(ValueError, match=r"two\ tensors\ for\ 'model\.norm\.weight'"):
        _load(d)


def test_model_tied_but_config_untied(tmp_path: Path) -> None:
    d = write_tiny_checkpoint(tmp_path)
    tied = Qwen3_5ForCausalLM(Qwen3_5TextConfig.from_pretrained(d, tie_word_embeddings=True))
    with pytest.raises(ValueError, match="tie_word_embeddings=False"):
        load_weights(tied, d, load_model_config(d))


# ----------------------------------------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tok"), form="conditional")


@pytest.fixture(scope="module")
def tok(tok_dir: str) -> Tokenizer:
    return Tokenizer.from_model_dir(tok_dir)


def test_encode_decode_round_trip(tok: Tokenizer) -> None:
    ids = tok.encode(MULTIBYTE_TEXT)
    assert len(ids) < len(MULTIBYTE_TEXT.encode())  # merges happen
    assert tok.decode(ids) == MULTIBYTE_TEXT
    assert tok.vocab_size == tokenizer_size() == 451
    assert all(0 <= i < tok.vocab_size for i in ids)


def test_encode_matches_transformers_autotokenizer(tok: Tokenizer, tok_dir: str) -> None:
    auto = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    assert tok.encode(MULTIBYTE_TEXT) == auto.encode(MULTIBYTE_TEXT)


def test_special_tokens(tok: Tokenizer) -> None:
    ids = special_token_ids()
    assert tok.eos_token_id == ids[IM_END]
    encoded = tok.encode(f"{IM_START}user\nhi{IM_END}")
    assert encoded[0] == ids[IM_START] and encoded[-1] == ids[IM_END]
    assert tok.decode(encoded, skip_special_tokens=False) == f"{IM_START}user\nhi{IM_END}"
    assert tok.decode(encoded) == "user\nhi"


def test_chat_template(tok: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = tok.apply_chat_template(messages)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    assert not tok.apply_chat_template(messages, add_generation_prompt=False).endswith("assistant\n")


def test_chat_template_jinja_file(tmp_path: Path) -> None:
    d = write_tiny_checkpoint(tmp_path)
    _edit_json(os.path.join(d, "tokenizer_config.json"), chat_template=None)
    Path(d, "chat_template.jinja").write_text("JINJA:" + CHAT_TEMPLATE, encoding="utf-8")
    text = Tokenizer.from_model_dir(d).apply_chat_template([{"role": "user", "content": "x"}])
    assert text == "JINJA:<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"


def test_no_chat_template(tmp_path: Path) -> None:
    d = write_tiny_checkpoint(tmp_path)
    _edit_json(os.path.join(d, "tokenizer_config.json"), chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_model_dir(d).apply_chat_template([{"role": "user", "content": "x"}])


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    d = write_tiny_checkpoint(tmp_path)
    os.remove(os.path.join(d, "tokenizer.json"))
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json\ not\ found"):
        Tokenizer.from_model_dir(d)


def test_stop_token_ids_union(tmp_path: Path) -> None:
    ids = special_token_ids()
    d = write_tiny_checkpoint(tmp_path)
    cfg = load_model_config(d)
    assert load_generation_config(d)["eos_token_id"] == [ids[IM_END], ids[ENDOFTEXT]]
    assert stop_token_ids(d, cfg) == [ids[IM_END], ids[ENDOFTEXT]]
    _edit_json(os.path.join(d, "generation_config.json"), eos_token_id=7)
    assert stop_token_ids(d, cfg) == [7, ids[ENDOFTEXT], ids[IM_END]]
    os.remove(os.path.join(d, "generation_config.json"))
    assert load_generation_config(d) == {}
    assert stop_token_ids(d, cfg) == [ids[ENDOFTEXT], ids[IM_END]]
    os.remove(os.path.join(d, "tokenizer.json"))  # no tokenizer: the config's ids only
    assert stop_token_ids(d, dataclasses.replace(cfg, eos_token_id=[3, 3])) == [3]


# ----------------------------------------------------------------------------------------------- detokenizer


@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_detokenizer_matches_full_decode(tok: Tokenizer, chunk: int) -> None:
    prompt = tok.encode(f"{IM_START}user\nSay hi{IM_END}\n{IM_START}assistant\n")
    output = tok.encode(MULTIBYTE_TEXT * 2)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.append(output[i:i + chunk]) for i in range(0, len(output), chunk)]
    assert "".join(deltas) == detok.text == tok.decode(output)
    assert all(REPLACEMENT not in d for d in deltas)
    if chunk == 1:
        assert "" in deltas  # some token ended inside a multi-byte character and was held back


REPLACEMENT = "\ufffd"


def test_incremental_detokenizer_special_tokens(tok: Tokenizer) -> None:
    output = [*tok.encode("Hi 你好"), special_token_ids()[IM_END]]
    skip = IncrementalDetokenizer(tok, [], skip_special_tokens=True)
    keep = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    for t in output:
        skip.append([t])
        keep.append([t])
    assert skip.text == "Hi 你好"
    assert keep.text == "Hi 你好" + IM_END


def test_incremental_detokenizer_flush_and_window(tok: Tokenizer) -> None:
    emoji_ids = tok.encode("😀")
    assert len(emoji_ids) > 1  # the emoji is split into byte tokens
    detok = IncrementalDetokenizer(tok, tok.encode("prompt"))
    assert detok.append([*tok.encode("ok "), emoji_ids[0]]) == "ok "
    assert detok.flush() == REPLACEMENT
    assert detok.text == "ok " + REPLACEMENT

    long = IncrementalDetokenizer(tok, [])
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 60)
    for t in ids:
        long.append([t])
        assert len(long._ids) <= IncrementalDetokenizer._TRIM_AT + 8  # bounded: O(window), not O(output)
    assert long.text == tok.decode(ids)


def test_merged_projections_take_their_rows(tmp_path: Path) -> None:
    """hyserve's model runs one GEMM for in_proj_qkv/z/b/a and one for gate/up: each checkpoint tensor lands in
    its own rows of the merged weight, and the merged output splits back into the separate projections."""
    from hyserve.model.loader import checkpoint_tensors
    from hyserve.model.qwen3_5 import Qwen3_5ForCausalLM as HyModel

    d = write_tiny_checkpoint(tmp_path, form="conditional", seed=9)
    cfg = load_model_config(d)
    model = HyModel(cfg).eval()
    load_weights(model, d, cfg)
    on_disk = {("model." + k[len("model.language_model."):] if k.startswith("model.language_model.") else k): v
               for k, v in read_checkpoint_tensors(d).items() if not k.startswith(("model.visual.", "mtp."))}
    views = {k: v for k, v in checkpoint_tensors(model).items() if not k.startswith("visual.")}
    assert "model.layers.0.linear_attn.in_proj_z.weight" in views and "model.layers.0.mlp.up_proj.weight" in views
    assert views.keys() == on_disk.keys()
    for name, tensor in on_disk.items():
        assert torch.equal(views[name], tensor), name
    gdn = model.model.layers[0].linear_attn
    x = torch.randn(3, cfg.hidden_size)
    parts = gdn.in_proj.split(gdn.in_proj(x))
    for (name, _), got in zip(gdn.in_proj.parts, parts, strict=True):
        want = x @ on_disk[f"model.layers.0.linear_attn.{name}.weight"].T
        torch.testing.assert_close(got, want)

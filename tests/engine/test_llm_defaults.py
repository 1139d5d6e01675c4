"""Default sampling parameters from the checkpoint's generation_config.json, as vLLM's ``--generation-config``:
``auto`` (the checkpoint's file), ``vllm`` (none) or a directory; ``LLM.generate`` without SamplingParams uses them."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest

from hyserve import LLM, SamplingParams
from hyserve.llm import DEFAULT_MODEL_DIR
from hyserve.testing.families import CheckpointCache
from hyserve.tokenizer import generation_defaults

POOLS = {"num_kv_blocks": 64, "num_state_slots": 4}


def _with_generation_config(src: str, dst: str, values: dict) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "generation_config.json")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    data.update(values)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)
    return dst


def test_packaged_model_caps_requests_without_max_tokens() -> None:
    defaults, source = generation_defaults(DEFAULT_MODEL_DIR)
    assert defaults == {"max_tokens": 256} and source is not None
    llm = LLM(device="cpu", **POOLS)
    assert llm.get_default_sampling_params().max_tokens == 256
    assert llm.llm_engine.default_sampling_params == {"max_tokens": 256}


def test_auto_applies_the_checkpoint_file(ckpts: CheckpointCache, tmp_path: object,
                                          caplog: pytest.LogCaptureFixture) -> None:
    path = _with_generation_config(ckpts.get(), os.path.join(str(tmp_path), "m"), {
        "temperature": 0.0, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "max_new_tokens": 5, "do_sample": True,
        "repetition_penalty": 1.0})
    with caplog.at_level(logging.INFO, logger="hyserve"):
        llm = LLM(model=path, device="cpu", **POOLS)
    want = {"temperature": 0.0, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "max_tokens": 5, "repetition_penalty": 1.0}
    assert llm.llm_engine.default_sampling_params == want
    assert any("default sampling parameters from" in r.getMessage() and "'max_tokens': 5" in r.getMessage()
               for r in caplog.records)
    p = llm.get_default_sampling_params()
    assert isinstance(p, SamplingParams) and p.max_tokens == 5 and p.temperature == 0.0
    out = llm.generate({"prompt_token_ids": [3, 4, 5, 6]}, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) <= 5 and (len(out.token_ids) == 5) == (out.finish_reason == "length")
    # The engine's add_request without params takes the same defaults.
    eng = llm.llm_engine
    eng.add_request("d", {"prompt_token_ids": [3, 4, 5, 6]})
    assert eng.requests["d"].sampling_params == p
    eng.abort_request("d")


def test_vllm_ignores_the_file_and_a_directory_replaces_it(ckpts: CheckpointCache, tmp_path: object) -> None:
    path = _with_generation_config(ckpts.get(), os.path.join(str(tmp_path), "m"), {"max_new_tokens": 5})
    plain = LLM(model=path, device="cpu", generation_config="vllm", **POOLS)
    assert plain.llm_engine.default_sampling_params == {}
    assert plain.get_default_sampling_params() == SamplingParams()
    other = _with_generation_config(ckpts.get(), os.path.join(str(tmp_path), "other"), {"max_new_tokens": 9,
                                                                                          "temperature": 0.3})
    llm = LLM(model=path, device="cpu", generation_config=other, **POOLS)
    assert llm.llm_engine.default_sampling_params == {"max_tokens": 9, "temperature": 0.3}
    with pytest.raises(FileNotFoundError, match=r"no generation_config\.json"):
        LLM(model=path, device="cpu", generation_config=str(tmp_path), **POOLS)


def test_the_file_s_repetition_penalty_is_applied(ckpts: CheckpointCache, tmp_path: object) -> None:
    path = _with_generation_config(ckpts.get(), os.path.join(str(tmp_path), "m"), {"repetition_penalty": 1.3})
    llm = LLM(model=path, device="cpu", **POOLS)
    assert llm.llm_engine.default_sampling_params == {"repetition_penalty": 1.3}
    assert llm.get_default_sampling_params().repetition_penalty == 1.3


def test_bad_value_in_the_file_fails_at_startup(ckpts: CheckpointCache, tmp_path: object) -> None:
    path = _with_generation_config(ckpts.get(), os.path.join(str(tmp_path), "m"), {"top_p": 7})
    with pytest.raises(ValueError, match="top_p"):
        LLM(model=path, device="cpu", **POOLS)

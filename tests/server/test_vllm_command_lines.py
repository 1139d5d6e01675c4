"""vLLM's command lines run unchanged with ``hyserve`` in place of ``vllm``: the two reported lines (a single-GPU MTP
server with image input, and a four-stage pipeline with an uneven layer split, MTP 4 and FULL_AND_PIECEWISE) build
the engine config they mean; dotted sub-options and JSON forms give equal configs; each flag served by construction
logs exactly one INFO line; a flag or value hyserve cannot honour is refused, named. Argument parsing and config
building only: no model runs."""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
from pathlib import Path

import pytest

from hyserve import cli
from hyserve.config import EngineConfig
from hyserve.distributed.parallel_state import layer_partition
from hyserve.engine_args import PP_PARTITION_ENV, expand_dotted, llm_kwargs
from hyserve.model.registry import load_model_config
from hyserve.speculative.config import SpeculativeConfig
from hyserve.testing import write_tiny_checkpoint

# Issue report 2's line, MODEL a placeholder.
SEED_2 = ("serve MODEL --served-model-name path-mini --port 8000 --max-model-len 62768 --max-num-seqs 32 "
          "--gpu-memory-utilization 0.95 --enable-chunked-prefill --limit-mm-per-prompt.image 10 "
          "--enable-prefix-caching --mamba-cache-mode align "
          "--speculative-config '{\"method\": \"mtp\", \"num_speculative_tokens\": 2}'")
# Issue report 1's configuration: PP 4 split 13,13,13,9 (VLLM_PP_LAYER_PARTITION), MTP 4, prefix caching, align,
# FULL_AND_PIECEWISE, max_num_seqs 8.
SEED_1 = ("serve MODEL --pipeline-parallel-size 4 --max-num-seqs 8 --enable-prefix-caching --mamba-cache-mode align "
          "--speculative-config '{\"method\": \"mtp\", \"num_speculative_tokens\": 4}' "
          "--compilation-config '{\"cudagraph_mode\": \"FULL_AND_PIECEWISE\"}'")
SEED_1_PARTITION = "13,13,13,9"
LOGGER = "hyserve.engine_args"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny image-input checkpoint with an MTP head and report 1's 48 decoder layers."""
    types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 12
    return write_tiny_checkpoint(tmp_path_factory.mktemp("vllm_lines") / "ckpt", form="conditional",
                                 layer_types=types, with_mtp=True)


@pytest.fixture(autouse=True)
def no_vllm_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [k for k in os.environ if k.startswith("VLLM_")]:
        monkeypatch.delenv(name)


def config_of(line: str, model: str) -> EngineConfig:
    """The engine config ``hyserve <line>`` starts (MODEL replaced by ``model``), validated."""
    args = cli.build_parser().parse_args(shlex.split(line.replace("MODEL", model)))
    config = EngineConfig(model=model, **llm_kwargs(args, model))
    config.validate()
    return config


def info_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.INFO]


# ------------------------------------------------------------------------------------------------ the two seeds


def test_report_2_line_means_the_same(model: str, caplog: pytest.LogCaptureFixture) -> None:
    args = cli.build_parser().parse_args(shlex.split(SEED_2.replace("MODEL", model)))
    assert (args.served_model_name, args.port, args.model) == ("path-mini", 8000, model)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        config = EngineConfig(model=model, **llm_kwargs(args, model))
    config.validate()
    assert config.max_model_len == 62768 and config.max_num_seqs == 32
    assert config.gpu_memory_utilization == 0.95
    assert config.enable_prefix_caching is True
    assert config.limit_mm_per_prompt == {"image": 10} and config.image_limit == 10
    spec = SpeculativeConfig.from_dict(config.speculative_config or {}, load_model_config(model))
    assert (spec.method, spec.num_speculative_tokens) == ("mtp", 2)
    assert config.pipeline_parallel_size == 1 and config.pp_layer_partition is None
    assert config.enforce_eager is False  # CUDA graphs on, as vLLM's default
    lines = info_lines(caplog)
    assert len(lines) == 2, lines
    assert sum("--enable-chunked-prefill" in m for m in lines) == 1
    assert sum("--mamba-cache-mode align" in m for m in lines) == 1


def test_report_1_line_means_the_same(model: str, monkeypatch: pytest.MonkeyPatch,
                                      caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(PP_PARTITION_ENV, SEED_1_PARTITION)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        config = config_of(SEED_1, model)
    assert config.pipeline_parallel_size == 4 and config.world_size == 4
    assert config.pp_layer_partition == [13, 13, 13, 9]
    assert layer_partition(48, 4, config.pp_layer_partition) == [13, 13, 13, 9]
    spec = SpeculativeConfig.from_dict(config.speculative_config or {}, load_model_config(model))
    assert (spec.method, spec.num_speculative_tokens) == ("mtp", 4)
    assert config.enable_prefix_caching is True and config.max_num_seqs == 8
    assert config.enforce_eager is False
    lines = info_lines(caplog)
    assert sum("cudagraph_mode=FULL_AND_PIECEWISE" in m and "decode" in m for m in lines) == 1, lines
    assert sum(PP_PARTITION_ENV in m for m in lines) == 1
    # Without the variable the split is the even one, which is not report 1's.
    monkeypatch.delenv(PP_PARTITION_ENV)
    assert config_of(SEED_1, model).pp_layer_partition is None
    assert layer_partition(48, 4) == [12, 12, 12, 12]


def test_report_2_environment(model: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Report 2 exports VLLM_NO_USAGE_STATS=1 and VLLM_USE_FLASHINFER_SAMPLER=0: one INFO line each, saying why
    they change nothing; a VLLM_* variable hyserve does not know is named in a WARNING, never passed over."""
    monkeypatch.setenv("VLLM_NO_USAGE_STATS", "1")
    monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", "0")
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "FLASHINFER")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        config = config_of(f"serve {model}", model)
    monkeypatch.delenv("VLLM_NO_USAGE_STATS")
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER")
    monkeypatch.delenv("VLLM_ATTENTION_BACKEND")
    assert config == config_of(f"serve {model}", model)
    lines = info_lines(caplog)
    assert len(lines) == 2 and all("nothing to change" in m for m in lines), lines
    assert sum(m.startswith("VLLM_NO_USAGE_STATS=1") for m in lines) == 1
    assert sum(m.startswith("VLLM_USE_FLASHINFER_SAMPLER=0") for m in lines) == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["VLLM_ATTENTION_BACKEND is set but not read: no environment variable of that name changes "
                        "hyserve (docs/vllm_flags.md)"]


@pytest.mark.parametrize("value, says", [
    ("13,13,13,10", "sums to 49 layers"),
    ("16,16,16", "has 3 entries for pipeline_parallel_size=4"),
    ("13,13,x,9", "layer counts separated by commas"),
    ("13,13,22,0", "at least one layer"),
])
def test_partition_variable_mismatch_is_refused(model: str, monkeypatch: pytest.MonkeyPatch, value: str,
                                                says: str) -> None:
    monkeypatch.setenv(PP_PARTITION_ENV, value)
    with pytest.raises(ValueError, match=PP_PARTITION_ENV) as info:
        config_of(SEED_1, model)
    assert says in str(info.value)


def test_partition_variable_and_flag(model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PP_PARTITION_ENV, SEED_1_PARTITION)
    assert config_of(SEED_1 + " --pp-layer-partition 13,13,13,9", model).pp_layer_partition == [13, 13, 13, 9]
    with pytest.raises(ValueError, match=f"--pp-layer-partition 12,12,12,12 contradicts {PP_PARTITION_ENV}"):
        config_of(SEED_1 + " --pp-layer-partition 12,12,12,12", model)


# ------------------------------------------------------------------------------------------ dotted and JSON forms


@pytest.mark.parametrize("dotted, json_form", [
    ("--limit-mm-per-prompt.image 10", "--limit-mm-per-prompt '{\"image\": 10}'"),
    ("--limit-mm-per-prompt.image=10", "--limit-mm-per-prompt '{\"image\": {\"count\": 10}}'"),
    ("--speculative-config.method mtp --speculative-config.num_speculative_tokens 2",
     "--speculative-config '{\"method\": \"mtp\", \"num_speculative_tokens\": 2}'"),
    ("--speculative-config '{\"method\": \"mtp\"}' --speculative-config.num_speculative_tokens=2",
     "--speculative-config '{\"method\": \"mtp\", \"num_speculative_tokens\": 2}'"),
    ("--speculative-config.method mtp --speculative-config.num_speculative_tokens 2 "
     "--speculative-config.adaptive false --speculative-config.disable_by_batch_size 16",
     "--speculative-config '{\"method\": \"mtp\", \"num_speculative_tokens\": 2, \"adaptive\": false, "
     "\"disable_by_batch_size\": 16}'"),
    ("--compilation-config.cudagraph_mode NONE", "--compilation-config '{\"cudagraph_mode\": \"NONE\"}'"),
    ("--compilation-config.cudagraph_capture_sizes [1,2,4]",
     "--compilation-config '{\"cudagraph_capture_sizes\": [1, 2, 4]}'"),
])
def test_dotted_and_json_forms_give_equal_configs(model: str, dotted: str, json_form: str) -> None:
    base = f"serve {model} --max-model-len 256"
    from_dotted, from_json = config_of(f"{base} {dotted}", model), config_of(f"{base} {json_form}", model)
    assert from_dotted == from_json
    assert from_dotted != config_of(base, model)  # the flag changed something


def test_report_2_line_with_json_forms_only(model: str) -> None:
    json_line = SEED_2.replace("--limit-mm-per-prompt.image 10", "--limit-mm-per-prompt '{\"image\": 10}'")
    assert json_line != SEED_2
    assert config_of(json_line, model) == config_of(SEED_2, model)


def test_expand_dotted_merges_in_order_and_nests() -> None:
    argv = ["serve", "--speculative-config.a.b", "1", "--max-num-seqs", "2", "--speculative-config.a.c=x",
            "--speculative-config", '{"a": {"b": 3}, "k": true}']
    assert expand_dotted(argv) == ["serve", "--speculative-config", '{"a": {"b": 3, "c": "x"}, "k": true}',
                                   "--max-num-seqs", "2"]
    # Flags that take no JSON object keep their dots (argparse then names them as unrecognized).
    assert expand_dotted(["--max-num-seqs.x", "1"]) == ["--max-num-seqs.x", "1"]


def test_dotted_form_of_a_plain_flag_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "m", "--max-num-seqs.x", "1"])
    assert "--max-num-seqs.x" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "m", "--speculative-config..x", "1"])
    assert "empty key" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ cudagraph_mode


@pytest.mark.parametrize("mode, eager", [("FULL_AND_PIECEWISE", False), ("FULL", False), ("FULL_DECODE_ONLY", False),
                                         ("full_decode_only", False), ("NONE", True)])
def test_cudagraph_modes(model: str, caplog: pytest.LogCaptureFixture, mode: str, eager: bool) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER):
        config = config_of(f"serve {model} --compilation-config.cudagraph_mode {mode}", model)
    assert config.enforce_eager is eager
    lines = info_lines(caplog)
    assert len(lines) == 1 and f"cudagraph_mode={mode.upper()}" in lines[0], lines
    assert ("eagerly" in lines[0]) and (("decode" in lines[0]) is not eager)


@pytest.mark.parametrize("extra, says", [
    ("--compilation-config.cudagraph_mode PIECEWISE", "cudagraph_mode PIECEWISE is not supported"),
    ("--compilation-config.cudagraph_mode SOMETIMES", "cudagraph_mode 'SOMETIMES' is not one of"),
    ("--compilation-config.level 3", "--compilation-config: level not supported"),
    ("--compilation-config.cudagraph_mode FULL --enforce-eager", "--enforce-eager contradicts"),
    ("--compilation-config.cudagraph_capture_sizes [0]", "cudagraph_capture_sizes must be"),
    ("--compilation-config.cudagraph_capture_sizes [1,2] --cuda-graph-sizes 4", "--cuda-graph-sizes [4] contradicts"),
])
def test_compilation_values_that_cannot_be_honoured_are_refused(model: str, extra: str, says: str) -> None:
    with pytest.raises(ValueError) as info:
        config_of(f"serve {model} {extra}", model)
    assert says in str(info.value)


def test_capture_sizes_reach_the_config(model: str) -> None:
    config = config_of(f"serve {model} --compilation-config.cudagraph_capture_sizes [1,2,8]", model)
    assert config.cuda_graph_sizes == [1, 2, 8]


# ---------------------------------------------------------------------------------------- served by construction


@pytest.mark.parametrize("extra, flag", [
    ("--enable-chunked-prefill", "--enable-chunked-prefill"),
    ("--mamba-cache-mode align", "--mamba-cache-mode align"),
    ("--mamba-cache-mode all", "--mamba-cache-mode all"),
    ("--mamba-cache-mode none --no-enable-prefix-caching", "--mamba-cache-mode none"),
    ("--trust-remote-code", "--trust-remote-code"),
    ("--disable-log-requests", "--disable-log-requests"),
    ("--max-logprobs 20", "--max-logprobs 20"),
    ("--tokenizer MODEL", "--tokenizer"),
])
def test_flags_served_by_construction_log_one_info_line(model: str, caplog: pytest.LogCaptureFixture, extra: str,
                                                        flag: str) -> None:
    base = f"serve {model} --max-model-len 256"
    with caplog.at_level(logging.INFO, logger=LOGGER):
        config_of(base, model)
    assert info_lines(caplog) == []
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        config = config_of(f"{base} {extra.replace('MODEL', model)}", model)
    lines = info_lines(caplog)
    assert len(lines) == 1 and lines[0].startswith(flag) and "nothing to change" in lines[0], lines
    if "--no-enable-prefix-caching" not in extra:
        assert config == config_of(base, model)  # and changes nothing


@pytest.mark.parametrize("extra, says", [
    ("--no-enable-chunked-prefill", "--no-enable-chunked-prefill is not supported"),
    ("--mamba-cache-mode none", "--mamba-cache-mode none caches no recurrent state"),
    ("--max-logprobs 5", "--max-logprobs 5 is not supported"),
    ("--tokenizer /somewhere/else", "--tokenizer '/somewhere/else' is not supported"),
    ("--limit-mm-per-prompt.video 2", "modality 'video' is not served"),
])
def test_flags_that_cannot_be_honoured_are_refused(model: str, extra: str, says: str) -> None:
    with pytest.raises(ValueError) as info:
        config_of(f"serve {model} {extra}", model)
    assert says in str(info.value)


@pytest.mark.parametrize("argv, says", [
    (["--enable-log-requests"], "--enable-log-requests is not supported: request contents are never logged"),
    (["--download-dir", "/tmp"], "unrecognized arguments: --download-dir"),
    (["--mamba-cache-mode", "sometimes"], "--mamba-cache-mode: invalid choice"),
])
def test_refusals_at_parse_name_the_flag(capsys: pytest.CaptureFixture[str], argv: list[str], says: str) -> None:
    with pytest.raises(SystemExit) as info:
        cli.build_parser().parse_args(["serve", "m", *argv])
    assert info.value.code == 2 and says in capsys.readouterr().err


def test_the_command_line_refuses_before_the_model_loads(model: str, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Through ``hyserve serve``: the refusal is a one-line error and exit status 2, before any load."""
    def no_load(*args: object, **kw: object) -> None:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("hyserve.llm.LLM", no_load)
    assert cli.main(["serve", model, "--port", "0", "--compilation-config.cudagraph_mode", "PIECEWISE"]) == 2
    assert "hyserve: error: --compilation-config: cudagraph_mode PIECEWISE" in capsys.readouterr().err
    monkeypatch.setenv(PP_PARTITION_ENV, "13,13,13,10")
    assert cli.main([*shlex.split(SEED_1.replace("MODEL", model)), "--port", "0"]) == 2
    assert f"hyserve: error: {PP_PARTITION_ENV}=13,13,13,10" in capsys.readouterr().err


def test_docs_table_lists_every_vllm_flag_accepted(model: str) -> None:
    """docs/vllm_flags.md names every flag the command line takes from vLLM's set."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "vllm_flags.md").read_text()
    for flag in ("--compilation-config", "--mamba-cache-mode", "--enable-chunked-prefill", "--chat-template",
                 "--trust-remote-code", "--disable-log-requests", "--enable-log-requests", "--max-logprobs",
                 "--tokenizer", "--limit-mm-per-prompt", "--speculative-config", PP_PARTITION_ENV,
                 "--enable-auto-tool-choice", "--tool-call-parser", "--reasoning-parser"):
        assert f"`{flag}" in text, flag


@pytest.mark.parametrize("form", ["--override-generation-config '{\"temperature\": 0.25, \"max_new_tokens\": 7}'",
                                  "--override-generation-config.temperature 0.25 "
                                  "--override-generation-config.max_new_tokens 7"])
def test_override_generation_config(model: str, tmp_path: Path, form: str) -> None:
    """vLLM's --override-generation-config, JSON or dotted: its keys over the checkpoint's generation_config.json
    (here top_p from the file survives beside them), and alone under --generation-config vllm."""
    from hyserve import LLM

    with open(os.path.join(model, "generation_config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    path = str(tmp_path / "ckpt")
    shutil.copytree(model, path)
    with open(os.path.join(path, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump({**raw, "top_p": 0.8, "temperature": 0.9}, f)
    config = config_of(f"serve MODEL {form}", path)
    assert config.override_generation_config == {"temperature": 0.25, "max_new_tokens": 7}
    llm = LLM(model=path, device="cpu", dtype="float32", override_generation_config=config.override_generation_config)
    p = llm.get_default_sampling_params()
    assert (p.temperature, p.top_p, p.max_tokens) == (0.25, 0.8, 7)
    alone = LLM(model=path, device="cpu", dtype="float32", generation_config="vllm",
                override_generation_config={"temperature": 0.25}).get_default_sampling_params()
    assert (alone.temperature, alone.top_p) == (0.25, 1.0)
    with pytest.raises(ValueError, match="'do_sample' is not a key hyserve reads"):
        LLM(model=path, device="cpu", dtype="float32", override_generation_config={"do_sample": True})


def test_enable_expert_parallel_reaches_the_config(model: str) -> None:
    """``--enable-expert-parallel`` sets ``EngineConfig.enable_expert_parallel`` (off without it); what it does is
    tested on the MoE family (tests/model/test_qwen3_5_moe.py)."""
    assert config_of(f"serve {model} --tensor-parallel-size 2 --enable-expert-parallel",
                     model).enable_expert_parallel is True
    assert config_of(f"serve {model}", model).enable_expert_parallel is False

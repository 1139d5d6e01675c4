"""The command line: default paths (`hyserve serve` and `hyserve demo` with no model use the packaged model), startup
errors found before the model loads, help texts that show every default, and the engine flags reaching the LLM."""

from __future__ import annotations

import argparse
import errno
import json
import socket
from typing import Any

import pytest
import torch

from hyserve import cli
from hyserve.config import resolve_dtype
from hyserve.llm import DEFAULT_MODEL_DIR


def test_demo_serves_the_default_model_and_answers(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo", "--device", "cpu", "--max-tokens", "6", "--prompt", "def main():\n"]) == 0
    out = capsys.readouterr().out
    assert f"serving {DEFAULT_MODEL_DIR}" in out
    assert "POST /v1/completions" in out and "POST /v1/chat/completions" in out
    assert "6 completion tokens" in out


def test_serve_without_model_uses_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from hyserve.server.serving import GracefulServer

    seen: dict[str, Any] = {}

    def fake_run(server: GracefulServer, sockets: Any = None) -> None:
        seen["config"] = server.config

    monkeypatch.setattr(GracefulServer, "run", fake_run)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert cli.main(["serve", "--device", "cpu", "--port", str(port)]) == 0
    assert seen["config"].port == port
    assert seen["config"].app.state.engine.engine.config.model == DEFAULT_MODEL_DIR


def test_generate_without_model_uses_the_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generate", "--device", "cpu", "--max-tokens", "3", "--prompt", "def f(x):"]) == 0
    line = json.loads(capsys.readouterr().out.splitlines()[0])
    assert line["prompt"] == "def f(x):" and len(line["token_ids"]) == 3 and line["finish_reason"] == "length"


def test_generate_reports_bad_model_dir(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generate", "/nonexistent/dir", "--device", "cpu"]) == 2
    assert "model directory not found" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- startup errors


def _no_model_load(*args: Any, **kw: Any) -> Any:
    raise AssertionError("the model was loaded before the port was checked")


def test_port_out_of_range_is_a_usage_error(capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "make_llm", _no_model_load)
    for bad in ("99999", "-1", "http"):
        with pytest.raises(SystemExit) as info:
            cli.main(["serve", "--device", "cpu", "--port", bad])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert "invalid port" in err and "0..65535" in err and "Traceback" not in err


def test_port_in_use_fails_before_the_model_loads(capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "make_llm", _no_model_load)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert cli.main(["serve", "--device", "cpu", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}: the address is already in use" in err
    cli.bind_port("127.0.0.1", port).close()  # free again once the other socket closed


def test_port_is_held_while_the_model_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bound from the check until the server listens: nothing started during the load (worker processes, a
    distributed store) can take it; and refused, not queued, until then."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    seen: dict[str, Any] = {}

    def load(*args: Any, **kw: Any) -> Any:
        with socket.socket() as other:
            try:
                other.bind(("127.0.0.1", port))
                seen["bind"] = "free"
            except OSError as e:
                seen["bind"] = e.errno
        with socket.socket() as client:
            seen["connect"] = client.connect_ex(("127.0.0.1", port))
        raise RuntimeError("stop after the check")

    monkeypatch.setattr(cli, "make_llm", load)
    with pytest.raises(RuntimeError, match="stop after the check"):
        cli.cmd_serve(cli.build_parser().parse_args(["serve", "--device", "cpu", "--port", str(port)]))
    assert seen["bind"] == errno.EADDRINUSE
    assert seen["connect"] == errno.ECONNREFUSED
    cli.bind_port("127.0.0.1", port).close()  # released when serve ends


def test_cpu_cache_errors_name_the_cpu_flag() -> None:
    from hyserve.llm import LLM

    with pytest.raises(ValueError, match="cannot hold one request's recurrent state") as info:
        LLM(device="cpu", cpu_cache_memory_bytes=64 * 1024)
    assert "--cpu-cache-memory" in str(info.value) and "gpu-memory-utilization" not in str(info.value)
    with pytest.raises(ValueError, match="does not fit in the KV cache") as info:
        LLM(device="cpu", cpu_cache_memory_bytes=4 * 2**20, max_model_len=4096)
    assert "--cpu-cache-memory" in str(info.value) and "gpu-memory-utilization" not in str(info.value)


def test_cpu_cache_memory_flag_sizes() -> None:
    parse = cli.build_parser().parse_args
    assert parse(["generate", "m", "--cpu-cache-memory", "1GiB"]).cpu_cache_memory == 2**30
    assert parse(["generate", "m", "--cpu-cache-memory", "256MiB"]).cpu_cache_memory == 256 * 2**20
    assert parse(["generate", "m", "--cpu-cache-memory", "5000000"]).cpu_cache_memory == 5_000_000
    assert parse(["generate", "m", "--cpu-cache-memory", "1.5GB"]).cpu_cache_memory == 1_500_000_000
    assert parse(["generate", "m"]).cpu_cache_memory == 256 * 2**20
    with pytest.raises(SystemExit):
        parse(["generate", "m", "--cpu-cache-memory", "lots"])


def test_default_start_does_not_warn_about_max_num_seqs(caplog: pytest.LogCaptureFixture) -> None:
    from hyserve.llm import LLM

    with caplog.at_level("INFO", logger="hyserve"):
        LLM(device="cpu")
    lowered = [r for r in caplog.records if "max_num_seqs lowered" in r.getMessage()]
    assert lowered and all(r.levelname == "INFO" for r in lowered)
    assert not [r for r in caplog.records if r.levelname == "WARNING"], [r.getMessage() for r in caplog.records]
    caplog.clear()
    with caplog.at_level("INFO", logger="hyserve"):
        LLM(device="cpu", max_num_seqs=256)  # asked for: worth a warning
    assert [r.levelname for r in caplog.records if "max_num_seqs lowered" in r.getMessage()] == ["WARNING"]


# ---------------------------------------------------------------------------------------------- help and flags


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_flag_of_every_subcommand_shows_its_default() -> None:
    subs = _subparsers()
    assert {"generate", "serve", "demo", "bench", "soak"} <= set(subs)
    for name, sub in subs.items():
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction) or not action.option_strings:
                continue
            assert action.help and "default" in action.help.lower(), (name, action.option_strings, action.help)


def test_help_texts_say_what_the_defaults_are(capsys: pytest.CaptureFixture[str]) -> None:
    texts = {}
    for name in ("serve", "soak"):
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args([name, "--help"])
        texts[name] = " ".join(capsys.readouterr().out.split())
    assert "required for now" not in texts["serve"] and "default: the packaged default model" in texts["serve"]
    assert "nothing is downloaded" in texts["serve"]
    assert "default: the packaged default model" in texts["soak"]
    assert "default: write a tiny random checkpoint with an MTP head" not in texts["soak"]


def test_vllm_dtype_names() -> None:
    from hyserve.model.registry import load_model_config

    parse = cli.build_parser().parse_args
    cfg = load_model_config(DEFAULT_MODEL_DIR)
    want = {"float": torch.float32, "float32": torch.float32, "half": torch.float16, "float16": torch.float16,
            "bfloat16": torch.bfloat16, "auto": torch.float32}
    for name, dtype in want.items():
        assert parse(["generate", "m", "--dtype", name]).dtype == name
        assert resolve_dtype(name, cfg, torch.device("cpu")) == dtype
    with pytest.raises(SystemExit):
        parse(["generate", "m", "--dtype", "float64"])


def test_hub_id_says_only_local_directories_work(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generate", "Qwen/Qwen3.5-2B", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "model directory not found: 'Qwen/Qwen3.5-2B'" in err
    assert "only local checkpoint directories" in err and "downloads nothing" in err and "hf download" in err


def test_engine_flags_reach_the_llm(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    class FakeLLM:
        def __init__(self, **kw: Any) -> None:
            seen.update(kw)

    monkeypatch.setattr("hyserve.llm.LLM", FakeLLM)
    parse = cli.build_parser().parse_args
    cli.make_llm(parse(["generate", "m", "--cpu-threads", "3", "--cpu-cache-memory", "64MiB",
                         "--generation-config", "vllm", "--dtype", "float"]), "m")
    assert (seen["cpu_threads"], seen["cpu_cache_memory_bytes"], seen["generation_config"], seen["dtype"]) == \
        (3, 64 * 2**20, "vllm", "float")
    assert seen["disable_log_stats"] is True and seen["max_num_seqs"] is None  # offline: no periodic stats line
    cli.make_llm(parse(["serve"]), "m")
    assert seen["disable_log_stats"] is False and seen["generation_config"] == "auto"  # serve logs stats
    cli.make_llm(parse(["serve", "--disable-log-stats"]), "m")
    assert seen["disable_log_stats"] is True


# ---------------------------------------------------------------------------------------- no abbreviated flags


def test_no_parser_takes_abbreviated_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """A prefix of a longer flag is refused, never read as that flag: ``--max-num-seq`` is not ``--max-num-seqs``."""
    parser = cli.build_parser()
    assert parser.allow_abbrev is False
    assert all(sub.allow_abbrev is False for sub in _subparsers().values())
    for argv in (["serve", "m", "--max-num-seq", "8"], ["serve", "m", "--chat-template-t", "5"],
                 ["generate", "m", "--max-tok", "3"], ["bench", "--max-num-seq", "8"]):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
        assert f"unrecognized arguments: {argv[-2]}" in capsys.readouterr().err, argv


def test_chat_template_is_not_read_as_the_timeout(capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``--chat-template t.jinja`` once failed as an invalid --chat-template-timeout, and ``--chat-template 5`` set
    the timeout: both now are the template flag, and a missing file is a startup error naming it."""
    monkeypatch.setattr("hyserve.llm.LLM", _no_model_load)
    parse = cli.build_parser().parse_args
    for value in ("t.jinja", "5"):
        args = parse(["serve", "m", "--chat-template", value])
        assert args.chat_template == value and args.chat_template_timeout == 10.0
        assert cli.main(["serve", "m", "--port", "0", "--chat-template", value]) == 2
        err = capsys.readouterr().err
        assert f"hyserve: error: --chat-template {value!r}: no such file" in err and "timeout" not in err


# ---------------------------------------------------------------------------------------------- --chat-template


TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}:{{ m['content'] }}]{% endfor %}"
            "{% if add_generation_prompt %}>{% endif %}")


def test_chat_template_file_replaces_the_checkpoints(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert cli.main(["generate", "--device", "cpu", "--chat", "--max-tokens", "1", "--prompt", "hi",
                     "--chat-template", str(path)]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[0])["prompt"] == "[user:hi]>"


def test_chat_template_text_reaches_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    from hyserve.server.serving import GracefulServer

    seen: dict[str, Any] = {}

    def fake_run(server: GracefulServer, sockets: Any = None) -> None:
        seen["tokenizer"] = server.config.app.state.engine.engine.tokenizer

    monkeypatch.setattr(GracefulServer, "run", fake_run)
    assert cli.main(["serve", "--device", "cpu", "--port", "0", "--chat-template", TEMPLATE]) == 0
    rendered = seen["tokenizer"].apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "[user:hi]>"


def test_chat_template_check_takes_what_the_tokenizer_renders() -> None:
    """Loop controls and the generation tag (Qwen-style templates use them) pass the startup check and render."""
    from hyserve.engine_args import load_chat_template
    from hyserve.llm import LLM

    text = ("{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
            "{% generation %}<{{ m['content'] }}>{% endgeneration %}{% if loop.index > 2 %}{% break %}{% endif %}"
            "{% endfor %}")
    assert load_chat_template(text) == text
    tok = LLM(device="cpu").get_tokenizer()
    tok.hf_tokenizer.chat_template = text
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}]
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == "<a><b>"


@pytest.mark.parametrize("value, says", [
    ("{% for m in messages %}", "is not a valid Jinja template (line 1"),
    ("{% for m in messages %}{% tool %}{% endfor %}", "is not a valid Jinja template (line 1"),
    ("/no/such/dir/t.jinja", "no such file"),
    ("", "no such file"),
])
def test_bad_chat_template_is_a_startup_error(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                              tmp_path: Any, value: str, says: str) -> None:
    monkeypatch.setattr("hyserve.llm.LLM", _no_model_load)
    assert cli.main(["generate", "m", "--chat-template", value or str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "hyserve: error: --chat-template" in err and says in err
    empty = tmp_path / "empty.jinja"
    empty.write_text("  \n")
    assert cli.main(["generate", "m", "--chat-template", str(empty)]) == 2
    assert "is empty" in capsys.readouterr().err

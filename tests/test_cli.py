"""The command line's default paths: `hyserve serve` and `hyserve demo` with no model use the packaged model."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from hyserve import cli
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


def test_generate_reports_bad_model_dir(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generate", "/nonexistent/dir", "--device", "cpu"]) == 2
    assert "model directory not found" in capsys.readouterr().err

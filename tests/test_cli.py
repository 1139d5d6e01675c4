"""The command line's default paths: `hyserve serve` and `hyserve demo` with no model use the packaged model."""

from __future__ import annotations

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
    seen: dict[str, Any] = {}

    def fake_run(app: Any, **kw: Any) -> None:
        seen["app"] = app
        seen.update(kw)

    monkeypatch.setattr("uvicorn.run", fake_run)
    assert cli.main(["serve", "--device", "cpu", "--port", "8123"]) == 0
    assert seen["port"] == 8123 and seen["app"] is not None


def test_generate_reports_bad_model_dir(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generate", "/nonexistent/dir", "--device", "cpu"]) == 2
    assert "model directory not found" in capsys.readouterr().err

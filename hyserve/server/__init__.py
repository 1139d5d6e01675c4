"""The OpenAI-compatible server: ``AsyncEngine`` (the engine on a background thread) and ``build_app`` (FastAPI).

``hyserve serve MODEL_DIR`` runs it; in Python::

    from hyserve.server import AsyncEngine, build_app
    app = build_app(AsyncEngine(LLM(model=...).llm_engine))   # then uvicorn.run(app, ...)
"""

from __future__ import annotations

from typing import Any

from hyserve.server.async_engine import AsyncEngine, EngineDeadError, RequestAbortedError

__all__ = ["AsyncEngine", "EngineDeadError", "RequestAbortedError", "build_app"]


def __getattr__(name: str) -> Any:
    """``build_app`` on first use: the engine side (``AsyncEngine``) runs where FastAPI is not installed (a benchmark
    driving the engine's async API in process, as ``benchmarks/seed_bench.py`` does)."""
    if name == "build_app":
        from hyserve.server.app import build_app

        return build_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

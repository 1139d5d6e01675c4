"""The OpenAI-compatible server: ``AsyncEngine`` (the engine on a background thread) and ``build_app`` (FastAPI).

``hyserve serve MODEL_DIR`` runs it; in Python::

    from hyserve.server import AsyncEngine, build_app
    app = build_app(AsyncEngine(LLM(model=...).llm_engine))   # then uvicorn.run(app, ...)
"""

from __future__ import annotations

from hyserve.server.app import build_app
from hyserve.server.async_engine import AsyncEngine, EngineDeadError, RequestAbortedError

__all__ = ["AsyncEngine", "EngineDeadError", "RequestAbortedError", "build_app"]

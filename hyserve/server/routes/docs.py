"""``/docs`` (Swagger UI) and ``/redoc`` served with no internet: their JavaScript and CSS come from this server
(``/docs-assets/...``), out of the ``fastapi-offline`` package's bundled copies (swagger-ui 5, redoc 2), never
from a CDN. Without that package the pages still answer, saying where the assets would come from and that the
schema itself is at ``/openapi.json``; they load nothing from elsewhere either way.

Also the answer to a path the server has no route for: an OpenAI-style 404 that lists the routes it has
(``route_not_found``), so that a client written for another server (``/v1/embeddings``, ``/pooling``, ...) learns
what this one serves.
"""

from __future__ import annotations

import html
import importlib.util
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from hyserve.server.errors import error_response

ASSETS_URL = "/docs-assets"
ASSETS_PACKAGE = "fastapi_offline"
ASSETS_FILES = ("swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js", "favicon.png")


def assets_dir() -> Path | None:
    """The bundled swagger-ui / redoc files, or None if ``fastapi-offline`` is not installed."""
    spec = importlib.util.find_spec(ASSETS_PACKAGE)
    if spec is None or spec.origin is None:
        return None
    static = Path(spec.origin).parent / "static"
    return static if all((static / name).is_file() for name in ASSETS_FILES) else None


def _missing_assets_page(title: str) -> HTMLResponse:
    body = (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head><body>"
            f"<h1>{html.escape(title)}</h1><p>The interactive documentation needs the swagger-ui and redoc assets "
            "of the Python package <code>fastapi-offline</code>, served from this server under "
            f"<code>{ASSETS_URL}/</code>; it is not installed here (<code>pip install fastapi-offline</code>). "
            "The OpenAPI schema itself is at <a href='/openapi.json'>/openapi.json</a>.</p></body></html>")
    return HTMLResponse(body)


def add_docs_routes(app: FastAPI, docs_url: str = "/docs", redoc_url: str = "/redoc") -> None:
    """``docs_url`` and ``redoc_url`` pages over ``app.openapi_url``, with their assets served locally. The app
    must be built with ``docs_url=None, redoc_url=None`` (FastAPI's own pages load from a CDN)."""
    static = assets_dir()
    openapi_url = app.openapi_url or "/openapi.json"
    if static is not None:
        app.mount(ASSETS_URL, StaticFiles(directory=static), name="docs-assets")

    async def swagger_ui(request: Request) -> HTMLResponse:
        title = f"{app.title} - Swagger UI"
        if static is None:
            return _missing_assets_page(title)
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(openapi_url=root + openapi_url, title=title,
                                   swagger_js_url=f"{root}{ASSETS_URL}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{root}{ASSETS_URL}/swagger-ui.css",
                                   swagger_favicon_url=f"{root}{ASSETS_URL}/favicon.png")

    async def redoc(request: Request) -> HTMLResponse:
        title = f"{app.title} - ReDoc"
        if static is None:
            return _missing_assets_page(title)
        root = request.scope.get("root_path", "")
        return get_redoc_html(openapi_url=root + openapi_url, title=title,
                              redoc_js_url=f"{root}{ASSETS_URL}/redoc.standalone.js",
                              redoc_favicon_url=f"{root}{ASSETS_URL}/favicon.png", with_google_fonts=False)

    app.add_api_route(docs_url, swagger_ui, methods=["GET"], include_in_schema=False)
    app.add_api_route(redoc_url, redoc, methods=["GET"], include_in_schema=False)


def route_list(app: FastAPI) -> list[str]:
    """``METHOD /path`` of every route in the app's OpenAPI schema (the documentation pages aside), by path."""
    paths = app.openapi().get("paths", {})
    return [f"{method.upper()} {path}" for path in sorted(paths) for method in paths[path]]


def add_not_found_handler(app: FastAPI) -> None:
    """A 404 for a path with no route names the routes there are; other 404s (raised by a route) keep their
    message. (A status handler comes before the class handler of ``hyserve.server.errors`` for 404s only.)"""

    async def not_found(request: Request, exc: Exception) -> JSONResponse:
        detail = exc.detail if isinstance(exc, StarletteHTTPException) else str(exc)
        if detail != "Not Found":
            return error_response(404, str(detail))
        routes = ", ".join(route_list(app))
        return error_response(404, f"Not Found: no such route on this server; the routes it serves: {routes}; "
                                   f"asked for: {request.method} {request.url.path}", code="route_not_found")

    app.add_exception_handler(404, not_found)

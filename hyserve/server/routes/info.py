"""The routes about the server itself: ``GET /v1/models``, ``/health``, ``/version`` and ``/metrics``."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel

import hyserve
from hyserve.server.context import Context
from hyserve.server.errors import AUTH_RESPONSES, error_response
from hyserve.server.metrics import render_metrics
from hyserve.server.metrics_vllm import render_vllm_metrics
from hyserve.server.protocol import ErrorResponse, ModelCard, ModelList

# /metrics is the text exposition format 0.0.4 (hyserve.server.metrics writes it).
METRICS_MEDIA_TYPE = "text/plain; version=0.0.4"

router = APIRouter()


class HealthResponse(BaseModel):
    status: str = "ok"


class VersionResponse(BaseModel):
    version: str


class MetricsResponse(PlainTextResponse):
    """``/metrics``' answer: ``text/plain; version=0.0.4; charset=utf-8``, also so declared in the OpenAPI schema."""

    media_type = METRICS_MEDIA_TYPE


@router.get("/v1/models", responses=AUTH_RESPONSES)
async def list_models(ctx: Context) -> ModelList:
    # root is the served name, as vLLM's: the checkpoint's path on this machine is not the client's business.
    return ModelList(data=[ModelCard(id=ctx.model_name, root=ctx.model_name, max_model_len=ctx.engine.max_model_len)])


@router.get("/health", response_model=None, responses={
    200: {"model": HealthResponse}, 503: {"model": ErrorResponse, "description": "The engine loop is not running"}})
async def health(ctx: Context) -> Response:
    async_engine = ctx.async_engine
    if async_engine.is_alive():
        return JSONResponse({"status": "ok"})
    err = async_engine.dead_error
    return error_response(503, "the engine loop is not running" + (f": {err!r}" if err else ""),
                          type="server_error", code="engine_dead")


@router.get("/version")
async def version() -> VersionResponse:
    return VersionResponse(version=hyserve.__version__)


@router.get("/metrics", response_model=None, response_class=MetricsResponse)
def metrics(ctx: Context) -> Response:  # sync: FastAPI runs it in a worker thread, so waiting for a step blocks no one
    engine_metrics = ctx.async_engine.get_metrics()
    request_metrics = ctx.async_engine.get_request_metrics()
    return MetricsResponse(render_metrics(engine_metrics, ctx.http_metrics)
                           + render_vllm_metrics(engine_metrics, request_metrics, ctx.model_name))

"""OpenAI-compatible API: /v1 (chat, completions, models, loglikelihood), tokenizer routes, health and metrics."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from engine import EngineHandle

from api import chat, completions, models, scoring, tokenize
from api.auth import bearer_scheme
from api.cors import APICORSMiddleware
from api.errors import OpenAIError, install_error_handlers
from api.limits import BodySizeLimitMiddleware
from api.server import RequestIDMiddleware, Server

__all__ = ["APICORSMiddleware", "BodySizeLimitMiddleware", "RequestIDMiddleware", "build_router", "install_error_handlers"]

_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


def build_router(handle: EngineHandle, api_key: str | None = None) -> APIRouter:
    """All API routes over one engine handle. With api_key, every route that runs the model or its tokenizer needs
    `Authorization: Bearer <key>`; /health, /ready and /metrics (api.server.OPEN_PATHS) stay open for probes."""
    server = Server(handle, api_key)
    route_class = server.route_class()
    # The bearer dependency only documents the key in /openapi.json; the route class checks it.
    v1 = APIRouter(route_class=route_class, dependencies=[Depends(bearer_scheme)] if server.api_key else None)
    chat.add_routes(v1, server)
    completions.add_routes(v1, server)
    scoring.add_routes(v1, server)
    models.add_routes(v1, server)

    # Last: the UI is mounted at "/" and would answer any other /v1 path with a page; clients want JSON.
    @v1.api_route("/v1/{path:path}", methods=_METHODS, include_in_schema=False)
    async def unknown_route(request: Request, path: str):
        raise OpenAIError(404, f"Invalid URL ({request.method} /v1/{path})", code="unknown_url")

    tokenizer = APIRouter(route_class=route_class, dependencies=[Depends(bearer_scheme)] if server.api_key else None)
    tokenize.add_routes(tokenizer, server)
    status = APIRouter(route_class=route_class)
    models.add_status_routes(status, server)

    router = APIRouter()
    router.include_router(v1)
    router.include_router(tokenizer)
    router.include_router(status)
    return router

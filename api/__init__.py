"""OpenAI-compatible API: /v1 (chat, completions, embeddings, models, loglikelihood), Anthropic's Messages API
(/v1/messages), tokenizer routes, health and metrics."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.routing import APIRoute

from engine import Engine, EngineHandle
from engine.registry import ModelRegistry

from api import anthropic, chat, completions, embeddings, models, responses, scoring, tokenize
from api.auth import bearer_scheme
from api.cors import APICORSMiddleware
from api.errors import OpenAIError, install_error_handlers
from api.limits import BodySizeLimitMiddleware
from api.responses import DEFAULT_MAX_STORED_RESPONSES, ResponseStore
from api.route_context import RequestIDMiddleware, RouteContext

__all__ = ["APICORSMiddleware", "BodySizeLimitMiddleware", "RequestIDMiddleware", "build_router", "install_error_handlers"]

_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS", "TRACE", "QUERY"]  # QUERY: the HTTP draft


def build_router(served: ModelRegistry | EngineHandle | Engine, api_key: str | None = None,
                 max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES) -> APIRouter:
    """All API routes over the registry's models (a handle or an engine: that one model, loaded by its owner). With
    api_key, every route that runs a model or its tokenizer needs `Authorization: Bearer <key>` (or, on
    /v1/messages, `x-api-key: <key>`); /health, /ready and /metrics (api.route_context.OPEN_PATHS) stay open for
    probes. max_stored_responses bounds the Responses API's store
    (api/responses/store.py)."""
    registry = served if isinstance(served, ModelRegistry) else ModelRegistry.serving(served)
    context = RouteContext(registry, api_key)
    route_class = context.route_class()
    # The bearer dependency only documents the key in /openapi.json; the route class checks it.
    # Anthropic's routes answer every error in Anthropic's envelope; included before /v1's catch-all.
    messages = APIRouter(route_class=context.route_class(anthropic.error_response, takes_x_api_key=True),
                         dependencies=[Depends(bearer_scheme)] if context.api_key else None)
    anthropic.add_routes(messages, context)
    _answer_every_method(messages)
    anthropic.add_unknown_route(messages, _METHODS)
    v1 = APIRouter(route_class=route_class, dependencies=[Depends(bearer_scheme)] if context.api_key else None)
    chat.add_routes(v1, context)
    completions.add_routes(v1, context)
    embeddings.add_routes(v1, context)
    responses.add_routes(v1, context, ResponseStore(max_stored_responses))
    scoring.add_routes(v1, context)
    models.add_routes(v1, context)
    _answer_every_method(v1)

    # Last: the UI is mounted at "/" and would answer any other /v1 path with a page; clients want JSON.
    @v1.api_route("/v1/{path:path}", methods=_METHODS, include_in_schema=False)
    async def unknown_route(request: Request, path: str):
        raise OpenAIError(404, f"Invalid URL ({request.method} /v1/{path})", code="unknown_url")

    tokenizer = APIRouter(route_class=route_class, dependencies=[Depends(bearer_scheme)] if context.api_key else None)
    tokenize.add_routes(tokenizer, context)
    _answer_every_method(tokenizer)
    status = APIRouter(route_class=route_class)
    models.add_status_routes(status, context)
    _answer_every_method(status)

    router = APIRouter()
    router.include_router(messages)
    router.include_router(v1)
    router.include_router(tokenizer)
    router.include_router(status)
    router.metrics = context.metrics  # for whoever reports them outside HTTP too (deploy/: each Ray replica's)
    return router


def _answer_every_method(router: APIRouter) -> None:
    """Every path of the router answers every method itself: HEAD wherever GET is served (load balancers probe with
    it), and a 405 in OpenAI's shape with an Allow header for the rest. Otherwise the UI mounted at "/" would answer
    them with Gradio's own 404."""
    routes = [route for route in router.routes if isinstance(route, APIRoute)]
    for path in dict.fromkeys(route.path for route in routes):
        on_path = [route for route in routes if route.path == path]
        served = set().union(*(route.methods for route in on_path))
        get = next((route for route in on_path if "GET" in route.methods), None)
        if get is not None and "HEAD" not in served:
            router.add_api_route(path, get.endpoint, methods=["HEAD"], include_in_schema=False,
                                 response_class=get.response_class)
            served.add("HEAD")
        others = [method for method in _METHODS if method not in served]
        router.add_api_route(path, _method_not_allowed(sorted(served)), methods=others, include_in_schema=False)


def _method_not_allowed(allowed: list[str]):
    async def method_not_allowed(request: Request):
        message = f"Method Not Allowed ({request.method} {request.url.path}): this path serves {', '.join(allowed)}"
        raise OpenAIError(405, message, code="method_not_allowed", headers={"Allow": ", ".join(allowed)})

    return method_not_allowed

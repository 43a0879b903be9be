"""RouteContext: what every route needs (the models, by id; metrics; the API key), the route class wrapping each route,
and the middleware that gives every response an X-Request-ID."""
from __future__ import annotations

import contextvars
import logging
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine import Engine
from engine.registry import Lease, ModelRegistry

from api.auth import authorize
from api.errors import OpenAIError, shutting_down, to_openai_error
from api.metrics import Metrics, ModelMetrics

logger = logging.getLogger("api")

# A client's X-Request-ID is echoed and logged only if it is short and plain; otherwise we make our own.
_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")


class RequestIDMiddleware:
    """Every HTTP response, the UI's and /openapi.json's included, carries an X-Request-ID: the client's, or a new
    one. Routes find it in request.state.request_id and log it. Plain ASGI rather than BaseHTTPMiddleware, which
    would sit between a streaming response and the client's disconnect."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _request_id(dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1"))
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["X-Request-ID"] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)


# The leases the request being handled holds: set by the route class, filled by RouteContext.serve.
_request_leases: contextvars.ContextVar[list[Lease]] = contextvars.ContextVar("tern_request_leases")


@dataclass(frozen=True)
class Served:
    """The model a request named, for as long as its response lasts: its engine, its id, its metrics."""

    engine: Engine
    model_id: str
    metrics: ModelMetrics


# Probes and scrapers reach these without the key: they say whether the server is up, and run no model.
OPEN_PATHS = frozenset({"/health", "/healthz", "/ready", "/readyz", "/metrics"})


class RouteContext:
    def __init__(self, models: ModelRegistry, api_key: str | None = None) -> None:
        self.models = models
        self.api_key = api_key or None
        self.metrics = Metrics(models)
        self.created = int(time.time())

    @property
    def is_draining(self) -> bool:
        """Shutting down: routes that run the model or its tokenizer answer 503, /ready too."""
        return self.models.is_draining

    def needs_key(self, route_path: str) -> bool:
        """With --api-key, every route but the probes needs it: /v1 and the tokenizer routes alike."""
        return self.api_key is not None and route_path not in OPEN_PATHS

    async def serve(self, model: str | None = None) -> Served:
        """The model the client named (empty: the default), loading it first if needed (this request waits; the
        others go on). Unknown: 404 naming the served ones; failed to load: 503 with why; the first model still
        loading at start: 503, retry shortly. It stays loaded until this request's response has ended: the route
        class releases the lease then, the client having read it all or gone."""
        leases = _request_leases.get(None)
        lease = await self.models.acquire_async(model)
        if leases is None:  # a route outside ServedRoute (none today): nothing would release it, so hold none
            lease.release()
        else:
            leases.append(lease)
        return Served(lease.engine, lease.model_id, self.metrics.of(lease.model_id))

    def route_class(self, error_response: Callable[[OpenAIError], Response] = OpenAIError.response,
                    takes_x_api_key: bool = False) -> type[APIRoute]:
        """An APIRoute whose handler adds request ids, the API-key check, one error shape, metrics and a log line.
        error_response writes every failure (OpenAI's shape unless the routes speak another API's);
        takes_x_api_key: the key may also come as `x-api-key` (Anthropic's clients send it so)."""
        context = self

        class ServedRoute(APIRoute):
            def get_route_handler(self):
                return _served(super().get_route_handler(), self.path, context, error_response, takes_x_api_key)

        return ServedRoute


def _served(handler, route_path: str, context: RouteContext, error_response: Callable[[OpenAIError], Response],
            takes_x_api_key: bool):
    needs_key = context.needs_key(route_path)
    is_work = route_path not in OPEN_PATHS  # refused while the server drains; the probes keep answering

    async def handle(request: Request) -> Response | _HoldingLeases:
        # Set by RequestIDMiddleware; a router used without it (a test's own app) makes its own.
        request_id = getattr(request.state, "request_id", None) or _request_id(request.headers.get("x-request-id", ""))
        request.state.request_id = request_id
        started = time.perf_counter()
        leases: list[Lease] = []
        token = _request_leases.set(leases)
        try:
            if needs_key:
                authorize(request, context.api_key, takes_x_api_key)
            if is_work and context.is_draining:
                raise shutting_down()
            response = await handler(request)
        except Exception as exc:  # everything, bad input included, leaves in the routes' one error shape
            error = to_openai_error(exc)
            if 400 <= error.status_code < 500:
                logger.info("%s: %d %s (param %s)", request_id, error.status_code, error.message, error.param)
            response = error_response(error)
        finally:
            _request_leases.reset(token)
        response.headers["X-Request-ID"] = request_id
        context.metrics.requests.labels(route_path, request.method, str(response.status_code)).inc()
        elapsed_ms = (time.perf_counter() - started) * 1000
        logger.info('%s "%s %s" %d %.0f ms', request_id, request.method, request.url.path, response.status_code, elapsed_ms)
        return _HoldingLeases(response, leases) if leases else response

    return handle


class _HoldingLeases:
    """A route's response (an ASGI app, as Starlette sends it), sent while the leases the route took are held (its
    model is not unloaded under a stream); they are released once it has been sent, failed, or its client left (the
    send is then cancelled)."""

    def __init__(self, response: Response, leases: list[Lease]) -> None:
        self.response, self.leases = response, leases

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            for lease in self.leases:
                lease.release()


def _request_id(client_value: str) -> str:
    return client_value if _CLIENT_REQUEST_ID.fullmatch(client_value) else uuid.uuid4().hex

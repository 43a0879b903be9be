"""CORS for browser clients of the API (--cors-origins): /v1 and the tokenizer routes answer the origins allowed."""
from __future__ import annotations

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from api.errors import OpenAIError

# The routes a browser page on another origin may call. The UI is served from this origin and needs none.
_API_PREFIX = "/v1/"
_TOKENIZER_PATHS = frozenset({"/tokenize", "/detokenize", "/tokenizer_info"})


class APICORSMiddleware:
    """Starlette's CORSMiddleware on the API's paths, for the allowed origins only: an origin not allowed gets no
    CORS header at all (and its preflight a 400), and other paths (the UI, the probes) are left alone."""

    def __init__(self, app: ASGIApp, origins: list[str]) -> None:
        self.app = app
        self.cors = CORSMiddleware(
            app,
            allow_origins=origins,
            allow_methods=["GET", "POST", "OPTIONS"],
            # Every header a client asks for is mirrored back: the OpenAI JS SDK sends Authorization and its own
            # x-stainless-* headers, and a list of ours would break each new one.
            allow_headers=["*"],
            expose_headers=["X-Request-ID", "Retry-After"],
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _is_api_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        if origin is None:
            await self.app(scope, receive, send)
        elif self.cors.is_allowed_origin(origin):
            await self.cors(scope, receive, send)
        elif scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            message = f"The origin {origin} is not allowed to call this server from a browser (--cors-origins)."
            await OpenAIError(400, message, code="cors_origin_not_allowed").response()(scope, receive, send)
        else:  # served as for any client; without CORS headers, the browser keeps the answer from the page
            await self.app(scope, receive, send)


def _is_api_path(path: str) -> bool:
    return path.startswith(_API_PREFIX) or path in _TOKENIZER_PATHS

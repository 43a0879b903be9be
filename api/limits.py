"""Request bodies over --max-body-size get a 413 in OpenAI's shape (Anthropic's on /v1/messages), without the body
being read past the limit."""
from __future__ import annotations

import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.anthropic.errors import response_for_path
from api.errors import RequestTooLargeError, to_openai_error

logger = logging.getLogger(__name__)

# An 8k-token prompt sent as 5-digit token ids is ~57 KB of JSON: 8 MiB holds a batch of 128 (MAX_PROMPTS).
DEFAULT_MAX_BODY_SIZE_BYTES = 8 * 1024 * 1024


class BodySizeLimitMiddleware:
    """A Content-Length over the limit is refused before any of the body reaches the app; a chunked body is counted
    as it arrives and refused once it passes the limit, so no client can make the server hold more than the limit.
    Plain ASGI, for every route (the UI's too), like RequestIDMiddleware."""

    def __init__(self, app: ASGIApp, max_body_size_bytes: int = DEFAULT_MAX_BODY_SIZE_BYTES) -> None:
        self.app = app
        self.max_body_size_bytes = max_body_size_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_size_bytes
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await _refuse(scope, send, limit)
            return
        num_received = 0
        has_started = False

        async def counting_receive() -> Message:
            nonlocal num_received
            message = await receive()
            if message["type"] == "http.request":
                num_received += len(message.get("body", b""))
                if num_received > limit:
                    # An HTTPException: FastAPI's body reading passes it on, and our routes answer it as a 413.
                    raise RequestTooLargeError(limit)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal has_started
            if message["type"] == "http.response.start":
                has_started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except RequestTooLargeError:
            if has_started:  # a route that read its body after answering: nothing left to tell the client
                raise
            await _refuse(scope, send, limit)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP parser refuses such a request before it reaches us
    return None


async def _refuse(scope: Scope, send: Send, limit: int) -> None:
    logger.info('413 "%s %s": body over %d bytes', scope.get("method"), scope.get("path"), limit)
    # No "Connection: close": uvicorn then reads the rest of the body and drops it as it arrives (no memory held),
    # so a client that sends its whole body before it reads (requests, httpx) gets this answer, not a reset.
    error = to_openai_error(RequestTooLargeError(limit))
    await response_for_path(scope.get("path", ""), error)(scope, _no_body, send)


async def _no_body() -> Message:
    return {"type": "http.disconnect"}

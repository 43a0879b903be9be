"""TernIngress: the HTTP entry Ray's proxy calls. It reads each request whole, works out where its prompt's prefix
is cached (deploy/forwarding.py), and forwards it to a TernReplica through a DeploymentHandle, whose request router
(deploy/router.py) picks the replica; then streams the replica's answer back as it comes.

Why a hop of its own: Ray's proxy hands a deployment the request's headers but not its body, so a router behind the
proxy alone could never see the prompt. This is how Ray Serve LLM is built too (an OpenAI ingress in front of the
engine deployments). /metrics is answered here, for every replica at once (deploy/board.py)."""
from __future__ import annotations

import asyncio
import json
import logging
from http.cookies import SimpleCookie

from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from api.errors import RETRY_AFTER_S, OpenAIError, RequestTooLargeError, to_openai_error
from api.sse import DONE, event
from deploy.forwarding import REPLICA_COOKIE, REPLICA_HEADER, ForwardedRequest, PrefixKeys

logger = logging.getLogger("tern.ingress")

_SCOPE_KEYS = ("http_version", "method", "scheme", "path", "raw_path", "query_string", "root_path", "headers",
               "client", "server")


@serve.ingress()
class TernIngress:
    def __init__(self, replicas: DeploymentHandle, board: DeploymentHandle, server, engine_config) -> None:
        from deploy.tokenizer import load_tokenizer

        self.replicas = replicas.options(method_name="forward", stream=True)
        self.board = board
        self.keys = PrefixKeys(load_tokenizer(engine_config), engine_config.block_size)
        self.max_body_size_bytes = server.max_body_size_bytes

    def __serve_build_asgi_app__(self):
        return _ASGI(self.asgi)  # a plain object: uvicorn would take a bound method for an ASGI 2 app

    async def drain_replicas(self) -> dict[str, bool]:
        """Shutting down: every replica drains (new requests get 503, running ones finish). Returns the replicas
        reporting and whether each still has requests; ask again until none has."""
        await self.board.drain.remote()
        return await self.board.replicas.remote()

    async def replicas_status(self) -> dict[str, bool]:
        return await self.board.replicas.remote()

    async def asgi(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
        elif scope["type"] != "http":  # Gradio's queue streams over HTTP; nothing here speaks websockets
            await send({"type": "websocket.close", "code": 1003})
        elif scope["path"] == "/metrics" and scope["method"] in ("GET", "HEAD"):
            text = await self.board.metrics.remote()
            await _respond(send, 200, text.encode(), "text/plain; version=0.0.4; charset=utf-8")
        else:
            await self._forward(scope, receive, send)

    async def _forward(self, scope, receive, send) -> None:
        body = await _read_body(receive, self.max_body_size_bytes)
        if body is None:  # the app's own 413
            await _error(send, to_openai_error(RequestTooLargeError(self.max_body_size_bytes)))
            return
        pinned = _cookie(scope, REPLICA_COOKIE)
        prefix_hashes = await asyncio.to_thread(self.keys.of, scope["path"], body) if not pinned else ()
        request = ForwardedRequest({k: scope[k] for k in _SCOPE_KEYS if k in scope}, body, prefix_hashes, pinned)
        answer = self.replicas.remote(request)
        started = is_event_stream = False
        try:
            async for message in answer:
                if message["type"] == "http.response.start":
                    started = True
                    headers = dict(message.get("headers", []))
                    is_event_stream = headers.get(b"content-type", b"").startswith(b"text/event-stream")
                    message = _pin_browser(message, pinned)
                await send(message)
        except asyncio.CancelledError:
            answer.cancel()  # the client left: Ray cancels the replica's generator, which aborts the engine request
            raise
        except BackPressureError:
            # Every replica is at max_ongoing_requests and the queue in front of them is full.
            await _error(send, OpenAIError(429, "every replica is busy; retry shortly", "rate_limit_error",
                                           code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)}))
        except Exception as exc:  # the replica died (its actor was killed, its node lost) or failed
            logger.warning("forwarding %s %s failed: %s: %s", scope["method"], scope["path"], type(exc).__name__, exc)
            message = ("the replica serving this request stopped before it finished; retry it (Ray restarts "
                       "the replica, and the other replicas keep serving)")
            error = OpenAIError(503, message, "server_error", code="replica_failed",
                                headers={"Retry-After": str(RETRY_AFTER_S)})
            if not started:
                await _error(send, error)
            elif is_event_stream:  # as the app ends a stream that failed (api/sse.py): an error event, then [DONE]
                await send({"type": "http.response.body", "body": (event(error.body()) + DONE).encode(),
                            "more_body": False})
            else:
                await send({"type": "http.response.body", "body": b"", "more_body": False})


class _ASGI:
    def __init__(self, handler) -> None:
        self.handler = handler

    async def __call__(self, scope, receive, send) -> None:
        await self.handler(scope, receive, send)


def _pin_browser(start: dict, pinned: str | None) -> dict:
    """A page of the UI pins the browser to the replica that served it: Gradio keeps sessions (its queue, a login)
    in that process's memory. API answers set no cookie, so API clients stay free to go where the router sends."""
    headers = list(start.get("headers", []))
    found = dict(headers)
    replica = found.get(REPLICA_HEADER.encode(), b"").decode()
    if not found.get(b"content-type", b"").startswith(b"text/html") or not replica or replica == pinned:
        return start
    cookie = f"{REPLICA_COOKIE}={replica}; Path=/; HttpOnly; SameSite=Lax"
    return {**start, "headers": [*headers, (b"set-cookie", cookie.encode())]}


def _cookie(scope, name: str) -> str | None:
    for key, value in scope.get("headers", []):
        if key == b"cookie":
            morsel = SimpleCookie(value.decode("latin-1")).get(name)
            if morsel is not None:
                return morsel.value
    return None


async def _read_body(receive, limit: int) -> bytes | None:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise asyncio.CancelledError()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _error(send, error: OpenAIError) -> None:
    await _respond(send, error.status_code, json.dumps(error.body()).encode(), "application/json", error.headers)


async def _respond(send, status: int, body: bytes, content_type: str, headers: dict | None = None) -> None:
    raw = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _lifespan(receive, send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return

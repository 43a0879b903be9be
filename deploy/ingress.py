"""TernIngress: the HTTP entry Ray's proxy calls. It reads each request whole, works out where its prompt's prefix
is cached (deploy/forwarding.py), and forwards it to a TernReplica through a DeploymentHandle, whose request router
(deploy/router.py) picks the replica; then streams the replica's answer back as it comes.

Why a hop of its own: Ray's proxy hands a deployment the request's headers but not its body, so a router behind the
proxy alone could never see the prompt. This is how Ray Serve LLM is built too (an OpenAI ingress in front of the
engine deployments). /metrics is answered here, for every replica at once (deploy/board.py).

Several models: one replica deployment each; a request goes to the replicas of the model it names (deploy/models.py),
and the router picks among those. GET /v1/models asks every model's replicas and lists them all."""
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
from deploy.models import MODELS_PATH, ServedModels, UnknownModel, error_json, merge_model_lists

logger = logging.getLogger("tern.ingress")

_SCOPE_KEYS = ("http_version", "method", "scheme", "path", "raw_path", "query_string", "root_path", "headers",
               "client", "server")


@serve.ingress()
class TernIngress:
    def __init__(self, replicas: DeploymentHandle, board: DeploymentHandle, server, models,
                 other_replicas: dict[str, DeploymentHandle] | None = None) -> None:
        """replicas: the first model's deployment; models: every ModelSpec, the first model first; other_replicas:
        the other models' deployments by id."""
        from deploy.tokenizer import load_tokenizer

        handles = {models[0].id: replicas, **(other_replicas or {})}
        self.replicas = {model_id: handle.options(method_name="forward", stream=True)
                         for model_id, handle in handles.items()}
        self.board = board
        self.models = ServedModels([spec.id for spec in models], server.api_key)
        # Each model's own tokenizer and template: the prefix keys must be the ones its replicas' caches hold.
        self.keys = {spec.id: PrefixKeys(load_tokenizer(spec.config), spec.config.block_size) for spec in models}
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
        elif self.models.is_several and scope["path"] == MODELS_PATH and scope["method"] == "GET":
            await self._list_models(scope, send)
        else:
            await self._forward(scope, receive, send)

    async def _forward(self, scope, receive, send) -> None:
        body = await _read_body(receive, self.max_body_size_bytes)
        if body is None:  # the app's own 413
            await _error(send, to_openai_error(RequestTooLargeError(self.max_body_size_bytes)))
            return
        model_id = self.models.default_id
        if self.models.is_several:
            try:
                model_id = await asyncio.to_thread(self.models.model_of, scope, body)
            except UnknownModel as unknown:
                await _respond(send, unknown.error.status_code, error_json(scope["path"], unknown.error),
                               "application/json", unknown.error.headers)
                return
        # The UI's cookie names a replica of the first model: only its requests (which name no model) follow it.
        pinned = _cookie(scope, REPLICA_COOKIE) if model_id == self.models.default_id else None
        keys = self.keys[model_id]
        prefix_hashes = await asyncio.to_thread(keys.of, scope["path"], body) if not pinned else ()
        request = ForwardedRequest(_plain(scope), body, prefix_hashes, pinned)
        answer = self.replicas[model_id].remote(request)
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

    async def _list_models(self, scope, send) -> None:
        """Every model's card, each from one of its replicas (which checks the key); any failure is answered as is."""
        try:
            answers = await asyncio.gather(*(_whole(handle.remote(ForwardedRequest(_plain(scope), b"")))
                                             for handle in self.replicas.values()))
        except Exception as exc:  # a model's replicas all busy (back pressure) or one died mid-answer: retry
            logger.warning("listing the models failed: %s: %s", type(exc).__name__, exc)
            await _error(send, OpenAIError(503, "a model's replicas did not answer; retry shortly", "server_error",
                                           code="replica_failed", headers={"Retry-After": str(RETRY_AFTER_S)}))
            return
        failed = [(status, headers, body) for status, headers, body in answers if status != 200]
        if failed:
            status, headers, body = failed[0]
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        await _respond(send, 200, merge_model_lists([body for _, _, body in answers]), "application/json")


async def _whole(answer) -> tuple[int, list, bytes]:
    """A replica's whole answer: (status, headers, body)."""
    status, headers, chunks = 500, [], []
    async for message in answer:
        if message["type"] == "http.response.start":
            status, headers = message["status"], list(message.get("headers", []))
        else:
            chunks.append(message.get("body", b""))
    return status, headers, b"".join(chunks)


def _plain(scope) -> dict:
    return {k: scope[k] for k in _SCOPE_KEYS if k in scope}


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

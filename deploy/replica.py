"""TernReplica: one Ray Serve replica owning one whole Tern app (engine, /v1 routes, UI), into which it replays
the HTTP requests the ingress forwards. Every /v1 feature (SSE, 4xx shapes, the key, the 429, per-request aborts)
is the app's own code, unchanged."""
from __future__ import annotations

import asyncio
import logging
import os

from ray import serve
from ray.serve.handle import DeploymentHandle

from deploy.board import REPORT_PERIOD_S
from deploy.forwarding import REPLICA_HEADER, ForwardedRequest
from deploy.router import PREFIX_HASHES_STAT

logger = logging.getLogger("tern.replica")


class TernReplica:
    async def __init__(self, server, engine_config, board: DeploymentHandle, num_threads: int) -> None:
        import torch

        from api.shutdown import drain_engine
        from tern.factory import create_app

        # Replicas share the node's cores: each uses the threads its num_cpus pays for, not every core (on 2 cores,
        # two replicas with 2 OpenMP threads each made every spin-wait fight the other replica's).
        torch.set_num_threads(num_threads)
        self._drain_engine = drain_engine
        self.drain_timeout_s = server.drain_timeout_s
        self.app = create_app(server, engine_config)
        self.handle = self.app.state.handle
        self.board = board
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._lifespan = _Lifespan(self.app)
        # The app's lifespan: the engine loading in a thread (the UI is built on its first visit, tern/lazy_ui.py).
        await self._lifespan.startup()
        engine = await asyncio.to_thread(self.handle.wait)
        if engine is None:  # Ray marks the replica failed and tries again; `serve status` shows why
            raise RuntimeError(f"the model failed to load: {self.handle.error}")
        self._tasks: set[asyncio.Task] = set()
        self._draining: asyncio.Task | None = None
        self._reporting = asyncio.create_task(self._report_forever())
        logger.info("replica %s ready (pid %d)", self.replica_id, os.getpid())

    async def forward(self, request: ForwardedRequest):
        """The app's answer to one request, as the ASGI messages it sends (a start, then body chunks). When the
        caller goes away (its client disconnected), Ray cancels this generator: the app then sees the disconnect
        and aborts the engine's request, as it does for a client of its own."""
        disconnected = asyncio.Event()
        messages: asyncio.Queue = asyncio.Queue()
        body = [{"type": "http.request", "body": request.body, "more_body": False}]

        async def receive() -> dict:
            if body:
                return body.pop()
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", []), (REPLICA_HEADER.encode(), self.replica_id.encode())]
                message = {**message, "headers": headers}
            messages.put_nowait(message)

        task = asyncio.create_task(self.app(_scope(request), receive, send))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda _: messages.put_nowait(None))
        try:
            while (message := await messages.get()) is not None:
                yield message
            task.result()  # an exception the app let out ends the caller's stream with it
        finally:
            disconnected.set()  # the caller left, or the answer is complete: either way the app may stop listening

    async def check_health(self) -> None:
        """Ray restarts a replica whose engine has stopped (a failed load, or a loop that died)."""
        engine = self.handle.engine
        if engine is None or not engine.is_running:
            raise RuntimeError("the engine is not running")

    def record_routing_stats(self) -> dict:
        """For deploy/router.py: the hashes of every KV block this replica's prefix cache holds."""
        engine = self.handle.engine
        return {PREFIX_HASHES_STAT: engine.cached_prefix_hashes() if engine is not None else []}

    async def __del__(self) -> None:
        # Ray calls this once the replica stops taking requests and its running ones ended (or its graceful
        # shutdown timeout, set from --drain-timeout, ran out).
        self._reporting.cancel()
        await self._lifespan.shutdown()  # the app's lifespan stops the engine

    def _start_draining(self) -> None:
        if self._draining is None:
            engine = self.handle.drain()
            if engine is not None:
                self._draining = asyncio.create_task(self._drain_engine(engine, self.drain_timeout_s))

    async def _report_forever(self) -> None:
        while True:
            try:
                engine = self.handle.engine
                text = self.app.state.metrics.render().decode()
                busy = engine is not None and engine.has_requests
                if await self.board.report.remote(self.replica_id, text, busy):
                    self._start_draining()
            except Exception as exc:  # the board restarting: report again next time
                logger.warning("reporting to the board failed: %s", exc)
            await asyncio.sleep(REPORT_PERIOD_S)


def _scope(request: ForwardedRequest) -> dict:
    scope = dict(request.scope)
    scope["headers"] = [(bytes(k), bytes(v)) for k, v in scope["headers"]]
    scope["client"] = tuple(scope["client"]) if scope.get("client") else None
    scope["server"] = tuple(scope["server"]) if scope.get("server") else None
    return {**scope, "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "state": {}}


class _Lifespan:
    """Runs an ASGI app's lifespan (startup, later shutdown) outside a server, as uvicorn would."""

    def __init__(self, app) -> None:
        self.app = app
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._task: asyncio.Task | None = None

    async def startup(self) -> None:
        self._task = asyncio.create_task(self.app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}},
                                                  self._inbox.get, self._outbox.put))
        await self._inbox.put({"type": "lifespan.startup"})
        reply = await self._outbox.get()
        if reply["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"the app failed to start: {reply.get('message', reply['type'])}")

    async def shutdown(self) -> None:
        if self._task is None or self._task.done():
            return
        await self._inbox.put({"type": "lifespan.shutdown"})
        await asyncio.wait_for(self._outbox.get(), timeout=60)

"""The web UI at "/", built when it is first asked for instead of at start.

Importing Gradio and building the UI's tabs is ~4 s of Python on 2 cores, and a server's start did it while the first
model loaded, so the load waited on the GIL for most of it (a 1B GGUF's server: ready in 5.4 s instead of 8.6); it
also holds ~70 MiB that a server used only through /v1 never needs. Built on the first request under "/" that no
route of the API matched (a browser opening the page, gradio_client), on a worker thread: the API goes on serving
meanwhile, and that first visit waits for the build."""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any

logger = logging.getLogger("tern")


class LazyUI:
    """An ASGI app that builds the real one on its first request and hands every request to it. `build` returns a
    Starlette app with a lifespan (Gradio's queue starts there); it runs on a worker thread, its lifespan on the
    event loop, and close() ends that lifespan (the app's own lifespan calls it at shutdown)."""

    def __init__(self, build: Callable[[], Any]):
        self._build = build
        self._app = None
        self._lock = asyncio.Lock()  # concurrent first requests (a page and its assets) build it once
        self._lifespans = AsyncExitStack()

    async def __call__(self, scope, receive, send) -> None:
        app = self._app or await self._built()
        await app(scope, receive, send)

    async def _built(self):
        async with self._lock:
            if self._app is None:
                started = time.perf_counter()
                app = await asyncio.to_thread(self._build)
                await self._lifespans.enter_async_context(app.router.lifespan_context(app))
                self._app = app
                logger.info("web UI built on its first request in %.1f s", time.perf_counter() - started)
        return self._app

    async def close(self) -> None:
        async with self._lock:  # a build under way finishes first, so its lifespan is ended too
            await self._lifespans.aclose()

"""RequestStream: the hand-off of one request's outputs from the engine thread to its consumer.

Created inside a running asyncio loop it is an async iterator (outputs cross with call_soon_threadsafe);
created outside one it is a plain blocking iterator (tests, benchmarks, scripts).
"""
from __future__ import annotations

import asyncio
import queue

_END = object()


class RequestStream:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
            self._async_queue: asyncio.Queue = asyncio.Queue()
        except RuntimeError:
            self._loop = None
            self._sync_queue: queue.SimpleQueue = queue.SimpleQueue()
        self.finished = False

    # Engine-thread side.
    def put(self, item) -> bool:
        """Deliver an output or an exception. False when the consumer's loop is gone (the request is orphaned)."""
        if self._loop is None:
            self._sync_queue.put(item)
            return True
        try:
            self._loop.call_soon_threadsafe(self._async_queue.put_nowait, item)
            return True
        except RuntimeError:
            return False

    def close(self) -> bool:
        return self.put(_END)

    # Consumer side.
    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.finished:
            raise StopAsyncIteration
        item = await self._async_queue.get()
        return self._unwrap(item, StopAsyncIteration)

    def __iter__(self):
        return self

    def __next__(self):
        if self.finished:
            raise StopIteration
        item = self._sync_queue.get()
        return self._unwrap(item, StopIteration)

    def _unwrap(self, item, stop):
        if item is _END:
            self.finished = True
            raise stop
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        return item

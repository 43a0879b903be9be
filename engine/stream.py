"""RequestStream: the hand-off of one request's outputs from the engine thread to its consumer.

Created inside a running asyncio loop it is an async iterator (outputs cross with call_soon_threadsafe);
created outside one it is a plain blocking iterator (tests, benchmarks, scripts). A consumer that stops reading
closes it (`close()`, `aclose()`, or `contextlib.aclosing`), which aborts the request if it has not ended: its KV
blocks are freed at the engine's next turn instead of when max_tokens runs out.
"""
from __future__ import annotations

import asyncio
import queue
from collections.abc import Callable

from engine.outputs import Completion

_END = object()


class RequestStream:
    def __init__(self, request_id: str, abort: Callable[[str], None] | None = None) -> None:
        self.request_id = request_id
        self._abort = abort  # Engine.abort
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

    def end(self) -> bool:
        """The request has ended: its consumer's iteration stops after what came before."""
        return self.put(_END)

    # Consumer side.
    def close(self) -> None:
        """Stop reading: abort the request unless it has ended. Any time, any number of times."""
        if not self.finished and self._abort is not None:
            self._abort(self.request_id)

    async def aclose(self) -> None:
        self.close()

    async def completion(self) -> Completion:
        """Every output to the end, accumulated; the request is aborted if this is cancelled first."""
        completion = Completion(self.request_id)
        try:
            async for out in self:
                completion.add(out)
        finally:
            self.close()
        return completion

    def collect(self) -> Completion:
        """The blocking twin of completion(), for streams made outside an event loop."""
        completion = Completion(self.request_id)
        try:
            for out in self:
                completion.add(out)
        finally:
            self.close()
        return completion

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

"""Graceful shutdown: on SIGTERM or SIGINT the server drains before it closes its socket, and then exits 0.

Draining: /ready and new work answer 503 with Retry-After (the socket stays open, so clients get an answer rather
than a refused connection); running requests get up to the drain timeout to finish; whatever still runs then is
ended by the engine with finish_reason "abort" (a stream gets that last chunk and [DONE], a plain request a 503).
A second signal ends the wait at once.
"""
from __future__ import annotations

import asyncio
import logging
import time
from types import FrameType

import uvicorn

from engine import Engine
from engine.registry import ModelRegistry

logger = logging.getLogger(__name__)

DEFAULT_DRAIN_TIMEOUT_S = 30.0
POLL_S = 0.05
# After the engine ended every request: how long their last chunks and responses may take to be written.
_ABORT_WAIT_S = 10.0
FLUSH_TIMEOUT_S = 10.0  # uvicorn's timeout_graceful_shutdown: then open connections (a stuck client) are cut


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose signals start a drain instead of closing the socket. uvicorn's own handler sets
    should_exit (its shutdown closes the socket first) and re-raises the signal once done, which makes the exit
    status 128 + signal; this one sets should_exit only when the drain is over and re-raises nothing."""

    def __init__(self, config: uvicorn.Config, models: ModelRegistry, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.models = models
        self.drain_timeout_s = drain_timeout_s
        self._num_signals = 0
        self._drain: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: only flags here; on_tick, on the event loop, starts the drain.
        self._num_signals += 1
        if not self.started:  # still starting up: nothing is running yet, so nothing to drain
            self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self._num_signals and self._drain is None:
            self._drain = asyncio.create_task(self._drain_then_exit())
        return await super().on_tick(counter)

    async def _drain_then_exit(self) -> None:
        try:
            # Every loaded engine at once, each with the whole timeout; no model loads from now on.
            engines = self.models.drain()
            await asyncio.gather(*(self._drain_engine(engine) for engine in engines))
        except Exception:  # never keep the server from exiting
            logger.exception("draining failed; shutting down")
        finally:
            self.should_exit = True

    async def _drain_engine(self, engine: Engine) -> None:
        await drain_engine(engine, self.drain_timeout_s, lambda: self._num_signals >= 2)


async def drain_engine(engine: Engine, timeout_s: float, is_cut_short=lambda: False) -> None:
    """Wait until the (draining) engine's running requests end, up to timeout_s or until is_cut_short() says so (a
    second signal); then end the rest with finish_reason "abort" and give their last chunks time to be written.
    Shared by the uvicorn server here and by each replica on Ray (deploy/replica.py)."""
    if engine.has_requests:
        logger.info("draining: new requests get 503; the running ones have up to %.0f s to finish (send the "
                    "signal again to end them now)", timeout_s)
    deadline = time.monotonic() + timeout_s
    while engine.has_requests and time.monotonic() < deadline and not is_cut_short():
        await asyncio.sleep(POLL_S)
    if not engine.has_requests:
        logger.info("drained: every request finished")
        return
    logger.warning("drain over: ending the requests still running (finish_reason \"abort\")")
    engine.abort_all()
    deadline = time.monotonic() + _ABORT_WAIT_S
    while engine.has_requests and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)

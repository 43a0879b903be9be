"""EngineHandle: the engine as the server sees it — absent while loading, then ready (or failed with a reason)."""
from __future__ import annotations

import threading

from engine.engine import Engine


class EngineHandle:
    """Lets the API and the UI exist before the model has loaded: they ask the handle, not a global."""

    def __init__(self, served_model_name: str | None = None) -> None:
        self.engine: Engine | None = None
        self.error: str | None = None  # one line saying why loading failed
        self.is_draining = False  # drain(): shutting down, no new requests
        self._served_model_name = served_model_name
        self._ready = threading.Event()

    @property
    def is_ready(self) -> bool:
        return self.engine is not None

    @property
    def served_model_name(self) -> str:
        if self._served_model_name:
            return self._served_model_name
        return self.engine.model_name if self.engine is not None else "loading"

    def set_engine(self, engine: Engine) -> None:
        if self.is_draining:  # loaded while shutting down: it takes no requests either
            engine.drain()
        self.engine = engine
        self._ready.set()

    def drain(self) -> Engine | None:
        """Shutting down: the engine, now or once loaded, takes no new requests (Engine.drain). Returns the engine
        if it is loaded: whoever drains waits for its requests to end."""
        self.is_draining = True
        engine = self.engine
        if engine is not None:
            engine.drain()
        return engine

    def set_error(self, message: str) -> None:
        self.error = message
        self._ready.set()

    def clear(self) -> None:
        """Unloaded (engine/registry.py): no engine until the next load."""
        self.engine = None
        self.error = None
        self._ready.clear()

    def wait(self, timeout_s: float | None = None) -> Engine | None:
        self._ready.wait(timeout_s)
        return self.engine

"""One served model, as the ModelRegistry (engine/registry.py) keeps it: its spec (id, engine options, keep-alive),
its state and leases (ModelSlot), the Lease a request holds, the status /v1/models and /metrics show, and the errors a
request for it may get. Loading and unloading themselves are the registry's."""
from __future__ import annotations

import ctypes
import gc
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import EngineError, ModelLoadError
from engine.handle import EngineHandle

if TYPE_CHECKING:
    from engine.registry import ModelRegistry

logger = logging.getLogger("engine.registry")

UNLOADED, LOADING, LOADED, UNLOADING, FAILED = "unloaded", "loading", "loaded", "unloading", "failed"


@dataclass(frozen=True)
class ModelSpec:
    """One served model: the id clients name it by, how its engine is built, and how long it may sit idle loaded
    (None: never unloaded for idleness; it may still be evicted to make room under max_loaded)."""

    id: str
    config: EngineConfig
    keep_alive_s: float | None = None


class UnknownModelError(EngineError):
    """A request named a model this server does not serve; the message names the ones it does."""


class ModelNotReadyError(EngineError):
    """The model is still loading at start-up (loaded on purpose, not on demand): retry shortly."""


class ModelFailedError(ModelLoadError):
    """A served model failed to load; the message names it and says why (the others serve on)."""


@dataclass(frozen=True)
class ModelStatus:
    """One model as /v1/models, /metrics and the UI show it."""

    id: str
    state: str
    error: str | None  # why it failed to load
    num_leases: int  # requests (and UI actions) using it now
    num_loads: int
    num_unloads: int
    last_load_s: float | None  # how long its last load took
    idle_s: float | None  # since its last lease ended, when loaded and unused
    unloads_by_reason: dict[str, int]  # "idle" (its keep-alive passed), "evicted" (room for another, max_loaded)
    total_load_s: float = 0.0  # every load's seconds, added up


def load_engine(config: EngineConfig) -> Engine:
    """An engine started and at full speed: where the decode step compiles, it is built before the engine serves."""
    engine = Engine(config).start()
    if engine.info().decode_step == "compiling":
        # Ready means full speed: until the compiled step is built the eager one would serve at a fifth of its
        # speed, with the compile taking the cores from it, so the model is not ready until it is done.
        logger.info("building the compiled decode step before serving (seconds when the inductor cache has it, "
                    "minutes on a machine's first start)")
        engine.wait_for_compiled_decode()
    # Loading read and repacked the file through buffers now freed; glibc keeps those under its mmap threshold in
    # its arenas, resident, until asked (~40 MB at ready for a 1B GGUF): asked once here, before any request. No
    # gc.collect: loading leaves no cycles holding memory (it freed nothing, measured), and a full collection over
    # the web app's objects took 0.15-0.2 s of every start, holding the GIL.
    trim_malloc()
    return engine


class Lease:
    """The right to use one model's engine until release(); while any lease on it is held it is not unloaded.
    Release is idempotent; a lease is also a context manager."""

    def __init__(self, registry: ModelRegistry, model_id: str, engine: Engine) -> None:
        self.registry, self.model_id, self.engine = registry, model_id, engine
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.engine = None  # a released lease kept somewhere must not keep an unloaded model's memory
            self.registry._release(self.model_id)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class ModelSlot:
    """One model's place in the registry: its engine's handle, state, leases and counts (changed under the
    registry's lock)."""

    def __init__(self, spec: ModelSpec, handle: EngineHandle | None = None) -> None:
        self.spec = spec
        # A handle given from outside (ModelRegistry.serving) is loaded by its owner: the entry only mirrors it.
        self.is_external = handle is not None
        self.handle = handle or EngineHandle(spec.id)
        self.state = UNLOADED
        self.on_demand = False  # this load was asked for by a request, which waits for it
        self.num_leases = 0
        self.num_waiting = 0  # requests waiting for a lease on it
        self.last_used = time.monotonic()
        self.num_loads = self.num_unloads = 0
        self.last_load_s: float | None = None
        self.total_load_s = 0.0
        self.unloads_by_reason: dict[str, int] = {}  # "idle" (keep-alive) or "evicted" (max_loaded)

    def sync(self) -> None:
        """An external handle's state, as the registry names it (never unloaded: its owner loaded it for good)."""
        if self.is_external:
            handle = self.handle
            self.state = LOADED if handle.engine is not None else FAILED if handle.error else LOADING

    def status(self) -> ModelStatus:
        self.sync()
        idle = time.monotonic() - self.last_used if self.state == LOADED and not self.num_leases else None
        return ModelStatus(self.spec.id, self.state, self.handle.error, self.num_leases, self.num_loads,
                           self.num_unloads, self.last_load_s, idle, dict(self.unloads_by_reason), self.total_load_s)


def has_room(slots: Iterable[ModelSlot], max_loaded: int | None) -> bool:
    """Whether one more model may load under max_loaded (one unloading still holds its memory, so its room)."""
    return max_loaded is None or sum(slot.state in (LOADING, LOADED, UNLOADING) for slot in slots) < max_loaded


def least_recently_used_idle(slots: Iterable[ModelSlot]) -> ModelSlot | None:
    """The model to evict for room: loaded, and used by nothing (no lease, nobody waiting for one, and no request
    in its engine: one submitted outside a lease is never cut off either)."""
    idle = [slot for slot in slots if slot.state == LOADED and slot.num_leases == 0 and slot.num_waiting == 0
            and not slot.handle.engine.has_requests]
    return min(idle, key=lambda slot: slot.last_used, default=None)


def return_freed_memory() -> None:
    """Give an unloaded model's memory back to the system: collect its tensors' cycles, then ask glibc to return the
    freed heap (large tensors are mmap'd and go back at once; smaller ones stay in malloc's arenas otherwise)."""
    gc.collect()
    trim_malloc()


def trim_malloc() -> None:
    """Ask glibc to return its arenas' free memory to the system."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: what it keeps, it keeps
        pass

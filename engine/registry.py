"""ModelRegistry: the models one server serves, by id. Each model is one Engine, unchanged inside; the registry loads
it on demand (once, however many requests ask), unloads it after --keep-alive seconds idle, and evicts the least
recently used idle model when --max-loaded models are loaded. api/ and ui/ ask it for an engine by id (a Lease,
which keeps that engine loaded until released) and know nothing else of loading.

States: unloaded -> loading -> loaded -> unloading -> unloaded, or loading -> failed (the reason kept, the other
models served on). A model is never unloaded while a lease on it is held or its engine has a request."""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import DrainingError, ModelLoadError
from engine.handle import EngineHandle
from engine.model_slot import (FAILED, LOADED, LOADING, UNLOADED, UNLOADING, Lease, ModelFailedError,
                               ModelNotReadyError, ModelSlot, ModelSpec, ModelStatus, UnknownModelError, has_room,
                               least_recently_used_idle, load_engine, return_freed_memory)

__all__ = ["FAILED", "LOADED", "LOADING", "UNLOADED", "UNLOADING", "Lease", "ModelFailedError", "ModelNotReadyError",
           "ModelRegistry", "ModelSpec", "ModelStatus", "UnknownModelError", "load_engine"]

logger = logging.getLogger(__name__)


class ModelRegistry:
    def __init__(self, specs: Sequence[ModelSpec], max_loaded: int | None = None,
                 load: Callable[[EngineConfig], Engine] = load_engine) -> None:
        if not specs:
            raise ValueError("a registry serves at least one model")
        ids = [spec.id for spec in specs]
        if len(set(ids)) != len(ids):
            raise ValueError(f"model ids must differ, got {ids}")
        if max_loaded is not None and max_loaded < 1:
            raise ValueError(f"max_loaded must be at least 1, got {max_loaded}")
        self.max_loaded = max_loaded
        self._load = load
        self._entries = {spec.id: ModelSlot(spec) for spec in specs}
        self._lock = threading.Condition()
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._is_draining = False
        self._is_stopped = False
        self._reaper: threading.Thread | None = None

    @classmethod
    def serving(cls, handle: EngineHandle | Engine) -> ModelRegistry:
        """A registry over one model whose engine someone else loads and owns (a test's engine, or a handle loading
        on another thread): the model is `loading` until the handle has its engine, then `loaded` for good, or
        `failed` with the handle's error. Its id is the handle's served name when built: name the handle, or give it
        its engine first."""
        if isinstance(handle, Engine):
            engine, handle = handle, EngineHandle()
            handle.set_engine(engine)
        config = handle.engine.config if handle.engine is not None else EngineConfig()
        registry = cls([ModelSpec(handle.served_model_name, config)])
        registry._entries[registry.default_id] = ModelSlot(registry.spec(), handle)
        return registry

    # -- what is served ------------------------------------------------------------------------------------------
    @property
    def ids(self) -> list[str]:
        return list(self._entries)

    @property
    def default_id(self) -> str:
        """The first model: the one a request that names no model gets."""
        return next(iter(self._entries))

    def resolve(self, model: str | None) -> str:
        """The id a request's `model` names: empty or None means the default; an unknown one raises."""
        if not model:
            return self.default_id
        entry = self._entries.get(model) or self._entries[self.default_id]
        if entry.is_external and entry.handle.engine is None:
            return entry.spec.id  # someone else's model, not loaded yet: what it will be called is not known
        if model not in self._entries:
            served = ", ".join(f"`{i}`" for i in self._entries)
            raise UnknownModelError(f"The model `{model}` does not exist. This server serves {served}.", "model")
        return model

    def spec(self, model: str | None = None) -> ModelSpec:
        return self._entries[self.resolve(model)].spec

    def handle(self, model: str | None = None) -> EngineHandle:
        """The model's handle: its engine when loaded (else None), its load error when it failed."""
        return self._entries[self.resolve(model)].handle

    def status(self, model: str | None = None) -> ModelStatus:
        with self._lock:
            return self._entries[self.resolve(model)].status()

    def statuses(self) -> list[ModelStatus]:
        return [self.status(model_id) for model_id in self._entries]

    @property
    def is_draining(self) -> bool:
        # An external handle may be drained by its owner (a test, a Ray replica) rather than through drain().
        return self._is_draining or any(entry.handle.is_draining for entry in self._entries.values())

    # -- life ----------------------------------------------------------------------------------------------------
    def start(self, preload: Sequence[str] = ()) -> ModelRegistry:
        """Begin loading `preload` (requests for them get ModelNotReadyError until each is loaded, as a single-model
        server's did) and start the thread that unloads idle models."""
        with self._lock:
            for model_id in preload:
                self._begin_load(self._entries[self.resolve(model_id)], on_demand=False)
        self._reaper = threading.Thread(target=self._reap_idle, name="tern-registry", daemon=True)
        self._reaper.start()
        return self

    def drain(self) -> list[Engine]:
        """Shutting down: no model loads any more and no engine takes new requests; those running go on. Returns the
        loaded engines, for whoever drains to wait on."""
        with self._lock:
            self._is_draining = True
            engines = [e for e in (entry.handle.drain() for entry in self._entries.values()) if e is not None]
            self._notify()
            return engines

    def stop(self) -> None:
        """Stop every engine (the server is exiting)."""
        with self._lock:
            self._is_stopped = True
            engines = [entry.handle.engine for entry in self._entries.values() if entry.handle.engine is not None]
            self._notify()
        for engine in engines:
            engine.stop()
        if self._reaper is not None:
            self._reaper.join(timeout=5)

    # -- leases --------------------------------------------------------------------------------------------------
    def acquire(self, model: str | None = None, timeout_s: float | None = None) -> Lease:
        """A lease on the model's engine, loading it first if needed (this thread waits; one load however many ask).
        Raises UnknownModelError, ModelLoadError (it failed to load: the reason), ModelNotReadyError (loading at
        start-up), DrainingError, or TimeoutError after timeout_s."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            while True:
                lease = self._try_lease(self.resolve(model))
                if lease is not None:
                    return lease
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"model `{self.resolve(model)}` did not load within {timeout_s} s")
                # Woken by every change; the second is for a room that frees without one (an engine's last request
                # ending after its lease did).
                entry = self._entries[self.resolve(model)]
                entry.num_waiting += 1  # a waiter is a use: the model it waits for is not unloaded under it
                try:
                    self._lock.wait(1.0 if remaining is None else min(remaining, 1.0))
                finally:
                    entry.num_waiting -= 1

    async def acquire_async(self, model: str | None = None) -> Lease:
        """acquire() for the event loop: waits for a load without holding a thread. Cancelled (the client left), it
        leaves nothing behind; the load it started goes on."""
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                lease = self._try_lease(self.resolve(model))
                if lease is not None:
                    return lease
                waiter = loop.create_future()
                self._async_waiters.append((loop, waiter))
                entry = self._entries[self.resolve(model)]
                entry.num_waiting += 1
            try:
                await asyncio.wait([waiter], timeout=1.0)  # as acquire(): woken by every change, else each second
            finally:
                with self._lock:
                    entry.num_waiting -= 1

    def _try_lease(self, model_id: str) -> Lease | None:
        """Under the lock: a lease now, or None after starting whatever must happen first (a load, an eviction)."""
        entry = self._entries[model_id]
        entry.sync()
        if self.is_draining or self._is_stopped:
            raise DrainingError("the server is shutting down and takes no new requests; retry shortly")
        if entry.state == LOADED:
            entry.num_leases += 1
            entry.last_used = time.monotonic()
            return Lease(self, model_id, entry.handle.engine)
        if entry.state == FAILED:
            raise ModelFailedError(f"model `{model_id}` failed to load: {entry.handle.error}", "model")
        if entry.state == LOADING and (entry.is_external or not entry.on_demand):
            raise ModelNotReadyError(f"model `{model_id}` is still loading; retry shortly", "model")
        if entry.state == UNLOADED:
            if has_room(self._entries.values(), self.max_loaded):
                self._begin_load(entry, on_demand=True)
            elif all(slot.state != UNLOADING for slot in self._entries.values()):  # one under way makes the room
                victim = least_recently_used_idle(self._entries.values())
                if victim is not None:
                    why = f"least recently used idle model, room for `{model_id}` (--max-loaded {self.max_loaded})"
                    self._begin_unload(victim, "evicted", why)
        return None  # loading, unloading, or waiting for a loaded model to become idle

    def _release(self, model_id: str) -> None:
        with self._lock:
            entry = self._entries[model_id]
            entry.num_leases -= 1
            entry.last_used = time.monotonic()
            self._notify()

    # -- loading and unloading -----------------------------------------------------------------------------------
    def _begin_load(self, entry: ModelSlot, on_demand: bool) -> None:
        entry.state, entry.on_demand = LOADING, on_demand
        entry.handle.error = None
        threading.Thread(target=self._load_entry, args=(entry,), name=f"tern-load-{entry.spec.id}", daemon=True).start()

    def _load_entry(self, entry: ModelSlot) -> None:
        started = time.monotonic()
        logger.info("loading model `%s` (%s)", entry.spec.id, "on demand" if entry.on_demand else "at start")
        engine, error = None, None
        try:
            engine = self._load(entry.spec.config)
        except ModelLoadError as exc:
            error = exc.message
            logger.error("model `%s` failed to load: %s", entry.spec.id, error)
        except Exception as exc:  # keep serving the other models, with this one's reason
            error = f"{type(exc).__name__}: {exc}"
            logger.exception("model `%s` failed to load", entry.spec.id)
        with self._lock:
            if engine is not None and self._is_stopped:
                engine.stop()
                engine = None
            if engine is None:
                entry.state = FAILED
                entry.handle.set_error(error or "the server stopped while it loaded")
            else:
                entry.state, entry.last_used = LOADED, time.monotonic()
                entry.num_loads += 1
                entry.last_load_s = entry.last_used - started
                entry.total_load_s += entry.last_load_s
                entry.handle.set_engine(engine)  # drained at once if the server drains
                logger.info("model `%s` loaded in %.1f s", entry.spec.id, entry.last_load_s)
            self._notify()

    def _begin_unload(self, entry: ModelSlot, kind: str, reason: str) -> None:
        engine = entry.handle.engine
        entry.unloads_by_reason[kind] = entry.unloads_by_reason.get(kind, 0) + 1
        entry.state = UNLOADING
        entry.handle.clear()
        logger.info("unloading model `%s`: %s", entry.spec.id, reason)
        # In a list the thread empties: a Thread keeps its args until its target returns, which would keep the
        # engine (and every tensor of it) alive through the memory's return below.
        threading.Thread(target=self._unload_entry, args=(entry, [engine]), name=f"tern-unload-{entry.spec.id}",
                         daemon=True).start()

    def _unload_entry(self, entry: ModelSlot, holder: list[Engine]) -> None:
        holder.pop().stop()  # the last reference to the engine goes with the call
        return_freed_memory()
        with self._lock:
            entry.state = UNLOADED
            entry.num_unloads += 1
            self._notify()

    def _reap_idle(self) -> None:
        """Unload each model idle for its keep-alive. Sleeps until the next one could expire; no polling."""
        with self._lock:
            while not self._is_stopped:
                now, deadlines = time.monotonic(), []
                for entry in self._entries.values() if not self._is_draining else ():
                    keep_alive = entry.spec.keep_alive_s
                    if entry.state != LOADED or keep_alive is None or entry.num_leases or entry.num_waiting:
                        continue  # not loaded, kept for good, or in use (its release wakes this thread)
                    if entry.last_used + keep_alive > now:
                        deadlines.append(entry.last_used + keep_alive)
                    elif entry.handle.engine.has_requests:  # running without a lease: look again a keep-alive later
                        entry.last_used = now
                        deadlines.append(now + keep_alive)
                    else:
                        idle_s = now - entry.last_used
                        self._begin_unload(entry, "idle", f"idle for {idle_s:.0f} s (keep-alive {keep_alive:g} s)")
                self._lock.wait(min(deadlines) - now if deadlines else None)

    def _notify(self) -> None:
        """Under the lock: wake every waiter, threads and event loops, to look again."""
        self._lock.notify_all()
        for loop, waiter in self._async_waiters:
            loop.call_soon_threadsafe(_resolve, waiter)
        self._async_waiters.clear()


def _resolve(waiter: asyncio.Future) -> None:
    if not waiter.done():  # a cancelled waiter (its client left) is simply dropped
        waiter.set_result(None)

"""ModelRegistry: several models behind one server, each loaded on demand once, unloaded when idle, evicted least
recently used first, never while in use; a model that fails to load leaves the others serving. Real engines on a tiny
random checkpoint (each loads in about a second)."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine import EngineConfig, ModelLoadError, SamplingParams
from engine.registry import (FAILED, LOADED, UNLOADED, ModelNotReadyError, ModelRegistry, ModelSpec,
                             UnknownModelError, load_engine)

WAIT_S = 60  # bound on waiting for a state; a fast machine sees it in a second


@pytest.fixture
def registry_of(tiny_checkpoint):
    """Build registries over the tiny checkpoint under several ids; every one is stopped after the test."""
    registries = []

    def make(*ids: str, keep_alive_s: float | None = None, max_loaded: int | None = None, paths: dict | None = None):
        specs = [ModelSpec(i, EngineConfig(model=str((paths or {}).get(i, tiny_checkpoint)), max_num_seqs=4),
                           keep_alive_s) for i in ids]
        registry = ModelRegistry(specs, max_loaded=max_loaded).start()
        registries.append(registry)
        return registry

    yield make
    for registry in registries:
        registry.stop()


def wait_for_state(registry: ModelRegistry, model_id: str, state: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while registry.status(model_id).state != state:
        assert time.monotonic() < deadline, f"{model_id} is {registry.status(model_id).state}, never {state}"
        time.sleep(0.01)


def generate(lease, max_tokens: int = 4) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return lease.engine.generate([[1, 2, 3]], params)[0].choices[0].token_ids


def test_a_request_for_an_unloaded_model_loads_it_once_however_many_ask(registry_of):
    registry = registry_of("a", "b")
    assert [s.state for s in registry.statuses()] == [UNLOADED, UNLOADED]  # nothing preloaded here
    leases = []
    threads = [threading.Thread(target=lambda: leases.append(registry.acquire("b"))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    assert len(leases) == 4 and len({id(lease.engine) for lease in leases}) == 1
    status = registry.status("b")
    assert (status.state, status.num_loads, status.num_leases) == (LOADED, 1, 4)
    assert registry.status("a").state == UNLOADED  # the other model stays as it was
    assert len(generate(leases[0])) == 4
    for lease in leases:
        lease.release()
    assert registry.status("b").num_leases == 0


def test_requests_waiting_on_the_event_loop_share_one_load(registry_of):
    registry = registry_of("a")

    async def ask_three_times():
        return await asyncio.gather(*(registry.acquire_async("a") for _ in range(3)))

    leases = asyncio.run(ask_three_times())
    assert len({id(lease.engine) for lease in leases}) == 1 and registry.status("a").num_loads == 1
    for lease in leases:
        lease.release()


def test_an_unknown_model_is_refused_naming_the_served_ones(registry_of):
    registry = registry_of("a", "b")
    with pytest.raises(UnknownModelError, match="`nope`.*`a`, `b`"):
        registry.acquire("nope")
    assert registry.resolve(None) == registry.resolve("") == "a"  # no model named: the first one


def test_an_idle_model_is_unloaded_after_its_keep_alive_but_never_while_leased(registry_of):
    registry = registry_of("a", keep_alive_s=0.0)  # idle for no time at all: unloaded the moment it is free
    lease = registry.acquire("a")
    engine = lease.engine
    # Held, it serves a whole generation (its engine would be stopped under it otherwise) and stays loaded.
    assert len(generate(lease, max_tokens=16)) == 16
    assert registry.status("a").state == LOADED and engine.is_running
    lease.release()
    wait_for_state(registry, "a", UNLOADED)
    assert not engine.is_running and registry.handle("a").engine is None
    assert registry.status("a").num_unloads == 1
    with registry.acquire("a") as again:  # asked again, it loads again
        assert again.engine is not engine and len(generate(again)) == 4
    assert registry.status("a").num_loads == 2


def test_a_model_without_keep_alive_stays_loaded(registry_of):
    registry = registry_of("a", keep_alive_s=None)
    registry.acquire("a").release()
    # The reaper looks at each change; after the release it has looked and found nothing to do.
    registry.acquire("a").release()
    assert registry.status("a").state == LOADED and registry.status("a").num_loads == 1


def test_max_loaded_evicts_the_least_recently_used_idle_model(registry_of):
    registry = registry_of("a", "b", "c", max_loaded=2)
    registry.acquire("a").release()
    registry.acquire("b").release()
    registry.acquire("a").release()  # a is now more recent than b
    with registry.acquire("c") as lease:
        assert len(generate(lease)) == 4
    states = {s.id: s.state for s in registry.statuses()}
    assert states == {"a": LOADED, "b": UNLOADED, "c": LOADED}
    assert registry.status("b").num_unloads == 1 and registry.status("a").num_unloads == 0


def test_a_leased_model_is_not_evicted_the_newcomer_waits_for_it(registry_of):
    registry = registry_of("a", "b", max_loaded=1)
    held = registry.acquire("a")
    got = []
    waiter = threading.Thread(target=lambda: got.append(registry.acquire("b", timeout_s=WAIT_S)))
    waiter.start()
    # While a is held, b cannot take its place: a keeps serving.
    assert len(generate(held, max_tokens=8)) == 8
    assert registry.status("a").state == LOADED and not got
    held.release()
    waiter.join(WAIT_S)
    assert got and registry.status("b").state == LOADED and registry.status("a").state == UNLOADED
    got[0].release()


def test_a_model_that_fails_to_load_says_why_and_the_others_serve_on(registry_of, tmp_path):
    registry = registry_of("good", "broken", paths={"broken": tmp_path / "no-such-model.gguf"})
    with pytest.raises(ModelLoadError, match="`broken` failed to load"):
        registry.acquire("broken")
    status = registry.status("broken")
    assert status.state == FAILED and status.error
    with registry.acquire("good") as lease:
        assert len(generate(lease)) == 4


def test_a_model_preloaded_at_start_refuses_requests_until_loaded(registry_of, tiny_checkpoint):
    release_load = threading.Event()

    def slow_load(config):
        release_load.wait(WAIT_S)
        return load_engine(config)

    registry = ModelRegistry([ModelSpec("a", EngineConfig(model=str(tiny_checkpoint)))], load=slow_load)
    registry.start(preload=["a"])
    try:
        with pytest.raises(ModelNotReadyError):  # as a single-model server answered while loading: retry shortly
            registry.acquire("a")
        release_load.set()
        wait_for_state(registry, "a", LOADED)
        registry.acquire("a").release()
    finally:
        release_load.set()
        registry.stop()


def test_draining_refuses_new_loads_and_drains_the_loaded_engines(registry_of):
    registry = registry_of("a", "b")
    registry.acquire("a").release()
    engines = registry.drain()
    assert len(engines) == 1 and engines[0].is_draining
    with pytest.raises(Exception, match="shutting down"):
        registry.acquire("b")


def test_a_registry_serving_someone_elses_handle_follows_it_and_never_unloads_it(tiny_engine_factory):
    # What build_router(handle) and the in-process test apps use: the handle's owner loads the engine.
    from engine import EngineHandle

    engine, _ = tiny_engine_factory()
    handle = EngineHandle("tiny")
    registry = ModelRegistry.serving(handle)
    assert registry.ids == ["tiny"] and registry.status().state == "loading"
    with pytest.raises(ModelNotReadyError):
        registry.acquire("tiny")
    handle.set_engine(engine)
    with registry.acquire("tiny") as lease:
        assert lease.engine is engine and registry.status("tiny").num_leases == 1
    status = registry.status("tiny")
    assert (status.state, status.num_unloads) == (LOADED, 0)
    handle.drain()  # drained by its owner: the registry refuses new work too
    assert registry.is_draining
    failed = EngineHandle("broken")
    failed.set_error("no such file")
    with pytest.raises(ModelLoadError, match="no such file"):
        ModelRegistry.serving(failed).acquire()


def test_unloads_are_counted_by_reason(registry_of):
    crowded = registry_of("a", "b", max_loaded=1)
    crowded.acquire("a").release()
    crowded.acquire("b").release()  # makes room: `a` is evicted
    assert crowded.status("a").unloads_by_reason == {"evicted": 1}
    idling = registry_of("c", keep_alive_s=0.1)
    idling.acquire("c").release()
    wait_for_state(idling, "c", UNLOADED)
    assert idling.status("c").unloads_by_reason == {"idle": 1}

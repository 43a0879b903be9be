"""A step that raises (a kernel or model bug, injected with Engine.fail_next_step) fails the requests of that step
with a StepFailedError, frees their KV blocks, and the engine goes on serving with the same answers as before."""
from __future__ import annotations

import time

import pytest

from engine import SamplingParams, StepFailedError

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPT = [5, 17, 301, 42, 7, 900, 12, 64, 3, 77, 1000, 250, 8, 19, 33, 61, 402, 6]  # over one 16-token block


def _wait_idle(engine, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not (engine.stats().num_running == 0 and engine.stats().num_kv_blocks_used == 0):
        assert time.monotonic() < deadline, f"engine not idle: {engine.stats()}"
        time.sleep(0.005)


def test_a_failed_step_fails_its_request_frees_its_blocks_and_the_next_request_is_served_alike(tiny_engine_factory):
    engine, _ = tiny_engine_factory()
    [before] = engine.generate([PROMPT], GREEDY)
    engine.fail_next_step(RuntimeError("injected kernel fault"))
    stream = engine.submit(PROMPT, GREEDY)
    with pytest.raises(StepFailedError) as info:
        list(stream)
    assert "RuntimeError" in info.value.message and "retried" in info.value.message
    assert isinstance(info.value.__cause__, RuntimeError)  # the cause travels with it, for the log
    _wait_idle(engine)
    [after] = engine.generate([PROMPT], GREEDY)
    assert after.choices[0].token_ids == before.choices[0].token_ids
    assert after.choices[0].finish_reason == "length"


def test_a_failure_mid_decode_fails_every_sequence_of_that_step_and_only_those(tiny_engine_factory):
    engine, _ = tiny_engine_factory()
    [alone] = engine.generate([PROMPT[:5]], GREEDY)
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    two = SamplingParams(n=2, max_tokens=400, ignore_eos=True)
    streams = [engine.submit(PROMPT, long), engine.submit(PROMPT[3:], two)]
    firsts = [next(stream) for stream in streams]  # both are decoding now, so both are in the next step
    assert all(first.token_ids for first in firsts)
    engine.fail_next_step(RuntimeError("injected kernel fault"))
    for stream in streams:
        with pytest.raises(StepFailedError):
            for out in stream:
                assert out.finish_reason is None  # no sample finishes normally once its step failed
    _wait_idle(engine)
    # The engine still batches, prefills and decodes: a request after the failure gets the same tokens as before.
    [again] = engine.generate([PROMPT[:5]], GREEDY)
    assert again.choices[0].token_ids == alone.choices[0].token_ids

"""What a client sees when an engine step fails (injected with Engine.fail_next_step into a real tiny engine): a 500
in OpenAI's error shape, or once a stream has started an error event then [DONE]; the next request is served as
before."""
from __future__ import annotations

import json
import time

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from api import build_router, install_error_handlers
from engine import EngineHandle

PROMPT = [5, 17, 301, 42, 7, 900, 12, 64, 3, 77]
COMPLETION = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "Name three birds."}], "max_tokens": 8, "temperature": 0,
        "ignore_eos": True}


@pytest.fixture
def served(tiny_engine_factory):
    engine, _ = tiny_engine_factory()
    handle = EngineHandle()
    handle.set_engine(engine)
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(build_router(handle))
    with TestClient(app) as client:
        yield engine, client


def _server_error(response) -> dict:
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "server_error"
    assert "RuntimeError" in error["message"] and "retried" in error["message"]
    assert "injected" not in error["message"]  # the exception's own text stays in the server log
    return error


def _events(client, body) -> list[str]:
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        return [line[len("data: "):] for line in response.iter_lines() if line]


def _wait_idle(engine) -> None:
    deadline = time.monotonic() + 30
    while engine.stats().num_running or engine.stats().num_kv_blocks_used:
        assert time.monotonic() < deadline, engine.stats()
        time.sleep(0.01)


def test_a_failed_step_is_a_500_in_openais_shape_and_the_next_request_answers_as_before(served):
    engine, client = served
    before = client.post("/v1/completions", json=COMPLETION).json()["choices"][0]["text"]
    engine.fail_next_step(RuntimeError("injected kernel fault"))
    _server_error(client.post("/v1/completions", json=COMPLETION))
    _wait_idle(engine)
    after = client.post("/v1/completions", json=COMPLETION)
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == before


def test_a_stream_whose_step_fails_ends_with_an_error_event_then_done(served):
    engine, client = served
    before = _events(client, CHAT)
    engine.fail_next_step(RuntimeError("injected kernel fault"))
    events = _events(client, CHAT)
    assert events[-1] == "[DONE]"
    first, error = json.loads(events[0]), json.loads(events[-2])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}  # sent before the step ran
    assert error["error"]["type"] == "server_error" and "RuntimeError" in error["error"]["message"]
    assert len(events) == 3  # no content, no finish_reason: the answer never came
    _wait_idle(engine)
    after = _events(client, CHAT)

    def text(events):
        return "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1])

    assert after[-1] == "[DONE]" and text(after) == text(before)

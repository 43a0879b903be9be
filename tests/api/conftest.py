"""A tiny random model behind the real /v1 routes, for tests of what a client sees."""
from __future__ import annotations

import json

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from api import build_router, install_error_handlers
from engine import EngineHandle


@pytest.fixture
def tiny_api(tiny_engine_factory):
    """(engine, TestClient) serving the tiny llama, whose tokenizer is the default model's."""
    engine, _ = tiny_engine_factory()
    handle = EngineHandle()
    handle.set_engine(engine)
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(build_router(handle))
    with TestClient(app) as client:
        yield engine, client


def sse_chunks(response) -> list[dict]:
    """The JSON chunks of a streamed answer, after checking it ended with [DONE]."""
    assert response.status_code == 200, response.text
    data = [line[len("data: "):] for line in response.text.split("\n\n") if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]

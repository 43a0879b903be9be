"""X-Request-ID on every response: the client's when it is short and plain, else a fresh one; routes and streams
alike, and the route sees the same id it answers with."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient

from api.route_context import RequestIDMiddleware


def _client() -> TestClient:
    app = FastAPI()
    app.add_middleware(RequestIDMiddleware)

    @app.get("/seen")
    async def seen(request: Request) -> dict:
        return {"request_id": request.state.request_id}

    @app.get("/stream")
    async def stream() -> StreamingResponse:
        async def pieces():
            yield "data: 1\n\n"

        return StreamingResponse(pieces(), media_type="text/event-stream")

    return TestClient(app)


def test_the_clients_id_is_echoed_and_seen_by_the_route():
    response = _client().get("/seen", headers={"X-Request-ID": "abc-123"})
    assert response.headers["x-request-id"] == "abc-123" == response.json()["request_id"]


def test_a_missing_or_unfit_id_is_replaced_by_a_fresh_one():
    client = _client()
    ids = [client.get("/seen").headers["x-request-id"] for _ in range(2)]
    ids += [client.get("/seen", headers={"X-Request-ID": value}).headers["x-request-id"] for value in ("a b", "x" * 200)]
    assert len(set(ids)) == 4 and all(len(i) == 32 for i in ids)


def test_streams_and_unknown_paths_carry_it_too():
    client = _client()
    assert client.get("/stream", headers={"X-Request-ID": "s-1"}).headers["x-request-id"] == "s-1"
    missing = client.get("/nowhere", headers={"X-Request-ID": "n-1"})
    assert missing.status_code == 404 and missing.headers["x-request-id"] == "n-1"

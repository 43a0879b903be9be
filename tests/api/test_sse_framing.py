"""SSE framing on its own: one `data:` event per chunk, `[DONE]` last, failures as an error event then `[DONE]`."""
from __future__ import annotations

import asyncio
import json

import pytest

from api.errors import OpenAIError
from api.sse import DONE, event, frame
from engine import QueueFullError


async def _collect(chunks) -> list[str]:
    return [piece async for piece in frame(chunks)]


async def _chunks(items, failure: BaseException | None = None):
    for item in items:
        yield item
    if failure is not None:
        raise failure


def _data(piece: str):
    assert piece.startswith("data: ") and piece.endswith("\n\n")
    return piece[len("data: ") : -2]


def test_each_chunk_is_one_event_and_done_comes_last():
    pieces = asyncio.run(_collect(_chunks([{"a": 1}, {"b": "é"}])))
    assert pieces[-1] == DONE == "data: [DONE]\n\n"
    assert [json.loads(_data(p)) for p in pieces[:-1]] == [{"a": 1}, {"b": "é"}]
    assert all("\n" not in _data(p) for p in pieces[:-1])  # one line per event, whatever the text holds


def test_newlines_in_text_stay_inside_one_event():
    piece = event({"text": "line one\nline two\r\n"})
    assert piece.count("\n") == 2 and json.loads(_data(piece)) == {"text": "line one\nline two\r\n"}


def test_a_failure_after_the_first_chunk_becomes_an_error_event_then_done():
    pieces = asyncio.run(_collect(_chunks([{"a": 1}], OpenAIError(400, "bad thing", param="x", code="oops"))))
    assert json.loads(_data(pieces[0])) == {"a": 1}
    assert json.loads(_data(pieces[1])) == {
        "error": {"message": "bad thing", "type": "invalid_request_error", "param": "x", "code": "oops"}
    }
    assert pieces[2] == DONE and len(pieces) == 3


def test_engine_errors_mid_stream_keep_their_type():
    pieces = asyncio.run(_collect(_chunks([], QueueFullError("too many"))))
    error = json.loads(_data(pieces[0]))["error"]
    assert error["type"] == "rate_limit_error" and error["message"] == "too many"


def test_an_unexpected_failure_is_reported_without_crashing_the_stream():
    pieces = asyncio.run(_collect(_chunks([{"a": 1}], RuntimeError("boom"))))
    error = json.loads(_data(pieces[1]))["error"]
    assert error["type"] == "server_error" and pieces[-1] == DONE


def test_json_cannot_carry_nan_so_it_becomes_an_error_event():
    pieces = asyncio.run(_collect(_chunks([{"logprob": float("nan")}])))
    assert "error" in json.loads(_data(pieces[0])) and pieces[-1] == DONE


def test_cancellation_is_not_turned_into_an_event():
    async def run():
        async def endless():
            yield {"a": 1}
            await asyncio.sleep(3600)
            yield {"never": True}

        stream = frame(endless())
        assert await stream.__anext__() == event({"a": 1})
        task = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())

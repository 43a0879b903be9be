"""Server-sent events framing: `data: {json}\\n\\n` per chunk, an error event on failure, then `data: [DONE]\\n\\n`."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from api.errors import to_openai_error

DONE = "data: [DONE]\n\n"

# Proxies (nginx) buffer responses unless told not to; a buffered stream arrives all at once.
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(data: dict | BaseModel) -> str:
    """One SSE event. A chunk model is written with the fields it was built with, null ones included
    (`finish_reason: null`), and none it was not (a delta holds only what changed), as vLLM writes its protocol
    models. NaN or infinity in a dict cannot be written as JSON: they raise rather than send invalid JSON."""
    if isinstance(data, BaseModel):
        return f"data: {data.model_dump_json(exclude_unset=True)}\n\n"
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'), allow_nan=False)}\n\n"


async def frame(chunks: AsyncIterator[dict | BaseModel]) -> AsyncIterator[str]:
    """Each chunk as an event, then [DONE]. Once the first byte is out the status cannot change, so a failure
    becomes an error event (the openai SDK raises APIError on it) followed by [DONE]."""
    try:
        async for chunk in chunks:
            yield event(chunk)
    except Exception as exc:  # a disconnect cancels us (CancelledError is no Exception) and ends the stream
        yield event(to_openai_error(exc).body())
    yield DONE


def event_stream(chunks: AsyncIterator[dict | BaseModel]) -> StreamingResponse:
    return StreamingResponse(frame(chunks), media_type="text/event-stream", headers=HEADERS)

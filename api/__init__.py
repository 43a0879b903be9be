"""OpenAI-compatible API at /v1 (minimal for now: chat completions, models, health)."""
from __future__ import annotations

import json
import time
import uuid

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from engine import EngineError, EngineHandle, QueueFullError, SamplingParams


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return _error(400, str(exc.errors()[0].get("msg", "invalid request")), "invalid_request_error")

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, exc: EngineError):
        status = 429 if isinstance(exc, QueueFullError) else 400
        return _error(status, exc.message, "invalid_request_error", exc.param)


def build_router(handle: EngineHandle, api_key: str | None = None) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health():
        if handle.engine is None:
            return _error(503, handle.error or "the model is loading", "service_unavailable")
        return {"status": "ok"}

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        engine = handle.engine
        if engine is None:
            return _error(503, "the model is loading", "service_unavailable")
        body = await request.json()
        prompt = engine.tokenizer.render_chat(body["messages"])
        prompt_ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
        params = SamplingParams(
            temperature=body.get("temperature", 1.0),
            max_tokens=body.get("max_tokens"),
            stop=[body["stop"]] if isinstance(body.get("stop"), str) else body.get("stop") or (),
        )
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        model = handle.served_model_name
        if not body.get("stream"):
            completion = await engine.complete(prompt_ids, params, request_id)
            choice = completion.choices[0]
            return {
                "id": request_id,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": choice.text},
                        "finish_reason": choice.finish_reason,
                    }
                ],
                "usage": {
                    "prompt_tokens": completion.num_prompt_tokens,
                    "completion_tokens": completion.num_output_tokens,
                    "total_tokens": completion.num_prompt_tokens + completion.num_output_tokens,
                },
            }
        stream = engine.submit(prompt_ids, params, request_id)

        async def events():
            def chunk(delta, finish_reason=None):
                data = {
                    "id": request_id,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
                }
                return f"data: {json.dumps(data)}\n\n"

            try:
                yield chunk({"role": "assistant", "content": ""})
                async for out in stream:
                    if out.text:
                        yield chunk({"content": out.text})
                    if out.finish_reason:
                        yield chunk({}, out.finish_reason)
                yield "data: [DONE]\n\n"
            finally:
                if not stream.finished:
                    engine.abort(request_id)

        return StreamingResponse(events(), media_type="text/event-stream")

    return router


def _error(status: int, message: str, type_: str, param: str | None = None, code: str | None = None):
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": type_, "param": param, "code": code}})

"""POST /v1/chat/completions: render the chat template, generate, answer as one JSON body or as SSE chunks."""
from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request

from engine import Engine, EngineError

from api.errors import OpenAIError
from api.generation import Generation, Sample, until_disconnected
from api.logprobs import chat_logprobs, visible_logprobs
from api.protocol import ChatCompletionRequest, ChatMessage, template_messages
from api.response_format import grammar_for
from api.responses import ChatChoice, ChatCompletion, ChatCompletionChunk, ChatMessageOut, streamed
from api.server import Server
from api.sse import event_stream


def add_routes(router: APIRouter, server: Server) -> None:
    @router.post(
        "/v1/chat/completions",
        response_model=ChatCompletion,
        responses=streamed(ChatCompletionChunk),
        summary="Create a chat completion",
    )
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        engine = server.engine(body.model)
        params = body.to_sampling_params()
        prompt_ids = prompt_ids_for(engine, body.messages)
        params = dataclasses.replace(params, grammar=await grammar_for(engine, body.response_format))
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        try:
            generation = Generation(engine, [prompt_ids], params, response_id, server.metrics, request.state.request_id)
        except EngineError as exc:
            if exc.param == "prompt":  # the engine saw a prompt; the client sent messages
                exc.param = "messages"
            raise
        head = {"id": response_id, "created": int(time.time()), "model": server.model_name}
        if body.stream:
            return event_stream(_chunks(generation, head, body, engine))
        samples = await until_disconnected(request, generation.collect())
        choices = [_choice(sample, bool(body.logprobs), engine) for sample in samples]
        return ChatCompletion(**head, choices=choices, usage=generation.usage())


def chat_text(engine: Engine, messages: list[ChatMessage], add_generation_prompt: bool = True) -> str:
    """Chat messages rendered through the model's chat template."""
    rendered = template_messages(messages)
    try:
        return engine.tokenizer.render_chat(rendered, add_generation_prompt)
    except EngineError:
        raise
    except Exception as exc:  # the template refused these messages (e.g. "roles must alternate") or choked on them
        raise OpenAIError(400, f"The chat template could not render these messages: {exc}", param="messages") from exc


def prompt_ids_for(engine: Engine, messages: list[ChatMessage]) -> list[int]:
    # The rendered template already holds the special tokens (BOS included): adding them again would double them.
    return engine.tokenizer.encode(chat_text(engine, messages), add_special_tokens=False)


def _choice(sample: Sample, want_logprobs: bool, engine: Engine) -> ChatChoice:
    logprobs = None
    if want_logprobs:
        entries = visible_logprobs(sample.logprobs, sample.finish_reason, sample.stop_reason)
        logprobs = {"content": chat_logprobs(entries, engine.tokenizer), "refusal": None}
    return ChatChoice(
        index=sample.index,
        message=ChatMessageOut(content=sample.text),
        logprobs=logprobs,
        finish_reason=sample.finish_reason,
    )


async def _chunks(generation: Generation, head: dict, body: ChatCompletionRequest, engine: Engine) -> AsyncIterator[dict]:
    """OpenAI's sequence per choice: a role delta, content deltas, an empty delta with finish_reason; then the
    usage chunk (choices: []) when asked for, with usage null on every other chunk."""
    base = {**head, "object": "chat.completion.chunk"}
    usage = {"usage": None} if body.include_usage else {}

    def chunk(index: int, delta: dict, finish_reason: str | None = None, logprobs: dict | None = None) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {**base, "choices": [choice], **usage}

    try:
        for sample in generation.samples:
            yield chunk(sample.index, {"role": "assistant", "content": ""})
        async for sample, out in generation.outputs():
            logprobs = None
            if body.logprobs:
                entries = visible_logprobs(out.logprobs or [], out.finish_reason, out.stop_reason)
                if entries:
                    logprobs = {"content": chat_logprobs(entries, engine.tokenizer), "refusal": None}
            if out.text or logprobs:
                yield chunk(sample.index, {"content": out.text}, logprobs=logprobs)
            if out.finish_reason is not None:
                yield chunk(sample.index, {}, out.finish_reason)
        if body.include_usage:
            yield {**base, "choices": [], "usage": generation.usage()}
    finally:
        generation.abort()  # a client gone before the first output never entered outputs()

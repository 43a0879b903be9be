"""POST /v1/messages (one JSON message, or a stream of Anthropic's events) and POST /v1/messages/count_tokens. A
message is a chat turn: its system, messages and tools become chat messages (api/anthropic/convert.py) and it runs
on chat's path (api/chat.py start_chat), so sampling, stops, tool grammars, cancellation on disconnect, 429, drain
on shutdown and the API key behave as they do there."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine import FINISH_ABORT
from engine.text.reasoning import ReasoningParser

from api import function_tools, reasoning
from api.anthropic.bodies import ERRORS, CountTokensResponse, streamed_events
from api.anthropic.convert import MessageBuilder, new_id, stop_reason, thinking_template_kwargs, to_chat
from api.anthropic.errors import error_body
from api.anthropic.protocol import CountTokensRequest, MessagesRequest
from api.chat import chat_prompt, start_chat
from api.errors import OpenAIError, shutting_down, to_openai_error
from api.generation import Generation, until_disconnected
from api.response_format import AnswerFormat
from api.route_context import RouteContext
from api.sse import HEADERS


def add_routes(router: APIRouter, context: RouteContext) -> None:
    @router.post("/v1/messages", response_model=None, responses=streamed_events(),
                 summary="Create a message (Anthropic Messages API)")
    async def create_message(body: MessagesRequest, request: Request):
        served = await context.serve(body.model)
        params = body.to_sampling_params()
        turns = to_chat(body)
        message_id = new_id("msg")
        generation, split = await start_chat(served, turns.messages, params, turns.tools, AnswerFormat(None),
                                             message_id, request, thinking_template_kwargs(body.thinking))
        run = _Run(generation, served.model_id, params.stop, turns.tools.parses_calls,
                   None if split is None else split.parser())
        if body.stream:
            return StreamingResponse(_framed(run.events()), media_type="text/event-stream", headers=HEADERS)
        samples = await until_disconnected(request, generation.collect())
        run.feed(samples[0].text)
        run.end(samples[0].finish_reason, samples[0].stop_reason)
        return JSONResponse(run.message())

    @router.post("/v1/messages/count_tokens", response_model=CountTokensResponse, responses=ERRORS,
                 summary="Count a message request's input tokens (Anthropic Messages API)")
    async def count_tokens(body: CountTokensRequest) -> CountTokensResponse:
        engine = (await context.serve(body.model)).engine
        turns = to_chat(body)
        constrained = reasoning.is_constrained(AnswerFormat(None), turns.tools)
        _, ids = chat_prompt(engine, turns.messages, turns.tools, constrained, thinking_template_kwargs(body.thinking))
        return CountTokensResponse(input_tokens=len(ids))


def add_unknown_route(router: APIRouter, methods: list[str]) -> None:
    """Any other path under /v1/messages: a 404 in Anthropic's shape, not the OpenAI one /v1/{path} gives. Added
    after the routes' 405s, which a catch-all before them would shadow."""
    @router.api_route("/v1/messages/{path:path}", methods=methods, include_in_schema=False)
    async def unknown_route(request: Request, path: str):
        raise OpenAIError(404, f"Invalid URL ({request.method} /v1/messages/{path})", code="unknown_url")


class _Run:
    """One message being generated: the builder of its content blocks over the one sample's reply."""

    def __init__(self, generation: Generation, model: str, stop_sequences: tuple[str, ...], parses_calls: bool,
                 thoughts: ReasoningParser | None):
        self.generation, self.model, self.stop_sequences = generation, model, stop_sequences
        self.thoughts = thoughts  # a thinking model's reply: its reasoning goes to a thinking block
        self.reply = function_tools.ReplySplitter() if parses_calls else None
        self.builder = MessageBuilder()
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None

    def feed(self, text: str) -> list[dict]:
        thought, answer = self.thoughts.feed(text) if self.thoughts else ("", text)
        return self.builder.add_thinking(thought) + self._answer(answer)

    def end(self, finish_reason: str | None, matched: str | int | None) -> list[dict]:
        """The reply ended: its last blocks' events, then message_delta and message_stop."""
        events = []
        if self.thoughts:
            thought, answer = self.thoughts.finish()
            events += self.builder.add_thinking(thought) + self._answer(answer)
        events += self.builder.add(*self.reply.finish()) if self.reply else []
        events += self.builder.finish()
        self.stop_reason, self.stop_sequence = stop_reason(finish_reason, matched, self.stop_sequences,
                                                           self.builder.has_calls)
        delta = {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence}
        return events + [{"type": "message_delta", "delta": delta, "usage": self.usage()}, {"type": "message_stop"}]

    def _answer(self, text: str) -> list[dict]:
        return self.builder.add(*self.reply.feed(text)) if self.reply else self.builder.add(text, [])

    def usage(self) -> dict:
        # Anthropic counts cache reads apart: the prompt is input_tokens + cache_read_input_tokens.
        cached = self.generation.num_cached_tokens
        return {"input_tokens": self.generation.num_prompt_tokens - cached,
                "output_tokens": self.generation.num_completion_tokens,
                "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}

    def message(self) -> dict:
        return {"id": self.generation.response_id, "type": "message", "role": "assistant",
                "content": self.builder.blocks, "model": self.model, "stop_reason": self.stop_reason,
                "stop_sequence": self.stop_sequence, "usage": self.usage()}

    async def events(self) -> AsyncIterator[dict]:
        """Anthropic's sequence: message_start (empty content; usage as known before the prompt ran), a ping, the
        blocks' start/delta/stop events, message_delta (stop_reason and the final usage), message_stop."""
        yield {"type": "message_start", "message": self.message()}
        yield {"type": "ping"}
        try:
            async for _, out in self.generation.outputs():
                for event in self.feed(out.text):
                    yield event
                if out.finish_reason == FINISH_ABORT:
                    yield error_body(shutting_down("the server shut down before this message finished"))
                    return
                if out.finish_reason is not None:
                    for event in self.end(out.finish_reason, out.stop_reason):
                        yield event
        except Exception as exc:  # a failed step: the stream says so as Anthropic does, then ends
            yield error_body(to_openai_error(exc))
        finally:
            self.generation.abort()


async def _framed(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    """Each event as Anthropic frames them: `event: <type>` then `data: <json>`; no [DONE]."""
    async for event in events:
        data = json.dumps(event, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        yield f"event: {event['type']}\ndata: {data}\n\n"

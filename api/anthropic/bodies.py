"""The Messages API's response bodies as /openapi.json shows them: the message, its content blocks, a stream's
events, count_tokens' answer and the error envelope. The routes build plain dicts (api/anthropic/convert.py); these
models describe them, and the fuzz tests hold the server's answers to them."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from api.bodies import inline

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class _Open(BaseModel):
    # Anthropic adds fields to these objects often; a client must take more than is listed here.
    model_config = ConfigDict(extra="allow")


class AnthropicTextBlock(_Open):
    type: Literal["text"] = "text"
    text: str


class AnthropicToolUseBlock(_Open):
    type: Literal["tool_use"] = "tool_use"
    id: str = Field(description="toolu_...: what a tool_result block's tool_use_id answers.")
    name: str
    input: dict[str, Any] = Field(description="Valid against the tool's input_schema (held by a grammar).")


class AnthropicThinkingBlock(_Open):
    type: Literal["thinking"] = "thinking"
    thinking: str = Field(description="A thinking model's reasoning (between its <think> tags).")
    signature: str = Field(description="Empty: Tern signs nothing.")


class AnthropicUsage(BaseModel):
    input_tokens: int = Field(description="Prompt tokens computed for this request: those the prefix cache did "
                              "not hold (the prompt is input_tokens + cache_read_input_tokens).")
    output_tokens: int
    cache_read_input_tokens: int = Field(description="Prompt tokens served from Tern's prefix cache.")
    cache_creation_input_tokens: int = Field(description="Always 0: the prefix cache needs no writes paid for.")


class AnthropicMessage(_Open):
    id: str = Field(description="msg_...")
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[AnthropicThinkingBlock | AnthropicTextBlock | AnthropicToolUseBlock]
    model: str
    stop_reason: StopReason | None = Field(description="null only in message_start's message.")
    stop_sequence: str | None = Field(description="The stop sequence that ended the reply, if one did.")
    usage: AnthropicUsage


class CountTokensResponse(BaseModel):
    input_tokens: int = Field(description="The prompt's tokens: system, messages and tools as rendered.")


class AnthropicStreamEvent(_Open):
    """One event of a streamed message; which fields it has depends on its type."""

    type: str = Field(description="message_start, ping, content_block_start, content_block_delta, "
                      "content_block_stop, message_delta, message_stop (or error)")
    message: AnthropicMessage | None = None
    index: int | None = None
    content_block: AnthropicThinkingBlock | AnthropicTextBlock | AnthropicToolUseBlock | None = None
    delta: dict[str, Any] | None = Field(None, description="text_delta {text}, thinking_delta {thinking}, "
                                         "input_json_delta {partial_json}, or on message_delta {stop_reason, "
                                         "stop_sequence}.")
    usage: dict[str, int] | None = None


class AnthropicErrorObject(BaseModel):
    type: str = Field(description="invalid_request_error, authentication_error, not_found_error, "
                      "request_too_large, rate_limit_error, api_error or overloaded_error")
    message: str


class AnthropicErrorResponse(BaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorObject


# Every error has this body. "4XX" also keeps FastAPI from documenting its 422, which clients never get.
ERRORS = {status: {"model": AnthropicErrorResponse, "description": description} for status, description in [
    (400, "Malformed JSON, a missing or wrong field, an unsupported block"),
    (401, "Missing or wrong API key (when the server has one)"),
    (404, "Unknown model"),
    (429, "Too many requests waiting; retry after Retry-After seconds"),
    (503, "The model is still loading, or the server is shutting down"),
    ("4XX", "Any other client error"),
]}


def streamed_events() -> dict:
    """OpenAPI `responses` entry of POST /v1/messages: the message as JSON, or with stream: true Anthropic's events,
    each an `event: <type>` line and a `data:` line with the event as JSON."""
    description = ("application/json: the message. With stream: true, text/event-stream: `event: <type>` and "
                   "`data: <AnthropicStreamEvent>` per event, message_start first and message_stop last (an `error` "
                   "event if the request fails once streaming).")
    data = {"type": "string", "contentMediaType": "application/json",
            "contentSchema": {"anyOf": [inline(AnthropicStreamEvent.model_json_schema()),
                                        inline(AnthropicErrorResponse.model_json_schema())]}}
    event = {"type": "object", "required": ["data"],
             "properties": {"data": data, "event": {"type": "string"}, "id": {"type": "string"},
                            "retry": {"type": "integer", "minimum": 0}}}
    return {200: {"description": description, "model": AnthropicMessage,
                  "content": {"application/json": {}, "text/event-stream": {"itemSchema": event}}}, **ERRORS}

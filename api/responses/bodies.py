"""The Responses API's bodies as /openapi.json shows them: the response object, its output items, a stream's events.
The route builds plain dicts (api/responses/output.py); these models describe them, and the fuzz tests hold the
server's answers to them."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from api.bodies import ERRORS, ErrorResponse, inline

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class _Open(BaseModel):
    # OpenAI adds fields to these objects often; a client must take more than is listed here.
    model_config = ConfigDict(extra="allow")


class OutputText(_Open):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list, description="Always empty.")
    logprobs: list[Any] = Field(default_factory=list, description="Always empty.")


class OutputMessage(_Open):
    id: str = Field(description="msg_...")
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class FunctionCall(_Open):
    id: str = Field(description="fc_...")
    type: Literal["function_call"] = "function_call"
    status: ItemStatus
    call_id: str = Field(description="call_...: what a function_call_output item answers.")
    name: str
    arguments: str = Field(description="JSON text, valid against the function's parameters.")


class ReasoningText(_Open):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class Reasoning(_Open):
    """A thinking model's reasoning (what it wrote between <think> and </think>), before the answer's message."""

    id: str = Field(description="rs_...")
    type: Literal["reasoning"] = "reasoning"
    status: ItemStatus
    summary: list[Any] = Field(default_factory=list, description="Always empty.")
    content: list[ReasoningText]


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(BaseModel):
    code: str
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(_Open):
    id: str = Field(description="resp_...")
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    completed_at: int | None
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[Reasoning | OutputMessage | FunctionCall]
    parallel_tool_calls: bool
    previous_response_id: str | None
    store: bool
    temperature: float
    text: dict[str, Any] = Field(description="{format: ...} as the request gave it (text by default).")
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float
    truncation: Literal["disabled"]
    usage: ResponseUsage | None = Field(description="null until the response has finished.")
    user: str | None
    metadata: dict[str, str]


class ResponseEvent(_Open):
    """One event of a streamed response; which fields it has depends on its type."""

    type: str = Field(description="response.created, response.in_progress, response.output_item.added, "
                      "response.content_part.added, response.output_text.delta, response.output_text.done, "
                      "response.content_part.done, response.function_call_arguments.delta, "
                      "response.function_call_arguments.done, response.reasoning_text.delta, response.reasoning_text.done, "
                      "response.output_item.done, response.completed, "
                      "response.incomplete or response.failed")
    sequence_number: int = Field(description="0, 1, 2, ... in the order sent.")
    response: ResponseObject | None = None
    output_index: int | None = None
    item: Reasoning | OutputMessage | FunctionCall | None = None
    item_id: str | None = None
    content_index: int | None = None
    part: OutputText | None = None
    delta: str | None = None
    text: str | None = None
    name: str | None = None
    arguments: str | None = None
    logprobs: list[Any] | None = None


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True


def streamed_events() -> dict:
    """OpenAPI `responses` entry of POST /v1/responses: JSON, or with stream: true OpenAI's typed events, each an
    `event: <type>` line and a `data:` line with the event as JSON, and no [DONE]."""
    description = ("application/json: the response. With stream: true, text/event-stream: `event: <type>` and "
                   "`data: <ResponseEvent>` per event, from response.created to response.completed (or "
                   "response.incomplete, or response.failed).")
    data = {"type": "string", "contentMediaType": "application/json",
            "contentSchema": {"anyOf": [inline(ResponseEvent.model_json_schema()),
                                        inline(ErrorResponse.model_json_schema())]}}
    event = {"type": "object", "required": ["data"],
             "properties": {"data": data, "event": {"type": "string"}, "id": {"type": "string"},
                            "retry": {"type": "integer", "minimum": 0}}}
    return {200: {"description": description, "model": ResponseObject,
                  "content": {"application/json": {}, "text/event-stream": {"itemSchema": event}}}, **ERRORS}

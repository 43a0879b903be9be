"""Anthropic Messages API request bodies with Anthropic's field names (POST /v1/messages, /v1/messages/count_tokens);
to_sampling_params() is where they become engine names. Content blocks are one loose model here: which block types
Tern takes is decided, with a 400 naming the block, in api/anthropic/convert.py."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from engine import SamplingParams
from engine.params import MAX_STOP_LENGTH, MAX_STOP_STRINGS

from api.protocol import _Body


class TextBlockParam(_Body):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = Field(None, description="Accepted; Tern's prefix cache needs no hints.")


class ToolResultPart(_Body):
    type: str = Field(description="Only \"text\" is supported.")
    text: str | None = None


class ContentBlockParam(_Body):
    """One block of a message's content. user: `text`, `tool_result`; assistant: `text`, `tool_use`, `thinking`
    (its text goes back to the template as reasoning; redacted_thinking is dropped). Images, documents and server
    tools are refused."""

    type: str = Field(description="text, tool_use, tool_result, thinking (redacted_thinking: accepted, dropped)")
    text: str | None = Field(None, description="A text block's text.")
    thinking: str | None = Field(None, description="A thinking block's reasoning.")
    id: str | None = Field(None, description="A tool_use block's id (toolu_...).")
    name: str | None = Field(None, description="A tool_use block's tool name.")
    input: dict[str, Any] | None = Field(None, description="A tool_use block's input object.")
    tool_use_id: str | None = Field(None, description="A tool_result block: the tool_use it answers.")
    content: str | list[ToolResultPart] | None = Field(None, description="A tool_result's content: a string or "
                                                       "text blocks.")
    is_error: bool | None = Field(None, description="A tool_result: the tool failed.")
    cache_control: dict[str, Any] | None = None


class MessageParam(_Body):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlockParam]


class AnthropicTool(_Body):
    name: str = Field(description="a-z, A-Z, 0-9, _ and -, at most 64 characters.")
    description: str | None = None
    input_schema: dict[str, Any] = Field(description="JSON Schema of the input object (\"type\": \"object\").")
    type: str | None = Field(None, description="Absent or \"custom\"; server tools (bash, web_search, ...) are "
                             "refused.")
    cache_control: dict[str, Any] | None = None


class AnthropicToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"] = Field(
        description="auto: text or calls; any: at least one call; tool: one call of `name`; none: no tools offered.")
    name: str | None = Field(None, description="With type \"tool\": the tool to call.")
    disable_parallel_tool_use: bool | None = Field(None, description="At most one call (auto, any).")


class ThinkingConfig(_Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=0, description="Accepted; max_tokens bounds reasoning and answer.")


class AnthropicMetadata(_Body):
    user_id: str | None = Field(None, description="Accepted; unused.")


class CountTokensRequest(_Body):
    """What counts toward the prompt: the fields of a message request that are rendered into it."""

    model_config = {"json_schema_extra": {"examples": [
        {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Name three birds."}]},
    ]}}
    model: str = Field(description="The served model id (GET /v1/models).")
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlockParam] | None = Field(None, description="A system prompt: a string or text blocks.")
    tools: list[AnthropicTool] | None = Field(None, description="Tools the model may call; their definitions go into "
                                          "the prompt.")
    tool_choice: AnthropicToolChoice | None = Field(None, description="Default auto with tools.")
    thinking: ThinkingConfig | None = Field(None, description="A thinking model (Qwen3, ...) thinks when enabled "
                                            "(its reasoning in a thinking block); absent or disabled: thinking off "
                                            "where the chat template can turn it off.")


class MessagesRequest(CountTokensRequest):
    model_config = {"json_schema_extra": {"examples": [
        {"model": "SmolLM2-135M-Instruct", "max_tokens": 32,
         "messages": [{"role": "user", "content": "Name three birds."}]},
        {"model": "SmolLM2-135M-Instruct", "max_tokens": 32, "system": "Answer in one word.", "temperature": 0,
         "stream": True, "messages": [{"role": "user", "content": "Capital of France?"}]},
    ]}}
    max_tokens: int = Field(ge=1, description="The most tokens to generate.")
    stop_sequences: list[str] | None = Field(
        None, description=f"Strings that end the text (not returned; reported as stop_sequence). At most "
        f"{MAX_STOP_STRINGS}, each at most {MAX_STOP_LENGTH} characters.")
    temperature: float | None = Field(None, ge=0, le=1, description="0 is greedy; default 1.")
    top_p: float | None = Field(None, gt=0, le=1, description="Nucleus sampling mass; default 1 (off).")
    top_k: int | None = Field(None, ge=0, description="Keep the k most likely tokens; 0 or absent: off.")
    stream: bool | None = Field(False, description="Server-sent events: message_start ... message_stop.")
    metadata: AnthropicMetadata | None = None

    def to_sampling_params(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            stop=tuple(self.stop_sequences or ()),
        )

"""The Responses API's request: its body, its input items as the chat messages the engine renders, its function tools
and its text format, each checked with a 400 that names the field at fault."""
from __future__ import annotations

from typing import Any

from pydantic import Field

from engine import SamplingParams

from api import function_tools
from api.errors import OpenAIError
from api.protocol import _Body
from api.response_format import AnswerFormat, invalid, schema_format, unsupported_type

_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text")
_REASONING_PARTS = ("reasoning_text",)


class ResponsesRequest(_Body):
    model_config = {"json_schema_extra": {"examples": [
        {"input": "Name three birds.", "max_output_tokens": 64},
        {"instructions": "Answer in one word.", "input": [{"role": "user", "content": "Capital of France?"}],
         "temperature": 0, "stream": True},
    ]}}
    model: str | None = Field(None, description="The served model id (GET /v1/models); defaults to it.")
    input: str | list[dict[str, Any]] = Field(
        description="A user message as a string, or a list of items: messages (role user, system, developer or "
        "assistant; content a string or input_text/output_text parts), function_call and function_call_output.")
    instructions: str | None = Field(None, description="A system prompt for this response only (not carried over "
                                     "by previous_response_id).")
    max_output_tokens: int | None = Field(None, ge=1, description="Default: up to the end of the context.")
    temperature: float | None = Field(None, ge=0, le=2, description="0 is greedy; default 1.")
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[dict[str, Any]] | None = Field(None, description="Function tools: {type: function, name, "
                                              "description, parameters, strict}.")
    tool_choice: str | dict[str, Any] | None = Field(None, description="none, auto, required or {type: function, "
                                                     "name}.")
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = Field(None, description="{format: {type: text | json_object | json_schema, name, "
                                        "schema, strict}}: the reply held to the format by a grammar.")
    stream: bool | None = Field(False, description="Server-sent events: response.created ... response.completed.")
    store: bool | None = Field(True, description="Keep the response (in memory, bounded) for GET and "
                               "previous_response_id.")
    previous_response_id: str | None = Field(None, description="Continue the conversation of a stored response.")
    metadata: dict[str, str] | None = None
    user: str | None = Field(None, description="Accepted; unused.")
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1, description="Extension: reproducible sampling.")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extension (vLLM's): more variables for the chat template, e.g. {\"enable_thinking\": "
        "false} to turn a Qwen3 model's thinking off.")

    def to_sampling_params(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_output_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed,
        )


def input_messages(items: str | list[dict[str, Any]]) -> list[dict]:
    """The input as chat messages in OpenAI's chat shape (what engine/text/tokens.py renders): consecutive function
    calls join one assistant turn, their outputs become `tool` messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise OpenAIError(400, "input must not be empty", param="input", code="invalid_value")
    messages: list[dict] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            message = _message(item, f"input[{i}]")
            if message["role"] == "assistant" and _is_reasoning_only(messages):  # the reasoning before this answer
                messages[-1]["content"] = message["content"]
            else:
                messages.append(message)
        elif kind == "reasoning":  # sent back as history: the chat template decides what to do with it
            text = _parts_text(item.get("content") or [], f"input[{i}].content", _REASONING_PARTS)
            messages.append({"role": "assistant", "content": "", "reasoning_content": text})
        elif kind == "function_call":
            name, arguments, call_id = (_string(item, key, f"input[{i}]") for key in ("name", "arguments", "call_id"))
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            if messages and messages[-1]["role"] == "assistant":  # the calls of one reply are one assistant turn
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", f"input[{i}]")
            output = item.get("output")
            content = output if isinstance(output, str) else _parts_text(output, f"input[{i}].output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
        else:
            message = f"input items of type {kind!r} are not supported; send message, reasoning, function_call or " \
                      "function_call_output items"
            raise OpenAIError(400, message, param=f"input[{i}].type", code="unsupported_parameter")
    return messages


def output_messages(output: list[dict]) -> list[dict]:
    """A response's output items as the assistant turn they were, for the conversation a later response continues."""
    kept = [item for item in output if item["type"] in ("reasoning", "message", "function_call")]
    return input_messages(kept) if kept else []


def response_tools(request: ResponsesRequest) -> function_tools.Tools:
    definitions = []
    for i, tool in enumerate(request.tools or []):
        if tool.get("type") != "function":
            message = f"tools of type {tool.get('type')!r} are not supported; only \"function\""
            raise OpenAIError(400, message, param=f"tools[{i}].type", code="unsupported_parameter")
        name, parameters = tool.get("name"), tool.get("parameters")
        if not isinstance(name, str):
            raise OpenAIError(400, "a function tool needs a name", param=f"tools[{i}].name", code="invalid_value")
        if parameters is not None and not isinstance(parameters, dict):
            raise OpenAIError(400, "parameters must be a JSON Schema object", param=f"tools[{i}].parameters",
                              code="invalid_value")
        description = tool.get("description")
        definitions.append((name, description if isinstance(description, str) else None, parameters))
    choice, name = request.tool_choice, None
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise OpenAIError(400, "tool_choice must be none, auto, required or {\"type\": \"function\", \"name\"}",
                              param="tool_choice", code="invalid_value")
        choice, name = "function", choice["name"]
    elif choice is not None and choice not in ("none", "auto", "required"):
        raise OpenAIError(400, f"tool_choice {choice!r} is not one of none, auto, required", param="tool_choice",
                          code="invalid_value")
    return function_tools.resolve(definitions, choice, name, request.parallel_tool_calls, where="tools[{i}]")


def text_format(text: dict[str, Any] | None) -> AnswerFormat:
    """`text.format`, checked: the Responses API's flat form of chat's response_format."""
    spec = (text or {}).get("format")
    if spec is None:
        return AnswerFormat(None, param="text.format")
    if not isinstance(spec, dict):
        raise invalid("text.format must be an object", "text.format")
    kind = spec.get("type")
    if kind == "text":
        return AnswerFormat(None, param="text.format")
    if kind == "json_object":
        return AnswerFormat({"type": "object"}, param="text.format")
    if kind == "json_schema":
        return schema_format(spec.get("name"), spec.get("schema"), "text.format", "text.format")
    raise unsupported_type(kind, "text.format")


def _message(item: dict, where: str) -> dict:
    role = _ROLES.get(item.get("role"))
    if role is None:
        raise OpenAIError(400, f"role must be one of {', '.join(_ROLES)}", param=f"{where}.role", code="invalid_value")
    content = item.get("content")
    text = content if isinstance(content, str) else _parts_text(content, f"{where}.content")
    return {"role": role, "content": text}


def _is_reasoning_only(messages: list[dict]) -> bool:
    last = messages[-1] if messages else {}
    return last.get("role") == "assistant" and "reasoning_content" in last and not last["content"] \
        and not last.get("tool_calls")


def _parts_text(parts: Any, where: str, kinds: tuple[str, ...] = _TEXT_PARTS) -> str:
    if not isinstance(parts, list):
        raise OpenAIError(400, "content must be a string or a list of text parts", param=where, code="invalid_value")
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") not in kinds or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            message = f"content parts of type {kind!r} are not supported; send input_text parts"
            raise OpenAIError(400, message, param=f"{where}[{j}]", code="unsupported_content_type")
        texts.append(part["text"])
    return "\n".join(texts)


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise OpenAIError(400, f"{key} must be a string", param=f"{where}.{key}", code="invalid_value")
    return value

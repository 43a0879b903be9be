"""The one converter between Anthropic's Messages API and Tern's chat: a request's system, messages and tools become
chat messages (OpenAI's shape, what engine/text/tokens.py renders) and function_tools.Tools; a reply's text and calls
(as api/function_tools.py splits them) become Anthropic's content blocks, and in a stream the events that build them.

One MessageBuilder serves a stream and a whole answer: fed the same reply it builds the same blocks, so the message
the SDK's stream helper assembles equals the non-streamed one (ids aside). Blocks open and close in order, one at a
time: a thinking model's reasoning (engine/text/reasoning.py splits it off) in a `thinking` block before the answer's.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from api import function_tools
from api.anthropic.protocol import ContentBlockParam, CountTokensRequest, ToolResultPart
from api.errors import OpenAIError

# Blocks a client sends back from an earlier reply that carry nothing the prompt needs (a thinking block's text goes
# back to the template as reasoning_content; a redacted one has none).
_DROPPED = ("redacted_thinking",)
_CHOICES = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}


@dataclass(frozen=True)
class ChatTurns:
    """A Messages request as Tern's chat sees it."""

    messages: list[dict]
    tools: function_tools.Tools


def to_chat(body: CountTokensRequest) -> ChatTurns:
    """system + messages -> chat messages; tools + tool_choice -> Tools. Every refusal is a 400 naming the field."""
    messages = []
    system = _system_text(body.system)
    if system:
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(body.messages):
        where = f"messages[{i}]"
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
        elif message.role == "user":
            messages += _user_turn(message.content, where)
        else:
            messages.append(_assistant_turn(message.content, where))
    return ChatTurns(messages, _tools(body))


def thinking_template_kwargs(thinking) -> dict:
    """Anthropic's `thinking` as the chat template's switch: a thinking model thinks only when asked (`enabled`,
    `adaptive`), as Claude does; without the field, or `disabled`, the template renders with thinking off where it
    has that switch (Qwen3's enable_thinking). A template that always thinks still does: its reasoning then comes
    back in a thinking block all the same. budget_tokens is not enforced: max_tokens bounds reasoning and answer."""
    return {"enable_thinking": thinking is not None and thinking.type != "disabled"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def tool_use_id(call: function_tools.CallOut) -> str:
    """Anthropic's id for a call: the chat id's random part behind `toolu_`."""
    return "toolu_" + call.id.removeprefix("call_")


def stop_reason(finish_reason: str | None, matched: str | int | None, stop_sequences: tuple[str, ...],
                has_calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for how the engine ended a sample."""
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(matched, str) and matched in stop_sequences:
        return "stop_sequence", matched
    return ("tool_use" if has_calls else "end_turn"), None


class MessageBuilder:
    """The content blocks of one reply as it streams. add() and finish() return the events for what changed."""

    def __init__(self) -> None:
        self.blocks: list[dict] = []
        self._open: dict | None = None
        self._partial_json: dict[int, str] = {}  # block index -> a tool_use's input as JSON text so far

    def add(self, text: str, calls: list[tuple[function_tools.CallOut, function_tools.CallDelta]]) -> list[dict]:
        events: list[dict] = []
        if text:
            if self._open is None or self._open["type"] != "text":
                events += self._open_block({"type": "text", "text": ""})
            self._open["text"] += text
            events.append(self._delta({"type": "text_delta", "text": text}))
        for call, delta in calls:
            if delta.name is not None:
                events += self._open_block({"type": "tool_use", "id": tool_use_id(call), "name": call.name,
                                            "input": {}})
            if delta.arguments:
                self._partial_json[len(self.blocks) - 1] += delta.arguments
                events.append(self._delta({"type": "input_json_delta", "partial_json": delta.arguments}))
        return events

    def add_thinking(self, text: str) -> list[dict]:
        """Reasoning of a thinking model, into a thinking block (before the answer's blocks: reasoning comes first).
        Its signature stays empty: nothing here verifies one when the block comes back."""
        if not text:
            return []
        events: list[dict] = []
        if self._open is None or self._open["type"] != "thinking":
            events += self._open_block({"type": "thinking", "thinking": "", "signature": ""})
        self._open["thinking"] += text
        return events + [self._delta({"type": "thinking_delta", "thinking": text})]

    def finish(self) -> list[dict]:
        """The reply ended: close the last block. A reply with nothing in it still has one text block, empty, so
        that clients reading content[0] find it."""
        events = [] if self.blocks else self._open_block({"type": "text", "text": ""})
        return events + self._close()

    @property
    def has_calls(self) -> bool:
        return any(block["type"] == "tool_use" for block in self.blocks)

    def _open_block(self, block: dict) -> list[dict]:
        events = self._close()
        self.blocks.append(block)
        self._open = block
        if block["type"] == "tool_use":
            self._partial_json[len(self.blocks) - 1] = ""
        return events + [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)}]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def _close(self) -> list[dict]:
        if self._open is None:
            return []
        index = len(self.blocks) - 1
        if self._open["type"] == "tool_use":
            self._open["input"] = _input_object(self._partial_json[index])
        self._open = None
        return [{"type": "content_block_stop", "index": index}]


def _input_object(arguments: str) -> dict:
    """A call's input: the object the grammar held it to, or, cut short by max_tokens, what parses of it (nothing)."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _system_text(system: str | list | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    return "\n".join(block.text for block in system)


def _user_turn(blocks: list[ContentBlockParam], where: str) -> list[dict]:
    """Tool results first, as `tool` messages answering the previous turn's calls (in the order sent); the text
    after them as one user message."""
    results, texts = [], []
    for j, block in enumerate(blocks):
        if block.type == "text" and block.text is not None:
            texts.append(block.text)
        elif block.type == "tool_result" and block.tool_use_id:
            content = _result_text(block.content, f"{where}.content[{j}].content")
            results.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": f"Error: {content}" if block.is_error else content})
        else:
            raise _unsupported(block, f"{where}.content[{j}]", "user", ("text", "tool_result"), "tool_use_id")
    return results + ([{"role": "user", "content": "\n".join(texts)}] if texts or not results else [])


def _assistant_turn(blocks: list[ContentBlockParam], where: str) -> dict:
    texts, calls, thoughts = [], [], []
    for j, block in enumerate(blocks):
        if block.type == "text" and block.text is not None:
            texts.append(block.text)
        elif block.type == "thinking":
            thoughts.append(block.thinking or "")
        elif block.type == "tool_use" and block.id and block.name and block.input is not None:
            arguments = json.dumps(block.input, ensure_ascii=False)
            calls.append({"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}})
        elif block.type not in _DROPPED:
            raise _unsupported(block, f"{where}.content[{j}]", "assistant", ("text", "tool_use"), "id, name, input")
    message: dict = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    if thoughts:  # the template decides what to keep of it (Qwen3's drops reasoning before the last user turn)
        message["reasoning_content"] = "\n".join(thoughts)
    return message


def _result_text(content: str | list[ToolResultPart] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for k, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise OpenAIError(400, f"{where}[{k}]: tool_result content blocks of type {part.type!r} are not "
                              "supported; send text blocks", param=f"{where}[{k}]")
        texts.append(part.text)
    return "\n".join(texts)


def _unsupported(block: ContentBlockParam, where: str, role: str, types: tuple[str, str], fields: str) -> OpenAIError:
    expected = f"send {types[0]} or {types[1]} blocks (a {types[1]} with {fields})"
    message = f"{where}: content blocks of type {block.type!r} are not supported in {role} turns; {expected}"
    if block.type in types:
        message = f"{where}: this {block.type} block lacks a field it needs; {expected}"
    return OpenAIError(400, message, param=where, code="unsupported_content_type")


def _tools(body: CountTokensRequest) -> function_tools.Tools:
    definitions = []
    for i, tool in enumerate(body.tools or []):
        if tool.type not in (None, "custom"):
            message = f"tools[{i}]: server tools (type {tool.type!r}) are not supported; send custom tools"
            raise OpenAIError(400, message, param=f"tools[{i}].type", code="unsupported_parameter")
        definitions.append((tool.name, tool.description, tool.input_schema))
    choice = body.tool_choice
    if choice is None:
        return function_tools.resolve(definitions, None, None, None, where="tools[{i}]")
    if choice.type == "tool" and not choice.name:
        raise OpenAIError(400, "tool_choice of type \"tool\" needs the tool's name", param="tool_choice.name")
    parallel = None if choice.disable_parallel_tool_use is None else not choice.disable_parallel_tool_use
    return function_tools.resolve(definitions, _CHOICES[choice.type], choice.name, parallel, where="tools[{i}]")

"""Function tools, for /v1/chat/completions and /v1/responses: definitions checked, tool_choice resolved to the
engine's ToolUse (engine/text/tool_calls.py says how calls are written, held to a grammar and parsed back), and each
sample's reply split into text and calls as it streams.

What OpenAI's contract asks and Tern follows: `tool_choice` defaults to "auto" with tools and "none" without;
"none" is text (the definitions are then left out of the prompt); "required" is one call or more, a named function
exactly one call of it; `parallel_tool_calls: false` is at most one call; arguments are the JSON text the model
wrote (compact, under the grammar); a reply with calls has `finish_reason: "tool_calls"`. A reply that max_tokens
cuts keeps "length": the calls completed before the cut are returned, the cut call stays text (`content`), and a
stream sends each call only once its arguments are complete, so no client sees arguments that are not JSON.
"""
from __future__ import annotations

import asyncio
import re
import uuid
from dataclasses import dataclass, field

import jsonschema

from engine import Engine, GrammarError
from engine.text.grammar import Grammar
from engine.text.tool_call_parser import CallDelta, ReplyParser
from engine.text.tool_calls import Function, ToolUse

from api.errors import OpenAIError

# OpenAI's rule for function names (FunctionObject.name in its OpenAPI spec).
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tools:
    """A request's tools: what the prompt shows and what the reply may do."""

    functions: tuple[Function, ...]  # in the prompt; empty with tool_choice "none"
    use: ToolUse | None  # None: the reply is text and is not parsed for calls

    @property
    def parses_calls(self) -> bool:
        return self.use is not None


NO_TOOLS = Tools((), None)


def resolve(
    definitions: list[tuple[str, str | None, dict | None]],
    choice: str | None,
    choice_name: str | None,
    parallel: bool | None,
    where: str = "tools[{i}].function",
) -> Tools:
    """definitions: (name, description, parameters) per tool, in the request's order; choice: "none", "auto",
    "required", "function" (then choice_name) or None (the default); where: the field holding tool i's name and
    parameters (chat nests them under "function", the Responses API does not). Every refusal is a 400 naming its
    field."""
    if not definitions:
        if choice not in (None, "none", "auto"):
            raise OpenAIError(400, "tool_choice is only allowed when tools are specified", param="tool_choice")
        return NO_TOOLS
    functions = []
    for i, (name, description, parameters) in enumerate(definitions):
        field = where.format(i=i)
        if not _NAME.match(name):
            message = f"Invalid function name {name!r}: use a-z, A-Z, 0-9, underscores and dashes, at most 64"
            raise OpenAIError(400, message, param=f"{field}.name", code="invalid_value")
        if any(f.name == name for f in functions):
            raise OpenAIError(400, f"Duplicate function name {name!r}", param=f"{field}.name", code="invalid_value")
        functions.append(Function(name, _checked_parameters(parameters, f"{field}.parameters"), description))
    if choice is None:
        choice = "auto"
    if choice == "none":
        return NO_TOOLS
    if choice == "function":
        if choice_name not in {f.name for f in functions}:
            message = f"tool_choice names function {choice_name!r}, which is not among the tools"
            raise OpenAIError(400, message, param="tool_choice", code="invalid_value")
        return Tools(tuple(functions), ToolUse(tuple(functions), "named", choice_name, parallel=False))
    return Tools(tuple(functions), ToolUse(tuple(functions), choice, parallel=parallel is not False))


async def compile_grammar(engine: Engine, tools: Tools, answer_schema: dict | None) -> Grammar | None:
    """The reply's grammar (None when tools leave it free): compiled off the event loop, each function's parameters
    on their own first so that a refusal names the tool."""
    if tools.use is None:
        return None

    def compile_all() -> Grammar:
        for i, function in enumerate(tools.functions):
            try:
                engine.grammars.json_schema(function.parameters, function.name)
            except GrammarError as exc:
                message = f"Invalid parameters schema for function {function.name!r}: {exc.message}"
                raise OpenAIError(400, message, param=f"tools[{i}]", code="invalid_value") from None
        try:
            return engine.grammars.tool_calls(tools.use, answer_schema)
        except GrammarError as exc:
            raise OpenAIError(400, f"These tools cannot be compiled: {exc.message}", param="tools") from None

    return await asyncio.to_thread(compile_all)


def _checked_parameters(parameters: dict | None, where: str) -> dict:
    if parameters is None:
        return _NO_PARAMETERS
    try:
        jsonschema.validators.validator_for(parameters).check_schema(parameters)
    except jsonschema.SchemaError as exc:
        raise OpenAIError(400, f"parameters is not a JSON Schema: {exc.message}", param=where,
                          code="invalid_value") from None
    kind = parameters.get("type")
    if kind is not None and kind != "object" and kind != ["object"]:
        message = f"parameters must describe a JSON object (\"type\": \"object\"), not {kind!r}"
        raise OpenAIError(400, message, param=where, code="invalid_value")
    return parameters


@dataclass
class CallOut:
    """One call as a client sees it."""

    id: str
    name: str
    arguments: str = ""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ReplySplitter:
    """One sample's reply as text and calls (with ids), fed the engine's text deltas; a stream's events come from
    feed() and finish(), a whole answer from the same calls, so the two always agree."""

    parser: ReplyParser = field(default_factory=ReplyParser)
    calls: list[CallOut] = field(default_factory=list)

    def feed(self, text: str) -> tuple[str, list[tuple[CallOut, CallDelta]]]:
        return self._named(*self.parser.feed(text))

    def finish(self) -> tuple[str, list[tuple[CallOut, CallDelta]]]:
        return self._named(*self.parser.finish())

    @property
    def text(self) -> str:
        return self.parser.text

    def _named(self, content: str, deltas: list[CallDelta]) -> tuple[str, list[tuple[CallOut, CallDelta]]]:
        out = []
        for delta in deltas:
            self.calls.append(CallOut(new_call_id(), delta.name, delta.arguments))
            out.append((self.calls[delta.index], delta))
        return content, out


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    """A reply that ended by itself after calling functions says so; one cut by max_tokens stays "length"."""
    return "tool_calls" if has_calls and reason == "stop" else reason

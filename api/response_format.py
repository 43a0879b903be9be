"""`response_format` -> the engine's Grammar: the shape checked here, the schema compiled in a worker thread.

`{"type": "text"}` (the default) asks for nothing; `{"type": "json_object"}` for one JSON object;
`{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` for a value valid against the schema. The
schema is enforced whatever `strict` says (OpenAI only guarantees it with strict: true; vLLM enforces it always).
Beside tools that may be called (api/function_tools.py), the reply is calls or such a value, under one grammar.
"""
from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from typing import Any

import jsonschema
from engine import Engine, GrammarError
from engine.text.grammar import Grammar

from api import function_tools
from api.errors import OpenAIError

TYPES = ("text", "json_object", "json_schema")
_ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class AnswerFormat:
    """What a response format asks of the answer: a schema (None: free text) and the name it was given."""

    schema: dict | None
    name: str | None = None
    param: str = "response_format"  # where the client put it (the Responses API: text.format)

    @property
    def label(self) -> str:
        return f"{self.param} {self.name!r}" if self.name else self.param


def chat_format(response_format: dict[str, Any] | None) -> AnswerFormat:
    """Chat's (and /v1/completions') response_format, checked; every refusal is a 400 on `response_format`."""
    if response_format is None:
        return AnswerFormat(None)
    kind = response_format.get("type")
    if kind == "text":
        return AnswerFormat(None)
    if kind == "json_object":
        return AnswerFormat(_ANY_OBJECT)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise invalid("response_format.json_schema must be an object with the schema under \"schema\"")
        return schema_format(spec.get("name"), spec.get("schema"), "response_format", "response_format.json_schema")
    raise unsupported_type(kind, "response_format")


def schema_format(name: Any, schema: Any, param: str, where: str) -> AnswerFormat:
    """A json_schema format's name and schema, checked (`where` names the object holding them in messages)."""
    if not isinstance(schema, dict):
        raise invalid(f"{where}.schema must be a JSON Schema (a JSON object)", param)
    if name is not None and not isinstance(name, str):
        raise invalid(f"{where}.name must be a string", param)
    answer = AnswerFormat(schema, name, param)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise invalid(f"Invalid schema for {answer.label}: not JSON Schema: {exc.message}", param) from None
    return answer


async def grammar_for(engine: Engine, answer: AnswerFormat, tools: function_tools.Tools = function_tools.NO_TOOLS
                      ) -> Grammar | None:
    """The grammar a request asks for (None: free text). Compiling runs off the event loop and off the engine's
    thread: a slow schema delays only its own request."""
    if tools.use is not None:
        if answer.schema is not None:  # checked on its own first, so that a bad schema is named as such
            await _compiled(engine, answer)
        return await function_tools.compile_grammar(engine, tools, answer.schema)
    if answer.schema is None:
        return None
    return await _compiled(engine, answer)


async def _compiled(engine: Engine, answer: AnswerFormat) -> Grammar:
    if answer.schema is _ANY_OBJECT:
        compile_grammar = engine.grammars.json_object
    else:
        compile_grammar = functools.partial(engine.grammars.json_schema, answer.schema, answer.name)
    try:
        return await asyncio.to_thread(compile_grammar)
    except GrammarError as exc:
        raise invalid(f"Invalid schema for {answer.label}: {exc.message}", answer.param) from None


def unsupported_type(kind: Any, param: str) -> OpenAIError:
    message = f"{param} type {kind!r} is not supported; use one of {', '.join(map(repr, TYPES))}"
    return invalid(message, param, "unsupported_parameter" if isinstance(kind, str) else "invalid_value")


def invalid(message: str, param: str = "response_format", code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)

"""`response_format` -> the engine's Grammar: the shape checked here, the schema compiled in a worker thread.

`{"type": "text"}` (the default) asks for nothing; `{"type": "json_object"}` for one JSON object;
`{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` for a value valid against the schema. The
schema is enforced whatever `strict` says (OpenAI only guarantees it with strict: true; vLLM enforces it always).
"""
from __future__ import annotations

import asyncio
import functools
from typing import Any

from engine import Engine, GrammarError
from engine.grammar import Grammar

from api.errors import OpenAIError

TYPES = ("text", "json_object", "json_schema")


async def grammar_for(engine: Engine, response_format: dict[str, Any] | None) -> Grammar | None:
    """The grammar a request's response_format asks for (None for text). Compiling runs off the event loop and
    off the engine's thread: a slow schema delays only its own request. Every refusal is a 400 on
    `response_format`."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        compile_grammar, name = engine.grammars.json_object, None
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise _invalid("response_format.json_schema must be an object with the schema under \"schema\"")
        name, schema = spec.get("name"), spec.get("schema")
        if not isinstance(schema, dict):
            raise _invalid("response_format.json_schema.schema must be a JSON Schema (a JSON object)")
        if name is not None and not isinstance(name, str):
            raise _invalid("response_format.json_schema.name must be a string")
        compile_grammar = functools.partial(engine.grammars.json_schema, schema, name)
    else:
        message = f"response_format type {kind!r} is not supported; use one of {', '.join(map(repr, TYPES))}"
        raise _invalid(message, "unsupported_parameter" if isinstance(kind, str) else "invalid_value")
    try:
        return await asyncio.to_thread(compile_grammar)
    except GrammarError as exc:
        label = f"response_format {name!r}" if name else "response_format"
        raise _invalid(f"Invalid schema for {label}: {exc.message}") from None


def _invalid(message: str, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, param="response_format", code=code)

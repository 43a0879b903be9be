"""The Chat tab's JSON schema: the typed text -> the engine's grammar, and a reply made under it -> indented JSON in a
code block with one line saying whether it validated against the schema."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

import jsonschema

from engine import FINISH_ABORT, Engine, GrammarError, InvalidRequestError
from engine.text.grammar import Grammar

# A plain check mark, not the emoji: it shows in fonts without emoji too (headless chromium drew a box).
VALID_MARK = "\u2713 Valid JSON: it matches the schema."


@dataclass(frozen=True)
class Schema:
    """A schema typed in the Chat tab: checked as JSON Schema and compiled to the engine's grammar."""

    schema: dict
    grammar: Grammar


@dataclass(frozen=True)
class JsonCheck:
    """How the chat shows a reply made under a schema. `pretty` is the reply indented (None while it streams or
    when it is not JSON: the raw text is shown instead); `mark` says whether it validated (empty while streaming)."""

    pretty: str | None = None
    mark: str = ""


STREAMING = JsonCheck()


def compile_schema(engine: Engine, text: str) -> Schema | None:
    """The schema in the Chat tab's box, or None when it is blank (free text). Raises InvalidRequestError with a
    message for the user when the text is not JSON, not a JSON Schema, or not something the engine can hold a reply
    to. Compiling takes milliseconds to seconds (the first one indexes the vocabulary): call it off the event loop."""
    if not text or not text.strip():
        return None
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno}, column {exc.colno}"
        raise _invalid(f"The JSON schema is not valid JSON: {exc.msg} ({where}).") from None
    if not isinstance(schema, dict):
        raise _invalid('The JSON schema must be a JSON object, such as {"type": "object"}.')
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise _invalid(f"This is not a valid JSON Schema: {exc.message} (at {exc.json_path}).") from None
    title = schema.get("title")
    try:
        grammar = engine.grammars.json_schema(schema, title if isinstance(title, str) else None)
    except GrammarError as exc:  # valid JSON Schema, but beyond what the grammar supports, or unsatisfiable
        raise _invalid(f"The reply cannot be held to this schema: {exc.message}") from None
    return Schema(schema, grammar)


def check_reply(text: str, schema: dict, finish_reason: str | None, max_tokens: int | None) -> JsonCheck:
    """What to show for a finished reply: indented when it is JSON, and whether it validated against the schema."""
    # The grammar's own end wins over max_tokens in the engine, so "length" always means the JSON was cut, even
    # when the cut text happens to parse (an integer "12" whose next digit never came).
    if finish_reason == "length":
        return JsonCheck(mark=f"\u26a0\ufe0f Not valid JSON: the reply stopped at the limit of {max_tokens} new "
                              "tokens before the JSON was complete.")
    if finish_reason == FINISH_ABORT:
        return JsonCheck(mark="\u26a0\ufe0f Not valid JSON: the reply was cut short.")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:  # a stop sequence cut it
        return JsonCheck(mark=f"\u26a0\ufe0f Not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno}).")
    pretty = json.dumps(value, indent=2, ensure_ascii=False)
    error = jsonschema.exceptions.best_match(jsonschema.validators.validator_for(schema)(schema).iter_errors(value))
    if error is not None:
        return JsonCheck(pretty, f"\u26a0\ufe0f JSON, but not valid against the schema: {error.message}")
    return JsonCheck(pretty, VALID_MARK)


def render_json_reply(text: str, check: JsonCheck) -> str:
    """Markdown for the chat bubble: the reply (indented once it parsed) in a JSON code block, then the mark."""
    body = check.pretty if check.pretty is not None else text
    # A fence longer than any run of backticks inside, so a string value holding ``` cannot close it early.
    longest = max((len(run) for run in re.findall(r"`+", body)), default=0)
    fence = "`" * max(3, longest + 1)
    block = f"{fence}json\n{body}\n{fence}"
    return f"{block}\n\n{check.mark}" if check.mark else block


def _invalid(message: str) -> InvalidRequestError:
    return InvalidRequestError(message, "schema")

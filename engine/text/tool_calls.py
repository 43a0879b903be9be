"""Tool calls in a model's text: the one format Tern reads, the grammar that holds a reply to it, and how a conversation
with tools is written for a chat template that knows no tools (engine/text/tool_call_parser.py reads replies back).

The format is Hermes's, which the Qwen2.5, Qwen3 and Hermes chat templates teach their models: each call is a JSON
object with the function's name first, then its arguments, between tags on lines of their own:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A template that renders `tools=` itself is given the definitions as they are; one that ignores them (the default
model's) gets them written into the system prompt in this format by `fallback_messages`, and earlier calls and their
results written as text. Reading one format only is a choice: a model trained on another (Llama 3.1's bare JSON,
Mistral's [TOOL_CALLS]) is still held to this one when a call is required, but in `auto` its own format reads as text.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"

ToolMode = Literal["auto", "required", "named"]


@dataclass(frozen=True)
class Function:
    """A function the model may call; parameters is the JSON Schema of its arguments object."""

    name: str
    parameters: dict
    description: str | None = None

    def definition(self) -> dict:
        """In OpenAI's (and transformers' `tools=`) shape."""
        function = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolUse:
    """What a request lets the model do with its functions. `none` is no ToolUse at all: the reply is text."""

    functions: tuple[Function, ...]
    mode: ToolMode = "auto"  # auto: text or calls; required: one call or more; named: exactly one call of `name`
    name: str | None = None
    parallel: bool = True  # more than one call in a reply (never for `named`, as OpenAI)


def grammar_source(tool_use: ToolUse, answer_schema: dict | None = None, json_options: dict | None = None) -> str:
    """The reply's grammar, in llguidance's Lark dialect (docs/syntax.md of llguidance).

    required / named: nothing but calls, each valid against its function's parameters. auto: free text, until the
    model writes the opening tag; from there a valid call is forced (a lazy lexeme: the text before the tag matches
    as little as it can), then text again. With `answer_schema` (response_format beside tools) the reply is either
    calls or one JSON value valid against it. Without `parallel`, the reply ends after its first call.
    json_options: llguidance's JSON compile options (whitespace), given to each JSON part as its "x-guidance" key.
    """
    def embedded(schema: dict) -> str:
        return json.dumps({**schema, "x-guidance": json_options} if json_options else schema)

    functions = tool_use.functions
    if tool_use.mode == "named":
        functions = tuple(f for f in functions if f.name == tool_use.name)
    call_schema = {"anyOf": [_call_schema(f) for f in functions]}
    # One layout, the format's own: a call's JSON on its own line between the tags, calls one newline apart, and
    # nothing after the last one, so that the end-of-sequence token is allowed right after each closing tag.
    rules = [
        "%llguidance {}",
        f"call_json: %json {embedded(call_schema)}",
        f'call_body: "\\n" call_json "\\n" {json.dumps(CLOSE_TAG)}',
    ]
    if tool_use.mode == "auto" and answer_schema is None:
        rules += [
            "TEXT: /(.|\\n)*/",
            f"call_head[lazy]: TEXT {json.dumps(OPEN_TAG)}",
            "tool_call: call_head call_body",
            "start: tool_call* TEXT" if tool_use.parallel else "start: tool_call | TEXT",
        ]
    else:
        rules.append(f"tool_call: {json.dumps(OPEN_TAG)} call_body")
        calls = 'tool_call ("\\n" tool_call)*' if tool_use.parallel and tool_use.mode != "named" else "tool_call"
        if tool_use.mode == "auto":  # with an answer schema
            rules += [f"answer: %json {embedded(answer_schema)}", f"start: {calls} | answer"]
        else:
            rules.append(f"start: {calls}")
    return "\n".join(rules) + "\n"


def _call_schema(function: Function) -> dict:
    # Properties are generated in the order listed: the name first, then the arguments, whose end the parser finds
    # without parsing (engine/text/tool_call_parser.py).
    return {
        "type": "object",
        "properties": {"name": {"const": function.name}, "arguments": function.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def format_call(name: str, arguments: str) -> str:
    """One call as the model would have written it (arguments: the JSON text a client sent back to us)."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        value = arguments  # kept as a string rather than refused: it is the client's history, not ours to judge
    return f"{OPEN_TAG}\n{json.dumps({'name': name, 'arguments': value}, ensure_ascii=False)}\n{CLOSE_TAG}"


def tools_prompt(functions: tuple[Function, ...] | list[Function]) -> str:
    """The system prompt's part that teaches a model without a tools template what it may call, and how."""
    definitions = "\n".join(json.dumps(f.definition(), ensure_ascii=False) for f in functions)
    return (
        "# Tools\n\nYou can call functions to help you answer. Their definitions, one JSON object per line:\n"
        f"<tools>\n{definitions}\n</tools>\n\n"
        "To call a function, answer with a JSON object holding its name and its arguments between "
        f"{OPEN_TAG} and {CLOSE_TAG} tags, one pair of tags per call:\n"
        f'{OPEN_TAG}\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n{CLOSE_TAG}'
    )


def fallback_messages(messages: list[dict], functions: tuple[Function, ...] | list[Function] | None) -> list[dict]:
    """A conversation with tools as plain chat for a template that renders no tools: the definitions join the
    system prompt, an assistant's calls become text in the format above, and tool results become user turns
    wrapped in <tool_response> tags (a user turn, because many templates refuse any other role)."""
    out: list[dict] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            calls = [format_call(c["function"]["name"], c["function"].get("arguments") or "") for c in message["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(filter(None, [content, *calls]))})
        elif role == "tool":
            response = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("_tool_responses"):
                out[-1]["content"] += "\n" + response  # several results of one turn's calls: one user turn
            else:
                out.append({"role": "user", "content": response, "_tool_responses": True})
        else:
            out.append({k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")})
    for message in out:
        message.pop("_tool_responses", None)
    if functions:
        prompt = tools_prompt(functions)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}" if out[0]["content"] else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def native_messages(messages: list[dict]) -> list[dict]:
    """The conversation for a template that renders tools itself: calls' arguments as objects, which is what
    transformers' templates expect (they write them with `tojson`); a string that is no JSON stays a string."""
    out = []
    for message in messages:
        if message.get("tool_calls"):
            calls = []
            for call in message["tool_calls"]:
                arguments = call["function"].get("arguments") or "{}"
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    pass
                calls.append({**call, "function": {**call["function"], "arguments": arguments}})
            message = {**message, "tool_calls": calls}
        out.append(message)
    return out

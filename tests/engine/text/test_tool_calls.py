"""engine/text/tool_calls.py on its own: the reply parser (the same text and calls however the reply is cut into deltas),
the grammar (what it lets through, with the default tokenizer), and the conversation written for a template that
knows no tools."""
from __future__ import annotations

import json
import random

import pytest

from engine.text.grammar import GrammarCompiler
from engine.text.tool_call_parser import ReplyParser
from engine.text.tool_calls import Function, ToolUse, fallback_messages, native_messages

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ris \\"x\\"", "days": [1, {"a": 2}]}}\n</tool_call>'
WEATHER = Function("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                                   "additionalProperties": False}, "Weather now")
NOTHING = Function("ping", {"type": "object", "properties": {}, "additionalProperties": False})


def parse(text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]], list[tuple[str, str]]]:
    """(content, calls put together from the deltas, calls the parser kept) for text fed in pieces cut at `cuts`."""
    parser, content, streamed = ReplyParser(), "", {}
    bounds = [0, *sorted(cuts), len(text)]
    for piece in [text[a:b] for a, b in zip(bounds, bounds[1:])] + [None]:
        delta, calls = parser.feed(piece) if piece is not None else parser.finish()
        content += delta
        for call in calls:
            assert call.index == len(streamed)  # each call comes once, whole
            streamed[call.index] = [call.name, call.arguments]
    assert content == parser.text
    return content, [tuple(c) for c in streamed.values()], [(c.name, c.arguments) for c in parser.calls]


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("Just text, and a < sign <tool_ not a tag\n", "Just text, and a < sign <tool_ not a tag\n", []),
        (f"Let me check.\n{CALL}\n{CALL.replace('get_weather', 'ping')}\n", "Let me check.",
         [("get_weather", '{"city": "Pa}ris \\"x\\"", "days": [1, {"a": 2}]}'),
          ("ping", '{"city": "Pa}ris \\"x\\"", "days": [1, {"a": 2}]}')]),
        (f"{CALL} and after", "and after", [("get_weather", '{"city": "Pa}ris \\"x\\"", "days": [1, {"a": 2}]}')]),
        # Cut by max_tokens inside the arguments: text, never a call with arguments that are no JSON.
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', []),
        # Cut after the arguments: a call (its arguments are whole).
        ('<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool', "",
         [("get_weather", '{"city":"Paris"}')]),
        # A second call cut: the first is a call, the cut one text.
        (f'{CALL}\n<tool_call>\n{{"name":"ping","arguments":{{"a', '<tool_call>\n{"name":"ping","arguments":{"a',
         [("get_weather", '{"city": "Pa}ris \\"x\\"", "days": [1, {"a": 2}]}')]),
        # Arguments that end but are no JSON (only without a grammar): text.
        ('<tool_call>\n{"name": "f", "arguments": {nope}}\n</tool_call>',
         '<tool_call>\n{"name": "f", "arguments": {nope}}\n</tool_call>', []),
        ('<tool_call>\n{"na', '<tool_call>\n{"na', []),  # cut before a name: nothing callable, so text
        ('<tool_call>{"arguments": {}, "name": "ping"}</tool_call>', "", [("ping", "{}")]),  # name last: taken whole
        ("<tool_call>not a call</tool_call>", "<tool_call>not a call</tool_call>", []),
    ],
)
def test_the_parser_gives_the_same_reply_however_it_is_cut(text, content, calls):
    whole = parse(text, [])
    assert whole == (content, calls, calls)
    rng = random.Random(0)
    for _ in range(200):
        cuts = rng.sample(range(1, len(text)), rng.randint(1, min(25, len(text) - 1)))
        assert parse(text, cuts) == whole


def test_a_call_goes_out_once_its_arguments_are_complete():
    parser = ReplyParser()
    assert parser.feed('<tool_call>\n{"name":"get_weather","arguments":{"city":"Pa') == ("", [])
    _, calls = parser.feed('ris"}')
    assert [(d.name, d.arguments) for d in calls] == [("get_weather", '{"city":"Paris"}')]
    assert parser.feed("}\n</tool_call>") == ("", [])


@pytest.fixture(scope="module")
def grammars(default_tokenizer) -> GrammarCompiler:
    return GrammarCompiler(default_tokenizer, len(default_tokenizer), frozenset({default_tokenizer.eos_token_id}))


def accepts(grammar, tokenizer, text: str) -> bool:
    matcher = grammar.matcher()
    return all(matcher.accept(token_id) for token_id in tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize(
    ("use", "text", "allowed"),
    [
        (ToolUse((WEATHER, NOTHING), "required"), CALL, False),  # "days" is no property of get_weather
        (ToolUse((WEATHER, NOTHING), "required"), '<tool_call>\n{"name": "get_weather", "arguments": {"city": "P"}}\n'
         '</tool_call>\n<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>', True),
        # One line of JSON with json.dumps's separators, in the format's own layout only.
        (ToolUse((WEATHER, NOTHING), "required"), '<tool_call>\n{"name":"ping","arguments":{}}\n</tool_call>', False),
        (ToolUse((WEATHER, NOTHING), "required"), '<tool_call>\n{"name": "ping",\n"arguments": {}}\n</tool_call>', False),
        (ToolUse((WEATHER, NOTHING), "required"), '<tool_call>{"name": "ping", "arguments": {}}</tool_call>', False),
        (ToolUse((WEATHER, NOTHING), "required"), "Sure! <tool_call>", False),  # required: calls only
        (ToolUse((WEATHER, NOTHING), "required"), '<tool_call>\n{"name": "get_weather", "arguments": {}}', False),
        (ToolUse((WEATHER, NOTHING), "required"), '<tool_call>\n{"name": "other", "arguments": {}}', False),
        (ToolUse((WEATHER, NOTHING), "named", "ping"), '<tool_call>\n{"name": "get_weather"', False),
        (ToolUse((WEATHER, NOTHING), "required", parallel=False),
         '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>\n<tool_call>', False),
        (ToolUse((WEATHER, NOTHING)), "Any text at all, then <tool_call>", True),  # auto
        (ToolUse((WEATHER, NOTHING)), 'Text <tool_call>\n{"name": "nope"', False),  # auto: once opened, a real call
        (ToolUse((WEATHER, NOTHING)), 'Text <tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call> more', True),
    ],
)
def test_the_grammar_lets_through_valid_calls_only(grammars, default_tokenizer, use, text, allowed):
    assert accepts(grammars.tool_calls(use), default_tokenizer, text) is allowed


@pytest.mark.parametrize("use", [ToolUse((WEATHER, NOTHING), "required"), ToolUse((WEATHER, NOTHING), "named", "ping"),
                                 ToolUse((WEATHER, NOTHING), "required", parallel=False)])
def test_the_reply_may_end_right_after_each_call(grammars, default_tokenizer, use):
    call = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    for num_calls in (1, 2) if use.parallel and use.mode == "required" else (1,):
        matcher = grammars.tool_calls(use).matcher()
        assert all(matcher.accept(t) for t in default_tokenizer.encode("\n".join([call] * num_calls)))
        assert matcher.accept(default_tokenizer.eos_token_id) and matcher.is_finished


def test_a_template_without_tools_gets_them_as_text():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}},
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "21"},
        {"role": "tool", "tool_call_id": "c2", "content": "25"},
    ]
    system, user, assistant, results = fallback_messages(messages, [WEATHER])
    assert system["role"] == "system" and system["content"].startswith("Be brief.\n\n")
    assert json.dumps(WEATHER.definition()) in system["content"]
    assert user == messages[1]
    assert assistant == {"role": "assistant", "content": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')}
    # Both results in one user turn: templates that insist on alternating roles accept it.
    assert results == {"role": "user", "content": "<tool_response>\n21\n</tool_response>\n"
                                                   "<tool_response>\n25\n</tool_response>"}
    assert fallback_messages(messages[1:2], None) == messages[1:2]


def test_a_template_with_tools_gets_arguments_as_objects():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}
    [message] = native_messages([{"role": "assistant", "content": "", "tool_calls": [call]}])
    assert message["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert call["function"]["arguments"] == "{\"a\": 1}"  # the caller's message is left as it was

"""The Anthropic Messages converter on its own (api/anthropic/convert.py): requests become the chat messages and tools
chat renders, replies become Anthropic's content blocks and stream events, and every refusal is a 400 in Anthropic's
envelope. No model: these are pure functions."""
from __future__ import annotations

import json

import pytest

from api import function_tools
from api.anthropic.convert import MessageBuilder, stop_reason, to_chat
from api.anthropic.errors import error_body
from api.anthropic.protocol import MessagesRequest
from api.errors import OpenAIError, to_openai_error
from engine import QueueFullError

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"name": "get_weather", "description": "Weather now", "input_schema": WEATHER},
         {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}]


def request(**fields) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 8,
                                           "messages": [{"role": "user", "content": "hi"}], **fields})


def test_system_text_blocks_and_a_tool_round_trip_become_chat_messages():
    body = request(system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}], messages=[
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "...", "signature": "s"},
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18 C"}]},
            {"type": "text", "text": "And tomorrow?"}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "no such city", "is_error": True}]},
    ], tools=TOOLS, thinking={"type": "enabled", "budget_tokens": 1024}, metadata={"user_id": "u"})
    turns = to_chat(body)
    assert turns.messages == [
        {"role": "system", "content": "Be brief.\nUse tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
         "reasoning_content": "..."},  # a thinking block goes back to the template as the turn's reasoning
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"},
        {"role": "user", "content": "And tomorrow?"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no such city"},
    ]
    assert [f.name for f in turns.tools.functions] == ["get_weather", "get_time"]
    assert turns.tools.use.mode == "auto" and turns.tools.use.parallel


@pytest.mark.parametrize(("choice", "mode", "name", "parallel"), [
    ({"type": "auto"}, "auto", None, True),
    ({"type": "any"}, "required", None, True),
    ({"type": "any", "disable_parallel_tool_use": True}, "required", None, False),
    ({"type": "tool", "name": "get_time"}, "named", "get_time", False),
])
def test_tool_choice_maps_to_openais(choice, mode, name, parallel):
    use = to_chat(request(tools=TOOLS, tool_choice=choice)).tools.use
    assert (use.mode, use.name, use.parallel) == (mode, name, parallel)


def test_tool_choice_none_offers_no_tools():
    assert to_chat(request(tools=TOOLS, tool_choice={"type": "none"})).tools == function_tools.NO_TOOLS


@pytest.mark.parametrize(("fields", "says"), [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "x"}}]}]},
     "'image' are not supported"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
     "'tool_result' are not supported in assistant turns"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "lacks a field"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                 "content": [{"type": "image"}]}]}]}, "'image' are not supported"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search", "input_schema": {}}]}, "server tools"),
    ({"tools": [{"name": "bad name", "input_schema": WEATHER}]}, "Invalid function name"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "not among the tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool"}}, "needs the tool's name"),
    ({"tool_choice": {"type": "any"}}, "only allowed when tools are specified"),
])
def test_what_tern_cannot_serve_is_a_400_saying_why(fields, says):
    with pytest.raises(OpenAIError) as refused:
        to_chat(request(**fields))
    assert refused.value.status_code == 400 and says in refused.value.message
    assert error_body(refused.value) == {"type": "error", "error": {"type": "invalid_request_error",
                                                                    "message": refused.value.message}}


@pytest.mark.parametrize(("status", "kind"), [(401, "authentication_error"), (404, "not_found_error"),
                                              (413, "request_too_large"), (429, "rate_limit_error"),
                                              (500, "api_error"), (503, "overloaded_error")])
def test_error_types_follow_the_status(status, kind):
    assert error_body(OpenAIError(status, "x"))["error"]["type"] == kind
    assert error_body(to_openai_error(QueueFullError("full")))["error"]["type"] == "rate_limit_error"


def _replay(events: list[dict]) -> list[dict]:
    """The content blocks a client assembles from the stream's events, as the SDK does."""
    blocks, partial = [], {}
    for event in events:
        if event["type"] == "content_block_start":
            assert event["index"] == len(blocks)
            blocks.append(dict(event["content_block"]))
        elif event["type"] == "content_block_delta":
            delta = event["delta"]
            if delta["type"] == "text_delta":
                blocks[event["index"]]["text"] += delta["text"]
            else:
                partial[event["index"]] = partial.get(event["index"], "") + delta["partial_json"]
        elif event["type"] == "content_block_stop":
            if event["index"] in partial:
                blocks[event["index"]]["input"] = json.loads(partial[event["index"]])
    return blocks


def test_streamed_events_build_the_same_blocks_as_the_whole_reply():
    reply = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    splitter, builder, events = function_tools.ReplySplitter(), MessageBuilder(), []
    for i in range(0, len(reply), 7):  # the engine's deltas, cut anywhere
        events += builder.add(*splitter.feed(reply[i:i + 7]))
    events += builder.add(*splitter.finish()) + builder.finish()
    assert [e["type"] for e in events if e["type"] != "content_block_delta"] == [
        "content_block_start", "content_block_stop", "content_block_start", "content_block_stop"]
    assert builder.blocks[0] == {"type": "text", "text": "Checking."}
    call = builder.blocks[1]
    assert call["type"] == "tool_use" and call["id"].startswith("toolu_") and call["input"] == {"city": "Paris"}
    assert _replay(events) == builder.blocks and builder.has_calls


def test_an_empty_reply_is_one_empty_text_block():
    builder = MessageBuilder()
    events = builder.add("", []) + builder.finish()
    assert builder.blocks == [{"type": "text", "text": ""}]
    assert [e["type"] for e in events] == ["content_block_start", "content_block_stop"]


@pytest.mark.parametrize(("finish", "matched", "calls", "expected"), [
    ("stop", None, False, ("end_turn", None)),
    ("stop", None, True, ("tool_use", None)),
    ("length", None, True, ("max_tokens", None)),
    ("stop", "\n\n", False, ("stop_sequence", "\n\n")),
    ("stop", 2, False, ("end_turn", None)),  # the EOS token, not a stop sequence of the request
])
def test_stop_reason(finish, matched, calls, expected):
    assert stop_reason(finish, matched, ("\n\n",), calls) == expected

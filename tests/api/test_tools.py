"""Tool calling through the real chat route on a tiny random model: with tool_choice "required" or a named function
even random weights give valid calls (the grammar holds them); streamed deltas add up to the whole answer; the 400s
on bad definitions; a conversation with calls and results renders."""
from __future__ import annotations

import json

import jsonschema
import pytest
from conftest import sse_chunks

CHAT = "/v1/chat/completions"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
# Closed objects: with extra properties allowed, random weights write keys until max_tokens.
TIME = {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


@pytest.fixture
def client(tiny_api):
    return tiny_api[1]


def _assert_valid_calls(calls: list[dict]) -> None:
    assert calls
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


def _streamed_calls(chunks: list[dict]) -> tuple[str, list[dict], str]:
    """(content, calls, finish_reason) put together from deltas as the openai SDK's stream helpers do."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        [choice] = chunk["choices"]
        delta = choice["delta"]
        content += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            if "id" in call:
                assert call["index"] not in calls  # id, type and name come once, on the call's first delta
                calls[call["index"]] = {"id": call["id"], "type": call["type"],
                                        "function": {"name": call["function"]["name"], "arguments": ""}}
            calls[call["index"]]["function"]["arguments"] += call["function"].get("arguments") or ""
        if choice["finish_reason"] is not None:
            assert finish is None
            finish = choice["finish_reason"]
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_gives_valid_calls_streamed_or_not(client, temperature):
    # One call: random weights rarely choose the end-of-sequence token, so with parallel calls allowed they call on
    # until max_tokens (test_parallel_calls_are_each_valid).
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
            "temperature": temperature, "seed": 5, "max_tokens": 230}
    response = client.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    [choice] = response.json()["choices"]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["content"] is None
    _assert_valid_calls(choice["message"]["tool_calls"])
    content, calls, finish = _streamed_calls(sse_chunks(client.post(CHAT, json={**body, "stream": True})))
    assert (content, finish) == ("", "tool_calls")
    strip_ids = lambda calls: [c["function"] for c in calls]  # noqa: E731 - ids are new per answer
    assert strip_ids(calls) == strip_ids(choice["message"]["tool_calls"])


def test_parallel_calls_are_each_valid(client):
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "temperature": 1.0, "seed": 0,
            "max_tokens": 230}
    [choice] = client.post(CHAT, json=body).json()["choices"]
    calls = choice["message"]["tool_calls"]  # only whole calls, even where max_tokens cut a further one
    assert len(calls) >= 2
    _assert_valid_calls(calls)
    content, streamed, _ = _streamed_calls(sse_chunks(client.post(CHAT, json={**body, "stream": True})))
    assert [c["function"] for c in streamed] == [c["function"] for c in choice["message"]["tool_calls"]]
    assert content == (choice["message"]["content"] or "")
    assert len({c["id"] for c in streamed}) == len(streamed)


def test_named_function_is_the_one_call(client):
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}},
            "temperature": 1.0, "seed": 1, "max_tokens": 230}
    for seed in range(3):
        [choice] = client.post(CHAT, json={**body, "seed": seed}).json()["choices"]
        calls = choice["message"]["tool_calls"]
        assert [c["function"]["name"] for c in calls] == ["get_time"]
        _assert_valid_calls(calls)


def test_parallel_tool_calls_false_gives_one_call(client):
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
            "temperature": 1.0, "max_tokens": 230}
    for seed in range(3):
        [choice] = client.post(CHAT, json={**body, "seed": seed}).json()["choices"]
        assert len(choice["message"]["tool_calls"]) == 1


def test_none_answers_in_text_without_calls(client):
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "none", "temperature": 0, "max_tokens": 8}
    [choice] = client.post(CHAT, json=body).json()["choices"]
    assert choice["message"]["tool_calls"] is None
    assert choice["finish_reason"] in ("stop", "length")
    plain = client.post(CHAT, json={"messages": ASK, "temperature": 0, "max_tokens": 8}).json()["choices"][0]
    assert choice["message"]["content"] == plain["message"]["content"]  # the tools are left out of the prompt


def test_a_cut_call_is_length(client):
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "temperature": 0, "max_tokens": 12}
    [choice] = client.post(CHAT, json=body).json()["choices"]
    assert choice["finish_reason"] == "length"
    # Never a call whose arguments are cut: the call stays text, streamed or not.
    assert choice["message"].get("tool_calls") is None and choice["message"]["content"].startswith("<tool_call>")
    content, calls, finish = _streamed_calls(sse_chunks(client.post(CHAT, json={**body, "stream": True})))
    assert (content, calls, finish) == (choice["message"]["content"], [], "length")


def test_history_with_calls_and_results_renders(client):
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 21}"},
    ]
    response = client.post(CHAT, json={"messages": messages, "tools": TOOLS, "max_tokens": 4, "temperature": 0})
    assert response.status_code == 200, response.text
    tokenized = client.post("/tokenize", json={"messages": messages}).json()
    text = client.post("/detokenize", json={"tokens": tokenized["tokens"]}).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' in text
    assert "<tool_response>\n{\"temperature\": 21}\n</tool_response>" in text


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]},
         "tools[0].function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
         "tools[0].function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
        ({"tools": [{"type": "code_interpreter", "function": {"name": "f"}}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}},
            "required": ["n"]}}}]}, "tools[0]"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ],
)
def test_bad_tools_are_400_naming_the_field(client, change, param):
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 4, **change}
    response = client.post(CHAT, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["message"]
    assert client.post(CHAT, json={"messages": ASK, "max_tokens": 2}).status_code == 200  # and the server serves

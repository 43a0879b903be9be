"""/v1/responses through the real routes on a tiny random model: the event sequence and its numbering, streamed and
whole answers agreeing, the store (previous_response_id, GET, DELETE, its bound), text.format and function tools held
by the grammar, max_output_tokens, and the 4xx for bad input."""
from __future__ import annotations

import json

import jsonschema
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from api import RequestIDMiddleware, build_router, install_error_handlers
from engine import EngineHandle

RESPONSES = "/v1/responses"
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
        "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather now", "parameters": CITY}
STORE_SIZE = 3


@pytest.fixture
def client(tiny_engine_factory):
    engine, _ = tiny_engine_factory()
    handle = EngineHandle()
    handle.set_engine(engine)
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(RequestIDMiddleware)
    app.include_router(build_router(handle, max_stored_responses=STORE_SIZE))
    with TestClient(app) as test_client:
        yield test_client


def _events(response) -> list[dict]:
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    events = []
    for block in response.text.strip().split("\n\n"):
        event_line, data_line = block.split("\n")
        event = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {event['type']}"  # as OpenAI frames them; no [DONE] after the last
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def _text(response: dict) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message" for part in item["content"])


def test_a_text_response_whole_and_streamed_agree(client):
    body = {"input": "Name a bird.", "instructions": "Be brief.", "max_output_tokens": 12, "temperature": 1.0,
            "seed": 7}
    whole = client.post(RESPONSES, json=body).json()
    assert whole["object"] == "response" and whole["id"].startswith("resp_")
    assert whole["status"] == "incomplete" and whole["incomplete_details"] == {"reason": "max_output_tokens"}
    [message] = whole["output"]
    assert message["type"] == "message" and message["role"] == "assistant" and message["status"] == "incomplete"
    usage = whole["usage"]
    assert usage["output_tokens"] == 12 and usage["total_tokens"] == usage["input_tokens"] + 12
    assert whole["instructions"] == "Be brief." and whole["temperature"] == 1.0 and whole["max_output_tokens"] == 12

    events = _events(client.post(RESPONSES, json={**body, "stream": True}))
    kinds = [e["type"] for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    streamed = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert streamed == _text(whole)  # the same seed: the same text
    assert events[-1]["response"]["output"][0]["content"] == message["content"]
    streamed_usage = events[-1]["response"]["usage"]
    # The same counts; only cached_tokens may differ (the streamed request finds the prompt's blocks cached).
    assert {**streamed_usage, "input_tokens_details": None} == {**usage, "input_tokens_details": None}


def test_previous_response_id_continues_the_stored_conversation(client, default_tokenizer):
    first = client.post(RESPONSES, json={"input": "Hello there.", "max_output_tokens": 3, "temperature": 0}).json()
    second = client.post(RESPONSES, json={"input": "And then?", "previous_response_id": first["id"],
                                          "max_output_tokens": 3, "temperature": 0}).json()
    assert second["previous_response_id"] == first["id"]
    # The second prompt holds the first turn (its input and its answer) and the new input.
    conversation = [{"role": "user", "content": "Hello there."}, {"role": "assistant", "content": _text(first)},
                    {"role": "user", "content": "And then?"}]
    expected = default_tokenizer.apply_chat_template(conversation, add_generation_prompt=True, return_dict=True)
    assert second["usage"]["input_tokens"] == len(expected["input_ids"])
    assert client.get(f"{RESPONSES}/{first['id']}").json() == first


def test_get_delete_and_the_store_bound(client):
    ids = [client.post(RESPONSES, json={"input": f"Hi {i}", "max_output_tokens": 1}).json()["id"]
           for i in range(STORE_SIZE + 1)]
    assert client.get(f"{RESPONSES}/{ids[0]}").status_code == 404  # the least recently used was dropped
    assert all(client.get(f"{RESPONSES}/{i}").status_code == 200 for i in ids[1:])
    deleted = client.delete(f"{RESPONSES}/{ids[1]}")
    assert deleted.json() == {"id": ids[1], "object": "response", "deleted": True}
    for method in (client.get, client.delete):
        missing = method(f"{RESPONSES}/{ids[1]}")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "response_not_found"
    unknown = client.post(RESPONSES, json={"input": "Hi", "previous_response_id": "resp_nope"})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "previous_response_id"
    not_stored = client.post(RESPONSES, json={"input": "Hi", "max_output_tokens": 1, "store": False}).json()
    assert not_stored["store"] is False and client.get(f"{RESPONSES}/{not_stored['id']}").status_code == 404


def test_text_format_json_schema_holds_the_reply(client):
    body = {"input": "Where?", "text": {"format": {"type": "json_schema", "name": "place", "schema": CITY}},
            "temperature": 1.0, "max_output_tokens": 200}
    for seed in range(3):
        reply = client.post(RESPONSES, json={**body, "seed": seed}).json()
        assert reply["status"] == "completed"
        jsonschema.validate(json.loads(_text(reply)), CITY)
        assert reply["text"] == body["text"]


def test_required_tool_gives_function_call_items_streamed_or_not(client):
    body = {"input": "Weather in Paris?", "tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False,
            "temperature": 1.0, "seed": 3, "max_output_tokens": 200}
    whole = client.post(RESPONSES, json=body).json()
    [call] = whole["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather" and call["status"] == "completed"
    assert call["id"].startswith("fc_") and call["call_id"].startswith("call_")
    jsonschema.validate(json.loads(call["arguments"]), CITY)
    assert whole["tools"][0]["name"] == "get_weather" and whole["tool_choice"] == "required"

    events = _events(client.post(RESPONSES, json={**body, "stream": True}))
    kinds = [e["type"] for e in events]
    deltas = kinds.count("response.function_call_arguments.delta")
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     *["response.function_call_arguments.delta"] * deltas, "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    arguments = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert arguments == call["arguments"] == events[-3]["arguments"]

    # The call and its output continue the conversation: the next turn is text.
    follow = client.post(RESPONSES, json={
        "previous_response_id": whole["id"], "tools": [TOOL], "max_output_tokens": 3,
        "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": "{\"celsius\": 21}"}]})
    assert follow.status_code == 200, follow.text


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": []}, 400, "input"),
        ({"input": [{"role": "robot", "content": "hi"}]}, 400, "input[0].role"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
         "input[0].content[0]"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, 400, "input[0].type"),
        ({"input": [{"type": "reasoning", "summary": [], "content": "not parts"}]}, 400, "input[0].content"),
        ({"input": [{"type": "function_call_output", "output": "1"}]}, 400, "input[0].call_id"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
        ({"input": "hi", "tools": [{**TOOL, "parameters": {"type": "bogus"}}]}, 400, "tools[0].parameters"),
        ({"input": "hi", "tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}}, 400,
         "text.format"),
        ({"input": "hi", "text": {"format": {"type": "xml"}}}, 400, "text.format"),
        ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"input": "hi", "temperature": 3}, 400, "temperature"),
        ({"input": 5}, 400, "input"),
    ],
)
def test_bad_input_is_a_4xx_naming_the_field(client, body, status, param):
    response = client.post(RESPONSES, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"], error
    assert client.post(RESPONSES, json={"input": "hi", "max_output_tokens": 1}).status_code == 200

"""The official `anthropic` SDK against the real server on the default model: /v1/messages whole, async and streamed
(and the stream's events in order, read as raw HTTP), stop sequences, tools with a grammar-held input, a tool_result
round trip, count_tokens, errors in Anthropic's envelope, and one Claude-Code-style request printed for a person to
read (`pytest -s`). The API key on these routes is tried in test_api_key.py, on its keyed server."""
from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import jsonschema
import pytest

pytestmark = pytest.mark.slow

TIMEOUT_S = 120.0  # 2 shared CPU cores; a generous bound, never an assertion on speed
ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [{"name": "get_weather", "description": "The weather in a city now", "input_schema": WEATHER}]
# This SDK's create() has no temperature parameter (newer Claude models fix it); the API still takes it, in the body.
GREEDY = {"temperature": 0}
WEATHER_ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def client(live_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live_server, api_key="unused", max_retries=0, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def model(live_server) -> str:
    return httpx.get(f"{live_server}/v1/models", timeout=30).json()["data"][0]["id"]


def _text(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def _sse_events(response: httpx.Response) -> list[tuple[str, dict]]:
    """(event name, data) per event, after checking each event's name is its data's type."""
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = []
    for frame in response.text.strip().split("\n\n"):
        name_line, data_line = frame.split("\n")
        name, data = name_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))
        assert data["type"] == name
        events.append((name, data))
    return events


def test_create_answers_with_a_message_and_its_usage(client, model):
    message = client.messages.create(model=model, max_tokens=8, extra_body=GREEDY, messages=ASK)
    assert message.id.startswith("msg_") and message.role == "assistant" and message.model == model
    assert message.stop_reason in ("end_turn", "max_tokens") and message.stop_sequence is None
    assert "Paris" in _text(message)
    usage = message.usage
    assert usage.output_tokens > 0 and usage.cache_creation_input_tokens == 0
    assert usage.input_tokens + usage.cache_read_input_tokens > 10
    # The same prompt again: its tokens now come from the prefix cache, and the prompt's size is unchanged.
    again = client.messages.create(model=model, max_tokens=8, extra_body=GREEDY, messages=ASK)
    assert again.usage.cache_read_input_tokens > 0 and _text(again) == _text(message)
    assert (again.usage.input_tokens + again.usage.cache_read_input_tokens
            == usage.input_tokens + usage.cache_read_input_tokens)


def test_count_tokens_is_the_prompt_a_message_request_runs(client, model):
    options = dict(model=model, system="You answer in one word.", messages=ASK, tools=TOOLS)
    counted = client.messages.count_tokens(**options).input_tokens
    message = client.messages.create(**options, max_tokens=4, extra_body=GREEDY)
    # Anthropic counts cache reads apart from input_tokens; together they are the whole prompt.
    assert counted == message.usage.input_tokens + message.usage.cache_read_input_tokens
    assert client.messages.count_tokens(model=model, messages=ASK).input_tokens < counted  # tools are in the prompt


def test_the_async_client(live_server, model):
    async def run():
        async with anthropic.AsyncAnthropic(base_url=live_server, api_key="unused", max_retries=0,
                                            timeout=TIMEOUT_S) as client:
            return await asyncio.gather(*(client.messages.create(model=model, max_tokens=8, extra_body=GREEDY,
                                                                 messages=ASK) for _ in range(2)))

    first, second = asyncio.run(run())
    assert _text(first) == _text(second) and first.id != second.id


def test_the_stream_helper_and_the_events_in_order(client, live_server, model):
    with client.messages.stream(model=model, max_tokens=8, extra_body=GREEDY, messages=ASK) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == _text(final) and "Paris" in text
    assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens > 0

    body = {"model": model, "max_tokens": 8, "temperature": 0, "messages": ASK, "stream": True}
    events = _sse_events(httpx.post(f"{live_server}/v1/messages", json=body, timeout=TIMEOUT_S))
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    streamed = "".join(data["delta"]["text"] for name, data in events if name == "content_block_delta")
    assert streamed == text  # greedy: the raw stream and the SDK's agree
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == final.stop_reason and delta["usage"]["output_tokens"] > 0


def test_a_stop_sequence_ends_the_text_and_is_reported(client, model):
    options = dict(model=model, max_tokens=8, extra_body=GREEDY, messages=ASK)
    free = _text(client.messages.create(**options))
    word = free.split()[2]  # a word the greedy answer writes: the capital of France is Paris -> "of"
    message = client.messages.create(**options, stop_sequences=["zzz-never", word])
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", word)
    assert _text(message) == free[:free.index(word)]


def test_tool_choice_any_gives_a_tool_use_valid_against_its_schema(client, model):
    one_call = {"type": "any", "disable_parallel_tool_use": True}
    message = client.messages.create(model=model, max_tokens=100, extra_body={"temperature": 1.0}, tools=TOOLS,
                                     messages=WEATHER_ASK, tool_choice=one_call)
    assert message.stop_reason == "tool_use"
    [call] = [block for block in message.content if block.type == "tool_use"]
    assert call.id.startswith("toolu_") and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER)

    with client.messages.stream(model=model, max_tokens=100, extra_body=GREEDY, messages=WEATHER_ASK, tools=TOOLS,
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        final = stream.get_final_message()
    [call] = final.content
    assert final.stop_reason == "tool_use" and call.type == "tool_use"
    jsonschema.validate(call.input, WEATHER)  # the SDK put the input together from input_json_delta fragments


def test_a_tool_result_round_trip(client, model):
    """The client's history: the call it got (as a tool_use block), then its result in the next user turn."""
    call = {"type": "tool_use", "id": "toolu_01A09q90qw90lq917835lq9", "name": "get_weather",
            "input": {"city": "Paris", "unit": "celsius"}}

    def history(result: str) -> list:
        return [*WEATHER_ASK, {"role": "assistant", "content": [call]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"],
                                              "content": [{"type": "text", "text": result}]}]}]

    short = json.dumps({"temperature": 21})
    answer = client.messages.create(model=model, max_tokens=12, extra_body=GREEDY, messages=history(short), tools=TOOLS)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use") and answer.content
    # The result reaches the prompt: a longer one makes it longer.
    longer = json.dumps({"temperature": 21, "sky": "clear, with a light wind from the west"})
    counts = [client.messages.count_tokens(model=model, messages=history(r), tools=TOOLS).input_tokens
              for r in (short, longer)]
    assert counts[1] > counts[0]


def test_errors_are_in_anthropics_envelope(client, live_server, model):
    response = httpx.post(f"{live_server}/v1/messages", json={"model": model, "messages": ASK}, timeout=30)
    assert response.status_code == 400
    assert response.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                          "message": "Missing required parameter: 'max_tokens'."}}
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=model, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
    assert caught.value.body["error"]["type"] == "invalid_request_error" and "image" in caught.value.message
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="not-the-served-model", max_tokens=8, messages=ASK)
    assert caught.value.body["error"]["type"] == "not_found_error"
    # The server is fine afterwards.
    assert client.messages.create(model=model, max_tokens=2, messages=ASK).usage.output_tokens > 0


def test_a_claude_code_style_request(live_server, model):
    """What Claude Code sends: a system prompt in cached text blocks, its tools (JSON Schema draft 7 with $schema),
    metadata, thinking off, and a stream. Printed, event by event, for a person to read."""
    tools = [
        {"name": "Read", "description": "Reads a file from the local filesystem.", "input_schema": {
            "$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "additionalProperties": False,
            "properties": {"file_path": {"type": "string", "description": "The absolute path to the file to read"}},
            "required": ["file_path"]}},
        {"name": "Bash", "description": "Executes a given bash command.", "input_schema": {
            "$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "additionalProperties": False,
            "properties": {"command": {"type": "string", "description": "The command to execute"},
                           "timeout": {"type": "number", "description": "Optional timeout in milliseconds"}},
            "required": ["command"]}},
    ]
    body = {
        "model": model, "max_tokens": 24, "stream": True, "temperature": 1,
        "system": [{"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
                   {"type": "text", "text": "You are an interactive CLI tool that helps users with software "
                    "engineering tasks.", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Show me the files in this folder.",
                                                   "cache_control": {"type": "ephemeral"}}]}],
        "tools": tools, "metadata": {"user_id": "user_abc_account__session_123"}, "thinking": {"type": "disabled"},
    }
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219", "x-api-key": "unused"}
    response = httpx.post(f"{live_server}/v1/messages", json=body, headers=headers, timeout=TIMEOUT_S)
    events = _sse_events(response)
    print("\nClaude-Code-style request, streamed events:")
    for name, data in events:
        print(f"  {name}: {json.dumps(data)}")
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    stop = events[-2][1]["delta"]["stop_reason"]
    assert stop in ("end_turn", "max_tokens", "tool_use")
    starts = [data["content_block"] for name, data in events if name == "content_block_start"]
    stops = [data["index"] for name, data in events if name == "content_block_stop"]
    assert starts and stops == list(range(len(starts)))
    if stop == "tool_use":
        assert any(block["type"] == "tool_use" for block in starts)

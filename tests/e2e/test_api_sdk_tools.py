"""The official `openai` SDK against the real server on the default model: tool calling on chat completions and the
Responses API, streamed and not, at temperature 0 and 1.0, with jsonschema validating every structured reply (the
grammar must hold while sampling too)."""
from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow

TIMEOUT_S = 120.0  # 2 shared CPU cores; a generous bound, never an assertion on speed
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                           "parameters": WEATHER}}]


class GetWeather(BaseModel):
    """The weather in a city now."""

    city: str = Field(max_length=40)
    unit: Literal["celsius", "fahrenheit"]


class Capital(BaseModel):
    country: str = Field(max_length=40)
    capital: str = Field(max_length=40)


@pytest.fixture(scope="module")
def client(live_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_server}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def _valid_calls(calls) -> list[tuple[str, dict]]:
    assert calls
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, WEATHER)
        out.append((call.function.name, arguments))
    return out


# Chat completions with tools.
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_tool_calls_whole_and_streamed(client, model, temperature):
    options = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="required", temperature=temperature, seed=11,
                   max_tokens=200)
    [choice] = client.chat.completions.create(**options).choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = _valid_calls(choice.message.tool_calls)

    chunks = list(client.chat.completions.create(**options, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed: dict[int, list] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or []:
            if delta.id is not None:
                streamed[delta.index] = [delta.function.name, ""]
            streamed[delta.index][1] += delta.function.arguments or ""
    assert [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"
    assert [(name, json.loads(arguments)) for name, arguments in streamed.values()] == calls


@pytest.mark.parametrize("stream", [False, True])
def test_required_ends_with_its_calls_within_a_small_budget(client, model, stream):
    """What the OpenAI Agents SDK sends (parallel calls allowed, max_tokens 80): the reply ends after its calls with
    "tool_calls", every call's arguments valid, none cut."""
    options = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=80)
    if stream:
        finish, calls = _streamed(client.chat.completions.create(**options, stream=True))
    else:
        [choice] = client.chat.completions.create(**options).choices
        finish, calls = choice.finish_reason, [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert finish == "tool_calls"
    for name, arguments in calls:
        assert name == "get_weather"
        jsonschema.validate(json.loads(arguments), WEATHER)


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_by_max_tokens_stays_text(client, model, stream):
    options = dict(model=model, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=22)
    if stream:
        chunks = list(client.chat.completions.create(**options, stream=True))
        assert not any(c.choices[0].delta.tool_calls for c in chunks)  # no call announced that then broke off
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        [choice] = client.chat.completions.create(**options).choices
        assert choice.message.tool_calls is None
        content, finish = choice.message.content, choice.finish_reason
    assert finish == "length"
    assert content.startswith('<tool_call>\n{"name":') and '"arguments":' in content  # cut inside the arguments


def _streamed(chunks) -> tuple[str | None, list[tuple[str, str]]]:
    finish, calls = None, {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or []:
            if delta.id is not None:
                calls[delta.index] = [delta.function.name, ""]
            calls[delta.index][1] += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return finish, [tuple(call) for call in calls.values()]


def test_named_function_and_parse_with_a_pydantic_tool(client, model):
    completion = client.chat.completions.parse(
        model=model, messages=ASK, tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice={"type": "function", "function": {"name": "GetWeather"}}, temperature=1.0, seed=2, max_tokens=200)
    [choice] = completion.choices
    [call] = choice.message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetWeather)
    assert choice.finish_reason == "tool_calls"


def test_the_stream_helper_puts_tool_calls_together(client, model):
    with client.chat.completions.stream(model=model, messages=ASK, tools=[openai.pydantic_function_tool(GetWeather)],
                                        tool_choice="required", parallel_tool_calls=False, temperature=0,
                                        max_tokens=200) as stream:
        final = stream.get_final_completion()
    [call] = final.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetWeather)


def test_a_tool_result_is_answered_in_text(client, model):
    [choice] = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                              temperature=0, max_tokens=200, parallel_tool_calls=False).choices
    [call] = choice.message.tool_calls
    history = [*ASK, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_celsius": 21})}]
    [answer] = client.chat.completions.create(model=model, messages=history, tools=TOOLS, tool_choice="none",
                                              temperature=0, max_tokens=40).choices
    assert answer.message.tool_calls is None and answer.message.content
    assert answer.finish_reason in ("stop", "length")


def test_bad_tools_are_bad_requests(client, model):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=5,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert caught.value.param == "tool_choice"
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": 3}}}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=ASK, tools=bad, max_tokens=5)
    assert caught.value.param == "tools[0].function.parameters"


# The Responses API.
def test_responses_answer_whole_and_streamed(client, model):
    response = client.responses.create(model=model, input="What is the capital of France?", temperature=0)
    assert response.status == "completed" and response.output_text == "The capital of France is Paris."
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens

    events = list(client.responses.create(model=model, input="What is the capital of France?", temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == response.output_text == events[-1].response.output_text


def test_responses_continue_a_stored_conversation_and_can_be_deleted(client, model):
    first = client.responses.create(model=model, input="What is the capital of France?", temperature=0)
    second = client.responses.create(model=model, input="And what is its population?", temperature=0,
                                     previous_response_id=first.id, max_output_tokens=30)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens  # the first turn is in
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=model, input="Hi", previous_response_id=first.id)


def test_responses_max_output_tokens_leaves_it_incomplete(client, model):
    response = client.responses.create(model=model, input="Write a long story about a tern.", max_output_tokens=5)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 5


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_responses_parse_a_pydantic_format(client, model, temperature):
    response = client.responses.parse(model=model, input="What is the capital of France?", text_format=Capital,
                                      temperature=temperature, max_output_tokens=200)
    assert response.status == "completed"
    assert isinstance(response.output_parsed, Capital)
    jsonschema.validate(json.loads(response.output_text), Capital.model_json_schema())


def test_responses_function_calls_streamed_and_continued(client, model):
    tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city now",
              "parameters": WEATHER, "strict": True}]
    response = client.responses.create(model=model, input="What is the weather like in Paris today?", tools=tools,
                                       tool_choice="required", parallel_tool_calls=False, temperature=1.0,
                                       max_output_tokens=200)
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)

    events = list(client.responses.create(model=model, input="What is the weather like in Rome today?", tools=tools,
                                          tool_choice="required", parallel_tool_calls=False, temperature=0,
                                          max_output_tokens=200, stream=True))
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == done.arguments
    jsonschema.validate(json.loads(done.arguments), WEATHER)

    answer = client.responses.create(model=model, previous_response_id=response.id, tools=tools, tool_choice="none",
                                     temperature=0, max_output_tokens=40, input=[
                                         {"type": "function_call_output", "call_id": call.call_id,
                                          "output": json.dumps({"temperature_celsius": 21})}])
    assert answer.output_text and answer.output[0].type == "message"


def test_responses_bad_input_is_a_bad_request(client, model):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=model, input=[{"role": "user", "content": [{"type": "input_image",
                                                                                  "image_url": "http://x/y.png"}]}])
    assert caught.value.param == "input[0].content[0]"
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=model, input="hi", text={"format": {"type": "json_schema", "name": "x",
                                                                          "schema": {"type": 7}}})
    assert caught.value.param == "text.format"

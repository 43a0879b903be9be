"""response_format through the real routes on a tiny random model: JSON that validates, streamed or not, on chat and
completions; the 400s on `response_format`; `length` when max_tokens cuts the JSON."""
from __future__ import annotations

import json

import jsonschema
import pytest
from conftest import sse_chunks

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "Describe a bird."}]
BIRD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "kind": {"enum": ["tern", "gull"]},
        "wingspan_cm": {"type": "integer", "minimum": 20, "maximum": 99},
        "colours": {"type": "array", "items": {"enum": ["white", "grey", "black"]}, "minItems": 1, "maxItems": 2},
    },
    "required": ["name", "kind", "wingspan_cm", "colours"],
    "additionalProperties": False,
}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "bird", "schema": BIRD, "strict": True}}


@pytest.fixture
def client(tiny_api):
    return tiny_api[1]


def test_chat_json_schema_validates_streamed_or_not(client):
    body = {"messages": HI, "response_format": SCHEMA_FORMAT, "temperature": 1.0, "seed": 3, "max_tokens": 300}
    whole = client.post(CHAT, json=body).json()
    [choice] = whole["choices"]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), BIRD)
    chunks = sse_chunks(client.post(CHAT, json={**body, "stream": True}))
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert streamed == choice["message"]["content"]  # the same seed, the same grammar: the same answer
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop"


def test_chat_json_object_with_n_and_logprobs(client):
    body = {"messages": HI, "response_format": {"type": "json_object"}, "n": 3, "seed": 1, "max_tokens": 40,
            "logprobs": True, "top_logprobs": 2}
    for choice in client.post(CHAT, json=body).json()["choices"]:
        text = choice["message"]["content"]
        assert text.startswith("{")
        tokens = choice["logprobs"]["content"]
        assert all(t["logprob"] <= 0 for t in tokens)
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(text), dict)
        else:
            assert choice["finish_reason"] == "length" and len(tokens) == 40


def test_completions_take_response_format_too(client):
    body = {"prompt": "A bird:", "response_format": SCHEMA_FORMAT, "temperature": 0, "max_tokens": 300}
    [choice] = client.post(COMPLETIONS, json=body).json()["choices"]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["text"]), BIRD)
    chunks = sse_chunks(client.post(COMPLETIONS, json={**body, "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]


def test_max_tokens_that_cuts_the_json_is_length(client):
    body = {"messages": HI, "response_format": SCHEMA_FORMAT, "temperature": 0, "max_tokens": 3}
    [choice] = client.post(CHAT, json=body).json()["choices"]
    assert choice["finish_reason"] == "length" and choice["message"]["content"].startswith("{")


def test_text_is_the_default_and_changes_nothing(client):
    body = {"messages": HI, "temperature": 0, "max_tokens": 12, "ignore_eos": True}
    plain = client.post(CHAT, json=body).json()["choices"][0]["message"]["content"]
    as_text = client.post(CHAT, json={**body, "response_format": {"type": "text"}}).json()
    assert as_text["choices"][0]["message"]["content"] == plain


@pytest.mark.parametrize(
    ("response_format", "words"),
    [
        ({"type": "xml"}, ["'xml'", "json_schema"]),
        ({}, ["None", "json_object"]),
        ({"type": "json_schema"}, ["json_schema"]),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, ["schema"]),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": "an object"}}, ["schema"]),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}, ["'x'", "strin"]),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(("}}},
         ["regex"]),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/gone"}}}, ["gone"]),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "object", "required": ["a"],
          "properties": {"a": {"type": "integer", "minimum": 3, "maximum": 1}}}}}, ["nsatisfiable"]),
    ],
)
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_what_cannot_be_compiled_is_a_400_on_response_format(client, response_format, words, path):
    body = {"messages": HI} if path == CHAT else {"prompt": "A bird:"}
    response = client.post(path, json={**body, "response_format": response_format, "stream": True})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "response_format")
    assert all(word in error["message"] for word in words), error["message"]


def test_a_response_format_that_is_not_an_object_is_a_400_too(client):
    response = client.post(CHAT, json={"messages": HI, "response_format": "json"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "response_format"

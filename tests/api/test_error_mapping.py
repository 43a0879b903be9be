"""Every exception a route can raise becomes OpenAI's error shape with the right status, param and code."""
from __future__ import annotations

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from api.errors import ClientDisconnected, OpenAIError, to_openai_error
from api.protocol import ChatCompletionRequest, CompletionRequest
from engine import (
    ContextLengthExceededError,
    InvalidRequestError,
    ModelLoadError,
    NoChatTemplateError,
    QueueFullError,
    StepFailedError,
)


def _validation_error(model, body) -> RequestValidationError:
    """What FastAPI raises for this body: pydantic's errors located under "body"."""
    try:
        model.model_validate(body)
    except ValidationError as exc:
        return RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()])
    raise AssertionError("body was valid")


@pytest.mark.parametrize(
    ("model", "body", "param", "code"),
    [
        (ChatCompletionRequest, {}, "messages", "missing_required_parameter"),
        (ChatCompletionRequest, {"messages": "hi"}, "messages", "invalid_type"),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_type"),
        (ChatCompletionRequest, {"messages": [{"content": "x"}]}, "messages[0].role", "missing_required_parameter"),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "top_p": 2}, "top_p", "invalid_value"),
        (CompletionRequest, {"prompt": 5}, "prompt", "invalid_type"),
        (CompletionRequest, {"prompt": [1, "a"]}, "prompt", "invalid_type"),
        (CompletionRequest, {"prompt": "x", "max_tokens": "many"}, "max_tokens", "invalid_type"),
        (CompletionRequest, {"prompt": "x", "stop": [1]}, "stop", "invalid_type"),
    ],
)
def test_validation_errors_name_the_field_like_openai(model, body, param, code):
    error = to_openai_error(_validation_error(model, body))
    assert (error.status_code, error.type, error.param, error.code) == (400, "invalid_request_error", param, code)
    assert param in error.message


def test_a_union_lists_the_shapes_it_would_accept():
    error = to_openai_error(_validation_error(CompletionRequest, {"prompt": 5}))
    assert error.message == "Invalid type for 'prompt': expected one of list[list[int]], list[int], list[str], str."


def test_malformed_json_and_non_objects():
    json_error = RequestValidationError(
        [{"type": "json_invalid", "loc": ("body", 1), "msg": "JSON decode error", "ctx": {"error": "Expecting value"}}]
    )
    error = to_openai_error(json_error)
    assert error.status_code == 400 and "JSON" in error.message and error.param is None
    not_object = RequestValidationError([{"type": "model_attributes_type", "loc": ("body",), "msg": "Input should be"}])
    assert "JSON object" in to_openai_error(not_object).message


@pytest.mark.parametrize(
    ("exc", "status", "code"),
    [
        (InvalidRequestError("bad", "prompt"), 400, "invalid_value"),
        (ContextLengthExceededError("too long", "max_tokens"), 400, "context_length_exceeded"),
        (NoChatTemplateError("no template", "messages"), 400, "chat_template_missing"),
        (QueueFullError("busy"), 429, "rate_limit_exceeded"),
        (ModelLoadError("missing file"), 503, "model_not_ready"),
        (StepFailedError("the engine failed while computing this request"), 500, None),
    ],
)
def test_engine_errors(exc, status, code):
    error = to_openai_error(exc)
    assert (error.status_code, error.code, error.param) == (status, code, exc.param)
    assert exc.message in error.message


def test_429_and_503_say_when_to_retry():
    assert to_openai_error(QueueFullError("busy")).headers["Retry-After"] == "1"
    assert to_openai_error(ModelLoadError("x")).headers["Retry-After"] == "1"


def test_only_our_own_bugs_are_500s():
    error = to_openai_error(KeyError("oops"))
    assert error.status_code == 500 and error.type == "server_error"
    assert to_openai_error(HTTPException(405, "Method Not Allowed")).status_code == 405
    assert to_openai_error(ClientDisconnected()).status_code == 499


def test_body_has_exactly_openais_four_fields():
    assert OpenAIError(400, "m", param="p").body() == {
        "error": {"message": "m", "type": "invalid_request_error", "param": "p", "code": None}
    }

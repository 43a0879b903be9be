"""Limits that protect the process, the HTTP side: body size (413), bounds on what one request may ask for (400),
CORS only for allowed origins, and 503 with Retry-After while the server drains. The API here has no model (the
handle is empty, as while loading), which every check below comes before."""
from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.testclient import TestClient
from pydantic import ValidationError

from api import APICORSMiddleware, BodySizeLimitMiddleware, RequestIDMiddleware, build_router, install_error_handlers
from api.errors import OpenAIError, to_openai_error
from api.protocol import MAX_PROMPTS, ChatCompletionRequest, CompletionRequest
from api.scoring import LoglikelihoodRequest
from engine import EngineHandle, InvalidRequestError
from engine.params import MAX_LOGIT_BIAS, MAX_STOP_STRINGS

CHAT = "/v1/chat/completions"
HI = {"messages": [{"role": "user", "content": "hi"}]}
ORIGIN = "https://app.example"


def api_client(max_body_size_bytes: int = 1024, cors_origins: list[str] | None = None,
               handle: EngineHandle | None = None) -> TestClient:
    """The API as app.py wires it, minus the UI and the model."""
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_body_size_bytes=max_body_size_bytes)
    app.add_middleware(RequestIDMiddleware)
    if cors_origins:
        app.add_middleware(APICORSMiddleware, origins=cors_origins)
    app.include_router(build_router(handle or EngineHandle()))
    return TestClient(app)


def error_of(response) -> dict:
    body = response.json()
    assert list(body) == ["error"] and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# Body size.
def test_a_body_over_the_limit_is_413_in_openais_shape():
    response = api_client().post(CHAT, content=b"x" * 2000, headers={"content-type": "application/json"})
    assert response.status_code == 413 and response.headers["x-request-id"]
    error = error_of(response)
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
    assert "1024 bytes" in error["message"]


def test_a_chunked_body_is_counted_as_it_arrives():
    def chunks():  # no Content-Length: the client sends it chunked
        for _ in range(8):
            yield b"x" * 200

    response = api_client().post(CHAT, content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in response.request.headers
    assert response.status_code == 413 and error_of(response)["code"] == "request_too_large"


def test_on_anthropics_messages_route_the_413_is_in_anthropics_envelope():
    def chunks():
        for _ in range(8):
            yield b"x" * 200

    for content in (b"x" * 2000, chunks()):  # refused from its Content-Length, or counted as it arrives
        response = api_client().post("/v1/messages", content=content, headers={"content-type": "application/json"})
        assert response.status_code == 413
        assert response.json()["type"] == "error" and response.json()["error"]["type"] == "request_too_large"
    body = {"model": "m", "max_tokens": 1, **HI}
    loading = api_client().post("/v1/messages", json=body)  # past the limit: the model is not loaded
    assert loading.status_code == 503 and loading.json()["error"]["type"] == "overloaded_error"
    assert loading.headers["retry-after"]


def test_a_body_under_the_limit_goes_through():
    response = api_client().post(CHAT, json=HI)
    assert response.status_code == 503 and error_of(response)["code"] == "model_not_ready"  # past the limit check


# Bounds on one request.
def test_prompts_per_request_are_bounded():
    assert len(CompletionRequest(prompt=["a"] * MAX_PROMPTS).prompts()) == MAX_PROMPTS
    with pytest.raises(OpenAIError) as caught:
        CompletionRequest(prompt=["a"] * (MAX_PROMPTS + 1)).prompts()
    assert (caught.value.status_code, caught.value.param) == (400, "prompt")
    assert f"at most {MAX_PROMPTS} prompts" in caught.value.message
    token_ids = CompletionRequest(prompt=[7] * (MAX_PROMPTS + 1)).prompts()  # one prompt of token ids, not a batch
    assert len(token_ids) == 1


def test_scoring_pairs_per_request_are_bounded():
    LoglikelihoodRequest(prompts=["a"] * MAX_PROMPTS, continuations=["b"] * MAX_PROMPTS)
    with pytest.raises(ValidationError) as caught:
        LoglikelihoodRequest(prompts=["a"] * (MAX_PROMPTS + 1), continuations=["b"] * (MAX_PROMPTS + 1))
    errors = [{**e, "loc": ("body", *e["loc"])} for e in caught.value.errors()]
    error = to_openai_error(RequestValidationError(errors))
    assert (error.status_code, error.param) == (400, "prompts") and str(MAX_PROMPTS) in error.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}, "stop"),
        ({"logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
        ({"stop_token_ids": list(range(100))}, "stop_token_ids"),
    ],
)
def test_stop_lists_and_logit_bias_are_bounded_with_a_400(fields, param):
    with pytest.raises(InvalidRequestError) as caught:
        ChatCompletionRequest.model_validate({**HI, **fields}).to_sampling_params()
    error = to_openai_error(caught.value)
    assert (error.status_code, error.param, error.code) == (400, param, "invalid_value")


def test_bounds_in_the_body_schema_are_400s_over_http():
    client = api_client(max_body_size_bytes=1 << 20)
    pairs = ["a"] * (MAX_PROMPTS + 1)
    for path, body, param in [
        (CHAT, {**HI, "n": 17}, "n"),
        (CHAT, {**HI, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
        ("/v1/loglikelihood", {"prompts": pairs, "continuations": pairs}, "prompts"),
    ]:
        response = client.post(path, json=body)
        assert response.status_code == 400 and error_of(response)["param"] == param, body


# CORS.
def preflight(client: TestClient, origin: str, path: str = CHAT):
    return client.options(path, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    })


def cors_headers(response) -> dict[str, str]:
    return {k: v for k, v in response.headers.items() if k.startswith("access-control-")}


def test_an_allowed_origins_preflight_gets_the_allow_headers():
    client = api_client(cors_origins=[ORIGIN, "http://localhost:3000"])
    for path in (CHAT, "/v1/models", "/tokenize"):
        response = preflight(client, ORIGIN, path)
        assert response.status_code == 200
        headers = cors_headers(response)
        assert headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in headers["access-control-allow-methods"]
        assert "authorization" in headers["access-control-allow-headers"].lower()
    # The answer itself (a 503 here: no model) carries the origin, and lets the page read its request id.
    response = client.post(CHAT, json=HI, headers={"Origin": ORIGIN})
    assert response.headers["access-control-allow-origin"] == ORIGIN
    assert "x-request-id" in response.headers["access-control-expose-headers"].lower()


def test_a_disallowed_origin_gets_no_cors_headers():
    client = api_client(cors_origins=[ORIGIN])
    response = preflight(client, "https://evil.example")
    assert response.status_code == 400 and cors_headers(response) == {}
    assert error_of(response)["code"] == "cors_origin_not_allowed"
    assert cors_headers(client.post(CHAT, json=HI, headers={"Origin": "https://evil.example"})) == {}


def test_without_cors_origins_nothing_is_sent_and_other_paths_are_left_alone():
    assert cors_headers(preflight(api_client(), ORIGIN)) == {}
    assert cors_headers(api_client().post(CHAT, json=HI, headers={"Origin": ORIGIN})) == {}
    assert cors_headers(api_client(cors_origins=[ORIGIN]).get("/health", headers={"Origin": ORIGIN})) == {}


def test_a_wildcard_allows_any_origin():
    response = preflight(api_client(cors_origins=["*"]), "https://anywhere.example")
    assert response.status_code == 200 and response.headers["access-control-allow-origin"] == "*"


# Draining.
def test_while_draining_new_work_and_ready_get_503_with_retry_after():
    handle = EngineHandle()
    client = api_client(handle=handle)
    handle.drain()
    for method, path, body in [("POST", CHAT, HI), ("POST", "/v1/completions", {"prompt": "hi"}),
                               ("GET", "/v1/models", None), ("POST", "/tokenize", {"prompt": "hi"}),
                               ("GET", "/ready", None), ("GET", "/readyz", None)]:
        response = client.request(method, path, json=body)
        assert response.status_code == 503 and int(response.headers["retry-after"]) >= 1, path
        error = error_of(response)
        assert error["code"] == "server_shutting_down" and error["type"] == "service_unavailable_error"

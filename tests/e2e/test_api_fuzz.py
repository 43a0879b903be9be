"""Hostile input against the real server: schemathesis over /openapi.json (every route and method, generated and
boundary bodies, valid and not), then one test per thing it found.

The fuzz run asserts what a client relies on: no 5xx, no response outside its documented schema (streamed events
included), every malformed request refused with a 4xx, and the server afterwards idle, its KV cache empty, giving
the same greedy answers as before. `TERN_FUZZ_EXAMPLES` and `TERN_FUZZ_SEED` run it longer or elsewhere by hand.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import ARTIFACTS, start_server, stop_server, wait_healthy

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GREEDY_COMPLETION = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
GREEDY_CHAT = {"messages": [{"role": "user", "content": "Name three birds."}], "max_tokens": 8, "temperature": 0}
HI = [{"role": "user", "content": "hi"}]
NEEDS_SCHEMATHESIS = "a test-only dependency: pip install -r requirements-test.txt"
# Every check but max_response_time (timings belong in bench/) and object_level_authorization (no users here).
CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,"
          "response_schema_conformance,negative_data_rejection,positive_data_acceptance,missing_required_header,"
          "unsupported_method,allow_header_conformance,use_after_free,ensure_resource_availability,ignored_auth")
# A body the schema allows may still be refused for what no schema says: an unknown model (404), a prompt longer
# than the context, token ids outside the vocabulary, an empty text (400). Anything else (a 405, 415 or 422 for
# valid data) still fails the run.
CONFIG = """
[checks.positive_data_acceptance]
expected-statuses = ["2xx", "400", "404"]
"""


@pytest.fixture(scope="module")
def fuzz_server():
    """The default server as shipped, but with the eager decode step (nothing compiling while it is fuzzed)."""
    process, base_url, log_path = start_server("--no-compile", log_name="fuzz-server")
    try:
        wait_healthy(process, base_url, log_path)
        yield base_url, log_path
    finally:
        stop_server(process)


@pytest.fixture(scope="module")
def http(fuzz_server):
    with httpx.Client(base_url=fuzz_server[0], timeout=120.0) as client:
        yield client


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert list(body) == ["error"] and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def greedy_answers(http: httpx.Client) -> tuple[str, str]:
    completion = http.post(COMPLETIONS, json=GREEDY_COMPLETION)
    chat = http.post(CHAT, json=GREEDY_CHAT)
    assert completion.status_code == 200 and chat.status_code == 200, (completion.text, chat.text)
    return completion.json()["choices"][0]["text"], chat.json()["choices"][0]["message"]["content"]


def engine_load(http: httpx.Client) -> dict[str, float]:
    lines = http.get("/metrics").text.splitlines()
    names = ("tern_num_requests_running", "tern_num_requests_waiting", "tern_kv_cache_blocks_used")
    return {line.split()[0]: float(line.split()[1]) for line in lines if line.split(" ")[0] in names}


def test_schemathesis_finds_no_server_error_and_no_response_outside_the_schema(fuzz_server, http, tmp_path):
    pytest.importorskip("schemathesis", reason=NEEDS_SCHEMATHESIS)
    base_url, log_path = fuzz_server
    before = greedy_answers(http)
    operations = [(method.upper(), path) for path, item in http.get("/openapi.json").json()["paths"].items()
                  for method in item]
    for route in ("/tokenize", "/detokenize", "/tokenizer_info", "/health", "/ready", "/metrics", CHAT, COMPLETIONS,
                  "/v1/models", "/v1/models/{model_id}", "/v1/loglikelihood", "/v1/embeddings", "/v1/messages",
                  "/v1/messages/count_tokens"):
        assert route in {path for _, path in operations}, route
    log_start = log_path.stat().st_size

    (tmp_path / "schemathesis.toml").write_text(CONFIG)
    report = tmp_path / "report.json"
    command = [
        sys.executable, "-m", "schemathesis.cli", "--config-file", str(tmp_path / "schemathesis.toml"), "run",
        f"{base_url}/openapi.json", "--checks", CHECKS, "--phases", "examples,coverage,fuzzing,stateful",
        "--max-examples", os.environ.get("TERN_FUZZ_EXAMPLES", "25"), "--seed", os.environ.get("TERN_FUZZ_SEED", "17"),
        "--workers", "1", "--request-timeout", "120", "--generation-database", "none", "--no-color",
        "--report", "json", "--report-json-path", str(report),
    ]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "fuzz_hooks",  # tests/e2e/fuzz_hooks.py: a few tokens per request
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    started = time.monotonic()
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200)
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "fuzz-output.txt").write_text(result.stdout + result.stderr)
    assert report.exists(), result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(report.read_text())
    (ARTIFACTS / "fuzz-report.json").write_text(json.dumps(summary, indent=1))
    print(f"\nschemathesis: {summary['operations']['tested']} of {len(operations)} operations, "
          f"{summary['test_cases']['generated']} test cases, {len(summary['failures'])} failures, "
          f"{len(summary['errors'])} errors, in {time.monotonic() - started:.0f} s (full output: "
          f"test-artifacts/fuzz-output.txt)")
    assert result.returncode == 0 and not summary["failures"] and not summary["errors"], result.stdout[-6000:]
    assert summary["operations"]["tested"] == len(operations)

    # A bug mid-stream would still be a 200 whose last events are an error: the server log names every one.
    log = log_path.read_text(errors="replace")[log_start:]
    assert "unexpected error" not in log and "step failed" not in log and "Traceback" not in log, log[-3000:]
    assert http.get("/health").status_code == 200
    deadline = time.monotonic() + 60
    while any(engine_load(http).values()):  # every aborted or finished request gave its KV blocks back
        assert time.monotonic() < deadline, engine_load(http)
        time.sleep(0.25)
    assert greedy_answers(http) == before


# What the fuzzing found, one test each.
def test_scoring_refuses_an_empty_context_or_continuation_in_any_form(http):
    """`{"prompts": [""], "continuations": [[false]]}` was a 500: an empty text context before token ids, with
    `false` read as token 0, left the continuation's first token without a likelihood."""
    error = error_of(http.post("/v1/loglikelihood", json={"prompts": [""], "continuations": [[False]]}), 400)
    assert (error["param"], error["code"]) == ("continuations[0]", "invalid_type")
    for body, param, says in [
        ({"prompts": [""], "continuations": [[5]]}, "prompts", "context must not be empty"),
        ({"prompts": [[]], "continuations": [" Paris"]}, "prompts", "context must not be empty"),
        ({"prompts": ["The capital of France is"], "continuations": [[]]}, "continuations", "continuation is empty"),
    ]:
        error = error_of(http.post("/v1/loglikelihood", json=body), 400)
        assert error["param"] == param and says in error["message"], (body, error)
    ok = http.post("/v1/loglikelihood", json={"prompts": [[504, 3575]], "continuations": [[30]]})
    assert ok.status_code == 200 and ok.json()["ll"][0] < 0


def test_a_known_path_asked_with_another_method_is_a_405_naming_the_ones_it_serves(http):
    """Such requests fell through to the UI mounted at "/", which answered Gradio's `{"detail": "Not Found"}`
    (HEAD /health, what some load balancers probe with, included)."""
    for method, path, allowed in [
        ("PUT", CHAT, "POST"), ("GET", COMPLETIONS, "POST"), ("TRACE", "/health", "GET, HEAD"),
        ("DELETE", "/v1/models/x", "GET, HEAD"), ("QUERY", "/tokenize", "POST"), ("OPTIONS", "/metrics", "GET, HEAD"),
    ]:
        response = http.request(method, path)
        error = error_of(response, 405)
        assert response.headers["allow"] == allowed and error["code"] == "method_not_allowed", (method, path)
        assert f"{method} {path}" in error["message"]
    head = http.head("/health")
    assert head.status_code == 200 and head.content == b""
    assert error_of(http.request("TRACE", "/v1/audio/speech"), 404)["code"] == "unknown_url"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (COMPLETIONS, {"prompt": [True, False], "max_tokens": 1}, "prompt"),
        (COMPLETIONS, {"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
        (CHAT, {"messages": HI, "logprobs": True, "top_logprobs": False}, "top_logprobs"),
        (CHAT, {"messages": HI, "stream": "true"}, "stream"),
        ("/detokenize", {"tokens": [False]}, "tokens[0]"),
        ("/tokenize", {"prompt": "hi", "add_special_tokens": 0}, "add_special_tokens"),
    ],
    ids=["bools as token ids", "a number in a string", "false as a count", "a string as a flag", "a bool as a token",
         "0 as a flag"],
)
def test_a_value_of_the_wrong_json_type_is_refused_not_converted(http, path, body, param):
    """These were answered 200: `false` taken as 0 (token id 0, no alternatives), `"5"` as 5, `"true"` as true.
    The schema says integer or boolean, and OpenAI refuses them too."""
    error = error_of(http.post(path, json=body), 400)
    assert (error["param"], error["code"]) == (param, "invalid_type")


def test_streaming_routes_document_their_events_as_openapi_tools_read_them(http):
    """The 200 of each streaming route is JSON or an event stream whose `itemSchema` is one event (OpenAPI 3.2's
    form, which FastAPI uses for its own SSE routes): `data` is a chunk or an error as JSON, or [DONE]."""
    paths = http.get("/openapi.json").json()["paths"]
    for path, chunk in ((CHAT, "ChatCompletionChunk"), (COMPLETIONS, "TextCompletion")):
        content = paths[path]["post"]["responses"]["200"]["content"]
        assert set(content) == {"application/json", "text/event-stream"}
        event = content["text/event-stream"]["itemSchema"]
        assert event["required"] == ["data"] and "schema" not in content["text/event-stream"]
        as_json, done = event["properties"]["data"]["anyOf"]
        assert as_json["contentMediaType"] == "application/json" and done == {"const": "[DONE]"}
        assert [s["title"] for s in as_json["contentSchema"]["anyOf"]] == [chunk, "ErrorResponse"]

    schemathesis = pytest.importorskip("schemathesis", reason=NEEDS_SCHEMATHESIS)
    schema = schemathesis.openapi.from_url(f"{http.base_url}/openapi.json")
    for path, body in ((CHAT, {**GREEDY_CHAT, "stream": True, "logprobs": True, "top_logprobs": 2}),
                       (COMPLETIONS, {**GREEDY_COMPLETION, "stream": True, "logprobs": 2,
                                      "stream_options": {"include_usage": True}})):
        case = schema[path]["POST"].Case(body=body)
        response = case.call()
        assert response.headers["content-type"][0].startswith("text/event-stream")
        case.validate_response(response)  # raises, naming the event, if one breaks the documented schema


def test_messages_answers_match_their_documented_schemas(http):
    """/v1/messages documents Anthropic's shapes: the message, each streamed event (`event:` and `data:` lines), and
    errors in Anthropic's envelope, a malformed body's included (FastAPI would have said 422)."""
    schemathesis = pytest.importorskip("schemathesis", reason=NEEDS_SCHEMATHESIS)
    schema = schemathesis.openapi.from_url(f"{http.base_url}/openapi.json")
    paths = http.get("/openapi.json").json()["paths"]
    refs = [paths[path]["post"]["responses"]["400"]["content"]["application/json"]["schema"]["$ref"]
            for path in ("/v1/messages", CHAT)]
    assert refs == ["#/components/schemas/AnthropicErrorResponse", "#/components/schemas/ErrorResponse"]
    model = http.get("/v1/models").json()["data"][0]["id"]
    body = {"model": model, "max_tokens": 4, "messages": HI, "temperature": 0}
    for case_body in (body, {**body, "stream": True}, {"model": model, "messages": HI}):
        case = schema["/v1/messages"]["POST"].Case(body=case_body)
        response = case.call()
        case.validate_response(response)
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    # Another method is a 405 naming the one served, another path under /v1/messages a 404: in the same envelope.
    for method, path, status, kind in [("GET", "/v1/messages/count_tokens", 405, "invalid_request_error"),
                                       ("DELETE", "/v1/messages/msg_1", 404, "not_found_error")]:
        response = http.request(method, path)
        assert response.status_code == status and response.json()["error"]["type"] == kind, response.text
    assert response.status_code == 404 and http.get("/v1/messages").headers["allow"] == "POST"
